"""Write ``tests/durations.txt`` (the order pytest-xdist starts tests in: tests/conftest.py's
``scheduling_order``) from a per-test account: ``TFDP_TEST_CPU=cpu.jsonl pytest``, then
``python tests/durations.py cpu.jsonl``. Tests under 2 s are left out (they count 0.5 s)."""

import json
import os
import sys

MIN_SECONDS = 2.0
HEADER = """\
# Wall seconds of the tests that took 2 s or more in one measured run, longest first: the order
# pytest-xdist starts them in (tests/conftest.py, scheduling_order). Regenerate it after a
# change of the suite: TFDP_TEST_CPU=cpu.jsonl pytest && python tests/durations.py cpu.jsonl
"""


def main(argv):
    if len(argv) != 1:
        print("Invalid arguments: expected one per-test account (a TFDP_TEST_CPU file). "
              f"Received: {argv}. Fix: python tests/durations.py cpu.jsonl", file=sys.stderr)
        return 2
    walls = {}
    with open(argv[0], encoding="utf-8") as f:
        for line in f:
            entry = json.loads(line)
            walls[entry["id"]] = entry["wall"]
    kept = sorted(((w, n) for n, w in walls.items() if w >= MIN_SECONDS), reverse=True)
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write(HEADER)
        f.writelines(f"{w:.1f} {n}\n" for w, n in kept)
    print(f"{path}: {len(kept)} tests of {len(walls)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

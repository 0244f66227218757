"""The two-line change is two added lines: ``import tfdp`` and ``tfdp.set_default_strategy()``.

A single-device Keras script and its data-parallel twin differ by exactly two ADDED lines (nothing
removed, nothing re-indented, no ``with strategy.scope():`` block); both run, the twin on 4 CPU
replicas, and it trains the same model as one device (same weights to float32 round-off; the
examples' model uses BatchNormalization(synchronized=True): plain BatchNorm would keep Keras's
per-replica batch statistics). Each script runs in a fresh process (hard timeouts).
"""

import difflib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _added_only(single: list, twin: list) -> list:
    """The lines ``twin`` adds to ``single``; fails when any line is removed or changed."""
    ops = difflib.SequenceMatcher(a=single, b=twin, autojunk=False).get_opcodes()
    added = []
    for tag, i1, i2, j1, j2 in ops:
        assert tag in ("equal", "insert"), (tag, single[i1:i2], twin[j1:j2])
        if tag == "insert":
            added.extend(twin[j1:j2])
    return added


def _run(path, replicas=None, timeout=150, args=()):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CONFIG", None)
    env.pop("TFDP_CPU_REPLICAS", None)
    if replicas:
        env["TFDP_CPU_REPLICAS"] = str(replicas)
    p = subprocess.run([sys.executable, path, "--epochs", "2", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=timeout, env=env,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p.stdout


def _lines(name):
    with open(os.path.join(EXAMPLES, name), encoding="utf-8") as f:
        return f.read().splitlines()


def test_the_examples_twin_adds_exactly_two_lines():
    added = _added_only(_lines("workstation_vision_single.py"), _lines("workstation_vision_dp.py"))
    assert len(added) == 2, added
    assert added[0] == "import tfdp"
    assert added[1].split("#")[0].strip() == "tfdp.set_default_strategy()"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_examples_twins_train_the_same_weights(run_process, tmp_path):
    """The README's pair (BatchNormalization(synchronized=True), batches of 256 on 1,437
    examples: the last one uneven across 4 replicas) trains one device's weights."""
    single = _run(os.path.join(EXAMPLES, "workstation_vision_single.py"),
                  args=("--save-weights", str(tmp_path / "single.npz")))
    dp = _run(os.path.join(EXAMPLES, "workstation_vision_dp.py"), replicas=4,
              args=("--save-weights", str(tmp_path / "dp.npz")))
    assert "1 replica(s)" in single and "DataParallelStrategy: 4 replica(s)" in dp, (single, dp)
    for out in (single, dp):
        acc = float(out.rsplit("test accuracy ", 1)[1].split(",")[0])
        assert acc > 0.5, out       # 2 epochs: learning, well above chance (0.1)
    one, many = np.load(tmp_path / "single.npz"), np.load(tmp_path / "dp.npz")
    assert len(one.files) == len(many.files) > 0
    diff = max(float(np.max(np.abs(one[k] - many[k]))) for k in one.files)
    print(f"examples' twin on 4 CPU replicas vs one device: max |dw| = {diff:.2e}")
    assert diff <= 1e-5


# A single-device script without BatchNorm: its twin must give the same weights.
SINGLE = '''\
import argparse
import json

import keras
import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

rng = np.random.default_rng(0)
x = rng.normal(size=(210, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 1))).astype("float32")

keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(1)])
model.compile(keras.optimizers.Adam(1e-2), "mse")
history = model.fit(x, y, batch_size=52, epochs=args.epochs, verbose=0)   # uneven last batch

import tensorflow as tf
print("RESULT", json.dumps({
    "replicas": tf.distribute.get_strategy().num_replicas_in_sync,
    "strategy": type(model.distribute_strategy).__name__,
    "loss": history.history["loss"],
    "weights": [w.tolist() for w in model.get_weights()]}))
'''


def _twin(single: str) -> str:
    """The two-line change, applied as a user would: two lines added, nothing else touched."""
    lines = single.splitlines()
    lines.insert(lines.index("import numpy as np") + 1, "import tfdp")
    lines.insert(lines.index("keras.utils.set_random_seed(1)"), "tfdp.set_default_strategy()")
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(300)
def test_two_added_lines_train_the_same_weights_as_one_device(run_process, tmp_path):
    single_path, twin_path = tmp_path / "single.py", tmp_path / "twin.py"
    single_path.write_text(SINGLE)
    twin_path.write_text(_twin(SINGLE))
    added = _added_only(SINGLE.splitlines(), twin_path.read_text().splitlines())
    assert added == ["import tfdp", "tfdp.set_default_strategy()"]

    def result(out):
        (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        return json.loads(line[len("RESULT "):])

    one = result(_run(str(single_path)))
    dp = result(_run(str(twin_path), replicas=4))
    assert one["replicas"] == 1 and dp["replicas"] == 4
    assert dp["strategy"] == "DataParallelStrategy"
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(one["weights"], dp["weights"]))
    print(f"two-line twin on 4 CPU replicas vs one device: max |dw| = {diff:.2e}")
    assert diff <= 1e-5
    np.testing.assert_allclose(dp["loss"], one["loss"], rtol=1e-5)


@pytest.mark.timeout(120)
def test_set_default_strategy_errors_are_clear(run_process):
    code = '''
import tfdp, tensorflow as tf
s = tfdp.DataParallelStrategy()
for call in (lambda: tfdp.set_default_strategy(s, all_reduce="ring"),
             lambda: tfdp.set_default_strategy("mirrored")):
    try:
        call()
    except ValueError as e:
        print("ERR", e)
with s.scope():
    try:
        tfdp.set_default_strategy()
    except ValueError as e:
        print("ERR", e)
print("SAME", tfdp.set_default_strategy(s) is s and tf.distribute.get_strategy() is s)
print("AGAIN", type(tfdp.set_default_strategy(all_reduce="ring")).__name__)
'''
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               TFDP_CPU_REPLICAS="2")
    env.pop("TF_CONFIG", None)
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=110, env=env)
    errs = [ln[4:] for ln in p.stdout.splitlines() if ln.startswith("ERR ")]
    assert len(errs) == 3, p.stdout + p.stderr[-3000:]
    assert "either a strategy or DataParallelStrategy arguments" in errs[0]
    assert "Expected a tf.distribute.Strategy" in errs[1] and "'mirrored'" in errs[1]
    assert "inside a `with strategy.scope():` block" in errs[2] and "Received:" in errs[2]
    assert "SAME True" in p.stdout and "AGAIN DataParallelStrategy" in p.stdout, p.stdout


# --- one line at strategy creation says what the program runs on (issue 23, point 2) -----------

def _script(code, env_extra=None):
    import textwrap
    env = {k: v for k, v in os.environ.items() if k not in ("TFDP_CPU_REPLICAS", "TF_CONFIG")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=150, env=env)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup, expected", [
    ("", "tfdp: DataParallelStrategy: 1 replica on CPU:0, 1 worker; for n CPU replicas set "
         "TFDP_CPU_REPLICAS=n"),
    ("ENV", "tfdp: DataParallelStrategy: 3 replicas on CPU:0, CPU:1, CPU:2 (TFDP_CPU_REPLICAS=3),"
            " 1 worker; all_reduce 'fused'"),
    ("import logging; logging.getLogger('tfdp').setLevel(logging.WARNING)", None),
    ("import logging; logging.basicConfig(level=logging.INFO, format='LOG %(message)s')",
     "LOG tfdp: DataParallelStrategy: 1 replica on CPU:0"),
])
def test_the_two_line_script_says_what_it_runs_on_once(run_process, setup, expected):
    r = _script(f"""
        {setup if setup != "ENV" else ""}
        import tfdp
        tfdp.set_default_strategy()
        tfdp.set_default_strategy()     # a second strategy: no second line
        print("DONE")
    """, {"TFDP_CPU_REPLICAS": "3"} if setup == "ENV" else None)
    assert "DONE" in r.stdout, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if "DataParallelStrategy:" in ln]
    if expected is None:
        assert lines == [], r.stderr
    elif expected.startswith("LOG"):
        assert lines and lines[0].startswith(expected), r.stderr   # their logging decides
    else:
        assert len(lines) == 1 and lines[0].startswith(expected), r.stderr


def test_the_line_names_workers_and_devices(cpu_devices):
    import tfdp
    from tfdp.strategy.announce import device_list, strategy_line
    line = strategy_line(tfdp.DataParallelStrategy())
    assert line.startswith("tfdp: DataParallelStrategy: 4 replicas on CPU:0..CPU:3 "), line
    assert "1 worker; all_reduce 'fused'" in line, line
    assert device_list(["GPU:0", "GPU:2"]) == "GPU:0, GPU:2"

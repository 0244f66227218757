"""The README's ``pytest``, as written, is the fast run: pytest-xdist on by default, a serial
test alone while it runs (tests/conftest.py), the worker count from the CPUs (issue 33)."""

import configparser
import os
import threading
import time
import types
import uuid

import pytest

import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plain_pytest_runs_in_xdist_workers_with_the_suites_scheduling():
    ini = configparser.ConfigParser()
    ini.read(os.path.join(ROOT, "pytest.ini"))
    opts = ini["pytest"]["addopts"].split()
    assert "-n" in opts and opts[opts.index("-n") + 1] == "auto", opts
    assert "--dist" in opts and opts[opts.index("--dist") + 1] == "loadgroup", opts


def test_auto_worker_count_follows_the_cpus_capped(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)))
    assert conftest.pytest_xdist_auto_num_workers(None) in (1, 2)   # (1: under 6 GB free)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert 1 <= conftest.pytest_xdist_auto_num_workers(None) <= 8
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert conftest.pytest_xdist_auto_num_workers(None) is None     # xdist's own hook reads it


def _item(runuid, serial, nodeid="tests/test_x.py::test", e2e=True):
    """A stand-in for a test item: e2e (it waits for a serial test) unless ``e2e=False``."""
    markers = {"serial": serial, "e2e": serial or e2e}
    return types.SimpleNamespace(
        config=types.SimpleNamespace(workerinput={"testrunuid": runuid}), nodeid=nodeid,
        get_closest_marker=lambda name: object() if markers.get(name) else None)


def _run_as_workers(runuid, threads):
    """Run threads standing in for xdist workers to the end; remove the run's lock files."""
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a lock was never released"
    finally:
        for path in conftest._lock_paths(runuid):
            if os.path.exists(path):
                os.unlink(path)


def test_a_serial_test_waits_for_running_tests_and_runs_alone():
    """Threads stand in for xdist workers (each opens its own lock files, as a process does):
    a serial test waits until the running test ends; an e2e test that starts while it waits or
    runs waits until it ends; two ordinary tests run side by side."""
    runuid = uuid.uuid4().hex
    events, lock = [], threading.Lock()

    def run(name, serial, hold, start_after=0.0):
        time.sleep(start_after)
        with conftest._alone_if_serial(_item(runuid, serial)):
            with lock:
                events.append(("start", name))
            time.sleep(hold)
            with lock:
                events.append(("end", name))

    _run_as_workers(runuid, [threading.Thread(target=run, args=a) for a in (
        ("a", False, 0.6),           # running when the serial test comes
        ("b", False, 0.6, 0.1),      # beside a
        ("serial", True, 0.5, 0.3),  # waits for a and b
        ("c", False, 0.1, 0.45),     # comes while serial waits: after serial
    )])
    order = [f"{kind} {name}" for kind, name in events]
    assert order.index("start b") < order.index("end a"), order          # side by side
    s, e = order.index("start serial"), order.index("end serial")
    assert e == s + 1, order                                              # alone
    assert s > order.index("end a") and s > order.index("end b"), order  # after the running
    assert order.index("start c") > e, order                              # then the queue


def test_without_xdist_nothing_is_locked():
    item = types.SimpleNamespace(config=types.SimpleNamespace(),
                                 get_closest_marker=lambda name: pytest.fail("looked up"))
    with conftest._alone_if_serial(item):
        pass


def test_the_serial_block_runs_alone_from_its_first_serial_test_to_its_last():
    """One worker runs the SERIAL modules' tests (one scheduling group, SERIAL_BLOCK): after its
    first serial test it keeps the others out through the block's next tests, serial or not,
    and lets them in after the last; a test of another worker waits once, for all of it."""
    runuid = uuid.uuid4().hex
    events, lock = [], threading.Lock()
    released = []
    block = [_item(runuid, serial, f"{conftest.SERIAL[0]}test_{i}")
             for i, serial in enumerate((True, False, True))]

    def note(what):
        with lock:
            events.append(what)

    def block_worker():
        for item, nextitem in zip(block, block[1:] + [None]):
            with conftest._alone_if_serial(item, nextitem):
                note(f"start {item.nodeid[-6:]}")
                time.sleep(0.2)
                note(f"end {item.nodeid[-6:]}")
        released.append(conftest._HOLDING.room is None)

    def other_worker():
        time.sleep(0.1)  # starts while the block's first test runs
        with conftest._alone_if_serial(_item(runuid, False)):
            note("start other")

    _run_as_workers(runuid, [threading.Thread(target=block_worker),
                             threading.Thread(target=other_worker)])
    assert events[-1] == "start other", events           # after the whole block
    assert events[:-1] == [f"{k} test_{i}" for i in range(3) for k in ("start", "end")], events
    assert released == [True], "the block worker still holds the room"


def test_the_serial_modules_are_one_scheduling_group():
    for prefix in conftest.SERIAL:
        assert conftest.shared_setup_group(prefix + "test_any") == conftest.SERIAL_BLOCK
    assert conftest.shared_setup_group("tests/test_keras.py::test_any") is None


def test_the_cpu_account_writes_one_line_per_test(monkeypatch, tmp_path):
    import json
    path = tmp_path / "cpu.jsonl"
    with conftest._cpu_account(types.SimpleNamespace(nodeid="tests/test_x.py::test_a")):
        pass  # (TFDP_TEST_CPU unset: nothing written)
    assert not path.exists()
    monkeypatch.setenv("TFDP_TEST_CPU", str(path))
    for name in ("test_a", "test_b"):
        with conftest._cpu_account(types.SimpleNamespace(nodeid=f"tests/test_x.py::{name}")):
            sum(i * i for i in range(200_000))  # some CPU time of this process
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert [ln["id"] for ln in lines] == ["tests/test_x.py::test_a", "tests/test_x.py::test_b"]
    assert all(ln["self"] > 0 and ln["children"] >= 0 and ln["wall"] > 0 for ln in lines), lines
    assert lines[0]["start"] <= lines[1]["start"], lines  # (wall-clock start times, in order)
    assert all(ln["worker"] == os.environ.get("PYTEST_XDIST_WORKER", "") for ln in lines), lines


def test_a_core_test_runs_at_nice_19_beside_the_serial_block():
    """Where the workers may raise their priority again (root, CAP_SYS_NICE): a core-tier test
    that starts while a serial test runs starts at once, with every thread of its process at
    nice 19, and its threads are back at their nice values after it; an e2e test still waits."""
    if not conftest._can_renice():
        pytest.skip("this process may not lower a nice value again (not root, no CAP_SYS_NICE)")
    runuid = uuid.uuid4().hex
    events, lock, nices = [], threading.Lock(), {}

    def note(what):
        with lock:
            events.append(what)

    def serial():
        with conftest._alone_if_serial(_item(runuid, True, conftest.SERIAL[0] + "test_s")):
            note("start serial")
            time.sleep(0.6)
            note("end serial")

    def core():
        time.sleep(0.2)
        tid = threading.get_native_id()
        nices["before"] = os.getpriority(os.PRIO_PROCESS, tid)
        with conftest._alone_if_serial(_item(runuid, False, e2e=False)):
            note("start core")
            nices["during"] = os.getpriority(os.PRIO_PROCESS, tid)
        nices["after"] = os.getpriority(os.PRIO_PROCESS, tid)

    def e2e():
        time.sleep(0.2)
        with conftest._alone_if_serial(_item(runuid, False)):
            note("start e2e")

    _run_as_workers(runuid, [threading.Thread(target=f) for f in (serial, core, e2e)])
    assert events.index("start core") < events.index("end serial"), events   # beside it
    assert events.index("start e2e") > events.index("end serial"), events    # after it
    assert nices["during"] == conftest.NICE_BESIDE_SERIAL, nices
    assert nices["after"] == nices["before"], nices


def test_tests_start_serial_block_first_then_the_longest_scopes():
    ids = ["tests/test_a.py::t1", "tests/test_a.py::t2",
           conftest.SERIAL[1] + "test_x", "tests/test_b.py::t",
           "tests/test_ray.py::t1", "tests/test_ray.py::t2"]  # (the last two: one scope)
    durations = {"tests/test_a.py::t2": 9.0, "tests/test_b.py::t": 5.0,
                 "tests/test_ray.py::t1": 3.0, "tests/test_ray.py::t2": 3.0}
    order = [ids[i] for i in conftest.scheduling_order(ids, durations)]
    assert order == [conftest.SERIAL[1] + "test_x", "tests/test_a.py::t2",
                     "tests/test_ray.py::t1", "tests/test_ray.py::t2", "tests/test_b.py::t",
                     "tests/test_a.py::t1"], order  # (t1: unmeasured, DEFAULT_DURATION)


def test_the_durations_file_reads_and_names_tests_of_the_suite():
    durations = conftest.load_durations()
    assert len(durations) > 100 and all(s >= 2.0 for s in durations.values())
    assert all(n.startswith("tests/test_") and "::" in n for n in durations), list(durations)[:5]
    assert conftest.load_durations(os.path.join(ROOT, "no-such-file")) == {}

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


def _item(runuid, serial):
    marker = object() if serial else None
    return types.SimpleNamespace(
        config=types.SimpleNamespace(workerinput={"testrunuid": runuid}),
        get_closest_marker=lambda name: marker if name == "serial" else None)


def test_a_serial_test_waits_for_running_tests_and_runs_alone():
    """Threads stand in for xdist workers (each opens its own lock files, as a process does):
    a serial test waits until the running test ends; a test that starts while it waits or runs
    waits until it ends; two ordinary tests run side by side."""
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

    threads = [threading.Thread(target=run, args=a) for a in (
        ("a", False, 0.6),           # running when the serial test comes
        ("b", False, 0.6, 0.1),      # beside a
        ("serial", True, 0.5, 0.3),  # waits for a and b
        ("c", False, 0.1, 0.45),     # comes while serial waits: after serial
    )]
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

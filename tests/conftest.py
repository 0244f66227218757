"""Test set-up: CPU replicas, the test tiers, and the guard that keeps the tiers honest.

CPU replicas: the host CPU is split into 4 logical devices once per test process. This must run
before TensorFlow initialises its runtime, so it happens at import of this conftest (pytest
imports it before any test module).

Tiers (``pytest -m "not e2e"`` is the core tier, ``pytest -m e2e`` the rest; plain ``pytest``
runs both):

- ``e2e``: the test starts a process (a worker cluster, the launcher, ``python -m tfdp ...``, a
  browser, ``ip netns``, Ray). It is applied here, automatically, to every test whose fixtures
  include one of :data:`PROCESS_FIXTURES` (directly, through ``usefixtures``, or through another
  fixture) -- never by hand. ``multiprocess`` is kept as an alias of ``e2e`` (applied with it).
- ``slow``: full README runs, network-namespace jobs, fault trials, long benchmark runs (by hand,
  or here in :data:`SLOW`).
- ``serial``: e2e tests that run while no other test runs (:data:`SERIAL`).

Plain ``pytest`` runs in pytest-xdist workers (pytest.ini: ``-n auto --dist loadgroup``; one
worker per CPU, :func:`pytest_xdist_auto_num_workers`; ``-n 0`` for one process): tests sharing an
expensive set-up (a module-scoped fixture, a memo of reference fits) stay in one worker
(:data:`SHARED_SETUP`, scheduled by :func:`pytest_xdist_make_scheduler`), and a serial test waits
until no other test runs, in any worker, and runs alone (:func:`_alone_if_serial`); the SERIAL
modules are one group (:data:`SERIAL_BLOCK`) that runs alone from its first serial test to its
last, so the others wait for it once, or run their core-tier tests at nice 19 beside it where they
may (root). Scopes start longest first (:func:`scheduling_order`, ``tests/durations.txt``).

The guard: in a test that is not ``e2e``, starting a process (``subprocess``, ``os.fork`` /
``os.system`` / ``os.posix_spawn``, ``multiprocessing``) fails the test with a message naming the
fixture to use, so a core-tier test can never start a process unnoticed. A test marked
``multiprocess`` or ``e2e`` by hand without a process fixture is a collection error.
"""

import contextlib
import fcntl
import os
import tempfile
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # tests are CPU-only, also on GPU hosts

import multiprocessing.process  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

import tfdp  # noqa: E402

tfdp.configure_cpu_replicas(4)  # before any test can start the TF runtime

#: Fixtures that start processes: a test using any of them (or a fixture that does) is ``e2e``.
PROCESS_FIXTURES = ("run_process", "worker_job")

#: ``slow`` besides the tests marked by hand: network namespaces and fault trials (node id
#: prefixes). (The README's full runs and the long benchmark runs are marked where they are.)
SLOW = (
    "tests/test_netns.py::",                                       # two hosts in namespaces
    "tests/test_faults.py::test_kill_detect_and_kill_in_write_end_to_end",  # fault trials
    "tests/test_failures.py::test_dead_worker_ends_the_job_with_its_name_and_address",
    "tests/test_failures.py::test_stopped_worker_is_detected_and_named",
    "tests/test_failures.py::test_a_slow_step_is_not_a_failure",
)

#: e2e tests that run alone (``serial``): under pytest-xdist no other test runs beside one
#: (:func:`_alone_if_serial`). They assert how fast the launcher or a worker reacts, use network
#: namespaces, or run the README's commands in the repository root.
SERIAL = (
    "tests/test_failures.py::",   # seconds from a failure to the end of the job
    "tests/test_startup.py::",    # start-up deadlines and signals, timed
    "tests/test_launch.py::",     # first output within seconds, a lost node within 10 s
    "tests/test_faults.py::",     # fault trials: kill, detect, restart, timed
    "tests/test_netns.py::",      # root, network namespaces
    "tests/test_readme.py::",     # the README's commands as written, in the repository root
)


#: Under pytest-xdist with ``--dist loadgroup`` (pytest.ini's default), tests that share an
#: expensive set-up run in one worker, which computes it once instead of once per worker: node id
#: regex -> group (``{0}``: the regex's first group). The scheduler below sends each group to one
#: worker as a unit (largest first), every other test on its own. (Not xdist's own
#: ``xdist_group`` marks: xdist 3.8 renames ``item._nodeid``, which pytest 9 no longer reads.)
SHARED_SETUP = (
    # module-scoped fixtures (SHARED_FIXTURES checks that every test using one is listed here)
    (r"tests/test_callbacks_backup\.py::test_(?:resume_mid_epoch_equals_uninterrupted"
     r"|epoch_save_freq_plain_fit_drop_in)$", "test_callbacks_backup-reference"),
    (r"tests/test_input_kinds\.py::test_(?:input_kind_is_exact_and_never_modified\["
     r"|single_device_reference_sees_the_same_batches\["
     r"|no_numpy_alias_makes_a_distributed_generator_exact$)", "test_input_kinds-reference"),
    (r"tests/test_monitor\.py::", "test_monitor-trained"),
    (r"tests/test_zero_checkpoint\.py::test_restore_elsewhere_and_continue\[",
     "test_zero_checkpoint-saved"),
    # a module's memo of reference fits, the session's one_device fixture
    (r"tests/test_zero\.py::test_optimizer_sharded_equals_one_device\[(\w+)-stage\d\]",
     "test_zero-reference-{0}"),
    (r"tests/test_resume_dropin\.py::test_(?:dropin_resume_equals_uninterrupted\[shuffled-"
     r"|resumed_epoch_metrics_and_progress$)", "test_resume_dropin-reference-shuffled"),
    (r"tests/test_elastic\.py::test_a_backup_resumes_exactly_on_another_replica_count\[",
     "test_elastic-one_device"),
    (r"tests/test_keras\.py::test_fit_equals_single_device\[\d-(\w+)\]",
     "test_keras-one_device-fit-{0}"),
    (r"tests/test_combinations\.py::test_(?:combination_equals_one_device\["
     r"|the_features_change_the_result$|two_workers_equal_one_device$)",
     "test_combinations-reference"),  # (a feature's reference: at 3 zero stages, in its pairs)
    (r"tests/test_compat_features\.py::test_(?:the_run_stays_exact_with_the_feature_off\["
     r"|reference_weights_are_not_all_equal$)", "test_compat_features-reference"),
    (r"tests/test_micro_batches\.py::test_micro_batches_train_like_one_device\[(\w+)-",
     "test_micro_batches-reference-{0}"),
    (r"tests/test_sparse\.py::test_keras_fit_with_embedding_equals_single_device\[\w+-(\w+)\]",
     "test_sparse-reference-{0}"),
    # the user-pattern rows' single-device runs (test_user_patterns.shared_reference)
    (r"tests/test_user_patterns\.py::test_row_equals_single_device\[(\w+)\]",
     "pattern-reference-{0}"),
    (r"tests/test_user_patterns\.py::test_reference_is_deterministic$()",
     "pattern-reference-two_optimizers"),
    (r"tests/test_zero\.py::test_pattern_rows_sharded\[(\w+)-stage\d\]",
     "pattern-reference-{0}"),
    # one local Ray cluster at a time: the example starts its own, then the module's starts (two
    # at once leave Ray's processes that connect by auto-detection unable to choose: CI failed on
    # 'Found multiple active Ray instances')
    (r"tests/test_ray(?:_elastic)?\.py::", "test_ray-cluster"),
    (r"tests/test_slurm\.py::", "test_slurm-cluster"),  # one SLURM cluster, started once
)
#: The module-scoped fixtures SHARED_SETUP groups by: a test using one that no pattern matches is
#: a collection error (so a renamed or new test cannot silently compute it again in each worker).
SHARED_FIXTURES = {
    "tests/test_callbacks_backup.py": "reference",    # the uninterrupted run
    "tests/test_input_kinds.py": "reference",         # the one-device fit
    "tests/test_monitor.py": "trained",               # a trained model
    "tests/test_zero_checkpoint.py": "saved",         # checkpoints of a sharded run (and the
    "tests/test_ray.py": "ray_cluster",               # uninterrupted run, with it); the local
    "tests/test_slurm.py": "slurm",                   # Ray cluster; the one-host SLURM cluster
    "tests/test_ray_elastic.py": "two_node_cluster",  # a local multi-node Ray cluster
}


#: The scheduling group of the SERIAL modules' tests: one worker runs them one after another, and
#: a serial test followed by another test of the block keeps the others waiting
#: (:func:`_alone_if_serial`), so the room drains once for the block, not once per serial test
#: (each drain left a CPU idle until the other worker's running test ended).
SERIAL_BLOCK = "serial-block"


def shared_setup_group(nodeid):
    """The group of a test that shares an expensive set-up (SHARED_SETUP), SERIAL_BLOCK for a
    test of a SERIAL module, else None."""
    if nodeid.startswith(SERIAL):
        return SERIAL_BLOCK
    for pattern, group in SHARED_SETUP:
        match = re.match(pattern, nodeid)
        if match:
            return group.format(*match.groups())
    return None


def scope_of(nodeid):
    """The scheduling unit of a test: its SHARED_SETUP group (or SERIAL_BLOCK), else itself."""
    return shared_setup_group(nodeid) or nodeid


#: Measured wall seconds of the tests that took 2 s or more (``tests/durations.txt``, written by
#: ``python tests/durations.py cpu.jsonl`` from a ``TFDP_TEST_CPU`` account); any other test
#: counts DEFAULT_DURATION. Only the order tests start in depends on them.
DURATIONS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.txt")
DEFAULT_DURATION = 0.5


def load_durations(path=DURATIONS_FILE):
    """{node id: seconds} from ``path`` ("seconds node-id" lines, # comments); {} without it."""
    durations = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip() and not line.startswith("#"):
                    seconds, _, nodeid = line.rstrip("\n").partition(" ")
                    durations[nodeid] = float(seconds)
    except OSError:
        pass
    return durations


def scheduling_order(nodeids, durations):
    """The positions of ``nodeids`` in the order pytest-xdist hands out their scopes
    (SharedSetupScheduling keeps it): the serial block first (the other workers run core-tier
    tests at a low priority beside it: :func:`_alone_if_serial`), then the scopes by their
    measured seconds, longest first, so that no long test starts last and runs alone at the
    end; a scope's tests in their order."""
    scopes = [scope_of(nodeid) for nodeid in nodeids]
    cost, first = {}, {}
    for i, (nodeid, scope) in enumerate(zip(nodeids, scopes)):
        cost[scope] = cost.get(scope, 0.0) + durations.get(nodeid, DEFAULT_DURATION)
        first.setdefault(scope, i)
    return sorted(range(len(nodeids)), key=lambda i: (
        scopes[i] != SERIAL_BLOCK, -cost[scopes[i]], first[scopes[i]], i))


@pytest.hookimpl(optionalhook=True)  # (a pytest-xdist hook: unknown when xdist is missing)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup``: xdist's scope scheduler with SHARED_SETUP's groups as the scopes
    (each other test a scope of its own), handed out in the workers' collection order, which
    :func:`scheduling_order` sorted (not by their test counts: xdist's loadscope reordering)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedSetupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return scope_of(nodeid)

    config.option.loadscopereorder = False
    return SharedSetupScheduling(config, log)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "e2e: starts processes (applied automatically by tests/conftest.py to tests "
        "using the run_process / worker_job fixtures; deselect with -m 'not e2e')")
    config.addinivalue_line("markers", "multiprocess: alias of e2e (applied with it)")
    config.addinivalue_line(
        "markers", "serial: e2e tests that run alone, also under pytest-xdist (timed, "
        "namespaces, README runs; tests/conftest.py's SERIAL)")
    config.addinivalue_line(
        "markers", "slow: full README runs, network namespaces, fault trials, long benchmark "
        "runs (deselect with -m 'not slow')")
    _install_guard()


def _uses_process_fixture(item) -> bool:
    return any(name in PROCESS_FIXTURES for name in getattr(item, "fixturenames", ()))


def _unlisted_shared_fixture(item) -> bool:
    fixture = SHARED_FIXTURES.get(item.nodeid.partition("::")[0])
    return (fixture is not None and fixture in getattr(item, "fixturenames", ())
            and shared_setup_group(item.nodeid) is None)


def pytest_collection_modifyitems(session, config, items):
    unlisted = [item.nodeid for item in items if _unlisted_shared_fixture(item)]
    if unlisted:
        raise pytest.UsageError(
            "Tests using a shared module-scoped fixture (tests/conftest.py's SHARED_FIXTURES) "
            f"must be in a SHARED_SETUP group. Received {len(unlisted)} unlisted: "
            f"{', '.join(unlisted[:10])}. Fix: extend the module's pattern in SHARED_SETUP.")
    errors = []
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
        if _uses_process_fixture(item):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.multiprocess)
            if item.nodeid.startswith(SERIAL):
                item.add_marker(pytest.mark.serial)
        elif item.get_closest_marker("e2e") or item.get_closest_marker("multiprocess"):
            errors.append(item.nodeid)
    if errors:
        raise pytest.UsageError(
            "Tests marked 'e2e' or 'multiprocess' by hand must use a process fixture instead "
            f"(one of {', '.join(PROCESS_FIXTURES)}; tests/conftest.py marks them). Received "
            f"{len(errors)} such test(s): {', '.join(errors[:10])}. Fix: drop the marker and "
            "add the fixture as an argument (or pytest.mark.usefixtures).")
    if getattr(config, "workerinput", None) is not None:  # (an xdist worker: see the scheduler)
        order = scheduling_order([item.nodeid for item in items], load_durations())
        items[:] = [items[i] for i in order]


# --- the guard ----------------------------------------------------------------------------------

_GUARD = {"blocked": None}  # the nodeid of the running core-tier test, else None


class ProcessStartInCoreTest(RuntimeError):
    pass


def _refuse(what):
    nodeid = _GUARD["blocked"]
    if nodeid is not None:
        raise ProcessStartInCoreTest(
            f"A core-tier test started a process. Received: {what} in {nodeid}, which uses none "
            f"of the process fixtures ({', '.join(PROCESS_FIXTURES)}). Fix: add the "
            "'run_process' fixture (or 'worker_job' for jobs of workers) to the test's arguments: "
            "tests/conftest.py then marks it 'e2e' and allows it.")


def _install_guard():
    if getattr(subprocess.Popen, "_tfdp_guarded", False):
        return
    popen_execute = subprocess.Popen._execute_child

    def _execute_child(self, args, *a, **kw):
        _refuse(f"subprocess {args!r:.200}")
        return popen_execute(self, args, *a, **kw)

    subprocess.Popen._execute_child = _execute_child
    subprocess.Popen._tfdp_guarded = True

    start = multiprocessing.process.BaseProcess.start

    def _start(self):
        _refuse(f"multiprocessing {self!r}")
        return start(self)

    multiprocessing.process.BaseProcess.start = _start

    for name in ("fork", "forkpty", "system", "posix_spawn", "posix_spawnp", "spawnv",
                 "spawnve", "spawnvp", "spawnvpe", "execv", "execve"):
        original = getattr(os, name, None)
        if original is None:
            continue

        def _wrapped(*a, _original=original, _name=name, **kw):
            _refuse(f"os.{_name}{tuple(map(str, a))!r:.200}")
            return _original(*a, **kw)

        setattr(os, name, _wrapped)


# --- serial tests under pytest-xdist ------------------------------------------------------------

def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pytest.ini's default): one worker per CPU this process may use, at most 8 and
    one per 3 GB of available memory (an e2e test's workers are TensorFlow processes of their
    own); ``PYTEST_XDIST_AUTO_NUM_WORKERS`` overrides it, as in pytest-xdist."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # (pytest-xdist's own hook reads it)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            avail = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        by_memory = max(1, avail // (3 * 1024 * 1024))
    except (OSError, StopIteration, ValueError):
        by_memory = 8
    return max(1, min(cpus or 1, 8, by_memory))


_SERIAL_LOCKS = []  # the controller's lock files, removed when the run ends


def _lock_paths(testrunuid):
    base = os.path.join(tempfile.gettempdir(), f"tfdp-pytest-{testrunuid}")
    return base + ".gate", base + ".room"


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):  # (pytest-xdist, in the controller: one call per worker)
    paths = _lock_paths(node.workerinput["testrunuid"])
    if paths not in _SERIAL_LOCKS:
        _SERIAL_LOCKS.append(paths)


def pytest_unconfigure(config):
    for paths in _SERIAL_LOCKS:
        for path in paths:
            try:
                os.unlink(path)
            except OSError:
                pass


class _Holding(threading.local):  # (per thread: the scheduling tests' threads stand in for workers)
    room = None  # this worker's room and gate while it runs the serial block alone


_HOLDING = _Holding()


def _in_serial_block(item):
    return item is not None and item.nodeid.startswith(SERIAL)


@contextlib.contextmanager
def _alone_if_serial(item, nextitem=None):
    """Under pytest-xdist, a ``serial`` test runs while no other test does at the normal
    priority, in any worker; the others run side by side. Two file locks shared by the run's
    workers: the room, held shared by every running test and exclusively by a serial one, and a
    gate before it that a serial test holds while it waits, so that tests starting meanwhile
    queue behind it instead of keeping the room busy for ever. When the next test of this
    worker is of the serial block (SERIAL_BLOCK: the SERIAL modules, scheduled to one worker),
    the room and the gate stay held for it: the block runs alone from its first serial test to
    its last, and the other workers wait once, not once per serial test. Meanwhile, where the
    workers may raise their threads' priority again (root, CAP_SYS_NICE: :func:`_can_renice`),
    their core-tier tests run at nice 19 beside it instead of waiting (:func:`_shared_room`):
    they take only the CPU time the serial tests leave. Without pytest-xdist, tests run one at
    a time anyway."""
    workerinput = getattr(item.config, "workerinput", None)
    if workerinput is None:
        yield
        return
    if _HOLDING.room is None:
        if not item.get_closest_marker("serial"):
            beside = not item.get_closest_marker("e2e") and _can_renice()
            with _shared_room(workerinput["testrunuid"], niced_beside_serial=beside):
                yield
            return
        _HOLDING.room = _exclusive_room(workerinput["testrunuid"])
    try:
        yield
    finally:
        if not _in_serial_block(nextitem):
            files, _HOLDING.room = _HOLDING.room, None
            for f in files:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()


def _exclusive_room(testrunuid):
    """The gate and the room, both held exclusively (every running test has left the room)."""
    gate_path, room_path = _lock_paths(testrunuid)
    gate, room = open(gate_path, "a"), open(room_path, "a")
    fcntl.flock(gate, fcntl.LOCK_EX)
    fcntl.flock(room, fcntl.LOCK_EX)
    return room, gate


@contextlib.contextmanager
def _shared_room(testrunuid, niced_beside_serial=False):
    """The room, held shared (after passing the gate: never while a serial test waits). With
    ``niced_beside_serial``, a test that finds the gate closed (a serial test waits or runs)
    runs at once instead, outside the room, at nice 19 (:func:`_niced`): beside the serial
    block, on the CPU time it leaves idle, not on the time it needs (a core-tier test: no
    process of it can outlive it at that priority)."""
    gate_path, room_path = _lock_paths(testrunuid)
    with open(gate_path, "a") as gate, open(room_path, "a") as room:
        try:
            fcntl.flock(gate, fcntl.LOCK_EX | (fcntl.LOCK_NB if niced_beside_serial else 0))
            passed = True
        except BlockingIOError:
            passed = False
        if not passed:
            with _niced():
                yield
            return
        fcntl.flock(room, fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


NICE_BESIDE_SERIAL = 19
_RENICE = {}  # "ok": whether this process may lower its threads' nice values again


def _tids():
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []


def _can_renice():
    """Whether this process can set a thread to nice 19 and back (Linux: per-thread nice values
    in /proc/self/task; lowering one needs root or CAP_SYS_NICE). Probed once, on a thread of
    its own."""
    if "ok" not in _RENICE:
        result = []

        def probe():
            tid = threading.get_native_id()
            try:
                nice = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, NICE_BESIDE_SERIAL)
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                result.append(True)
            except (OSError, AttributeError):
                result.append(False)

        thread = threading.Thread(target=probe)
        thread.start()
        thread.join()
        _RENICE["ok"] = sys.platform.startswith("linux") and bool(_tids()) and result == [True]
    return _RENICE["ok"]


@contextlib.contextmanager
def _niced():
    """Every thread of this process (TensorFlow's pools included, and the threads they start)
    at nice NICE_BESIDE_SERIAL, then back to their nice values before."""
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    before = {}
    for tid in _tids():
        try:
            before[tid] = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(before[tid], NICE_BESIDE_SERIAL))
        except ProcessLookupError:  # (a thread that ended meanwhile)
            pass
    try:
        yield
    finally:
        for tid in _tids():
            try:
                os.setpriority(os.PRIO_PROCESS, tid, before.get(tid, base))
            except ProcessLookupError:
                pass


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # (outside pytest-timeout's wrapper: waiting
def pytest_runtest_protocol(item, nextitem):         # for a serial test is not this test's time)
    with _alone_if_serial(item, nextitem), _cpu_account(item):
        _GUARD["blocked"] = None if item.get_closest_marker("e2e") else item.nodeid
        try:
            yield
        finally:
            _GUARD["blocked"] = None


@contextlib.contextmanager
def _cpu_account(item):
    """``TFDP_TEST_CPU=FILE pytest ...``: one JSON line per test appended to FILE: its node id,
    start (Unix time) and xdist worker, wall seconds, and CPU seconds of the test process
    (``self``: its threads, TensorFlow's included) and of the processes it started and waited
    for (``children``: worker jobs, the launcher and its workers, CLI runs). Where the suite's
    CPU time goes (docs/development.md)."""
    path = os.environ.get("TFDP_TEST_CPU")
    if not path:
        yield
        return
    import json
    import resource
    import time

    def cpu(who):
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    start = time.time()  # (wall clock: lines of several workers on one timeline)
    t0, self0, children0 = time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(
        resource.RUSAGE_CHILDREN)
    try:
        yield
    finally:
        line = json.dumps({"id": item.nodeid, "start": round(start, 3),
                           "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
                           "wall": round(time.monotonic() - t0, 3),
                           "self": round(cpu(resource.RUSAGE_SELF) - self0, 3),
                           "children": round(cpu(resource.RUSAGE_CHILDREN) - children0, 3)})
        with open(path, "a", encoding="utf-8") as f:  # (one short line: appends do not mix)
            f.write(line + "\n")


# --- fixtures -----------------------------------------------------------------------------------

class Processes:
    """What a test uses to start processes (the ``run_process`` / ``worker_job`` fixtures).

    Calling it is ``subprocess.run``; ``popen`` is ``subprocess.Popen``; ``workers`` is
    ``tfdp.testing.run_workers`` (a job of N local workers through the launcher); ``launch`` is
    ``tfdp.launch.launcher.launch``. Module helpers that start processes may keep calling
    ``subprocess`` / ``tfdp.testing`` themselves: the guard allows it in tests that hold this
    fixture (and only there).
    """

    python = sys.executable

    def __call__(self, *args, **kwargs):
        return subprocess.run(*args, **kwargs)

    def popen(self, *args, **kwargs):
        return subprocess.Popen(*args, **kwargs)

    def workers(self, *args, **kwargs):
        from tfdp.testing import run_workers
        return run_workers(*args, **kwargs)

    def launch(self, *args, **kwargs):
        from tfdp.launch import launcher
        return launcher.launch(*args, **kwargs)


_PROCESSES = Processes()


@pytest.fixture(scope="session")
def run_process():
    """Start processes from a test (``run_process([...])`` is ``subprocess.run``): makes it e2e."""
    return _PROCESSES


@pytest.fixture(scope="session")
def worker_job():
    """Jobs of local workers (``worker_job.workers(script, ...)``): makes the test e2e."""
    return _PROCESSES


@pytest.fixture(scope="session")
def cpu_devices():
    """The test process's logical CPU devices (4 of them, configured at import)."""
    import tensorflow as tf
    return [d.name for d in tf.config.list_logical_devices("CPU")]


@pytest.fixture
def tfdp_cli(capsys, monkeypatch):
    """``tfdp ARGS`` in this process (a core-tier test of a command-line usage error):
    ``tfdp_cli(argv) -> (exit code, stdout, stderr)``, run in the repository root without
    ``TF_CONFIG`` / ``TFDP_CPU_REPLICAS``, as ``python -m tfdp ARGS`` would report them. The
    guard fails the test if the command starts a process."""
    import tfdp.cli
    from jobs import command_in_process

    def run(argv):
        return command_in_process(monkeypatch, capsys, lambda: tfdp.cli.main(list(argv)))

    return run


class _OneDevice:
    """Session-wide memo of one-device reference results (the ``one_device`` fixture)."""

    def __init__(self):
        self._values = {}

    def __call__(self, key, compute):
        """``compute()``'s result for ``key``, computed once per test session. Keep results to
        values (numpy arrays, histories), never models a test could change."""
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]


@pytest.fixture(scope="session")
def one_device():
    """One-device reference fits shared by the tests that compare with the same one:
    ``one_device(key, compute)`` computes once per session (same values as computing it in each
    test: the same seeds, data and batches)."""
    return _OneDevice()

"""A dead or stuck worker ends the whole job promptly, with one line naming it (DESIGN.md #4).

Two workers x 1 CPU replica run a Keras ``fit`` through ``tfdp launch``; at step 5 worker 1
either dies (``os._exit(1)``: the launcher sees the exit) or freezes itself with SIGSTOP (no exit
to see: worker 0 must notice the missing heartbeats, fail with a line naming worker 1 and its
address, and exit non-zero; the launcher then kills the stopped worker at once), or takes a
step longer than the heartbeat timeout (no false alarm). Each job has a
hard timeout; the time from the failure to the end of the launcher is measured and printed.
Also: unit tests of the error translation and the settings, and of the launcher killing a
stopped worker without waiting for the SIGTERM grace period (no TensorFlow in the workers).
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tfdp import failures
from tfdp.launch import job as job_lib  # (the running job's timings, split from launcher.py)
from tfdp.launch import launcher as launcher_lib

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

FIT_SCRIPT = r"""
import os, signal, time
import numpy as np
import keras
from tfdp.strategy import multiworker as mw

rank = int(os.environ["TFDP_WORKER_RANK"])
strategy = mw.MultiWorkerDataParallelStrategy()
x = np.random.RandomState(0).randn(4000, 8).astype("float32")
y = x.sum(axis=1, keepdims=True)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)])
    model.compile("sgd", "mse")


class Fail(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if rank == 1 and batch == 5:
            print(f"FAILING pid={os.getpid()} at={time.time():.3f}", flush=True)
            mode = os.environ["FAIL_MODE"]
            if mode == "exit":
                os._exit(1)
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if mode == "slow":  # a step slower than the heartbeat timeout, partly holding the GIL
                time.sleep(6.0)
                end = time.time() + 3.0
                while time.time() < end:
                    pass


epochs = 1 if os.environ["FAIL_MODE"] == "slow" else 50
model.fit(x, y, batch_size=20, epochs=epochs, verbose=0, callbacks=[Fail()])
print("FINISHED", flush=True)
"""

HARD_TIMEOUT = 100  # seconds for one job (the launcher's own --timeout is 80)


def _run_job(tmp_path, mode, extra_env=None):
    """Run FIT_SCRIPT in 2 workers; return (exit code, output, seconds from failure to end)."""
    script = tmp_path / "fail_script.py"
    script.write_text(textwrap.dedent(FIT_SCRIPT))
    env = dict(os.environ, FAIL_MODE=mode, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.update(extra_env or {})
    cmd = [sys.executable, "-m", "tfdp", "launch", "--all-output",
           "--workers", "2", "--cpu-replicas", "1",
           "--timeout", "80", "--", sys.executable, str(script)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=HARD_TIMEOUT)
    except BaseException:  # hard timeout or pytest-timeout: never leave workers behind
        pids = [proc.pid] + _children(proc.pid)
        for pid in pids:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        out, _ = proc.communicate()
        raise AssertionError("job did not end in time:\n" + out.decode(errors="replace"))
    end = time.time()
    text = out.decode("utf-8", errors="replace")
    m = re.search(r"FAILING pid=(\d+) at=([\d.]+)", text)
    assert m, f"worker 1 never reached step 5:\n{text}"
    return proc.returncode, text, end - float(m.group(2)), int(m.group(1))


def _children(pid):
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return kids


def _gone(pid):
    """Whether ``pid`` no longer runs (absent, or a zombie waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@pytest.mark.timeout(HARD_TIMEOUT + 20)
def test_dead_worker_ends_the_job_with_its_name_and_address(run_process, tmp_path):
    code, text, seconds, _ = _run_job(tmp_path, "exit")
    print(f"dead worker: the launcher ended {seconds:.1f} s after os._exit")
    assert code != 0, text
    assert "FINISHED" not in text
    assert re.search(r"^tfdp launch: worker 1 \(127\.0\.0\.1:\d+\) failed with exit code 1; "
                     r"stopped the other workers$", text, re.M), text
    assert seconds < 15, f"took {seconds:.1f} s after the failure:\n{text}"


@pytest.mark.timeout(HARD_TIMEOUT + 20)
def test_stopped_worker_is_detected_and_named(run_process, tmp_path):
    code, text, seconds, pid = _run_job(tmp_path, "stop")
    print(f"SIGSTOPped worker: the launcher ended {seconds:.1f} s after SIGSTOP")
    assert code != 0, text
    assert "FINISHED" not in text
    # the survivor found it by itself (no launcher needed), in one line ...
    assert re.search(r"^\[worker 0\] tfdp: peer failure: worker 1 \(127\.0\.0\.1:\d+\) has "
                     r"stopped responding \(no heartbeat for 6 s", text, re.M), text
    # ... which the launcher repeats, naming the stuck worker first (it stops the job 0.5 s after
    # that report when the reporting worker is slow to exit)
    assert re.search(r"^tfdp launch: worker 1 \(127\.0\.0\.1:\d+\) has stopped responding .*; "
                     r"reported by worker 0 \(127\.0\.0\.1:\d+\), which (failed with exit code 1|"
                     r"was still exiting)", text, re.M), text
    assert seconds < 20, f"took {seconds:.1f} s after the failure:\n{text}"
    assert _gone(pid), "the stopped worker was left behind"


@pytest.mark.timeout(HARD_TIMEOUT + 20)
def test_a_slow_step_is_not_a_failure(run_process, tmp_path):
    """A 9 s step on worker 1 (longer than the 6 s heartbeat timeout; 3 s of it holding the
    GIL): heartbeats run in TF's C++ threads, so the job just waits and finishes."""
    code, text, _, _ = _run_job(tmp_path, "slow")
    assert code == 0, text
    assert text.count("FINISHED") == 2, text
    assert "peer failure" not in text, text


# --- without TensorFlow in the workers: the launcher and a stopped worker -----------------------

def test_launcher_kills_a_stopped_worker_without_waiting_for_the_grace_period(run_process):
    """Worker 1 stops itself, worker 0 then fails: the launcher must not wait GRACE_S for a
    SIGTERM that a stopped process cannot act on, and must name a reported peer failure."""
    code = textwrap.dedent(f"""
        import os, signal, sys, time
        if os.environ["TFDP_WORKER_RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(60)
        time.sleep(1.0)
        sys.stderr.write({failures.PEER_FAILURE_MARK!r} + "worker 1 is frozen\\n")
        sys.exit(3)
    """)
    import io
    err = io.StringIO()
    start = time.monotonic()
    rc = launcher_lib.launch([sys.executable, "-c", code], 2, timeout=30, stdout=io.StringIO(),
                             stderr=err)
    took = time.monotonic() - start
    assert rc == 3
    assert took < 1.0 + job_lib.GRACE_S, took
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("tfdp launch:")]
    assert len(lines) == 1, err.getvalue()
    assert re.fullmatch(r"tfdp launch: worker 1 is frozen; reported by worker 0 \(127\.0\.0\.1:"
                        r"\d+\), which failed with exit code 3; stopped the other workers",
                        lines[0]), lines


def test_launcher_stops_the_job_when_a_worker_reports_a_lost_peer_but_is_slow_to_exit(run_process):
    """A worker that printed its peer-failure line may take seconds to exit (TF's unwinding):
    the launcher stops the job half a second later, naming the lost peer (fault trials (c))."""
    code = textwrap.dedent(f"""
        import os, sys, time
        if os.environ["TFDP_WORKER_RANK"] == "0":
            sys.stderr.write({failures.PEER_FAILURE_MARK!r} + "worker 1 is frozen\\n")
            sys.stderr.flush()
        time.sleep(60)
    """)
    import io
    err = io.StringIO()
    start = time.monotonic()
    rc = launcher_lib.launch([sys.executable, "-c", code], 2, timeout=30, stdout=io.StringIO(),
                             stderr=err)
    took = time.monotonic() - start
    assert rc == 1
    assert took < 2.0 + job_lib._PEER_EXIT_S + job_lib.GRACE_S, took
    lines = [ln for ln in err.getvalue().splitlines() if ln.startswith("tfdp launch:")]
    assert len(lines) == 1, err.getvalue()
    assert re.fullmatch(r"tfdp launch: worker 1 is frozen; reported by worker 0 \(127\.0\.0\.1:"
                        r"\d+\), which was still exiting; stopped the other workers",
                        lines[0]), lines


def test_is_stopped(run_process):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not job_lib._is_stopped(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not job_lib._is_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert job_lib._is_stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait(timeout=10)


# --- the error translation and the settings (in this process) ----------------------------------

@pytest.fixture()
def cluster():
    from tfdp.cluster import ClusterInfo
    addrs = ["127.0.0.1:1111", "127.0.0.1:2222", "127.0.0.1:3333"]
    return ClusterInfo(workers=tuple(addrs), task_type="worker", task_id=0, rank=0,
                       source="explicit", cluster_spec={"worker": addrs})


def test_peer_failure_message_names_the_unhealthy_task(cluster):
    import tensorflow as tf
    from tfdp.failures import peer_failure_message
    err = tf.errors.UnavailableError(None, None, (
        "Graph execution error:\n\nDetected at node CollectiveReduceV2 ...\n"
        "Collective ops is aborted by: Error reported from /job:worker/task:2: The following "
        "tasks are unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:2\n"
        "The tasks have crashed. Check the task logs for an earlier error"))
    assert peer_failure_message(err, cluster, 6.0) == (
        "worker 2 (127.0.0.1:3333) has stopped responding (no heartbeat for 6 s: crashed, "
        "killed, frozen or unreachable)")


def test_peer_failure_message_other_shapes(cluster):
    import dataclasses
    import tensorflow as tf
    from tfdp.failures import peer_failure_message
    w1 = dataclasses.replace(cluster, task_id=1, rank=1)
    leader = tf.errors.UnavailableError(None, None, "Collective ops is aborted by: Deadline "
                                        "Exceeded\nRPC: /tensorflow.CoordinationService/Heartbeat")
    assert peer_failure_message(leader, w1, 6.0).startswith(
        "worker 0 (127.0.0.1:1111) (the coordination leader) has stopped responding")
    reset = tf.errors.UnavailableError(None, None, (
        "Additional GRPC error information from remote target /job:worker/replica:0/task:0 "
        "while calling /tensorflow.WorkerService/CompleteInstance:\n:UNKNOWN:Error received "
        "from peer  {grpc_message:\"recvmsg:Connection reset by peer\", grpc_status:14}"))
    assert peer_failure_message(reset, w1) == (
        "lost the connection to worker 0 (127.0.0.1:1111) (crashed, killed or unreachable)")
    by_address = tf.errors.UnavailableError(None, None, "failed to connect to all addresses; "
                                            "last error: ipv4:127.0.0.1:3333: Connection refused")
    assert "worker 2 (127.0.0.1:3333)" in peer_failure_message(by_address, w1)
    timeout = tf.errors.DeadlineExceededError(None, None, "Collective has timed out waiting "
                                              "for other workers.")
    assert peer_failure_message(timeout, cluster, 6.0, 30.0) == (
        "one of worker 1 (127.0.0.1:2222), worker 2 (127.0.0.1:3333) did not reach a collective "
        "within 30 s (TFDP_COLLECTIVE_TIMEOUT): stuck or much slower")
    assert peer_failure_message(tf.errors.InvalidArgumentError(None, None, "task:1"),
                                cluster) is None
    assert peer_failure_message(ValueError("/job:worker/task:1"), cluster) is None


def test_timeout_settings(monkeypatch):
    from tfdp.errors import TfdpError
    from tfdp.failures import (COLLECTIVE_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT,
                               HEARTBEAT_TIMEOUT_ENV)
    from tfdp.failures import seconds_setting as _seconds_setting

    def heartbeat(value=None):
        return _seconds_setting(value, "heartbeat_timeout", HEARTBEAT_TIMEOUT_ENV,
                                DEFAULT_HEARTBEAT_TIMEOUT, off_ok=False)

    def collective(value=None):
        return _seconds_setting(value, "collective_timeout", COLLECTIVE_TIMEOUT_ENV, None)

    monkeypatch.delenv(HEARTBEAT_TIMEOUT_ENV, raising=False)
    monkeypatch.delenv(COLLECTIVE_TIMEOUT_ENV, raising=False)
    assert heartbeat() == DEFAULT_HEARTBEAT_TIMEOUT == 6.0
    assert collective() is None
    monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, "2.5")
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "120")
    assert heartbeat() == 2.5 and collective() == 120.0
    assert heartbeat(4) == 4.0 and collective(7) == 7.0  # the argument wins
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "none")
    assert collective() is None
    for bad in ("0", "-1", "soon", "nan", "inf"):
        monkeypatch.setenv(HEARTBEAT_TIMEOUT_ENV, bad)
        with pytest.raises(TfdpError, match=HEARTBEAT_TIMEOUT_ENV):
            heartbeat()
    for bad in (0, -3, True, "5", float("inf")):
        with pytest.raises(TfdpError, match="collective_timeout"):
            collective(bad)

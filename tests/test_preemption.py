"""PreemptionCheckpoint: SIGTERM -> backup at the next step on every worker -> exit 75 -> resume.

Each run is a fresh process (the exit code is the point): a first run gets SIGTERM at global
step KILL_AT (sent by the process to itself, or by worker 1 only) and must exit 75 with a backup
at that exact step; a rerun resumes and ends with the weights and optimizer state of an
uninterrupted run (1e-6).
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(170)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-6
KILL_AT = 9            # global step 9 = epoch 1, step 3 (6 steps per epoch, 2 epochs)
SAVE_FREQ = 100        # no periodic backup in between: the one found is the preemption's

SCRIPT = """
import os, signal, sys
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
import tfdp
if os.environ.get("TF_CONFIG"):
    strategy = tfdp.DataParallelStrategy()          # 2 workers x 1 CPU replica
    rank = strategy.cluster.rank
else:
    tfdp.configure_cpu_replicas(2)
    strategy = tfdp.DataParallelStrategy(["CPU:0", "CPU:1"])
    rank = 0
import keras
import test_callbacks_backup as t
from helpers import build
from tfdp.callbacks.backup import BackupAndRestore
from tfdp.callbacks.preemption import PreemptionCheckpoint
from tfdp.testing import emit_result

kill_at = int(os.environ.get("KILL_AT", "0"))
if int(os.environ.get("TFDP_RESTART_COUNT", "0")):  # restarted by tfdp launch: just resume
    kill_at = 0
kill_rank = int(os.environ.get("KILL_RANK", "0"))

class SigtermAt(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.seen = 0
    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == kill_at and rank == kill_rank:
            os.kill(os.getpid(), signal.SIGTERM)

make = t.dataset_fn(strategy)
m = build(strategy, "adam", seed=1 if kill_at else 5)
backup = BackupAndRestore(os.environ["BACKUP_DIR"], save_freq=%d)
preempt = PreemptionCheckpoint(backup)
extra = [SigtermAt()] if kill_at else []
# the killer runs before the preemption check of the same step: backup at exactly kill_at
preempt.fit(m, make, t.EPOCHS, t.STEPS, callbacks=extra)
if kill_at:
    raise SystemExit("not preempted")
got = t.state(m)
ref = t.uninterrupted(strategy)
emit_result(rank=rank, diff=t.max_diff(got, ref), restored=backup.restored,
            iterations=int(m.optimizer.iterations.numpy()),
            checks=preempt.checks, first_ms=1000 * preempt.first_check_seconds,
            check_ms=1000 * preempt.check_seconds / max(1, preempt.checks - 1))
""" % SAVE_FREQ


def _env(tmp_path, **extra):
    env = dict(os.environ, TFDP_TEST_DIR=TESTS_DIR, CUDA_VISIBLE_DEVICES="",
               TF_CPP_MIN_LOG_LEVEL="2", BACKUP_DIR=str(tmp_path / "backup"))
    env.pop("TFDP_CPU_REPLICAS", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return str(path)


def _run(cmd, env, cwd, timeout):
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                           start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd} timed out after {timeout} s:\n{(e.output or b'').decode()[-4000:]}")
    return p.returncode, p.stdout.decode("utf-8", errors="replace")


def _sidecar(tmp_path):
    meta = json.loads((tmp_path / "backup" / "backup.json").read_text())
    assert (tmp_path / "backup" / meta["state"]).exists()
    return meta["epoch"], meta["step_in_epoch"], meta["global_step"]


def test_single_process_sigterm_exits_75_and_resumes_exactly(run_process, tmp_path):
    from tfdp.testing import RESULT_MARK
    script = _script(tmp_path)
    code, out = _run([sys.executable, script], _env(tmp_path, KILL_AT=KILL_AT), tmp_path, 75)
    assert code == 75, out[-4000:]
    assert "preempted" in out
    assert _sidecar(tmp_path) == (1, 3, KILL_AT)

    code, out = _run([sys.executable, script], _env(tmp_path), tmp_path, 75)
    assert code == 0, out[-4000:]
    res = json.loads([ln for ln in out.splitlines() if ln.startswith(RESULT_MARK)][-1]
                     [len(RESULT_MARK):])
    assert res["restored"] and res["iterations"] == 12
    assert res["diff"] <= TOL, res
    assert not (tmp_path / "backup").exists()  # finished: deleted


def test_launcher_max_restarts_resumes_after_exit_75(run_process, tmp_path):
    """tfdp launch --max-restarts 1: the preempted run exits 75, the restart resumes."""
    from tfdp.testing import RESULT_MARK
    script = _script(tmp_path)
    cmd = [sys.executable, "-m", "tfdp", "launch", "--workers", "1", "--max-restarts", "1",
           "--timeout", "120", "--", sys.executable, script]
    code, out = _run(cmd, _env(tmp_path, KILL_AT=KILL_AT), tmp_path, 140)
    assert code == 0, out[-4000:]
    assert f"backed up at global step {KILL_AT}" in out and "exit code 75" in out, out[-4000:]
    res = json.loads([ln.split(RESULT_MARK, 1)[1] for ln in out.splitlines()
                      if RESULT_MARK in ln][-1])
    assert res["restored"] and res["iterations"] == 12 and res["diff"] <= TOL, res


@pytest.mark.timeout(240)
def test_two_workers_sigterm_to_worker_1_only(worker_job, tmp_path):
    from tfdp.testing import format_failure, parse_results, run_workers, split_output
    script = _script(tmp_path)
    cmd = [sys.executable, "-m", "tfdp", "launch", "--all-output", "--workers", "2",
           "--timeout", "90",
           "--cpu-replicas", "1", "--", sys.executable, script]
    code, out = _run(cmd, _env(tmp_path, KILL_AT=KILL_AT, KILL_RANK=1), tmp_path, 110)
    outputs, launcher = split_output(out, 2)
    assert code == 75, format_failure(f"exit code {code}", outputs, launcher)
    for o in outputs:  # both workers stopped at the same step through the preemption path
        assert f"backed up at global step {KILL_AT}" in o, format_failure("", outputs, launcher)
    assert _sidecar(tmp_path) == (1, 3, KILL_AT)

    outputs = run_workers(script, workers=2, cpu_replicas=1, timeout=100,
                          env=_env(tmp_path))
    results = parse_results(outputs)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["restored"] and r["iterations"] == 12 for r in results), results
    assert all(r["diff"] <= TOL for r in results), results
    print("per-step agreement (ms):", [(r["first_ms"], r["check_ms"]) for r in results])
    assert all(r["checks"] == 12 - KILL_AT for r in results), results
    assert all(r["check_ms"] < 50 for r in results), results  # the per-step agreement is cheap
    assert not (tmp_path / "backup").exists()


# --- in process: the epoch's last step, the handler's restore, bad arguments --------------------

def test_sigterm_at_epoch_end_resumes_next_epoch_and_restores_handler(tmp_path):
    import signal

    import keras
    import tfdp
    import test_callbacks_backup as t
    from helpers import build
    from tfdp.callbacks.backup import BackupAndRestore
    from tfdp.callbacks.preemption import Preempted, PreemptionCheckpoint

    class SigtermAt(keras.callbacks.Callback):
        seen = 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == t.STEPS:
                os.kill(os.getpid(), signal.SIGTERM)

    def marker(*_):
        pass

    strategy = tfdp.DataParallelStrategy(["CPU:0", "CPU:1"])
    make = t.dataset_fn(strategy)
    d = tmp_path / "backup"
    previous = signal.signal(signal.SIGTERM, marker)
    try:
        m = build(strategy, "adam", seed=1)
        preempt = PreemptionCheckpoint(BackupAndRestore(str(d), save_freq=SAVE_FREQ),
                                       exit_code=42)
        with pytest.raises(Preempted) as info:
            preempt.fit(m, make, t.EPOCHS, t.STEPS, callbacks=[SigtermAt()])
        assert info.value.code == 42 and preempt.preempted_at == t.STEPS
        assert signal.getsignal(signal.SIGTERM) is marker  # put back
        assert _sidecar(tmp_path) == (1, 0, t.STEPS)       # the last step: the next epoch

        m2 = build(strategy, "adam", seed=5)
        b2 = BackupAndRestore(str(d), save_freq=SAVE_FREQ)
        PreemptionCheckpoint(b2).fit(m2, make, t.EPOCHS, t.STEPS)
        assert b2.restored and signal.getsignal(signal.SIGTERM) is marker
        assert t.max_diff(t.state(m2), t.uninterrupted(strategy)) <= TOL
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_bad_arguments():
    from tfdp.callbacks.backup import BackupAndRestore
    from tfdp.callbacks.preemption import PreemptionCheckpoint
    from tfdp.errors import TfdpError
    b = BackupAndRestore("/tmp/x")
    with pytest.raises(TfdpError, match="backup"):
        PreemptionCheckpoint(object())
    for bad in (0, 126, True, "75"):
        with pytest.raises(TfdpError, match="exit_code"):
            PreemptionCheckpoint(b, exit_code=bad)
    with pytest.raises(TfdpError, match="check_every"):
        PreemptionCheckpoint(b, check_every=0)

"""Keras's own BackupAndRestore, ModelCheckpoint and CSVLogger across 2 workers, used exactly as
TF's multi-worker Keras tutorial uses them (one shared directory for every worker).

Without tfdp.callbacks.shared_files every worker writes the same files at once (h5py:
``BlockingIOError: unable to lock file``) and deletes the backup directory at the end. With it
only the chief writes the shared files (the other worker saves into a private temporary
directory, removed at once), and a worker killed mid-epoch and restarted by ``tfdp launch
--max-restarts 1`` resumes as Keras documents it: from the last epoch-end backup, the
interrupted epoch run again from its first step.
"""

import json
import os
import subprocess
import sys

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
EPOCHS, N, BATCH = 3, 120, 20   # 6 steps per epoch

WORKER_SCRIPT = """
import glob, os, sys, tempfile
import tfdp
strategy = tfdp.DataParallelStrategy()           # 2 workers x 2 CPU replicas (TF_CONFIG)
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
import keras, numpy as np
from helpers import build, make_data
from tfdp.testing import emit_result
rank = strategy.cluster.rank
first_attempt = int(os.environ.get("TFDP_RESTART_COUNT", "0")) == 0
x, y = make_data(%(N)d)

class KillAt(keras.callbacks.Callback):          # worker 1 dies in epoch 2 of the first attempt
    seen = 0
    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == int(os.environ["KILL_AT"]):
            print("killing worker", rank, flush=True)
            os._exit(17)

class Count(keras.callbacks.Callback):
    epochs = []
    def on_epoch_begin(self, epoch, logs=None):
        self.epochs.append(epoch)

def fit(callbacks, seed=1):
    m = build(strategy, "adam", seed=seed)
    h = m.fit(x, y, batch_size=%(BATCH)d, epochs=%(EPOCHS)d, shuffle=False, verbose=0,
              callbacks=callbacks)
    return m, h.history

# --- the tutorial's form: one directory shared by every worker ---
backup_dir, ckpt_dir = os.environ["BACKUP_DIR"], os.environ["CKPT_DIR"]
count = Count()
callbacks = [keras.callbacks.BackupAndRestore(backup_dir=backup_dir),
             keras.callbacks.ModelCheckpoint(filepath=os.path.join(ckpt_dir,
                                                                   "ckpt-{epoch}.weights.h5"),
                                             save_weights_only=True),
             keras.callbacks.CSVLogger(os.environ["CSV"]),
             count]
if first_attempt and rank == 1 and os.environ.get("KILL_AT"):
    callbacks.append(KillAt())
mine = os.path.join(tempfile.gettempdir(), f"tfdp-worker{rank}-*")  # this worker's private dirs
before = set(glob.glob(mine))
m, hist = fit(callbacks, seed=1 if first_attempt else 5)
leftover = sorted(set(glob.glob(mine)) - before)
ref, ref_hist = fit([])                           # uninterrupted, no callbacks
diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
           for a, b in zip(m.get_weights(), ref.get_weights()))
emit_result(rank=rank, first_attempt=first_attempt, epochs=count.epochs, diff=diff,
            loss=hist["loss"][-1], ref_loss=ref_hist["loss"][-1], leftover=leftover)
""" % {"N": N, "BATCH": BATCH, "EPOCHS": EPOCHS}


def _launch(tmp_path, restarts, **env_extra):
    from tfdp.testing import RESULT_MARK, format_failure, split_output
    script = tmp_path / "train.py"
    script.write_text(WORKER_SCRIPT)
    env = dict(os.environ, TFDP_TEST_DIR=TESTS_DIR, CUDA_VISIBLE_DEVICES="",
               TF_CPP_MIN_LOG_LEVEL="2", BACKUP_DIR=str(tmp_path / "backup"),
               CKPT_DIR=str(tmp_path / "ckpt"), CSV=str(tmp_path / "log.csv"), **env_extra)
    cmd = [sys.executable, "-m", "tfdp", "launch", "--all-output", "--workers", "2",
           "--cpu-replicas", "2",
           "--max-restarts", str(restarts), "--timeout", "300", "--", sys.executable,
           str(script)]
    try:
        p = subprocess.run(cmd, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=330,
                           start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out:\n{(e.output or b'').decode()[-6000:]}")
    outputs, launcher = split_output(p.stdout.decode("utf-8", errors="replace"), 2)
    assert p.returncode == 0, format_failure(f"exit code {p.returncode}", outputs, launcher)
    results = []
    for o in outputs:
        lines = [ln for ln in o.splitlines() if ln.startswith(RESULT_MARK)]
        assert lines, format_failure("no result", outputs, launcher)
        results.append(json.loads(lines[-1][len(RESULT_MARK):]))
    return results, outputs, launcher


def _check_shared_files(tmp_path, epochs_logged):
    ckpts = sorted(os.listdir(tmp_path / "ckpt"))
    assert ckpts == [f"ckpt-{e}.weights.h5" for e in range(1, EPOCHS + 1)], ckpts
    assert not (tmp_path / "backup").exists()      # deleted by the chief at the end
    rows = (tmp_path / "log.csv").read_text().strip().splitlines()
    assert rows[0].startswith("epoch") and len(rows) == 1 + epochs_logged, rows  # one writer


@pytest.mark.timeout(400)
def test_tutorial_form_two_workers_one_writer(run_process, tmp_path):
    results, _, _ = _launch(tmp_path, restarts=0)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["epochs"] == list(range(EPOCHS)) and r["diff"] <= 1e-6, r
        assert r["leftover"] == [], r                # the private directories were removed
    _check_shared_files(tmp_path, EPOCHS)


@pytest.mark.timeout(400)
def test_tutorial_form_killed_worker_resumes_as_keras_documents(run_process, tmp_path):
    # killed at step 9 = epoch 1, step 3: the last backup is epoch 0's end, so the restart runs
    # epochs 1 and 2 again in full and ends with the uninterrupted weights
    results, outputs, launcher = _launch(tmp_path, restarts=1, KILL_AT="9")
    assert "killing worker 1" in outputs[1] and "restart" in launcher, launcher
    for r in results:
        assert not r["first_attempt"] and r["epochs"] == [1, 2], r
        assert r["diff"] <= 1e-6, r
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6), r
        assert r["leftover"] == [], r
    _check_shared_files(tmp_path, 2)


def test_single_worker_untouched_and_install_idempotent(tmp_path):
    import keras
    import tfdp
    from tfdp.callbacks import shared_files
    from tfdp.compat import keras_callbacks_hook_points
    strategy = tfdp.DataParallelStrategy(["CPU:0", "CPU:1"])
    shared_files.install(strategy)        # one worker: nothing installed by this call
    from helpers import build, make_data
    x, y = make_data(40)
    m = build(strategy, "adam", seed=1)
    m.fit(x, y, batch_size=20, epochs=1, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(str(tmp_path / "c.weights.h5"), save_weights_only=True),
        keras.callbacks.BackupAndRestore(str(tmp_path / "b"), delete_checkpoint=False)])
    assert (tmp_path / "c.weights.h5").exists()
    assert (tmp_path / "b" / "latest.weights.h5").exists()
    points = keras_callbacks_hook_points()
    owner, attr = points["backup_save"]
    before = owner.__dict__[attr]
    shared_files.install(strategy)
    assert owner.__dict__[attr] is before

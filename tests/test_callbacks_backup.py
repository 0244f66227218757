"""BackupAndRestore (exact resume, atomic, checked, one writer) and NaNGuard (rollback).

A run interrupted in the middle of an epoch and resumed in a fresh model/optimizer from the
backup must end with the same weights and optimizer variables as an uninterrupted run (1e-6):
weights, optimizer state and the data position (shuffled with tfdp.data) are all restored.
"""

import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(150)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-6
N, BATCH, EPOCHS = 120, 20, 2           # 6 steps per epoch, 12 in all
STEPS = N // BATCH
KILL_AT = 9                             # global step 9 = epoch 1, step 3
SAVE_FREQ = 2                           # last backup before the kill: global step 8 (epoch 1, 2)


from helpers import Interrupt  # noqa: E402


def make_callbacks():
    import keras

    class KillAt(keras.callbacks.Callback):
        """Simulates a crash: raises after global training step ``step``."""

        def __init__(self, step):
            super().__init__()
            self.step, self.seen = step, 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == self.step:
                raise Interrupt(f"killed at global step {self.seen}")
    return KillAt


def dataset_fn(strategy, bad_batches=(), seed=3):
    """``(epoch, start_step) -> distributed dataset``: shuffled per epoch, resumable."""
    import tensorflow as tf
    import tfdp
    from helpers import make_data
    x, y = make_data(N)
    y = y.copy()
    for b in bad_batches:  # poison a whole batch (in batch order: no shuffle then)
        y[b * BATCH:(b + 1) * BATCH] = np.inf
    ds = tf.data.Dataset.from_tensor_slices((x, y))

    def make(epoch, start_step):
        return tfdp.data.distribute(strategy, ds, global_batch_size=BATCH,
                                    shuffle_seed=None if bad_batches else seed, epoch=epoch,
                                    start_step=start_step)
    return make


def state(model):
    return [np.array(getattr(v, "value", v)) for v in
            list(model.variables) + list(model.optimizer.variables)]


def max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
               for x, y in zip(a, b))


def uninterrupted(strategy, opt="adam"):
    """Reference: plain Keras fit, one call per epoch on the same data."""
    from helpers import build
    make = dataset_fn(strategy)
    m = build(strategy, opt, seed=1)
    for e in range(EPOCHS):
        m.fit(make(e, 0), initial_epoch=e, epochs=e + 1, steps_per_epoch=STEPS, verbose=0)
    return state(m)


def interrupted_then_resumed(strategy, backup_dir, opt="adam"):
    """Run until KILL_AT, crash; then a fresh model + optimizer + callback resume."""
    from helpers import build
    from tfdp.callbacks.backup import BackupAndRestore, _is_chief
    make = dataset_fn(strategy)
    m = build(strategy, opt, seed=1)
    backup = BackupAndRestore(backup_dir, save_freq=SAVE_FREQ)
    with pytest.raises(Interrupt):
        backup.fit(m, make, EPOCHS, STEPS, callbacks=[make_callbacks()(KILL_AT)])
    chief = _is_chief(strategy)
    assert backup.saves_written == (1 + KILL_AT // SAVE_FREQ if chief else 0)  # + initial state
    meta = json.loads(open(os.path.join(backup_dir, "backup.json")).read())
    assert (meta["epoch"], meta["step_in_epoch"], meta["global_step"]) == (1, 2, 8)

    m2 = build(strategy, opt, seed=5)  # other initial weights: the restore must overwrite them
    resumed = BackupAndRestore(backup_dir, save_freq=SAVE_FREQ)
    assert (resumed.initial_epoch, resumed.start_step, resumed.global_step) == (1, 2, 8)
    resumed.fit(m2, make, EPOCHS, STEPS)
    assert resumed.restored
    assert int(np.asarray(m2.optimizer.iterations)) == EPOCHS * STEPS
    return state(m2), resumed


@pytest.fixture(scope="module")
def strategy():
    import tfdp
    return tfdp.DataParallelStrategy(["CPU:0", "CPU:1"])


@pytest.fixture(scope="module")
def reference(strategy):
    return uninterrupted(strategy)


def test_resume_mid_epoch_equals_uninterrupted(strategy, reference, tmp_path):
    backup_dir = str(tmp_path / "backup")
    got, resumed = interrupted_then_resumed(strategy, backup_dir)
    assert max_diff(got, reference) <= TOL
    assert not os.path.exists(backup_dir)  # finished: deleted (delete_checkpoint=True)


def test_epoch_save_freq_plain_fit_drop_in(strategy, reference, tmp_path):
    """save_freq="epoch" with plain model.fit: resume skips the finished epoch, like Keras."""
    from helpers import build
    from tfdp.callbacks.backup import BackupAndRestore
    make = dataset_fn(strategy)
    backup_dir = str(tmp_path / "b")
    m = build(strategy, "adam", seed=1)
    with pytest.raises(Interrupt):  # one whole epoch then a crash at step 2 of epoch 1
        m.fit(make(0, 0), epochs=1, steps_per_epoch=STEPS, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, delete_checkpoint=False)])
        m.fit(make(1, 0), initial_epoch=1, epochs=2, steps_per_epoch=STEPS, verbose=0,
              callbacks=[BackupAndRestore(backup_dir, delete_checkpoint=False),
                         make_callbacks()(2)])
    m2 = build(strategy, "adam", seed=5)
    b2 = BackupAndRestore(backup_dir)
    assert (b2.initial_epoch, b2.start_step) == (1, 0)
    m2.fit(make(b2.initial_epoch, 0), epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0,
           callbacks=[b2])
    assert max_diff(state(m2), reference) <= TOL


def _saved_backup(strategy, path, model_seed=1, **build_kw):
    from helpers import build
    from tfdp.callbacks.backup import BackupAndRestore
    m = build(strategy, "adam", seed=model_seed, **build_kw)
    b = BackupAndRestore(str(path))
    b.set_model(m)
    b._check_optimizer()
    assert b.save()
    return m, b


def test_atomic_tmp_leftover_ignored_and_foreign_dirs(strategy, tmp_path):
    from helpers import build
    from tfdp.callbacks.backup import BackupAndRestore, BackupError
    d = tmp_path / "b"
    m, b = _saved_backup(strategy, d)
    # A crash mid-write leaves a private temporary file: ignored, the backup still loads.
    (d / ".tmp-123-deadbeef-xyz").write_bytes(b"\x00garbage")
    m2 = build(strategy, "adam", seed=9)
    b2 = BackupAndRestore(str(d))
    b2.set_model(m2)
    b2.restore()
    assert max_diff(state(m2), state(m)) == 0
    assert b2.initial_epoch == 0

    # Another model's backup (different architecture): a clear error, nothing overwritten.
    other = build(strategy, "adam", seed=1, batchnorm=True)
    b3 = BackupAndRestore(str(d))
    b3.set_model(other)
    with pytest.raises(BackupError, match="belongs to another model"):
        b3.on_train_begin()
    with pytest.raises(BackupError, match="belongs to another model"):
        b3.save()

    # A directory that is not a tfdp backup (e.g. Keras's BackupAndRestore).
    foreign = tmp_path / "keras_backup"
    foreign.mkdir()
    (foreign / "training_metadata.json").write_text("{}")
    with pytest.raises(BackupError, match="not a tfdp backup"):
        BackupAndRestore(str(foreign)).initial_epoch


@pytest.mark.parametrize("content", [b"{not json", b'{"format": "tfdp-backup"}', b"\xff\xfe",
                                     b'{"format": "other", "epoch": 0}'])
def test_corrupt_sidecar_is_a_clear_error(strategy, tmp_path, content):
    from tfdp.callbacks.backup import BackupAndRestore, BackupError
    d = tmp_path / "b"
    m, _ = _saved_backup(strategy, d)
    (d / "backup.json").write_bytes(content)
    b = BackupAndRestore(str(d))
    b.set_model(m)
    with pytest.raises(BackupError, match="sidecar"):
        b.on_train_begin()
    assert (d / "backup.json").read_bytes() == content  # never clobbered


def test_corrupt_state_file_is_a_clear_error(strategy, tmp_path):
    from tfdp.callbacks.backup import BackupAndRestore, BackupError
    d = tmp_path / "b"
    m, _ = _saved_backup(strategy, d)
    state_file = json.loads((d / "backup.json").read_text())["state"]
    (d / state_file).write_bytes(b"PK\x03\x04 truncated")
    b = BackupAndRestore(str(d))
    b.set_model(m)
    with pytest.raises(BackupError, match="state file is unreadable"):
        b.restore()


def test_nan_guard_rolls_back_lowers_lr_and_continues(strategy, tmp_path):
    from helpers import build
    from tfdp.callbacks import backup as backup_lib
    from tfdp.callbacks.guard import NaNGuard
    make = dataset_fn(strategy, bad_batches=(3,))  # epoch 0 step 3 (and epoch 1 step 3)
    m = build(strategy, "sgd_momentum", seed=1)
    b = backup_lib.BackupAndRestore(str(tmp_path / "b"), save_freq=1, delete_checkpoint=False)
    guard = NaNGuard(b, max_rollbacks=3, lr_factor=0.5, check_weights=True)
    hist = b.fit(m, make, 2, STEPS, callbacks=[guard])
    assert guard.rollbacks == 2
    assert [(e["epoch"], e["step"]) for e in guard.events] == [(0, 4), (1, 4)]
    assert float(np.asarray(m.optimizer.learning_rate)) == pytest.approx(0.05 * 0.25)
    assert all(np.all(np.isfinite(v)) for v in state(m))
    assert np.all(np.isfinite(hist["loss"]))
    meta = json.loads((tmp_path / "b" / "backup.json").read_text())
    assert meta["global_step"] == 2 * STEPS  # training went on to the end


def test_nan_guard_gives_up_after_k_and_keeps_backup(strategy, tmp_path):
    from helpers import build
    from tfdp.callbacks.backup import BackupAndRestore
    from tfdp.callbacks.guard import DivergenceError, NaNGuard
    make = dataset_fn(strategy, bad_batches=range(STEPS))  # every batch is poisoned
    m = build(strategy, "sgd_momentum", seed=1)
    d = tmp_path / "b"
    b = BackupAndRestore(str(d), save_freq=1)  # delete_checkpoint=True: still kept on failure
    guard = NaNGuard(b, max_rollbacks=2, lr_factor=None)
    with pytest.raises(DivergenceError, match=r"epoch 0, step 3 .*after 2 rollback\(s\)"):
        b.fit(m, make, 1, STEPS, callbacks=[guard])
    assert b.failed and guard.rollbacks == 2
    meta = json.loads((d / "backup.json").read_text())
    assert meta["global_step"] == 0 and (d / meta["state"]).exists()
    assert float(np.asarray(m.optimizer.learning_rate)) == pytest.approx(0.05)


def test_bad_arguments():
    from tfdp.callbacks.backup import BackupAndRestore
    from tfdp.callbacks.guard import NaNGuard
    from tfdp.errors import TfdpError
    with pytest.raises(TfdpError, match="save_freq"):
        BackupAndRestore("/tmp/x", save_freq=0)
    with pytest.raises(TfdpError, match="backup"):
        NaNGuard(object())
    with pytest.raises(TfdpError, match="lr_factor"):
        NaNGuard(BackupAndRestore("/tmp/x"), lr_factor=2.0)


# --- two workers -------------------------------------------------------------------------------

WORKER_SCRIPT = """
import os, sys
import tfdp
strategy = tfdp.DataParallelStrategy()  # 2 workers x 1 CPU replica (TF_CONFIG)
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
from tfdp.testing import emit_result
import test_callbacks_backup as t
rank = strategy.cluster.rank
ref = t.uninterrupted(strategy)
got, resumed = t.interrupted_then_resumed(strategy, os.environ["BACKUP_DIR"])
emit_result(rank=rank, diff=t.max_diff(got, ref), writes=resumed.saves_written,
            chief=bool(strategy.cluster.is_chief))
"""


@pytest.mark.timeout(300)
def test_two_workers_one_writer_and_exact_resume(worker_job, tmp_path):
    from tfdp.testing import parse_results, run_workers
    backup_dir = tmp_path / "shared_backup"
    outputs = run_workers(WORKER_SCRIPT, workers=2, cpu_replicas=1, timeout=240,
                          env={"TFDP_TEST_DIR": TESTS_DIR, "CUDA_VISIBLE_DEVICES": "",
                               "BACKUP_DIR": str(backup_dir)})
    results = parse_results(outputs)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["diff"] <= TOL for r in results), results
    # Only the chief wrote (the first, interrupted run asserts its count on each worker too).
    assert results[0]["chief"] and results[0]["writes"] > 0
    assert not results[1]["chief"] and results[1]["writes"] == 0
    assert not backup_dir.exists()  # deleted by the chief at the successful end

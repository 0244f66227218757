"""Drop-in exact resume: ``model.fit(data, epochs=E, callbacks=[tfdp.callbacks.BackupAndRestore(
dir, save_freq=N)])`` killed at a step and run again ends with the weights, optimizer state and
metrics of the uninterrupted run (1e-6): numpy input (Keras's shuffle, global seed), a
deterministic tf.data pipeline, a seeded shuffled one, endless data with steps_per_epoch; in one
process on 2 replicas, and across 2 workers x 2 replicas restarted by ``tfdp launch
--max-restarts 1`` after a worker died (``os._exit``). What cannot be resumed exactly says so
once at restore time.

The interrupted run and the resumed run each build their model, optimizer and data afresh (as a
restarted process does: a new dataset object has its own seed generator).
"""

import logging
import os

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(240)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-6
N, BATCH, EPOCHS = 100, 20, 3     # 5 steps per epoch, 15 in all
SEED = 11


from helpers import Interrupt  # noqa: E402


def kill_at(step, how="raise"):
    """A callback that ends the run after global training step ``step`` (``how="exit"``: the
    process dies at once, as a killed worker)."""
    import keras

    class KillAt(keras.callbacks.Callback):
        seen = 0

        def on_train_batch_end(self, batch, logs=None):
            self.seen += 1
            if self.seen == step:
                if how == "exit":
                    print(f"killing this worker after global step {step}", flush=True)
                    os._exit(17)
                raise Interrupt(f"killed at global step {step}")
    return KillAt()


def make_input(kind, strategy=None):
    """``(fit positional/keyword arguments)`` for one run: fresh objects every call."""
    import tensorflow as tf
    from helpers import make_data
    x, y = make_data(N)
    if kind == "numpy":                       # Keras's array adapter, shuffle=True (default)
        return (x, y), {"batch_size": BATCH}
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if kind == "dataset":
        return (ds.batch(BATCH),), {}
    if kind == "shuffled":                    # reshuffled every epoch from seed 7
        return (ds.shuffle(N, seed=7).batch(BATCH),), {}
    if kind == "repeat_steps":                # endless data, steps_per_epoch
        return (ds.shuffle(N, seed=7).batch(BATCH).repeat(),), {"steps_per_epoch": N // BATCH}
    if kind == "unseeded":
        return (ds.shuffle(N).batch(BATCH),), {}
    if kind == "generator":
        def gen():
            for i in range(0, N, BATCH):
                yield {k: v[i:i + BATCH] for k, v in x.items()}, y[i:i + BATCH]
        return (gen(),), {}
    raise ValueError(kind)


def state(model):
    return [np.array(getattr(v, "value", v)) for v in
            list(model.variables) + list(model.optimizer.variables)]


def max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
               for x, y in zip(a, b))


def run(strategy, kind, callbacks=(), model_seed=1, global_seed=SEED):
    import keras
    from helpers import build
    m = build(strategy, "adam", seed=model_seed)
    if global_seed is not None:
        keras.utils.set_random_seed(global_seed)  # the script's seed, before its data and fit
    else:
        import tensorflow as tf
        tf.random.set_seed(None)  # (building the model set one)
    args, kwargs = make_input(kind, strategy)
    h = m.fit(*args, epochs=EPOCHS, verbose=0, callbacks=list(callbacks), **kwargs)
    return m, h.history


def interrupted_then_resumed(strategy, kind, backup_dir, kill_step, save_freq=1):
    """The drop-in form: the callback passed to model.fit, the script run twice."""
    from tfdp.callbacks import BackupAndRestore
    with pytest.raises(Interrupt):
        run(strategy, kind, [BackupAndRestore(backup_dir, save_freq=save_freq),
                             kill_at(kill_step)])
    backup = BackupAndRestore(backup_dir, save_freq=save_freq)
    m, hist = run(strategy, kind, [backup], model_seed=5)  # other initial weights
    assert backup.restored
    return m, hist, backup


@pytest.fixture(scope="module")
def strategy():
    import tfdp
    return tfdp.DataParallelStrategy(["CPU:0", "CPU:1"])


_references = {}


def reference(strategy, kind):
    if kind not in _references:
        m, hist = run(strategy, kind)
        _references[kind] = (state(m), hist)
    return _references[kind]


@pytest.mark.parametrize("kind,kill_step,save_freq", [
    ("numpy", 7, 1),          # epoch 1, step 2
    ("dataset", 7, 1),
    ("shuffled", 7, 1),
    ("shuffled", 12, 3),      # backup at step 12 = epoch 2 step 2, killed right after
    ("shuffled", 10, 1),      # the epoch's last step: resumes at the start of epoch 2
    ("shuffled", 8, 3),       # killed 2 steps after the backup (step 6): those are redone
    ("repeat_steps", 7, 1),
])
def test_dropin_resume_equals_uninterrupted(strategy, tmp_path, kind, kill_step, save_freq):
    ref_state, ref_hist = reference(strategy, kind)
    m, hist, _ = interrupted_then_resumed(strategy, kind, str(tmp_path / "b"), kill_step,
                                               save_freq)
    assert int(np.asarray(m.optimizer.iterations)) == EPOCHS * (N // BATCH)
    assert max_diff(state(m), ref_state) <= TOL
    # the metrics of the last epoch (the resumed one when killed in it) are the same
    for key in ("loss", "mae"):
        assert hist[key][-1] == pytest.approx(ref_hist[key][-1], rel=1e-6, abs=1e-7), key
    assert not (tmp_path / "b").exists()  # finished: deleted


def test_resumed_epoch_metrics_and_progress(strategy, tmp_path):
    """Killed in the last epoch: that epoch's logged metrics cover all its steps."""
    ref_state, ref_hist = reference(strategy, "shuffled")
    m, hist, _ = interrupted_then_resumed(strategy, "shuffled", str(tmp_path / "b"), 13)
    assert len(hist["loss"]) == 1  # only the resumed epoch ran
    assert hist["loss"][0] == pytest.approx(ref_hist["loss"][-1], rel=1e-6)
    assert hist["mae"][0] == pytest.approx(ref_hist["mae"][-1], rel=1e-6)
    assert max_diff(state(m), ref_state) <= TOL


def _resume_log(strategy, tmp_path, kind, caplog, global_seed=SEED):
    from tfdp.callbacks import BackupAndRestore
    d = str(tmp_path / "b")
    with pytest.raises(Interrupt):
        run(strategy, kind, [BackupAndRestore(d, save_freq=1), kill_at(3)],
            global_seed=global_seed)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tfdp"):
        run(strategy, kind, [BackupAndRestore(d, save_freq=1)], global_seed=global_seed)
    return [r.getMessage() for r in caplog.records if "resumed at" in r.getMessage()]


@pytest.mark.parametrize("kind,global_seed,expected", [
    ("unseeded", None, "unseeded shuffle"),
    ("numpy", None, "keras.utils.set_random_seed"),
    ("generator", SEED, "a generator is replayed"),
])
def test_not_exact_inputs_say_so_once_at_restore(strategy, tmp_path, caplog, kind,
                                                 global_seed, expected):
    lines = _resume_log(strategy, tmp_path, kind, caplog, global_seed)
    assert len(lines) == 1, lines
    assert "will not be exact" in lines[0] and expected in lines[0], lines[0]


def test_exact_inputs_resume_quietly(strategy, tmp_path, caplog):
    lines = _resume_log(strategy, tmp_path, "shuffled", caplog)
    assert len(lines) == 1 and "not exact" not in lines[0] and "input replayed" in lines[0]


def test_keras_own_backup_and_restore_replays_the_epoch(strategy, tmp_path):
    """Keras's keras.callbacks.BackupAndRestore under tfdp: as Keras documents it (the
    interrupted epoch starts again from its first step, from the last epoch-end backup)."""
    import keras
    d = str(tmp_path / "k")
    with pytest.raises(Interrupt):
        run(strategy, "dataset", [keras.callbacks.BackupAndRestore(d), kill_at(7)])
    # resumed: epochs 1 and 2 run again in full (5 + 5 steps), from the weights after epoch 0
    counted = kill_at(10 ** 6)
    m, hist = run(strategy, "dataset", [keras.callbacks.BackupAndRestore(d), counted],
                  model_seed=5)
    assert counted.seen == 2 * (N // BATCH) and len(hist["loss"]) == 2
    ref_state, _ = reference(strategy, "dataset")
    assert max_diff(state(m), ref_state) <= TOL  # the same batches, so the same weights


# --- two workers x two replicas, restarted by the launcher --------------------------------------

WORKER_SCRIPT = """
import os, sys
import tfdp
strategy = tfdp.DataParallelStrategy()   # 2 workers x 2 CPU replicas (TF_CONFIG)
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
import test_resume_dropin as t
from tfdp.callbacks import BackupAndRestore
from tfdp.testing import emit_result
rank = strategy.cluster.rank
kind = os.environ["KIND"]
first_attempt = int(os.environ.get("TFDP_RESTART_COUNT", "0")) == 0
backup = BackupAndRestore(os.environ["BACKUP_DIR"], save_freq=1)
callbacks = [backup]
if first_attempt and rank == int(os.environ["KILL_RANK"]):
    callbacks.append(t.kill_at(int(os.environ["KILL_AT"]), how="exit"))
m, hist = t.run(strategy, kind, callbacks, model_seed=1 if first_attempt else 5)
got = t.state(m)
ref, ref_hist = t.run(strategy, kind)   # uninterrupted, same process
emit_result(rank=rank, restored=backup.restored, first_attempt=first_attempt,
            diff=t.max_diff(got, t.state(ref)), loss=hist["loss"][-1],
            ref_loss=ref_hist["loss"][-1], iterations=int(m.optimizer.iterations.numpy()),
            replicas=strategy.num_replicas_in_sync)
"""


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kind,kill_rank", [("shuffled", 1), ("numpy", 0)])
def test_two_workers_killed_worker_restarted_by_launcher(run_process, tmp_path, kind, kill_rank):
    import json
    import subprocess
    import sys
    from tfdp.testing import RESULT_MARK, format_failure, split_output
    script = tmp_path / "train.py"
    script.write_text(WORKER_SCRIPT)
    env = dict(os.environ, TFDP_TEST_DIR=TESTS_DIR, CUDA_VISIBLE_DEVICES="",
               TF_CPP_MIN_LOG_LEVEL="2", BACKUP_DIR=str(tmp_path / "backup"), KIND=kind,
               KILL_AT="7", KILL_RANK=str(kill_rank))
    cmd = [sys.executable, "-m", "tfdp", "launch", "--all-output", "--workers", "2",
           "--cpu-replicas", "2",
           "--max-restarts", "1", "--timeout", "360", "--", sys.executable, str(script)]
    try:
        p = subprocess.run(cmd, env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=390,
                           start_new_session=True)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"timed out:\n{(e.output or b'').decode()[-6000:]}")
    out = p.stdout.decode("utf-8", errors="replace")
    outputs, launcher = split_output(out, 2)
    assert p.returncode == 0, format_failure(f"exit code {p.returncode}", outputs, launcher)
    assert "killing this worker after global step 7" in outputs[kill_rank]
    assert "restart" in launcher, launcher
    results = []
    for o in outputs:
        lines = [ln for ln in o.splitlines() if ln.startswith(RESULT_MARK)]
        assert lines, format_failure("no result", outputs, launcher)
        results.append(json.loads(lines[-1][len(RESULT_MARK):]))
    print("two workers:", results)
    assert all(r["replicas"] == 4 and not r["first_attempt"] and r["restored"]
               for r in results), results
    assert all(r["iterations"] == EPOCHS * (N // BATCH) for r in results), results
    assert all(r["diff"] <= TOL for r in results), results
    assert all(r["loss"] == pytest.approx(r["ref_loss"], rel=1e-6) for r in results), results
    assert not (tmp_path / "backup").exists()


@pytest.mark.timeout(420)
def test_two_nodes_killed_worker_restarts_the_job_across_nodes(run_process, tmp_path):
    """``tfdp launch --nnodes 2 --max-restarts 1`` on two "nodes" of 127.0.0.1 (a launcher
    each, 1 worker x 2 CPU replicas): node 1's worker dies at step 7; both launchers stop, form
    the job again at the coordinator and restart; the resumed run ends bitwise equal to an
    uninterrupted one on both workers."""
    import json
    import subprocess
    import sys
    import portpicker
    from tfdp.testing import RESULT_MARK
    script = tmp_path / "train.py"
    script.write_text(WORKER_SCRIPT)
    env = dict(os.environ, TFDP_TEST_DIR=TESTS_DIR, CUDA_VISIBLE_DEVICES="",
               TF_CPP_MIN_LOG_LEVEL="2", BACKUP_DIR=str(tmp_path / "backup"), KIND="shuffled",
               KILL_AT="7", KILL_RANK="1", TFDP_RDZV_TOKEN="c0ffee" * 4)
    port = portpicker.pick_unused_port()
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "tfdp", "launch", "--nnodes", "2", "--node-rank", str(r),
         "--coordinator", f"127.0.0.1:{port}", "--workers-per-node", "1", "--cpu-replicas",
         "2", "--output", "all", "--max-restarts", "1", "--timeout", "360", "--",
         sys.executable, str(script)], env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for r in (0, 1)]
    outs = []
    try:
        for n in nodes:
            outs.append(n.communicate(timeout=390))
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, 9)
                n.communicate()
    text = "\n".join(f"--- node {r}: exit {n.returncode}\n{o}\n{e}"
                     for r, (n, (o, e)) in enumerate(zip(nodes, outs)))
    assert [n.returncode for n in nodes] == [0, 0], text[-6000:]
    for r, (_, err) in enumerate(outs):
        assert "restarting the job on every node (restart 1 of 1): every node's workers " \
            "restart from the last backup" in err, text[-4000:]
    assert "killing this worker after global step 7" in outs[1][0]
    results = []
    for out, _ in outs:
        lines = [ln.split("] ", 1)[-1] for ln in out.splitlines() if RESULT_MARK in ln]
        assert lines, text[-4000:]
        results.append(json.loads(lines[-1][len(RESULT_MARK):]))
    print("two nodes, restarted:", results)
    assert all(r["replicas"] == 4 and not r["first_attempt"] and r["restored"]
               for r in results), results
    assert all(r["iterations"] == EPOCHS * (N // BATCH) for r in results), results
    assert all(r["diff"] == 0.0 for r in results), results   # bitwise: the same sums
    assert results[0]["loss"] == results[1]["loss"] == results[0]["ref_loss"], results


# --- the position API ----------------------------------------------------------------------------

def test_position_api_save_now_and_order_check(strategy, tmp_path):
    import keras
    from tfdp.callbacks import BackupAndRestore, Position
    from tfdp.errors import TfdpError
    d = str(tmp_path / "b")
    backup = BackupAndRestore(d, save_freq=100)       # no periodic backup after the first
    assert backup.restore_point is None and backup.position == Position(0, 0, 0)
    seen = {}

    class SaveAt(keras.callbacks.Callback):
        count = 0

        def on_train_batch_end(self, batch, logs=None):
            self.count += 1
            if self.count == 7:
                seen["wrote"] = backup.save_now("test", batch=batch, logs=logs)
                seen["again"] = backup.save_now("test", batch=batch, logs=logs)
                seen["position"] = backup.position
                raise Interrupt("stop")

    with pytest.raises(Interrupt):
        run(strategy, "shuffled", [backup, SaveAt()])
    assert seen == {"wrote": True, "again": False, "position": Position(1, 2, 7)}
    assert backup.restore_point == Position(1, 2, 7)
    resumed = BackupAndRestore(d, save_freq=100)
    assert resumed.position == resumed.restore_point == Position(1, 2, 7)
    m, _ = run(strategy, "shuffled", [resumed], model_seed=5)
    assert max_diff(state(m), reference(strategy, "shuffled")[0]) <= TOL

    early = BackupAndRestore(str(tmp_path / "c"), save_freq=100)

    class TooEarly(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            early.save_now("TooEarly", batch=batch, logs=logs)

    with pytest.raises(TfdpError, match="TooEarly runs before its BackupAndRestore"):
        run(strategy, "dataset", [TooEarly(), early])


def test_position_input_false_leaves_the_input_alone(strategy, tmp_path):
    """position_input=False: fit's data is the caller's business (here not positioned at all:
    epoch 0 runs all its batches again after the 3 restored steps)."""
    from tfdp.callbacks import BackupAndRestore
    d = str(tmp_path / "b")
    with pytest.raises(Interrupt):
        run(strategy, "dataset", [BackupAndRestore(d, save_freq=1), kill_at(3)])
    b = BackupAndRestore(d, save_freq=1, position_input=False)
    assert (b.initial_epoch, b.start_step) == (0, 3)
    m, _ = run(strategy, "dataset", [b], model_seed=5)
    assert b.restored and int(np.asarray(m.optimizer.iterations)) == 3 + EPOCHS * (N // BATCH)


def test_keras_internals_used_by_callbacks_exist(tmp_path):
    """Every Keras internal tfdp.callbacks relies on (tfdp/compat/) exists in this Keras."""
    import keras
    from tfdp import compat
    for name, (owner, attr) in compat.keras_callbacks_hook_points().items():
        assert attr in owner.__dict__, name
    from keras.src.trainers.epoch_iterator import EpochIterator
    ei = EpochIterator(np.zeros((4, 1)), batch_size=2)
    for attr in ("_num_batches", "_steps_seen", "steps_per_epoch", "_interrupted_warning",
                 "data_adapter"):
        assert hasattr(ei, attr), attr
    b = keras.callbacks.BackupAndRestore(str(tmp_path))
    for attr in compat._KERAS_BACKUP_PATHS:
        assert isinstance(getattr(b, attr), str), attr
    assert callable(keras.callbacks.ModelCheckpoint._get_file_path)
    import tensorflow as tf
    assert compat.shuffle_dataset_seeds(tf.data.Dataset.range(3).shuffle(3, seed=1)) is not None

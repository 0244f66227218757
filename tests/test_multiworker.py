"""MultiWorkerDataParallelStrategy: 2 workers x 2 CPU replicas through `tfdp launch` equal one device.

Each test runs a worker script through ``tfdp.testing.run_workers`` (127.0.0.1, free ports, hard
timeouts, child tracebacks in the failure) and compares with single-device training computed in
this test process. The workers import the training code from this module (``fit_and_evaluate``,
``custom_loop``), so both sides run exactly the same code.
"""

import os

import numpy as np
import pytest

from tfdp.testing import parse_results, run_workers

pytestmark = [pytest.mark.timeout(300)]

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-5
N_EXAMPLES, BATCH, EPOCHS = 210, 50, 2  # batches 50,50,50,50,10: uneven over 4 replicas
ENV = {"TFDP_TEST_DIR": TESTS_DIR, "CUDA_VISIBLE_DEVICES": ""}


# --- training code shared by the workers and the single-device reference -----------------------

def fit_and_evaluate(strategy, seed, batch_size=BATCH):
    """Keras fit/evaluate/predict; returns (model, results dict)."""
    from helpers import build, make_data
    x, y = make_data(N_EXAMPLES)
    m = build(strategy, "adam", seed=seed)
    hist = m.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0).history
    ev = m.evaluate(x, y, batch_size=37, verbose=0, return_dict=True)
    pred = m.predict(x, batch_size=37, verbose=0)
    return m, {"loss": hist["loss"], "mae": hist["mae"], "eval": ev, "pred": pred}


def custom_loop(strategy, seed):
    """A custom training loop: compute_average_loss(global_batch_size) + strategy.reduce."""
    import contextlib
    import keras
    import tensorflow as tf
    from helpers import dense_embedding_model, make_data
    x, y = make_data(N_EXAMPLES, seed=7)
    with strategy.scope() if strategy else contextlib.nullcontext():
        model = dense_embedding_model(seed=seed)
        opt = keras.optimizers.SGD(0.05, momentum=0.9)
        opt.build(model.trainable_variables)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)

    def step(inputs, global_batch):
        xb, yb = inputs
        with tf.GradientTape() as tape:
            per_example = tf.reduce_mean(tf.square(model(xb, training=True) - yb), axis=-1)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if strategy is None:
        data, train_step = ds, tf.function(step)
    else:
        data = strategy.experimental_distribute_dataset(ds)

        @tf.function
        def train_step(batch, global_batch):
            return strategy.reduce("SUM", strategy.run(step, (batch, global_batch)), axis=None)

    losses = []
    for _ in range(EPOCHS):
        for i, batch in enumerate(data):
            global_batch = tf.constant(min(BATCH, N_EXAMPLES - i * BATCH), tf.int64)
            losses.append(float(train_step(batch, global_batch)))
    return model, opt, losses


# --- worker scripts ----------------------------------------------------------------------------

_SAVE_STATE = """
def save_state(path, model, optimizer, strategy):
    import numpy as np
    arrays, replicas_identical = {}, True
    for i, v in enumerate(list(model.variables) + list(optimizer.variables)):
        copies = [np.asarray(c) for c in strategy.experimental_local_results(getattr(v, "value", v))]
        replicas_identical &= all(np.array_equal(c, copies[0]) for c in copies)
        arrays[f"v{i:03d}"] = copies[0]
    np.savez(path, **arrays)
    return bool(replicas_identical), len(copies)
"""

FIT_SCRIPT = """
import os, sys
import tfdp
# The unchanged single-worker line: TF_CONFIG from the launcher makes it multi-worker.
strategy = tfdp.DataParallelStrategy()  # at program start-up, before any TF op
from tfdp.strategy.multiworker import MultiWorkerDataParallelStrategy
assert isinstance(strategy, MultiWorkerDataParallelStrategy), type(strategy)
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
import tensorflow as tf
from tfdp.testing import emit_result
from test_multiworker import fit_and_evaluate
""" + _SAVE_STATE + """
rank = strategy.cluster.rank
# Exactly once: which elements of each global batch this worker's replicas get.
seen = [[c.numpy().tolist() for c in strategy.experimental_local_results(b)]
        for b in strategy.experimental_distribute_dataset(tf.data.Dataset.range(210).batch(50))]
# Different initial weights on each worker: worker 0's must win (broadcast at creation).
model, res = fit_and_evaluate(strategy, seed=1 + rank, batch_size=int(os.environ["BATCH"]))
identical, local_copies = save_state(os.path.join(os.environ["OUT_DIR"], f"w{rank}.npz"),
                                     model, model.optimizer, strategy)
emit_result(res, rank=rank, replicas=strategy.num_replicas_in_sync, seen=seen,
            replicas_identical=identical, local_copies=local_copies, repr=repr(strategy))
"""

LOOP_SCRIPT = """
import os, sys
import tfdp
tfdp.configure_cpu_replicas(int(os.environ["TFDP_CPU_REPLICAS"]))  # starts the TF runtime first
from tfdp.strategy.multiworker import MultiWorkerDataParallelStrategy
strategy = MultiWorkerDataParallelStrategy(all_reduce="ring")
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
from tfdp.testing import emit_result
from test_multiworker import custom_loop
""" + _SAVE_STATE + """
rank = strategy.cluster.rank
model, opt, losses = custom_loop(strategy, seed=3 + rank)
identical, _ = save_state(os.path.join(os.environ["OUT_DIR"], f"w{rank}.npz"), model, opt,
                          strategy)
emit_result(rank=rank, losses=losses, replicas_identical=identical, all_reduce=strategy.all_reduce)
"""


def _load(path):
    with np.load(path) as f:
        return [f[k] for k in sorted(f.files)]


def _state(model, optimizer):
    return [np.asarray(getattr(v, "value", v)) for v in
            list(model.variables) + list(optimizer.variables)]


def _max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
               for x, y in zip(a, b))


def _assert_bitwise_equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        np.testing.assert_array_equal(x, y, err_msg=f"variable {i} differs between workers")


# --- tests -------------------------------------------------------------------------------------

# 2 x 2: batches of 50 split 13,13 | 13,11 and the last (10) 3,3 | 3,1 over the 4 replicas.
# 2 x 1: one device per worker (Keras sees plain tensors, not PerReplica): batches of 51 split
# 26 | 25 and the last (6) 3 | 3.
@pytest.mark.parametrize("cpu_replicas,batch", [(2, 50), (1, 51)])
def test_keras_fit_evaluate_predict_two_workers_equal_single_device(worker_job, tmp_path,
                                                                    cpu_replicas, batch):
    outputs = run_workers(FIT_SCRIPT, workers=2, cpu_replicas=cpu_replicas, timeout=150,
                          env=dict(ENV, OUT_DIR=str(tmp_path), BATCH=str(batch)))
    results = parse_results(outputs)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["replicas"] == 2 * cpu_replicas and r["local_copies"] == cpu_replicas
               for r in results)
    assert all(r["replicas_identical"] for r in results), "a worker's replica copies differ"

    # Exactly once: in every global batch, each element reaches exactly one replica.
    steps = list(zip(*(r["seen"] for r in results)))
    assert len(steps) == 5
    for i, per_worker in enumerate(steps):
        got = sorted(e for replicas in per_worker for rep in replicas for e in rep)
        assert got == list(range(50 * i, min(50 * (i + 1), 210))), f"global batch {i}: {got}"

    # Weights, optimizer slots and counters are bitwise identical on both workers.
    w0, w1 = _load(tmp_path / "w0.npz"), _load(tmp_path / "w1.npz")
    _assert_bitwise_equal(w0, w1)
    # Loss/metrics/evaluate/predict are global: identical on both workers.
    for key in ("loss", "mae", "eval", "pred"):
        assert results[0][key] == results[1][key], key

    # ... and equal to one device trained on the same global batches.
    ref, ref_res = fit_and_evaluate(None, seed=1, batch_size=batch)
    assert _max_diff(w0, _state(ref, ref.optimizer)) <= TOL
    np.testing.assert_allclose(results[0]["loss"], ref_res["loss"], rtol=1e-5)
    np.testing.assert_allclose(results[0]["mae"], ref_res["mae"], rtol=1e-5)
    for k, v in ref_res["eval"].items():
        np.testing.assert_allclose(results[0]["eval"][k], v, rtol=1e-5)
    pred = np.asarray(results[0]["pred"], dtype=np.float32)
    assert pred.shape == ref_res["pred"].shape == (N_EXAMPLES, 1)
    np.testing.assert_allclose(pred, ref_res["pred"], rtol=1e-5, atol=1e-6)


def test_custom_loop_two_workers_equal_single_device(worker_job, tmp_path):
    outputs = run_workers(LOOP_SCRIPT, workers=2, cpu_replicas=2, timeout=150,
                          env=dict(ENV, OUT_DIR=str(tmp_path)))
    results = parse_results(outputs)
    assert all(r["replicas_identical"] and r["all_reduce"] == "ring" for r in results)
    w0, w1 = _load(tmp_path / "w0.npz"), _load(tmp_path / "w1.npz")
    _assert_bitwise_equal(w0, w1)
    assert results[0]["losses"] == results[1]["losses"]

    ref, ref_opt, ref_losses = custom_loop(None, seed=3)
    assert _max_diff(w0, _state(ref, ref_opt)) <= TOL
    np.testing.assert_allclose(results[0]["losses"], ref_losses, rtol=1e-5)


def test_run_workers_reports_child_tracebacks(worker_job):
    script = """
        import os, time
        from tfdp.testing import emit_result
        if os.environ["TFDP_WORKER_RANK"] == "1":
            raise RuntimeError("boom in worker 1")
        emit_result(ok=True)
        time.sleep(60)
    """
    with pytest.raises(AssertionError) as info:
        run_workers(script, workers=2, cpu_replicas=None, timeout=60)
    text = str(info.value)
    assert "failed (exit code 1)" in text and "worker 1 (127.0.0.1:" in text
    assert "RuntimeError: boom in worker 1" in text and "----- worker 0 -----" in text


def test_run_workers_timeout_is_hard(worker_job):
    with pytest.raises(AssertionError, match="timed out after 2 s"):
        run_workers("import time\ntime.sleep(120)\n", workers=2, cpu_replicas=None, timeout=2)


def test_parse_results_per_worker():
    outs = ['noise\nRESULT {"a": 1}\n', 'RESULT {"a": 0}\nRESULT {"a": 2, "b": [1.5]}\n']
    assert parse_results(outs) == [{"a": 1}, {"a": 2, "b": [1.5]}]
    with pytest.raises(AssertionError, match="worker 1 printed no RESULT"):
        parse_results(['RESULT {}', 'nothing'])


def test_single_worker_cluster_is_rejected():
    from tfdp.cluster import ClusterInfo
    from tfdp.errors import TfdpError
    from tfdp.strategy.multiworker import MultiWorkerDataParallelStrategy
    with pytest.raises(TfdpError, match="2 or more workers"):
        MultiWorkerDataParallelStrategy(cluster=ClusterInfo())


COMPRESSION_SCRIPT = """
import tfdp
strategy = tfdp.DataParallelStrategy(compression="fp16")
import numpy as np
import tensorflow as tf
from tfdp.testing import emit_result
SHAPES = [(3,), (5, 4), (300000,)]  # the last is above bucket_bytes: packed only when compressed
rank = strategy.cluster.rank
# the same call gives the multi-worker strategy, and it is a DataParallelStrategy too
assert isinstance(strategy, tfdp.DataParallelStrategy), type(strategy)
assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), type(strategy)
assert (strategy.num_workers, strategy.worker_index) == (2, rank), strategy
assert strategy.is_chief == (rank == 0) and tfdp.strategy.worker_role(strategy).count == 2

def make(ctx):
    g = ctx.replica_id_in_sync_group  # this replica's global index (0..3)
    floats = [tf.cast(tf.reshape(tf.range(int(np.prod(s))), s) % 7, tf.float32) * 0.25 + g
              for s in SHAPES]
    return floats + [tf.fill([4], g + 1)]          # + an int32 tensor (never compressed)

values = strategy.experimental_distribute_values_from_function(make)

@tf.function
def step(vals):
    ctx = lambda: tf.distribute.get_replica_context()
    return strategy.run(lambda v: (ctx().all_reduce("SUM", v), ctx().all_reduce("MEAN", v[:-1])),
                        args=(vals,))

total, mean = step(values)
strategy.run(tf.function(lambda v: tf.distribute.get_replica_context().all_reduce("SUM", v[:-1])),
             args=(values,))
plan = [len(b.indices) for b in strategy.cross_device_ops.last_plan]
first = lambda t: strategy.experimental_local_results(t)[0].numpy()
n = strategy.num_replicas_in_sync
err_sum, err_mean = [], []
for i, s in enumerate(SHAPES):
    want = sum((np.arange(int(np.prod(s))) % 7).reshape(s) * 0.25 + g for g in range(n))
    err_sum.append(float(np.max(np.abs(first(total[i]) - want) / np.abs(want).max())))
    err_mean.append(float(np.max(np.abs(first(mean[i]) - want / n) / np.abs(want / n).max())))
emit_result(rank=rank, err_sum=err_sum, err_mean=err_mean, ints=first(total[3]).tolist(),
            digest=float(sum(first(t).astype(np.float64).sum() for t in total)), n=n,
            plan=plan)
"""


def test_fp16_compression_two_workers_sums_within_tolerance(worker_job):
    outputs = run_workers(COMPRESSION_SCRIPT, workers=2, cpu_replicas=2, timeout=150, env=ENV)
    results = parse_results(outputs)
    assert results[0]["digest"] == results[1]["digest"]  # the same sums on both workers
    for r in results:
        assert r["n"] == 4
        assert max(r["err_sum"]) <= 1e-3 and max(r["err_mean"]) <= 1e-3  # fp16 tolerance
        assert r["ints"] == [1 + 2 + 3 + 4] * 4  # ints exact (never compressed)
    # one packed float16 bucket for all three float tensors (the large one included)
    assert 3 in results[0]["plan"]

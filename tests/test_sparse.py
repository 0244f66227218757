"""Sparse gradients (IndexedSlices): the gather-or-densify rule, both paths' exactness locally and
across workers, Keras fit with an Embedding, and the sparse benchmark."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.reduce import sparse
from tfdp.reduce.algorithms import tree_sum
from tfdp.reduce import Reducer
from tfdp.reduce.options import ReduceOptions
from tfdp.testing import parse_results, run_workers

DEVS4 = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


# --- the rule ------------------------------------------------------------------------------------

class TestRule:
    def test_limit_is_ratio_times_table_over_row_bytes(self):
        # table 1000 x 16 float32 = 64,000 bytes; a gathered row is 16*4 + 8 = 72 bytes
        assert sparse.gather_row_limit(16, 1000, 4, 8, workers=2, ratio=1.0) == 64_000 // 72
        assert sparse.gather_row_limit(16, 1000, 4, 8, workers=2, ratio=2.0) == 128_000 // 72
        assert sparse.gather_row_limit(16, 1000, 4, 8, workers=1, ratio=None) == (
            None if sparse.LOCAL_GATHER_MAX_RATIO is None else
            int(sparse.LOCAL_GATHER_MAX_RATIO * 64_000 // 72))

    def test_choose_at_the_boundary(self):
        limit = 64_000 // 72
        assert sparse.choose(limit, 16, 1000, 4, 8, workers=2, ratio=1.0) == "gather"
        assert sparse.choose(limit + 1, 16, 1000, 4, 8, workers=2, ratio=1.0) == "densify"
        assert sparse.choose(0, 16, 1000, 4, 8, workers=2, ratio=1.0) == "gather"

    def test_measured_thresholds(self):
        # one process: gathering never lost the reduction (docs/benchmarks/sparse.txt)
        assert sparse.gather_max_ratio(1) == sparse.LOCAL_GATHER_MAX_RATIO
        assert sparse.gather_max_ratio(4) == sparse.WORKERS_GATHER_MAX_RATIO
        # recommender shape: 1M x 64 table, 4 replicas x 2048 ids -> gather everywhere
        assert sparse.choose(4 * 2048, 64, 1_000_000, 4, 4, workers=1) == "gather"
        assert sparse.choose(2 * 4 * 2048, 64, 1_000_000, 4, 4, workers=2) == "gather"
        # a small table hit by many ids: densify across workers
        assert sparse.choose(100_000, 64, 1000, 4, 4, workers=2) == "densify"

    def test_local_rule_follows_the_constant(self, monkeypatch):
        monkeypatch.setattr(sparse, "LOCAL_GATHER_MAX_RATIO", None)
        assert sparse.choose(10**9, 8, 10, 4, 8, workers=1) == "gather"
        monkeypatch.setattr(sparse, "LOCAL_GATHER_MAX_RATIO", 0.5)
        assert sparse.choose(10**9, 8, 10, 4, 8, workers=1) == "densify"

    @pytest.mark.parametrize("bad", [-1, 1.5, "3", True, None])
    def test_choose_validates(self, bad):
        with pytest.raises(ValueError, match="gathered_rows"):
            sparse.choose(bad, 8, 10, 4, 8)

    def test_mode_kwarg_env_default(self, monkeypatch):
        monkeypatch.delenv(sparse.ENV, raising=False)
        assert sparse.resolve_mode() == "auto"
        monkeypatch.setenv(sparse.ENV, " Densify ")
        assert sparse.resolve_mode() == "densify"
        assert sparse.resolve_mode("GATHER") == "gather"  # the kwarg wins
        assert Reducer().sparse == "densify"
        monkeypatch.setenv(sparse.ENV, "dense")
        with pytest.raises(ValueError, match=r"Invalid TFDP_SPARSE.*'dense'.*'auto', 'gather', "
                                             r"'densify'"):
            sparse.resolve_mode()
        with pytest.raises(ValueError, match="Invalid sparse"):
            Reducer(sparse="sometimes")
        r = Reducer(sparse="gather")
        with pytest.raises(ValueError, match="Valid: 'auto', 'gather', 'densify'"):
            r.sparse = 3
        assert "sparse='gather'" in repr(r)


# --- local exactness -----------------------------------------------------------------------------

TABLE = (37, 5)
ROWS = [9, 4, 0, 6]  # replica 2 has an empty batch


def _slices_inputs(seed=0, nan_replica=None):
    rng = np.random.default_rng(seed)
    idx = [rng.integers(0, TABLE[0], size=n).astype(np.int32) for n in ROWS]
    idx[0][:3] = 7  # duplicates within and across replicas
    idx[1][0] = 7
    vals = [rng.normal(size=(n, TABLE[1])).astype(np.float32) for n in ROWS]
    if nan_replica is not None:
        vals[nan_replica][:] = np.nan
    return idx, vals


def _reduce(strategy, idx, vals, op, weights=None, dynamic=False, densify_ok=False):
    """all_reduce of per-replica IndexedSlices through the strategy's reducer."""
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.IndexedSlices(tf.constant(vals[ctx.replica_id_in_sync_group]),
                                     tf.constant(idx[ctx.replica_id_in_sync_group]),
                                     tf.constant(TABLE, tf.int32)))
    kinds = []

    @tf.function
    def step(v):
        def replica_fn(s):
            # a static dense_shape, as Keras's Embedding gradients have
            s = tf.IndexedSlices(s.values, s.indices, tf.constant(TABLE, tf.int32))
            if dynamic:  # hide the row count from the trace
                keep = tf.ones(tf.shape(s.indices), tf.bool)
                s = tf.IndexedSlices(tf.boolean_mask(s.values, keep),
                                     tf.boolean_mask(s.indices, keep), s.dense_shape)
            return s
        pr = strategy.run(replica_fn, args=(v,))
        w = None if weights is None else [tf.constant(x, tf.float32) for x in weights]
        options = ReduceOptions(weights=w, densify_ok=densify_ok)
        out = strategy.cross_device_ops.all_reduce(op, [pr], options)[0]
        comps = strategy.experimental_local_results(out)
        kinds.append(type(comps[0]).__name__)
        return [tf.convert_to_tensor(c) for c in comps]

    return [np.asarray(c) for c in step(per_replica)], kinds[0]


def _want(idx, vals, op, weights=None):
    want = np.zeros(TABLE, np.float64)
    for r in range(len(idx)):
        w = 1.0 if weights is None else weights[r]
        if w == 0:
            continue
        np.add.at(want, idx[r], w * vals[r].astype(np.float64))
    return want / (len(idx) if op == "MEAN" else 1)


MODES = {  # name -> (sparse mode, LOCAL_GATHER_MAX_RATIO, densify_ok, hide shapes, slices?)
    "gather": ("gather", None, False, False, True),
    "densify": ("densify", None, False, False, False),
    "auto_static_densify": ("auto", 0.5, True, False, False),
    "auto_runtime_densify": ("auto", 0.5, True, True, True),   # tf.cond: IndexedSlices both ways
    "auto_runtime_gather": ("auto", 50.0, True, True, True),
    "auto_not_densify_ok": ("auto", 0.5, False, False, True),  # would densify, but may not
}


@pytest.mark.parametrize("case", list(MODES))
@pytest.mark.parametrize("op,weighted", [("SUM", False), ("SUM", True), ("MEAN", True)])
def test_local_paths_equal_dense_reference(case, op, weighted, monkeypatch):
    mode, ratio, densify_ok, dynamic, is_slices = MODES[case]
    monkeypatch.setattr(sparse, "LOCAL_GATHER_MAX_RATIO", ratio)
    s = tfdp.DataParallelStrategy(DEVS4)
    s.cross_device_ops.sparse = mode
    # uneven weights; replica 2 (empty) has weight 0, replica 3 weight 0 with NaN values
    weights = [1.25, 0.75, 0.0, 0.0] if weighted else None
    idx, vals = _slices_inputs(nan_replica=3 if weighted else None)
    got, got_kind = _reduce(s, idx, vals, op, weights, dynamic, densify_ok)
    assert (got_kind == "IndexedSlices") == is_slices, got_kind
    want = _want(idx, vals, op, weights)
    for g in got:  # every replica gets the same, exact result
        assert g.shape == TABLE
        np.testing.assert_allclose(g, want, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(g, got[0])


def test_per_replica_densify_through_the_dense_path():
    """The GPU variant (densify on every replica, then the dense bucket algorithm)."""
    from tfdp.devices import canonical
    devices = [canonical(d) for d in DEVS4]
    idx, vals = _slices_inputs(seed=1)
    comps = []
    for r, d in enumerate(devices):
        with tf.device(d):
            comps.append(tf.IndexedSlices(tf.constant(vals[r]), tf.constant(idx[r]),
                                          tf.constant(TABLE, tf.int32)))

    def dense_reduce(bufs):
        total = tree_sum(bufs, devices)
        return [total for _ in devices]

    out = sparse.reduce_local(comps, [tf.constant(w) for w in (1.0, 2.0, 0.5, 0.0)], devices,
                              "densify", scale=0.25, dense_reduce=dense_reduce)
    want = _want(idx, vals, "MEAN", [1.0, 2.0, 0.5, 0.0])
    for o in out:
        assert not isinstance(o, tf.IndexedSlices)
        np.testing.assert_allclose(o.numpy(), want, atol=1e-6)


# --- Keras fit -----------------------------------------------------------------------------------

_REF = {}


def _fit(strategy, epochs=1, opt="sgd_momentum"):
    from helpers import build, make_data
    x, y = make_data(210)
    m = build(strategy, opt)
    m.fit(x, y, batch_size=50, epochs=epochs, shuffle=False, verbose=0)
    return m


# Densifying is exact for optimizers linear in the gradient (SGD, momentum); Keras's Adam squares
# IndexedSlices rows before duplicates are summed, so Adam runs the gather path ("auto" without
# densify_ok), which keeps the single-device semantics.
@pytest.mark.parametrize("case,opt", [("gather", "adam"), ("densify", "sgd_momentum"),
                                      ("auto_runtime", "sgd_momentum")])
def test_keras_fit_with_embedding_equals_single_device(case, opt, monkeypatch):
    from helpers import TOL, assert_replicas_identical, max_diff
    if opt not in _REF:
        _REF[opt] = _fit(None, opt=opt).get_weights()
    s = tfdp.DataParallelStrategy(DEVS4)
    if case != "auto_runtime":
        s.cross_device_ops.sparse = case
    else:
        # vocab 50 x 8 float32 = 1,600 bytes; batches of 50 (4 ids each) gather 200 rows of 36
        # bytes (4.5x the table: densify), the last batch of 10 gathers 40 (0.9x: gather).
        monkeypatch.setattr(sparse, "LOCAL_GATHER_MAX_RATIO", 1.0)
        s.cross_device_ops.sparse = "auto"  # (SGD with momentum: the gradient path lets it densify)
    m = _fit(s, opt=opt)
    assert max_diff(_REF[opt], m.get_weights()) <= TOL
    assert_replicas_identical(s, m)


# --- across workers ------------------------------------------------------------------------------

MW_SCRIPT = """
import os, sys
import numpy as np
import tfdp
strategy = tfdp.DataParallelStrategy()  # multi-worker: TF_CONFIG from the launcher
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
from tfdp.testing import emit_result
from test_sparse import _fit
rank = strategy.cluster.rank
for mode in ("gather", "densify", "auto"):
    os.environ["TFDP_SPARSE"] = mode  # read when the train step is traced
    m = _fit(strategy, epochs=1)
    ws = m.get_weights()
    np.savez(os.path.join(os.environ["OUT_DIR"], f"{mode}-w{rank}.npz"),
             **{f"v{i:03d}": w for i, w in enumerate(ws)})
emit_result(rank=rank, replicas=strategy.num_replicas_in_sync)
"""


@pytest.mark.timeout(150)
def test_two_workers_gather_densify_auto_equal_single_device(worker_job, tmp_path):
    from helpers import TOL, max_diff
    # 2 workers x 2 replicas; batches of 50 split 13,13 | 13,11, the last (10) 3,3 | 3,1. With
    # "auto" (across workers: gather while gathered bytes <= table bytes) the full batches
    # densify (2 x 100 rows of 36 bytes vs a 1,600-byte table) and the last one gathers.
    outputs = run_workers(MW_SCRIPT, workers=2, cpu_replicas=2, timeout=110,
                          env={"TFDP_TEST_DIR": TESTS_DIR, "OUT_DIR": str(tmp_path),
                               "CUDA_VISIBLE_DEVICES": ""})
    assert [r["replicas"] for r in parse_results(outputs)] == [4, 4]
    ref = _fit(None, epochs=1).get_weights()
    for mode in ("gather", "densify", "auto"):
        per_worker = []
        for rank in (0, 1):
            with np.load(tmp_path / f"{mode}-w{rank}.npz") as f:
                per_worker.append([f[k] for k in sorted(f.files)])
        for a, b in zip(*per_worker):
            np.testing.assert_array_equal(a, b, err_msg=f"{mode}: workers differ")
        assert max_diff(ref, per_worker[0]) <= TOL, mode


# --- the benchmark -------------------------------------------------------------------------------

def test_sparse_bench_tiny_run(run_process, tmp_path):
    # In a fresh process: TF's MirroredStrategy numbers its collectives per strategy object from
    # the same keys, so a second one in a process that already ran another's collectives (the
    # rest of this suite) fails with "Collective instance 100 expected type ...".
    path = tmp_path / "sparse.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-m", "tfdp", "bench", "sparse", "--vocab", "3000",
                        "--dim", "8", "--ids-per-batch", "32", "--repeats", "1",
                        "--sweep", "8,2000", "--json", str(path), "--quiet"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    text = p.stdout
    assert "tfdp gather" in text and "tfdp densify" in text and "MS " in text
    assert "sweep" in text and "densify beats gather" in text
    res = json.loads(path.read_text())
    names = [c["contender"] for c in res["main"]["contenders"]]
    assert names[:3] == ["tfdp gather", "tfdp densify", "tfdp auto"]
    assert any(n.startswith("MS ") for n in names) and "MS ReductionToOneDevice" in names
    assert [r["ids_per_batch"] for r in res["sweep"]] == [8, 2000]
    assert set(res["crossover"]) == {"reduce", "dense"}
    assert res["main"]["rule"] == "gather"
    for c in res["main"]["contenders"]:
        assert c["reduce"]["median_s"] > 0 and c["dense"]["median_s"] > 0


def test_sparse_bench_help_and_usage_errors(run_process):
    from tfdp_bench import sparse as bench
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    p = subprocess.run([sys.executable, "-m", "tfdp_bench.sparse", "--help"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--ids-per-batch" in p.stdout and "--sweep" in p.stdout
    assert bench.main(["--vocab", "0"]) == 2
    assert bench.main(["--sweep", "10,x"]) == 2

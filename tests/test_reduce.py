"""Every algorithm and bucket size gives numpy's sums (and means)."""

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.reduce import packing, registry

ALGOS = ["fused", "ring", "one_device"]
DEVS4 = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


def _inputs(shapes, dtype, n, seed=0):
    rng = np.random.default_rng(seed)
    # values exactly representable in every dtype -> sums are exact, whatever the order
    return [[rng.integers(-8, 8, size=s).astype(np.float32) for s in shapes] for _ in range(n)]


def _all_reduce(strategy, per_replica, op, dtype):
    """Replica-context all_reduce of a list of tensors (the path Keras's optimizer takes)."""
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: [tf.constant(a, dtype=dtype) for a in per_replica[ctx.replica_id_in_sync_group]])

    @tf.function
    def step(v):
        return strategy.run(lambda x: tf.distribute.get_replica_context().all_reduce(op, x),
                            args=(v,))

    out = step(values)
    return [[np.asarray(tf.cast(c, tf.float32)) for c in strategy.experimental_local_results(o)]
            for o in out]


SHAPES = {
    "odd": [(3,), (7, 5), (1,), (2, 3, 3), ()],
    "many_tiny": [(2,)] * 200 + [(1, 1)] * 50,
    "huge": [(3_000_001,)],
    "mixed": [(1000, 33), (5,), (257,), (4096, 65), (1,)],
}


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("bucket", [0, 256, None])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", ["odd", "mixed"])
def test_sum_equals_numpy(algo, bucket, dtype, case):
    s = tfdp.DataParallelStrategy(DEVS4, all_reduce=algo, bucket_bytes=bucket)
    ins = _inputs(SHAPES[case], dtype, 4)
    out = _all_reduce(s, ins, tf.distribute.ReduceOp.SUM, dtype)
    for i, per_dev in enumerate(out):
        want = sum(ins[r][i] for r in range(4))
        for got in per_dev:  # every replica receives the same, correct sum
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("case", ["many_tiny", "huge"])
def test_sum_extreme_shapes(algo, case):
    s = tfdp.DataParallelStrategy(DEVS4, all_reduce=algo)
    ins = _inputs(SHAPES[case], "float32", 4, seed=1)
    out = _all_reduce(s, ins, "SUM", tf.float32)
    for i, per_dev in enumerate(out):
        want = sum(ins[r][i] for r in range(4))
        for got in per_dev:
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("n", [1, 2, 3])
def test_mean_and_replica_counts(algo, n):
    s = tfdp.DataParallelStrategy(DEVS4[:n], all_reduce=algo, bucket_bytes=64)
    ins = _inputs(SHAPES["odd"], "float32", n, seed=2)
    out = _all_reduce(s, ins, tf.distribute.ReduceOp.MEAN, tf.float32)
    assert len(out[0]) == n
    for i, per_dev in enumerate(out):
        want = sum(ins[r][i] for r in range(n)) / n
        for got in per_dev:
            np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_compression_sums_within_tolerance(compression):
    s = tfdp.DataParallelStrategy(DEVS4, compression=compression)
    rng = np.random.default_rng(3)
    ins = [[rng.normal(size=(513,)).astype(np.float32), rng.normal(size=(4, 7)).astype(np.float32)]
           for _ in range(4)]
    tol = 2e-2 if compression == "bf16" else 2e-3
    for op in ("SUM", "MEAN"):
        out = _all_reduce(s, ins, op, tf.float32)
        for i, per_dev in enumerate(out):
            want = sum(ins[r][i] for r in range(4)) / (4 if op == "MEAN" else 1)
            for got in per_dev:
                assert got.dtype == np.float32
                np.testing.assert_allclose(got, want, atol=tol * 4, rtol=tol)


def test_integer_values_sum():
    s = tfdp.DataParallelStrategy(DEVS4)
    ins = [[np.array([1, 2, 3], np.int32) * (r + 1)] for r in range(4)]
    out = _all_reduce(s, ins, "SUM", tf.int32)
    for got in out[0]:
        np.testing.assert_array_equal(got, [10, 20, 30])


@pytest.mark.parametrize("algo", ALGOS)
def test_indexed_slices_sum(algo):
    """Embedding gradients (IndexedSlices) reduce to the dense sum, duplicates included."""
    s = tfdp.DataParallelStrategy(DEVS4, all_reduce=algo)
    rng = np.random.default_rng(4)
    table = (10, 3)
    idx = [rng.integers(0, 10, size=5) for _ in range(4)]
    vals = [rng.integers(-4, 4, size=(5, 3)).astype(np.float32) for _ in range(4)]

    def value_fn(ctx):
        r = ctx.replica_id_in_sync_group
        return tf.IndexedSlices(tf.constant(vals[r]), tf.constant(idx[r]), tf.constant(table))

    per_replica = s.experimental_distribute_values_from_function(value_fn)

    @tf.function
    def step(v):
        def fn(x):
            y = tf.distribute.get_replica_context().all_reduce("SUM", [x, tf.ones([2])])
            return tf.convert_to_tensor(y[0]), y[1]
        return s.run(fn, args=(v,))

    dense, ones = step(per_replica)
    want = np.zeros(table, np.float32)
    for r in range(4):
        np.add.at(want, idx[r], vals[r])
    for got in s.experimental_local_results(dense):
        np.testing.assert_array_equal(got, want)
    for got in s.experimental_local_results(ones):
        np.testing.assert_array_equal(got, [4.0, 4.0])


def test_strategy_reduce_and_gather_to_host():
    s = tfdp.DataParallelStrategy(DEVS4)
    v = s.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([2], float(ctx.replica_id_in_sync_group)))
    np.testing.assert_array_equal(s.reduce("SUM", v, axis=None), [6.0, 6.0])
    np.testing.assert_array_equal(s.reduce("MEAN", v, axis=None), [1.5, 1.5])
    assert float(s.reduce("SUM", v, axis=0)) == 12.0
    np.testing.assert_array_equal(s.gather(v, axis=0), [0, 0, 1, 1, 2, 2, 3, 3])
    # batch_reduce_to from cross-replica context
    out = s.extended.batch_reduce_to("SUM", [(v, v), (v, v)])
    for o in out:
        for c in s.experimental_local_results(o):
            np.testing.assert_array_equal(c, [6.0, 6.0])


def test_bucket_plan_groups_small_tensors_by_dtype():
    f32, f16 = tf.float32, tf.float16
    specs = [(f32, 10, 4), (f16, 10, 2), (f32, 10, 4), (f32, 1000, 4), (f32, None, 4), (f16, 5, 2)]
    plan = packing.plan(specs, bucket_bytes=1000)
    groups = [(b.indices, b.fused) for b in plan]
    assert groups == [([0, 2], True), ([1, 5], True), ([3], False), ([4], False)]
    assert [b.indices for b in packing.plan(specs, 0)] == [[i] for i in range(6)]
    # capacity respected: 30 tensors of 400 bytes in buckets of 1000 bytes -> 2 per bucket
    plan = packing.plan([(f32, 100, 4)] * 30, 1000)
    assert all(b.nbytes <= 1000 for b in plan) and len(plan) == 15


def test_fusion_reduces_number_of_reductions():
    s = tfdp.DataParallelStrategy(DEVS4, bucket_bytes=1 << 20)
    _all_reduce(s, _inputs(SHAPES["many_tiny"], "float32", 4), "SUM", tf.float32)
    assert len(s.cross_device_ops.last_plan) == 1  # 250 tiny tensors -> one bucket


class TestAutoSelection:
    """NCCL selection logic with faked device lists (NCCL cannot run on CPU)."""

    GPUS = [f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(4)]
    CPUS = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]

    def test_auto_picks_nccl_on_physical_gpus(self):
        c = registry.choose("auto", self.GPUS, physical_gpus=4, nccl_kernel=True)
        assert c.algorithm == "nccl"

    @pytest.mark.parametrize("devices,phys,kernel,why", [
        (CPUS, 0, True, "not every device is a GPU"),
        (GPUS[:2] + CPUS[:1], 2, True, "not every device is a GPU"),
        (GPUS, 2, True, "share 2 physical GPU"),
        (GPUS, 4, False, "no NCCL kernel"),
    ])
    def test_auto_falls_back_to_fused(self, devices, phys, kernel, why):
        c = registry.choose("auto", devices, physical_gpus=phys, nccl_kernel=kernel)
        assert c.algorithm == "fused" and why in c.reason
        with pytest.raises(ValueError, match="nccl") as e:
            registry.choose("nccl", devices, physical_gpus=phys, nccl_kernel=kernel)
        assert why in str(e.value)

    def test_one_gpu_needs_no_nccl(self):
        assert registry.choose("auto", self.GPUS[:1], physical_gpus=1,
                               nccl_kernel=True).algorithm == "fused"

    def test_explicit_choices_are_kept(self):
        for a in ("fused", "ring", "one_device"):
            assert registry.choose(a, self.GPUS, physical_gpus=4, nccl_kernel=True).algorithm == a

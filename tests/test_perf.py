"""The fast paths of issue #14 (task perf): each one exact, and each one actually taken.

* Embedding lookups in a tfdp step read rows (``ResourceGather``), not the whole table, when a
  plain SGD updates the table with scatters (``tfdp.keras.gradient_path._take``): same values
  (negative ids wrap as in Keras), same training as one device, no whole-table read left in the
  traced step; tables with dense updates (momentum, Adam) keep Keras's read.
* One replica costs nothing (``tfdp_bench.overhead``): no buckets in its all-reduce, the dataset
  iterated directly (``OneReplicaDataset``), and training equal to plain Keras.
* Cross-worker bucket caps: compressed buckets packed up to 64 MiB, float32 ones at the local
  ``bucket_bytes`` (packing them was measured slower), overridable for the benchmark.

Timings are not asserted here (the benchmarks measure them side by side, alternating rounds).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import max_diff

import tfdp
from tfdp import compat as tfp
from tfdp.keras import gradient_path

DEVS = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
VOCAB, DIM, IDS = 50, 4, 3


def _embedding_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((IDS,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM, name="emb")(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(5, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(1)(x))


def _data(n=52, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, VOCAB, (n, IDS)).astype(np.int32),
            rng.standard_normal((n, 1)).astype(np.float32))


def _train(strategy, optimizer, epochs=2, batch=13):
    x, y = _data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    scope = strategy.scope() if strategy is not None else _null()
    with scope:
        model = _embedding_model()
        model.compile(optimizer=optimizer(), loss="mse")
    model.fit(ds, epochs=epochs, verbose=0, shuffle=False)
    return model


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_perf_hook_points_exist_in_the_installed_keras():
    strategy = tfdp.DataParallelStrategy(DEVS[:2])  # installs the hooks while it lives
    points = tfp.keras_perf_hook_points()
    assert set(points) == set(gradient_path._PERF_HOOKS)
    for name, (owner, attr) in points.items():
        assert callable(getattr(owner, attr)), f"{name}: {owner.__name__}.{attr} is gone"
        original = getattr(getattr(owner, attr), "__tfdp_original__", None)
        assert callable(original), f"{name} is not wrapped"


OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1),
              "momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(0.01)}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_sparse_reads_train_as_one_device(opt):
    # 52 examples in batches of 13 over 4 replicas: uneven (4,3,3,3), and a sparse update of the
    # table every step (copy-on-read from the first step on)
    ref = _train(None, OPTIMIZERS[opt])
    got = _train(tfdp.DataParallelStrategy(DEVS), OPTIMIZERS[opt])
    assert max_diff(ref.get_weights(), got.get_weights()) <= 1e-5


def _lookup_op_types(strategy, model, ids):
    seen = []

    @tf.function
    def step(i):
        def fn(v):
            out = model(v)
            seen.extend(op.type for op in tf.compat.v1.get_default_graph().get_operations())
            return out
        return strategy.run(fn, args=(i,))

    step(tf.constant(ids))
    return set(seen)


def _built(strategy, optimizer):
    with strategy.scope():
        model = _embedding_model()
        model.compile(optimizer=optimizer(), loss="mse")
        model.optimizer.build(model.trainable_variables)  # (fit builds it before tracing)
    return model


def test_embedding_lookup_is_a_row_read_for_a_table_updated_by_scatters():
    strategy = tfdp.DataParallelStrategy(DEVS[:2])
    x, _ = _data(8)
    model = _built(strategy, OPTIMIZERS["sgd"])
    seen = _lookup_op_types(strategy, model, x[:4])
    assert "ResourceGather" in seen
    assert "GatherV2" not in seen  # (Keras's own take: ReadVariableOp of the table + GatherV2)
    # outside a tfdp step (the default strategy): Keras's own path, which the benchmark's
    # "before" contender writes out (tfdp_bench.embedding._table_read_embedding)
    default = tf.distribute.get_strategy()
    seen = _lookup_op_types(default, _built(default, OPTIMIZERS["sgd"]), x[:4])
    assert "GatherV2" in seen and "ResourceGather" not in seen


@pytest.mark.parametrize("opt", ["momentum", "adam"])
def test_dense_updated_tables_keep_keras_read(opt):
    # a row read would put the table in copy-on-read mode, and every dense update would then
    # copy it (measured 0.6-0.7x): Keras's dense read copies nothing there
    strategy = tfdp.DataParallelStrategy(DEVS[:2])
    x, _ = _data(8)
    model = _built(strategy, OPTIMIZERS[opt])
    seen = _lookup_op_types(strategy, model, x[:4])
    assert "GatherV2" in seen and "ResourceGather" not in seen


def test_negative_ids_wrap_as_in_keras():
    ids = np.array([[-1, 0, 3], [-VOCAB, 7, -2]], np.int32)
    ref_model = _embedding_model()
    want = ref_model.predict(ids, verbose=0)
    strategy = tfdp.DataParallelStrategy(DEVS[:2])
    model = _built(strategy, OPTIMIZERS["sgd"])  # (row reads)
    model.set_weights(ref_model.get_weights())
    got = model.predict(ids, verbose=0, batch_size=2)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_out_of_range_ids_still_fail_clearly():
    strategy = tfdp.DataParallelStrategy(DEVS[:2])
    model = _built(strategy, OPTIMIZERS["sgd"])  # (row reads)
    with pytest.raises(tf.errors.InvalidArgumentError, match="not in"):
        model.predict(np.array([[VOCAB + 3, 0, 1], [0, 1, 2]], np.int32), verbose=0,
                      batch_size=2)


# --- one replica ---------------------------------------------------------------------------------

def _mlp(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(8, activation="relu")(inputs)
    x = keras.layers.Dense(8, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(2)(x))


def test_one_replica_trains_exactly_as_plain_keras():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 6)).astype(np.float32)
    y = rng.standard_normal((50, 2)).astype(np.float32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)  # last batch of 2
    ref = _mlp()
    ref.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=1.0),
                loss="mse", metrics=["mae"])
    h_ref = ref.fit(ds, epochs=3, verbose=0)
    strategy = tfdp.DataParallelStrategy(["CPU:0"])
    with strategy.scope():
        model = _mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=1.0),
                      loss="mse", metrics=["mae"])
    h = model.fit(ds, epochs=3, verbose=0)
    assert max_diff(ref.get_weights(), model.get_weights()) <= 1e-6
    np.testing.assert_allclose(h.history["loss"], h_ref.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(model.evaluate(ds, verbose=0), ref.evaluate(ds, verbose=0),
                               rtol=1e-5)
    assert strategy.cross_device_ops.last_plan == []  # no buckets: the sum of one is the value


def test_one_replica_dataset_is_a_distributed_dataset_iterated_directly():
    strategy = tfdp.DataParallelStrategy(["CPU:0"])
    ds = tf.data.Dataset.range(10).batch(4)
    dist = strategy.experimental_distribute_dataset(ds)
    assert isinstance(dist, tf.distribute.DistributedDataset)
    assert tfp.distributed_dataset_source(dist) is ds
    assert dist.element_spec == ds.element_spec
    batches = [strategy.experimental_local_results(b)[0].numpy().tolist() for b in dist]
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]

    @tf.function
    def total(it):
        return strategy.run(lambda v: tf.reduce_sum(v), args=(next(it),))
    assert int(total(iter(dist))) == 6
    # with options, or several replicas, TF's distributed dataset as before
    options = tf.distribute.InputOptions(experimental_fetch_to_device=False)
    assert type(strategy.experimental_distribute_dataset(ds, options)).__name__ != \
        "OneReplicaDataset"
    many = tfdp.DataParallelStrategy(DEVS[:2]).experimental_distribute_dataset(ds)
    assert type(many).__name__ != "OneReplicaDataset"


def test_one_replica_fit_of_a_generator_leaves_the_users_arrays_alone():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 6)).astype(np.float32)
    y = rng.standard_normal((40, 2)).astype(np.float32)
    x0, y0 = x.copy(), y.copy()

    def gen():
        while True:
            for i in range(0, 40, 8):
                yield x[i:i + 8], y[i:i + 8]
    strategy = tfdp.DataParallelStrategy(["CPU:0"])
    with strategy.scope():
        model = _mlp()
        model.compile(optimizer="sgd", loss="mse")
    model.fit(gen(), steps_per_epoch=5, epochs=2, verbose=0)
    assert np.array_equal(x, x0) and np.array_equal(y, y0)


# --- cross-worker buckets ------------------------------------------------------------------------

def test_cross_worker_bucket_caps():
    from tfdp.reduce import reducer
    dev = ["/job:localhost/replica:0/task:0/device:CPU:0"]
    plain = reducer.Reducer(dev, 2)
    # measured: float32 buckets bigger than the local capacity are slower across workers
    assert reducer.UNCOMPRESSED_BUCKET_BYTES is None
    assert plain.packed_bucket_bytes() == plain.bucket_bytes
    fp16 = reducer.Reducer(dev, 2, compression="fp16")
    assert fp16.packed_bucket_bytes() == reducer.COMPRESSED_BUCKET_BYTES
    assert reducer.Reducer(dev, 2, bucket_bytes=0).packed_bucket_bytes() == 0
    plain.bucket_bytes = 4 << 20  # (what tfdp bench crossworker sweeps)
    assert plain.packed_bucket_bytes() == 4 << 20
    big_local = reducer.Reducer(dev, 2, bucket_bytes=128 << 20)
    assert big_local.packed_bucket_bytes() == 128 << 20  # never below the local capacity
    # one process: the local capacity, compressed or not
    assert reducer.Reducer(dev, 1, compression="fp16").packed_bucket_bytes() == \
        reducer.Reducer(dev, 1).bucket_bytes

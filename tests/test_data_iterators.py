"""tfdp's distributed-dataset iterators (tfdp.data._iterators, tfdp.compat.iterator_internals):
the same elements in the same order as TF's own MultiDeviceIterator (MirroredStrategy on the same
replicas), unread iterators of independent pipelines never built, Python pipelines released
synchronously, and custom loops (iterators made inside a tf.function) unchanged."""

import threading

import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp import compat
from tfdp.data._iterators import pipeline_facts

PIPELINES = {
    "batch": lambda: tf.data.Dataset.range(103).batch(8),
    "uneven": lambda: tf.data.Dataset.range(10).batch(3),   # 3 < 4 replicas: empty replicas
    "shuffle": lambda: tf.data.Dataset.range(103).shuffle(50, seed=3).batch(8),
    "map_prefetch": lambda: (tf.data.Dataset.range(64).map(lambda i: (i, tf.cast(i, tf.float32)))
                             .batch(10).prefetch(tf.data.AUTOTUNE)),
    "random_map": lambda: tf.data.Dataset.range(40).map(
        lambda i: tf.random.stateless_uniform([2], seed=[1, 2]) + tf.cast(i, tf.float32)
    ).batch(8),
    "generator": lambda: tf.data.Dataset.from_generator(
        lambda: iter(range(30)), output_signature=tf.TensorSpec([], tf.int64)).batch(4),
    "slack": lambda: tf.data.Dataset.range(40).batch(8).prefetch(2).with_options(_slack()),
}


def _slack():
    options = tf.data.Options()
    options.experimental_slack = True   # the per-device prefetch then has a slack period
    return options


def _epochs(distributed, epochs=3):
    """Every epoch's elements; after each epoch an unread iterator, as Keras makes one."""
    out = []
    for _ in range(epochs):
        out.append([[c.numpy().tolist() for c in tf.nest.flatten(
            tf.nest.map_structure(lambda v: list(v.values), e))] for e in iter(distributed)])
        unread = iter(distributed)
        del unread
    return out


@pytest.fixture(scope="module")
def strategies(cpu_devices):
    # (ReductionToOneDevice: MirroredStrategy's CPU default, CollectiveAllReduce, reuses collective
    # group keys across instances in one process, and a clash aborts the process's collective
    # executor for every later test; the input path compared here is the same with either)
    return (tfdp.DataParallelStrategy(cpu_devices),
            tf.distribute.MirroredStrategy(
                cpu_devices, cross_device_ops=tf.distribute.ReductionToOneDevice()))


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_same_elements_as_tf_multi_device_iterator(strategies, name):
    tfdp_strategy, mirrored = strategies
    ours = tfdp_strategy.experimental_distribute_dataset(PIPELINES[name]())
    assert type(ours).tfdp_fast_iterators
    ref = _epochs(mirrored.experimental_distribute_dataset(PIPELINES[name]()))
    assert _epochs(ours) == ref
    it = iter(ours)
    assert isinstance(it._iterators[0]._iterator, compat.CachedMultiDeviceIterator)


@pytest.mark.parametrize("buffer_size", [0, 3])
def test_same_elements_with_a_per_replica_buffer_size(strategies, buffer_size):
    # InputOptions(experimental_per_replica_buffer_size): no per-device prefetch at 0 (and the
    # host pipeline's injected prefetch turned off, as TF does), a larger one at 3
    tfdp_strategy, mirrored = strategies
    options = tf.distribute.InputOptions(experimental_per_replica_buffer_size=buffer_size)
    ours = tfdp_strategy.experimental_distribute_dataset(PIPELINES["uneven"](), options)
    ref = mirrored.experimental_distribute_dataset(PIPELINES["uneven"](), options)
    assert _epochs(ours, 2) == _epochs(ref, 2)
    assert isinstance(iter(ours)._iterators[0]._iterator, compat.CachedMultiDeviceIterator)


def test_per_device_options_are_one_setting_in_two_forms():
    # tfdp makes per-device datasets from their ops (serialized options) and, where TF's own
    # per-device dataset is used, with tf.data.Options: the same settings
    from tensorflow.core.framework import dataset_options_pb2
    from tfdp.compat import iterator_internals
    proto = dataset_options_pb2.Options.FromString(iterator_internals._DEVICE_OPTIONS)
    options = tf.data.Options()
    options._from_proto(proto)
    assert options == iterator_internals._python_device_options()
    assert not options.autotune.enabled
    assert not options.experimental_optimization.apply_default_optimizations


def test_mirrored_strategy_is_left_alone(strategies):
    _, mirrored = strategies
    dist = mirrored.experimental_distribute_dataset(PIPELINES["batch"]())
    assert not getattr(type(dist), "tfdp_fast_iterators", False)
    it = iter(dist)
    assert not isinstance(it._iterators[0]._iterator, compat.CachedMultiDeviceIterator)


def test_pipeline_facts():
    assert pipeline_facts(PIPELINES["batch"]()) == {"python": False, "independent": True}
    assert pipeline_facts(PIPELINES["random_map"]())["independent"]
    assert not pipeline_facts(PIPELINES["shuffle"]())["independent"]   # draws a seed per iterator
    assert pipeline_facts(tf.data.Dataset.range(9).shuffle(
        9, seed=1, reshuffle_each_iteration=False).batch(3))["independent"]
    assert pipeline_facts(PIPELINES["generator"]()) == {"python": True, "independent": False}
    counter = tf.Variable(0, dtype=tf.int64)
    writes = tf.data.Dataset.range(9).map(lambda i: i + counter.assign_add(1)).batch(3)
    assert not pipeline_facts(writes)["independent"]
    assert pipeline_facts(None) == {"python": True, "independent": False}


def _built(it):
    return it._iterators[0]._iterator._tfdp_built is not None


def test_unread_iterators_of_independent_pipelines_are_never_built(strategies):
    tfdp_strategy, _ = strategies
    lazy = tfdp_strategy.experimental_distribute_dataset(PIPELINES["batch"]())
    it = iter(lazy)
    assert not _built(it)
    first = next(it)
    assert _built(it) and first.values[0].numpy().tolist() == [0, 1]
    eager = tfdp_strategy.experimental_distribute_dataset(PIPELINES["shuffle"]())
    assert _built(iter(eager))   # its seed draw happens when it is made, as TF's


def test_cpu_replica_generator_functions_are_single_device(strategies):
    # tf.data runs grappler over a multi-device generator function in every new iterator (~10 ms
    # per replica and iterator on CPU): on CPU replicas init and finalize carry the mark TF gives
    # its next function, which makes them single-device (same elements: the test above)
    from tfdp.compat import iterator_internals
    tfdp_strategy, _ = strategies
    next(iter(tfdp_strategy.experimental_distribute_dataset(PIPELINES["batch"]())))
    cached = [f for f in iterator_internals._functions.values() if f is not None]
    assert cached
    for fns in cached:
        for fn in (fns.init_func, fns.next_func, fns.finalize_func):
            assert fn.function_def.attr["experimental_ints_on_device"].b, fn.name


def test_release_in_background_only_without_python(strategies):
    tfdp_strategy, _ = strategies
    for name, background in (("batch", True), ("generator", False)):
        it = iter(tfdp_strategy.experimental_distribute_dataset(PIPELINES[name]()))
        assert it._iterators[0]._iterator._tfdp_release_in_background is background


def test_background_release_thread_drops_what_it_is_given():
    import time

    dropped_in = []

    class Thing:
        def __del__(self):
            dropped_in.append(threading.current_thread().name)

    compat.start_releaser()
    compat.release_in_background([Thing()])
    deadline = time.monotonic() + 10
    while not dropped_in and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped_in == ["tfdp-iterator-release"]


def test_a_release_from_a_finalizer_never_waits_on_the_modules_locks():
    """The garbage collector runs an iterator's __del__ wherever an allocation triggers it: in
    the suite, inside a trace under the module's function-cache lock, and the release waited
    on that lock for good (Keras 3.16's whole suite hung in one worker)."""
    from tfdp.compat import iterator_internals as ii
    from tfdp.compat import iterator_release as ir

    compat.start_releaser()
    done = threading.Event()

    def collect_while_holding_the_locks():
        with ii._lock, ir._releaser_lock:
            compat.release_in_background([object()])
        done.set()

    t = threading.Thread(target=collect_while_holding_the_locks, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set(), "release_in_background waited on a lock its caller held"


def test_custom_loop_iterating_inside_a_tf_function(strategies):
    tfdp_strategy, mirrored = strategies

    def total(strategy):
        dist = strategy.experimental_distribute_dataset(
            tf.data.Dataset.range(40).map(lambda i: tf.cast(i, tf.float32)).batch(8))

        @tf.function
        def run():
            s = tf.constant(0.0)
            for batch in dist:
                per = strategy.run(lambda b: tf.reduce_sum(b), args=(batch,))
                s += strategy.reduce("SUM", per, axis=None)
            return s
        return float(run())

    assert total(tfdp_strategy) == total(mirrored) == float(sum(range(40)))


def test_eager_custom_loop_with_next(strategies):
    tfdp_strategy, _ = strategies
    dist = tfdp_strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(np.arange(32, dtype=np.float32)).batch(8))
    it = iter(dist)
    step = tf.function(lambda b: tfdp_strategy.run(lambda x: tf.reduce_sum(x), args=(b,)))
    sums = [sum(float(v) for v in tfdp_strategy.experimental_local_results(step(next(it))))
            for _ in range(4)]
    assert sums == [float(sum(range(i, i + 8))) for i in range(0, 32, 8)]
    with pytest.raises((StopIteration, tf.errors.OutOfRangeError)):
        next(it)

"""tfdp's gradient path (tfdp.gradient_path): the Keras internals it hooks, and its contract.

The user-pattern matrix (test_user_patterns.py) checks the patterns users write; this module
checks the mechanism: the private names still exist, the hooks change nothing outside a tfdp
step, ``strategy.reduce`` keeps its public meaning, custom loops get the same exact weighting.
"""

import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from tfdp import _tf_private as tfp
from tfdp import gradient_path
from helpers import TOL, max_diff

DEVS = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


def test_every_hooked_keras_name_exists_in_the_installed_keras():
    points = tfp.keras_hook_points()
    assert set(points) == set(gradient_path._HOOKS)
    for name, (owner, attr) in points.items():
        where = owner.__dict__ if isinstance(owner, type) else vars(owner)
        assert attr in where, f"{name}: {owner.__name__}.{attr} is gone (Keras {keras.__version__})"
        assert callable(where[attr])


def test_other_private_names_used_by_tfdp_exist():
    ds = tf.data.Dataset.range(3).map(lambda v: v + 1)
    assert len(tfp.dataset_inputs(ds)) == 1 and len(tfp.dataset_functions(ds)) == 1
    s = tfdp.DataParallelStrategy(DEVS[:2])
    dist = s.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))

    class _EpochIterator:  # what Keras's TFEpochIterator holds
        _distributed_dataset = dist
    spec = tfp.keras_epoch_iterator_element_spec(_EpochIterator())
    assert isinstance(spec, tf.TensorSpec) and spec.dtype == tf.int64
    assert tfp.in_xla_context() is False


def test_hooks_are_installed_once_and_keep_the_original():
    tfdp.DataParallelStrategy(DEVS[:2])
    tfdp.DataParallelStrategy(DEVS[:2])
    for owner, attr in tfp.keras_hook_points().values():
        fn = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        original = fn.__tfdp_original__
        assert getattr(original, "__tfdp_original__", None) is None  # wrapped exactly once


_PLAIN_FIT = """
import numpy as np, keras
{prelude}
rng = np.random.default_rng(0)
x = rng.normal(size=(96, 5)).astype("float32"); y = rng.normal(size=(96, 1)).astype("float32")
keras.utils.set_random_seed(3)
m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"),
                      keras.layers.Dense(1)])
m.compile(keras.optimizers.SGD(0.1, clipnorm=0.05, gradient_accumulation_steps=2), "mse")
m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
np.save({out!r}, np.concatenate([w.ravel() for w in m.get_weights()]))
"""


def test_hooks_change_nothing_without_a_tfdp_strategy(tmp_path):
    # The same no-strategy script, with and without tfdp's hooks installed: bitwise equal.
    outs = []
    for i, prelude in enumerate(["", "import tfdp; tfdp.DataParallelStrategy(['CPU:0'])"]):
        out = str(tmp_path / f"w{i}.npy")
        subprocess.run([sys.executable, "-c", _PLAIN_FIT.format(prelude=prelude, out=out)],
                       check=True, timeout=120, env={**__import__("os").environ,
                                                     "TF_CPP_MIN_LOG_LEVEL": "3"})
        outs.append(np.load(out))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_reduce_sum_sums_and_uneven_shapes_are_a_clear_error():
    s = tfdp.DataParallelStrategy(DEVS)
    v = s.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([2], float(ctx.replica_id_in_sync_group + 1)))
    np.testing.assert_array_equal(s.reduce("SUM", v, axis=None).numpy(), [10.0, 10.0])
    np.testing.assert_array_equal(s.reduce("MEAN", v, axis=None).numpy(), [2.5, 2.5])
    uneven = s.experimental_distribute_values_from_function(
        lambda ctx: tf.ones([ctx.replica_id_in_sync_group + 1]))
    with pytest.raises(ValueError, match=r"same shape on every replica.*Received: per-replica "
                                         r"shapes \[\(1,\), \(2,\), \(3,\), \(4,\)\].*axis=0"):
        s.reduce("SUM", uneven, axis=None)
    assert float(s.reduce("SUM", uneven, axis=0)) == 10.0


def _custom_loop(strategy, x, y, batch):
    """TF's custom-loop pattern with a Keras loss object and an optimizer built lazily."""
    keras.utils.set_random_seed(5)
    scope = strategy.scope() if strategy else None
    if scope:
        scope.__enter__()
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(1e-2, global_clipnorm=0.1)
    loss_fn = keras.losses.MeanSquaredError()
    if scope:
        scope.__exit__(None, None, None)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    if strategy is None:
        run = tf.function(step)
        for xb, yb in ds:
            run(xb, yb)
    else:
        run = tf.function(lambda xb, yb: strategy.run(step, args=(xb, yb)))
        for xb, yb in strategy.experimental_distribute_dataset(ds):
            run(xb, yb)
    return model


def test_custom_loop_with_keras_losses_is_exact_on_uneven_batches():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(90, 5)).astype("float32")
    y = rng.normal(size=(90, 1)).astype("float32")
    ref = _custom_loop(None, x, y, 25)  # 25 over 4 replicas: 7,6,6,6; last batch 15
    s = tfdp.DataParallelStrategy(DEVS)
    m = _custom_loop(s, x, y, 25)
    assert max_diff(ref.get_weights(), m.get_weights()) <= TOL


def _dense(strategy, jit_compile):
    keras.utils.set_random_seed(1)
    scope = strategy.scope() if strategy else None
    if scope:
        scope.__enter__()
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(1)])
    m.compile(keras.optimizers.SGD(0.1, clipnorm=0.05), "mse", jit_compile=jit_compile)
    if scope:
        scope.__exit__(None, None, None)
    return m


def test_jit_compile_one_replica_exact_auto_fine_several_cpu_replicas_a_clear_error():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(100, 6)).astype("float32")
    y = rng.normal(size=(100, 1)).astype("float32")
    ref = _dense(None, True)
    ref.fit(x, y, batch_size=30, epochs=1, shuffle=False, verbose=0)
    one = _dense(tfdp.DataParallelStrategy(DEVS[:1]), True)
    one.fit(x, y, batch_size=30, epochs=1, shuffle=False, verbose=0)
    assert max_diff(ref.get_weights(), one.get_weights()) <= TOL
    auto = _dense(tfdp.DataParallelStrategy(DEVS), "auto")  # Keras resolves it to False on CPU
    auto.fit(x, y, batch_size=30, epochs=1, shuffle=False, verbose=0)
    assert max_diff(ref.get_weights(), auto.get_weights()) <= TOL
    jit = _dense(tfdp.DataParallelStrategy(DEVS), True)
    with pytest.raises(ValueError, match=r"jit_compile=True cannot run on several CPU replicas"
                                         r".*Received: .*4 replicas.*jit_compile=False"):
        jit.fit(x, y, batch_size=30, epochs=1, shuffle=False, verbose=0)

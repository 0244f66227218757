"""tfdp's gradient path (tfdp.keras.gradient_path): the Keras internals it hooks, and its contract.

The user-pattern matrix (test_user_patterns.py) checks the patterns users write; this module
checks the mechanism: the private names still exist, the hooks change nothing outside a tfdp
step, ``strategy.reduce`` keeps its public meaning, custom loops get the same exact weighting.
"""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import TOL, max_diff

import tfdp
from tfdp import compat as tfp
from tfdp.keras import gradient_path

DEVS = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


def test_every_hooked_keras_name_exists_in_the_installed_keras():
    points = tfp.keras_hook_points()
    assert set(points) == set(gradient_path._HOOKS)
    for name, (owner, attr) in points.items():
        assert callable(getattr(owner, attr, None)), (
            f"{name}: {owner.__name__}.{attr} is gone (Keras {keras.__version__})")


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
    # (the hooks are in Keras while a tfdp strategy lives: tfdp.keras.adapter)
    strategies = [tfdp.DataParallelStrategy(DEVS[:2]), tfdp.DataParallelStrategy(DEVS[:2])]
    assert len(strategies) == 2
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


def test_hooks_change_nothing_without_a_tfdp_strategy(run_process, tmp_path):
    # The same no-strategy script, with and without tfdp's hooks installed: bitwise equal.
    outs = []
    for i, prelude in enumerate(["", "import tfdp; s = tfdp.DataParallelStrategy(['CPU:0'])"]):
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


def _conv(strategy, jit_compile, sync_bn=False, model_class=None, optimizer=None):
    keras.utils.set_random_seed(1)
    scope = strategy.scope() if strategy else None
    if scope:
        scope.__enter__()
    layers = [keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
              keras.layers.MaxPooling2D()]
    if sync_bn:
        layers.append(keras.layers.BatchNormalization(synchronized=True))
    layers += [keras.layers.Flatten(), keras.layers.Dense(3)]
    m = (model_class or keras.Sequential)(layers)
    m.compile(optimizer() if optimizer else keras.optimizers.Adam(1e-2, clipnorm=0.1),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"], jit_compile=jit_compile)
    if scope:
        scope.__exit__(None, None, None)
    return m


def _conv_data():
    rng = np.random.default_rng(0)
    # 101 examples in batches of 25 over 4 replicas: 7,6,6,6 and a last batch of 1
    return (rng.normal(size=(101, 8, 8, 1)).astype("float32"),
            rng.integers(0, 3, size=(101,)).astype("int32"))


def _fit_evaluate_predict(m, x, y):
    h = m.fit(x, y, batch_size=25, epochs=2, shuffle=False, verbose=0)
    return h.history, m.evaluate(x, y, batch_size=25, verbose=0), m.predict(
        x, batch_size=25, verbose=0)


def test_a_statically_empty_replica_trains_and_predicts_as_one_device():
    """A replica whose batch is a static 0 (Keras 3.16 traces a step's first batch with static
    shapes: a global batch of 2 on 4 replicas is 1,1,0,0) gets a padded example too: TF's
    Conv2D gradient fails on a static empty batch ("input depth must be evenly divisible by
    filter depth: 1 vs 8", with or without a strategy). Trained and predicted as one device."""
    x, y = _conv_data()
    xb, yb = x[:2], y[:2]
    ref = _conv(None, False)
    ref.optimizer.build(ref.trainable_variables)
    tf.function(ref.train_step)((xb, yb))
    s = tfdp.DataParallelStrategy(DEVS)
    m = _conv(s, False)
    with s.scope():
        m.optimizer.build(m.trainable_variables)
    sizes = [1, 1, 0, 0]
    starts = np.cumsum([0] + sizes)

    def part(a):
        return s.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(a[starts[ctx.replica_id_in_sync_group]:
                                      starts[ctx.replica_id_in_sync_group + 1]]))

    xd, yd = part(xb), part(yb)
    assert [v.shape[0] for v in xd.values] == sizes
    tf.function(lambda a, b: s.run(m.train_step, args=((a, b),)))(xd, yd)
    assert max_diff(ref.get_weights(), m.get_weights()) <= TOL
    out = tf.function(lambda a: s.run(m.predict_step, args=((a,),)))(xd)
    assert [v.shape[0] for v in out.values] == sizes
    np.testing.assert_allclose(np.concatenate([v.numpy() for v in out.values]),
                               ref.predict_on_batch(xb), atol=1e-5)


@pytest.mark.parametrize("optimizer", ["adam_clipnorm", "sgd_accumulate"])
def test_jit_compile_on_cpu_replicas_equals_one_device(optimizer):
    # XLA cannot compile CPU collectives: tfdp compiles each replica's step (forward, backward,
    # metrics) and reduces/updates after it; equal to one device compiling the whole step.
    opt = {"adam_clipnorm": lambda: keras.optimizers.Adam(1e-2, clipnorm=0.1),
           "sgd_accumulate": lambda: keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)}
    x, y = _conv_data()
    ref = _conv(None, True, optimizer=opt[optimizer])
    ref_out = _fit_evaluate_predict(ref, x, y)
    s = tfdp.DataParallelStrategy(DEVS)
    m = _conv(s, True, optimizer=opt[optimizer])
    out = _fit_evaluate_predict(m, x, y)
    assert max_diff(ref.get_weights(), m.get_weights()) <= TOL
    for key in ref_out[0]:
        np.testing.assert_allclose(out[0][key], ref_out[0][key], rtol=1e-5)
    np.testing.assert_allclose(out[1], ref_out[1], rtol=1e-5)
    assert out[2].shape == ref_out[2].shape == (101, 3)
    np.testing.assert_allclose(out[2], ref_out[2], atol=1e-5)


def test_jit_compile_one_replica_and_auto():
    x, y = _conv_data()
    ref = _conv(None, True)
    ref.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    one = _conv(tfdp.DataParallelStrategy(DEVS[:1]), True)
    one.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    assert max_diff(ref.get_weights(), one.get_weights()) <= TOL
    auto = _conv(tfdp.DataParallelStrategy(DEVS), "auto")  # Keras resolves it to False on CPU
    auto.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    assert max_diff(ref.get_weights(), auto.get_weights()) <= TOL


class CustomStepModel(keras.Sequential):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize("case", ["sync_batchnorm", "custom_train_step", "wrapping_function"])
def test_jit_compile_where_xla_cannot_run_is_one_clear_error(case):
    x, y = _conv_data()
    s = tfdp.DataParallelStrategy(DEVS)
    what = {"sync_batchnorm": "replica-context all-reduce",
            "custom_train_step": "a custom train_step",
            "wrapping_function": "around strategy.run"}[case]
    # (around a user's own tf.function, TF's autograph wraps the error in a StagingError)
    error = Exception if case == "wrapping_function" else ValueError
    with pytest.raises(error, match=rf"jit_compile=True cannot run here: XLA cannot compile "
                                         rf"collective ops for CPU devices.*{what}.*Received: .*"
                                         rf"4 replicas.*Fix: compile with jit_compile=False"):
        if case == "wrapping_function":
            v = s.experimental_distribute_values_from_function(lambda ctx: tf.ones([2]))
            tf.function(lambda: s.run(
                lambda t: tf.distribute.get_replica_context().all_reduce("SUM", t), (v,)),
                jit_compile=True)()
        else:
            m = _conv(s, True, sync_bn=case == "sync_batchnorm",
                      model_class=CustomStepModel if case == "custom_train_step" else None)
            m.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)

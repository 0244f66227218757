"""What a replica's loss is worth (tfdp.keras.losses): the mechanism behind the loss rows of the
user-pattern matrix (test_user_patterns.py runs the rows themselves against one device).

Checked here: the divisor of a masked / weighted-mean loss is counted across replicas in custom
loops too; a hand-written loss is weighted only inside Keras's step functions (a custom loop
keeps tf.distribute's convention) and only when differentiated with respect to variables; the
one-time warning for a scalar loss function; the clear error where XLA cannot hold the
collective; nothing changes outside a tfdp strategy.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import max_diff

import tfdp

DEVS = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


def _tokens(n=22, t=5, seed=0):
    rng = np.random.default_rng(seed)
    x = np.zeros((n, t), "int32")
    for i, length in enumerate(rng.integers(1, t + 1, size=n)):
        x[i, :length] = rng.integers(1, 20, size=length)
    return x, (x % 3).astype("int32")


def _tagger():
    keras.utils.set_random_seed(4)
    return keras.Sequential([keras.Input((5,), dtype="int32"),
                             keras.layers.Embedding(20, 4, mask_zero=True),
                             keras.layers.Dense(3)])


def _custom_loop(strategy, x, y, hand_written=False):
    """A custom training loop as tf.distribute documents it: strategy.run + optimizer.apply."""
    with strategy.scope():
        model = _tagger()
        opt = keras.optimizers.SGD(0.5)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dist = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(11))

    @tf.function
    def step(batch):
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                pred = model(xb, training=True)
                if hand_written:
                    loss = tf.reduce_mean(pred)  # no Keras loss: summed over replicas
                else:
                    loss = loss_fn(yb, pred)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply(grads, model.trainable_variables)
            return loss
        return strategy.run(replica, args=batch)

    for batch in dist:
        step(batch)
    return [np.array(w) for w in model.get_weights()]


def test_custom_loop_masked_loss_equals_one_device():
    x, y = _tokens()  # batches of 11 over 4 replicas: 3, 3, 3, 2
    one = _custom_loop(tf.distribute.get_strategy(), x, y)
    got = _custom_loop(tfdp.DataParallelStrategy(DEVS), x, y)
    assert max_diff(one, got) <= 1e-6


def test_custom_loop_hand_written_loss_keeps_tf_distribute_convention():
    """Outside Keras's step functions a hand-written mean is not weighted: the replicas'
    gradients are summed, as tf.distribute documents (scale it yourself)."""
    x, y = _tokens()
    x = x[:8]
    y = y[:8]  # one batch of 8: 2 per replica, even
    one = _custom_loop(tf.distribute.get_strategy(), x, y, hand_written=True)
    start = _custom_loop(tf.distribute.get_strategy(), x[:0], y[:0], hand_written=True)
    got = _custom_loop(tfdp.DataParallelStrategy(DEVS), x, y, hand_written=True)
    # the update is 4 x one device's (a sum of 4 replica means)
    np.testing.assert_allclose(np.concatenate([(g - s).ravel() for g, s in zip(got, start)]),
                               4 * np.concatenate([(o - s).ravel() for o, s in zip(one, start)]),
                               rtol=1e-4, atol=1e-7)


def test_gradient_with_respect_to_tensors_is_not_weighted():
    """A gradient penalty (tape.gradient of a scalar with respect to inputs) inside a custom
    train_step is the user's own business: only gradients with respect to variables of a
    hand-written loss are weighted."""
    seen = {}

    class Model(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as inner:
                inner.watch(x)
                s = tf.reduce_sum(self(x, training=True))
            seen["gp"] = inner.gradient(s, x)
            return {"gp": tf.reduce_sum(seen["gp"])}

    strategy = tfdp.DataParallelStrategy(DEVS)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        inp = keras.Input((3,))
        model = Model(inp, keras.layers.Dense(1, use_bias=False)(inp))
        model.compile("sgd")
    x = np.ones((8, 3), "float32")
    logs = model.fit(x, np.zeros((8, 1), "float32"), batch_size=8, verbose=0).history
    kernel = np.array(model.get_weights()[0]).ravel()
    # every example's input gradient is the kernel: 2 examples x 3 per replica, unweighted
    np.testing.assert_allclose(logs["gp"][0], 2 * kernel.sum(), rtol=1e-5)


def test_scalar_loss_function_warns_once(caplog):
    def warned_mse(y_true, y_pred):  # (a name no other test's loss has: the warning is once)
        return keras.ops.mean(keras.ops.square(y_true - y_pred))

    strategy = tfdp.DataParallelStrategy(DEVS)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", loss=warned_mse)
    with caplog.at_level(logging.WARNING, logger="tfdp"):
        model.fit(np.ones((10, 3), "float32"), np.ones((10, 1), "float32"), batch_size=5,
                  epochs=2, verbose=0)
    lines = [r.getMessage() for r in caplog.records if "returned one scalar" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "warned_mse" in lines[0] and "per-example values" in lines[0]


def test_masked_loss_under_per_replica_xla_is_refused_clearly():
    strategy = tfdp.DataParallelStrategy(DEVS)
    with strategy.scope():
        model = _tagger()
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
    x, y = _tokens()
    with pytest.raises(tfdp.errors.TfdpError, match="masked or sample-weight-mean loss"):
        model.fit(x, y, batch_size=11, verbose=0)


def test_nothing_changes_outside_a_tfdp_step():
    """A masked loss and a Mean tracker outside any strategy: Keras's own values."""
    strategy = tfdp.DataParallelStrategy(DEVS)  # hooks installed while it lives
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    logits = tf.constant(np.random.default_rng(0).normal(size=(2, 3, 4)).astype("float32"))
    y = tf.constant([[1, 2, 0], [3, 0, 0]])
    mask = tf.constant([[True, True, False], [True, False, False]])
    logits._keras_mask = mask
    want = float(tf.reduce_mean(tf.boolean_mask(
        tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits), mask)))
    assert abs(float(loss(y, logits)) - want) < 1e-6
    m = keras.metrics.Mean()
    m.update_state(2.0)
    m.update_state(4.0)
    assert float(m.result()) == 3.0


@pytest.mark.parametrize("loss, sample_weight", [
    ("mse", None), ("mse_sum", None), ("mse_weighted_mean", True)])
def test_an_empty_replica_of_a_static_split_adds_zero(loss, sample_weight):
    """Keras returns the empty values of an empty batch as its "loss" (shape (0,)), which its
    loss tracker sums to NaN. A split whose shapes are static (Keras 3.16 traces evaluate's first
    batch so: 5 examples on 4 replicas, 2,2,1,0) leaves a replica empty: its loss is 0, and the
    sum over replicas weighted by the shares is one device's loss."""
    fn = {"mse": keras.losses.MeanSquaredError(),
          "mse_sum": keras.losses.MeanSquaredError(reduction="sum"),
          "mse_weighted_mean": keras.losses.MeanSquaredError(
              reduction="mean_with_sample_weight")}[loss]
    rng = np.random.default_rng(1)
    y, p = rng.normal(size=(5, 3)).astype("float32"), rng.normal(size=(5, 3)).astype("float32")
    w = rng.random(5).astype("float32")
    rows = [(0, 2), (2, 4), (4, 5), (5, 5)]
    strategy = tfdp.DataParallelStrategy(DEVS)

    def part(array):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(array[slice(*rows[ctx.replica_id_in_sync_group])]))

    def step(y_true, y_pred, weights):
        return fn(y_true, y_pred, sample_weight=weights if sample_weight else None)
    out = strategy.run(step, args=(part(y), part(p), part(w)))
    values = [float(v) for v in strategy.experimental_local_results(out)]
    assert all(np.isfinite(values)), values
    want = float(fn(y, p, sample_weight=w if sample_weight else None))
    if loss == "mse":  # a replica's own mean, weighted by its share of the 5 examples
        got = sum(v * (b - a) / 5 for v, (a, b) in zip(values, rows))
        assert values[3] == 0.0
    else:  # the divisor is counted across replicas: every replica reports the global value
        got = values[3]
    np.testing.assert_allclose(got, want, rtol=1e-6)

"""Keras 3 fit/evaluate/predict under DataParallelStrategy equal single-device training."""


import numpy as np
import pytest
import tensorflow as tf
import keras

import tfdp
from helpers import (TOL, assert_replicas_identical, build, make_data, max_diff)

DEVS = {1: ["CPU:0"], 2: ["CPU:0", "CPU:1"], 4: ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]}


def fit_weights(strategy, opt, x, y, batch_size=50, epochs=2, **kw):
    m = build(strategy, opt, **kw)
    h = m.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return m, h.history


def _one_device_fit(opt, x, y):
    ref, hist = fit_weights(None, opt, x, y)
    return ref.get_weights(), hist


@pytest.mark.parametrize("opt", ["sgd_momentum", "adam"])
@pytest.mark.parametrize("n", [2, 4])
def test_fit_equals_single_device(n, opt, one_device):
    # 210 examples in batches of 50: every batch splits unevenly over 4 replicas
    # (13,13,13,11) and the last batch of 10 splits unevenly over both 2 and 4.
    x, y = make_data(210)
    # the one-device fit, once per session for both replica counts
    ref_weights, ref_hist = one_device(("test_keras.fit", opt),
                                       lambda: _one_device_fit(opt, x, y))
    s = tfdp.DataParallelStrategy(DEVS[n])
    m, hist = fit_weights(s, opt, x, y)
    assert max_diff(ref_weights, m.get_weights()) <= TOL
    np.testing.assert_allclose(hist["loss"], ref_hist["loss"], rtol=1e-5)
    np.testing.assert_allclose(hist["mae"], ref_hist["mae"], rtol=1e-5)
    assert_replicas_identical(s, m)


def test_uneven_batches_two_replicas():
    # 51 per batch over 2 replicas -> 26 + 25 every step; Keras alone would weight them equally.
    x, y = make_data(153, seed=3)
    ref, _ = fit_weights(None, "sgd_momentum", x, y, batch_size=51, epochs=3)
    m, _ = fit_weights(tfdp.DataParallelStrategy(DEVS[2]), "sgd_momentum", x, y,
                       batch_size=51, epochs=3)
    assert max_diff(ref.get_weights(), m.get_weights()) <= TOL


def test_batchnorm_copies_stay_identical_and_predict_matches():
    x, y = make_data(200, seed=4)
    s = tfdp.DataParallelStrategy(DEVS[4])
    m = build(s, "adam", batchnorm=True)
    m.fit(x, y, batch_size=40, epochs=2, shuffle=False, verbose=0)
    n_checked = assert_replicas_identical(s, m)
    assert n_checked >= 20  # weights, BN moving stats, Adam slots, iteration counter...
    bn = [l for l in m.layers if isinstance(l, keras.layers.BatchNormalization)][0]
    mm = s.experimental_local_results(bn.moving_mean.value)
    assert not np.allclose(np.asarray(mm[0]), 0.0)  # statistics were really updated
    # predict() under the strategy == the same weights in a plain model
    plain = build(None, "adam", batchnorm=True)
    plain.set_weights(m.get_weights())
    np.testing.assert_allclose(m.predict(x, batch_size=64, verbose=0),
                               plain.predict(x, batch_size=64, verbose=0), rtol=1e-5, atol=1e-6)


def test_evaluate_and_predict_equal_single_device():
    x, y = make_data(150, seed=5)
    ref, _ = fit_weights(None, "sgd_momentum", x, y, epochs=1)
    s = tfdp.DataParallelStrategy(DEVS[4])
    m, _ = fit_weights(s, "sgd_momentum", x, y, epochs=1)
    ev_ref = ref.evaluate(x, y, batch_size=37, verbose=0, return_dict=True)
    ev = m.evaluate(x, y, batch_size=37, verbose=0, return_dict=True)
    for k in ev_ref:
        np.testing.assert_allclose(ev[k], ev_ref[k], rtol=1e-5)
    p_ref = ref.predict(x, batch_size=37, verbose=0)
    p = m.predict(x, batch_size=37, verbose=0)
    assert p.shape == p_ref.shape == (150, 1)
    np.testing.assert_allclose(p, p_ref, rtol=1e-5, atol=1e-6)


def test_save_and_load_model(tmp_path):
    x, y = make_data(100, seed=6)
    s = tfdp.DataParallelStrategy(DEVS[2])
    m, _ = fit_weights(s, "adam", x, y, epochs=1)
    path = str(tmp_path / "model.keras")
    m.save(path)
    loaded = keras.models.load_model(path)  # outside the strategy
    assert max_diff(m.get_weights(), loaded.get_weights()) == 0
    with s.scope():  # and back under it, then keep training
        again = keras.models.load_model(path)
    again.fit(x, y, batch_size=50, epochs=1, verbose=0)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), m.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-6)


def test_loss_scale_optimizer():
    x, y = make_data(120, seed=7)
    opt = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
    ref, _ = fit_weights(None, opt, x, y, batch_size=30, epochs=2)
    s = tfdp.DataParallelStrategy(DEVS[4])
    m, _ = fit_weights(s, opt, x, y, batch_size=30, epochs=2)
    assert max_diff(ref.get_weights(), m.get_weights()) <= TOL
    assert_replicas_identical(s, m)


def test_callbacks_and_validation_split():
    x, y = make_data(200, seed=8)

    class Count(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = 0
            self.epochs = 0

        def on_train_batch_end(self, batch, logs=None):
            self.batches += 1

        def on_epoch_end(self, epoch, logs=None):
            self.epochs += 1

    def run(strategy):
        m = build(strategy, "sgd_momentum")
        c = Count()
        h = m.fit(x, y, batch_size=32, epochs=2, validation_split=0.25, shuffle=False,
                  verbose=0, callbacks=[c, keras.callbacks.TerminateOnNaN()])
        return m, h.history, c

    ref, ref_h, ref_c = run(None)
    m, h, c = run(tfdp.DataParallelStrategy(DEVS[4]))
    assert (c.batches, c.epochs) == (ref_c.batches, ref_c.epochs) == (10, 2)
    np.testing.assert_allclose(h["val_loss"], ref_h["val_loss"], rtol=1e-5)
    assert max_diff(ref.get_weights(), m.get_weights()) <= TOL


def _dataset(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def test_fit_from_tf_data_and_from_distributed_dataset():
    x, y = make_data(190, seed=9)
    ref = build(None, "adam")
    ref.fit(_dataset(x, y, 40), epochs=2, verbose=0)
    s = tfdp.DataParallelStrategy(DEVS[4])
    m1 = build(s, "adam")
    m1.fit(_dataset(x, y, 40), epochs=2, verbose=0)
    assert max_diff(ref.get_weights(), m1.get_weights()) <= TOL
    m2 = build(s, "adam")
    m2.fit(s.experimental_distribute_dataset(_dataset(x, y, 40)), epochs=2, verbose=0)
    assert max_diff(ref.get_weights(), m2.get_weights()) <= TOL
    assert_replicas_identical(s, m2)


def test_one_replica_strategy_equals_no_strategy():
    x, y = make_data(100, seed=10)
    ref, _ = fit_weights(None, "adam", x, y)
    m, _ = fit_weights(tfdp.DataParallelStrategy(DEVS[1]), "adam", x, y)
    assert max_diff(ref.get_weights(), m.get_weights()) <= TOL


def test_fit_from_per_replica_pipelines():
    """distribute_datasets_from_function: each replica builds its own pipeline."""
    x, y = make_data(160, seed=13)
    s = tfdp.DataParallelStrategy(DEVS[4])
    seen = []

    def dataset_fn(ctx):
        seen.append((ctx.num_replicas_in_sync, ctx.get_per_replica_batch_size(40)))
        return _dataset(x, y, ctx.get_per_replica_batch_size(40)).repeat()

    m = build(s, "sgd_momentum")
    hist = m.fit(s.distribute_datasets_from_function(dataset_fn), epochs=2, steps_per_epoch=4,
                 verbose=0)
    assert seen and all(v == (4, 10) for v in seen)
    assert np.all(np.isfinite(hist.history["loss"]))
    assert_replicas_identical(s, m)


def test_empty_replica_batch_with_batchnorm_stays_finite():
    # 210 = 4*52 + 2: the last global batch of 2 leaves two of the four replicas empty;
    # their NaN statistics / gradients must not leak into the reduced values.
    x, y = make_data(210, seed=14)
    s = tfdp.DataParallelStrategy(DEVS[4])
    m = build(s, "sgd_momentum", batchnorm=True)
    hist = m.fit(x, y, batch_size=52, epochs=2, shuffle=False, verbose=0)
    assert np.all(np.isfinite(hist.history["loss"])), hist.history
    assert all(np.all(np.isfinite(w)) for w in m.get_weights())
    assert_replicas_identical(s, m)


def test_a_step_reads_only_its_own_models_variables():
    # A loop of trials (Keras Tuner's form) builds and fits a new model under the same strategy
    # while the previous one is still alive. The padded-replica restore (uneven batches) and the
    # BatchNorm sync read only the stepped model's variables: when they read every variable the
    # strategy had made, the previous model's ended in the new step's function, and once that
    # model was collected (here: two workers, while the next step was traced) TF failed with
    # "Called a function referencing variables which have been deleted".
    import gc
    x, y = make_data(210, seed=15)
    s = tfdp.DataParallelStrategy(DEVS[4])
    previous = build(s, "sgd_momentum", batchnorm=True)
    previous.fit(x, y, batch_size=52, epochs=1, shuffle=False, verbose=0)
    theirs = {id(c.handle) for v in list(previous.variables) + list(previous.metrics_variables)
              for c in s.experimental_local_results(v.value)}
    captured = []

    class Trial(keras.Model):
        def train_step(self, data):
            out = super().train_step(data)
            graph = tf.compat.v1.get_default_graph()  # this step's function, being traced
            captured.append(sum(id(t) in theirs for t in graph.external_captures))
            return out

    with s.scope():
        base = build(None, "sgd_momentum", batchnorm=True)
        m = Trial(base.inputs, base.outputs)
        m.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"])
    m.fit(x, y, batch_size=52, epochs=1, shuffle=False, verbose=0)
    assert captured and not any(captured), captured
    del previous
    gc.collect()
    hist = m.fit(x, y, batch_size=52, epochs=2, shuffle=False, verbose=0)
    assert np.all(np.isfinite(hist.history["loss"]))
    assert_replicas_identical(s, m)

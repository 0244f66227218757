"""tfdp.train.monitor: the cheap probes behind `tfdp train`'s summary (no timing assertions)."""

import math

import numpy as np
import pytest
import tensorflow as tf

import keras
import tfdp
from tfdp.train import monitor


class _Data:
    """What ``tfdp.train.data`` hands the monitor: ``local(batch_size)``, endless batches."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def local(self, batch_size):
        return (tf.data.Dataset.from_tensor_slices((self.x, self.y)).repeat()
                .batch(batch_size, drop_remainder=True))


@pytest.fixture(scope="module")
def trained(cpu_devices):
    strategy = tfdp.DataParallelStrategy(cpu_devices)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 6)).astype(np.float32)
    y = rng.standard_normal((64, 1)).astype(np.float32)
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                  keras.layers.BatchNormalization(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return strategy, model, _Data(x, y)


@pytest.mark.timeout(120)
def test_local_compute_leaves_the_trained_model_as_it_was(trained):
    _, model, data = trained
    before = [v.numpy().copy() for v in model.variables]   # BatchNorm statistics included
    out = monitor.local_compute(model, data, batch_size=4, steps=3)
    assert out["steps"] == 3 and out["forward_ms_p50"] > 0
    assert math.isclose(out["step_time_ms_p50"], 3 * out["forward_ms_p50"])
    assert all(np.array_equal(b, v.numpy()) for b, v in zip(before, model.variables))


@pytest.mark.timeout(120)
def test_estimate_allreduce_from_the_cross_replica_context(trained):
    strategy, model, _ = trained
    out = monitor.estimate_allreduce(strategy, model, repeats=2)
    assert out["ms"] > 0 and out["tensors"] == len(model.trainable_variables)
    assert out["floats"] == sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    first = model.trainable_variables[0]
    assert monitor.estimate_allreduce(strategy, model, exclude_ids={id(first)},
                                      repeats=1)["excluded"] == 1
    one = tfdp.DataParallelStrategy(["CPU:0"])
    assert monitor.estimate_allreduce(one, model) is None   # one replica: nothing to reduce

"""The values a step reports, after every batch (what callbacks and the progress bar see): one
device's, also on uneven splits (the last batch leaves replicas empty), for ratios such as
precision, with steps_per_execution and per-replica XLA steps (``tfdp.keras.reported``). Keras
averages the replicas' values; before, the mean of the replicas' running ratios was 0.07 to 0.67
off one device's in a 23-example epoch of batch 7 on 4 replicas."""

import contextlib

import numpy as np
import pytest

import keras

import tfdp

DEVS = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
N, BATCH = 23, 7  # batches of 7, 7, 7, 2: the last leaves two of four replicas empty


class Logs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.train, self.test = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.train.append(dict(logs))

    def on_test_batch_end(self, batch, logs=None):
        self.test.append(dict(logs))


def _data():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(N, 6)).astype("float32")
    y = (rng.random((N, 1)) < 0.4).astype("float32")
    return x, y


def _fit(strategy, compile_kwargs):
    keras.utils.set_random_seed(5)
    x, y = _data()

    def make():
        m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
        m.compile(keras.optimizers.SGD(0.1), "binary_crossentropy",
                  metrics=["mae", keras.metrics.Precision(name="precision"),
                           keras.metrics.AUC(name="auc")], **compile_kwargs)
        return m
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = make()
    logs = Logs()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[logs],
              validation_data=(x, y), validation_batch_size=BATCH)
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return logs, evaluated


def _compare(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert sorted(g) == sorted(w)
        for key in w:
            np.testing.assert_allclose(g[key], w[key], atol=1e-5, err_msg=key)


@pytest.mark.parametrize("compile_kwargs", [{}, {"steps_per_execution": 2},
                                            {"jit_compile": True}],
                         ids=["plain", "steps_per_execution", "jit_compile"])
def test_logs_after_every_batch_are_one_devices(compile_kwargs):
    want, want_eval = _fit(None, compile_kwargs)
    got, got_eval = _fit(tfdp.DataParallelStrategy(DEVS), compile_kwargs)
    _compare(got.train, want.train)
    _compare(got.test, want.test)
    _compare([got_eval], [want_eval])


def test_custom_loop_replicas_read_their_own_metric_state():
    """Outside Keras's steps nothing changes: a metric read in ``strategy.run`` is the
    replica's own (tf.distribute's convention)."""
    strategy = tfdp.DataParallelStrategy(DEVS[:2])
    with strategy.scope():
        mean = keras.metrics.Mean()

    def step(v):
        mean.update_state(v)
        return mean.result()
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: float(ctx.replica_id_in_sync_group + 1))
    out = strategy.run(step, args=(values,))
    assert sorted(float(v) for v in strategy.experimental_local_results(out)) == [1.0, 2.0]


def _two_output_state(strategy):
    """A two-output model's fit: every metric's state (total, count) after each batch."""
    keras.utils.set_random_seed(5)
    x, y = _data()
    states = []

    class State(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            states.append({f"{m.name}/{i}": float(keras.ops.convert_to_numpy(v))
                           for top in self.model.metrics for m in getattr(top, "metrics", [top])
                           for i, v in enumerate(m.variables)})

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        inp = keras.Input((6,))
        h = keras.layers.Dense(8, activation="relu")(inp)
        model = keras.Model(inp, {"a": keras.layers.Dense(1, name="a")(h),
                                  "b": keras.layers.Dense(1, name="b")(h)})
        model.compile(keras.optimizers.SGD(0.1), loss={"a": "mse", "b": "mae"},
                      loss_weights={"a": 1.0, "b": 0.5})
    hist = model.fit(x, {"a": y, "b": 2 * y}, batch_size=BATCH, epochs=2, shuffle=False,
                     verbose=0, callbacks=[State()]).history
    return states, hist


def test_per_output_loss_trackers_hold_one_devices_state():
    """Keras weights a per-output loss tracker's update by the batch's static size, or gives it
    the weight 1 where the size is dynamic (Keras 3.16 traces the first batch with static shapes
    and the last, partial one without: both kinds of weight in one tracker). The state summed
    over the replicas (total and count) is one device's after every batch, so is History."""
    want, want_hist = _two_output_state(None)
    got, got_hist = _two_output_state(tfdp.DataParallelStrategy(DEVS))
    _compare(got, want)
    _compare([{k: v[-1] for k, v in got_hist.items()}], [{k: v[-1] for k, v in want_hist.items()}])

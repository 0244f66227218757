"""Checkpoints of sharded optimizer state stay whole and portable (zero_stage, tfdp.zero).

A model trained one epoch with its optimizer state sharded over 4 replicas is saved with
``tf.train.Checkpoint``, ``model.save`` (.keras) and ``save_weights`` (.weights.h5); each file is
restored unsharded on 4 replicas, sharded on 2 replicas, on one device and sharded with stage 2,
and training continues one more epoch: every one ends within 1e-5 of the uninterrupted sharded
run (weights and every optimizer variable), and a file written on one device restores sharded
the same way. tfdp's BackupAndRestore resumes a sharded run exactly where it stopped.
"""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(600)

D4 = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
D2 = ["CPU:0", "CPU:1"]
TOL = 1e-5


def _strategy(kind):
    import tfdp
    return {"sharded4": lambda: tfdp.DataParallelStrategy(D4, zero_stage=1),
            "stage2_4": lambda: tfdp.DataParallelStrategy(D4, zero_stage=2),
            "unsharded4": lambda: tfdp.DataParallelStrategy(D4),
            "sharded2": lambda: tfdp.DataParallelStrategy(D2, zero_stage=1),
            "one_device": lambda: None}[kind]()


def _scope(strategy):
    import contextlib
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _data():
    from helpers import make_data
    return make_data(210)


def _fit(model, epoch):
    x, y = _data()
    model.fit(x, y, batch_size=50, epochs=epoch + 1, initial_epoch=epoch, shuffle=False,
              verbose=0)


def _state(model):
    return ([np.array(w) for w in model.get_weights()]
            + [np.array(getattr(v, "value", v)) for v in model.optimizer.variables])


def _max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
               for x, y in zip(a, b) if x.size)


@pytest.fixture(scope="module")
def uninterrupted():
    from helpers import build
    m = build(_strategy("sharded4"), "adam")
    _fit(m, 0)
    _fit(m, 1)
    return _state(m)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{source: (tf.train.Checkpoint prefix, .keras path, .weights.h5 path)} after one epoch."""
    import tensorflow as tf

    from helpers import build
    out = {}
    for source in ("sharded4", "one_device"):
        d = tmp_path_factory.mktemp(source)
        m = build(_strategy(source), "adam")
        _fit(m, 0)
        if source == "sharded4":  # really sharded: slots on several devices, one copy each
            devices = {v.value.device for v in m.optimizer.variables
                       if not isinstance(v.value, tf.distribute.DistributedValues)}
            assert len(devices) > 1
        prefix = tf.train.Checkpoint(model=m, optimizer=m.optimizer).write(str(d / "ckpt"))
        m.save(str(d / "model.keras"))
        m.save_weights(str(d / "model.weights.h5"))
        out[source] = (prefix, str(d / "model.keras"), str(d / "model.weights.h5"))
    return out


def _restore(kind, fmt, files):
    import keras
    import tensorflow as tf

    from helpers import build
    prefix, keras_path, h5 = files
    strategy = _strategy(kind)
    if fmt == "keras":
        with _scope(strategy):
            return keras.models.load_model(keras_path)
    model = build(strategy, "adam", seed=7)  # other initial weights: the restore overwrites them
    with _scope(strategy):
        model.optimizer.build(model.trainable_variables)
    if fmt == "checkpoint":
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(prefix).assert_consumed()
    else:
        model.load_weights(h5)
    return model


@pytest.mark.parametrize("fmt", ["checkpoint", "keras", "weights_h5"])
@pytest.mark.parametrize("source,target", [
    ("sharded4", "unsharded4"), ("sharded4", "sharded2"), ("sharded4", "one_device"),
    ("sharded4", "stage2_4"), ("one_device", "sharded4")])
def test_restore_elsewhere_and_continue(source, target, fmt, saved, uninterrupted):
    model = _restore(target, fmt, saved[source])
    _fit(model, 1)
    assert _max_diff(_state(model), uninterrupted) <= TOL


def test_backup_and_restore_resumes_a_sharded_run_exactly(tmp_path):
    """tfdp.callbacks.BackupAndRestore: a sharded run killed mid-epoch, resumed sharded, ends
    where the uninterrupted (sharded) run ends."""
    import tfdp
    from test_callbacks_backup import interrupted_then_resumed, max_diff, uninterrupted as plain
    strategy = tfdp.DataParallelStrategy(D2, zero_stage=1)
    reference = plain(strategy)
    got, _ = interrupted_then_resumed(strategy, str(tmp_path / "backup"))
    assert max_diff(got, reference) <= 1e-6
    assert not os.path.exists(tmp_path / "backup")

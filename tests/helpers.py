"""Shared helpers for the Keras equivalence and backup tests."""

import numpy as np
import keras

TOL = 1e-5


def make_data(n=210, vocab=50, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (n, 4)).astype("int32")
    dense = rng.normal(size=(n, 6)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    return {"ids_in": ids, "features": dense}, y


def dense_embedding_model(vocab=50, batchnorm=False, seed=1):
    """A small model with an Embedding (sparse gradients) and Dense layers."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((4,), dtype="int32", name="ids_in")
    dense = keras.Input((6,), name="features")
    e = keras.layers.Flatten()(keras.layers.Embedding(vocab, 8)(ids))
    x = keras.layers.Concatenate()([e, dense])
    x = keras.layers.Dense(16, activation="relu")(x)
    if batchnorm:
        x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Dense(8, activation="tanh")(x)
    out = keras.layers.Dense(1)(x)
    return keras.Model({"ids_in": ids, "features": dense}, out)


OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(1e-2),
}


def build(strategy, opt="sgd_momentum", **kw):
    def _b():
        m = dense_embedding_model(**kw)
        m.compile(OPTIMIZERS[opt]() if isinstance(opt, str) else opt(), "mse",
                  metrics=["mae"])
        return m
    if strategy is None:
        return _b()
    with strategy.scope():
        return _b()


def max_diff(ws_a, ws_b):
    assert len(ws_a) == len(ws_b)
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(ws_a, ws_b))


def tf_variables(model):
    """Every tf variable behind the model and its optimizer (mirrored ones included)."""
    out = []
    for v in list(model.variables) + list(model.optimizer.variables):
        out.append(getattr(v, "value", v))
    return out


def assert_replicas_identical(strategy, model):
    """Every replica's copy of every variable is bitwise identical."""
    checked = 0
    for v in tf_variables(model):
        copies = strategy.experimental_local_results(v)
        assert len(copies) == strategy.num_replicas_in_sync, v.name
        first = np.asarray(copies[0])
        for c in copies[1:]:
            np.testing.assert_array_equal(np.asarray(c), first, err_msg=v.name)
        checked += 1
    return checked


class _Counter:
    executed = 0


def count_replica_collectives(strategy):
    """Count the replica-context collectives the strategy's reducer *executes* (a py_function
    tick after each): call before the step is traced; read ``.executed`` of the result."""
    import threading

    import tensorflow as tf
    counter, lock = _Counter(), threading.Lock()
    collectives = strategy.cross_device_ops.prepare_replica_context()
    original = collectives.collective

    def tick():
        with lock:  # (py_functions of several replicas run in TF's threads)
            counter.executed += 1
        return tf.constant(0, tf.int32)

    def counted(buf, replica_id):
        out = original(buf, replica_id)
        with tf.control_dependencies([out]):
            ticked = tf.py_function(tick, [], tf.int32)
        with tf.control_dependencies([ticked]):
            return tf.identity(out)

    collectives.collective = counted  # (an instance attribute: the stage looks it up per call)
    return counter


# --- simulated crashes (backup tests) ------------------------------------------------------------
# (A model abandoned in one needs no collection before the next test: a step reads only its own
# model's variables, tests/test_keras.py::test_a_step_reads_only_its_own_models_variables.)

class Interrupt(Exception):
    pass

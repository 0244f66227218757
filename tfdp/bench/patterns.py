"""The user-pattern matrix: Keras training patterns as users write them, one row each.

Every row trains a tiny model (seconds on a CPU) on deterministic data with a fixed seed, once
without a strategy (the single-device reference) and once under a strategy; :func:`run_row`
reports the largest weight difference from the reference (``max |dw|``), whether every replica's
copy of every model and optimizer variable is bitwise identical, and any crash as
``"crashes: <ExceptionType>: <first line>"``.

The same rows drive ``tests/test_user_patterns.py`` (tfdp must be exact on every row: max |dw| <=
1e-5 and identical copies) and ``tfdp bench patterns`` (the table tfdp vs
``tf.distribute.MirroredStrategy``).

Data: 210 examples in global batches of 50 split unevenly over 4 replicas (13,13,13,11 and a last
batch of 10: 3,3,3,1); "even" rows use 200 in batches of 40 (10 per replica); "last batch 1" rows
use 201 in batches of 50 (the last global batch of 1 leaves 3 of 4 replicas empty).

Rows marked ``per_replica`` (plain BatchNormalization in training mode) legitimately differ from
one device, which normalises with the statistics of the whole batch: only replica identity (and
finiteness) is checked for them.

Importing this module does not import TensorFlow or Keras (each row imports them when it runs), so
``tfdp bench patterns --list`` is instant and the CPU can still be split into logical devices.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time

import numpy as np

from tfdp.bench import pattern_losses
from tfdp.bench.pattern_base import (  # noqa: F401 (re-exported: the rows' vocabulary)
    B_EVEN, B_TINY_LAST, B_UNEVEN, EPOCHS, N_EVEN, N_TINY_LAST, N_UNEVEN, TOL, VALUE_RTOL, Row,
    RowResult, Trained, _classification, _fit_row, _keras, _mlp, _regression, _scope, _sgd,
    _weights, fmt, format_error)


# --- rows: built-in fit and optimizer arguments -------------------------------------------------

def _baseline(strategy):
    return _fit_row(strategy, model_fn=_mlp, optimizer_fn=_sgd, data=_regression(N_UNEVEN),
                    batch_size=B_UNEVEN)


# Far below the gradients' sizes (measured on the first batch: global norm 1.4-2.1, per tensor
# 0.24-1.4, elements up to 0.37-0.69), so that every step clips (clipvalue: the larger elements).
CLIP = {"global_clipnorm": 0.05, "clipnorm": 0.02, "clipvalue": 0.005}


def _clip_row(kind, even):
    def train(strategy):
        n, b = (N_EVEN, B_EVEN) if even else (N_UNEVEN, B_UNEVEN)
        return _fit_row(strategy, model_fn=_mlp, optimizer_fn=lambda: _sgd(**{kind: CLIP[kind]}),
                        data=_regression(n, seed=2), batch_size=b)
    return train


def _clip_accum_row(kind):
    def train(strategy):
        import tensorflow as tf
        x, y = _regression(N_UNEVEN, seed=3)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(B_EVEN, drop_remainder=True)
        with _scope(strategy):
            model = _mlp()
            model.compile(_sgd(**{kind: CLIP[kind]}, gradient_accumulation_steps=2), "mse")
        model.fit(ds, epochs=EPOCHS, verbose=0)
        return Trained(model, _weights(model), [model.optimizer])
    return train


# --- rows: custom train_step ---------------------------------------------------------------------

def _two_optimizers(use_compute_loss):
    """GAN-like: a generator and a discriminator, each with its own optimizer and apply()."""
    def train(strategy):
        import tensorflow as tf
        keras = _keras()

        class TwoPart(keras.Model):
            def __init__(self, generator, discriminator, **kw):
                super().__init__(**kw)
                self.generator = generator
                self.discriminator = discriminator

            def compile(self, d_optimizer, g_optimizer, **kw):
                super().compile(**kw)
                self.d_optimizer = d_optimizer
                self.g_optimizer = g_optimizer
                self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

            def call(self, noise):  # like real samples (Keras builds the compiled loss on it)
                return self.generator(noise)

            def _loss(self, labels, logits):
                if use_compute_loss:
                    return self.compute_loss(y=labels, y_pred=logits)
                return self.loss_fn(labels, logits)

            def train_step(self, data):
                noise, real = data
                with tf.GradientTape() as tape:
                    fake = self.generator(noise, training=True)
                    logits_real = self.discriminator(real, training=True)
                    logits_fake = self.discriminator(fake, training=True)
                    d_loss = (self._loss(tf.ones_like(logits_real), logits_real)
                              + self._loss(tf.zeros_like(logits_fake), logits_fake))
                d_vars = self.discriminator.trainable_weights
                self.d_optimizer.apply(tape.gradient(d_loss, d_vars), d_vars)
                with tf.GradientTape() as tape:
                    logits = self.discriminator(self.generator(noise, training=True),
                                                training=True)
                    g_loss = self._loss(tf.ones_like(logits), logits)
                g_vars = self.generator.trainable_weights
                self.g_optimizer.apply(tape.gradient(g_loss, g_vars), g_vars)
                return {"d_loss": d_loss, "g_loss": g_loss}

        rng = np.random.default_rng(4)
        noise = rng.normal(size=(N_UNEVEN, 4)).astype("float32")
        real = (rng.normal(size=(N_UNEVEN, 6)) * 0.5 + 1.0).astype("float32")
        with _scope(strategy):
            keras.utils.set_random_seed(5)
            generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, "relu"),
                                          keras.layers.Dense(6)], name="generator")
            discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, "relu"),
                                              keras.layers.Dense(1)], name="discriminator")
            model = TwoPart(generator, discriminator)
            kw = {"loss": keras.losses.BinaryCrossentropy(from_logits=True)} \
                if use_compute_loss else {}
            model.compile(d_optimizer=keras.optimizers.Adam(1e-2),
                          g_optimizer=keras.optimizers.SGD(0.05, momentum=0.9), **kw)
        model.fit(noise, real, batch_size=B_UNEVEN, epochs=EPOCHS, shuffle=False, verbose=0)
        weights = _weights(generator) + _weights(discriminator)
        return Trained(model, weights, [model.d_optimizer, model.g_optimizer, model.optimizer])
    return train


def _custom_step(mode):
    """A functional model subclass whose train_step is the Keras guide's, varied by ``mode``."""
    def train(strategy):
        import tensorflow as tf
        keras = _keras()

        class Custom(keras.Model):
            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self.compute_loss(y=y, y_pred=y_pred)
                tv = self.trainable_variables
                grads = tape.gradient(loss, tv)
                if mode == "apply_gradients":
                    self.optimizer.apply_gradients(zip(grads, tv))
                elif mode == "var_subset":  # fine-tune the last two layers only
                    self.optimizer.apply(grads[-4:], tv[-4:])
                else:  # "reversed", "frozen": reversed order
                    self.optimizer.apply(grads[::-1], tv[::-1])
                return {"loss": loss}

        with _scope(strategy):
            model = _mlp(cls=Custom, frozen_first=mode == "frozen")
            model.compile(_sgd(), "mse")
        x, y = _regression(N_UNEVEN, seed=6)
        model.fit(x, y, batch_size=B_UNEVEN, epochs=EPOCHS, shuffle=False, verbose=0)
        return Trained(model, _weights(model), [model.optimizer])
    return train


# --- rows: layers and compile/fit options -------------------------------------------------------

def _batchnorm(kind, n=N_UNEVEN, b=B_UNEVEN):
    def train(strategy):
        t = _fit_row(strategy, model_fn=lambda: _mlp(batchnorm=kind), optimizer_fn=_sgd,
                     data=_regression(n, seed=7), batch_size=b)
        t.checks["weights finite"] = all(np.all(np.isfinite(w)) for w in t.weights)
        return t
    return train


def _jit(strategy):
    return _fit_row(strategy, model_fn=_mlp, optimizer_fn=_sgd, data=_regression(N_UNEVEN, seed=8),
                    batch_size=B_UNEVEN, compile_kw={"jit_compile": True})


def _input_kind(kind):
    """fit() from a keras.utils.PyDataset subclass or a Python generator over the user's arrays."""
    def train(strategy):
        keras = _keras()
        x, y = _regression(N_UNEVEN, seed=9)
        x0, y0 = x.copy(), y.copy()
        steps = math.ceil(N_UNEVEN / B_UNEVEN)
        with _scope(strategy):
            model = _mlp()
            model.compile(_sgd(), "mse")
        if kind == "pydataset":
            class Batches(keras.utils.PyDataset):
                def __init__(self, x, y, batch_size, **kw):
                    super().__init__(**kw)
                    self.x, self.y, self.batch_size = x, y, batch_size

                def __len__(self):
                    return math.ceil(len(self.x) / self.batch_size)

                def __getitem__(self, i):
                    s = slice(i * self.batch_size, (i + 1) * self.batch_size)
                    return self.x[s], self.y[s]

            model.fit(Batches(x, y, B_UNEVEN), epochs=EPOCHS, shuffle=False, verbose=0)
        else:
            def batches():
                while True:
                    for i in range(steps):
                        yield x[i * B_UNEVEN:(i + 1) * B_UNEVEN], y[i * B_UNEVEN:(i + 1) * B_UNEVEN]

            model.fit(batches(), steps_per_epoch=steps, epochs=EPOCHS, verbose=0)
        t = Trained(model, _weights(model), [model.optimizer])
        t.checks["user's x/y arrays unchanged"] = (x.tobytes() == x0.tobytes()
                                                   and y.tobytes() == y0.tobytes())
        return t
    return train


def _conv_model():
    keras = _keras()
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6, 6, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(1)])


def _images(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6, 6, 1)).astype("float32")
    y = (x.mean(axis=(1, 2)) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def _embedding_model(vocab=20):
    keras = _keras()
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(vocab, 4),
                             keras.layers.Flatten(), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def _ids(n, seed, vocab=20):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (n, 4)).astype("int32")
    table = rng.normal(size=(vocab,))
    y = (table[ids].sum(axis=1, keepdims=True) / 2).astype("float32")
    return ids, y


def _tiny_last(kind):
    def train(strategy):
        if kind == "dense":
            return _fit_row(strategy, model_fn=_mlp, optimizer_fn=_sgd,
                            data=_regression(N_TINY_LAST, seed=10), batch_size=B_TINY_LAST)
        if kind == "conv2d":
            return _fit_row(strategy, model_fn=_conv_model, optimizer_fn=_sgd,
                            data=_images(N_TINY_LAST, seed=11), batch_size=B_TINY_LAST)
        if kind == "embedding":
            return _fit_row(strategy, model_fn=_embedding_model, optimizer_fn=_sgd,
                            data=_ids(N_TINY_LAST, seed=12), batch_size=B_TINY_LAST)
        return _batchnorm(kind, n=N_TINY_LAST, b=B_TINY_LAST)(strategy)
    return train


def _sample_weight(strategy):
    x, y = _regression(N_UNEVEN, seed=13)
    w = np.random.default_rng(14).uniform(0.0, 2.0, size=(N_UNEVEN,)).astype("float32")
    return _fit_row(strategy, model_fn=_mlp, optimizer_fn=_sgd, data=(x, y),
                    batch_size=B_UNEVEN, fit_kw={"sample_weight": w})


def _class_weight(strategy):
    return _fit_row(strategy, model_fn=lambda: _mlp(outputs=3, output_activation="softmax"),
                    optimizer_fn=_sgd, data=_classification(N_UNEVEN, seed=15),
                    batch_size=B_UNEVEN, loss="sparse_categorical_crossentropy",
                    metrics=["accuracy"], fit_kw={"class_weight": {0: 1.0, 1: 2.0, 2: 0.5}})


def _two_outputs(strategy):
    keras = _keras()

    def model_fn():
        keras.utils.set_random_seed(1)
        inp = keras.Input((6,), name="x")
        h = keras.layers.Dense(16, activation="relu")(inp)
        a = keras.layers.Dense(1, name="a")(h)
        b = keras.layers.Dense(3, activation="softmax", name="b")(keras.layers.Dense(8, "tanh")(h))
        return keras.Model(inp, {"a": a, "b": b})

    x, ya = _regression(N_UNEVEN, seed=16)
    _, yb = _classification(N_UNEVEN, seed=16)
    return _fit_row(strategy, model_fn=model_fn, optimizer_fn=_sgd, data=(x, {"a": ya, "b": yb}),
                    batch_size=B_UNEVEN, loss={"a": "mse", "b": "sparse_categorical_crossentropy"},
                    compile_kw={"loss_weights": {"a": 1.0, "b": 0.3}})


def _regularizer(strategy):
    keras = _keras()
    return _fit_row(strategy, model_fn=lambda: _mlp(regularizer=keras.regularizers.L2(1e-2)),
                    optimizer_fn=_sgd, data=_regression(N_UNEVEN, seed=17), batch_size=B_UNEVEN)


def _embedding_adam(strategy):
    keras = _keras()
    return _fit_row(strategy, model_fn=lambda: _embedding_model(vocab=50),
                    optimizer_fn=lambda: keras.optimizers.Adam(1e-2),
                    data=_ids(N_UNEVEN, seed=18, vocab=50), batch_size=B_UNEVEN)


def _mixed_float16(strategy):
    keras = _keras()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        t = _fit_row(strategy, model_fn=lambda: _mlp(output_dtype="float32"),
                     optimizer_fn=lambda: keras.optimizers.SGD(0.05),
                     data=_regression(N_UNEVEN, seed=19), batch_size=B_UNEVEN)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    t.checks["compile() wrapped the optimizer in LossScaleOptimizer"] = isinstance(
        t.model.optimizer, keras.optimizers.LossScaleOptimizer)
    return t


def _loss_scale_clipnorm(strategy):
    keras = _keras()
    return _fit_row(strategy, model_fn=_mlp,
                    optimizer_fn=lambda: keras.optimizers.LossScaleOptimizer(
                        keras.optimizers.SGD(0.05, clipnorm=CLIP["clipnorm"])),
                    data=_regression(N_UNEVEN, seed=20), batch_size=B_UNEVEN)


def _steps_per_execution(strategy):
    return _fit_row(strategy, model_fn=_mlp, optimizer_fn=_sgd, data=_regression(N_UNEVEN, seed=21),
                    batch_size=B_UNEVEN, compile_kw={"steps_per_execution": 3})


def _validation_evaluate(strategy):
    x, y = _regression(N_UNEVEN, seed=22)
    xv, yv = _regression(90, seed=23)
    with _scope(strategy):
        model = _mlp()
        model.compile(_sgd(), "mse", metrics=["mae"])
    hist = model.fit(x, y, batch_size=B_UNEVEN, epochs=EPOCHS, shuffle=False, verbose=0,
                     validation_data=(xv, yv)).history
    ev = model.evaluate(xv, yv, batch_size=37, verbose=0, return_dict=True)
    values = {f"history {k}": hist[k] for k in sorted(hist)}
    values.update({f"evaluate {k}": [ev[k]] for k in sorted(ev)})
    return Trained(model, _weights(model), [model.optimizer], values=values)


# --- the registry --------------------------------------------------------------------------------

ROWS: list[Row] = [
    Row("fit_uneven", "built-in fit, SGD momentum, 210 ex / batch 50 (uneven over 4)", _baseline),
]
for _kind in ("global_clipnorm", "clipnorm", "clipvalue"):
    ROWS += [
        Row(f"{_kind}_even", f"SGD({_kind}={CLIP[_kind]}), 200 ex / batch 40 (even)",
            _clip_row(_kind, even=True)),
        Row(f"{_kind}_uneven", f"SGD({_kind}={CLIP[_kind]}), 210 ex / batch 50 (uneven)",
            _clip_row(_kind, even=False)),
    ]
for _kind in ("global_clipnorm", "clipnorm", "clipvalue"):
    ROWS.append(Row(f"{_kind}_accum2", f"SGD({_kind}={CLIP[_kind]}, gradient_accumulation_steps=2),"
                    " tf.data batch 40 drop_remainder (even micro-batches)",
                    _clip_accum_row(_kind)))
ROWS += [
    Row("two_optimizers", "custom train_step, GAN-like: two sub-models, two optimizers, two "
        "apply() calls, keras.losses objects; uneven", _two_optimizers(False)),
    Row("two_optimizers_compute_loss", "as two_optimizers, both losses through "
        "self.compute_loss (compiled loss); uneven", _two_optimizers(True)),
    Row("custom_step_reversed", "custom train_step: optimizer.apply(grads[::-1], "
        "trainable_variables[::-1]); uneven", _custom_step("reversed")),
    Row("custom_step_frozen_layer", "custom train_step, first layer trainable=False, reversed "
        "order; uneven", _custom_step("frozen")),
    Row("custom_step_var_subset", "custom train_step applying the last two layers' gradients "
        "only; uneven", _custom_step("var_subset")),
    Row("custom_step_apply_gradients", "custom train_step: "
        "optimizer.apply_gradients(zip(grads, vars)); uneven", _custom_step("apply_gradients")),
    Row("sync_batchnorm_uneven", "BatchNormalization(synchronized=True); uneven",
        _batchnorm("sync")),
    Row("batchnorm_uneven", "plain BatchNormalization; uneven (per-replica semantics: only "
        "replica identity checked)", _batchnorm("plain"), per_replica=True),
    Row("jit_compile", "compile(jit_compile=True); uneven (XLA cannot compile CPU collectives: "
        "tfdp compiles each replica's step, then reduces and updates)", _jit),
    Row("fit_pydataset", "fit(keras.utils.PyDataset subclass), batches 50 (uneven); user arrays "
        "unchanged", _input_kind("pydataset")),
    Row("fit_generator", "fit(Python generator, steps_per_epoch=5), batches 50 (uneven); user "
        "arrays unchanged", _input_kind("generator")),
    Row("last_batch_1_dense", "Dense, 201 ex / batch 50: last global batch of 1",
        _tiny_last("dense")),
    Row("last_batch_1_conv2d", "Conv2D, 201 ex / batch 50: last global batch of 1",
        _tiny_last("conv2d")),
    Row("last_batch_1_embedding", "Embedding, 201 ex / batch 50: last global batch of 1",
        _tiny_last("embedding")),
    Row("last_batch_1_sync_batchnorm", "BatchNormalization(synchronized=True), 201 ex / batch "
        "50: last global batch of 1", _tiny_last("sync")),
    Row("last_batch_1_batchnorm", "plain BatchNormalization, 201 ex / batch 50: last global "
        "batch of 1 (per-replica semantics: only identity and finiteness checked)",
        _tiny_last("plain"), per_replica=True),
    Row("sample_weight", "fit(sample_weight=...); uneven", _sample_weight),
    Row("class_weight", "3-class softmax, fit(class_weight=...); uneven", _class_weight),
    Row("two_outputs_loss_weights", "two outputs, two losses, loss_weights; uneven",
        _two_outputs),
    Row("kernel_regularizer", "Dense(kernel_regularizer=L2(1e-2)); uneven", _regularizer),
    Row("embedding_adam", "Embedding + Adam; uneven", _embedding_adam),
    # float16 compute: on ONE device, computing each batch's gradient as 4 sub-batch parts
    # (13,13,13,11, weighted, summed in float32) instead of at once already moves the weights by
    # 2.6e-5 after these 10 steps (the same experiment in float32: 6e-8), hence a float16
    # tolerance.
    Row("mixed_float16", "mixed_float16 policy (compile adds LossScaleOptimizer); uneven",
        _mixed_float16, tol=1e-4),
    Row("loss_scale_clipnorm", f"LossScaleOptimizer(SGD(clipnorm={CLIP['clipnorm']})); uneven",
        _loss_scale_clipnorm),
    Row("steps_per_execution_3", "compile(steps_per_execution=3); uneven",
        _steps_per_execution),
    Row("validation_evaluate", "fit(validation_data=...) + evaluate(): weights, history and "
        "evaluate() values equal; uneven", _validation_evaluate),
]
del _kind
ROWS += pattern_losses.ROWS  # losses that divide by something else; what custom steps report

ROWS_BY_NAME = {r.name: r for r in ROWS}
assert len(ROWS_BY_NAME) == len(ROWS)

# The multi-worker subset (tests/test_user_patterns.py runs them on 2 workers x 2 CPU replicas).
MULTIWORKER_ROWS = ["fit_uneven", "clipnorm_uneven", "two_optimizers", "sync_batchnorm_uneven"]
MULTIWORKER_ROWS += pattern_losses.MULTIWORKER_ROWS


def get_row(name: str) -> Row:
    try:
        return ROWS_BY_NAME[name]
    except KeyError:
        raise KeyError(f"Unknown pattern row {name!r}. Valid: {', '.join(ROWS_BY_NAME)}.") \
            from None


# --- running a row -------------------------------------------------------------------------------

def max_diff(ws_a, ws_b) -> float:
    """max |a - b| over matching arrays (float64); nan if any difference is nan."""
    if len(ws_a) != len(ws_b):
        raise ValueError(f"{len(ws_a)} weights vs {len(ws_b)} in the reference")
    out = 0.0
    for a, b in zip(ws_a, ws_b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            raise ValueError(f"weight of shape {a.shape} vs {b.shape} in the reference")
        if a.size == 0:
            continue
        d = float(np.max(np.abs(a - b)))
        if math.isnan(d):
            return float("nan")
        out = max(out, d)
    return out


def _max_rel_diff(values, ref_values) -> float:
    out = 0.0
    for k, ref in ref_values.items():
        if k not in values:
            return float("inf")
        a, b = np.asarray(values[k], np.float64), np.asarray(ref, np.float64)
        if a.shape != b.shape:
            return float("inf")
        d = float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-6)))
        if math.isnan(d):
            return float("nan")
        out = max(out, d)
    return out


def replica_variables(trained: Trained) -> list:
    """Every variable of the model and of its optimizers (each once)."""
    out, seen = [], set()
    for v in list(trained.model.variables) + [v for o in trained.optimizers if o is not None
                                               for v in o.variables]:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out


def differing_replica_copies(strategy, trained: Trained) -> list[str]:
    """Names of variables whose replica copies are not all bitwise identical."""
    bad = []
    for v in replica_variables(trained):
        copies = [np.asarray(c) for c in
                  strategy.experimental_local_results(getattr(v, "value", v))]
        first = copies[0]
        if any(c.shape != first.shape or c.tobytes() != first.tobytes() for c in copies[1:]):
            bad.append(getattr(v, "path", None) or v.name)
    return bad


def digest(weights) -> str:
    h = hashlib.sha256()
    for w in weights:
        h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()


def reference(row: Row) -> Trained:
    """The single-device run (no strategy, no scope)."""
    return row.train(None)


def run_row(row: Row, strategy_factory, ref: Trained | None = None) -> RowResult:
    """Train ``row`` under ``strategy_factory()`` and compare with the no-strategy reference.

    ``strategy_factory`` returns a fresh strategy (or None: the row runs without one and is
    compared with its reference, a determinism check). ``ref`` (from :func:`reference`) is
    computed when not given. Errors raised by the strategy run (strategy creation included) are
    reported in ``error``; errors of the reference run propagate.
    """
    if ref is None:
        ref = reference(row)
    res = RowResult(row.name, per_replica=row.per_replica, tol=row.tol)
    t0 = time.perf_counter()
    try:
        strategy = strategy_factory() if strategy_factory is not None else None
        trained = row.train(strategy)
    except Exception as e:  # noqa: BLE001 - the point is to report it
        import traceback
        res.error = format_error(e)
        res.traceback = traceback.format_exc()
        res.seconds = time.perf_counter() - t0
        return res
    res.seconds = time.perf_counter() - t0
    try:
        res.max_dw = max_diff(trained.weights, ref.weights)
    except ValueError as e:
        res.error = f"weights do not match the reference: {e}"
        return res
    res.weights_sha256 = digest(trained.weights)
    if ref.values:
        res.max_dvalue = _max_rel_diff(trained.values, ref.values)
    res.failed_checks = [name for name, ok in trained.checks.items() if not ok]
    if strategy is not None:
        res.not_identical = differing_replica_copies(strategy, trained)
        res.identical = not res.not_identical
    return res


# --- the benchmark (tfdp bench patterns) ----------------------------------------------------------

def run_patterns(rows: list[Row], devices: list[str], progress: bool = True,
                 zero_stage: int = 0) -> dict:
    """Every row without a strategy, under MirroredStrategy and under tfdp, on ``devices``
    (tfdp with ``zero_stage``: sharded optimizer state, ``tfdp.zero``)."""
    import tensorflow as tf

    from tfdp.bench import _common
    from tfdp.strategy import DataParallelStrategy
    contenders = {
        # ReductionToOneDevice: MirroredStrategy's CPU default (CollectiveAllReduce) reuses
        # group keys across instances in one process, and a clash aborts every collective of
        # the process (tfdp's too); the reducer does not change MirroredStrategy's semantics.
        "mirrored": lambda: tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()),
        "tfdp": lambda: DataParallelStrategy(devices, zero_stage=zero_stage),
    }
    results = []
    t_all = time.perf_counter()
    for i, row in enumerate(rows, 1):
        t0 = time.perf_counter()
        entry = {"row": row.name, "description": row.description,
                 "per_replica": row.per_replica}
        try:
            ref = reference(row)
        except Exception as e:  # noqa: BLE001
            entry["reference_error"] = format_error(e)
            results.append(entry)
            _common.progress(f"[{i}/{len(rows)}] {row.name}: reference {entry['reference_error']}",
                             progress)
            continue
        for key, factory in contenders.items():
            entry[key] = dataclasses.asdict(run_row(row, factory, ref))
        results.append(entry)
        ms, dp = entry["mirrored"], entry["tfdp"]
        _common.progress(f"[{i}/{len(rows)}] {row.name} ({time.perf_counter() - t0:.1f} s): "
                         f"MirroredStrategy {_cell_dw(ms)}; tfdp {_cell_dw(dp)}, "
                         f"identical {_cell_identical(dp)}", progress)
    return {"benchmark": "patterns", "devices": list(devices), "tolerance": TOL,
            "zero_stage": zero_stage, "rows": results, "seconds": time.perf_counter() - t_all,
            "environment": _common.environment()}


def _cell_dw(r: dict) -> str:
    if r.get("error"):
        return r["error"]
    s = fmt(r["max_dw"])
    if r.get("max_dvalue") is not None:
        s += f" (values {fmt(r['max_dvalue'])})"
    if r.get("failed_checks"):
        s += "; " + "; ".join(f"FAILED: {c}" for c in r["failed_checks"])
    return s


def _cell_identical(r: dict) -> str:
    if r.get("error") or r.get("identical") is None:
        return "-"
    if r["identical"]:
        return "yes"
    return f"no ({len(r['not_identical'])} vars)"


def _md(text: str) -> str:
    return str(text).replace("|", "\\|")


def format_patterns(result: dict) -> str:
    """A markdown table: row | MirroredStrategy max|dw| | tfdp max|dw| | tfdp identical | ok."""
    n = len(result["devices"])
    loose = ", ".join(f"{e['row']} <= {e['tfdp']['tol']:g}" for e in result["rows"]
                      if "tfdp" in e and e["tfdp"]["tol"] != TOL)
    stage = result.get("zero_stage") or 0
    lines = [f"User-pattern matrix on {n} CPU replicas: max |dw| vs one device without a "
             f"strategy (exact: <= {TOL:g}{'; ' + loose if loose else ''})"
             + (f"; tfdp with zero_stage={stage}." if stage else "."), "",
             "| row | MirroredStrategy max\\|dw\\| | tfdp max\\|dw\\| | tfdp replicas identical "
             "| tfdp exact |",
             "|---|---|---|---|---|"]
    n_ok = 0
    for e in result["rows"]:
        name = e["row"] + (" (per-replica semantics)" if e["per_replica"] else "")
        if "reference_error" in e:
            lines.append(f"| {_md(name)} | reference {_md(e['reference_error'])} | - | - | - |")
            continue
        dp = e["tfdp"]
        ok = RowResult(**dp).exact
        n_ok += ok
        lines.append(f"| {_md(name)} | {_md(_cell_dw(e['mirrored']))} | {_md(_cell_dw(dp))} | "
                     f"{_cell_identical(dp)} | {'yes' if ok else '**no**'} |")
    lines += ["", f"tfdp exact on {n_ok}/{len(result['rows'])} rows "
                  f"({result['seconds']:.0f} s)."]
    return "\n".join(lines)


__all__ = ["MULTIWORKER_ROWS", "ROWS", "ROWS_BY_NAME", "Row", "RowResult", "TOL", "Trained",
           "format_patterns", "get_row", "reference", "run_patterns", "run_row"]


# --- command line: tfdp bench patterns -----------------------------------------------------------

def build_parser():
    from tfdp.bench.parser import BenchParser, add_common_options
    p = BenchParser("tfdp bench patterns",
                    usage="tfdp bench patterns [--rows NAME,...] [--list] [--cpu-replicas K] "
                          "[--zero-stage S] [--json FILE] [--quiet]",
                    description="The user-pattern matrix (tfdp.bench.patterns, also run by "
                                "tests/test_user_patterns.py): every row trains a tiny Keras "
                                "model as a user writes it, without a strategy (the one-device "
                                "reference), under tf.distribute.MirroredStrategy and under tfdp "
                                "DataParallelStrategy on the same K CPU replicas, and prints a "
                                "markdown table: max |dw| vs the reference (or 'crashes: ...') "
                                "and whether tfdp's replica copies of every variable are bitwise "
                                "identical.",
                    epilog="tfdp promises max |dw| <= 1e-5 on every row; rows marked "
                           "per-replica semantics (plain BatchNormalization) only promise "
                           "identical copies.")
    add_common_options(p)
    p.add_argument("--rows", metavar="NAME,...",
                   help="run only these rows (default: all; --list shows them)")
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2), default=0, metavar="S",
                   help="tfdp's zero_stage (sharded optimizer state; default 0)")
    return p


def parse_args(argv):
    from tfdp.bench.parser import check_positive, check_writable, split_list
    from tfdp.errors import UsageError
    args = build_parser().parse_args(argv)
    if args.list:
        return args
    check_positive("--cpu-replicas", args.cpu_replicas)
    if args.rows is None:
        args.rows = [r.name for r in ROWS]
    else:
        names = split_list(args.rows)
        bad = [n for n in names if n not in ROWS_BY_NAME]
        if bad or not names:
            raise UsageError(f"Invalid --rows. Received: --rows {args.rows}. Valid: "
                             f"{', '.join(ROWS_BY_NAME)} (comma-separated; see --list).")
        args.rows = list(dict.fromkeys(names))
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    from tfdp.bench import _common
    from tfdp.bench.parser import write_json
    if args.list:
        width = max(len(r.name) for r in ROWS)
        for r in ROWS:
            print(f"{r.name.ljust(width)}  {r.description}")
        return 0
    devices = _common.configure_replicas(args.cpu_replicas)  # before the TF runtime starts
    result = run_patterns([ROWS_BY_NAME[n] for n in args.rows], devices, progress=not args.quiet,
                          zero_stage=args.zero_stage)
    print(format_patterns(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp.bench.patterns
    import sys

    from tfdp.bench.parser import run_standalone
    sys.exit(run_standalone("patterns", parse_args, run))

"""The user-pattern rows (:mod:`tfdp_bench.patterns`): built-in fit and optimizer arguments,
custom ``train_step`` s, layers and compile/fit options, and the registry of every row.

Each row is a :class:`~tfdp_bench.pattern_base.Row` whose ``train(strategy)`` trains a tiny model
and returns a :class:`~tfdp_bench.pattern_base.Trained`; the rows about losses that divide by
something else are in :mod:`tfdp_bench.pattern_losses`. Importing this module does not import
TensorFlow or Keras.
"""

from __future__ import annotations

import math

import numpy as np

from tfdp_bench import pattern_losses
from tfdp_bench.pattern_base import (B_EVEN, B_TINY_LAST, B_UNEVEN, EPOCHS, N_EVEN, N_TINY_LAST,
                                     N_UNEVEN, Row, Trained, _classification, _fit_row, _keras,
                                     _mlp, _regression, _scope, _sgd, _weights)


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

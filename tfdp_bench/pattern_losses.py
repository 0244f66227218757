"""The user-pattern matrix's loss rows: losses that divide by something other than the number of
examples, and what custom steps report.

Each row is a user script as written for one device (masked sequence losses, weighted means, a
loss function that returns a scalar, a hand-written loss in ``train_step`` or ``compute_loss``,
a user's own ``keras.metrics.Mean`` loss tracker), trained on the matrix's uneven global batches
(210 examples in batches of 50 over 4 replicas), and compared with one device on weights *and*
on the values the user reads: History (loss per output, metrics) and ``evaluate()``.
"""

from __future__ import annotations

import numpy as np

from tfdp_bench.pattern_base import (B_TINY_LAST, B_UNEVEN, EPOCHS, N_TINY_LAST, N_UNEVEN, Row,
                                     Trained, _keras, _mlp, _regression, _scope, _weights)

T, VOCAB, CLASSES = 7, 30, 5  # tokens per sequence, vocabulary (0 = padding), token classes
EVAL_BATCH = 37  # evaluate()'s batch: 210 -> 5 x 37 + 25 (uneven over 4 replicas)


def _sequences(n, seed):
    """Padded token sequences (lengths 1..T, id 0 = padding) and per-token class labels."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=n)
    x = np.zeros((n, T), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.integers(1, VOCAB, size=length)
    y = ((x * 7 + 3) % CLASSES).astype("int32")
    return x, y


def _gru_tagger(seed=1):
    """Embedding(mask_zero=True) -> GRU(return_sequences) -> per-token logits."""
    keras = _keras()
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((T,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 8, mask_zero=True, name="embed"),
        keras.layers.GRU(8, return_sequences=True, name="gru"),
        keras.layers.Dense(CLASSES, name="logits")])


def _sgd():
    return _keras().optimizers.SGD(0.1, momentum=0.9)


def _report(model, hist, ev):
    """The values a user reads: History per epoch and evaluate()."""
    values = {f"history {k}": hist[k] for k in sorted(hist)}
    values.update({f"evaluate {k}": [ev[k]] for k in sorted(ev)})
    return Trained(model, _weights(model), [model.optimizer], values=values)


def _fit_report(strategy, *, model_fn, loss, data, fit_kw=None, eval_kw=None, compile_kw=None,
                optimizer_fn=_sgd, n=N_UNEVEN, batch_size=B_UNEVEN, metrics=None):
    """The plain user script: compile under the scope, fit, evaluate; weights and values."""
    x, y = data
    with _scope(strategy):
        model = model_fn()
        model.compile(optimizer_fn(), loss=loss, metrics=metrics, **(compile_kw or {}))
    hist = model.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0,
                     **(fit_kw or {})).history
    ev = model.evaluate(x, y, batch_size=EVAL_BATCH, verbose=0, return_dict=True, **(eval_kw or {}))
    return _report(model, hist, ev)


# --- built-in fit: masks, weighted means, sums, scalars ------------------------------------------

def _masked_gru(compile_kw=None, n=N_UNEVEN, batch_size=B_UNEVEN, optimizer_kw=None):
    def train(strategy):
        keras = _keras()
        return _fit_report(
            strategy, model_fn=_gru_tagger, data=_sequences(n, seed=31), n=n,
            batch_size=batch_size, compile_kw=compile_kw,
            optimizer_fn=lambda: keras.optimizers.SGD(0.1, momentum=0.9, **(optimizer_kw or {})),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["sparse_categorical_accuracy"])
    return train


def _mean_with_sample_weight(strategy):
    keras = _keras()
    x, y = _regression(N_UNEVEN, seed=32)
    w = np.random.default_rng(33).uniform(0.0, 2.0, size=(N_UNEVEN,)).astype("float32")
    return _fit_report(strategy, model_fn=_mlp, data=(x, y), fit_kw={"sample_weight": w},
                       eval_kw={"sample_weight": w}, optimizer_fn=lambda: keras.optimizers.SGD(
                           0.05, momentum=0.9),
                       loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
                       metrics=["mae"])


def _sum_reduction(strategy):
    keras = _keras()
    return _fit_report(strategy, model_fn=_mlp, data=_regression(N_UNEVEN, seed=34),
                       optimizer_fn=lambda: keras.optimizers.SGD(5e-4, momentum=0.9),
                       loss=keras.losses.MeanSquaredError(reduction="sum"), metrics=["mae"])


def _scalar_loss_fn(strategy):
    keras = _keras()
    ops = keras.ops

    def my_mse(y_true, y_pred):  # one scalar for the whole batch
        return ops.mean(ops.square(y_true - y_pred))

    return _fit_report(strategy, model_fn=_mlp, data=_regression(N_UNEVEN, seed=35),
                       optimizer_fn=lambda: keras.optimizers.SGD(0.05, momentum=0.9),
                       loss=my_mse, metrics=["mae"])


def _mlm_padding(strategy):
    """BERT-style masked LM: padded sequences, the loss only on the masked positions (per-token
    sample weights) and averaged over them (``mean_with_sample_weight``), padding masked too."""
    keras = _keras()
    x, y = _sequences(N_UNEVEN, seed=36)
    rng = np.random.default_rng(37)
    picked = ((rng.uniform(size=x.shape) < 0.3) & (x > 0)).astype("float32")
    x_in = np.where(picked > 0, VOCAB - 1, x).astype("int32")  # the [MASK] token
    return _fit_report(strategy, model_fn=_gru_tagger, data=(x_in, y),
                       fit_kw={"sample_weight": picked}, eval_kw={"sample_weight": picked},
                       loss=keras.losses.SparseCategoricalCrossentropy(
                           from_logits=True, reduction="mean_with_sample_weight"))


def _per_timestep_weights(strategy):
    keras = _keras()
    x, y = _sequences(N_UNEVEN, seed=38)
    w = np.random.default_rng(39).uniform(0.0, 2.0, size=x.shape).astype("float32")
    return _fit_report(strategy, model_fn=_gru_tagger, data=(x, y), fit_kw={"sample_weight": w},
                       eval_kw={"sample_weight": w},
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _class_weighted_tokens_masked(strategy):
    """Class weights per token (Keras's class_weight takes no sequence targets: the per-token
    weights a user builds from a class-weight table) on a masked sequence loss."""
    keras = _keras()
    x, y = _sequences(N_UNEVEN, seed=40)
    table = np.array([1.0, 2.0, 0.5, 1.5, 0.8], "float32")
    return _fit_report(strategy, model_fn=_gru_tagger, data=(x, y),
                       fit_kw={"sample_weight": table[y]}, eval_kw={"sample_weight": table[y]},
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def _two_outputs_masked(strategy):
    """Two outputs, loss_weights, a masked per-token loss and a weighted-mean sequence loss."""
    keras = _keras()

    def model_fn():
        keras.utils.set_random_seed(1)
        inp = keras.Input((T,), dtype="int32")
        h = keras.layers.GRU(8, return_sequences=True)(
            keras.layers.Embedding(VOCAB, 8, mask_zero=True)(inp))
        tags = keras.layers.Dense(CLASSES, name="tags")(h)
        score = keras.layers.Dense(1, name="score")(keras.layers.GlobalAveragePooling1D()(h))
        return keras.Model(inp, {"tags": tags, "score": score})

    x, y = _sequences(N_UNEVEN, seed=41)
    score = (x > 0).sum(axis=1, keepdims=True).astype("float32") / T
    return _fit_report(
        strategy, model_fn=model_fn, data=(x, {"tags": y, "score": score}),
        loss={"tags": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              "score": keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")},
        compile_kw={"loss_weights": {"tags": 1.0, "score": 0.5}})


def _activity_regularizer(strategy):
    keras = _keras()

    def model_fn():
        keras.utils.set_random_seed(1)
        inp = keras.Input((6,))
        h = keras.layers.Dense(16, activation="relu",
                               activity_regularizer=keras.regularizers.L2(1e-2))(inp)
        return keras.Model(inp, keras.layers.Dense(1)(h))

    return _fit_report(strategy, model_fn=model_fn, data=_regression(N_UNEVEN, seed=42),
                       optimizer_fn=lambda: keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")


# --- custom train_step / compute_loss: hand-written losses and the user's own trackers -----------

def _custom_step(kind):
    """A model subclass with a custom ``train_step`` / ``test_step`` (keras.io's "Customizing what
    happens in fit()"): its own ``Mean`` loss tracker and MAE metric; the loss a Keras loss object
    (``"loss_object"``) or written by hand (``"hand_written"``: ``ops.mean(...)``)."""
    def train(strategy):
        import tensorflow as tf
        keras = _keras()
        ops = keras.ops

        class Custom(keras.Model):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.loss_tracker = keras.metrics.Mean(name="loss")
                self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
                self.loss_fn = keras.losses.MeanSquaredError()

            def _loss(self, y, y_pred):
                if kind == "hand_written":
                    return ops.mean(ops.square(y - y_pred))
                return self.loss_fn(y, y_pred)

            def train_step(self, data):
                x, y = data
                with tf.GradientTape() as tape:
                    y_pred = self(x, training=True)
                    loss = self._loss(y, y_pred)
                grads = tape.gradient(loss, self.trainable_variables)
                self.optimizer.apply(grads, self.trainable_variables)
                self.loss_tracker.update_state(loss)
                self.mae_metric.update_state(y, y_pred)
                return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

            def test_step(self, data):
                x, y = data
                y_pred = self(x, training=False)
                self.loss_tracker.update_state(self._loss(y, y_pred))
                self.mae_metric.update_state(y, y_pred)
                return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

            @property
            def metrics(self):
                return [self.loss_tracker, self.mae_metric]

        with _scope(strategy):
            model = _mlp(cls=Custom)
            model.compile(keras.optimizers.SGD(0.05, momentum=0.9))
        x, y = _regression(N_UNEVEN, seed=43)
        hist = model.fit(x, y, batch_size=B_UNEVEN, epochs=EPOCHS, shuffle=False,
                         verbose=0).history
        ev = model.evaluate(x, y, batch_size=EVAL_BATCH, verbose=0, return_dict=True)
        return _report(model, hist, ev)
    return train


def _custom_step_compiled_loss(strategy):
    """The TF 2 era custom step: ``self.compiled_loss(...)`` (deprecated, still there) and
    ``self.compute_metrics(...)``; compile(loss="mse", metrics=["mae"])."""
    import tensorflow as tf
    keras = _keras()

    class Custom(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compiled_loss(y, y_pred)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            return self.compute_metrics(x, y, y_pred, None)

    return _fit_report(strategy, model_fn=lambda: _mlp(cls=Custom),
                       data=_regression(N_UNEVEN, seed=45), loss="mse", metrics=["mae"],
                       optimizer_fn=lambda: keras.optimizers.SGD(0.05, momentum=0.9))


def _compute_loss_override(strategy):
    """Keras's own ``compute_loss`` docstring example: ``ops.mean((y_pred - y) ** 2)`` plus the
    model's regularization losses, its own tracker; Keras's built-in train_step."""
    keras = _keras()
    ops = keras.ops

    class Custom(keras.Model):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.loss_tracker = keras.metrics.Mean(name="my_loss")

        def compute_loss(self, x, y, y_pred, sample_weight, training=True):
            loss = ops.mean((y_pred - y) ** 2)
            loss += ops.sum(self.losses)
            self.loss_tracker.update_state(loss)
            return loss

    with _scope(strategy):
        model = _mlp(cls=Custom, regularizer=keras.regularizers.L2(1e-2))
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9))
    x, y = _regression(N_UNEVEN, seed=44)
    hist = model.fit(x, y, batch_size=B_UNEVEN, epochs=EPOCHS, shuffle=False, verbose=0).history
    ev = model.evaluate(x, y, batch_size=EVAL_BATCH, verbose=0, return_dict=True)
    return _report(model, hist, ev)


ROWS: list[Row] = [
    Row("masked_sequence_loss", "Embedding(mask_zero=True) + GRU(return_sequences=True), "
        "per-token SparseCategoricalCrossentropy: a mean over valid tokens; uneven",
        _masked_gru()),
    Row("masked_sequence_accum2", "masked per-token loss, gradient_accumulation_steps=2; uneven",
        _masked_gru(optimizer_kw={"gradient_accumulation_steps": 2})),
    Row("masked_sequence_spe3", "masked per-token loss, steps_per_execution=3; uneven",
        _masked_gru(compile_kw={"steps_per_execution": 3})),
    Row("masked_sequence_last_batch_1", "masked per-token loss, 201 ex / batch 50: last global "
        "batch of 1 (3 replicas empty)", _masked_gru(n=N_TINY_LAST, batch_size=B_TINY_LAST)),
    Row("mlm_padding", "BERT-style MLM: padded sequences, loss on masked positions only "
        "(per-token weights, mean_with_sample_weight); uneven", _mlm_padding),
    Row("per_timestep_weights", "sequence loss with per-timestep sample weights and padding "
        "masked; uneven", _per_timestep_weights),
    Row("class_weighted_tokens_masked", "per-token class weights on a masked sequence loss; "
        "uneven", _class_weighted_tokens_masked),
    Row("mean_with_sample_weight", "MeanSquaredError(reduction='mean_with_sample_weight') + "
        "sample_weight: a mean over the sum of weights; uneven", _mean_with_sample_weight),
    Row("sum_reduction", "MeanSquaredError(reduction='sum'); uneven", _sum_reduction),
    Row("scalar_loss_fn", "compile(loss=fn), fn returns ops.mean(...) (a scalar); uneven",
        _scalar_loss_fn),
    Row("two_outputs_masked", "two outputs, loss_weights: a masked per-token loss and a "
        "weighted-mean loss; uneven", _two_outputs_masked),
    Row("activity_regularizer", "Dense(activity_regularizer=L2) (an add_loss per step); uneven",
        _activity_regularizer),
    Row("custom_step_loss_tracker", "custom train_step/test_step (keras.io guide): own "
        "Mean('loss') tracker of a MeanSquaredError() loss, MAE metric; uneven",
        _custom_step("loss_object")),
    Row("custom_step_scalar_loss", "custom train_step/test_step with a hand-written scalar loss "
        "ops.mean(...), own Mean tracker; uneven", _custom_step("hand_written")),
    Row("custom_step_compiled_loss", "custom train_step with self.compiled_loss(...) and "
        "self.compute_metrics(...); uneven", _custom_step_compiled_loss),
    Row("compute_loss_override", "compute_loss override (Keras's docstring example: "
        "ops.mean + sum(self.losses), own tracker), L2 regularizers; uneven",
        _compute_loss_override),
]

# rows the multi-worker test runs too (2 workers x 2 replicas)
MULTIWORKER_ROWS = ["masked_sequence_loss", "masked_sequence_last_batch_1",
                    "masked_sequence_accum2", "masked_sequence_spe3", "mean_with_sample_weight",
                    "scalar_loss_fn", "custom_step_loss_tracker", "custom_step_scalar_loss"]

__all__ = ["ROWS", "MULTIWORKER_ROWS"]

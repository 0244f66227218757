"""What the user-pattern matrix's rows are made of: the row and result types, the reference data,
the tiny models and the plain user script (``fit_row``), shared by ``tfdp_bench.patterns`` (the
registry and the runner) and the row modules (``tfdp_bench.pattern_losses``).

Importing this module does not import TensorFlow or Keras.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any, Callable

import numpy as np

TOL = 1e-5        # max |dw| tfdp promises (float32)
VALUE_RTOL = 1e-5  # relative tolerance for metrics / evaluate() values

N_UNEVEN, B_UNEVEN = 210, 50  # 13,13,13,11 per batch; last batch 10 -> 3,3,3,1
N_EVEN, B_EVEN = 200, 40      # 10 per replica, 5 batches
N_TINY_LAST, B_TINY_LAST = 201, 50  # last global batch of 1 over 4 replicas
EPOCHS = 2


# --- data structures -----------------------------------------------------------------------------

@dataclasses.dataclass
class Trained:
    """What a row's train function returns."""
    model: Any
    weights: list                       # numpy arrays compared with the reference
    optimizers: list                    # every optimizer whose variables must match on replicas
    values: dict = dataclasses.field(default_factory=dict)  # name -> floats, compared (rtol)
    checks: dict = dataclasses.field(default_factory=dict)  # name -> bool, must be True


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    description: str
    train: Callable[[Any], Trained]     # train(strategy or None) -> Trained
    per_replica: bool = False           # per-replica semantics: only replica identity checked
    tol: float = TOL                    # max |dw| allowed (TOL except for float16 compute)


@dataclasses.dataclass
class RowResult:
    row: str
    error: str | None = None            # "crashes: Type: first line" (strategy run)
    max_dw: float | None = None         # max |w - w_ref| over model.get_weights()
    identical: bool | None = None       # every replica copy of every variable bitwise equal
    not_identical: list = dataclasses.field(default_factory=list)  # variable names that differ
    max_dvalue: float | None = None     # max relative difference of the row's values
    failed_checks: list = dataclasses.field(default_factory=list)
    per_replica: bool = False
    tol: float = TOL
    weights_sha256: str | None = None   # digest of the strategy run's weights
    seconds: float = 0.0
    traceback: str | None = None

    @property
    def exact(self) -> bool:
        """What the test asserts: exact where the row promises it, identical copies always."""
        if self.error or self.failed_checks or not self.identical:
            return False
        if self.per_replica:
            return True
        return (self.max_dw is not None and self.max_dw <= self.tol
                and (self.max_dvalue is None or self.max_dvalue <= VALUE_RTOL))

    def summary(self) -> str:
        if self.error:
            return self.error
        parts = [f"max|dw| {fmt(self.max_dw)}"]
        if self.identical is not None:
            parts.append("replicas identical" if self.identical else
                         f"replicas differ ({len(self.not_identical)} vars)")
        if self.max_dvalue is not None:
            parts.append(f"values rel diff {fmt(self.max_dvalue)}")
        parts += [f"check failed: {c}" for c in self.failed_checks]
        return ", ".join(parts)


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return "0" if x == 0 else f"{x:.1e}"


_TF_FUNCTION_NODE = re.compile(r"\{\{function_node [^}]*\}\}\s*")
_TF_TRACE_LINES = ("Detected at node", "File ", "[[", "Cf. ")
_TF_COUNTS = re.compile(r"^\d+ (root error|successful operation|derived error)")
_TF_ERROR_INDEX = re.compile(r"^\(\d+\) [A-Z_]+:\s*")
_TF_OP_SUFFIX = re.compile(r"\s*\[Op:[^\]]*\]( name:.*)?$")


def format_error(e: BaseException) -> str:
    """'crashes: <ExceptionType>: <first line of the message>' (TF's node prefixes dropped)."""
    text = _TF_FUNCTION_NODE.sub("", str(e))
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    if first.startswith("Graph execution error"):  # the cause follows TF's node traceback
        causes = [ln for ln in lines[1:] if not ln.startswith(_TF_TRACE_LINES)
                  and not _TF_COUNTS.match(ln)]
        if causes:
            first = f"{first} {_TF_ERROR_INDEX.sub('', causes[0])}"
    first = _TF_OP_SUFFIX.sub("", first)
    if len(first) > 160:
        first = first[:157] + "..."
    return f"crashes: {type(e).__name__}: {first}" if first else f"crashes: {type(e).__name__}"


# --- helpers shared by the rows --------------------------------------------------------------------

def _scope(strategy):
    return strategy.scope() if strategy is not None else contextlib.nullcontext()


def _keras():
    import keras
    return keras


def _regression(n, features=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, 1))
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def _classification(n, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, classes))
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(n, classes)), axis=1).astype("int32")
    return x, y


def _mlp(inputs=6, hidden=16, outputs=1, seed=1, batchnorm=None, regularizer=None,
         frozen_first=False, cls=None, output_activation=None, output_dtype=None):
    """Input -> Dense(hidden, relu) [-> BN] -> Dense(8, tanh) -> Dense(outputs)."""
    keras = _keras()
    keras.utils.set_random_seed(seed)
    inp = keras.Input((inputs,), name="x")
    h = keras.layers.Dense(hidden, activation="relu", kernel_regularizer=regularizer,
                           name="dense_in")(inp)
    if batchnorm is not None:
        h = keras.layers.BatchNormalization(synchronized=batchnorm == "sync", name="bn")(h)
    h = keras.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer, name="hidden")(h)
    out = keras.layers.Dense(outputs, activation=output_activation, dtype=output_dtype,
                             name="out")(h)
    model = (cls or keras.Model)(inp, out)
    if frozen_first:
        model.get_layer("dense_in").trainable = False
    return model


def _sgd(**kw):
    return _keras().optimizers.SGD(0.05, momentum=0.9, **kw)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _fit_row(strategy, *, model_fn, optimizer_fn, data, batch_size, loss="mse", metrics=None,
             compile_kw=None, fit_kw=None, epochs=EPOCHS):
    """The plain user script: build + compile under the scope, fit(x, y) outside."""
    x, y = data
    with _scope(strategy):
        model = model_fn()
        model.compile(optimizer=optimizer_fn(), loss=loss, metrics=metrics, **(compile_kw or {}))
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
              **(fit_kw or {}))
    return Trained(model, _weights(model), [model.optimizer])

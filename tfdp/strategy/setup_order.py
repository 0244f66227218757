"""The two-line change in the wrong place: a model built before the strategy, said in tfdp's words.

A Keras model's variables are created by whichever strategy is current when the model is built.
Built before ``tfdp.set_default_strategy()`` / ``tfdp.DataParallelStrategy()`` (or outside
``with strategy.scope():``), they are plain, single-device variables, and the first training step
fails deep in TensorFlow when the optimizer, created under the strategy, builds its slots next to
them (``StrategyExtended.colocate_vars_with``):

* the variable was not created by this strategy: "`colocate_vars_with` must only be passed a
  variable created in this tf.distribute.Strategy.scope()" (model built before
  ``set_default_strategy()``, or ``fit`` inside the strategy's scope);
* the model trains outside the strategy's scope, its optimizer inside: 'Need to be inside "with
  strategy.scope()"' (model built before ``DataParallelStrategy()``, compiled in its scope).

``SetupOrderChecks.colocate_vars_with`` (mixed into both tfdp extendeds) raises a
:class:`SetupOrderError` instead, in the same situations, naming the variable and the fix for the
form the program uses (the default strategy, or ``with strategy.scope():``).

The same mixin checks every other order a script can get wrong, at the same point (the step
the strategy is asked to run) and with the same error, before TensorFlow fails on it:

* the model built before the strategy (its trainable variables are plain ``tf.Variable``\ s);
* the model compiled before the strategy (its optimizer was created under no strategy: TF's
  "Mixing different tf.distribute.Strategy objects: ... is not <..._DefaultDistributionStrategy
  object ...>" when the optimizer builds its slots);
* the model trained, or loaded with ``keras.models.load_model``, before the strategy or outside
  its scope (the optimizer's state already exists, on one device: TF's bare ``AssertionError``);
* a model (or an optimizer) created under another strategy, and a strategy's scope entered
  while another strategy is current (TF's "Mixing different tf.distribute.Strategy objects").

:func:`check_step` is the check (``SetupOrderChecks._call_for_each_replica`` runs it on the
model whose step ``strategy.run`` is given); :func:`setup_order_error` builds every message.
"""

from __future__ import annotations

import inspect
import weakref

from tfdp.errors import TfdpError, message

# The strategy tfdp.set_default_strategy() made the program's default (weakly held).
_program_default = {"ref": None}


def remember_program_default(strategy) -> None:
    """Called by ``tfdp.set_default_strategy``: which strategy the program's default is."""
    _program_default["ref"] = weakref.ref(strategy)


def is_program_default(strategy) -> bool:
    ref = _program_default["ref"]
    return ref is not None and ref() is strategy


class SetupOrderError(TfdpError, RuntimeError):
    """A model (or its variables, its optimizer) created before the strategy, outside its scope,
    or under another strategy."""


def _variable_name(variable) -> str:
    # (a Keras variable's path, 'sequential/dense/kernel'; a tf.Variable's name)
    name = getattr(variable, "path", None) or getattr(variable, "name", None) or repr(variable)
    return str(name).removesuffix(":0")


_NO_STRATEGY = "no strategy"  # (what a plain, not distributed, variable was created under)


def _is_tf_default(strategy) -> bool:
    """TF's default strategy (what ``tf.distribute.get_strategy()`` is outside every scope)."""
    return (strategy is _NO_STRATEGY
            or type(strategy).__name__.startswith("_DefaultDistributionStrategy"))


def _created_under(variable):
    """The strategy whose scope created ``variable`` (a Keras or TF variable): a distributed
    variable's public ``distribute_strategy``; ``_NO_STRATEGY`` for a plain one."""
    owner = getattr(getattr(variable, "value", variable), "distribute_strategy", None)
    return _NO_STRATEGY if owner is None else owner


def describe(strategy) -> str:
    """A strategy as a message names it: two tfdp strategies with the same devices are told
    apart by their address, the program's default says so."""
    if strategy is None or _is_tf_default(strategy):
        return "no strategy (TF's default)"
    text = f"{type(strategy).__name__} at 0x{id(strategy):x}"
    if is_program_default(strategy):
        text += " (the program's default, from tfdp.set_default_strategy())"
    return text


# What went wrong, by the first set-up step that came too early (or under another strategy).
_WHAT = {
    "built": "The model was built {before}, so its variables are not mirrored across the replicas",
    "compiled": "The model's optimizer was created {before} (by model.compile, or passed to it), "
                "so it belongs to no strategy and cannot create its state on the replicas",
    "trained": "The model was trained, or loaded with keras.models.load_model, {before}, so its "
               "optimizer state sits on one device, not on the replicas",
    "created": "An optimizer (or another object with variables) was created {before}, so it is "
               "not mirrored across the replicas",
    "other": "Two strategies are mixed: a model, optimizer or scope of one strategy is used while "
             "another is current",
}
_FIX_DEFAULT = ("Call tfdp.set_default_strategy() before the model is built: move it above "
                "`model = ...` (layers, model and optimizer must all be created after it)")
_FIX_SCOPE = ("Create the strategy first and the model inside its scope: `strategy = "
              "tfdp.DataParallelStrategy()`, then `with strategy.scope(): model = build_model(); "
              "model.compile(...)`; or call tfdp.set_default_strategy() before building the model")
_FIX_LOADED = {True: "; a saved model: `model = keras.models.load_model(path)` after the call",
               False: " (a saved model: `with strategy.scope(): model = "
                      "keras.models.load_model(path)`)"}
_FIX_OTHER = ("Build, compile and train each model under one strategy: call "
              "tfdp.set_default_strategy() once, before any model, or create one `strategy = "
              "tfdp.DataParallelStrategy()` and use its `with strategy.scope():` throughout; to "
              "move a model to another strategy, save it and load it inside that strategy's scope.")


def setup_order_error(strategy, stage: str, received: str) -> SetupOrderError:
    """The one error for every wrong set-up order (all messages are built here).

    Args:
      strategy: the tfdp strategy that met the problem (the one training).
      stage: ``"built"`` (the model's variables are plain), ``"compiled"`` (its optimizer was
        created under no strategy), ``"trained"`` (its optimizer state exists on one device:
        trained or loaded before the strategy), ``"created"`` (an optimizer or variable of a
        custom loop), ``"other"`` (objects or scopes of two strategies mixed).
      received: what was met (the variable, the optimizer, the strategies).
    """
    if stage == "other":
        return SetupOrderError(message(_WHAT["other"], received, _FIX_OTHER))
    default = is_program_default(strategy)
    before = ("before tfdp.set_default_strategy()" if default else
              f"before the {type(strategy).__name__} was created or outside its "
              "`with strategy.scope():` block")
    fix = _FIX_DEFAULT if default else _FIX_SCOPE
    if stage in ("trained", "compiled"):
        fix += _FIX_LOADED[default]
    return SetupOrderError(message(_WHAT[stage].format(before=before), received, fix + "."))


def model_before_strategy_error(strategy, variable, outside_scope: bool) -> SetupOrderError:
    """The error for a model whose variable ``variable`` the strategy does not own (met by the
    optimizer when it creates its slots: ``colocate_vars_with``).

    Args:
      strategy: the tfdp strategy whose optimizer met the variable.
      variable: the model's variable (a plain ``tf.Variable``).
      outside_scope: True when training ran outside the strategy's scope (Keras recorded no
        strategy for the model), False when inside it.
    """
    name = type(strategy).__name__
    received = (f"variable {_variable_name(variable)!r}, a plain tf.Variable on one device "
                f"(not mirrored), met by the optimizer of {name} ("
                + ("training ran outside its scope" if outside_scope else "inside its scope")
                + ")")
    return setup_order_error(strategy, "built", received)


def step_model(fn):
    """The Keras model whose step ``fn`` is (its bound ``train_step`` / ``test_step`` /
    ``predict_step``, as Keras passes it to ``strategy.run``, maybe wrapped), else None (a
    custom loop's function)."""
    model = getattr(inspect.unwrap(fn), "__self__", None)
    return model if model is not None and hasattr(model, "metrics_variables") else None


def check_step(strategy, fn) -> None:
    """Raise :class:`SetupOrderError` when ``fn`` is a model's ``train_step`` and the model was
    built, compiled, trained or loaded before ``strategy`` (or outside its scope), or under
    another strategy. A custom loop's function is not checked here (``colocate_vars_with`` and
    :func:`translate_mixing` cover it); evaluation and prediction steps are not checked (they
    read the variables, wherever they were made)."""
    model = step_model(fn)
    if model is None or getattr(inspect.unwrap(fn), "__name__", "") != "train_step":
        return
    where = f"model {getattr(model, 'name', type(model).__name__)!r}"
    name = type(strategy).__name__
    optimizer = getattr(model, "optimizer", None)
    # an optimizer's strategy: the one its first variable (its step counter, made in its
    # __init__) was created under
    optimizers = [(opt, _created_under(opt.variables[0]))
                  for opt in (optimizer, getattr(optimizer, "inner_optimizer", None))
                  if opt is not None and getattr(opt, "variables", None)]
    state_before = next((opt for opt, owner in optimizers
                         if _is_tf_default(owner) and getattr(opt, "built", False)), None)
    for variable in model.trainable_variables:
        owner = _created_under(variable)
        if owner is _NO_STRATEGY:
            owner = None
        if owner is strategy:
            continue
        if owner is not None:
            raise setup_order_error(strategy, "other", (
                f"variable {_variable_name(variable)!r} of {where} belongs to {describe(owner)}; "
                f"the training step is run by {describe(strategy)}"))
        received = (f"variable {_variable_name(variable)!r} of {where}, a plain tf.Variable on "
                    f"one device (not mirrored), in a training step of {name}")
        if state_before is not None:   # built and trained (or loaded) before: say the latter
            raise setup_order_error(strategy, "trained", received + (
                f"; its optimizer {state_before.name!r} already has its state "
                f"(iterations={_iterations(state_before)})"))
        raise setup_order_error(strategy, "built", received)
    for opt, owner in optimizers:
        if owner is None or owner is strategy:
            continue
        kind = f"optimizer {getattr(opt, 'name', '?')!r} ({type(opt).__name__}) of {where}"
        if not _is_tf_default(owner):
            raise setup_order_error(strategy, "other", (
                f"{kind} was created under {describe(owner)}; the training step is run by "
                f"{describe(strategy)}"))
        if opt is state_before:
            raise setup_order_error(strategy, "trained", (
                f"{kind}, created under no strategy, with its state already on one device "
                f"(iterations={_iterations(opt)}), in a training step of {name}"))
        raise setup_order_error(strategy, "compiled", (
            f"{kind}, created under no strategy, in a training step of {name}"))


def _iterations(optimizer) -> str:
    import tensorflow as tf
    try:
        with tf.init_scope():   # (the check runs while Keras traces the step)
            return str(int(optimizer.iterations.numpy()))
    except Exception:  # pylint: disable=broad-except  (only a detail of the message)
        return "?"


def translate_mixing(strategy, error: RuntimeError) -> SetupOrderError | None:
    """TF's "Mixing different tf.distribute.Strategy objects: A is not B" met while ``strategy``
    runs a step or enters its scope, as a :class:`SetupOrderError` (None for other errors)."""
    text = str(error)
    if isinstance(error, SetupOrderError) or "Mixing different tf.distribute.Strategy" not in text:
        return None
    tf_words = text.split(": ", 1)[-1]
    current = _current_strategy()
    if "_DefaultDistributionStrategy" in text:
        return setup_order_error(strategy, "created", (
            f"an object created under no strategy, used under {describe(strategy)} (TF: "
            f"{tf_words!r})"))
    if current is not None and current is not strategy:
        received = (f"{describe(strategy)}.scope() entered while {describe(current)} is "
                    "current (a model created under the first, trained under the second)")
    else:
        received = f"TF: {tf_words!r}, in {describe(strategy)}"
    return setup_order_error(strategy, "other", received)


def _current_strategy():
    import tensorflow as tf
    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


class CheckedScope:
    """``strategy.scope()`` (tfdp's strategies return it from their public ``scope``), entering which while another strategy is current is a
    :class:`SetupOrderError` (TF's "Mixing different tf.distribute.Strategy objects")."""

    def __init__(self, scope, strategy):
        self._scope = scope
        self._strategy = strategy

    def __enter__(self):
        try:
            return self._scope.__enter__()
        except RuntimeError as e:
            error = translate_mixing(self._strategy, e)
            if error is None:
                raise
            raise error from None

    def __exit__(self, exc_type, exc, tb):
        # (an error in the block, e.g. Keras building an optimizer made under no strategy)
        error = translate_mixing(self._strategy, exc) if isinstance(exc, RuntimeError) else None
        result = self._scope.__exit__(exc_type, exc, tb)
        if error is not None:
            raise error from None
        return result


class SetupOrderChecks:
    """Mixin for tfdp's extendeds: every wrong set-up order (see the module docstring) is one
    :class:`SetupOrderError` naming the fix, raised where TF would fail (or earlier)."""

    def _call_for_each_replica(self, fn, args, kwargs):
        if self.tfdp_context is not None:   # nested (a merge_call's): checked by the outer one
            return super()._call_for_each_replica(fn, args, kwargs)
        strategy = self._container_strategy()
        check_step(strategy, fn)
        try:
            return super()._call_for_each_replica(fn, args, kwargs)
        except RuntimeError as e:
            error = translate_mixing(strategy, e)
            if error is None:
                raise
            raise error from None

    def colocate_vars_with(self, colocate_with_variable):
        try:
            return super().colocate_vars_with(colocate_with_variable)
        except RuntimeError as e:
            if "Need to be inside" not in str(e):
                raise
            raise model_before_strategy_error(self._container_strategy(),
                                              colocate_with_variable, True) from None
        except ValueError as e:
            if "colocate_vars_with" not in str(e):
                raise
            raise model_before_strategy_error(self._container_strategy(),
                                              colocate_with_variable, False) from None


__all__ = ["CheckedScope", "SetupOrderChecks", "SetupOrderError", "check_step", "describe", "is_program_default",
           "model_before_strategy_error", "remember_program_default", "setup_order_error",
           "step_model", "translate_mixing"]

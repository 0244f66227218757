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
"""

from __future__ import annotations

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
    """A model (or its variables) created before the strategy / outside its scope."""


def _variable_name(variable) -> str:
    name = getattr(variable, "name", None) or getattr(variable, "path", None) or repr(variable)
    return str(name).removesuffix(":0")


def model_before_strategy_error(strategy, variable, outside_scope: bool) -> SetupOrderError:
    """The error for a model whose variable ``variable`` the strategy does not own.

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
    if is_program_default(strategy):
        what = ("The model was built before tfdp.set_default_strategy(), so its variables are "
                "not mirrored across the replicas")
        fix = ("Call tfdp.set_default_strategy() before the model is built: move it above "
               "`model = ...` (layers, model and optimizer must all be created after it).")
    else:
        what = (f"The model was built before the {name} was created or outside its "
                "`with strategy.scope():` block, so its variables are not mirrored across the "
                "replicas")
        fix = ("Create the strategy first and the model inside its scope: `strategy = "
               "tfdp.DataParallelStrategy()`, then `with strategy.scope(): model = build_model(); "
               "model.compile(...)`; or call tfdp.set_default_strategy() before building the "
               "model.")
    return SetupOrderError(message(what, received, fix))


class SetupOrderChecks:
    """Mixin for tfdp's extendeds: TF's errors for a model built before the strategy, in
    tfdp's words (same conditions, same point, a message that names the fix)."""

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


__all__ = ["SetupOrderChecks", "SetupOrderError", "is_program_default",
           "model_before_strategy_error", "remember_program_default"]

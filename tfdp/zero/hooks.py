"""Keras hooks of sharded optimizer state (the adapter's ``zero`` set: in Keras while a strategy
with zero_stage > 0 that has used it lives; ``tfdp.keras.adapter``).

* ``BaseOptimizer.build``: the owner plan (``ZeroState.plan``) before the optimizer creates its
  slots (every Keras optimizer's ``build`` calls it first).
* ``BaseOptimizer._backend_apply_gradients``: after build, before the first update: refuse what
  cannot be sharded exactly (``ZeroState.check``).
* ``BaseOptimizer.apply`` / ``LossScaleOptimizer.apply``: remember which variable each of this
  replica's gradients belongs to, for zero_stage=2's reduction to owners.

Each hook does nothing outside a tfdp strategy with zero_stage > 0.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import compat as tfp
from tfdp.keras import adapter


def current_zero():
    """The ``ZeroState`` of the strategy in scope, or None."""
    if not tf.distribute.has_strategy():
        return None
    extended = tf.distribute.get_strategy().extended
    get = getattr(type(extended), "tfdp_zero", None)
    return extended.tfdp_zero if get is not None else None


def _build(original):
    def build(self, variables, *args, **kwargs):
        zero = current_zero()
        if zero is not None and not self.built:
            zero.plan(self, list(variables))
        return original(self, variables, *args, **kwargs)
    return build


def _backend_apply_gradients(original):
    def backend_apply_gradients(self, grads, trainable_variables):
        zero = current_zero()
        if zero is not None:
            zero.finalize(self)
        return original(self, grads, trainable_variables)
    return backend_apply_gradients


def _apply(original):
    def apply(self, grads, trainable_variables=None):
        zero = current_zero()
        if zero is not None and self.built:
            zero.finalize(self)
        if zero is not None and zero.stage == 2 and not tf.distribute.in_cross_replica_context():
            variables = (trainable_variables if trainable_variables is not None
                         else tfp.keras_optimizer_built_variables(self))
            if variables is not None:
                zero.remember_gradients(list(grads), list(variables))
        return original(self, grads, trainable_variables)
    return apply


HOOKS = {"build": _build, "backend_apply_gradients": _backend_apply_gradients,
         "apply": _apply, "loss_scale_apply": _apply}  # (at compat.keras_zero_hook_points)


adapter.provide("zero", HOOKS)


def install(strategy) -> None:
    """Put the hooks into Keras for as long as ``strategy`` lives (the adapter counts users)."""
    adapter.use(strategy, "zero")


__all__ = ["current_zero", "install"]

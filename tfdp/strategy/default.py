"""The two-line change: make a ``DataParallelStrategy`` the process's default strategy.

A single-device Keras script becomes data parallel by adding two lines and re-indenting
nothing::

    import tfdp
    tfdp.set_default_strategy()     # everything below runs under DataParallelStrategy()

    model = build_model()           # variables mirrored on every replica, no `with` block
    model.compile(...)
    model.fit(x, y, batch_size=256) # 256 is the GLOBAL batch

This is ``tf.distribute.experimental_set_strategy(tfdp.DataParallelStrategy(...))``: the strategy's
scope is entered for the rest of the program, so ``tf.distribute.get_strategy()`` returns it and
Keras creates, trains, evaluates and saves under it exactly as inside ``with strategy.scope():``
(measured: the same weights as the scoped form and as one device, to float32 round-off).
``with strategy.scope():`` stays available and is the form to use where one program needs
several strategies.
"""

from __future__ import annotations

import logging

from tfdp.errors import TfdpError, invalid_argument, message

log = logging.getLogger("tfdp")


def set_default_strategy(strategy=None, /, **kwargs):
    """Create a :class:`tfdp.DataParallelStrategy` (or take ``strategy``) and make it the default
    strategy of this program; returns it.

    Args:
      strategy: an existing ``tf.distribute.Strategy`` to make the default, or None to create
        ``tfdp.DataParallelStrategy(**kwargs)`` (``devices``, ``all_reduce``, ``bucket_bytes``,
        ``compression``, ``sparse``, ``cluster_resolver``; see its docstring).
      **kwargs: arguments of ``DataParallelStrategy`` (only without ``strategy``).

    Call it before the model is created, outside any ``with strategy.scope():`` block. Calling
    it again replaces the default; ``tfdp.set_default_strategy(None)`` is not the way back: use
    ``tf.distribute.experimental_set_strategy(None)``.

    Raises:
      TfdpError: called inside a strategy scope, or with both ``strategy`` and ``kwargs``, or
        ``strategy`` is not a ``tf.distribute.Strategy``.
    """
    import tensorflow as tf

    if strategy is not None and kwargs:
        raise invalid_argument(
            "strategy", strategy, what="Pass either a strategy or DataParallelStrategy "
            "arguments, not both", fix="Use tfdp.set_default_strategy(all_reduce='ring') or "
            "tfdp.set_default_strategy(tfdp.DataParallelStrategy(all_reduce='ring')).")
    if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
        raise invalid_argument(
            "strategy", strategy, what="Expected a tf.distribute.Strategy",
            fix="Pass e.g. tfdp.DataParallelStrategy(), or nothing to create one.")
    if strategy is None:
        from tfdp.strategy.api import DataParallelStrategy
        strategy = DataParallelStrategy(**kwargs)
    try:
        tf.distribute.experimental_set_strategy(strategy)
    except RuntimeError:   # TF: "Must not be called inside a `tf.distribute.Strategy` scope."
        raise _inside_scope(f"the active strategy {type(tf.distribute.get_strategy()).__name__}"
                            ) from None
    from tfdp.strategy.setup_order import remember_program_default
    remember_program_default(strategy)
    log.info("tfdp: %s (%d replica(s)) is the default strategy of this program",
             type(strategy).__name__, strategy.num_replicas_in_sync)
    return strategy


def _inside_scope(received):
    return TfdpError(message(
        "tfdp.set_default_strategy() was called inside a `with strategy.scope():` block",
        received, "Call it at the top level of the program, before the model is created (or "
        "keep the `with strategy.scope():` form and drop this call)."))


__all__ = ["set_default_strategy"]

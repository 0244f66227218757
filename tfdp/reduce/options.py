"""Per-call options of a reduction: what one call needs that the reducer must not remember.

``ReduceOptions`` has the attributes of ``tf.distribute.experimental.CommunicationOptions``
(``bytes_per_pack``, ``timeout_seconds``, ``implementation``: so it passes through TF's
``CrossDeviceOps.batch_reduce`` and ``_all_reduce`` templates, which hand ``options`` on to the
``*_implementation`` methods unchanged) and also carries

* ``weights``: per-local-replica scalars (tensors) multiplying each replica's float values
  before the sum: the replicas' shares of an uneven global batch, or 0/1 masks of empty
  (padded) replicas, which then add nothing even where their values are NaN;
* ``densify_ok``: the consumer of the reduced IndexedSlices is linear in the gradient (plain or
  momentum SGD), so "auto" may densify them (``tfdp.reduce.sparse``).

Options are passed in by the caller (the strategy's extended) for each call; the reducer keeps
nothing of a call.
"""

from __future__ import annotations

import tensorflow as tf


class ReduceOptions:
    """``CommunicationOptions``' attributes plus tfdp's per-call ``weights`` and ``densify_ok``.

    (Not a subclass: TF's public ``CommunicationOptions`` constructs its private ``Options``.)
    """

    def __init__(self, *, weights=None, densify_ok: bool = False, timeout_seconds=None):
        self.bytes_per_pack = 0
        self.timeout_seconds = timeout_seconds
        self.implementation = tf.distribute.experimental.CommunicationImplementation.AUTO
        self.weights = None if weights is None else list(weights)
        self.densify_ok = bool(densify_ok)

    def __repr__(self):
        w = None if self.weights is None else f"<{len(self.weights)} weights>"
        return f"ReduceOptions(weights={w}, densify_ok={self.densify_ok})"


def weights_of(options):
    """The per-replica weights of ``options`` (None for TF's own options or none given)."""
    return getattr(options, "weights", None)


def densify_ok_of(options) -> bool:
    return bool(getattr(options, "densify_ok", False))


__all__ = ["ReduceOptions", "densify_ok_of", "weights_of"]

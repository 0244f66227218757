"""One ``strategy.run`` of a tfdp strategy as the Keras hooks see it: its ``StepContext`` and
where the calling replica stands in it (``current``).

The strategy (``tfdp.strategy.extended``) makes a ``StepContext`` for every ``strategy.run`` and
makes it current (``running``: the extended's one attribute ``tfdp_context``) while the replica
functions are traced; the gradient path (``gradient_path``), the loss semantics (``losses``) and
the strategy's own replica-context paths read every piece of the step's state from it.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from tfdp import compat as tfp


class StepContext:
    """One ``strategy.run`` call while it is traced (or run eagerly): all of the step's state.

    Attributes:
      shares: per local replica, ``n_r / sum(n)`` as a float32 scalar tensor (None: no batch was
        found in the step's arguments; Keras's 1/N applies).
      live, masks: per local replica, whether it has examples, as a bool and as 1.0 / 0.0
        (None with ``shares``).
      applies: local replica id -> the ``_Apply`` of that replica's outermost ``optimizer.apply``.
      optimizers: the optimizers that applied gradients in this step, in order.
      keras_steps: the local replicas running a Keras step function (``train_step``, custom or
        not, ``test_step``, ``predict_step``), where Keras's one-device conventions apply to a
        hand-written loss (``tfdp.keras.losses``).
      weighted: local replica id -> the loss values tfdp's loss semantics made (graph tensors'
        refs; in eager mode the replica is a key with an empty set).
    """

    def __init__(self, shares):
        self.shares = shares
        # whether each replica has examples, and the same as 1.0 / 0.0: an empty replica's
        # gradients are zeroed in the reduction (an empty batch can give NaN statistics)
        self.live = None if shares is None else [s > 0 for s in shares]
        self.masks = None if shares is None else [tf.cast(v, tf.float32) for v in self.live]
        self.padded = False  # whether empty replicas got one example (strategy's padding)
        # with ``padded``: id(ON_READ variable) -> its local replicas' values before the step
        # (an empty replica's metric updates are undone after it); ``whole_state``: reduce
        # from every replica, padded ones included (the metrics' state, ``tfdp.keras.reported``)
        self.on_read_before: dict = {}
        self.whole_state = False
        # local replica id -> [(optimizer, grads, variables)] while that replica's XLA-compiled
        # step is traced: its optimizer updates wait until the compiled part has returned
        self.deferred: dict[int, list] = {}
        self.applies: dict = {}
        self.optimizers: list = []
        self.keras_steps: set[int] = set()
        self.weighted: dict[int, set] = {}
        self._no_merge = threading.local()  # per replica thread (replicas run concurrently)
        self.xla_refusal = None
        # micro-batches (tfdp.strategy.micro_batches): the step's Accumulator while one of
        # its micro-batches is traced; a micro_batches.Policy while micro-batches are asked
        # for (what cannot be split is refused)
        self.micro = None
        self.micro_policy = None

    @contextlib.contextmanager
    def replica_collectives(self):
        """Reduce from the replica contexts (no merge_call) while inside, in the calling
        replica's thread: TF runs the replicas' threads concurrently between their collectives,
        so another replica may be outside at the same time."""
        self._no_merge.depth = self.no_merge + 1
        try:
            yield
        finally:
            self._no_merge.depth -= 1

    @property
    def no_merge(self) -> int:
        """How deep the calling replica is in ``replica_collectives()`` (0: not inside)."""
        return getattr(self._no_merge, "depth", 0)


@tf.autograph.experimental.do_not_convert  # (called from tfdp's per-replica XLA step)
def current():
    """(extended, step, local replica id) inside a replica function of a tfdp step, else None."""
    if not tf.distribute.has_strategy():
        return None
    ctx = tf.distribute.get_replica_context()
    if ctx is None:
        return None
    extended = ctx.strategy.extended
    step = getattr(extended, "tfdp_context", None)
    if step is None:
        return None
    return extended, step, tfp.current_replica_id()


def is_tfdp(extended) -> bool:
    """Whether ``extended`` is a tfdp strategy's (it has a ``tfdp_context`` slot)."""
    return hasattr(extended, "tfdp_context")


@contextlib.contextmanager
def running(extended, context):
    """Make ``context`` the extended's current step for the duration of a strategy.run."""
    extended.tfdp_context = context
    try:
        yield context
    finally:
        extended.tfdp_context = None


__all__ = ["StepContext", "current", "is_tfdp", "running"]

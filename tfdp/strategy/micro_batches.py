"""Micro-batches: each replica's part of the global batch in k pieces within one training step,
their gradients summed, one update: the same step as one device on the whole global batch, with
at most ceil(n_r / k) of a replica's examples in its forward and backward pass at a time.

Who asks for it:

* ``tfdp launch --nnodes MIN:MAX --elastic-policy accumulate`` (the launcher sets
  ``TFDP_ELASTIC_POLICY=accumulate`` and ``TFDP_ELASTIC_MAX_WORKERS``, MAX nodes x workers per
  node). When a node is lost the global batch stays what the script asked for and each of the
  fewer replicas takes a larger share; with this policy each replica runs its share in
  ``k = ceil(full workers / workers now)`` micro-batches, none larger than a replica's share at
  the job's full size (what fitted in memory). At the full size k is 1.
* ``DataParallelStrategy(micro_batches=k)``: the same split, asked for directly.

How (``DataParallelExtendedBase._call_for_each_replica``, for a model's Keras ``train_step``):
the step's replica function runs k times in the one traced step. Micro-batch c of a replica with
n examples is its rows ``[c*n//k, (c+1)*n//k)`` (sizes differ by at most one; the last is never
empty when the replica has examples). Each run has the shares ``n_rc / sum(n)`` of the whole
global batch, so ``tfdp.keras.losses`` weights each micro-batch's loss by its part of the one
device's batch, and the empty-replica padding applies per micro-batch. The outermost
``optimizer.apply`` of micro-batches 0..k-2 keeps their gradients (``Accumulator``) and returns;
the last one's apply goes on with the sum, as one step's gradient: one all-reduce, one optimizer
update (loss scaling, clipping, sharded state and Keras's own ``gradient_accumulation_steps``
all see the whole step's gradient), one iteration. Metrics add up over the micro-batches; the
step returns the last run's logs, which have seen them all. Micro-batch c+1's input waits for
micro-batch c's gradients (control dependencies), so one is in memory at a time.

What cannot be split is refused at the first training step (with the elastic policy on, at the
job's full size already, before any node is lost): a custom ``train_step`` (what it does between
forward pass and update is its own), ``BatchNormalization`` (its statistics would be a
micro-batch's and its moving averages updated k times a step), a loss whose divisor is counted
across replicas (masked means, ``mean_with_sample_weight`` with sample weights,
``reduction="sum"``: the divisor is known only after every micro-batch's forward pass), and
``jit_compile=True`` with several CPU replicas (tfdp's per-replica XLA step).
"""

from __future__ import annotations

import math
import os

import tensorflow as tf

from tfdp.errors import TfdpError, invalid_argument, message

POLICY_ENV = "TFDP_ELASTIC_POLICY"
MAX_WORKERS_ENV = "TFDP_ELASTIC_MAX_WORKERS"
POLICIES = ("batch", "accumulate")
_POLICY_FIX = ("'batch' (default): fewer replicas after a lost node take larger shares of the "
               "same global batch; 'accumulate': each replica runs its share in micro-batches "
               "no larger than a replica's share at the job's full size.")


def validate_count(value):
    """``micro_batches``: None (the elastic policy decides) or an int >= 1."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid_argument("micro_batches", value,
                               fix="Pass an int >= 1 (1: no split), or None (the default: "
                                   "the elastic policy decides).")
    return int(value)


def validate_policy(value):
    """``elastic_policy`` from the argument, else ``TFDP_ELASTIC_POLICY``, else "batch"."""
    name = "elastic_policy"
    if value is None:
        value, name = os.environ.get(POLICY_ENV, "").strip() or "batch", POLICY_ENV
    if value not in POLICIES:
        raise invalid_argument(name, value, valid=POLICIES, fix=_POLICY_FIX)
    return value


def max_workers_from_env():
    """``TFDP_ELASTIC_MAX_WORKERS`` (the job's workers at its full size, set by ``tfdp launch``
    on several nodes), else None."""
    raw = os.environ.get(MAX_WORKERS_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise invalid_argument(MAX_WORKERS_ENV, raw,
                               fix="It is set by tfdp launch: the job's workers at its full "
                                   "size (MAX nodes x workers per node), an int >= 1.")
    return int(raw)


def policy_count(policy, max_workers, num_workers) -> int:
    """Micro-batches per replica under ``policy``: ``ceil(max_workers / num_workers)`` for
    "accumulate" (1 without a known full size), else 1."""
    if policy != "accumulate" or not max_workers or num_workers >= max_workers:
        return 1
    return math.ceil(max_workers / num_workers)


def refused(what, received, fix):
    return TfdpError(message(f"{what} cannot be split into micro-batches exactly", received,
                             fix))


_FIX_POLICY = ("Fix: use the elastic policy 'batch' (tfdp launch's default: fewer replicas take "
               "larger shares), or micro_batches=None/1")


class Policy:
    """Micro-batches asked for (``settings``; ``k`` per step now, maybe 1 at the job's full
    size): the refusals of what cannot be split, with what was asked in their text."""

    def __init__(self, settings, k):
        if settings.micro_batches is not None:
            self.asked = f"micro_batches={settings.micro_batches}"
        else:
            self.asked = (f"elastic_policy='accumulate' ({k} micro-batch"
                          f"{'es' if k != 1 else ''} per step now)")

    def check_step(self, model, builtin_train_step) -> None:
        """Refuse what micro-batches cannot split exactly in ``model``'s training step."""
        import keras
        step = getattr(type(model), "train_step", None)
        if getattr(step, "__func__", step) is not builtin_train_step:
            raise refused("A custom train_step",
                          f"{type(model).__name__}.train_step with {self.asked}",
                          f"{_FIX_POLICY}; or split the batch inside your train_step.")
        for layer in _layers(model):
            if isinstance(layer, keras.layers.BatchNormalization):
                raise refused(
                    "BatchNormalization (its batch statistics would be a micro-batch's, its "
                    "moving averages updated once per micro-batch)",
                    f"layer {layer.name!r} in model {model.name!r} with {self.asked}",
                    f"{_FIX_POLICY}; or a normalization without batch statistics "
                    "(LayerNormalization, GroupNormalization).")

    def refuse_counted_divisor(self, what):
        """The loss module's refusal: a divisor counted across replicas."""
        raise refused(what, f"such a loss with {self.asked}",
                      f"{_FIX_POLICY}; or a loss whose divisor is the number of examples "
                      "(Keras's default sum_over_batch_size, without a mask).")

    def refuse_xla(self):
        raise refused("A step compiled per replica with XLA (compile(jit_compile=True) on "
                      "several CPU replicas)", f"jit_compile=True with {self.asked}",
                      f"{_FIX_POLICY}; or compile with jit_compile=False.")


def _layers(model, seen=None):
    seen = set() if seen is None else seen
    for layer in getattr(model, "layers", None) or ():
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield layer
        yield from _layers(layer, seen)


def bounds(n, k, c):
    """Rows ``[c*n//k, (c+1)*n//k)`` of a replica with ``n`` examples (an int32 scalar)."""
    return (c * n) // k, ((c + 1) * n) // k


def split(args, devices, k, c, after=None):
    """Micro-batch ``c`` of ``k`` of a step's arguments: every batched leaf's local replica
    tensors cut to their rows ``bounds(n, k, c)`` (n: that tensor's batch size); leaves that are
    not batched stay whole. ``after``: per local replica, tensors its input waits for."""
    from tfdp.strategy.empty_replicas import components, regroup

    def cut(leaf):
        comps = components(leaf, devices, dynamic_only=False)
        if comps is None:
            values = getattr(leaf, "values", None)
            if isinstance(values, tuple) and any(
                    isinstance(v, (tf.RaggedTensor, tf.SparseTensor)) for v in values):
                raise refused("A ragged or sparse input", f"{type(values[0]).__name__} "
                              "batches", f"{_FIX_POLICY}; or dense (padded) inputs.")
            return leaf
        out = []
        for r, (t, d) in enumerate(zip(comps, devices)):
            with tf.device(d), tf.control_dependencies(after[r] if after else []):
                n = tf.shape(t, out_type=tf.int32)[0]
                lo, hi = bounds(n, k, c)
                out.append(t[lo:hi])
        return regroup(leaf, out)

    return tf.nest.map_structure(cut, args)


class Accumulator:
    """One training step's gradients over its micro-batches, per local replica."""

    def __init__(self, k, replicas):
        self.k = k
        self.index = 0            # the micro-batch being traced
        self.sums = [None] * replicas
        self.optimizer = None     # the optimizer whose apply is held (one per step)

    @property
    def last(self) -> bool:
        return self.index == self.k - 1

    def add(self, replica, optimizer, grads):
        """This micro-batch's ``grads`` (one replica's, from the outermost ``apply``) added to
        the earlier ones'; the sums so far."""
        if self.optimizer is None:
            self.optimizer = optimizer
        elif self.optimizer is not optimizer:
            raise TfdpError(message(
                "Micro-batches hold one optimizer's update per step; this step applies two",
                f"{type(self.optimizer).__name__} and {type(optimizer).__name__}",
                "Fix: use micro_batches=None/1 (or the elastic policy 'batch') for a model "
                "with several optimizers."))
        before = self.sums[replica]
        grads = list(grads)
        if before is not None:
            if len(before) != len(grads):
                raise TfdpError(message(
                    "Every micro-batch of a step must apply gradients for the same variables",
                    f"{len(before)} then {len(grads)} gradients",
                    "Fix: use micro_batches=None/1 for this model."))
            grads = [_add(a, b) for a, b in zip(before, grads)]
        self.sums[replica] = grads
        return grads

    def waits(self):
        """Per local replica, the tensors the next micro-batch's input waits for."""
        return [[g.values if isinstance(g, tf.IndexedSlices) else g
                 for g in (sums or ()) if g is not None] for sums in self.sums]


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0),
                                tf.concat([a.indices, b.indices], 0), a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


__all__ = ["Accumulator", "MAX_WORKERS_ENV", "POLICIES", "POLICY_ENV", "Policy", "bounds",
           "max_workers_from_env", "policy_count", "split", "validate_count", "validate_policy"]

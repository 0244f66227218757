"""What a replica's loss is worth: one device's loss semantics for every way Keras divides a loss.

One device computes a loss on the whole global batch; under tfdp each replica computes it on its
slice, and the SUM of the replicas' gradients must be the one-device gradient, while what the
user reads (History, progress bar, their own trackers) must be the one-device value. A loss is a
sum over elements divided by something, and tfdp handles each divisor where Keras computes it
(``Loss.__call__`` -> ``reduce_weighted_values``, ``scale_loss_for_distribution``):

* **the number of elements** (Keras's default ``sum_over_batch_size``, ``mean``, regularizers,
  ``add_loss``): the replica's value is its own mean (what the user reads), and its gradient is
  weighted by the replica's share of the global batch, ``n_r / sum(n)``: no collective.
* **a count only known after the forward pass**: valid elements under a mask (``mask_zero``
  embeddings, padded sequences), the sum of the sample weights (``mean_with_sample_weight``):
  the replica contributes ``local_sum / global_divisor`` to the gradient, the divisor summed
  over every replica of every worker by one small all-reduce (with the local sum, so the value
  every replica reports is the global loss itself). ``reduction="sum"`` likewise (divisor 1).
* **a scalar a loss function returns** (``compile(loss=fn)`` with ``fn`` returning
  ``ops.mean(...)``): Keras cannot divide it; tfdp takes it as the mean over the replica's
  examples (exact for a mean; a ratio over the whole batch, such as Dice, cannot be split across
  replicas: one warning says so and names the fix, per-example values).
* **a scalar a custom ``train_step`` or ``compute_loss`` computes by hand** (``ops.mean(...)``,
  no Keras loss involved): inside Keras's step functions, the gradient of a scalar that depends
  on no loss tfdp weighted, taken with respect to variables, is weighted by the replica's share
  (the same rule). Custom loops with ``strategy.run`` keep tf.distribute's convention (scale
  the loss yourself, e.g. ``tf.nn.compute_average_loss``).

Every value a replica reports is then one whose batch-share-weighted mean over the replicas is
the one-device value, so Keras's loss trackers (weighted by batch size) need no unscaling, and a
``keras.metrics.Mean`` a user updates with a scalar loss is weighted by the replica's share.
Outside a tfdp step every hook calls Keras's own code unchanged.
"""

from __future__ import annotations

import functools
import logging
import re

import tensorflow as tf

from tfdp import compat as tfp
from tfdp.keras.step import current

log = logging.getLogger("tfdp.losses")

SUM = tf.distribute.ReduceOp.SUM
_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
_warned: set = set()


def _warn_once(key, text):
    if key not in _warned:
        _warned.add(key)
        log.warning(text)


def _register(cur, value):
    """Remember ``value`` as a loss tfdp weighted in this replica's step."""
    _, step, replica = cur
    refs = step.weighted.setdefault(replica, set())
    if not tf.executing_eagerly() and isinstance(value, tf.Tensor):
        refs.add(value.ref())
    return value


def weight_gradient(value, weight):
    """``value`` unchanged, its gradient multiplied by ``weight`` (a scalar tensor)."""
    @tf.custom_gradient
    def weighted(v):
        def grad(dy):
            return dy * tf.cast(weight, dy.dtype)
        return tf.identity(v), grad
    return weighted(value)


def _replica_mean(cur, value):
    """A replica's mean-type loss: its value as computed, its gradient weighted by the replica's
    share of the global batch."""
    _, step, replica = cur
    value = tf.convert_to_tensor(value)
    if not value.dtype.is_floating:
        return value
    return _register(cur, weight_gradient(value, step.shares[replica]))


def _global_ratio(cur, local_sum, divisor, what):
    """``sum(local_sum) / sum(divisor)`` over every replica of the job as the value, and
    ``local_sum / sum(divisor)`` as this replica's contribution to the gradient (``divisor``
    None: a sum, gradient 1). One all-reduce of two scalars."""
    extended, step, replica = cur
    if replica in step.deferred:  # inside a replica's XLA-compiled step: no collective there
        extended.refuse_xla(what)
    if step.micro_policy is not None:  # the divisor of the whole batch: after every micro-batch
        step.micro_policy.refuse_counted_divisor(what[0].upper() + what[1:])
    dtype = local_sum.dtype
    live = step.masks[replica]
    s = tf.math.multiply_no_nan(tf.cast(local_sum, tf.float32), live)
    d = live if divisor is None else tf.math.multiply_no_nan(tf.cast(divisor, tf.float32), live)
    (totals,) = extended.all_reduce_values(SUM, [tf.stop_gradient(tf.stack([s, d]))])
    if divisor is None:
        value, gradient_weight = totals[0], live
    else:
        value = tf.math.divide_no_nan(totals[0], totals[1])
        gradient_weight = tf.math.divide_no_nan(live, totals[1])
    value, gradient_weight = tf.cast(value, dtype), tf.cast(gradient_weight, dtype)

    @tf.custom_gradient
    def ratio(x):
        del x
        return tf.identity(value), lambda dy: dy * gradient_weight
    return _register(cur, ratio(local_sum))


def _reduce_weighted_values(original):
    def reduce_weighted_values(values, sample_weight=None, mask=None,
                               reduction="sum_over_batch_size", dtype=None):
        cur = current()
        if cur is None or cur[1].shares is None:
            return original(values, sample_weight=sample_weight, mask=mask,
                            reduction=reduction, dtype=dtype)
        if reduction not in (*_MEANS, "sum"):  # None, "none", or invalid: Keras's own (error)
            return original(values, sample_weight=sample_weight, mask=mask,
                            reduction=reduction, dtype=dtype)
        from keras import ops as keras_ops
        v = keras_ops.convert_to_tensor(values, dtype=dtype)
        if v.shape.rank == 0 and sample_weight is None and mask is None:
            return _scalar_loss(cur, v, reduction)
        divisor_known = mask is None and (reduction != "mean_with_sample_weight"
                                          or sample_weight is None)
        if reduction in _MEANS and divisor_known:
            if tuple(v.shape) == (0,):
                # an empty replica of a split whose shapes are static (Keras 3.16 traces
                # evaluate's first batch so): Keras would return the empty values, which its
                # loss tracker sums to NaN; the replica's mean is 0 (its share is 0)
                return _replica_mean(cur, keras_ops.sum(v))
            # the element count: Keras divides by the local count and calls
            # scale_loss_for_distribution (below), which weights the gradient by the share
            return original(values, sample_weight=sample_weight, mask=mask,
                            reduction=reduction, dtype=dtype)
        sw = None if sample_weight is None else keras_ops.convert_to_tensor(sample_weight,
                                                                             dtype=dtype)
        m = None if mask is None else keras_ops.convert_to_tensor(mask, dtype=dtype)
        w = tfp.keras_mask_weights(sw, m, v.dtype, keras_ops)  # 0/1 mask times the weights
        if w is not None:
            v, w = tfp.keras_same_rank(v, keras_ops.cast(w, v.dtype), keras_ops)
            v = v * w
        local_sum = keras_ops.sum(v)
        if reduction == "sum":
            return _global_ratio(cur, local_sum, None, "a loss with reduction='sum' (its value "
                                 "is summed across replicas)")
        if reduction == "mean_with_sample_weight" and w is not None:
            divisor = keras_ops.sum(w)
        else:  # masked mean: the valid elements, in the units Keras divides by
            valid = keras_ops.sum(keras_ops.cast(m, v.dtype))
            divisor = valid * tf.math.divide_no_nan(tf.cast(tf.size(v), v.dtype),
                                                    tf.cast(tf.size(m), v.dtype))
        return _global_ratio(cur, local_sum, divisor,
                             "a masked or sample-weight-mean loss (its divisor is counted "
                             "across replicas)")
    return reduce_weighted_values


def _scalar_loss(cur, value, reduction):
    name = re.sub(r"^replica_\d+/", "", tf.get_current_name_scope() or "") or "loss"
    _warn_once(("scalar", name), (
        f"tfdp: the loss '{name}' returned one scalar for the whole batch, not one value per "
        "example. tfdp takes it as the mean over its replica's examples, which is exact for a "
        "mean (e.g. ops.mean(...)). A loss that is not a sum or mean over examples (one ratio "
        "over the whole batch, such as Dice or F1) cannot be split across replicas exactly: "
        "return per-example values (shape (batch,)) and let Keras average them."))
    if reduction == "sum":  # a replica's sum: the value is the global sum
        return _global_ratio(cur, value, None, "a loss with reduction='sum'")
    return _replica_mean(cur, value)


def _scale_loss(original):
    def scale_loss_for_distribution(value):
        cur = current()
        if cur is None or cur[1].shares is None:
            return original(value)
        return _replica_mean(cur, value)
    return scale_loss_for_distribution


def _unscale_loss(original):
    def unscale_loss_for_distribution(value):
        cur = current()
        if cur is None or cur[1].shares is None:
            return original(value)
        return tf.convert_to_tensor(value)  # tfdp's loss values are not scaled (see above)
    return unscale_loss_for_distribution


def _mean_update_state(original):
    """``keras.metrics.Mean.update_state(scalar)`` in a tfdp step: weighted by the replica's
    share of the batch, so that a tracker of a per-batch mean reports the one-device mean, also
    for uneven batches, and its count is one device's (the shares add up to the weight 1 one
    device gives the scalar). Keras's per-output loss trackers pass the batch's static size as
    the weight, and None where the size is dynamic: Keras 3.16 traces a fit's first batch with
    static shapes and a last partial batch without, so the two kinds of weight meet in one
    tracker and the counts must be one device's."""
    def update_state(self, values, sample_weight=None):
        cur = current()
        if cur is not None and cur[1].shares is not None and sample_weight is None:
            v = tf.convert_to_tensor(values)
            if v.shape.rank == 0:
                _, step, replica = cur
                sample_weight = step.shares[replica]
                values = v
        return original(self, values, sample_weight=sample_weight)
    return update_state


# --- hand-written losses in Keras's step functions ---------------------------------------------

def keras_step(step_function):
    """``step_function`` (Keras's train/test/predict step, custom or not) marked as a Keras step
    of the calling replica while it runs (``__wrapped__``: the step, whose ``__self__`` is the
    model)."""
    @functools.wraps(step_function)
    def run(data):
        cur = current()
        if cur is not None:
            cur[1].keras_steps.add(cur[2])
        return step_function(data)
    return run


def _is_variable(x):
    import keras
    return isinstance(x, (tf.Variable, keras.Variable))


def _depends_on(target, refs, limit=500_000):
    """Whether graph tensor ``target`` is computed from any tensor in ``refs``."""
    if not refs:
        return False
    seen, stack = set(), [target]
    while stack and len(seen) < limit:
        t = stack.pop()
        if t.ref() in refs:
            return True
        op = t.op
        if op.name in seen:
            continue
        seen.add(op.name)
        stack.extend(op.inputs)
    return len(seen) >= limit  # (too large to tell: leave it alone)


def _hand_written_mean(cur, target, sources, output_gradients):
    _, step, replica = cur
    if output_gradients is not None or replica not in step.keras_steps:
        return False
    if not isinstance(target, tf.Tensor) or target.shape.rank != 0:
        return False
    if not target.dtype.is_floating:
        return False
    flat = tf.nest.flatten(sources)
    if not flat or not all(_is_variable(s) for s in flat):
        return False
    if tf.executing_eagerly():
        return replica not in step.weighted
    return not _depends_on(target, step.weighted.get(replica, set()))


def _tape_gradient(original):
    def gradient(self, target, sources, output_gradients=None, *args, **kwargs):
        grads = original(self, target, sources, output_gradients, *args, **kwargs)
        cur = current()
        if (cur is None or cur[1].shares is None
                or not _hand_written_mean(cur, target, sources, output_gradients)):
            return grads
        _warn_once("hand-written", (
            "tfdp: a step function differentiates a scalar loss computed without Keras's "
            "losses; tfdp takes it as the mean over its replica's examples (exact for "
            "ops.mean(...) of per-example losses; not for one ratio over the whole batch, such "
            "as Dice: compute per-example values and average them with a Keras loss)."))
        share = cur[1].shares[cur[2]]

        def weigh(g):
            if g is None:
                return None
            if isinstance(g, tf.IndexedSlices):
                return tf.IndexedSlices(g.values * tf.cast(share, g.values.dtype), g.indices,
                                        g.dense_shape)
            return g * tf.cast(share, g.dtype)
        return tf.nest.map_structure(weigh, grads)
    return gradient


HOOKS = {
    "scale_loss": _scale_loss,
    "unscale_loss": _unscale_loss,
    "reduce_weighted_values": _reduce_weighted_values,
    "mean_update_state": _mean_update_state,
    "tape_gradient": _tape_gradient,
}

__all__ = ["HOOKS", "keras_step", "weight_gradient"]

"""The bucket pipeline every dense reduction of tfdp goes through, once.

    plan buckets -> per replica: weight, pre-scale, encode, pack -> stage -> decode, post-scale
    -> unpack

The reducer (``tfdp.reduce.reducer.Reducer``) runs it for every dense reduction; what differs is
only the stage: a local algorithm of ``tfdp.reduce.algorithms`` (one process), the same whose
finished pieces first cross the workers (``tfdp.reduce.cross_worker``), one replica's buffer into
one collective (a replica context, ``tfdp.reduce.collective``), or a tree finished on a
variable's owner (``tfdp.reduce.owner``).

* Weights: replica r's float values are multiplied by ``weights[r]`` (``multiply_no_nan``: an
  empty replica of weight 0 adds nothing, even where its values are NaN).
* MEAN divides by ``group_size`` (every replica of the job): after the sum, or, when the buffer
  travels compressed, before it (so the sum of fp16 values cannot overflow).
* Compression (``tfdp.reduce.compression``): float buffers travel as fp16 / bf16; each tensor is
  cast before packing, so the packing copy moves half the bytes.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.reduce import compression as codec
from tfdp.reduce import packing

SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN


def as_reduce_op(reduce_op):
    """A ``tf.distribute.ReduceOp`` from an op or its name ("sum", "MEAN")."""
    if isinstance(reduce_op, str):
        return tf.distribute.ReduceOp(reduce_op.upper())
    return reduce_op


def scale(t, factor):
    """``t * factor`` (integers through float64); ``t`` when ``factor`` is None."""
    if factor is None:
        return t
    if t.dtype.is_integer:
        return tf.cast(tf.cast(t, tf.float64) * factor, t.dtype)
    return t * tf.cast(factor, t.dtype)


def divide(t, n):
    """``t / n`` (integers through float64); ``t`` when ``n`` is None."""
    if n is None:
        return t
    if t.dtype.is_integer:
        return tf.cast(tf.cast(t, tf.float64) / n, t.dtype)
    return t / tf.cast(n, t.dtype)


def all_reduce_dense(comps_of, devices, reduce_op, stage, *, group_size, bucket_bytes,
                     compression=None, weights=None, outputs=None):
    """Reduce dense values through buckets.

    Args:
      comps_of: one list per value of its per-replica tensors (component r on ``devices[r]``).
      devices: the replica devices of this process taking part (one device for a replica
        context).
      reduce_op: SUM or MEAN.
      stage: ``stage(bufs, devices, finish) -> reduced bufs`` (one per device): sums the
        buffers over the job, applying ``finish(t, index)`` once to each summed piece.
      group_size: replicas summed by the stage (every replica of the job), for MEAN.
      bucket_bytes: fusion capacity (``tfdp.reduce.packing.plan``).
      compression: None, "fp16" or "bf16".
      weights: optional per-replica scalars (one per device) multiplying float values first.
      outputs: the device positions whose results are wanted (default: all); the stage may
        return None for the others (a reduction to one device: ``tfdp.reduce.owner``).
    Returns:
      (results, plan): results[i][r] is value i reduced, on ``devices[r]`` (None for a position
      not in ``outputs``); plan is the buckets.
    """
    reduce_op = as_reduce_op(reduce_op)
    specs = [(c[0].dtype, c[0].shape.num_elements(), c[0].dtype.size) for c in comps_of]
    plan = packing.plan(specs, bucket_bytes)
    results = [None] * len(comps_of)
    for bucket in plan:
        dtype = bucket.dtype
        shapes = [comps_of[i][0].shape for i in bucket.indices]
        if not bucket.fused and not shapes[0].is_fully_defined():
            shapes = None
        floating = dtype.is_floating
        compress = compression if floating else None
        pre_mean = reduce_op == MEAN and compress is not None
        bufs = []
        for r, d in enumerate(devices):
            with tf.device(d):
                parts = [comps_of[i][r] for i in bucket.indices]
                factor = None
                if weights is not None and floating:
                    factor = tf.cast(weights[r], dtype)
                if pre_mean:
                    factor = divide(tf.constant(1.0, dtype) if factor is None else factor,
                                    group_size)
                if factor is not None:  # 0 * NaN = 0: an empty replica adds nothing
                    parts = [tf.math.multiply_no_nan(p, factor) for p in parts]
                if compress is not None:
                    parts = [codec.encode(p, compress) for p in parts]
                bufs.append(packing.pack(parts) if bucket.fused else parts[0])
        post = group_size if (reduce_op == MEAN and not pre_mean) else None

        def finish(t, index, dtype=dtype, post=post):
            del index
            return divide(codec.decode(t, dtype), post)

        reduced = stage(bufs, list(devices), finish)
        per_value = [[None] * len(devices) for _ in bucket.indices]
        for r, d in enumerate(devices):
            if outputs is not None and r not in outputs:
                continue
            with tf.device(d):
                parts = (packing.unpack(reduced[r], bucket.sizes, shapes) if bucket.fused
                         else [reduced[r]])
            for k, p in enumerate(parts):
                per_value[k][r] = p
        for k, i in enumerate(bucket.indices):
            results[i] = per_value[k]
    return results, plan


__all__ = ["MEAN", "SUM", "all_reduce_dense", "as_reduce_op", "divide", "scale"]

"""Fusion: plan buckets of same-dtype tensors, pack them into one flat buffer, unpack after.

Measured on CPU replicas (see README): packing pays for many small tensors (launch overhead
dominates) and costs for large ones (the concat/split copies cost more than they save), so
tensors at least ``bucket_bytes`` large are reduced alone and only the small ones are fused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Chosen by measurement (tfdp bench fusion; README "Choosing bucket_bytes").
DEFAULT_BUCKET_BYTES = 1024 * 1024


@dataclass
class Bucket:
    """Indices (into the reduced list) of tensors reduced together; ``fused`` if packed."""
    dtype: object
    indices: list = field(default_factory=list)
    sizes: list = field(default_factory=list)   # element counts (for split), when fused
    nbytes: int = 0
    fused: bool = True


def plan(specs, bucket_bytes: int) -> list[Bucket]:
    """Group tensors into buckets.

    Args:
      specs: list of (dtype, num_elements or None, itemsize) per tensor, in order.
      bucket_bytes: bucket capacity; tensors of this size or larger (or of unknown size) are
        reduced alone; 0 disables fusion.
    Returns:
      Buckets in an order that keeps the original order of the first member of each bucket.
    """
    buckets: list[Bucket] = []
    open_by_dtype: dict = {}
    for i, (dtype, n, itemsize) in enumerate(specs):
        nbytes = None if n is None else n * itemsize
        if bucket_bytes <= 0 or nbytes is None or nbytes >= bucket_bytes:
            buckets.append(Bucket(dtype, [i], [n], nbytes or 0, fused=False))
            continue
        b = open_by_dtype.get(dtype)
        if b is None or b.nbytes + nbytes > bucket_bytes:
            b = Bucket(dtype)
            open_by_dtype[dtype] = b
            buckets.append(b)
        b.indices.append(i)
        b.sizes.append(n)
        b.nbytes += nbytes
    for b in buckets:  # a "bucket" of one small tensor needs no packing
        if b.fused and len(b.indices) == 1:
            b.fused = False
    return buckets


def pack(tensors):
    """Flatten and concatenate (on the current device)."""
    import tensorflow as tf
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def unpack(buffer, sizes, shapes):
    """Split a packed buffer back into tensors of ``shapes`` (on the current device)."""
    import tensorflow as tf
    parts = tf.split(buffer, sizes, axis=0)
    return [tf.reshape(p, s) for p, s in zip(parts, shapes)]

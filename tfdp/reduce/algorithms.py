"""Local all-reduce algorithms: N buffers (buffer r on ``devices[r]``) -> N reduced buffers.

Each takes ``finish(t, index)``, applied exactly once to each summed piece on the device that
holds it (``index`` is that device's local position): the bucket pipeline's decode and mean
scaling, and, across workers, the cross-worker collective first (``tfdp.reduce.cross_worker``).

* ``tree`` ("fused"): a pairwise tree of adds spread over the devices, finished on device 0, then
  copied to every device.
* ``ring``: reduce-scatter (device c sums chunk c and finishes it), then all-gather.
* ``one_device``: everything added on device 0 (TF's ReductionToOneDevice shape).
* ``nccl``: TF's NCCL all-sum (GPUs), finished on every device.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import compat as tfp


def broadcast(t, devices):
    """``t`` on every device of ``devices`` (t itself where it already is)."""
    out = []
    for d in devices:
        if t.device == d:
            out.append(t)
        else:
            with tf.device(d):
                out.append(tf.identity(t))
    return out


def tree_sum(bufs, devices):
    """Pairwise tree of adds whose levels are spread over the devices; the sum is on devices[0]."""
    items = list(zip(bufs, devices))
    while len(items) > 1:
        nxt = []
        for j in range(0, len(items) - 1, 2):
            (a, da), (b, _) = items[j], items[j + 1]
            with tf.device(da):
                nxt.append((a + b, da))
        if len(items) % 2:
            nxt.append(items[-1])
        items = nxt
    return items[0][0]


def one_device(bufs, devices, finish):
    with tf.device(devices[0]):
        total = finish(tf.math.add_n(bufs) if len(bufs) > 1 else tf.identity(bufs[0]), 0)
    return broadcast(total, devices)


def tree(bufs, devices, finish):
    total = tree_sum(bufs, devices)
    with tf.device(devices[0]):
        total = finish(total if len(bufs) > 1 else tf.identity(total), 0)
    return broadcast(total, devices)


def ring(bufs, devices, finish):
    n = len(bufs)
    shape = bufs[0].shape
    size = shape.num_elements()
    if n == 1 or size is None or size < n:
        return tree(bufs, devices, finish)
    base, rem = divmod(size, n)
    sizes = [base + (1 if c < rem else 0) for c in range(n)]
    chunks = []
    for b, d in zip(bufs, devices):
        with tf.device(d):
            chunks.append(tf.split(tf.reshape(b, [-1]), sizes))
    summed = []
    for c, d in enumerate(devices):  # reduce-scatter: device c owns chunk c
        with tf.device(d):
            summed.append(finish(tf.math.add_n([chunks[r][c] for r in range(n)]), c))
    out = []
    for d in devices:  # all-gather
        with tf.device(d):
            out.append(tf.reshape(tf.concat(summed, 0), shape))
    return out


def nccl(bufs, devices, finish):
    if len(bufs) == 1:
        return tree(bufs, devices, finish)
    outs = tfp.nccl_all_sum(bufs)
    result = []
    for i, (o, d) in enumerate(zip(outs, devices)):
        with tf.device(d):
            result.append(finish(o, i))
    return result


ALGORITHMS = {"fused": tree, "ring": ring, "one_device": one_device, "nccl": nccl}

__all__ = ["ALGORITHMS", "broadcast", "nccl", "one_device", "ring", "tree", "tree_sum"]

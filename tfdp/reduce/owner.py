"""Reductions for sharded optimizer state (``tfdp.zero``): to the owner, and from the owner.

* ``broadcast_local``: an owner's new value of a variable to the variable's other local copies
  (an assign per copy; in one process a copy between devices is all a broadcast is).
* ``replica_broadcast``: the same from replica contexts without merge_call (Keras's
  accumulation branch): every replica joins one ``CollectiveReduceV2`` of the job's
  replica-context group (``tfdp.reduce.collective.ReplicaCollectives``) through the bucket
  pipeline, the owner
  contributing its value and every other replica ``-0.0``. ``x + (-0.0)`` is ``x`` for every
  float ``x`` (``-0.0`` included), so the sum is the owner's value bit for bit, in any order.
  (TF has no reduce-to-root and no reduce-scatter on CPU; the all-reduce is the one collective
  every replica can join; only the first worker's owner contributes, the other workers' owners
  hold the same value already.)
* ``reduce_to_owners``: zero_stage=2's gradient reduction: each gradient summed onto its owner's
  device only (a tree of adds finished there; across workers, then one collective among the
  owner devices of every worker), through the bucket pipeline (small gradients of one owner
  share a bucket).

The reducer (``tfdp.reduce.reducer.Reducer``) exposes the last two as methods; the strategy
calls those.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import compat as tfp
from tfdp.reduce import algorithms, pipeline

SUM = tf.distribute.ReduceOp.SUM


def broadcast_local(comps, owner: int):
    """Copy ``comps[owner]``'s value into every other component (plain variables)."""
    src = comps[owner]
    if len(comps) == 1:
        return []
    with tf.device(src.device):
        value = src.read_value()
    ops = []
    for j, c in enumerate(comps):
        if j != owner:
            with tf.device(c.device):
                ops.append(c.assign(value, read_value=False))
    return ops


def identity_element(shape, dtype):
    """``-0.0`` (0 for integers) everywhere: what a non-owner adds to a broadcast sum."""
    if dtype.is_floating:
        return tf.fill(shape, tf.constant(-0.0, dtype))
    return tf.zeros(shape, dtype)


def replica_broadcast(collectives, comp, source: bool, replica: int, worker_rank: int = 0):
    """From replica ``replica``'s context: every copy of a variable takes the owner's value.

    ``collectives`` is the job's ``tfdp.reduce.collective.ReplicaCollectives``; ``comp`` is
    this replica's copy; ``source`` whether this replica is the owner (it updated ``comp``).
    Every replica of the job must call it, in the same order.
    """
    device = comp.device
    with tf.device(device):
        if source and worker_rank == 0:
            value = comp.read_value()
        else:
            value = identity_element(comp.shape, comp.dtype)

    def stage(bufs, devs, finish):
        del devs
        return [finish(collectives.collective(bufs[0], replica), 0)]

    reduced, _ = pipeline.all_reduce_dense(
        [[value]], [device], SUM, stage, group_size=collectives.group_size, bucket_bytes=0,
        compression=None)
    if source:
        return None
    with tf.device(device):
        return comp.assign(reduced[0][0], read_value=False)


def reduce_to_owners(values, owners, devices, *, weights=None, bucket_bytes=0,
                     cross_worker_sum=None):
    """Sum each per-replica value onto its owner's device only (zero_stage=2).

    Args:
      values: DistributedValues (one component per local device), dense or IndexedSlices.
      owners: the owner (local index) of each value.
      devices: the local replica devices.
      weights: optional per-replica scalars multiplying float values first.
      bucket_bytes: fusion capacity for the small values of one owner.
      cross_worker_sum: ``f(t, index)`` summing ``t`` (on local device ``index``) over every
        worker, or None in one process.
    Returns:
      One value per input: the sum, on its owner's device (a tensor or IndexedSlices).
    """
    from tfdp.reduce import sparse as sparse_lib
    results = [None] * len(values)
    by_owner = {}
    for i, (v, o) in enumerate(zip(values, owners)):
        comps = list(v.values) if tfp.is_distributed_values(v) else [v]
        if isinstance(comps[0], tf.IndexedSlices):
            with tf.device(devices[o]):
                parts = comps
                if weights is not None:
                    parts = [tf.IndexedSlices(tf.math.multiply_no_nan(
                        p.values, tf.cast(w, p.values.dtype)), p.indices, p.dense_shape)
                        for p, w in zip(comps, weights)]
                vals, idx = sparse_lib.concat_local(parts)
                results[i] = tf.IndexedSlices(vals, idx, comps[0].dense_shape)
            continue
        by_owner.setdefault(o, []).append((i, comps))
    for o, items in sorted(by_owner.items()):
        order = [o] + [r for r in range(len(devices)) if r != o]  # the tree finishes on o
        devs = [devices[r] for r in order]
        w = None if weights is None else [weights[r] for r in order]

        def stage(bufs, ds, finish, o=o):
            total = algorithms.tree_sum(bufs, ds)
            with tf.device(ds[0]):
                total = total if len(bufs) > 1 else tf.identity(total)
                if cross_worker_sum is not None:
                    total = cross_worker_sum(total, o)
                return [finish(total, 0)] + [None] * (len(bufs) - 1)

        reduced, _ = pipeline.all_reduce_dense(
            [[comps[r] for r in order] for _, comps in items], devs, SUM, stage,
            group_size=len(devices), bucket_bytes=bucket_bytes, weights=w, outputs=[0])
        for (i, _), r in zip(items, reduced):
            results[i] = r[0]
    return results


__all__ = ["broadcast_local", "identity_element", "reduce_to_owners", "replica_broadcast"]

"""Empty replicas: one real example, share 0, nothing counted.

A global batch smaller than the replica count leaves replicas with empty batches, and TF's
oneDNN kernels (the CPU default) cannot take those: graph-mode MaxPoolGrad aborts the process
(tensor.cc Check failed), Conv2D returns a wrong shape (ReluGrad / BiasAdd shape errors; "input
depth must be evenly divisible by filter depth" where the batch is a static 0), with or without
a strategy. So an empty replica gets one example (a real one from a replica that has some, else
zeros): selected by a tf.cond only when it is empty where the batch size is not static, and at
trace time where it is a static 0 (Keras 3.16 traces a step's first batch with static shapes).
Its share stays 0, so its loss and gradients are exactly zero; its replica-context all-reduce
inputs (SyncBatchNorm's sums and counts) are zeroed; its metric updates (ON_READ variables:
Keras metrics and loss trackers) are undone; and its per-example outputs (predict) are cut back
to 0 rows. ``DataParallelExtendedBase._call_for_each_replica`` is the one caller.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import compat as tfp


def components(leaf, devices, dynamic_only=True):
    """The local replicas' tensors of a batched value (rank >= 1; with ``dynamic_only``, of
    unknown batch size), else None. With one device per process values are plain tensors."""
    if tfp.is_distributed_values(leaf):
        comps = list(leaf.values)
    elif isinstance(leaf, tf.Tensor) and len(devices) == 1:
        comps = [leaf]
    else:
        return None
    if len(comps) != len(devices) or not all(
            isinstance(c, tf.Tensor) and c.shape.rank
            and (c.shape[0] is None or not dynamic_only) for c in comps):
        return None
    return comps


def regroup(leaf, comps):
    """``leaf`` (a batched value ``components`` took apart) made of ``comps`` instead."""
    return tfp.PerReplica(tuple(comps)) if tfp.is_distributed_values(leaf) else comps[0]


def _per_replica_select(leaves, live, devices, if_empty, static_empty=None):
    """``leaves`` with replica r's components replaced by ``if_empty(c, comps)`` where it is
    empty: one tf.cond per replica over all of its components whose batch size is dynamic (on
    its device: each replica's selection stays on its own device), ``if_empty`` itself for the
    components that are statically empty (``static_empty(r, c)``). A leaf that is not batched,
    or that nothing was selected in, comes back as it was (the same object)."""
    comps = [components(leaf, devices, dynamic_only=False) for leaf in leaves]
    batched = [i for i, c in enumerate(comps) if c is not None]
    out = {i: list(comps[i]) for i in batched}
    changed = set()
    for r, (ok, d) in enumerate(zip(live, devices)):
        dynamic = [i for i in batched if comps[i][r].shape[0] is None]
        with tf.device(d):
            for i in batched:
                c = comps[i][r]
                if (c.shape[0] is not None and static_empty is not None
                        and static_empty(r, c)):
                    out[i][r] = if_empty(c, comps[i])
                    changed.add(i)
            if dynamic:  # (one cond for all of them: a cond costs ~50 ms of tracing)
                selected = tf.cond(
                    ok, lambda r=r: tuple(tf.identity(comps[i][r]) for i in dynamic),
                    lambda r=r: tuple(if_empty(comps[i][r], comps[i]) for i in dynamic))
                for i, c in zip(dynamic, selected):
                    out[i][r] = c
                changed.update(dynamic)
    return [regroup(leaf, out[i]) if i in changed else leaf for i, leaf in enumerate(leaves)]


class Padding:
    """One step's padding: ``pad`` the inputs, ``trim`` the outputs (the same live flags)."""

    def __init__(self, live, devices):
        self.live, self.devices = live, devices
        self.static = set()    # replicas padded at trace time (a static 0 batch)

    def pad(self, args):
        """``args`` with empty replicas given one example, and whether any input could be."""
        def static_zero(r, c):
            if c.shape[0] == 0:
                self.static.add(r)
                return True
            return False

        def donor(c, comps):  # one real example from a replica that has some, else zeros
            rows = [x[:1] for x in comps] + [tf.zeros(tf.concat([[1], tf.shape(c)[1:]], 0),
                                                      c.dtype)]
            return tf.concat(rows, 0)[:1]

        leaves = tf.nest.flatten(args)
        out = _per_replica_select(leaves, self.live, self.devices, donor, static_zero)
        padded = any(o is not leaf for o, leaf in zip(out, leaves))
        return tf.nest.pack_sequence_as(args, out), padded

    def trim(self, result):
        """Per-example outputs back to 0 rows on the padded replicas (a statically padded
        one's output has its one row)."""
        leaves = tf.nest.flatten(result)
        out = _per_replica_select(leaves, self.live, self.devices, lambda c, _: c[:0],
                                  lambda r, c: r in self.static and c.shape[0] == 1)
        return tf.nest.pack_sequence_as(result, out)


def read_on_read_state(on_read_refs, only=None):
    """The values of every live ON_READ variable (weakrefs; ``only``: these ids), per device."""
    saved = []
    for ref in on_read_refs:
        v = ref()
        if v is not None and (only is None or id(v) in only):
            vals = []
            for c in v.values:
                with tf.device(c.device):
                    vals.append(c.read_value())
            saved.append((v, vals))
    return saved


def restore_on_read_state(saved, live):
    """The padded (not live) replicas' ON_READ values put back: their updates undone."""
    for v, vals in saved:
        for c, old, ok in zip(v.values, vals, live):
            with tf.device(c.device):
                c.assign(tf.where(ok, c.read_value(), old))

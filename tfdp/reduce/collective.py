"""TF's collective ops as tfdp's stages: ``reduce_v2`` and the replica-context launcher.

* ``reduce_v2``: one ``CollectiveReduceV2`` sum; dtypes the op does not take travel cast. The
  cross-worker stage (``tfdp.reduce.cross_worker``) and the replica-context stage below use it.
* ``ReplicaCollectives``: collectives launched by every replica from its own replica context,
  without ``merge_call``, over all N replicas of the job (the local devices of every worker:
  TF's collective runtime sums within the process and across workers). That is the only way to
  reduce where ``merge_call`` is refused, inside a ``tf.cond`` branch: Keras 3's own
  ``gradient_accumulation_steps=k`` puts the optimizer's all-reduce exactly there (under
  tf.distribute it crashes: "merge_call called while defining a new graph"). No replica waits
  for another in Python, so the collectives may sit in any control flow every replica takes
  alike: in Keras's accumulation ``tf.cond`` they run on update steps only.

The reducer (``tfdp.reduce.reducer.Reducer._all_reduce``) packs a replica's values into buckets
through the one bucket pipeline, with ``ReplicaCollectives.collective`` as the stage. Keys come
from ``tfdp.reduce.keys``: instance keys from one run-time counter per replica device, so replica
r's j-th executed collective has the same key as every other replica's j-th (and every
worker's), fresh on every execution, also inside loops and branches.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import devices as devices_lib
from tfdp.reduce import keys

# dtypes CollectiveReduceV2 accepts (others are cast for the trip).
REDUCE_DTYPES = (tf.float32, tf.float16, tf.bfloat16, tf.float64, tf.int32, tf.int64)


def reduce_v2(t, *, group_size, group_key, instance_key, ordering_token, hint, timeout_seconds,
              max_subdivs_per_device=-1):
    """One ``CollectiveReduceV2`` sum of ``t`` (on the current device) over the group; dtypes
    the op does not take (bool, int8, ...) travel as int64 / float32 and come back."""
    wire = t
    if t.dtype not in REDUCE_DTYPES:
        wire = tf.cast(t, tf.int64 if t.dtype.is_integer or t.dtype == tf.bool else tf.float32)
    out = tf.raw_ops.CollectiveReduceV2(
        input=wire, group_size=group_size, group_key=group_key, instance_key=instance_key,
        ordering_token=ordering_token, merge_op="Add", final_op="Id", communication_hint=hint,
        timeout_seconds=timeout_seconds, max_subdivs_per_device=max_subdivs_per_device)
    return out if wire is t else tf.cast(out, t.dtype)


class ReplicaCollectives:
    """One collective group over every replica of the job, joined from replica contexts.

    Args:
      devices: this process's replica devices, in local replica order.
      num_workers: worker processes in the job (each with ``len(devices)`` replicas).
      timeout_seconds: collective timeout, 0 for none.

    Creates variables (ordering tokens, key counters): make it outside any strategy scope.
    """

    def __init__(self, devices, num_workers: int = 1, timeout_seconds: float = 0.0):
        self.devices = tuple(devices)
        self.num_workers = int(num_workers)
        self.group_size = len(self.devices) * self.num_workers
        self.timeout_seconds = float(timeout_seconds)
        self.hint = "nccl" if all(devices_lib.is_gpu(d) for d in self.devices) else "ring"
        self.group_key = keys.new_replica_group_key()
        # One ordering token (a resource) per device, as TF's CollectiveReplicaLauncher: the
        # collectives of a device then run in program order (NCCL needs the same order on every
        # device), and CPU collectives among the devices of one process need it to run at all
        # (measured: without a token, 4 logical CPUs time out waiting for each other).
        self._tokens = keys.ordering_tokens(self.devices, "tfdp_replica_collective_order")
        self._keys = keys.InstanceKeys(self.devices, "tfdp_replica_collective_key")

    def __repr__(self):
        return f"ReplicaCollectives(replicas={self.group_size}, workers={self.num_workers})"

    def collective(self, buf, replica_id: int):
        """The sum of ``buf`` over every replica of the job (called by replica ``replica_id``,
        on its device; every replica calls it for the same buffers in the same order)."""
        return reduce_v2(buf, group_size=self.group_size, group_key=self.group_key,
                         instance_key=self._keys.next(replica_id),
                         ordering_token=[self._tokens[replica_id].handle], hint=self.hint,
                         timeout_seconds=self.timeout_seconds)


__all__ = ["REDUCE_DTYPES", "ReplicaCollectives", "reduce_v2"]

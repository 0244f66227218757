"""All-reduce from inside a replica, without ``merge_call``: one collective per replica and bucket.

tfdp's normal reduction (``local.DataParallelReduce``, ``hierarchical.MultiWorkerReduce``) sees
every replica's gradients at once through ``merge_call`` and sums them with a tree of adds. That
is impossible where ``merge_call`` is refused: inside a ``tf.cond`` branch. Keras 3's own
``gradient_accumulation_steps=k`` puts the optimizer's all-reduce exactly there (the update branch
runs every k-th micro-step, the other branch only adds to accumulators), so under tf.distribute it
crashes ("merge_call called while defining a new graph").

``ReplicaAllReduce`` is the other way of reducing: every replica, from its own replica context,
packs its values into the same buckets (``packing.plan``; same shapes on every replica, so the
same plan), optionally compresses them, and launches one ``CollectiveReduceV2`` per bucket over
all N replicas of the job (the local devices of every worker: TF's collective runtime sums within
the process and across workers). No replica waits for another in Python, so the collectives may
sit in any control flow that every replica takes alike: in Keras's accumulation ``tf.cond`` they
run on update steps only, one reduction per k micro-steps.

Its buckets go through the one bucket pipeline (``tfdp.reduce.pipeline``) with this replica's
buffer as the only one; the stage is ``reduce_v2``, also used across workers by
``tfdp.reduce.hierarchical``. Keys come from ``tfdp.reduce.keys``: instance keys from one run-time
counter per replica device, so replica r's j-th executed collective has the same key as every
other replica's j-th (and every worker's), fresh on every execution, also inside loops and
branches.
"""

from __future__ import annotations

import threading

import tensorflow as tf

from tfdp import devices as devices_lib
from tfdp.reduce import keys, packing, pipeline

SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN
_tick_lock = threading.Lock()

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


class ReplicaAllReduce:
    """Sum or mean of per-replica values, called by each replica from its replica context.

    Args:
      devices: this process's replica devices, in local replica order.
      num_workers: worker processes in the job (each with ``len(devices)`` replicas).
      bucket_bytes: fusion bucket capacity (None: ``packing.DEFAULT_BUCKET_BYTES``).
      compression: None, "fp16" or "bf16" (float values travel in that dtype).
      timeout_seconds: collective timeout, 0 for none.
    """

    def __init__(self, devices, num_workers: int = 1, bucket_bytes: int | None = None,
                 compression: str | None = None, timeout_seconds: float = 0.0):
        self.devices = tuple(devices)
        self.num_workers = int(num_workers)
        self.group_size = len(self.devices) * self.num_workers
        self.bucket_bytes = packing.DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.compression = compression
        self.timeout_seconds = float(timeout_seconds)
        self.gpu = all(devices_lib.is_gpu(d) for d in self.devices)
        self.hint = "nccl" if self.gpu else "ring"
        self.group_key = keys.new_replica_group_key()
        # One ordering token (a resource) per device, as TF's CollectiveReplicaLauncher: the
        # collectives of a device then run in program order (NCCL needs the same order on every
        # device), and CPU collectives among the devices of one process need it to run at all
        # (measured: without a token, 4 logical CPUs time out waiting for each other).
        # Create the reducer outside any strategy scope (these are plain variables).
        with tf.init_scope():
            self._tokens = []
            for d in self.devices:
                with tf.device(d):
                    self._tokens.append(tf.Variable(0.0, trainable=False,
                                                    name="tfdp_replica_collective_order"))
            self._keys = keys.InstanceKeys(self.devices, "tfdp_replica_collective_key")
        # Testing hook: when True (set before the function is traced), every *executed* collective
        # adds one to ``executed`` (through a py_function), so tests can count reductions per step.
        self.count_executions = False
        self.executed = 0
        self.traced = 0

    def __repr__(self):
        return (f"ReplicaAllReduce(replicas={self.group_size}, workers={self.num_workers}, "
                f"bucket_bytes={self.bucket_bytes}, compression={self.compression!r})")

    # --- keys --------------------------------------------------------------------------------

    def _tick(self):
        with _tick_lock:  # (py_functions of several replicas run in TF's threads)
            self.executed += 1
        return tf.constant(0, tf.int32)

    # --- the reduction -----------------------------------------------------------------------

    def all_reduce(self, reduce_op, values, replica_id: int, weight=None):
        """Reduce this replica's ``values`` (a flat list) with every other replica's.

        Args:
          reduce_op: SUM or MEAN (MEAN divides by the job's replica count).
          values: tensors or IndexedSlices (densified: the sum of slices is a dense tensor).
          replica_id: this replica's local index (the device it runs on is devices[replica_id]).
          weight: optional scalar multiplying float values first (uneven-batch weights).
        Returns:
          The reduced tensors, in order, on this replica's device.
        """
        if tf.executing_eagerly():
            raise RuntimeError("ReplicaAllReduce runs inside tf.function only (replica functions "
                               "run one after another in eager mode, so collectives would wait "
                               "for each other forever).")
        reduce_op = pipeline.as_reduce_op(reduce_op)
        self.traced += 1
        device = self.devices[replica_id]
        with tf.device(device):
            values = [tf.convert_to_tensor(v) for v in values]
            if any(v.shape.num_elements() is None for v in values):
                raise ValueError("tfdp replica-context all-reduce needs static shapes; received "
                                 f"shapes {[v.shape for v in values]}.")
        reduced, _ = pipeline.all_reduce_dense(
            [[v] for v in values], [device], reduce_op,
            lambda bufs, devs, finish: [finish(self._collective(bufs[0], replica_id), 0)],
            group_size=self.group_size, bucket_bytes=self.bucket_bytes,
            compression=self.compression, weights=None if weight is None else [weight])
        return [r[0] for r in reduced]

    def _collective(self, buf, replica_id):
        out = reduce_v2(buf, group_size=self.group_size, group_key=self.group_key,
                        instance_key=self._keys.next(replica_id),
                        ordering_token=[self._tokens[replica_id].handle], hint=self.hint,
                        timeout_seconds=self.timeout_seconds)
        if self.count_executions:
            with tf.control_dependencies([out]):
                tick = tf.py_function(self._tick, [], tf.int32)
            with tf.control_dependencies([tick]):
                out = tf.identity(out)
        return out


__all__ = ["ReplicaAllReduce"]

"""The cross-worker stage: TF collectives among one device per worker.

``CrossWorker`` sums or gathers a tensor over the workers, each call one TF collective on a local
device (``CollectiveReduceV2``: RING on CPU with ``max_subdivs_per_device=16``, NCCL on GPUs;
``CollectiveGatherV2``). The reducer (``tfdp.reduce.reducer.Reducer``) runs it after its local
algorithm: each piece the local stage finishes (the whole bucket on device 0 for a tree, chunk c
on device c for "ring") crosses the workers on the device that holds it, so "ring" runs K
concurrent cross-worker collectives. Every worker must make the same calls in the same order.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import devices as devices_lib
from tfdp.reduce import keys
from tfdp.reduce.collective import reduce_v2

# dtypes CollectiveGatherV2 accepts (others are cast for the trip).
_GATHER_DTYPES = (tf.float32, tf.float16, tf.float64, tf.int32, tf.int64)
_RING_SUBDIVS = 16  # measured: 2 workers, 64 MB float32 on loopback: 610 ms -> 267 ms (DESIGN.md)


class CrossWorker:
    """Collectives among the same local device of every worker.

    Args:
      devices: this worker's replica devices (canonical strings), in local replica order.
      num_workers: worker processes in the job.
      timeout_seconds: collective timeout (0: none); an expired collective raises
        DeadlineExceededError instead of waiting for a peer forever.
    """

    def __init__(self, devices, num_workers: int, timeout_seconds: float = 0.0):
        self.devices = tuple(devices)
        self.num_workers = int(num_workers)
        self.timeout_seconds = float(timeout_seconds)
        self.gpu = all(devices_lib.is_gpu(d) for d in self.devices)
        self.hint = "nccl" if self.gpu else "ring"
        # NCCL needs every worker to launch collectives in the same order: each collective on a
        # GPU takes its device's ordering token (a resource), so TF's automatic control
        # dependencies run them in program order (as TF's own CollectiveReplicaLauncher does).
        self._tokens = (keys.ordering_tokens(self.devices, "tfdp_collective_order") if self.gpu
                        else None)
        self._keys = keys.InstanceKeys(self.devices, "tfdp_cross_worker_key")

    def _ordering_token(self, index):
        return [] if self._tokens is None else [self._tokens[index].handle]

    def sum(self, t, index: int = 0):
        """Sum ``t`` (on local device ``index``) over the workers: one collective."""
        with tf.device(self.devices[index]):
            return reduce_v2(t, group_size=self.num_workers,
                             group_key=keys.cross_worker_group_key(index),
                             instance_key=self._keys.next(index),
                             ordering_token=self._ordering_token(index), hint=self.hint,
                             timeout_seconds=self.timeout_seconds,
                             max_subdivs_per_device=-1 if self.gpu else _RING_SUBDIVS)

    def gather(self, t, index: int = 0):
        """Concatenate ``t`` (same shape on every worker) of all workers along axis 0."""
        dtype = t.dtype
        wire = t if dtype in _GATHER_DTYPES else tf.cast(
            t, tf.int64 if dtype.is_integer or dtype == tf.bool else tf.float32)
        with tf.device(self.devices[index]):
            out = tf.raw_ops.CollectiveGatherV2(
                input=wire, group_size=self.num_workers,
                group_key=keys.cross_worker_group_key(index),
                instance_key=self._keys.next(index), ordering_token=self._ordering_token(index),
                communication_hint=self.hint, timeout_seconds=self.timeout_seconds)
            return out if wire is t else tf.cast(out, dtype)


__all__ = ["CrossWorker"]

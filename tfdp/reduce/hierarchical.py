"""Hierarchical all-reduce across workers: local devices first, then one TF collective per bucket.

``MultiWorkerReduce`` is the cross-device ops of the multi-worker strategy
(``tfdp.strategy.multiworker``): the K local values are summed first (packed into buckets,
``tfdp.reduce.packing``; weighted; optionally compressed), then summed across workers by one TF
collective per bucket (``CollectiveReduceV2``, RING on CPU with ``max_subdivs_per_device=16``,
NCCL on GPUs) on one device per worker, then copied to the local devices. With
``all_reduce="ring"`` the local stage is a reduce-scatter: device c of every worker all-reduces
chunk c, i.e. K concurrent cross-worker collectives, then a local all-gather. ``tf.IndexedSlices``
(embedding gradients) are all-gathered: locally, then across workers (padded to the longest
worker's slice count, then unpadded), or densified (``tfdp.reduce.sparse``).
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import compat as tfp
from tfdp import devices as devices_lib
from tfdp.reduce import algorithms, keys, packing, pipeline, registry
from tfdp.reduce.collective import reduce_v2
from tfdp.reduce.local import in_place

# dtypes CollectiveGatherV2 accepts (others are cast for the trip).
_GATHER_DTYPES = (tf.float32, tf.float16, tf.float64, tf.int32, tf.int64)
COMPRESSED_BUCKET_BYTES = 64 * 1024 * 1024  # bucket cap when gradients are compressed
# Uncompressed buckets keep the local ``bucket_bytes`` (None). Measured (tfdp bench crossworker,
# 2 workers on loopback, 64 MB float32 in 32 tensors of 2 MB, two runs of 9 alternating rounds):
# packing them into bigger buckets is slower, 4M 1.04-1.05x (noise: the same plan as 1M measured
# 0.81x), 8M 0.72x, 16M 0.66x, 32M 0.58x, 64M 0.39-0.67x of one collective per tensor; TF's ring
# sends chunks of up to 4 MB, and 32 concurrent collectives of 1 MB chunks move more per second
# than one collective of 4 MB chunks. Compressed, one packed collective does pay (fp16 64M:
# 1.20-1.32x over uncompressed in the same runs).
UNCOMPRESSED_BUCKET_BYTES = None
_RING_SUBDIVS = 16  # measured: 2 workers, 64 MB float32 on loopback: 610 ms -> 267 ms (DESIGN.md)

SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN


# --- the cross-device ops ----------------------------------------------------------------------

class MultiWorkerReduce(tf.distribute.CrossDeviceOps):
    """Hierarchical all-reduce: local devices, then across workers with TF collectives.

    Args:
      devices: this worker's replica devices (canonical strings), in local replica order.
      num_workers: number of worker processes (each with ``len(devices)`` replicas).
      algorithm: local stage: "ring" (reduce-scatter, one cross-worker collective per local
        device and chunk, all-gather) or anything else (pairwise tree to the first device, one
        cross-worker collective there, copy back).
      bucket_bytes: fusion bucket capacity (``tfdp.reduce.packing``); None: packing's default.
      compression: None, "fp16" or "bf16": dense float buckets travel in that dtype.
      fallback: TF's ``CollectiveAllReduce`` over the same devices, used for ``gather``.
      timeout_seconds: collective timeout (0: none); an expired collective raises
        DeadlineExceededError instead of waiting for a peer forever.
      sparse: IndexedSlices: "auto", "gather" or "densify" (``tfdp.reduce.sparse``); None reads
        ``TFDP_SPARSE`` (default "auto").
    """

    def __init__(self, devices, num_workers: int, algorithm: str = "fused",
                 bucket_bytes: int | None = None, compression: str | None = None, *,
                 fallback=None, timeout_seconds: float = 0.0, sparse: str | None = None):
        super().__init__()
        from tfdp.reduce import sparse as sparse_lib
        self.sparse = sparse_lib.resolve_mode(sparse)
        self.densify_ok = False  # set per Keras train step (strategy._DataParallelExtended)
        self.devices = tuple(devices)
        self.num_workers = int(num_workers)
        self.algorithm = algorithm
        bucket_bytes = registry.validate_bucket_bytes(bucket_bytes)
        self.bucket_bytes = packing.DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.compression = registry.validate_compression(compression)
        self.timeout_seconds = float(timeout_seconds)
        self._fallback = fallback
        self.gpu = all(devices_lib.is_gpu(d) for d in self.devices)
        self.hint = "nccl" if self.gpu else "ring"
        # NCCL needs every worker to launch collectives in the same order: each collective on a
        # GPU takes its device's ordering token (a resource), so TF's automatic control
        # dependencies run them in program order (as TF's own CollectiveReplicaLauncher does).
        self._tokens = None
        if self.gpu:
            with tf.init_scope():
                self._tokens = []
                for d in self.devices:
                    with tf.device(d):
                        self._tokens.append(tf.Variable(0.0, trainable=False,
                                                        name="tfdp_collective_order"))
        self._keys = keys.InstanceKeys(self.devices, "tfdp_cross_worker_key")
        # None: the measured caps below; an int overrides both (read when a step is traced;
        # the benchmark tfdp.bench.crossworker sweeps it)
        self.cross_worker_bucket_bytes = None
        self.traced_batch_reductions = 0
        self.last_plan: list = []

    def __repr__(self):
        return (f"MultiWorkerReduce(workers={self.num_workers}, local_devices="
                f"{len(self.devices)}, algorithm={self.algorithm!r}, "
                f"bucket_bytes={self.bucket_bytes}, compression={self.compression!r}, "
                f"cross_worker={self.hint!r})")

    @property
    def _num_between_graph_workers(self):
        return self.num_workers

    @property
    def num_replicas(self) -> int:
        return len(self.devices) * self.num_workers

    def packed_bucket_bytes(self) -> int:
        """The bucket capacity of this reducer's dense buckets (``bucket_bytes`` 0: no fusion).

        Across workers every collective has a fixed cost (~5 ms on loopback, TF's gRPC
        transport) that neither packing nor casting shrinks, so tensors are packed into few big
        collectives, far above the local ``bucket_bytes``, when they travel compressed: up to
        ``COMPRESSED_BUCKET_BYTES`` (the cast before packing halves the copy). In float32 that
        was measured slower than one collective per large tensor (``UNCOMPRESSED_BUCKET_BYTES``
        None: the local ``bucket_bytes``; ``tfdp bench crossworker``, README "Across
        workers"). ``cross_worker_bucket_bytes`` overrides both (benchmarks).
        """
        if self.bucket_bytes <= 0:
            return 0
        if self.cross_worker_bucket_bytes is not None:
            return max(self.bucket_bytes, int(self.cross_worker_bucket_bytes))
        cap = (COMPRESSED_BUCKET_BYTES if self.compression is not None
               else UNCOMPRESSED_BUCKET_BYTES)
        return self.bucket_bytes if cap is None else max(self.bucket_bytes, cap)

    # --- cross-worker primitives (one device per worker; same call order on every worker) ----

    def _ordering_token(self, index):
        return [] if self._tokens is None else [self._tokens[index].handle]

    def cross_worker_sum(self, t, index: int = 0):
        """Sum ``t`` (on local device ``index``) over the workers: one collective."""
        with tf.device(self.devices[index]):
            return reduce_v2(t, group_size=self.num_workers,
                             group_key=keys.cross_worker_group_key(index),
                             instance_key=self._keys.next(index),
                             ordering_token=self._ordering_token(index), hint=self.hint,
                             timeout_seconds=self.timeout_seconds,
                             max_subdivs_per_device=-1 if self.gpu else _RING_SUBDIVS)

    def cross_worker_gather(self, t, index: int = 0):
        """Concatenate ``t`` (same shape on every worker) of all workers along axis 0."""
        dtype = t.dtype
        wire = t if dtype in _GATHER_DTYPES else tf.cast(
            t, tf.int64 if dtype.is_integer or dtype == tf.bool else tf.float32)
        with tf.device(self.devices[index]):
            out = tf.raw_ops.CollectiveGatherV2(
                input=wire, group_size=self.num_workers, group_key=keys.cross_worker_group_key(index),
                instance_key=self._keys.next(index), ordering_token=self._ordering_token(index),
                communication_hint=self.hint, timeout_seconds=self.timeout_seconds)
            return out if wire is t else tf.cast(out, dtype)

    def cross_worker_gather_ragged(self, t, index: int = 0):
        """Concatenate along axis 0 tensors whose first dimension differs between workers."""
        with tf.device(self.devices[index]):
            n = tf.shape(t, out_type=tf.int32)[:1]
            lens = self.cross_worker_gather(n, index)
            longest = tf.reduce_max(lens)
            pad = [[0, longest - n[0]]] + [[0, 0]] * (t.shape.rank - 1)
            gathered = self.cross_worker_gather(tf.pad(t, pad), index)
            keep = tf.reshape(tf.range(longest)[tf.newaxis, :] < lens[:, tf.newaxis], [-1])
            return tf.boolean_mask(gathered, keep)

    # --- tf.distribute.CrossDeviceOps contract -------------------------------------------------

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        del options
        if len(per_replica_value.values) != len(self.devices):
            raise ValueError(
                f"tfdp MultiWorkerReduce expects one value per local replica "
                f"({len(self.devices)}); got {len(per_replica_value.values)}.")
        reduced = self.all_reduce(reduce_op, [per_replica_value])[0]
        if (not tfp.has_destinations(destinations)
                or tuple(tfp.devices_of(destinations)) == self.devices):
            return reduced
        first = tfp.select_replica(0, reduced) if tfp.is_distributed_values(reduced) else reduced
        return self.broadcast(first, destinations)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        return self.batch_reduce_weighted(reduce_op, value_destination_pairs, None)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        if self._fallback is None:
            raise NotImplementedError("gather needs the fallback CollectiveAllReduce")
        return self._fallback._gather_implementation(  # pylint: disable=protected-access
            per_replica_value, destinations, axis, options)

    # --- tfdp ----------------------------------------------------------------------------------

    def batch_reduce_weighted(self, reduce_op, value_destination_pairs, weights):
        """batch_reduce where replica r's values are multiplied by ``weights[r]`` first."""
        reduce_op = pipeline.as_reduce_op(reduce_op)
        pairs = list(value_destination_pairs)
        if all(in_place(d, self.devices) for _, d in pairs):
            return self.all_reduce(reduce_op, [v for v, _ in pairs], weights)
        if weights is not None:
            raise NotImplementedError("weighted reduction to other destinations")
        return [self.reduce_implementation(reduce_op, v, d, None) for v, d in pairs]

    def all_reduce(self, reduce_op, values, weights=None):
        """All-reduce PerReplica values over every replica of every worker.

        Args:
          reduce_op: SUM or MEAN (MEAN divides by the global replica count).
          values: DistributedValues with one component per local device, in replica order.
          weights: optional per-local-replica scalar tensors multiplying float values first.
        Returns:
          Mirrored values (plain tensors with one local device), identical on every worker.
        """
        reduce_op = pipeline.as_reduce_op(reduce_op)
        self.traced_batch_reductions += 1
        devices = list(self.devices)
        n_global = self.num_replicas
        results = [None] * len(values)
        comps_of = [list(v.values) if tfp.is_distributed_values(v) else [v] for v in values]
        dense = [i for i, c in enumerate(comps_of) if not isinstance(c[0], tf.IndexedSlices)]
        sparse = [i for i, c in enumerate(comps_of) if isinstance(c[0], tf.IndexedSlices)]

        for i in sparse:
            results[i] = self._all_gather_slices(comps_of[i], weights, reduce_op)

        cap = self.packed_bucket_bytes()
        # the local stage ("ring": reduce-scatter, else a tree to device 0); each finished piece
        # crosses the workers first, on the device that holds it
        local = algorithms.ring if self.algorithm == "ring" else algorithms.tree

        def stage(bufs, devs, finish):
            return local(bufs, devs, lambda t, i: finish(self.cross_worker_sum(t, i), i))

        reduced, self.last_plan = pipeline.all_reduce_dense(
            [comps_of[i] for i in dense], devices, reduce_op, stage, group_size=n_global,
            bucket_bytes=cap, compression=self.compression, weights=weights)
        for j, i in enumerate(dense):
            results[i] = tfp.mirrored(reduced[j])
        return results

    def _all_gather_slices(self, comps, weights, reduce_op):
        """IndexedSlices over every replica of every worker: all-gathered (local replicas, then
        workers, in rank order) or densified and summed, by ``tfdp.reduce.sparse``'s rule
        (``TFDP_SPARSE``: auto | gather | densify)."""
        from tfdp.reduce import sparse as sparse_lib
        per_dev = sparse_lib.reduce_across_workers(
            comps, weights, self.devices, self.num_workers,
            self.sparse,
            gather=lambda t: self.cross_worker_gather(t, 0),
            sum_dense=lambda t: self.cross_worker_sum(t, 0),
            scale=(1.0 / self.num_replicas) if reduce_op == MEAN else None,
            densify_ok=self.densify_ok)
        return tfp.mirrored(per_dev)


__all__ = ["MultiWorkerReduce"]

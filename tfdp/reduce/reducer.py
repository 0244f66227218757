"""tfdp's one reducer: a ``tf.distribute.CrossDeviceOps`` built from the bucket pipeline, a local
algorithm, an optional cross-worker stage, a codec and the replica-context collectives.

    Reducer(devices, num_workers=1, algorithm=..., bucket_bytes=..., compression=..., sparse=...)

Both strategies use it: the local one (one process, N devices) and the multi-worker one (the same
local stage, each finished piece then summed across workers, ``tfdp.reduce.cross_worker``). It
follows TF's ``CrossDeviceOps`` template: the public methods (``reduce``, ``batch_reduce``,
``broadcast``) validate and call the ``*_implementation`` methods below, and ``_all_reduce`` is
the replica-context entry TF's extended calls when ``merge_call`` is off.

What one call needs comes in with it (``tfdp.reduce.options.ReduceOptions``: per-replica
``weights``, ``densify_ok``); the reducer keeps only its configuration and what it planned last
(``last_plan``, for tests and benchmarks).

* Dense values go through the bucket pipeline (``tfdp.reduce.pipeline``): planned into buckets by
  dtype (``packing.plan``), small tensors packed into one flat buffer per device, each bucket an
  independent group of graph ops, so the runtime can start a bucket as soon as its gradients
  exist. The stage: one local algorithm (``tfdp.reduce.algorithms``: ``fused`` tree, ``ring``,
  ``one_device``, ``nccl``); across workers the tree (or "ring"'s reduce-scatter) whose finished
  pieces cross the workers first.
* IndexedSlices (embedding gradients) are all-gathered as (indices, values), or densified, by the
  measured rule of ``tfdp.reduce.sparse`` (``sparse=`` / ``TFDP_SPARSE``).
* In a replica context (``_all_reduce``: Keras's accumulation branch, sync BatchNorm under
  accumulation) each replica's buckets go to one collective over every replica of the job
  (``tfdp.reduce.collective.ReplicaCollectives``).
* Sharded optimizer state (``tfdp.zero``): ``reduce_to_owners`` (each gradient onto its owner
  only) and ``replica_broadcast`` (the owner's value to every copy, from replica contexts),
  through the same pipeline (``tfdp.reduce.owner``).
"""

from __future__ import annotations

import tensorflow as tf

from tfdp import compat as tfp
from tfdp.reduce import algorithms, owner, packing, pipeline
from tfdp.reduce import sparse as sparse_lib
from tfdp.reduce.options import densify_ok_of, weights_of
from tfdp.reduce.registry import ALGORITHMS, validate_bucket_bytes, validate_compression

SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN

COMPRESSED_BUCKET_BYTES = 64 * 1024 * 1024  # cross-worker bucket cap when compressed
# Uncompressed cross-worker buckets keep the local ``bucket_bytes`` (None). Measured (tfdp bench
# crossworker, 2 workers on loopback, 64 MB float32 in 32 tensors of 2 MB, two runs of 9
# alternating rounds): packing them into bigger buckets is slower, 4M 1.04-1.05x (noise: the
# same plan as 1M measured 0.81x), 8M 0.72x, 16M 0.66x, 32M 0.58x, 64M 0.39-0.67x of one
# collective per tensor; TF's ring sends chunks of up to 4 MB, and 32 concurrent collectives of
# 1 MB chunks move more per second than one collective of 4 MB chunks. Compressed, one packed
# collective does pay (fp16 64M: 1.20-1.32x over uncompressed in the same runs).
UNCOMPRESSED_BUCKET_BYTES = None


def in_place(destinations, devices) -> bool:
    """Whether an all-reduce result goes back to ``devices`` (no destinations, the same devices,
    or destinations without a device: a replica-context all_reduce of tensors built without a
    device scope passes those)."""
    if not tfp.has_destinations(destinations):
        return True
    dest = tuple(tfp.devices_of(destinations))
    return dest == tuple(devices) or all(d == "" for d in dest)


class Reducer(tf.distribute.CrossDeviceOps):
    """Bucketed, optionally compressed all-reduce over the local devices, then across workers.

    Args:
      devices: this process's replica devices (canonical strings), in local replica order; None
        (one process only): the devices of the values reduced.
      num_workers: worker processes in the job (each with ``len(devices)`` replicas).
      algorithm: the local stage: "fused", "ring", "one_device" or "nccl" (resolve "auto" with
        ``registry.choose`` first). Across workers "ring" reduce-scatters (one cross-worker
        collective per device and chunk) and every other algorithm sums on the first device.
      bucket_bytes: capacity of a fused bucket; tensors this large or larger are reduced alone;
        0 disables fusion; None takes ``packing.DEFAULT_BUCKET_BYTES``.
      compression: None, "fp16" or "bf16": float values travel in that dtype.
      sparse: how IndexedSlices are reduced: "auto" (the measured rule of
        ``tfdp.reduce.sparse``), "gather" or "densify"; None reads ``TFDP_SPARSE``.
      timeout_seconds: collective timeout (0: none).
      fallback: TF's ``CollectiveAllReduce`` over the same devices (across workers), for
        ``gather``.
    """

    def __init__(self, devices=None, num_workers: int = 1, algorithm: str = "fused",
                 bucket_bytes: int | None = None, compression: str | None = None,
                 sparse: str | None = None, *, timeout_seconds: float = 0.0, fallback=None):
        super().__init__()
        if algorithm not in algorithms.ALGORITHMS:
            from tfdp.errors import invalid_argument
            raise invalid_argument("algorithm", algorithm, valid=[a for a in ALGORITHMS
                                                                  if a != "auto"])
        num_workers = int(num_workers)
        if num_workers > 1 and devices is None:
            raise ValueError("A reducer across workers needs this worker's devices.")
        bucket_bytes = validate_bucket_bytes(bucket_bytes)
        self.devices = None if devices is None else tuple(devices)
        self.num_workers = num_workers
        self.algorithm = algorithm
        self.bucket_bytes = packing.DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.compression = validate_compression(compression)
        self.sparse = sparse
        self.timeout_seconds = float(timeout_seconds)
        self._fallback = fallback
        self.cross_worker = None
        if num_workers > 1:
            from tfdp.reduce.cross_worker import CrossWorker
            self.cross_worker = CrossWorker(self.devices, num_workers, self.timeout_seconds)
        self._replica = None  # ReplicaCollectives, made by prepare_replica_context()
        # Counted when graphs are built (each tf.function trace): tests and benchmarks read them.
        self.traced_batch_reductions = 0
        self.last_plan: list[packing.Bucket] = []

    @property
    def sparse(self) -> str:
        """How IndexedSlices are reduced: "auto", "gather" or "densify" (tfdp.reduce.sparse)."""
        return self._sparse

    @sparse.setter
    def sparse(self, value):
        self._sparse = sparse_lib.resolve_mode(value)

    @property
    def _num_between_graph_workers(self):
        return self.num_workers

    def __repr__(self):
        where = "" if self.devices is None else f"local_devices={len(self.devices)}, "
        workers = f"workers={self.num_workers}, " if self.num_workers > 1 else ""
        return (f"Reducer({workers}{where}algorithm={self.algorithm!r}, "
                f"bucket_bytes={self.bucket_bytes}, compression={self.compression!r}, "
                f"sparse={self.sparse!r})")

    def packed_bucket_bytes(self) -> int:
        """The bucket capacity of the dense buckets (``bucket_bytes`` 0: no fusion).

        In one process: ``bucket_bytes``. Across workers every collective has a fixed cost
        (~5 ms on loopback, TF's gRPC transport) that neither packing nor casting shrinks, so
        compressed tensors are packed into few big collectives, up to
        ``COMPRESSED_BUCKET_BYTES`` (the cast before packing halves the copy). In float32 that
        was measured slower than one collective per large tensor (``UNCOMPRESSED_BUCKET_BYTES``
        None: the local ``bucket_bytes``; ``tfdp bench crossworker``).
        """
        if self.bucket_bytes <= 0 or self.cross_worker is None:
            return max(self.bucket_bytes, 0)
        cap = (COMPRESSED_BUCKET_BYTES if self.compression is not None
               else UNCOMPRESSED_BUCKET_BYTES)
        return self.bucket_bytes if cap is None else max(self.bucket_bytes, cap)

    # --- tf.distribute.CrossDeviceOps template --------------------------------------------------

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        reduce_op = pipeline.as_reduce_op(reduce_op)
        value_devices = tuple(tfp.devices_of(per_replica_value))
        if self.cross_worker is not None and len(value_devices) != len(self.devices):
            raise ValueError(f"tfdp's reducer expects one value per local replica "
                             f"({len(self.devices)}); got {len(value_devices)}.")
        if (not tfp.has_destinations(destinations)
                or tuple(tfp.devices_of(destinations)) == value_devices):
            return self.all_reduce(reduce_op, [per_replica_value], options)[0]
        if self.cross_worker is not None:  # all-reduce, then one copy to the destinations
            reduced = self.all_reduce(reduce_op, [per_replica_value], options)[0]
            first = tfp.select_replica(0, reduced) if tfp.is_distributed_values(reduced) \
                else reduced
            return self.broadcast(first, destinations)
        dest = tfp.devices_of(destinations)  # one process: sum on the first destination
        values = list(per_replica_value.values)
        with tf.device(dest[0]):
            if isinstance(values[0], tf.IndexedSlices):
                vals, idx = sparse_lib.concat_local(values)
                if reduce_op == MEAN:
                    vals = pipeline.divide(vals, len(values))
                reduced = tf.IndexedSlices(vals, idx, values[0].dense_shape)
            else:
                reduced = tf.math.add_n(values) if len(values) > 1 else tf.identity(values[0])
                if reduce_op == MEAN:
                    reduced = pipeline.divide(reduced, len(values))
        return self.broadcast(reduced, destinations)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        reduce_op = pipeline.as_reduce_op(reduce_op)
        pairs = list(value_destination_pairs)
        if all(in_place(d, tuple(tfp.devices_of(v))) for v, d in pairs):
            return self.all_reduce(reduce_op, [v for v, _ in pairs], options)
        if weights_of(options) is not None:
            raise NotImplementedError("weighted reduction to other destinations")
        return [self.reduce_implementation(reduce_op, v, d, options) for v, d in pairs]

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        if self.cross_worker is not None:
            if self._fallback is None:
                raise NotImplementedError("gather needs the fallback CollectiveAllReduce")
            return self._fallback._gather_implementation(  # pylint: disable=protected-access
                per_replica_value, destinations, axis, options)
        dest = (tfp.devices_of(destinations) if tfp.has_destinations(destinations)
                else tfp.devices_of(per_replica_value))
        with tf.device(dest[0]):
            gathered = tf.concat(list(per_replica_value.values), axis=axis)
        return self.broadcast(gathered, destinations)

    def _all_reduce(self, reduce_op, value, replica_id, options):
        """From replica ``replica_id``'s context, without merge_call: ``value`` (a nested
        structure of tensors; IndexedSlices are densified) reduced over every replica of the
        job, one collective per bucket. Every replica must call it alike. ``options.weights``,
        if given, is ``[this replica's weight]``."""
        if tf.executing_eagerly():
            raise RuntimeError("tfdp's replica-context all-reduce runs inside tf.function only "
                               "(replica functions run one after another in eager mode, so "
                               "collectives would wait for each other forever).")
        reduce_op = pipeline.as_reduce_op(reduce_op)
        collectives = self.prepare_replica_context()
        device = collectives.devices[replica_id]
        flat = tf.nest.flatten(value)
        with tf.device(device):
            flat = [tf.convert_to_tensor(v) for v in flat]
            if any(v.shape.num_elements() is None for v in flat):
                raise ValueError("tfdp replica-context all-reduce needs static shapes; received "
                                 f"shapes {[v.shape for v in flat]}.")
        weights = weights_of(options)

        def stage(bufs, devs, finish):
            del devs
            return [finish(collectives.collective(bufs[0], replica_id), 0)]

        reduced, _ = pipeline.all_reduce_dense(
            [[v] for v in flat], [device], reduce_op, stage, group_size=collectives.group_size,
            bucket_bytes=self.bucket_bytes, compression=self.compression, weights=weights)
        return tf.nest.pack_sequence_as(value, [r[0] for r in reduced])

    # --- the one cross-replica path -----------------------------------------------------------

    def all_reduce(self, reduce_op, values, options=None):
        """All-reduce a list of DistributedValues (one component per local device, in replica
        order) over every replica of the job; returns Mirrored values, in order.

        ``options`` (``ReduceOptions``): per-local-replica ``weights`` multiplying each
        replica's float values first; ``densify_ok`` for IndexedSlices. MEAN divides by the
        job's replica count.
        """
        reduce_op = pipeline.as_reduce_op(reduce_op)
        weights, densify_ok = weights_of(options), densify_ok_of(options)
        self.traced_batch_reductions += 1
        comps_of = [list(v.values) if tfp.is_distributed_values(v) else [v] for v in values]
        # (in one process the values' own devices: a value TF wrapped from one tensor has one)
        devices = (list(tfp.devices_of(values[0])) if self.cross_worker is None
                   else list(self.devices))
        n_local = len(devices)
        n = n_local * self.num_workers
        if n == 1 and weights is None and self.compression is None:
            # One replica: the sum is the value. No buckets (their concat and split copied every
            # small gradient once per step: measured with tfdp bench overhead).
            self.last_plan = []
            return [tfp.mirrored([c[0]]) for c in comps_of]
        results = [None] * len(values)
        dense = [i for i, c in enumerate(comps_of) if not isinstance(c[0], tf.IndexedSlices)]
        for i, comps in enumerate(comps_of):
            if isinstance(comps[0], tf.IndexedSlices):
                results[i] = tfp.mirrored(self._reduce_slices(comps, devices, reduce_op,
                                                              weights, densify_ok))
        reduced, self.last_plan = pipeline.all_reduce_dense(
            [comps_of[i] for i in dense], devices, reduce_op, self._stage(n), group_size=n,
            bucket_bytes=self.packed_bucket_bytes(), compression=self.compression,
            weights=weights)
        for k, i in enumerate(dense):
            results[i] = tfp.mirrored(reduced[k])
        return results

    def _stage(self, n):
        """The bucket stage: ``stage(bufs, devices, finish) -> one reduced buffer per device``."""
        cross = self.cross_worker
        if cross is None:
            impl = algorithms.ALGORITHMS[self.algorithm]
            if n == 1:
                return lambda bufs, devs, finish: [finish(tf.identity(bufs[0]), 0)]
            return impl
        local = algorithms.ring if self.algorithm == "ring" else algorithms.tree

        def stage(bufs, devs, finish):  # each finished piece crosses the workers first
            return local(bufs, devs, lambda t, i: finish(cross.sum(t, i), i))
        return stage

    def _reduce_slices(self, comps, devices, reduce_op, weights, densify_ok):
        """IndexedSlices: all-gathered (local replicas, then workers, in rank order) or
        densified and summed, by ``tfdp.reduce.sparse``'s rule."""
        scale = (1.0 / (len(devices) * self.num_workers)) if reduce_op == MEAN else None
        if self.cross_worker is None:
            return sparse_lib.reduce_local(
                comps, weights, devices, self.sparse, scale=scale,
                dense_reduce=self._dense_sum(devices) if self.algorithm == "nccl" else None,
                densify_ok=densify_ok)
        return sparse_lib.reduce_across_workers(
            comps, weights, devices, self.num_workers, self.sparse,
            gather=lambda t: self.cross_worker.gather(t, 0),
            sum_dense=lambda t: self.cross_worker.sum(t, 0), scale=scale,
            densify_ok=densify_ok)

    def _dense_sum(self, devices):
        """Per-device dense tensors -> their sum on every device, by this reducer's algorithm."""
        impl = algorithms.ALGORITHMS[self.algorithm]
        return lambda bufs: impl(bufs, devices, lambda t, _: t)

    # --- across workers: one tensor, one collective (strategy checks, shares, zero) ------------

    def cross_worker_sum(self, t, index: int = 0):
        """Sum ``t`` (on local device ``index``) over the workers (itself in one process)."""
        return t if self.cross_worker is None else self.cross_worker.sum(t, index)

    def cross_worker_gather(self, t, index: int = 0):
        """``t`` of every worker concatenated along axis 0 (itself in one process)."""
        return t if self.cross_worker is None else self.cross_worker.gather(t, index)

    # --- replica contexts and sharded optimizer state ---------------------------------------

    def prepare_replica_context(self):
        """The replica-context collectives (made once; they create variables, so call this first
        outside any strategy scope). Needs ``devices``."""
        if self._replica is None:
            from tfdp.reduce.collective import ReplicaCollectives
            if self.devices is None:
                raise ValueError("Replica-context reduction needs the reducer's devices.")
            self._replica = ReplicaCollectives(self.devices, self.num_workers,
                                               self.timeout_seconds)
        return self._replica

    def reduce_to_owners(self, values, owners, options=None):
        """Sum each per-replica value onto its owner's device only (zero_stage=2): one result
        per value, on local device ``owners[i]`` (a tensor or IndexedSlices)."""
        return owner.reduce_to_owners(
            values, owners, list(self.devices), weights=weights_of(options),
            bucket_bytes=self.bucket_bytes,
            cross_worker_sum=None if self.cross_worker is None else self.cross_worker.sum)

    def replica_broadcast(self, comp, source: bool, replica_id: int, worker_rank: int = 0):
        """From replica ``replica_id``'s context: its copy ``comp`` of a variable takes the
        owner's value (``source``: this replica is the owner). Every replica calls it alike."""
        collectives = self.prepare_replica_context()
        return owner.replica_broadcast(collectives, comp, source, replica_id, worker_rank)


__all__ = ["COMPRESSED_BUCKET_BYTES", "Reducer", "UNCOMPRESSED_BUCKET_BYTES", "in_place"]

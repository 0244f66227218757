"""tfdp's cross-device reduction within one process: a ``tf.distribute.CrossDeviceOps``.

Every batch of values (Keras 3 all-reduces all gradients in one call) is split into dense and
sparse values. Dense values go through the bucket pipeline (``tfdp.reduce.pipeline``): planned
into buckets by dtype (``packing.plan``), small tensors packed into one flat buffer per device,
large ones reduced alone, each bucket an independent group of graph ops, so the runtime can start
a bucket as soon as its gradients exist. Each bucket is summed by one local algorithm
(``tfdp.reduce.algorithms``): ``fused`` (a tree of adds spread over the devices), ``ring``
(reduce-scatter + all-gather), ``one_device`` or ``nccl`` (TF's NCCL all-reduce on GPUs).

IndexedSlices (embedding gradients) are all-gathered as (indices, values) (a sum of IndexedSlices
is their concatenation) or densified and reduced as a dense tensor, by the measured rule of
``tfdp.reduce.sparse`` (``sparse=`` / ``TFDP_SPARSE``: "auto", "gather" or "densify").
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfdp import compat as tfp
from tfdp.reduce import algorithms, packing, pipeline
from tfdp.reduce import sparse as sparse_lib
from tfdp.reduce.registry import ALGORITHMS, validate_bucket_bytes, validate_compression

log = logging.getLogger("tfdp")

SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN


def in_place(destinations, devices) -> bool:
    """Whether an all-reduce result goes back to ``devices`` (no destinations, the same devices,
    or destinations without a device: a replica-context all_reduce of tensors built without a
    device scope passes those)."""
    if not tfp.has_destinations(destinations):
        return True
    dest = tuple(tfp.devices_of(destinations))
    return dest == tuple(devices) or all(d == "" for d in dest)


class DataParallelReduce(tf.distribute.CrossDeviceOps):
    """Bucketed, optionally compressed all-reduce over the local devices of one process.

    Args:
      algorithm: "fused", "ring", "one_device" or "nccl" (resolve "auto" with
        ``registry.choose`` first).
      bucket_bytes: capacity of a fused bucket; tensors this large or larger are reduced alone;
        0 disables fusion; None takes ``packing.DEFAULT_BUCKET_BYTES``.
      compression: None, "fp16" or "bf16": float gradients travel in that dtype.
      sparse: how IndexedSlices are reduced: "auto" (the measured rule of
        ``tfdp.reduce.sparse``), "gather" or "densify"; None reads ``TFDP_SPARSE`` (default
        "auto"). Settable later through the ``sparse`` attribute (validated).

    Attributes:
      densify_ok: set True when every sparse gradient's consumer is linear in the gradient
        (SGD, momentum SGD): only then may "auto" densify (see ``tfdp.reduce.sparse``:
        Keras's Adam/Adagrad/RMSprop treat duplicate rows of an IndexedSlices differently from a
        dense gradient). Default False: "auto" gathers.
    """

    def __init__(self, algorithm: str = "fused", bucket_bytes: int | None = None,
                 compression: str | None = None, sparse: str | None = None):
        super().__init__()
        if algorithm not in algorithms.ALGORITHMS:
            from tfdp.errors import invalid_argument
            raise invalid_argument("algorithm", algorithm, valid=[a for a in ALGORITHMS
                                                                  if a != "auto"])
        bucket_bytes = validate_bucket_bytes(bucket_bytes)
        self.algorithm = algorithm
        self.bucket_bytes = packing.DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.compression = validate_compression(compression)
        self._impl = algorithms.ALGORITHMS[algorithm]
        self.sparse = sparse
        self.densify_ok = False
        # Counted when graphs are built (each tf.function trace) - tests and stats read them.
        self.traced_batch_reductions = 0
        self.last_plan: list[packing.Bucket] = []

    @property
    def sparse(self) -> str:
        """How IndexedSlices are reduced: "auto", "gather" or "densify" (tfdp.reduce.sparse)."""
        return self._sparse

    @sparse.setter
    def sparse(self, value):
        self._sparse = sparse_lib.resolve_mode(value)

    def __repr__(self):
        return (f"DataParallelReduce(algorithm={self.algorithm!r}, "
                f"bucket_bytes={self.bucket_bytes}, compression={self.compression!r}, "
                f"sparse={self.sparse!r})")

    # --- tf.distribute.CrossDeviceOps contract -------------------------------------------------

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        del options
        reduce_op = pipeline.as_reduce_op(reduce_op)
        value_devices = tfp.devices_of(per_replica_value)
        dest = tfp.devices_of(destinations) if tfp.has_destinations(destinations) else value_devices
        if tuple(dest) == tuple(value_devices):
            return self.all_reduce(reduce_op, [per_replica_value])[0]
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
        return self.batch_reduce_weighted(reduce_op, value_destination_pairs, None)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        del options
        dest = (tfp.devices_of(destinations) if tfp.has_destinations(destinations)
                else tfp.devices_of(per_replica_value))
        with tf.device(dest[0]):
            gathered = tf.concat(list(per_replica_value.values), axis=axis)
        return self.broadcast(gathered, destinations)

    # --- tfdp ----------------------------------------------------------------------------------

    def batch_reduce_weighted(self, reduce_op, value_destination_pairs, weights):
        """batch_reduce where replica r's values are multiplied by ``weights[r]`` first."""
        reduce_op = pipeline.as_reduce_op(reduce_op)
        pairs = list(value_destination_pairs)
        if all(in_place(d, tuple(tfp.devices_of(v))) for v, d in pairs):
            return self.all_reduce(reduce_op, [v for v, _ in pairs], weights)
        if weights is not None:
            raise NotImplementedError("weighted reduction to other destinations")
        return [self.reduce_implementation(reduce_op, v, d, None) for v, d in pairs]

    def all_reduce(self, reduce_op, values, weights=None):
        """All-reduce a list of PerReplica/Mirrored values; returns Mirrored values in order.

        Args:
          reduce_op: SUM or MEAN.
          values: DistributedValues, all with components on the same devices, in replica order.
          weights: optional per-replica scalar tensors; replica r's float values are multiplied
            by ``weights[r]`` before the sum (tfdp uses it for uneven global batches).
        """
        reduce_op = pipeline.as_reduce_op(reduce_op)
        self.traced_batch_reductions += 1
        devices = list(tfp.devices_of(values[0]))
        n = len(devices)
        if n == 1 and weights is None and self.compression is None:
            # One replica: the sum is the value. No buckets (their concat and split copied every
            # small gradient once per step: measured with tfdp.bench.overhead, README "One
            # replica").
            self.last_plan = []
            return [tfp.mirrored([v.values[0]]) for v in values]
        results = [None] * len(values)
        dense = [i for i, v in enumerate(values) if not isinstance(v.values[0], tf.IndexedSlices)]
        sparse = [i for i, v in enumerate(values) if isinstance(v.values[0], tf.IndexedSlices)]

        for i in sparse:
            per_dev = sparse_lib.reduce_local(
                list(values[i].values), weights, devices, self.sparse,
                scale=(1.0 / n) if reduce_op == MEAN else None,
                dense_reduce=self._dense_sum(devices) if self.algorithm == "nccl" else None,
                densify_ok=self.densify_ok)
            results[i] = tfp.mirrored(per_dev)

        impl = self._impl

        def stage(bufs, devs, finish):
            return impl(bufs, devs, finish) if n > 1 else [finish(tf.identity(bufs[0]), 0)]

        reduced, self.last_plan = pipeline.all_reduce_dense(
            [list(values[i].values) for i in dense], devices, reduce_op, stage, group_size=n,
            bucket_bytes=self.bucket_bytes, compression=self.compression, weights=weights)
        for k, i in enumerate(dense):
            results[i] = tfp.mirrored(reduced[k])
        return results

    def _dense_sum(self, devices):
        """Per-device dense tensors -> their sum on every device, by this reducer's algorithm."""
        def reduce(bufs):
            return self._impl(bufs, devices, lambda t, _: t)
        return reduce


__all__ = ["DataParallelReduce"]

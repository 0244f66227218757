"""tfdp's cross-device reduction within one process: a ``tf.distribute.CrossDeviceOps``.

Every batch of values (Keras 3 all-reduces all gradients in one call) is split into dense and
sparse values. Dense values are planned into buckets by dtype (``packing.plan``): small tensors are
packed into one flat buffer per device, large ones are reduced alone, and each bucket is reduced
as an independent group of graph ops, so the runtime can start a bucket as soon as its gradients
exist. The reduction of one bucket is one of:

* ``fused``: a pairwise tree of adds whose levels are spread over the replicas' devices, scaled
  and cast once, then handed to every device (zero-copy between CPU devices of one process);
* ``ring``: reduce-scatter (device c sums chunk c of every buffer) then all-gather;
* ``one_device``: everything summed on the first device, then broadcast;
* ``nccl``: TF's NCCL all-reduce (``compat.nccl_all_sum``) on GPUs.

IndexedSlices (embedding gradients) are all-gathered as (indices, values) (a sum of IndexedSlices
is their concatenation) or densified and reduced as a dense tensor, by the measured rule of
``tfdp.reduce.sparse`` (``sparse=`` / ``TFDP_SPARSE``: "auto", "gather" or "densify").
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfdp import compat as tfp
from tfdp.reduce import compression as codec
from tfdp.reduce import packing
from tfdp.reduce import sparse as sparse_lib
from tfdp.reduce.registry import ALGORITHMS, validate_bucket_bytes, validate_compression

log = logging.getLogger("tfdp")

SUM = tf.distribute.ReduceOp.SUM
MEAN = tf.distribute.ReduceOp.MEAN


def _op(reduce_op):
    if isinstance(reduce_op, str):
        return tf.distribute.ReduceOp(reduce_op.upper())
    return reduce_op


def _scale(t, factor):
    if factor is None:
        return t
    if t.dtype.is_integer:
        return tf.cast(tf.cast(t, tf.float64) * factor, t.dtype)
    return t * tf.cast(factor, t.dtype)


def _broadcast(t, devices):
    out = []
    for d in devices:
        if t.device == d:
            out.append(t)
        else:
            with tf.device(d):
                out.append(tf.identity(t))
    return out


# --- algorithms: N buffers (buffer r on devices[r]) -> N reduced buffers (one per device) -------

def _one_device(bufs, devices, finish):
    with tf.device(devices[0]):
        total = finish(tf.math.add_n(bufs) if len(bufs) > 1 else tf.identity(bufs[0]))
    return _broadcast(total, devices)


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


def _tree(bufs, devices, finish):
    total = tree_sum(bufs, devices)
    with tf.device(devices[0]):
        total = finish(total if len(bufs) > 1 else tf.identity(total))
    return _broadcast(total, devices)


def _ring(bufs, devices, finish):
    n = len(bufs)
    shape = bufs[0].shape
    size = shape.num_elements()
    if n == 1 or size is None or size < n:
        return _tree(bufs, devices, finish)
    base, rem = divmod(size, n)
    sizes = [base + (1 if c < rem else 0) for c in range(n)]
    chunks = []
    for b, d in zip(bufs, devices):
        with tf.device(d):
            chunks.append(tf.split(tf.reshape(b, [-1]), sizes))
    summed = []
    for c, d in enumerate(devices):  # reduce-scatter: device c owns chunk c
        with tf.device(d):
            summed.append(finish(tf.math.add_n([chunks[r][c] for r in range(n)])))
    out = []
    for d in devices:  # all-gather
        with tf.device(d):
            out.append(tf.reshape(tf.concat(summed, 0), shape))
    return out


def _nccl(bufs, devices, finish):
    if len(bufs) == 1:
        return _tree(bufs, devices, finish)
    outs = tfp.nccl_all_sum(bufs)
    result = []
    for o, d in zip(outs, devices):
        with tf.device(d):
            result.append(finish(o))
    return result


_IMPLS = {"fused": _tree, "ring": _ring, "one_device": _one_device, "nccl": _nccl}


def _in_place(destinations, devices) -> bool:
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
        if algorithm not in _IMPLS:
            from tfdp.errors import invalid_argument
            raise invalid_argument("algorithm", algorithm, valid=[a for a in ALGORITHMS
                                                                  if a != "auto"])
        bucket_bytes = validate_bucket_bytes(bucket_bytes)
        self.algorithm = algorithm
        self.bucket_bytes = packing.DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
        self.compression = validate_compression(compression)
        self._impl = _IMPLS[algorithm]
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
        reduce_op = _op(reduce_op)
        value_devices = tfp.devices_of(per_replica_value)
        dest = tfp.devices_of(destinations) if tfp.has_destinations(destinations) else value_devices
        if tuple(dest) == tuple(value_devices):
            return self.all_reduce(reduce_op, [per_replica_value])[0]
        values = list(per_replica_value.values)
        with tf.device(dest[0]):
            if isinstance(values[0], tf.IndexedSlices):
                reduced = _gather_slices(values, None)
                if reduce_op == MEAN:
                    reduced = tf.IndexedSlices(_scale(reduced.values, 1.0 / len(values)),
                                               reduced.indices, reduced.dense_shape)
            else:
                reduced = tf.math.add_n(values) if len(values) > 1 else tf.identity(values[0])
                if reduce_op == MEAN:
                    reduced = _scale(reduced, 1.0 / len(values))
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
        reduce_op = _op(reduce_op)
        pairs = list(value_destination_pairs)
        if all(_in_place(d, tuple(tfp.devices_of(v))) for v, d in pairs):
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
        reduce_op = _op(reduce_op)
        self.traced_batch_reductions += 1
        devices = list(tfp.devices_of(values[0]))
        n = len(devices)
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

        specs = []
        for i in dense:
            t = values[i].values[0]
            specs.append((t.dtype, t.shape.num_elements(), t.dtype.size))
        plan = packing.plan(specs, self.bucket_bytes)
        self.last_plan = plan
        for bucket in plan:
            idx = [dense[k] for k in bucket.indices]
            dtype = bucket.dtype
            shapes = [values[i].values[0].shape for i in idx]
            if not bucket.fused and not shapes[0].is_fully_defined():
                shapes = None
            floating = dtype.is_floating
            compress = self.compression if floating else None
            pre_mean = reduce_op == MEAN and compress is not None
            bufs = []
            for r, d in enumerate(devices):
                with tf.device(d):
                    comps = [values[i].values[r] for i in idx]
                    buf = packing.pack(comps) if bucket.fused else comps[0]
                    factor = None
                    if weights is not None and floating:
                        factor = tf.cast(weights[r], dtype)
                    if pre_mean:
                        factor = (1.0 / n) if factor is None else factor * (1.0 / n)
                    if factor is not None:  # no_nan: an empty replica batch (weight 0) may
                        buf = tf.math.multiply_no_nan(buf, tf.cast(factor, dtype))  # give NaNs
                    bufs.append(codec.encode(buf, compress))
            post = (1.0 / n) if (reduce_op == MEAN and not pre_mean) else None

            def finish(t, dtype=dtype, post=post):
                return _scale(codec.decode(t, dtype), post)

            reduced = self._impl(bufs, devices, finish) if n > 1 else [finish(tf.identity(bufs[0]))]
            per_value = [[None] * n for _ in idx]
            for r, d in enumerate(devices):
                with tf.device(d):
                    parts = (packing.unpack(reduced[r], bucket.sizes, shapes) if bucket.fused
                             else [reduced[r]])
                for k, p in enumerate(parts):
                    per_value[k][r] = p
            for k, i in enumerate(idx):
                results[i] = tfp.mirrored(per_value[k])
        return results

    def _dense_sum(self, devices):
        """Per-device dense tensors -> their sum on every device, by this reducer's algorithm."""
        def reduce(bufs):
            return self._impl(bufs, devices, lambda t: t)
        return reduce


def _gather_slices(comps, weights):
    """Concatenate IndexedSlices from all replicas (their sum), optionally weighted."""
    vals = []
    for r, s in enumerate(comps):
        v = s.values
        if weights is not None and v.dtype.is_floating:
            v = tf.math.multiply_no_nan(v, tf.cast(weights[r], v.dtype))
        vals.append(v)
    dense_shape = comps[0].dense_shape
    return tf.IndexedSlices(tf.concat(vals, 0), tf.concat([s.indices for s in comps], 0),
                            dense_shape)

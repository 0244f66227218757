"""IndexedSlices (embedding gradients): all-gathered as (indices, values), or densified.

The sum of IndexedSlices is their concatenation, so a sparse gradient can be reduced two ways:

* ``gather``: every replica receives every replica's (indices, values): it moves the gathered
  rows, ``R * (row_bytes + index_bytes)`` with ``R`` the rows of all replicas (across workers,
  padded to the longest worker: ``W * max_w R_w``). The result stays an ``IndexedSlices``.
* ``densify``: the rows are summed into a dense ``[vocab, ...]`` tensor
  (``tf.math.unsorted_segment_sum``) and that tensor is all-reduced like any dense gradient: a
  ring moves ``2 (W-1)/W * table_bytes`` per worker, plus the cost of zero-filling and scattering
  into the table. The result is a dense tensor (Keras optimizers accept dense gradients for
  Embedding variables).

The rule (:func:`choose`): gather while ``gathered_bytes <= ratio * table_bytes``, densify
beyond, with ``ratio`` measured by ``tfdp bench sparse`` (docs/benchmarks/sparse.txt):

* within one process (CPU replicas share memory): densifying costs at least the concatenation
  the gather does, so gather is cheaper at every measured ratio (``LOCAL_GATHER_MAX_RATIO`` is
  None: always gather under "auto");
* across workers: a gather moves ``(W-1)/W`` of the gathered bytes into each worker, a ring
  all-reduce ``2 (W-1)/W`` of the table, and densifying costs about one pass over the table.
  Measured with 2 workers (docs/benchmarks/sparse_workers.txt, 25.6 and 102 MB tables): densify
  becomes cheaper beyond a ratio of 1.6-2.1 for the reduction alone, and beyond 0.7-0.8 when the
  optimizer then builds the dense gradient anyway (momentum SGD): ``WORKERS_GATHER_MAX_RATIO``
  = 1.0 lies between the two.

Exactness: a densified gradient has its duplicate ids summed before the optimizer sees it. For
optimizers linear in the gradient (SGD, SGD with momentum / Nesterov) that is the same update to
rounding (tested to 1e-5 against one device). Keras 3's Adam, Adagrad and RMSprop square an
``IndexedSlices`` gradient row by row (``ops.square`` keeps it sparse) before duplicates are
summed, so single-device Keras uses sum(g_i^2) where a dense gradient gives (sum g_i)^2: densifying
changes their update (by 5e-2 in the test model after 2 epochs). "auto" therefore densifies only
when the caller declares the consumer linear (``densify_ok=True``, e.g. the strategy for an SGD
optimizer); otherwise it gathers, which is also the measured winner within one process.

When the rule is applied (``TFDP_SPARSE=auto``, the default, with ``densify_ok``):

* locally, from static shapes when every replica's row count is known at trace time; otherwise
  with a ``tf.cond`` on the run-time row count (one process: nothing to agree on);
* across workers, always at run time on the gathered per-worker row counts, a value every worker
  holds identically after one small all-gather. Static shapes are not trusted there: two workers
  can trace with different static shapes (an uneven last batch), and a collective in a branch one
  worker skips would hang the job. The counts are needed by the padded gather anyway.

A run-time choice returns an ``IndexedSlices`` from both branches (``tf.cond`` needs one
structure): the densified branch gives ``IndexedSlices(dense, range(vocab))``. A forced
``densify`` (``TFDP_SPARSE=densify``) or a static choice returns the dense tensor itself.
"""

from __future__ import annotations

import os

from tfdp.errors import invalid_argument

MODES = ("auto", "gather", "densify")
ENV = "TFDP_SPARSE"

# Measured (docs/benchmarks/sparse.txt, tfdp bench sparse): gathered bytes / dense table bytes at
# which densifying becomes cheaper. None: never (within one process gather always won).
LOCAL_GATHER_MAX_RATIO = None
WORKERS_GATHER_MAX_RATIO = 1.0  # measured crossovers: 0.7-0.8 (+dense), 1.6-2.1 (alone)


def resolve_mode(value=None) -> str:
    """kwarg -> ``TFDP_SPARSE`` -> "auto"; validated (a clear error naming the valid modes)."""
    if value is None:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return "auto"
        if raw.lower() not in MODES:
            raise invalid_argument(ENV, raw, valid=MODES,
                                   fix="Unset it for 'auto' (the measured rule).")
        return raw.lower()
    if not isinstance(value, str) or value.lower() not in MODES:
        raise invalid_argument("sparse", value, valid=MODES)
    return value.lower()


# --- the rule (pure; unit-tested) ----------------------------------------------------------------

def gather_max_ratio(workers: int = 1):
    """Gathered bytes / table bytes up to which gathering is cheaper (None: always)."""
    return LOCAL_GATHER_MAX_RATIO if workers <= 1 else WORKERS_GATHER_MAX_RATIO


def gather_row_limit(row_elements: int, table_rows: int, dtype_bytes: int, index_bytes: int,
                     workers: int = 1, ratio=None):
    """The most gathered rows (all replicas, all workers) for which "gather" is chosen.

    Args:
      row_elements: elements per table row (the embedding dimension).
      table_rows: rows of the dense table (the vocabulary).
      dtype_bytes, index_bytes: bytes per value element and per index.
      workers: worker processes (1: one process).
      ratio: override of the measured ``gather_max_ratio(workers)``.
    Returns:
      An int, or None when gathering is always chosen.
    """
    ratio = gather_max_ratio(workers) if ratio is None else ratio
    if ratio is None:
        return None
    table_bytes = table_rows * row_elements * dtype_bytes
    return int(ratio * table_bytes // (row_elements * dtype_bytes + index_bytes))


def choose(gathered_rows: int, row_elements: int, table_rows: int, dtype_bytes: int,
           index_bytes: int = 8, workers: int = 1, ratio=None) -> str:
    """"gather" or "densify" for a sparse gradient of ``gathered_rows`` rows in total.

    Gather moves ``gathered_rows * (row_elements * dtype_bytes + index_bytes)`` bytes to every
    replica; densify all-reduces ``table_rows * row_elements * dtype_bytes`` bytes after a
    scatter into the table. Gather while the first is at most ``ratio`` times the second.
    """
    for name, v in (("gathered_rows", gathered_rows), ("row_elements", row_elements),
                    ("table_rows", table_rows), ("dtype_bytes", dtype_bytes),
                    ("index_bytes", index_bytes), ("workers", workers)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise invalid_argument(name, v, fix="Pass a non-negative int.")
    limit = gather_row_limit(row_elements, table_rows, dtype_bytes, index_bytes, workers, ratio)
    return "gather" if limit is None or gathered_rows <= limit else "densify"


# --- graph building blocks -----------------------------------------------------------------------

def _tf():
    import tensorflow as tf
    return tf


def _table_spec(s):
    """(table_rows or None, row_elements or None) from an IndexedSlices, statically."""
    tf = _tf()
    shape = tf.get_static_value(s.dense_shape)
    rows = int(shape[0]) if shape is not None else None
    row_shape = s.values.shape[1:]
    elems = row_shape.num_elements() if row_shape.is_fully_defined() else None
    return rows, elems


def _weighted(comps, weights):
    tf = _tf()
    vals = []
    for r, s in enumerate(comps):
        v = s.values
        if weights is not None and v.dtype.is_floating:
            # no_nan: an empty replica batch (weight 0) may give NaNs
            v = tf.math.multiply_no_nan(v, tf.cast(weights[r], v.dtype))
        vals.append(v)
    return vals


def _scale(t, factor):
    from tfdp.reduce.pipeline import scale  # (imports TensorFlow)
    return scale(t, factor)


def concat_local(comps, weights=None):
    """(values, indices): the replicas' slices, weighted, concatenated (on the current device)."""
    tf = _tf()
    vals = _weighted(comps, weights)
    if len(comps) == 1:
        return tf.identity(vals[0]), tf.identity(comps[0].indices)
    return tf.concat(vals, 0), tf.concat([s.indices for s in comps], 0)


def densify(values, indices, dense_shape):
    """The dense sum of rows ``values`` at ``indices`` in a table of ``dense_shape``."""
    tf = _tf()
    rows = tf.get_static_value(dense_shape)
    num = int(rows[0]) if rows is not None else dense_shape[0]
    return tf.math.unsorted_segment_sum(values, indices, num)


def _as_slices(dense, like):
    """A dense table as IndexedSlices of every row (a tf.cond branch's common structure)."""
    tf = _tf()
    n = tf.shape(dense, out_type=like.indices.dtype)[0]
    return tf.IndexedSlices(dense, tf.range(n), like.dense_shape)


def _bytes(dtype):
    return max(1, _tf().as_dtype(dtype).size)


def _static_rows(comps):
    rows = [s.values.shape[0] if s.values.shape.rank else None for s in comps]
    return None if any(r is None for r in rows) else sum(int(r) for r in rows)


def _broadcast(t, devices):
    tf = _tf()
    out = []
    for d in devices:
        with tf.device(d):
            if isinstance(t, tf.IndexedSlices):
                out.append(tf.IndexedSlices(tf.identity(t.values), tf.identity(t.indices),
                                            t.dense_shape))
            else:
                out.append(tf.identity(t))
    return out


# --- within one process --------------------------------------------------------------------------

def reduce_local(comps, weights, devices, mode, scale=None, dense_reduce=None,
                 densify_ok=False):
    """Sum (or mean, ``scale=1/n``) the replicas' IndexedSlices; one result per device.

    Args:
      comps: one ``tf.IndexedSlices`` per replica (replica r on ``devices[r]``).
      weights: None, or per-replica scalars multiplying float values first.
      devices: the replicas' devices.
      mode: "gather", "densify" or "auto" (``resolve_mode``).
      scale: None or a factor for the result (MEAN: 1/n).
      dense_reduce: optional ``f(per_device_dense) -> per_device_sum`` (the dense bucket path):
        when given, "densify" densifies on every replica and reduces with it (NCCL on GPUs);
        else the rows are concatenated on the first device and densified once there (measured
        3x faster on CPU replicas, which share memory: tfdp bench sparse).
      densify_ok: whether "auto" may densify (the consumer is linear in the gradient).
    Returns:
      A list of per-device values: IndexedSlices ("gather", or a run-time "auto" choice) or
      dense tensors ("densify", or a static "auto" choice of densify).
    """
    tf = _tf()
    proto = comps[0]
    if mode == "auto":
        mode = "gather" if gather_max_ratio(1) is None or not densify_ok else "dynamic"
        table_rows, elems = _table_spec(proto)
        static = _static_rows(comps)
        if mode == "dynamic" and None not in (table_rows, elems, static):
            mode = choose(static, elems, table_rows, _bytes(proto.values.dtype),
                          _bytes(proto.indices.dtype), workers=1)

    if mode == "densify" and dense_reduce is not None and len(devices) > 1:
        bufs = []
        for s, v, d in zip(comps, _weighted(comps, weights), devices):
            with tf.device(d):
                bufs.append(densify(_scale(v, scale), s.indices, s.dense_shape))
        return dense_reduce(bufs)

    with tf.device(devices[0]):
        values, indices = concat_local(comps, weights)
        values = _scale(values, scale)
        if mode == "gather":
            total = tf.IndexedSlices(values, indices, proto.dense_shape)
        elif mode == "densify":
            total = densify(values, indices, proto.dense_shape)
        else:  # dynamic
            total = _dynamic_local(values, indices, proto)
    return _broadcast(total, devices)


def _dynamic_local(values, indices, proto):
    tf = _tf()
    row_elems = tf.reduce_prod(tf.shape(values, out_type=tf.int64)[1:])
    table_rows = tf.cast(proto.dense_shape[0], tf.int64)
    ratio = gather_max_ratio(1)
    rows = tf.shape(values, out_type=tf.int64)[0]
    vb, ib = _bytes(values.dtype), _bytes(indices.dtype)
    gathered = tf.cast(rows * (row_elems * vb + ib), tf.float64)
    table = tf.cast(table_rows * row_elems * vb, tf.float64)
    sl = tf.IndexedSlices(values, indices, proto.dense_shape)
    return tf.cond(gathered <= ratio * table, lambda: sl,
                   lambda: _as_slices(densify(values, indices, proto.dense_shape), sl))


# --- across workers ------------------------------------------------------------------------------

def reduce_across_workers(comps, weights, devices, num_workers, mode, gather, sum_dense,
                          scale=None, densify_ok=False):
    """Sum (or mean) IndexedSlices over every replica of every worker; one result per device.

    The local replicas' slices are concatenated on ``devices[0]`` first, then:

    * "gather": each worker's row count is all-gathered, rows and indices are padded to the
      longest worker, all-gathered, and unpadded (in worker order);
    * "densify": the rows are summed into the dense table once per worker, and the tables summed
      across workers (one dense all-reduce);
    * "auto": the counts are all-gathered first (every worker then holds the same numbers), and
      a ``tf.cond`` on ``num_workers * max(counts)`` against :func:`gather_row_limit` picks one of
      the two above: the same branch on every worker, so every collective has all its peers.

    Args:
      comps: this worker's per-replica IndexedSlices (replica r on ``devices[r]``).
      weights: None or per-local-replica scalar weights (float values only).
      devices: this worker's replica devices.
      num_workers: worker processes.
      mode: "gather", "densify" or "auto".
      gather: ``f(t) -> t``: concatenation along axis 0 of ``t`` (same shape on every worker)
        over the workers in rank order (one collective on ``devices[0]``).
      sum_dense: ``f(t) -> t``: sum of ``t`` over the workers (one collective on ``devices[0]``).
      scale: None or a factor applied to the result (MEAN: 1 / global replicas).
      densify_ok: whether "auto" may densify (the consumer is linear in the gradient); if not,
        "auto" gathers.
    Returns:
      A list of per-device values (IndexedSlices, or dense tensors for a forced "densify").
    """
    tf = _tf()
    proto = comps[0]
    if mode == "auto" and not densify_ok:
        mode = "gather"
    with tf.device(devices[0]):
        values, indices = concat_local(comps, weights)
        if mode == "densify":
            total = _densify_workers(values, indices, proto, sum_dense, scale)
        else:
            counts = gather(tf.shape(values, out_type=tf.int32)[:1])
            if mode == "gather":
                total = _gather_workers(values, indices, proto, counts, gather, scale)
            else:
                total = _auto_workers(values, indices, proto, counts, num_workers, gather,
                                      sum_dense, scale)
    return _broadcast(total, devices)


def _gather_workers(values, indices, proto, counts, gather, scale):
    tf = _tf()
    longest = tf.reduce_max(counts)
    n = tf.shape(values, out_type=tf.int32)[0]
    pad_v = [[0, longest - n]] + [[0, 0]] * (values.shape.rank - 1)
    vals = gather(tf.pad(values, pad_v))
    idx = gather(tf.pad(indices, [[0, longest - n]]))
    keep = tf.reshape(tf.range(longest)[tf.newaxis, :] < counts[:, tf.newaxis], [-1])
    vals = _scale(tf.boolean_mask(vals, keep), scale)
    return tf.IndexedSlices(vals, tf.boolean_mask(idx, keep), proto.dense_shape)


def _densify_workers(values, indices, proto, sum_dense, scale):
    return _scale(sum_dense(densify(values, indices, proto.dense_shape)), scale)


def _auto_workers(values, indices, proto, counts, num_workers, gather, sum_dense, scale):
    tf = _tf()
    table_rows, elems = _table_spec(proto)
    ratio = gather_max_ratio(num_workers)
    if ratio is None:
        return _gather_workers(values, indices, proto, counts, gather, scale)
    padded = tf.cast(num_workers * tf.reduce_max(counts), tf.int64)  # what a gather moves
    vb, ib = _bytes(values.dtype), _bytes(indices.dtype)
    if table_rows is not None and elems is not None:
        pred = padded <= gather_row_limit(elems, table_rows, vb, ib, num_workers)
    else:
        row_elems = tf.reduce_prod(tf.shape(values, out_type=tf.int64)[1:])
        table = tf.cast(proto.dense_shape[0], tf.int64) * row_elems * vb
        pred = (tf.cast(padded * (row_elems * vb + ib), tf.float64)
                <= ratio * tf.cast(table, tf.float64))
    return tf.cond(
        pred, lambda: _gather_workers(values, indices, proto, counts, gather, scale),
        lambda: _as_slices(_densify_workers(values, indices, proto, sum_dense, scale),
                           tf.IndexedSlices(values, indices, proto.dense_shape)))


__all__ = ["MODES", "ENV", "LOCAL_GATHER_MAX_RATIO", "WORKERS_GATHER_MAX_RATIO", "choose",
           "gather_row_limit", "gather_max_ratio", "resolve_mode", "reduce_local",
           "reduce_across_workers", "concat_local", "densify"]

"""Global batch -> per-replica batches, the uneven tail included.

A global batch of ``m`` examples over ``P`` replicas is split into contiguous parts of
``m // P`` examples, the first ``m % P`` parts one larger: 50 over 4 replicas is 13, 13, 12, 12;
a tail of 2 over 4 is 1, 1, 0, 0 (empty batches, nothing dropped, nothing duplicated).
``tfdp.DataParallelStrategy`` weights each replica by its share, so any split gives the exact
global-batch step.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.data._context import check_input_context, local_replicas
from tfdp.data._no_alias import no_numpy_alias
from tfdp.errors import TfdpError, invalid_argument

AUTOTUNE = tf.data.AUTOTUNE


def _check_positive_int(name: str, value, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid_argument(name, value, fix=fix)
    return value


def replica_batch_sizes(batch_size: int, num_replicas: int) -> list[int]:
    """Sizes of the ``num_replicas`` parts of a batch of ``batch_size``: as even as possible.

    ``replica_batch_sizes(50, 4) == [13, 13, 12, 12]``;
    ``replica_batch_sizes(2, 4) == [1, 1, 0, 0]``.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise invalid_argument("batch_size", batch_size, fix="Pass an int >= 0.")
    _check_positive_int("num_replicas", num_replicas, "Pass a positive int.")
    base, extra = divmod(batch_size, num_replicas)
    return [base + (1 if r < extra else 0) for r in range(num_replicas)]


def check_global_batch_size(global_batch_size, num_replicas: int, empty_ok: bool = False) -> int:
    """Validate a global batch size for ``num_replicas`` replicas (at least one example each,
    unless ``empty_ok``: a global batch split by tfdp may leave replicas empty, which the
    strategy trains exactly)."""
    _check_positive_int(
        "global_batch_size", global_batch_size,
        "Pass a positive int: the number of examples in one training step across all replicas.")
    if global_batch_size < num_replicas and not empty_ok:
        raise TfdpError(
            f"The global batch is smaller than the number of replicas, so some replicas would "
            f"never get an example. Received: global_batch_size={global_batch_size} with "
            f"num_replicas_in_sync={num_replicas}. Use a global batch of at least "
            f"{num_replicas} (the global batch is split across all replicas), or fewer replicas.")
    return global_batch_size


def per_replica_batch_size(global_batch_size: int, input_context) -> int:
    """The batch of each replica when ``global_batch_size`` splits evenly (as TF's InputContext).

    Raises:
      TfdpError: the global batch is smaller than the replica count or does not divide evenly
        (``tfdp.data.distribute(..., global_batch_size=...)`` handles uneven splits exactly).
    """
    ctx = check_input_context(input_context)
    replicas = ctx.num_replicas_in_sync
    check_global_batch_size(global_batch_size, replicas)
    if global_batch_size % replicas:
        raise TfdpError(
            f"The global batch does not split evenly across the replicas. Received: "
            f"global_batch_size={global_batch_size} with num_replicas_in_sync={replicas} "
            f"(per-replica sizes would be {_sizes_text(global_batch_size, replicas)}). Use a "
            f"multiple of {replicas}, or let tfdp.data.distribute(strategy, dataset, "
            f"global_batch_size={global_batch_size}) split it unevenly and exactly "
            "(see tfdp.data.replica_batch_sizes).")
    return global_batch_size // replicas


def worker_batch_size(global_batch_size: int, input_context, empty_ok: bool = False) -> int:
    """This worker's share of each global batch: the sum of its local replicas' parts
    (``empty_ok``: with one worker, a global batch smaller than the replica count is allowed)."""
    ctx = check_input_context(input_context)
    check_global_batch_size(global_batch_size, ctx.num_replicas_in_sync,
                            empty_ok=empty_ok and ctx.num_input_pipelines == 1)
    first, count = local_replicas(ctx)
    sizes = replica_batch_sizes(global_batch_size, ctx.num_replicas_in_sync)
    return sum(sizes[first:first + count])


def _sizes_text(batch_size: int, replicas: int) -> str:
    sizes = replica_batch_sizes(batch_size, replicas)
    return ",".join(map(str, sizes)) if len(sizes) <= 8 else ",".join(map(str, sizes[:8])) + ",..."


# --- in-graph splitting --------------------------------------------------------------------------

def as_element(args):
    """A tf.data function's positional arguments back to the dataset element."""
    return args[0] if len(args) == 1 else args


def leading_dim(element):
    """The batch size (leading dimension) of a batched element, as a scalar int32 tensor."""
    first = tf.nest.flatten(element, expand_composites=False)[0]
    if isinstance(first, tf.RaggedTensor):
        return tf.cast(first.nrows(), tf.int32)
    if isinstance(first, tf.SparseTensor):
        return tf.cast(first.dense_shape[0], tf.int32)
    return tf.shape(first)[0]


def _slice(t, start, size, static_size):
    if isinstance(t, tf.SparseTensor):
        start64, size64 = tf.cast(start, tf.int64), tf.cast(size, tf.int64)
        rest = t.dense_shape[1:]
        return tf.sparse.slice(t, tf.concat([[start64], tf.zeros_like(rest)], 0),
                               tf.concat([[size64], rest], 0))
    part = t[start:start + size]
    if static_size is not None and isinstance(part, tf.Tensor):
        part = tf.ensure_shape(part, [static_size] + t.shape.as_list()[1:])
    return part


def _part(element, part_index, num_parts: int, static_size):
    """Part ``part_index`` of ``num_parts`` of a batched element (see module docstring)."""
    m = leading_dim(element)
    j = tf.cast(part_index, tf.int32)
    base, extra = m // num_parts, m % num_parts
    start = j * base + tf.minimum(j, extra)
    size = base + tf.cast(j < extra, tf.int32)
    return tf.nest.map_structure(lambda t: _slice(t, start, size, static_size), element)


def _static_batch(dataset) -> int | None:
    flat = tf.nest.flatten(dataset.element_spec)
    if not flat or not isinstance(flat[0], tf.TensorSpec) or flat[0].shape.rank in (None, 0):
        return None
    return flat[0].shape[0]


def split_parts(dataset: tf.data.Dataset, num_parts: int, first: int = 0,
                count: int | None = None) -> tf.data.Dataset:
    """Split each batch of ``dataset`` into ``num_parts`` parts; emit parts ``first`` .. ``+count``.

    Each input batch becomes ``count`` consecutive elements (possibly empty ones), in part order:
    exactly what a worker's dataset must yield for its local replicas, which TF hands out
    round-robin (element ``k`` of a step to local replica ``k``).
    """
    count = num_parts - first if count is None else count
    batch = _static_batch(dataset)
    static_size = batch // num_parts if batch is not None and batch % num_parts == 0 else None

    if count == 1:  # keeps the cardinality known
        return dataset.map(lambda *a: _part(as_element(a), first, num_parts, static_size),
                           num_parallel_calls=AUTOTUNE, deterministic=True)

    def parts(*args):
        element = as_element(args)
        return tf.data.Dataset.range(first, first + count).map(
            lambda j: _part(element, j, num_parts, static_size))

    return dataset.flat_map(parts)


def split_batches(dataset: tf.data.Dataset, input_context, *,
                  worker_local: bool = False, empty_ok: bool = False) -> tf.data.Dataset:
    """A dataset of batches -> this worker's per-replica batches (its local replicas, in order).

    Args:
      dataset: batched. By default its elements are *global* batches, identical (same order) on
        every worker; each worker keeps its local replicas' parts of each global batch (data
        sharding: every worker reads everything). With ``worker_local=True`` the elements are
        already this worker's own batches and are split across its local replicas.
      input_context: a ``tf.distribute.InputContext``.

    Returns:
      A dataset yielding ``num_replicas_in_sync // num_input_pipelines`` elements per input batch.
    """
    dataset = no_numpy_alias(dataset)  # its split slices the batches (see that module)
    ctx = check_input_context(input_context)
    first, count = local_replicas(ctx)
    batch = _static_batch(dataset)
    if batch is not None and not empty_ok:   # (empty_ok: empty replicas, trained exactly)
        need = count if worker_local else ctx.num_replicas_in_sync
        if batch < need:
            what = "worker" if worker_local else "global"
            raise TfdpError(
                f"The {what} batch is smaller than the number of replicas it feeds. Received: "
                f"batches of {batch} with {need} replica(s) to feed (num_replicas_in_sync="
                f"{ctx.num_replicas_in_sync}, num_input_pipelines={ctx.num_input_pipelines}). "
                f"Batch with at least {need} examples.")
    if worker_local:
        return split_parts(dataset, count)
    return split_parts(dataset, ctx.num_replicas_in_sync, first, count)

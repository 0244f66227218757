"""``distribute`` and ``worker_dataset``: a dataset or file list -> per-worker, per-replica input.

``worker_dataset(source, input_context, ...)`` builds what one worker feeds its local replicas:
``local = num_replicas_in_sync // num_input_pipelines`` per-replica batches per training step, in
local-replica order. ``distribute(strategy, source, ...)`` runs it on every worker through
``strategy.distribute_datasets_from_function``, so the same call works for one worker with N
devices and for M workers (each gets its own ``InputContext``).

Pipeline of one epoch ``e`` (stages in this order)::

    source -> [shard files] -> [shuffle(seed, e)] -> [skip start_step steps] -> batch
           -> split into per-replica parts (keep this worker's) -> [parse_fn] -> prefetch

Exactly once: every example of an epoch goes to exactly one replica once; the tail that does
not fill a global batch is split too (some replicas may get an empty batch) unless
``drop_remainder=True``. The pipeline is forced deterministic, so every worker sees the same
order (data sharding relies on it) and a restart reproduces it.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from tfdp.data import batching, sharding
from tfdp.data import shuffle as shuffle_lib
from tfdp.data._context import check_input_context, local_replicas
from tfdp.errors import TfdpError, invalid_argument

AUTOTUNE = tf.data.AUTOTUNE
DEFAULT_SHUFFLE_BUFFER = 10_000
_MAX_READ_PARALLELISM = 8


def _is_file_list(source) -> bool:
    return (isinstance(source, (list, tuple)) and len(source) > 0
            and all(isinstance(f, (str, os.PathLike)) for f in source))


def _check_source(source):
    if isinstance(source, tf.data.Dataset):
        return "dataset"
    if _is_file_list(source) or (isinstance(source, (list, tuple)) and not source):
        return "files"
    if isinstance(source, (str, bytes, os.PathLike)):
        raise invalid_argument(
            "source", source, what="Invalid source: a single path or pattern, not a file list",
            fix="Pass a list of TFRecord file paths, e.g. "
                "sorted(tf.io.gfile.glob('data/*.tfrecord')), or a tf.data.Dataset.")
    raise invalid_argument(
        "source", source if not callable(source) else f"<function {source!r}>",
        fix="Pass a tf.data.Dataset (unbatched with global_batch_size=..., or already batched "
            "with global batches), a list of TFRecord file paths, or (to tfdp.data.distribute "
            "only) a function input_context -> tf.data.Dataset.")


def _parse_callable(parse_fn):
    if parse_fn is None:
        return None
    if isinstance(parse_fn, dict):
        spec = parse_fn
        return lambda records: tf.io.parse_example(records, spec)
    if not callable(parse_fn):
        raise invalid_argument("parse_fn", parse_fn, fix="Pass a function applied to each "
                               "per-replica batch, or a dict of tf.io feature specs (parsed "
                               "with tf.io.parse_example).")
    return parse_fn


def _check_nonneg(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise invalid_argument(name, value, fix="Pass an int >= 0.")
    return value


def _read_files(paths: list[str], seed, epoch, reader):
    files = tf.constant(paths, tf.string)
    if seed is not None:
        files = shuffle_lib.shuffle_files(files, seed, epoch)
    ds = tf.data.Dataset.from_tensor_slices(files)
    cycle = min(len(paths), _MAX_READ_PARALLELISM)
    if cycle == 1:
        return ds.flat_map(reader)
    return ds.interleave(reader, cycle_length=cycle, block_length=1, num_parallel_calls=AUTOTUNE,
                         deterministic=True)


def worker_dataset(source, input_context, *, global_batch_size: int | None = None,
                   shard: str = "auto", parse_fn=None, shuffle_seed: int | None = None,
                   shuffle_buffer: int = DEFAULT_SHUFFLE_BUFFER, epoch: int = 0,
                   epochs: int | None = 1, start_step: int = 0, drop_remainder: bool = False,
                   reader=None, prefetch: int | None = AUTOTUNE,
                   empty_replicas: bool = False) -> tf.data.Dataset:
    """One worker's input: its local replicas' per-replica batches, ``local`` per step.

    Args:
      source: a ``tf.data.Dataset`` of examples (with ``global_batch_size``) or of global batches
        (without), or a list of TFRecord files (``global_batch_size`` required). With data
        sharding the dataset must produce the same elements in the same order on every worker.
      input_context: this worker's ``tf.distribute.InputContext``.
      global_batch_size: examples per training step across all replicas and workers; None means
        ``source`` is already batched with global batches.
      shard: "auto" | "data" | "files" | "off" (see ``tfdp.data.sharding``).
      parse_fn: applied to each per-replica batch after the split (so each worker parses only its
        share): a function, or a dict of ``tf.io`` feature specs for ``tf.io.parse_example``.
      shuffle_seed: None (keep the order) or an int: the order of each epoch depends only on
        ``(shuffle_seed, epoch)`` (stateless; the global TF seed plays no part).
      shuffle_buffer: shuffle window in examples (the dataset size gives a full shuffle).
      epoch: the (first) epoch this dataset covers; picks the shuffle order.
      epochs: how many consecutive epochs, each reshuffled (None: forever). With
        ``epochs > 1`` give Keras ``steps_per_epoch`` (see :func:`steps_per_epoch`).
      start_step: resume: skip the first ``start_step`` training steps of the first epoch.
      drop_remainder: drop the last, partial batch of every epoch instead of splitting it.
      reader: for files: ``path -> tf.data.Dataset`` of records (default ``TFRecordDataset``).
      prefetch: ``tf.data`` prefetch depth (default AUTOTUNE); 0 or None disables it.
      empty_replicas: allow a global batch smaller than the number of replicas (data sharding,
        or files with one worker): some replicas then get an empty batch in every step, which
        the strategy trains exactly (they only idle). Default: refused, as a likely mistake.
    """
    ctx = check_input_context(input_context)
    kind = _check_source(source)
    sharding.check_shard(shard)
    _check_nonneg("epoch", epoch)
    _check_nonneg("start_step", start_step)
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int)
                               or epochs < 1):
        raise invalid_argument("epochs", epochs, fix="Pass an int >= 1, or None for forever.")
    if shuffle_seed is not None:
        shuffle_lib.check_seed(shuffle_seed)
    if not isinstance(drop_remainder, (bool, np.bool_)):
        raise invalid_argument("drop_remainder", drop_remainder, fix="Pass True or False.")
    if reader is not None and not callable(reader):
        raise invalid_argument("reader", reader, fix="Pass a function path -> tf.data.Dataset of "
                               "records (e.g. tf.data.TFRecordDataset), or None for TFRecords.")
    if prefetch is not None and (isinstance(prefetch, bool) or not isinstance(prefetch, int)
                                 or prefetch < AUTOTUNE):
        raise invalid_argument("prefetch", prefetch, fix="Pass an int >= 0 (elements to "
                               "prefetch; 0 turns prefetching off), tf.data.AUTOTUNE (the "
                               "default) or None.")
    parse = _parse_callable(parse_fn)
    workers, replicas = ctx.num_input_pipelines, ctx.num_replicas_in_sync

    files = sharding.check_files(source) if kind == "files" else None
    mode = sharding.resolve_shard(shard, num_workers=workers,
                                  num_files=None if files is None else len(files))
    if kind == "files" and global_batch_size is None:
        raise TfdpError("A file list needs global_batch_size. Received: global_batch_size=None "
                        "with a list of files. Pass global_batch_size=<examples per step across "
                        "all replicas>.")
    if kind == "dataset" and int(source.cardinality()) == 0:
        raise TfdpError("The dataset is empty. Received: a tf.data.Dataset with cardinality 0. "
                        "Check the data source, filters and take()/skip() counts; an empty "
                        "dataset would give an epoch of zero steps (or a worker with no data).")
    worker_local = mode in ("files", "off")
    if global_batch_size is None:
        if shuffle_seed is not None:
            raise TfdpError(
                "Cannot shuffle examples of an already batched dataset. Received: shuffle_seed="
                f"{shuffle_seed} with global_batch_size=None. Pass the unbatched dataset with "
                "global_batch_size=... (tfdp shuffles, then batches), or shuffle before batching.")
        batch = None
    else:
        batching.check_global_batch_size(global_batch_size, replicas,
                                         empty_ok=empty_replicas is True and not (
                                             worker_local and ctx.num_input_pipelines > 1))
        batch = batching.worker_batch_size(global_batch_size, ctx, empty_replicas is True) \
            if worker_local else global_batch_size
    if mode == "files":
        paths = sharding.shard_files(files, ctx)
        if all(tf.io.gfile.stat(p).length == 0 for p in paths):
            raise TfdpError(
                f"Worker {ctx.input_pipeline_id}'s files are all empty, so it has no data. "
                f"Received: {len(paths)} empty file(s) {paths[:3]} of {len(files)} for "
                f"num_workers={workers}. Use shard=\"data\", or spread the data over the files.")
    else:
        paths = files
    read = reader or (lambda path: tf.data.TFRecordDataset(path))

    def one_epoch(e):
        stream = _read_files(paths, shuffle_seed, e, read) if kind == "files" else source
        if shuffle_seed is not None and batch is not None and shuffle_lib.fixed_shapes(stream):
            stream = shuffle_lib.shuffle(stream, shuffle_seed, e, shuffle_buffer, windows=True)
            stream = stream.rebatch(batch, drop_remainder=drop_remainder)
        else:
            if shuffle_seed is not None:
                stream = shuffle_lib.shuffle(stream, shuffle_seed, e, shuffle_buffer)
            if batch is not None:
                stream = stream.batch(batch, drop_remainder=drop_remainder)
        if start_step:  # whole steps: global batches (data) or this worker's batches
            stream = stream.skip(start_step if isinstance(e, int) else
                                 tf.where(tf.equal(e, epoch), tf.constant(start_step, tf.int64),
                                          tf.constant(0, tf.int64)))
        return stream

    if epochs == 1:
        ds = one_epoch(epoch)
    else:
        epoch_ids = (tf.data.Dataset.counter(epoch) if epochs is None
                     else tf.data.Dataset.range(epoch, epoch + epochs))
        ds = epoch_ids.flat_map(one_epoch)
    ds = batching.split_batches(ds, ctx, worker_local=worker_local,
                                empty_ok=empty_replicas is True)
    if parse is not None:
        ds = ds.map(lambda *a: parse(batching.as_element(a)), num_parallel_calls=AUTOTUNE,
                    deterministic=True)
    options = tf.data.Options()
    options.deterministic = True
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = ds.with_options(options)
    if prefetch:
        ds = ds.prefetch(prefetch)
    return ds


def _unknown_cardinality_if_several_local(ds, input_context):
    # TF's DistributedDatasetsFromFunction reports the worker dataset's cardinality (elements) as
    # the number of steps, but each step takes one element per local replica; Keras would then
    # expect `local` times too many steps. Unknown cardinality makes Keras run to the end instead.
    _, local = local_replicas(input_context)
    if local > 1 and int(ds.cardinality()) >= 0:
        ds = ds.filter(lambda *_: True)
    return ds


def distribute(strategy, source, *, options=None, **kwargs):
    """A ``tf.distribute`` distributed dataset of ``source`` for ``strategy``'s replicas.

    ``source`` is a ``tf.data.Dataset``, a list of TFRecord files, or a function
    ``input_context -> tf.data.Dataset`` with TF's contract (it returns this worker's
    per-replica batches, e.g. batched with ``tfdp.data.per_replica_batch_size``); with a function
    no other keyword may be given. Other keywords are those of :func:`worker_dataset`.
    ``options`` is passed to ``strategy.distribute_datasets_from_function``.

    The result works in ``model.fit`` and in ``for batch in ...: strategy.run(step, (batch,))``.

    Example::

        dist = tfdp.data.distribute(strategy, files, global_batch_size=1024,
                                    parse_fn=tfdp.data.INTERACTION_FEATURES, shuffle_seed=7,
                                    epoch=epoch)
    """
    if not isinstance(strategy, tf.distribute.Strategy):
        raise invalid_argument("strategy", strategy, fix="Pass a tf.distribute.Strategy, e.g. "
                               "tfdp.DataParallelStrategy().")
    if callable(source) and not isinstance(source, tf.data.Dataset):
        if kwargs:
            raise TfdpError(
                "A dataset function builds its own per-replica pipeline, so the other options do "
                f"not apply. Received: a function with {sorted(kwargs)}. Drop them (shard, batch "
                "and shuffle inside the function), or pass a dataset or file list instead.")
        user_fn = source

        def fn(input_context):
            ds = user_fn(input_context)
            if not isinstance(ds, tf.data.Dataset):
                raise invalid_argument(
                    "source", ds, what="The dataset function did not return a tf.data.Dataset",
                    fix="Return this worker's per-replica-batched tf.data.Dataset.")
            return _unknown_cardinality_if_several_local(ds, input_context).prefetch(AUTOTUNE)
    else:
        _check_source(source)
        for key in kwargs:
            if key not in _WORKER_KWARGS:
                raise invalid_argument(key, kwargs[key], what=f"Unknown argument {key!r}",
                                       valid=_WORKER_KWARGS)

        def fn(input_context):
            ds = worker_dataset(source, input_context, **kwargs)
            return _unknown_cardinality_if_several_local(ds, input_context)
    from tfdp.data._iterators import for_strategy
    return for_strategy(strategy, strategy.distribute_datasets_from_function(fn, options))


_WORKER_KWARGS = ("global_batch_size", "shard", "parse_fn", "shuffle_seed", "shuffle_buffer",
                  "epoch", "epochs", "start_step", "drop_remainder", "reader", "prefetch",
                  "empty_replicas")


def skip_to(dataset: tf.data.Dataset, step: int, input_context=None) -> tf.data.Dataset:
    """Skip the first ``step`` training steps of ``dataset`` (resume in the middle of an epoch).

    For a dataset of global batches (``input_context=None``) a step is one element; for a
    :func:`worker_dataset` it is one element per local replica. Prefer ``start_step=`` of
    :func:`worker_dataset` / :func:`distribute`, which skips examples before batching.
    """
    _check_nonneg("step", step)
    local = 1 if input_context is None else local_replicas(input_context)[1]
    return dataset.skip(step * local)


def steps_per_epoch(num_examples: int, global_batch_size: int, drop_remainder: bool = False) -> int:
    """Training steps in one epoch of ``num_examples``: ceil (or floor with drop_remainder)."""
    _check_nonneg("num_examples", num_examples)
    batching._check_positive_int("global_batch_size", global_batch_size, "Pass a positive int.")
    full, rest = divmod(num_examples, global_batch_size)
    return full + (1 if rest and not drop_remainder else 0)

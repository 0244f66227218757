"""TensorFlow Datasets input wired to tfdp's sharding: ``tfds.ReadConfig(input_context=...)``.

With file sharding tfds itself gives each worker its own shard files (``ReadConfig.input_context``);
with data sharding every worker reads the whole split in the same order and keeps its slices of
each global batch. The example order is tfdp's stateless ``(seed, epoch)`` shuffle, not tfds's
file shuffle (which depends on the global TF seed).
"""

from __future__ import annotations

import dataclasses
import logging

import tensorflow as tf

from tfdp.data import pipeline, sharding
from tfdp.data._context import check_input_context
from tfdp.errors import TfdpError, invalid_argument

log = logging.getLogger("tfdp")
_FORBIDDEN = {"batch_size": "global_batch_size", "shuffle_files": "shuffle_seed",
              "with_info": "tfds.builder(name).info", "split": "split"}


def _num_split_files(tfds, name, split, data_dir) -> int | None:
    """Files behind ``split`` from the dataset's metadata, or None when unknown."""
    try:
        info = tfds.builder(name, data_dir=data_dir).info
        return len(info.splits[split].file_instructions)
    except Exception:  # unknown splits (not prepared, mocked, ...): let data sharding handle it
        return None


def load_tfds(name: str, split: str, context, *, global_batch_size: int, shard: str = "auto",
              read_config=None, data_dir=None, options=None, **kwargs):
    """``tfds.load(name, split=split)`` as per-replica input for ``context``.

    Args:
      name, split: as for ``tfds.load`` (sub-splits like ``"train[:80%]"`` work).
      context: a ``tf.distribute.Strategy`` (returns its distributed dataset) or this worker's
        ``tf.distribute.InputContext`` (returns this worker's ``tf.data.Dataset``, like
        :func:`tfdp.data.worker_dataset`).
      global_batch_size: examples per step across all replicas.
      shard: "auto" ("files" when the split has at least as many files as workers, else "data"),
        "files" (tfds shards files via ``ReadConfig(input_context=...)``), "data", or "off" (the
        split is already this worker's, e.g. ``tfds.even_splits("train", n)[rank]``).
      read_config: a ``tfds.ReadConfig`` to start from (its ``input_context`` is set by tfdp).
      data_dir: tfds data directory.
      options: ``tf.distribute.InputOptions`` (with a strategy).
      **kwargs: :func:`tfdp.data.worker_dataset` options (``parse_fn``, ``shuffle_seed``,
        ``epoch``, ``epochs``, ``start_step``, ``drop_remainder``, ...) and other ``tfds.load``
        arguments (``as_supervised``, ``decoders``, ``download``, ...).
    """
    worker_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in pipeline._WORKER_KWARGS}
    for k, use in _FORBIDDEN.items():
        if k in kwargs:
            raise invalid_argument(k, kwargs[k], what=f"load_tfds does not take {k!r}",
                                   fix=f"Use {use} instead.")
    if "reader" in worker_kwargs:
        raise invalid_argument("reader", worker_kwargs["reader"],
                               what="load_tfds does not take 'reader'",
                               fix="tfds reads its own files; pass decoders=... to tfds.load.")
    sharding.check_shard(shard)
    if isinstance(context, tf.distribute.Strategy):
        def fn(input_context):
            ds = load_tfds(name, split, input_context, global_batch_size=global_batch_size,
                           shard=shard, read_config=read_config, data_dir=data_dir,
                           **worker_kwargs, **kwargs)
            return pipeline._unknown_cardinality_if_several_local(ds, input_context)
        from tfdp.data._iterators import for_strategy
        return for_strategy(context, context.distribute_datasets_from_function(fn, options))
    ctx = check_input_context(context, name="context")

    import tensorflow_datasets as tfds  # heavy: only when used

    workers = ctx.num_input_pipelines
    mode = shard
    num_files = None
    if shard in ("auto", "files") and workers > 1:
        num_files = _num_split_files(tfds, name, split, data_dir)
    if shard == "auto":
        mode = "files" if workers == 1 or (num_files or 0) >= workers else "data"
        log.info("tfdp.data: tfds %s[%s]: %s sharding (%s file(s), %d worker(s))", name, split,
                 mode, "unknown" if num_files is None else num_files, workers)
    if mode == "files" and num_files is not None and num_files < workers:
        raise _too_few_files(name, split, num_files, workers)
    if read_config is None:
        read_config = tfds.ReadConfig()
    elif not isinstance(read_config, tfds.ReadConfig):
        raise invalid_argument("read_config", read_config, fix="Pass a tfds.ReadConfig or None.")
    read_config = dataclasses.replace(read_config,
                                      input_context=ctx if mode == "files" else None)
    try:
        ds = tfds.load(name, split=split, read_config=read_config, shuffle_files=False,
                       data_dir=data_dir, **kwargs)
    except ValueError as e:
        if mode == "files" and "shard" in str(e).lower():
            raise _too_few_files(name, split, "fewer than workers", workers) from e
        raise
    return pipeline.worker_dataset(ds, ctx, global_batch_size=global_batch_size,
                                   shard="off" if mode in ("files", "off") else "data",
                                   **worker_kwargs)


def _too_few_files(name, split, num_files, workers) -> TfdpError:
    return TfdpError(
        f"Cannot shard tfds {name!r} split {split!r} by files: it has fewer files than workers, "
        f"so some worker would get no data. Received: {num_files} file(s) for "
        f"num_workers={workers}. Use shard=\"data\" (every worker reads the split and keeps its "
        "slice of each global batch), or shard=\"off\" with a per-worker split "
        "(tfds.even_splits(split, n=num_workers)[rank]).")

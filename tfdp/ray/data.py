"""Ray Data as tfdp input: every example exactly once per epoch, the uneven last batch exact.

Ray Train hands each worker a ``ray.data.DataIterator`` (``ray.train.get_dataset_shard(name)``).
By default (``ray.train.DataConfig()``) Ray splits the dataset across the workers with
``streaming_split(equal=True)``, which gives every worker the same number of rows by *dropping*
rows, and deals blocks out dynamically (the split differs from epoch to epoch). tfdp's exact
path is instead its data sharding, as for any dataset:

* :func:`data_config` makes a ``ray.train.DataConfig`` that gives every worker the whole
  dataset in one deterministic order (``preserve_order``); then
* :func:`distribute` turns that iterator into a tf.distribute dataset through
  ``tfdp.data.distribute``: each worker keeps its replicas' parts of each global batch
  (50 over 4 replicas: 13, 13, 12, 12; the last partial batch too). Shuffling is tfdp's
  (``shuffle_seed``, ``epoch``), resuming is ``start_step``, as in ``tfdp.data``.

Every worker then reads every row (as TF's and tfdp's data sharding do); only its share is
batched for its replicas. A shard that Ray did split is still accepted (each worker batches its
own rows, ``shard="off"``); tfdp then says once that Ray's equal split may have dropped rows.
"""

from __future__ import annotations

import copy
import logging

import tensorflow as tf

from tfdp.data import pipeline
from tfdp.errors import TfdpError, invalid_argument
from tfdp.ray._require import ray_train

log = logging.getLogger("tfdp")

_READ_BATCH = 256          # rows per batch read from Ray (unbatched again before tfdp batches)
_warned_split = [False]


def data_config(execution_options=None, datasets_to_split=()):
    """A ``ray.train.DataConfig`` for :func:`distribute`: every worker gets every dataset whole,
    in one order (``preserve_order=True``), so tfdp can shard it exactly.

    Args:
      datasets_to_split: names of datasets Ray should still split across the workers its own
        way (``streaming_split(equal=True)``: rows may be dropped); default none.
      execution_options: a ``ray.data.ExecutionOptions`` to start from (default: the driver's
        ``DataContext`` options, as Ray's default); a copy with ``preserve_order=True`` is used.
    """
    train = ray_train()
    if isinstance(datasets_to_split, str) or not all(
            isinstance(n, str) for n in datasets_to_split):
        raise invalid_argument("datasets_to_split", datasets_to_split,
                               fix='Pass a list of dataset names, e.g. ["validation"], or ().')
    from ray.data import DataContext, ExecutionOptions
    if execution_options is None:   # the driver's current options (what Ray's default copies)
        execution_options = DataContext.get_current().execution_options
    elif not isinstance(execution_options, ExecutionOptions):
        raise invalid_argument("execution_options", execution_options,
                               fix="Pass a ray.data.ExecutionOptions, or None.")
    options = copy.deepcopy(execution_options)
    options.preserve_order = True
    return train.DataConfig(datasets_to_split=list(datasets_to_split), execution_options=options)


def _is_ray_split(iterator) -> bool:
    """Whether Ray split this iterator's dataset across the workers (``streaming_split``)."""
    return type(iterator).__name__ == "StreamSplitDataIterator"


def _check_iterator(shard):
    ray_train()
    import ray.data
    if isinstance(shard, ray.data.Dataset):
        return shard.iterator()
    if not isinstance(shard, ray.data.DataIterator):
        raise invalid_argument(
            "shard", shard, fix='Pass ray.train.get_dataset_shard("train") (a '
            "ray.data.DataIterator) or a ray.data.Dataset.")
    return shard


def distribute(strategy, shard, *, feature_columns, label_columns, global_batch_size: int,
               additional_columns=None, feature_type_spec=None, label_type_spec=None,
               additional_type_spec=None, read_batch_size: int = _READ_BATCH, **kwargs):
    """``tfdp.data.distribute`` of a Ray Data shard: input for ``model.fit`` under ``strategy``.

    Args:
      strategy: the ``tfdp.DataParallelStrategy()`` of this worker.
      shard: ``ray.train.get_dataset_shard("train")`` (trainer given
        ``dataset_config=tfdp.ray.data_config()``), or a ``ray.data.Dataset``.
      feature_columns, label_columns, additional_columns, *_type_spec: as Ray's ``to_tf``
        (a column name gives a tensor, a list of names a dict).
      global_batch_size: examples per training step across all replicas of all workers.
      read_batch_size: rows per batch read from Ray (a read size only: batches are formed by
        tfdp).
      **kwargs: tfdp's pipeline options: ``shuffle_seed``, ``shuffle_buffer``, ``epoch``,
        ``epochs``, ``start_step``, ``drop_remainder``, ``prefetch``.

    Returns a distributed dataset for ``model.fit`` or ``for batch in ...:
    strategy.run(...)``. Each iteration reads the Ray dataset again (one Ray execution per
    epoch).
    """
    iterator = _check_iterator(shard)
    if "shard" in kwargs or "parse_fn" in kwargs or "reader" in kwargs:
        bad = sorted(k for k in ("shard", "parse_fn", "reader") if k in kwargs)
        raise TfdpError(f"tfdp.ray.distribute chooses the sharding itself and reads rows, not "
                        f"records. Received: {bad}. Drop them (transform rows in Ray Data, "
                        "e.g. dataset.map_batches(...)).")
    if isinstance(read_batch_size, bool) or not isinstance(read_batch_size, int) \
            or read_batch_size < 1:
        raise invalid_argument("read_batch_size", read_batch_size, fix="Pass a positive int.")
    split = _is_ray_split(iterator)
    if split and not _warned_split[0]:
        _warned_split[0] = True
        log.warning(
            "tfdp.ray: Ray split this dataset across the workers (ray.train.DataConfig's "
            "streaming_split(equal=True) drops rows to give every worker as many, and the split "
            "changes between epochs): each worker batches its own rows. For every example "
            "exactly once, pass dataset_config=tfdp.ray.data_config() to the trainer.")
    rows = iterator.to_tf(feature_columns, label_columns, additional_columns=additional_columns,
                          batch_size=read_batch_size, drop_last=False,
                          feature_type_spec=feature_type_spec, label_type_spec=label_type_spec,
                          additional_type_spec=additional_type_spec)
    rows = rows.unbatch()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    rows = rows.with_options(options)
    return pipeline.distribute(strategy, rows, global_batch_size=global_batch_size,
                               shard="off" if split else "data", **kwargs)


__all__ = ["data_config", "distribute"]

"""``tfdp.data``: per-worker, per-replica input pipelines that see every example exactly once.

One call turns a dataset or a file list into input for a strategy's replicas, on one worker or
many (each worker builds its own part from its ``tf.distribute.InputContext``)::

    strategy = tfdp.DataParallelStrategy()
    files = tfdp.data.write_interactions_tfrecords("/tmp/data", num_files=8)
    dist = tfdp.data.distribute(strategy, files, global_batch_size=1024,
                                parse_fn=tfdp.data.INTERACTION_FEATURES, shuffle_seed=7, epoch=0)
    model.fit(dist)                  # or: for batch in dist: strategy.run(step, (batch,))

* Sharding (``shard=``): ``"files"`` (each worker its own files; fewer files than workers is an
  error), ``"data"`` (each worker keeps its slices of every global batch), ``"off"``, ``"auto"``.
* Batching: each global batch is split across all replicas, 50 over 4 as 13,13,12,12; the last,
  partial batch too (nothing dropped or duplicated unless ``drop_remainder=True``).
* Shuffling: stateless, from ``(shuffle_seed, epoch)`` only; ``start_step=k`` resumes an epoch.
* Prefetch (AUTOTUNE), deterministic order, parsing after the split (each worker parses only its
  share).
* ``distribute(strategy, fn)`` accepts TF's ``input_context -> dataset`` functions too;
  :func:`worker_dataset` is one worker's pipeline (for custom set-ups and tests);
  :func:`load_tfds` does the same for TensorFlow Datasets.
"""

from tfdp.data._context import local_replicas, single_worker_context
from tfdp.data.batching import (per_replica_batch_size, replica_batch_sizes, split_batches,
                                worker_batch_size)
from tfdp.data.pipeline import distribute, skip_to, steps_per_epoch, worker_dataset
from tfdp.data.sharding import SHARD_MODES, shard_files
from tfdp.data.shuffle import shuffle, shuffle_files
from tfdp.data.synthetic import INTERACTION_FEATURES, write_interactions_tfrecords
from tfdp.data.tfds_loader import load_tfds

__all__ = [
    "INTERACTION_FEATURES", "SHARD_MODES", "distribute", "load_tfds", "local_replicas",
    "per_replica_batch_size", "replica_batch_sizes", "shard_files", "shuffle", "shuffle_files",
    "single_worker_context", "skip_to", "split_batches", "steps_per_epoch", "worker_batch_size",
    "worker_dataset", "write_interactions_tfrecords",
]

"""``tfdp.ray``: tfdp inside Ray Train (``ray.train.tensorflow.TensorflowTrainer``).

Ray starts the workers and sets ``TF_CONFIG`` for each; ``tfdp.DataParallelStrategy()`` in
``train_loop_per_worker`` reads it and trains across them (in place of
``MultiWorkerMirroredStrategy``, which fails with Keras 3). Nothing else is needed for arrays or
tfdp's own input pipelines (``tfdp.data.distribute``, file sharding included). This module adds
the two Ray-specific parts:

* :func:`distribute`: a Ray Data shard (``ray.train.get_dataset_shard("train")``) as tfdp input:
  every example exactly once per epoch across workers and replicas, the uneven last batch exact.
  Give the trainer ``dataset_config=tfdp.ray.data_config()`` (every worker reads the whole
  dataset in one order and keeps its slices of each global batch; Ray's default split drops
  rows).
* :class:`BackupAndRestore`: tfdp's exact-resume backup (``tfdp.callbacks.BackupAndRestore``)
  reported to Ray as a checkpoint at every backup, and restored from
  ``ray.train.get_checkpoint()`` when Ray restarts the workers
  (``FailureConfig(max_failures=...)``): the finished run equals an uninterrupted one.

* :func:`runtime_env`: ``ray.init(runtime_env=tfdp.ray.runtime_env())`` makes every process of
  the job as quiet about TensorFlow as ``tfdp launch``'s workers (its C++ INFO/WARNING and
  load-time lines, its Python INFO lines; errors stay).

CPU replicas per worker: ``resources_per_worker={"CPU": K}`` only reserves CPUs in Ray's
scheduler; make the replicas with ``tfdp.configure_cpu_replicas(K)`` as the first line of
``train_loop_per_worker`` (or ``TFDP_CPU_REPLICAS=K`` in the workers' environment, e.g.
``RunConfig(worker_runtime_env={"env_vars": {"TFDP_CPU_REPLICAS": "K"}})``).

``import tfdp`` never imports Ray; ``tfdp.ray``'s names import it when first used (install with
``pip install "tfdp[ray]"``).
"""

from __future__ import annotations

import importlib

__all__ = ["BackupAndRestore", "data_config", "distribute", "runtime_env"]

_LAZY = {"BackupAndRestore": "tfdp.ray.checkpoint", "data_config": "tfdp.ray.data",
         "distribute": "tfdp.ray.data", "runtime_env": "tfdp.ray.quiet"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfdp.ray' has no attribute {name!r}")

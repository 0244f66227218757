"""The strategies: ``DataParallelStrategy`` (local devices; several workers when TF_CONFIG / SLURM
describe a cluster) and the worker role every tfdp component asks for.

* ``local.py``: ``DataParallelStrategy`` (a ``tf.distribute.MirroredStrategy``) and its extended.
* ``multiworker.py``: ``MultiWorkerDataParallelStrategy`` (a ``DataParallelStrategy`` and a
  ``tf.distribute.MultiWorkerMirroredStrategy``, as Keras needs for cross-worker outputs).
* ``extended.py``: the extended both share: the Keras step path (replica shares, empty
  replicas, BatchNorm sync, XLA rules, the gradient reduction the gradient path calls).
* ``api.py``: both classes as users reach them (the multi-worker one registered).
* ``settings.py``: the keyword arguments both accept, validated once.
* ``role.py``: ``worker_role(strategy)``: rank, worker count and chief, for any strategy.

Names are imported when first used, so ``import tfdp.strategy`` does not start TensorFlow.
"""

__all__ = ["DataParallelStrategy", "MultiWorkerDataParallelStrategy", "WorkerRole",
           "uneven_reduce_error", "worker_role"]

_LAZY = {"DataParallelStrategy": "tfdp.strategy.api",
         "uneven_reduce_error": "tfdp.strategy.api",
         "MultiWorkerDataParallelStrategy": "tfdp.strategy.api",
         "WorkerRole": "tfdp.strategy.role", "worker_role": "tfdp.strategy.role"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfdp.strategy' has no attribute {name!r}")

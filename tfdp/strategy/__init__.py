"""The strategies: ``DataParallelStrategy`` (local devices; several workers when TF_CONFIG / SLURM
describe a cluster) and the worker role every tfdp component asks for.

* ``local.py``: ``DataParallelStrategy`` (a ``tf.distribute.MirroredStrategy``) and its extended.
* ``multiworker.py``: ``MultiWorkerDataParallelStrategy`` (a
  ``tf.distribute.MultiWorkerMirroredStrategy``, as Keras needs for cross-worker outputs).
* ``role.py``: ``worker_role(strategy)``: rank, worker count and chief, for any strategy.
"""

from tfdp.strategy.local import DataParallelStrategy, uneven_reduce_error
from tfdp.strategy.role import WorkerRole, worker_role

__all__ = ["DataParallelStrategy", "MultiWorkerDataParallelStrategy", "WorkerRole",
           "uneven_reduce_error", "worker_role"]


def __getattr__(name):
    if name == "MultiWorkerDataParallelStrategy":
        from tfdp.strategy.multiworker import MultiWorkerDataParallelStrategy
        return MultiWorkerDataParallelStrategy
    raise AttributeError(f"module 'tfdp.strategy' has no attribute {name!r}")

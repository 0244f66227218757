"""Cross-device reduction: every reducer of tfdp, on one bucket pipeline and one key allocator.

* ``local.py``: ``DataParallelReduce``, the local strategy's reducer (one process, N devices).
* ``hierarchical.py``: ``MultiWorkerReduce``, across workers (local stage, then TF collectives).
* ``collective.py``: ``ReplicaAllReduce``, from inside a replica (Keras's gradient accumulation).
* ``sparse.py``: IndexedSlices (embedding gradients): gather or densify, by a measured rule.
* ``pipeline.py``: the bucket pipeline all dense reductions share (weight, pre-scale, encode,
  pack, stage, decode, post-scale, unpack); ``algorithms.py``: the local stages (tree, ring,
  one_device, NCCL); ``packing.py``: bucket plans; ``compression.py``: fp16 / bf16 codecs;
  ``keys.py``: group and instance keys; ``registry.py``: names, validation, "auto".

Importing ``tfdp.reduce`` (or its ``registry``, ``packing``, ``sparse``'s rule) does not start
TensorFlow; the reducers import it when first used.
"""

from tfdp.reduce.packing import DEFAULT_BUCKET_BYTES
from tfdp.reduce.registry import ALGORITHMS, COMPRESSIONS, choose

__all__ = ["ALGORITHMS", "COMPRESSIONS", "DEFAULT_BUCKET_BYTES", "DataParallelReduce",
           "MultiWorkerReduce", "ReplicaAllReduce", "choose"]

_LAZY = {"DataParallelReduce": "tfdp.reduce.local", "MultiWorkerReduce": "tfdp.reduce.hierarchical",
         "ReplicaAllReduce": "tfdp.reduce.collective"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfdp.reduce' has no attribute {name!r}")

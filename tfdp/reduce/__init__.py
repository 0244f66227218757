"""Cross-device reduction: tfdp's one reducer, built from stages on one bucket pipeline.

* ``reducer.py``: ``Reducer``, the ``tf.distribute.CrossDeviceOps`` of both strategies (one
  process, or across workers), following TF's template (``*_implementation``, ``_all_reduce``).
* ``options.py``: ``ReduceOptions``, what one call needs (per-replica weights, densify_ok).
* ``pipeline.py``: the bucket pipeline every dense reduction goes through (weight, pre-scale,
  encode, pack, stage, decode, post-scale, unpack); ``packing.py``: bucket plans;
  ``compression.py``: fp16 / bf16 codecs.
* The stages: ``algorithms.py`` (local: tree, ring, one_device, NCCL), ``cross_worker.py`` (TF
  collectives among the workers), ``collective.py`` (collectives joined from replica contexts:
  Keras's gradient accumulation).
* ``sparse.py``: IndexedSlices (embedding gradients): gather or densify, by a measured rule.
* ``owner.py``: reduce-to-owner and broadcast-from-owner (sharded optimizer state).
* ``keys.py``: group and instance keys; ``registry.py``: names, validation, "auto".

Importing ``tfdp.reduce`` (or its ``registry``, ``packing``, ``sparse``'s rule) does not start
TensorFlow; the reducer imports it when first used.
"""

from tfdp.reduce.packing import DEFAULT_BUCKET_BYTES
from tfdp.reduce.registry import ALGORITHMS, COMPRESSIONS, choose

__all__ = ["ALGORITHMS", "COMPRESSIONS", "DEFAULT_BUCKET_BYTES", "Reducer", "ReduceOptions",
           "choose"]

_LAZY = {"Reducer": "tfdp.reduce.reducer", "ReduceOptions": "tfdp.reduce.options"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfdp.reduce' has no attribute {name!r}")

"""Every private TensorFlow / Keras name tfdp relies on: the only place that touches them.

* ``tf_internals.py``: tf.distribute internals (the extended classes tfdp subclasses, values,
  devices, NCCL), the eager context (late collective start, coordination heartbeats), tf.data.
* ``keras_internals.py``: Keras 3's internals (hook points of the gradient path, the callbacks,
  the fast paths and sharded optimizer state) and ``wrap`` / ``unwrap``, the one mechanism that
  wraps them (the hook sets, and when they are in Keras: ``tfdp.keras.adapter``).
* ``iterator_internals.py``: the multi-device iterator of a distributed dataset, built with its
  per-device functions traced once (``tfdp.data._iterators``); ``iterator_release.py``: the one
  thread that drops those iterators (no TensorFlow name: a queue and a thread).
* ``names.py``: the list of every private name (imports, calls, overridden hooks, wrapped
  functions, attributes), why each is needed, and the tested version range; a test asserts each
  still exists in the installed TensorFlow / Keras, and ``import tfdp`` logs one warning under
  an untested version (from package metadata: ``import tfdp`` still imports no TensorFlow).

Before the first helper is loaded, the features tfdp cannot do without are checked against the
installed TensorFlow / Keras (``names.require``): a missing name is one line naming it, the
versions and what to install, not an ImportError from deep inside tfdp.

Whatever must differ between supported versions lives here, keyed on features (``hasattr``, a
failed import), never on version strings. ``from tfdp import compat as tfp`` gives every helper
as an attribute (``tfp.MirroredExtended``, ``tfp.wrap``, ...), loaded when first used.
"""

import importlib

_SUBMODULES = ("tfdp.compat.tf_internals", "tfdp.compat.keras_internals",
               "tfdp.compat.iterator_internals", "tfdp.compat.iterator_release")


_checked = False


_OWN_MODULES = ("names", "versions", "tf_internals", "keras_internals", "iterator_internals",
                "iterator_release")


def __getattr__(name):
    global _checked
    if not name.startswith("__") and name not in _OWN_MODULES:  # (submodules: the importer's)
        if not _checked:  # (one line, not an ImportError deep in tfdp, on an untested Keras)
            names = importlib.import_module("tfdp.compat.names")
            names.require(*names.ESSENTIAL)
            _checked = True
        for sub in _SUBMODULES:
            module = importlib.import_module(sub)
            if name in vars(module):
                value = vars(module)[name]
                globals()[name] = value
                return value
    raise AttributeError(f"module 'tfdp.compat' has no attribute {name!r}")

"""tfdp: fast, correct data-parallel training for TensorFlow / Keras 3.

Public surface: ``DataParallelStrategy``, ``set_default_strategy`` (the two-line change: a
``DataParallelStrategy`` as the program's default strategy, no ``with`` block),
``configure_cpu_replicas``, ``data`` (sharded input pipelines) and ``__version__``.
TensorFlow is imported lazily, so ``import tfdp`` followed by ``tfdp.configure_cpu_replicas(n)``
works before the TF runtime starts.

Import-time effects: one warning when the installed TensorFlow or Keras is outside the tested
range (``tfdp.compat.versions``, read from package metadata); and when ``TFDP_CPU_REPLICAS`` is
set, the host CPU is split into that many logical devices before TensorFlow's runtime starts
(now if TensorFlow is already imported, else right after it is), so a script may build datasets,
tensors and seeds before creating the strategy (``tfdp.devices.apply_cpu_replicas_env_early``).
``import tfdp`` never imports TensorFlow itself.
"""

from tfdp._version import __version__
from tfdp.devices import apply_cpu_replicas_env_early as _apply_cpu_replicas_env_early
from tfdp.compat.versions import warn_if_untested as _warn_if_untested
from tfdp.devices import configure_cpu_replicas

__all__ = ["DataParallelStrategy", "set_default_strategy", "configure_cpu_replicas", "callbacks",
           "data", "__version__"]

_apply_cpu_replicas_env_early()
_warn_if_untested()


def __getattr__(name):
    if name == "DataParallelStrategy":
        from tfdp.strategy import DataParallelStrategy
        return DataParallelStrategy
    if name == "set_default_strategy":
        from tfdp.strategy.default import set_default_strategy
        return set_default_strategy
    if name in ("callbacks", "data", "cluster", "launch", "train"):
        import importlib
        return importlib.import_module(f"tfdp.{name}")
    raise AttributeError(f"module 'tfdp' has no attribute {name!r}")

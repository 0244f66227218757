"""The strategy classes as users reach them: both, with the multi-worker one registered.

``tfdp.DataParallelStrategy`` (and ``tfdp.strategy.DataParallelStrategy``) come from here:
importing this module imports ``multiworker``, which registers ``MultiWorkerDataParallelStrategy``
with ``DataParallelStrategy`` so that ``DataParallelStrategy()`` in a cluster of several workers
returns the multi-worker form. (The local module does not import the multi-worker one, which
subclasses it: no import cycle.)
"""

from tfdp.strategy.local import DataParallelStrategy, uneven_reduce_error
from tfdp.strategy.multiworker import MultiWorkerDataParallelStrategy

__all__ = ["DataParallelStrategy", "MultiWorkerDataParallelStrategy", "uneven_reduce_error"]

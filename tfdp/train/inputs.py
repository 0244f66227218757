"""What every data source of ``tfdp train`` gives: :class:`Data` (the built-in sources of
:mod:`tfdp.train.data` and your own ``[data] builder`` function, :mod:`tfdp.train.builders`).

A module of its own so that both can name it without importing each other.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


@dataclasses.dataclass
class Data:
    name: str
    description: str
    synthetic: bool
    num_train: int
    num_eval: int
    info: dict
    # (strategy, global_batch_size, shuffle_seed) -> distributed dataset, endless, reshuffled
    train: Callable
    # (strategy, global_batch_size) -> distributed dataset, one pass
    eval: Callable
    # (batch_size) -> local tf.data.Dataset of batches, endless (baseline runs)
    local: Callable

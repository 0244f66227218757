"""``tfdp train``: the main job, from a TOML config (see ``configs/`` and ``tfdp train --keys``).

    import tfdp.train
    cfg = tfdp.train.load("configs/quickstart.toml", ["train.epochs=3"])
    result = tfdp.train.run(cfg)          # a Result: throughput, metrics, targets, ...
    print(tfdp.train.summary(result))

``load`` validates without importing TensorFlow; ``run`` does the work.
"""

from tfdp.train.cli import main
from tfdp.train.config import Config, load, validate
from tfdp.train.lr import learning_rate_at, linear_scaled_lr

__all__ = ["Config", "Result", "learning_rate_at", "linear_scaled_lr", "load", "main", "run",
           "summary", "validate"]


def __getattr__(name):
    if name in ("run", "summary", "Result"):
        from tfdp.train import runner
        return getattr(runner, name)
    raise AttributeError(f"module 'tfdp.train' has no attribute {name!r}")

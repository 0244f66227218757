"""A DLRM-style recommender, data parallel, with sparse embedding gradients.

A thin wrapper over ``configs/recommender.toml``: the same as
``tfdp train configs/recommender.toml [ARGS]``. Writes SYNTHETIC interaction logs as TFRecord
shards on first use (``~/.cache/tfdp/...``, or ``--set data.dir=DIR``); each worker reads its own
files. User and item embedding tables get IndexedSlices gradients (all-gathered, not densified).

    python examples/recommender.py                         # 4 CPU replicas, one process
    python examples/recommender.py --workers 2             # 2 workers x 2 CPU replicas
    python examples/recommender.py --tiny
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import run_config  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_config("recommender.toml", sys.argv[1:], default_workers=1))

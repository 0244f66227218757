"""Small BERT-style masked-LM pretraining, data parallel across workers with ring all-reduce.

A thin wrapper over ``configs/bert_mlm.toml``: by default (``--workers 2``) it is
``tfdp launch --workers 2 --cpu-replicas 2 -- tfdp train configs/bert_mlm.toml [ARGS]``
(``--gpus-per-worker`` instead where GPUs exist); ``--workers 1`` runs
``tfdp train configs/bert_mlm.toml [ARGS]`` in this process. SYNTHETIC text (a random Markov
chain), masked 15% BERT style; masked-token accuracy is the metric.

    python examples/bert_mlm.py                           # 2 workers x 2 CPU replicas, ring
    python examples/bert_mlm.py --workers 1               # one process, 2 CPU replicas
    python examples/bert_mlm.py --tiny
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import run_config  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_config("bert_mlm.toml", sys.argv[1:], default_workers=2))

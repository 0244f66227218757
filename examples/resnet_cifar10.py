"""ResNet on CIFAR-10, data parallel over 8 replicas (32 per replica of a 256 global batch).

A thin wrapper over ``configs/resnet_cifar10.toml``: the same as
``tfdp train configs/resnet_cifar10.toml [ARGS]``. CPU replicas here (a small ResNet on a slice
of the data, under 2 minutes on 2 cores), every local GPU where present. Uses tfds cifar10 when it
is already prepared locally, else a SYNTHETIC stand-in, labelled as such in the output.

    python examples/resnet_cifar10.py                      # the config's defaults
    python examples/resnet_cifar10.py --tiny               # a few steps (smoke test)
    python examples/resnet_cifar10.py --baseline           # + scaling efficiency vs 1 replica
    python examples/resnet_cifar10.py --workers 2          # 2 workers x 4 CPU replicas
    python examples/resnet_cifar10.py --set model.depth=56 --set data.train_examples=50000
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import run_config  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_config("resnet_cifar10.toml", sys.argv[1:], default_workers=1, cpu_replicas=4))

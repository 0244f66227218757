"""The gradient sets ``tfdp bench allreduce`` reduces (:mod:`tfdp_bench.allreduce`): ResNet-50's
gradient shapes, a deep narrow MLP's, or single tensors of given sizes. No TensorFlow.
"""

from __future__ import annotations

import math

from tfdp.errors import TfdpError
from tfdp_bench import _common

MODELS = ("resnet50", "mlp", "sizes")
DEFAULT_SIZES = ("1K", "16K", "256K", "4M", "64M")


# --- workloads -----------------------------------------------------------------------------------

def resnet50_shapes() -> list[tuple]:
    """The trainable-variable shapes of ``keras.applications.ResNet50(weights=None)``, in order.

    214 tensors, 25,583,592 float32 (Keras 3 convolutions have biases; the 161 of other
    frameworks' ResNet50 have none). Computed instead of building the model (seconds); a test
    checks it against Keras.
    """
    s = [(7, 7, 3, 64), (64,), (64,), (64,)]  # conv1 kernel, bias; bn gamma, beta
    cin = 64
    for f, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        out = 4 * f
        for b in range(blocks):
            s += [(1, 1, cin, f), (f,), (f,), (f,), (3, 3, f, f), (f,), (f,), (f,)]
            if b == 0:  # shortcut conv (0) and conv 3, then bn 0 and bn 3
                s += [(1, 1, cin, out), (out,), (1, 1, f, out), (out,)] + [(out,)] * 4
            else:
                s += [(1, 1, f, out), (out,), (out,), (out,)]
            cin = out
    return s + [(2048, 1000), (1000,)]


def mlp_shapes(layers: int = 60, width: int = 64) -> list[tuple]:
    """Gradients of ``layers`` Dense(width) layers on width-wide inputs: kernel and bias each."""
    return [(width, width), (width,)] * layers


def workloads_for(model: str, sizes=None) -> list[dict]:
    """[{"name", "shapes"}]: one workload, or one per size (bytes, rounded down to float32s)."""
    if model == "resnet50":
        return [{"name": "resnet50", "shapes": resnet50_shapes()}]
    if model == "mlp":
        return [{"name": "mlp", "shapes": mlp_shapes()}]
    if model == "sizes":
        sizes = [_common.parse_size(s) if isinstance(s, str) else int(s)
                 for s in (sizes or DEFAULT_SIZES)]
        return [{"name": _common.fmt_bytes(n), "shapes": [(max(1, n // 4),)], "size_arg": n}
                for n in sizes]
    raise TfdpError(f"Invalid model. Received: model={model!r}. Valid: {', '.join(MODELS)}.")


def _num_elements(shape) -> int:
    return int(math.prod(shape))

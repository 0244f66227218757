"""Precise BatchNorm statistics after training (``[train] precise_bn_batches``).

Keras's BatchNormalization keeps exponential moving averages of the batch statistics
(``momentum`` 0.9 in ``tfdp train``'s ResNet: the last ~10 steps weigh most) and uses them at
inference. After a short run those averages lag the weights: they still hold the statistics of
the early, very different networks. Measured on ``configs/resnet_cifar10.toml --set
train.epochs=1`` (12 steps): the trained network classifies 0.90 of its training images in
training mode (batch statistics) but 0.09 (chance) in inference mode (moving statistics), and the
test accuracy was 0.095.

The fix is the standard "precise BN" (Wu & Johnson, "Rethinking 'Batch' in BatchNorm", 2021;
pycls' ``compute_precise_bn_stats``): with the final weights fixed, run a few forward passes in
training mode over training batches of the per-replica batch size and set every BatchNorm's
moving mean and variance to the plain average of the batch statistics. Only BatchNorm layers that
train (``trainable``, no ``renorm``) are touched; nothing else changes (no optimizer step).

Runs eagerly in the strategy's cross-replica context, so every replica's copy gets the same
values; on several workers each computes the same numbers from the same (unsharded) batches.
"""

from __future__ import annotations

import keras


def batchnorm_layers(model) -> list:
    """Every trainable, non-renorm ``keras.layers.BatchNormalization`` inside ``model``."""
    out, seen, stack = [], set(), [model]
    while stack:   # public attributes only: a model's .layers, and layers held by attributes
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if (isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
                and not getattr(layer, "renorm", False)):
            out.append(layer)
        children = list(getattr(layer, "layers", None) or [])
        for value in vars(layer).values():
            values = value if isinstance(value, (list, tuple)) else [value]
            children.extend(v for v in values if isinstance(v, keras.layers.Layer))
        stack.extend(reversed(children))
    return out


def recompute(model, batches, strategy=None) -> int:
    """Set the moving statistics of ``model``'s BatchNorm layers to the average batch statistics
    over ``batches`` (an iterable of ``(x, y, ...)`` or ``x``), computed with the current weights.

    Returns the number of batches used (0 when the model has no such layer: nothing is done).
    """
    layers = batchnorm_layers(model)
    if not layers:
        return 0
    import contextlib
    saved = [layer.momentum for layer in layers]
    used = 0
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    try:
        with scope:
            for batch in batches:
                x = batch[0] if isinstance(batch, (tuple, list)) else batch
                # k-th batch with momentum k/(k+1): the moving value becomes the running mean of
                # the batch statistics (the first batch overwrites the stale average).
                for layer in layers:
                    layer.momentum = used / (used + 1.0)
                model(x, training=True)
                used += 1
    finally:
        for layer, m in zip(layers, saved):
            layer.momentum = m
    return used

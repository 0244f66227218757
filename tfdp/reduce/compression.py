"""Gradient compression codecs: cast before the all-reduce, cast back after.

A codec is two small functions, in the spirit of PyTorch DDP comm hooks. For MEAN the inputs
are pre-divided by the replica count before the cast, so a float16 sum cannot overflow where the
mean would not.
"""

from __future__ import annotations

_WIRE = {"fp16": "float16", "bf16": "bfloat16"}


def encode(t, compression, prescale=None):
    """Scale (optional) and cast ``t`` to the wire dtype of ``compression``."""
    import tensorflow as tf
    if prescale is not None:
        t = t * tf.cast(prescale, t.dtype)
    if compression is None or not t.dtype.is_floating:
        return t
    wire = tf.as_dtype(_WIRE[compression])
    if t.dtype.size <= wire.size:  # already as small: nothing to gain
        return t
    return tf.cast(t, wire)


def decode(t, dtype):
    import tensorflow as tf
    return t if t.dtype == dtype else tf.cast(t, dtype)

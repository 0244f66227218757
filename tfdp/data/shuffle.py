"""Deterministic shuffling from ``(seed, epoch)`` alone.

``tf.data.Dataset.shuffle`` mixes its seed with the global seed (``tf.random.set_seed``), so two
workers that seeded TensorFlow differently would see different orders, and data sharding would
silently drop and duplicate examples. tfdp shuffles with stateless random ops instead: the order
depends only on ``(seed, epoch)`` and the input order, on every worker and after every restart,
which also makes "resume at step k of epoch e" exact.

The shuffle is windowed: the stream is cut into windows of ``buffer_size`` consecutive elements
and each window is permuted uniformly at random (a window as large as the dataset is a perfect
shuffle). File lists are permuted as a whole.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.data.batching import as_element
from tfdp.errors import TfdpError, invalid_argument

AUTOTUNE = tf.data.AUTOTUNE
_FILES_STREAM, _ELEMENTS_STREAM = 1, 2


def check_seed(seed, name: str = "shuffle_seed") -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise invalid_argument(name, seed, fix="Pass an int in [0, 2**63), the same on every "
                                               "worker, or None for no shuffling.")
    return seed


def check_epoch(epoch, name: str = "epoch") -> int:
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        raise invalid_argument(name, epoch, fix="Pass an int >= 0 (the first epoch is 0).")
    return epoch


def epoch_key(seed: int, epoch, stream: int = _ELEMENTS_STREAM):
    """The stateless-RNG key (int64[2]) of ``(seed, epoch, stream)``; ``epoch`` may be a tensor."""
    key = tf.constant([check_seed(seed), stream], tf.int64)
    return tf.random.experimental.stateless_fold_in(key, tf.cast(epoch, tf.int64))


def shuffle_files(files, seed: int, epoch=0):
    """A permutation of the file list (a string tensor) that depends only on ``(seed, epoch)``."""
    files = tf.convert_to_tensor(files, tf.string)
    key = epoch_key(seed, epoch, _FILES_STREAM)
    return tf.random.experimental.stateless_shuffle(files, seed=key)


def fixed_shapes(dataset) -> bool:
    """Whether every component of the dataset's elements is a dense tensor of fixed shape."""
    return all(_batchable(s) for s in tf.nest.flatten(dataset.element_spec))


def _batchable(spec) -> bool:
    return isinstance(spec, tf.TensorSpec) and spec.shape.is_fully_defined()


def shuffle(dataset: tf.data.Dataset, seed: int, epoch=0, buffer_size: int = 10_000,
            *, windows: bool = False) -> tf.data.Dataset:
    """Shuffle ``dataset`` in windows of ``buffer_size``; the order depends only on (seed, epoch).

    Args:
      dataset: unbatched examples. Dense tensors of any shape (variable ones are serialized for
        the shuffle); ragged or sparse components are not supported (shuffle before creating them,
        e.g. shuffle serialized records and parse after).
      seed: an int, the same on every worker.
      epoch: the epoch (an int, or a scalar integer tensor inside a tf.data function).
      buffer_size: window size; use the dataset size for a full shuffle.
      windows: return the shuffled windows (batches of ``buffer_size``) instead of examples, for
        ``.rebatch(n)`` (cheaper than unbatching and batching again). Only for fixed shapes.
    """
    check_seed(seed)
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise invalid_argument("shuffle_buffer", buffer_size, fix="Pass a positive int (a window "
                               "of that many examples is shuffled at a time).")
    if not isinstance(epoch, tf.Tensor):
        check_epoch(epoch)
    specs = tf.nest.flatten(dataset.element_spec)
    if not all(isinstance(s, tf.TensorSpec) for s in specs):
        raise TfdpError(
            "Cannot shuffle this dataset: it has ragged or sparse components. Received: "
            f"element_spec={dataset.element_spec}. Shuffle before creating them (e.g. shuffle "
            "serialized records and parse after batching: the parse_fn of tfdp.data.distribute).")
    key = epoch_key(seed, epoch)
    structure = dataset.element_spec
    dense = all(_batchable(s) for s in specs)
    if not dense:  # variable shapes: shuffle serialized tensors, parse them back after
        dataset = dataset.map(
            lambda *a: tuple(tf.io.serialize_tensor(t) for t in tf.nest.flatten(as_element(a))),
            num_parallel_calls=AUTOTUNE, deterministic=True)

    def permute(window_index, window):
        n = tf.shape(tf.nest.flatten(window)[0])[0]
        order = tf.random.experimental.stateless_shuffle(
            tf.range(n), seed=tf.random.experimental.stateless_fold_in(key, window_index))
        return tf.nest.map_structure(lambda t: tf.gather(t, order), window)

    dataset = dataset.batch(buffer_size).enumerate().map(
        lambda i, *w: permute(i, as_element(w)), num_parallel_calls=AUTOTUNE,
        deterministic=True)
    if windows:
        if not dense:
            raise TfdpError(f"windows=True needs fixed shapes. Received: element_spec="
                            f"{structure}. Use windows=False.")
        return dataset
    dataset = dataset.unbatch()
    if not dense:
        def restore(*a):
            flat = [tf.ensure_shape(tf.io.parse_tensor(s, spec.dtype), spec.shape)
                    for s, spec in zip(a, specs)]
            return tf.nest.pack_sequence_as(structure, flat)
        dataset = dataset.map(restore, num_parallel_calls=AUTOTUNE, deterministic=True)
    return dataset

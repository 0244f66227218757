"""Synthetic recommender-style interactions in TFRecord files (tests, benchmark, examples).

Each record is a ``tf.train.Example`` with::

    id          int64    unique example index across all files (0 .. N-1)
    user_id     int64    in [0, num_users), Zipf-like popularity
    item_id     int64    in [0, num_items), Zipf-like popularity
    history     int64[8] the user's previous item ids (padded with 0)
    dense       float[4] context features (normal)
    label       float    1.0 clicked / 0.0 not, correlated with (user_id + item_id) parity

``INTERACTION_FEATURES`` is the matching ``tf.io.parse_example`` spec, so
``tfdp.data.distribute(strategy, files, global_batch_size=B, parse_fn=INTERACTION_FEATURES)``
gives dicts of per-replica tensors.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from tfdp.errors import invalid_argument

HISTORY_LEN = 8
DENSE_DIM = 4
INTERACTION_FEATURES = {
    "id": tf.io.FixedLenFeature([], tf.int64),
    "user_id": tf.io.FixedLenFeature([], tf.int64),
    "item_id": tf.io.FixedLenFeature([], tf.int64),
    "history": tf.io.FixedLenFeature([HISTORY_LEN], tf.int64),
    "dense": tf.io.FixedLenFeature([DENSE_DIM], tf.float32),
    "label": tf.io.FixedLenFeature([], tf.float32),
}


def _positive(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise invalid_argument(name, v, fix="Pass a positive int.")


def write_interactions_tfrecords(directory, num_files: int = 8, examples_per_file: int = 1000,
                                 seed: int = 0, *, num_users: int = 10_000,
                                 num_items: int = 50_000, prefix: str = "interactions"
                                 ) -> list[str]:
    """Write ``num_files`` TFRecord files of ``examples_per_file`` interactions each.

    Deterministic in ``seed``; ids run consecutively through the files (file ``k`` holds ids
    ``k * examples_per_file ..``). Returns the sorted file paths
    (``<prefix>-00000-of-00008.tfrecord`` ...). Existing files of the same names are replaced.
    """
    for name, v in (("num_files", num_files), ("examples_per_file", examples_per_file),
                    ("num_users", num_users), ("num_items", num_items)):
        _positive(name, v)
    tf.io.gfile.makedirs(os.fspath(directory))
    rng = np.random.default_rng(seed)
    paths = []
    for k in range(num_files):
        n = examples_per_file
        ids = np.arange(k * n, (k + 1) * n, dtype=np.int64)
        users = (rng.zipf(1.3, n) - 1) % num_users
        items = (rng.zipf(1.3, n) - 1) % num_items
        history = (rng.zipf(1.3, (n, HISTORY_LEN)) - 1) % num_items
        dense = rng.normal(size=(n, DENSE_DIM)).astype(np.float32)
        p = np.where((users + items) % 2 == 0, 0.7, 0.2)
        labels = (rng.random(n) < p).astype(np.float32)
        path = os.path.join(os.fspath(directory), f"{prefix}-{k:05d}-of-{num_files:05d}.tfrecord")
        with tf.io.TFRecordWriter(path) as w:
            for i in range(n):
                feats = {
                    "id": _int64([ids[i]]), "user_id": _int64([users[i]]),
                    "item_id": _int64([items[i]]), "history": _int64(history[i]),
                    "dense": tf.train.Feature(float_list=tf.train.FloatList(value=dense[i])),
                    "label": tf.train.Feature(float_list=tf.train.FloatList(value=[labels[i]])),
                }
                w.write(tf.train.Example(features=tf.train.Features(feature=feats))
                        .SerializeToString())
        paths.append(path)
    return paths


def _int64(values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[int(v) for v in values]))

"""Data sources for ``tfdp train`` (``[data] source``), fed through ``tfdp.data``'s pipelines.

* ``digits``: scikit-learn's 1,797 real 8x8 handwritten digits (ship inside the package, no
  download); a fixed held-out split.
* ``cifar10``: TensorFlow Datasets' cifar10 when it is already prepared locally (never
  downloaded here), else a SYNTHETIC stand-in of the same shape (32x32x3, 10 classes: a fixed
  blocky pattern per class plus Gaussian noise), announced as such in every summary.
* ``synthetic_text``: SYNTHETIC token sequences from a fixed random Markov chain (each token has
  three likely successors), masked BERT-style (15%: 80% [MASK], 10% random, 10% kept).
* ``interactions``: SYNTHETIC click logs written as TFRecord shards on first use
  (``tfdp.data.write_interactions_tfrecords``); each worker reads its own files.

Every source gives a :class:`~tfdp.train.inputs.Data`: distributed train / eval inputs for a strategy and a local,
non-distributed input (for the 1-replica baseline).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile

import numpy as np
import tensorflow as tf

import tfdp.data as tdata
from tfdp.errors import TfdpError, message
from tfdp.train.inputs import Data  # noqa: F401 (also tfdp.train.data.Data)

log = logging.getLogger("tfdp")

MASK_ID, FIRST_TOKEN = 1, 4          # 0 [PAD], 1 [MASK], 2 [CLS], 3 [SEP]; words from 4


def build(cfg) -> Data:
    d = cfg["data"]
    if "builder" in d:     # your own function (tfdp.train.builders)
        from tfdp.train import builders
        return builders.build_data(cfg)
    return _SOURCES[d["source"]](d, cfg["job"]["seed"])


def _from_arrays(name, description, synthetic, train_arrays, eval_arrays, info, shuffle=True):
    train_ds = tf.data.Dataset.from_tensor_slices(train_arrays)
    eval_ds = tf.data.Dataset.from_tensor_slices(eval_arrays)
    return _from_datasets(name, description, synthetic, train_ds, eval_ds,
                          len(train_arrays[0]), len(eval_arrays[0]), info, shuffle)


def _from_datasets(name, description, synthetic, train_ds, eval_ds, n_train, n_eval, info,
                   shuffle=True, parse=None):
    def train(strategy, global_batch_size, shuffle_seed):
        return tdata.distribute(strategy, train_ds, global_batch_size=global_batch_size,
                                empty_replicas=True, shuffle_seed=shuffle_seed if shuffle else None,
                                shuffle_buffer=n_train, epochs=None, parse_fn=parse)

    def evaluate(strategy, global_batch_size):
        return tdata.distribute(strategy, eval_ds, global_batch_size=global_batch_size,
                                empty_replicas=True, parse_fn=parse)

    def local(batch_size):
        ds = train_ds.repeat().batch(batch_size, drop_remainder=True)
        if parse is not None:
            ds = ds.map(parse)
        return ds.prefetch(tf.data.AUTOTUNE)

    return Data(name, description, synthetic, n_train, n_eval, info, train, evaluate, local)


# --- digits ---------------------------------------------------------------------------------------

def digits(d, seed):
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise TfdpError(message("data.source 'digits' needs scikit-learn",
                                "no module 'sklearn'",
                                'Install it: pip install -e ".[examples]"')) from None
    raw = load_digits()
    x = (raw.images[..., None] / 16.0).astype("float32")
    y = raw.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))   # a fixed split, whatever job.seed
    x, y = x[order], y[order]
    n_test = d["test_examples"]
    return _from_arrays(
        "digits", f"digits (scikit-learn, real, offline): {len(x) - n_test} train / {n_test} "
        "test images, 8x8", False, (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test]),
        {"image_shape": (8, 8, 1), "num_classes": 10})


# --- cifar10 --------------------------------------------------------------------------------------

def _cifar10_prepared(data_dir) -> bool:
    """Whether tfds cifar10 is downloaded and prepared locally (nothing is downloaded here)."""
    root = data_dir or os.environ.get("TFDS_DATA_DIR") or os.path.join(
        os.path.expanduser("~"), "tensorflow_datasets")
    if not os.path.isdir(os.path.join(os.path.expanduser(root), "cifar10")):
        return False   # (cheap: no tfds import, no warnings about missing folders)
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        return False
    try:
        return bool(tfds.builder("cifar10", data_dir=data_dir).is_prepared())
    except Exception:  # no builder / unreadable dir: not available
        return False


def _normalize_images(element):
    image, label = element
    return tf.cast(image, tf.float32) / 255.0, tf.cast(label, tf.int32)


def cifar10(d, seed):
    info = {"image_shape": (32, 32, 3), "num_classes": 10}
    n_train, n_eval = d["train_examples"], d["eval_examples"]
    prepared = d["synthetic"] != "always" and _cifar10_prepared(d["data_dir"])
    if d["synthetic"] == "never" and not prepared:
        raise TfdpError(message(
            "tfds cifar10 is not prepared locally (tfdp train never downloads)",
            f"data.synthetic='never', data_dir={d['data_dir']!r}",
            "Prepare it first (python -c \"import tensorflow_datasets as tfds; "
            "tfds.builder('cifar10').download_and_prepare()\"), or set data.synthetic = 'auto'."))
    if prepared:
        import tensorflow_datasets as tfds

        def parse(batch):
            return _normalize_images(batch)

        n_train, n_eval = min(n_train, 50_000), min(n_eval, 10_000)

        def train(strategy, global_batch_size, shuffle_seed):
            return tdata.load_tfds("cifar10", f"train[:{n_train}]", strategy,
                                   global_batch_size=global_batch_size, as_supervised=True,
                                   empty_replicas=True, data_dir=d["data_dir"],
                                   shuffle_seed=shuffle_seed, shuffle_buffer=n_train, epochs=None,
                                   parse_fn=parse)

        def evaluate(strategy, global_batch_size):
            return tdata.load_tfds("cifar10", f"test[:{n_eval}]", strategy,
                                   global_batch_size=global_batch_size, as_supervised=True,
                                   empty_replicas=True, data_dir=d["data_dir"], shard="data",
                                   parse_fn=parse)

        def local(batch_size):
            ds = tfds.load("cifar10", split=f"train[:{n_train}]", as_supervised=True,
                           data_dir=d["data_dir"])
            return ds.repeat().batch(batch_size, drop_remainder=True).map(
                lambda x, y: _normalize_images((x, y))).prefetch(tf.data.AUTOTUNE)

        return Data("cifar10", f"cifar10 (tfds, real): {n_train} train / {n_eval} test images, "
                    "32x32x3", False, n_train, n_eval, info, train, evaluate, local)

    # the SYNTHETIC stand-in: example i is a function of (seed, i) only (no state, no memory)
    rng = np.random.default_rng(seed + 1234)
    templates = tf.constant(np.kron(rng.normal(size=(10, 4, 4, 3)),
                                    np.ones((1, 8, 8, 1))).astype("float32"))

    def make(i):
        label = tf.random.stateless_uniform([], [seed, i], 0, 10, dtype=tf.int32)
        noise = tf.random.stateless_normal([32, 32, 3], [seed + 1, i], stddev=1.0)
        return tf.gather(templates, label) + noise, label

    train_ds = tf.data.Dataset.range(n_train).map(make)
    eval_ds = tf.data.Dataset.range(n_train, n_train + n_eval).map(make)
    why = "synthetic='always'" if d["synthetic"] == "always" else \
        "tfds cifar10 is not prepared locally"
    return _from_datasets(
        "cifar10-SYNTHETIC", f"SYNTHETIC cifar10 stand-in ({why}): {n_train} train / {n_eval} "
        "eval random 32x32x3 images, 10 classes (a fixed pattern per class + noise); accuracy "
        "on it says nothing about CIFAR-10", True, train_ds, eval_ds, n_train, n_eval, info,
        shuffle=False)  # i.i.d. by construction: shuffling adds nothing


# --- synthetic text (masked LM) -------------------------------------------------------------

def _markov_corpus(n, seq_len, vocab, seed):
    rng = np.random.default_rng(seed)
    words = np.arange(FIRST_TOKEN, vocab)
    succ = rng.choice(words, size=(vocab, 3))              # three likely successors per token
    probs = np.array([0.6, 0.3, 0.1])
    seqs = np.empty((n, seq_len), dtype=np.int32)
    seqs[:, 0] = rng.choice(words, size=n)
    picks = rng.choice(3, size=(n, seq_len), p=probs)
    for t in range(1, seq_len):
        seqs[:, t] = succ[seqs[:, t - 1], picks[:, t]]
    return seqs


def _mask(seqs, vocab, rate, seed):
    rng = np.random.default_rng(seed)
    masked = rng.random(seqs.shape) < rate
    masked[np.arange(len(seqs)), rng.integers(0, seqs.shape[1], len(seqs))] = True  # >= 1 each
    inputs = seqs.copy()
    r = rng.random(seqs.shape)
    inputs[masked & (r < 0.8)] = MASK_ID
    rand = masked & (r >= 0.8) & (r < 0.9)
    inputs[rand] = rng.integers(FIRST_TOKEN, vocab, rand.sum())
    return inputs, seqs.astype(np.int32), masked.astype(np.float32)


def synthetic_text(d, seed):
    vocab, seq_len = d["vocab_size"], d["seq_len"]
    n_train, n_eval = d["train_examples"], d["eval_examples"]
    seqs = _markov_corpus(n_train + n_eval, seq_len, vocab, seed)
    x, y, w = _mask(seqs, vocab, d["mask_rate"], seed + 1)
    tr = (x[:n_train], y[:n_train], w[:n_train])
    ev = (x[n_train:], y[n_train:], w[n_train:])
    return _from_arrays(
        "synthetic_text", f"SYNTHETIC text: {n_train} train / {n_eval} eval sequences of "
        f"{seq_len} tokens, vocabulary {vocab} (a random Markov chain, 3 successors per token), "
        f"{d['mask_rate']:.0%} masked", True, tr, ev,
        {"vocab_size": vocab, "seq_len": seq_len})


# --- interactions (TFRecord shards) ---------------------------------------------------------------

def _interaction_files(d, seed) -> tuple[list[str], list[str], str]:
    directory = d["dir"]
    key = (f"{d['num_files']}x{d['examples_per_file']}-e{d['eval_files']}-u{d['num_users']}"
           f"-i{d['num_items']}-s{seed}")
    if directory is None:
        directory = os.path.join(os.path.expanduser("~"), ".cache", "tfdp",
                                 "interactions-" + hashlib.sha1(key.encode()).hexdigest()[:10])
    directory = os.path.expanduser(directory)
    wanted = {"train": (d["num_files"], seed), "eval": (d["eval_files"], seed + 10_007)}
    out = {}
    for prefix, (count, s) in wanted.items():
        names = [f"{prefix}-{k:05d}-of-{count:05d}.tfrecord" for k in range(count)]
        paths = [os.path.join(directory, n) for n in names]
        stamp = os.path.join(directory, f".{prefix}-{key}.done")
        if not os.path.exists(stamp) or not all(os.path.exists(p) for p in paths):
            # Written to a private folder, then moved into place one file at a time (atomic):
            # several workers may do this at once and all write identical bytes.
            os.makedirs(directory, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=directory, prefix=".tmp-") as tmp:
                tdata.write_interactions_tfrecords(
                    tmp, num_files=count, examples_per_file=d["examples_per_file"], seed=s,
                    num_users=d["num_users"], num_items=d["num_items"], prefix=prefix)
                for n in names:
                    os.replace(os.path.join(tmp, n), os.path.join(directory, n))
            with open(stamp, "w") as f:
                f.write(key + "\n")
        out[prefix] = paths
    return out["train"], out["eval"], directory


def _parse_interactions(records):
    f = tf.io.parse_example(records, tdata.INTERACTION_FEATURES)
    x = {"user_id": f["user_id"], "item_id": f["item_id"], "history": f["history"],
         "dense_features": f["dense"]}
    return x, tf.expand_dims(f["label"], -1)


def interactions(d, seed):
    train_files, eval_files, directory = _interaction_files(d, seed)
    n_train = d["num_files"] * d["examples_per_file"]
    n_eval = d["eval_files"] * d["examples_per_file"]
    from tfdp.data.synthetic import DENSE_DIM, HISTORY_LEN
    info = {"num_users": d["num_users"], "num_items": d["num_items"],
            "history_len": HISTORY_LEN, "dense_dim": DENSE_DIM}

    def train(strategy, global_batch_size, shuffle_seed):
        return tdata.distribute(strategy, train_files, global_batch_size=global_batch_size,
                                empty_replicas=True, shard="files", parse_fn=_parse_interactions,
                                shuffle_seed=shuffle_seed, epochs=None)

    def evaluate(strategy, global_batch_size):
        return tdata.distribute(strategy, eval_files, global_batch_size=global_batch_size,
                                empty_replicas=True, shard="data", parse_fn=_parse_interactions)

    def local(batch_size):
        return (tf.data.TFRecordDataset(train_files).repeat()
                .batch(batch_size, drop_remainder=True).map(_parse_interactions)
                .prefetch(tf.data.AUTOTUNE))

    return Data("interactions", f"SYNTHETIC click logs in TFRecord shards ({directory}): "
                f"{len(train_files)} train files x {d['examples_per_file']} = {n_train} "
                f"examples (sharded by file: each worker reads its own), {n_eval} eval; "
                f"{d['num_users']} users, {d['num_items']} items", True, n_train, n_eval, info,
                train, evaluate, local)


_SOURCES = {"digits": digits, "cifar10": cifar10, "synthetic_text": synthetic_text,
            "interactions": interactions}

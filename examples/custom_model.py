"""Your own model and data in ``tfdp train``: the builders named by examples/custom_model.toml.

``[model] builder = "custom_model:build_model"`` and ``[data] builder = "custom_model:build_data"``:
``tfdp train`` imports this file (it sits next to the config), calls the functions with the
tables' other keys as keyword arguments, compiles the model with the ``[train]`` optimizer and
learning rate, trains it data parallel and checks the ``[targets]``.

    tfdp train examples/custom_model.toml
    python examples/custom_model.py --tiny          # the same, through this file

* ``build_model(hidden, dropout)`` returns ``(model, loss, metrics)`` (an uncompiled model).
* ``build_data(input_context, global_batch_size, test_examples)`` gets a
  ``tf.distribute.InputContext`` for its input pipeline and returns ``(train, eval)`` datasets
  batched PER REPLICA, each pipeline reading its own shard (``distribute_datasets_from_function``).
  A function that takes ``global_batch_size`` and no ``input_context`` returns globally batched
  datasets instead and the strategy splits them.

Data: scikit-learn's 1,797 real 8x8 handwritten digits (they ship with it: no download).
"""

import os
import sys

import keras
import numpy as np
import tensorflow as tf


def build_model(hidden: int = 64, dropout: float = 0.0):
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dropout(dropout),
        keras.layers.Dense(hidden, activation="relu"),
        keras.layers.Dense(10),
    ], name="custom_mlp")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, loss, [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def _digits(test_examples):
    from sklearn.datasets import load_digits
    raw = load_digits()
    x = (raw.images[..., None] / 16.0).astype("float32")
    y = raw.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[test_examples:], y[test_examples:]), (x[:test_examples], y[:test_examples])


def build_data(input_context: tf.distribute.InputContext, global_batch_size: int,
               test_examples: int = 360, shuffle_seed: int = 7):
    (x, y), (xt, yt) = _digits(test_examples)
    per_replica = input_context.get_per_replica_batch_size(global_batch_size)
    shard = (input_context.num_input_pipelines, input_context.input_pipeline_id)
    train = (tf.data.Dataset.from_tensor_slices((x, y)).shard(*shard)
             .shuffle(len(x), seed=shuffle_seed).batch(per_replica))
    test = tf.data.Dataset.from_tensor_slices((xt, yt)).shard(*shard).batch(per_replica)
    return train, test


if __name__ == "__main__":
    from tfdp.train.cli import cli_main
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "custom_model.toml")
    sys.exit(cli_main([config, *sys.argv[1:]]))

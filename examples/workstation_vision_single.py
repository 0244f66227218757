"""Workstation vision: a small CNN on scikit-learn's handwritten digits, on one device
(workstation_vision_single.py) or data parallel over every local GPU, else 4 CPU replicas
(workstation_vision_dp.py). The two scripts differ by exactly two lines, the import and the
strategy::

    diff examples/workstation_vision_single.py examples/workstation_vision_dp.py

Run: python examples/workstation_vision_dp.py [--epochs N] [--batch-size B]
The digits (1,797 real 8x8 images) ship inside scikit-learn: nothing is downloaded.
"""

import argparse
import os

# CPU-only hosts: the data-parallel twin splits the CPU into 4 replicas (unused by this script;
# where GPUs exist the twin uses every local GPU instead).
os.environ.setdefault("TFDP_CPU_REPLICAS", "4")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=256, help="global batch (all replicas)")
args = parser.parse_args()

digits = load_digits()
x = (digits.images[..., None] / 16.0).astype("float32")
y = digits.target.astype("int32")
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order], y[order]
x_train, y_train, x_test, y_test = x[360:], y[360:], x[:360], y[:360]

strategy = tf.distribute.get_strategy()
print(f"{type(strategy).__name__}: {strategy.num_replicas_in_sync} replica(s)")
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", use_bias=False),
        keras.layers.BatchNormalization(momentum=0.9),
        keras.layers.ReLU(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(keras.optimizers.Adam(3e-3),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
print(f"test accuracy {accuracy:.4f}, test loss {loss:.4f}")

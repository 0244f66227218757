"""Workstation vision: a small CNN with BatchNormalization on scikit-learn's handwritten digits,
on one device (workstation_vision_single.py) or data parallel over every local GPU, else the
TFDP_CPU_REPLICAS logical CPU replicas (workstation_vision_dp.py). The data-parallel twin is this
script plus two added lines (nothing removed, nothing re-indented, no `with` block)::

    diff examples/workstation_vision_single.py examples/workstation_vision_dp.py

Run: python examples/workstation_vision_single.py [--epochs N] [--batch-size B]
     TFDP_CPU_REPLICAS=4 python examples/workstation_vision_dp.py     (no GPU: 4 CPU replicas)
The digits (1,797 real 8x8 images) ship inside scikit-learn: nothing is downloaded.
BatchNormalization(synchronized=True) computes each batch's statistics over the whole global
batch, so the twin trains one device's weights; plain BatchNormalization would use each
replica's own examples (Keras's per-replica statistics, as under MirroredStrategy).
The activations are smooth (swish, average pooling): the global statistics are sums over the
replicas' sums, in another order than one device's sum, and on these quantized images (17 grey
levels) that float32 round-off can flip a ReLU or max-pooling kink at a tie, which moves the
weights by ~1e-4 (MirroredStrategy alike); with smooth activations the twin stays within 1e-5.
"""

import argparse

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=256, help="global batch (all replicas)")
parser.add_argument("--save-weights", metavar="FILE.npz", help="save the trained weights")
args = parser.parse_args()

digits = load_digits()
x = (digits.images[..., None] / 16.0).astype("float32")
y = digits.target.astype("int32")
order = np.random.default_rng(0).permutation(len(x))
x, y = x[order], y[order]
x_train, y_train, x_test, y_test = x[360:], y[360:], x[:360], y[:360]

keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(32, 3, padding="same", use_bias=False),
    keras.layers.BatchNormalization(momentum=0.9, synchronized=True),  # global batch statistics
    keras.layers.Activation("swish"),   # smooth: see the note above
    keras.layers.Conv2D(64, 3, padding="same", activation="swish"),
    keras.layers.AveragePooling2D(2),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation="swish"),
    keras.layers.Dense(10),
])
model.compile(keras.optimizers.Adam(3e-3),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])

strategy = tf.distribute.get_strategy()
print(f"{type(strategy).__name__}: {strategy.num_replicas_in_sync} replica(s)")
model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
print(f"test accuracy {accuracy:.4f}, test loss {loss:.4f}")
if args.save_weights:
    np.savez(args.save_weights, *model.get_weights())

"""``tfdp demo``: a real data-parallel training run on CPU replicas (or all local GPUs).

Trains a small convolutional classifier on scikit-learn's bundled handwritten digits
(1,797 8x8 images, shipped inside the package: no download) with ``DataParallelStrategy`` and
Keras ``fit``, then prints a summary and checks a target accuracy.
"""

from __future__ import annotations

import argparse
import time

from tfdp.errors import TfdpError, UsageError, invalid_argument


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _parser():
    p = _Parser(prog="tfdp demo", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=4,
                   help="CPU replicas when there is no GPU (default 4)")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=128, help="global batch size (default 128)")
    p.add_argument("--target-accuracy", type=float, default=0.93,
                   help="exit 1 if test accuracy ends below this (default 0.93)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    for name in ("replicas", "epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise invalid_argument("--" + name.replace("_", "-"), getattr(args, name),
                                   fix="Pass a positive integer.", cls=UsageError)
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise TfdpError("The demo needs scikit-learn (its digits dataset ships offline). "
                        "Received: no module 'sklearn'. Install it: pip install -e \".[examples]\"")

    import tfdp
    import tensorflow as tf
    if not tf.config.list_physical_devices("GPU"):
        tfdp.configure_cpu_replicas(args.replicas)
    import keras
    import numpy as np

    digits = load_digits()
    x = (digits.images[..., None] / 16.0).astype("float32")
    y = digits.target.astype("int32")
    rng = np.random.default_rng(0)
    order = rng.permutation(len(x))
    x, y = x[order], y[order]
    n_test = 360
    x_train, y_train, x_test, y_test = x[n_test:], y[n_test:], x[:n_test], y[:n_test]

    strategy = tfdp.DataParallelStrategy()
    n = strategy.num_replicas_in_sync
    print(f"tfdp demo: {strategy}")
    print(f"  {n} replicas, global batch {args.batch_size} "
          f"(~{args.batch_size // n} per replica), {len(x_train)} training images")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(keras.optimizers.Adam(3e-3),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
    t0 = time.perf_counter()
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs, verbose=2)
    seconds = time.perf_counter() - t0
    loss, acc = model.evaluate(x_test, y_test, batch_size=args.batch_size, verbose=0)
    per_s = len(x_train) * args.epochs / seconds
    print(f"tfdp demo: {args.epochs} epochs in {seconds:.1f} s ({per_s:,.0f} examples/s incl. "
          f"tracing); test loss {loss:.4f}, test accuracy {acc:.4f} "
          f"(target >= {args.target_accuracy})")
    if acc < args.target_accuracy:
        print(f"tfdp demo: test accuracy {acc:.4f} is below the target {args.target_accuracy}")
        return 1
    return 0

"""``tfdp bench fit``: Keras ``model.fit`` throughput, tfdp vs MirroredStrategy vs one device.

The model is a deep narrow MLP (``layers`` Dense layers of ``width`` units on ``width``-wide
inputs, relu, He init, linear last layer; MSE against random targets; SGD), so a step is cheap and
the per-tensor cost of the gradient all-reduce shows. Each contender builds and compiles its model
once under its strategy (``jit_compile=False`` for all: MirroredStrategy ignores its cross-device
ops under XLA), is warmed up with one fit, then rounds alternate timed
``model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)`` calls between contenders.
"""

from __future__ import annotations

import gc
import math
import time

from tfdp.bench import _common

DEFAULTS = {"layers": 60, "width": 64, "batch": 256, "steps": 20, "repeats": 7}


def build_mlp(layers: int, width: int):
    import keras
    inputs = keras.Input((width,))
    x = inputs
    for i in range(layers):
        x = keras.layers.Dense(width, activation="relu" if i < layers - 1 else None,
                               kernel_initializer="he_normal", name=f"dense_{i}")(x)
    return keras.Model(inputs, x, name=f"mlp_{layers}x{width}")


def _dataset(width: int, batch: int, seed: int = 0):
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(seed)
    pool = batch * 4
    x = rng.standard_normal((pool, width), dtype=np.float32)
    y = rng.standard_normal((pool, width), dtype=np.float32)
    return (tf.data.Dataset.from_tensor_slices((x, y)).repeat()
            .batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))


class _FitContender:
    def __init__(self, name, kind, strategy, layers, width, **info):
        import keras
        self.name, self.kind, self.strategy, self.info = name, kind, strategy, info
        if strategy is None:
            self.model = build_mlp(layers, width)
            self._compile(keras)
        else:
            with strategy.scope():
                self.model = build_mlp(layers, width)
                self._compile(keras)

    def _compile(self, keras):
        self.model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-3), loss="mse",
                           jit_compile=False)

    def fit(self, dataset, steps):
        history = self.model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
        return float(history.history["loss"][-1])


def run_fit(cpu_replicas: int = 4, layers: int = DEFAULTS["layers"],
            width: int = DEFAULTS["width"], batch: int = DEFAULTS["batch"],
            steps: int = DEFAULTS["steps"], repeats: int = DEFAULTS["repeats"],
            all_reduce: str = "auto", progress: bool = False) -> dict:
    """Fit throughput of the MLP per contender; returns all figures as a dict.

    Args:
      cpu_replicas: K logical CPU devices (configured first).
      layers, width: the MLP (``layers`` Dense(width) layers: ``2 * layers`` gradient tensors).
      batch: global batch size; steps: steps per timed fit; repeats: rounds.
      all_reduce: tfdp's ``all_reduce`` argument.
      progress: print "round i/R" lines to stderr.

    Returns:
      {"benchmark", "cpu_replicas", ..., "results": [{"contender", "fit_s", "examples_per_s",
       "median_examples_per_s", "median_step_ms", "final_loss", ...}],
       "ratio_tfdp_over_mirrored", "environment"}.
    """
    import tensorflow as tf

    from tfdp.bench.allreduce import describe_cross_device_ops
    from tfdp.strategy import DataParallelStrategy

    devices = _common.configure_replicas(cpu_replicas)
    dataset = _dataset(width, batch)
    tfdp_strategy = DataParallelStrategy(devices, all_reduce=all_reduce)
    ms = tf.distribute.MirroredStrategy(devices)
    ms_desc = describe_cross_device_ops(ms)
    _common.progress(f"fit: building {layers}x{width} MLPs under each strategy", progress)
    contenders = [
        _FitContender(f"tfdp {tfdp_strategy.all_reduce} b="
                      f"{_common.fmt_bytes(tfdp_strategy.bucket_bytes)}", "tfdp", tfdp_strategy,
                      layers, width, algorithm=tfdp_strategy.all_reduce,
                      bucket_bytes=tfdp_strategy.bucket_bytes, replicas=cpu_replicas),
        _FitContender(f"MS {ms_desc}", "mirrored", ms, layers, width,
                      cross_device_ops=ms_desc, replicas=cpu_replicas),
        _FitContender("one device, no strategy", "single", None, layers, width, replicas=1),
    ]
    warm = []
    for c in contenders:
        _common.progress(f"fit: warm-up {c.name}", progress)
        t0 = time.perf_counter()
        c.fit(dataset, steps)
        warm.append(time.perf_counter() - t0)

    times = [[] for _ in contenders]
    losses = [[] for _ in contenders]
    for r in range(repeats):
        _common.progress(f"fit: round {r + 1}/{repeats}", progress)
        gc.collect()
        for i in _common.round_order(len(contenders), r):
            t0 = time.perf_counter()
            losses[i].append(contenders[i].fit(dataset, steps))
            times[i].append(time.perf_counter() - t0)

    examples = steps * batch
    results = []
    for c, ts, ls, w in zip(contenders, times, losses, warm):
        st = _common.summarize(ts)
        results.append({
            "contender": c.name, "kind": c.kind, **c.info, "fit_s": ts,
            "examples_per_s": [examples / t for t in ts], "warmup_fit_s": w,
            "median_fit_s": st["median"], "min_fit_s": st["min"],
            "median_examples_per_s": examples / st["median"],
            "best_examples_per_s": examples / st["min"],
            "median_step_ms": st["median"] / steps * 1e3, "final_loss": ls[-1],
            "finite_loss": all(math.isfinite(v) for v in ls),
        })
    ms_res = results[1]
    for res in results:
        res["ratio_over_mirrored"] = (res["median_examples_per_s"]
                                      / ms_res["median_examples_per_s"])
    return {
        "benchmark": "fit", "cpu_replicas": cpu_replicas, "devices": devices, "layers": layers,
        "width": width, "gradient_tensors": 2 * layers, "batch": batch, "steps": steps,
        "repeats": repeats, "mirrored_cross_device_ops": ms_desc, "results": results,
        "ratio_tfdp_over_mirrored": results[0]["ratio_over_mirrored"],
        "environment": _common.environment(),
        "notes": {"fit_s": "seconds per model.fit(epochs=1, steps_per_epoch=steps) call",
                  "ratio_over_mirrored": "median examples/s / MirroredStrategy's: > 1 means "
                                         "faster than MirroredStrategy"},
    }


def format_fit(result: dict) -> str:
    env = result["environment"]
    lines = [f"tfdp bench fit: MLP {result['layers']} x Dense({result['width']}) relu, MSE, "
             f"SGD ({result['gradient_tensors']} gradient tensors), global batch "
             f"{result['batch']}, {result['steps']} steps per fit, {result['repeats']} rounds",
             f"{result['cpu_replicas']} CPU replicas ({env['cpu_cores']} cores), TF "
             f"{env['tensorflow']}, Keras {env['keras']}; MirroredStrategy default "
             f"cross_device_ops: {result['mirrored_cross_device_ops']}", ""]
    headers = ["contender", "replicas", "median ex/s", "best ex/s", "ms/step", "vs MS"]
    rows = [[r["contender"], r["replicas"], f"{r['median_examples_per_s']:,.0f}",
             f"{r['best_examples_per_s']:,.0f}", f"{r['median_step_ms']:.2f}",
             f"{r['ratio_over_mirrored']:.2f}"] for r in result["results"]]
    lines.append(_common.render_table(headers, rows))
    lines += ["", f"tfdp / MirroredStrategy (median examples/s): "
                  f"{result['ratio_tfdp_over_mirrored']:.2f}  (> 1: tfdp faster)"]
    if not all(r["finite_loss"] for r in result["results"]):
        lines.append("warning: a loss was not finite; the figures still time the same work.")
    return "\n".join(lines)

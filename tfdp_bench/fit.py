"""``tfdp bench fit``: Keras ``model.fit`` throughput, tfdp vs MirroredStrategy vs one device.

The model is a deep narrow MLP (``layers`` Dense layers of ``width`` units on ``width``-wide
inputs, relu, He init, linear last layer; MSE against random targets; SGD), so a step is cheap and
the per-tensor cost of the gradient all-reduce shows. Each contender builds and compiles its model
once under its strategy (``jit_compile=False`` for all: MirroredStrategy ignores its cross-device
ops under XLA), is warmed up with one short fit, then rounds alternate timed
``model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)`` calls between contenders.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import time

from tfdp_bench import _common
from tfdp_bench.parser import (BenchParser, add_common_options, all_reduce_names,
                               check_directory, check_positive, check_writable, write_json)
from tfdp.errors import TfdpError, UsageError

WARMUP_STEPS = 10  # the warm-up fit traces the train function and starts the input pipeline
DEFAULTS = {"layers": 60, "width": 64, "batch": 256, "steps": 100, "repeats": 5}
TRACE_STEPS = 5  # steady steps profiled per contender with --trace


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
        """One timed fit: (seconds, final loss, steady-state step intervals in seconds)."""
        timer = _new_step_timer()
        t0 = time.perf_counter()
        history = self.model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0,
                                 shuffle=False, callbacks=[timer])
        t1 = time.perf_counter()
        ends = timer.batch_ends
        return {"seconds": t1 - t0, "loss": float(history.history["loss"][-1]),
                "steps_s": [b - a for a, b in zip(ends, ends[1:])],
                "teardown_s": t1 - timer.train_end}


def _step_timer_class():
    import keras

    class StepTimer(keras.callbacks.Callback):
        """Records when each training batch ends (the train function runs synchronously)."""

        def __init__(self):
            super().__init__()
            self.batch_ends = []
            self.train_end = None

        def on_train_batch_end(self, batch, logs=None):
            self.batch_ends.append(time.perf_counter())

        def on_train_end(self, logs=None):
            self.train_end = time.perf_counter()

    return StepTimer


_STEP_TIMER_CLASS = None


def _new_step_timer():
    global _STEP_TIMER_CLASS
    if _STEP_TIMER_CLASS is None:  # keras is imported only when a benchmark runs
        _STEP_TIMER_CLASS = _step_timer_class()
    return _STEP_TIMER_CLASS()


def run_fit(cpu_replicas: int = 4, layers: int = DEFAULTS["layers"],
            width: int = DEFAULTS["width"], batch: int = DEFAULTS["batch"],
            steps: int = DEFAULTS["steps"], repeats: int = DEFAULTS["repeats"],
            all_reduce: str = "auto", progress: bool = False, trace_dir: str | None = None,
            trace_steps: int = TRACE_STEPS) -> dict:
    """Fit throughput of the MLP per contender; returns all figures as a dict.

    Args:
      cpu_replicas: K logical CPU devices (configured first).
      layers, width: the MLP (``layers`` Dense(width) layers: ``2 * layers`` gradient tensors).
      batch: global batch size; steps: steps per timed fit; repeats: rounds.
      all_reduce: tfdp's ``all_reduce`` argument.
      progress: print "round i/R" lines to stderr.
      trace_dir: after the timed rounds, profile ``trace_steps`` steady steps of the tfdp and
        MirroredStrategy contenders (``tfdp_bench.trace``): one TensorBoard log directory per
        contender under ``trace_dir``, a Perfetto ``trace.json.gz`` and ``timeline.txt`` in
        each, and ``timeline.txt`` / ``timeline.json`` with both tables in ``trace_dir``.

    Returns:
      {"benchmark", "cpu_replicas", ..., "results": [{"contender", "fit_s", "examples_per_s",
       "median_examples_per_s", "median_step_ms", "final_loss", ...}],
       "ratio_tfdp_over_mirrored", "environment"}; with ``trace_dir`` also "trace":
      [{"contender", "steps": [per-step figures], "median", ...}].
    """
    for name, value in (("layers", layers), ("width", width), ("batch", batch),
                        ("steps", steps), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TfdpError(f"Invalid {name}. Received: {name}={value!r}. Pass an int >= 1.")
    if trace_dir is not None and (isinstance(trace_steps, bool) or not isinstance(trace_steps, int)
                                  or trace_steps < 1):
        raise TfdpError(f"Invalid trace_steps. Received: trace_steps={trace_steps!r}. Pass an "
                        "int >= 1.")
    if batch < cpu_replicas:
        raise TfdpError(f"Invalid batch. Received: batch={batch} with cpu_replicas="
                        f"{cpu_replicas}. Give every replica at least one example per step.")
    import tensorflow as tf

    from tfdp.strategy import DataParallelStrategy

    devices = _common.configure_replicas(cpu_replicas)
    dataset = _dataset(width, batch)
    tfdp_strategy = DataParallelStrategy(devices, all_reduce=all_reduce)
    ms = tf.distribute.MirroredStrategy(devices)
    ms_desc = _common.describe_cross_device_ops(ms)
    if trace_dir is not None:  # before the train functions are traced: ops get the scope
        from tfdp_bench import trace
        from tfdp_bench._internals import mirrored_cross_device_ops
        trace.scope_reductions(tfdp_strategy.cross_device_ops)
        trace.scope_reductions(mirrored_cross_device_ops(ms))
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
        warm.append(c.fit(dataset, min(steps, WARMUP_STEPS))["seconds"])

    times = [[] for _ in contenders]
    losses = [[] for _ in contenders]
    intervals = [[] for _ in contenders]
    teardowns = [[] for _ in contenders]
    for r in range(repeats):
        _common.progress(f"fit: round {r + 1}/{repeats}", progress)
        gc.collect()
        for i in _common.round_order(len(contenders), r):
            run = contenders[i].fit(dataset, steps)
            times[i].append(run["seconds"])
            losses[i].append(run["loss"])
            intervals[i].extend(run["steps_s"])
            teardowns[i].append(run["teardown_s"])

    traces = None
    if trace_dir is not None:
        traces = _trace(contenders[:2], dataset, trace_dir, trace_steps, progress)

    examples = steps * batch
    results = []
    for c, ts, ls, iv, td, w in zip(contenders, times, losses, intervals, teardowns, warm):
        st = _common.summarize(ts)
        steady = statistics.median(iv) if iv else float("nan")
        results.append({
            "contender": c.name, "kind": c.kind, **c.info, "fit_s": ts,
            "examples_per_s": [examples / t for t in ts], "warmup_fit_s": w,
            "median_fit_s": st["median"], "min_fit_s": st["min"],
            "median_examples_per_s": examples / st["median"],
            "best_examples_per_s": examples / st["min"],
            "median_step_ms": st["median"] / steps * 1e3,
            "steady_step_s": iv, "steady_median_step_ms": steady * 1e3,
            "steady_examples_per_s": batch / steady,
            "teardown_s": td, "median_teardown_s": statistics.median(td),
            "final_loss": ls[-1], "finite_loss": all(math.isfinite(v) for v in ls),
        })
    ms_res = results[1]
    for res in results:
        res["ratio_over_mirrored"] = (res["median_examples_per_s"]
                                      / ms_res["median_examples_per_s"])
        res["steady_ratio_over_mirrored"] = (res["steady_examples_per_s"]
                                             / ms_res["steady_examples_per_s"])
    out = {
        "benchmark": "fit", "cpu_replicas": cpu_replicas, "devices": devices, "layers": layers,
        "width": width, "gradient_tensors": 2 * layers, "batch": batch, "steps": steps,
        "repeats": repeats, "mirrored_cross_device_ops": ms_desc, "results": results,
        "ratio_tfdp_over_mirrored": results[0]["ratio_over_mirrored"],
        "steady_ratio_tfdp_over_mirrored": results[0]["steady_ratio_over_mirrored"],
        "environment": _common.environment(),
        "notes": {"fit_s": "seconds per model.fit(epochs=1, steps_per_epoch=steps) call",
                  "steady_step_s": "intervals between consecutive batch ends inside the timed "
                                   "fits (the first batch of a fit, which also starts the input "
                                   "iterators, is excluded)",
                  "teardown_s": "from Keras's on_train_end to fit returning: mostly the "
                                "destruction of the distributed input iterator, which can stall "
                                "for seconds on a busy host (both strategies alike)",
                  "ratio_over_mirrored": "median examples/s / MirroredStrategy's: > 1 means "
                                         "faster than MirroredStrategy"},
    }
    if traces is not None:
        out["trace_dir"] = trace_dir
        out["trace"] = traces
        out["notes"]["trace"] = trace_note()
    return out


def trace_note() -> str:
    from tfdp_bench.trace import TABLE_NOTE
    return TABLE_NOTE.replace("\n", " ")


def _trace(contenders, dataset, trace_dir, trace_steps, progress):
    """Profile ``trace_steps`` steady steps of each contender: their timelines (bench.trace)."""
    from tfdp_bench import trace
    for c in contenders:  # the profiler's own set-up must not land in the first traced steps
        trace.warm_up(lambda callbacks, c=c: c.model.fit(
            dataset, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False, callbacks=callbacks))
    out = []
    for c in contenders:
        _common.progress(f"fit: tracing {trace_steps} steps of {c.name}", progress)
        logdir = os.path.join(trace_dir, trace.slug(c.name))

        def run_steps(callbacks, c=c):
            # one step more than shown: the first of a fit also starts the input iterators
            c.model.fit(dataset, epochs=1, steps_per_epoch=trace_steps + 1, verbose=0,
                        shuffle=False, callbacks=callbacks)

        out.append(trace.trace_contender(c.name, run_steps, logdir, skip_steps=1))
    text = "\n\n".join(r["table"] for r in out) + "\n\n" + trace.TABLE_NOTE + "\n"
    with open(os.path.join(trace_dir, "timeline.txt"), "w") as f:
        f.write(text)
    with open(os.path.join(trace_dir, "timeline.json"), "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "table"} for r in out], f, indent=1)
        f.write("\n")
    return out


def format_fit(result: dict) -> str:
    env = result["environment"]
    lines = [f"tfdp bench fit: MLP {result['layers']} x Dense({result['width']}) relu, MSE, "
             f"SGD ({result['gradient_tensors']} gradient tensors), global batch "
             f"{result['batch']}, {result['steps']} steps per fit, {result['repeats']} rounds",
             f"{result['cpu_replicas']} CPU replicas ({env['cpu_cores']} cores), TF "
             f"{env['tensorflow']}, Keras {env['keras']}; MirroredStrategy default "
             f"cross_device_ops: {result['mirrored_cross_device_ops']}", ""]
    headers = ["contender", "replicas", "fit ex/s", "best ex/s", "vs MS", "teardown s",
               "step ms", "step ex/s", "vs MS"]
    rows = [[r["contender"], r["replicas"], f"{r['median_examples_per_s']:,.0f}",
             f"{r['best_examples_per_s']:,.0f}", f"{r['ratio_over_mirrored']:.2f}",
             f"{r['median_teardown_s']:.2f}",
             f"{r['steady_median_step_ms']:.2f}", f"{r['steady_examples_per_s']:,.0f}",
             f"{r['steady_ratio_over_mirrored']:.2f}"] for r in result["results"]]
    lines.append(_common.render_table(headers, rows))
    lines += ["",
              "fit ex/s: whole model.fit calls (median; includes Keras's per-fit set-up, input-"
              "iterator start and teardown);",
              "teardown s: median time from on_train_end to fit returning (distributed input "
              "iterator destruction); step ex/s: median steady-state step inside the fits.",
              f"tfdp / MirroredStrategy: {result['ratio_tfdp_over_mirrored']:.2f} (whole fit), "
              f"{result['steady_ratio_tfdp_over_mirrored']:.2f} (steady step); > 1: tfdp faster"]
    if result.get("trace"):
        from tfdp_bench.trace import TABLE_NOTE
        lines.append("")
        for t in result["trace"]:
            lines += [t["table"], ""]
        lines += [TABLE_NOTE,
                  f"traces in {result['trace_dir']}: TensorBoard (tensorboard --logdir "
                  f"{result['trace_dir']}, Profile tab) reads each contender's "
                  "plugins/profile/*/*.xplane.pb; Perfetto (ui.perfetto.dev) opens its "
                  "trace.json.gz."]
    if not all(r["finite_loss"] for r in result["results"]):
        lines.append("warning: a loss was not finite; the figures still time the same work.")
    return "\n".join(lines)


# --- command line: tfdp bench fit ----------------------------------------------------------------

def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench fit",
                    description="Keras model.fit throughput of a deep narrow MLP (--layers Dense "
                                "layers of --width, relu, MSE on random data) under tfdp "
                                "DataParallelStrategy vs tf.distribute.MirroredStrategy on the "
                                "same K CPU replicas, plus one device without a strategy. With "
                                "--trace DIR, a few steady steps of the tfdp and "
                                "MirroredStrategy contenders then run under TensorFlow's "
                                "profiler: per step, compute vs all-reduce vs idle time and how "
                                "much of the all-reduce overlapped the backward pass.")
    add_common_options(p)
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"], metavar="N",
                   help=f"Dense layers (default: {DEFAULTS['layers']})")
    p.add_argument("--width", type=int, default=DEFAULTS["width"], metavar="W",
                   help=f"units per layer and input width (default: {DEFAULTS['width']})")
    p.add_argument("--batch", type=int, default=DEFAULTS["batch"], metavar="B",
                   help=f"global batch size (default: {DEFAULTS['batch']})")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"], metavar="S",
                   help=f"steps per timed fit (default: {DEFAULTS['steps']})")
    p.add_argument("--repeats", type=int, default=DEFAULTS["repeats"], metavar="R",
                   help=f"rounds (default: {DEFAULTS['repeats']})")
    p.add_argument("--all-reduce", default="auto", metavar="ALG",
                   help="tfdp's all_reduce argument (default: auto)")
    p.add_argument("--trace", metavar="DIR",
                   help="profile steady steps of tfdp and MirroredStrategy into DIR "
                        "(TensorBoard log directories, Perfetto trace.json.gz) and print the "
                        "per-step timeline (also written to DIR/timeline.txt)")
    p.add_argument("--trace-steps", type=int, default=TRACE_STEPS, metavar="S",
                   help=f"steps profiled per contender with --trace (default: {TRACE_STEPS})")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    for name in ("cpu_replicas", "layers", "width", "batch", "steps", "repeats", "trace_steps"):
        check_positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.batch < args.cpu_replicas:
        raise UsageError(f"--batch is smaller than --cpu-replicas. Received: --batch "
                         f"{args.batch} --cpu-replicas {args.cpu_replicas}. Give every replica "
                         "at least one example per step.")
    names = all_reduce_names()
    if args.all_reduce.lower() not in names:
        raise UsageError(f"Invalid --all-reduce. Received: --all-reduce {args.all_reduce}. "
                         f"Valid: {', '.join(names)}.")
    args.all_reduce = args.all_reduce.lower()
    check_writable("--json", args.json)
    check_directory("--trace", args.trace)
    return args


def run(args) -> int:
    result = run_fit(cpu_replicas=args.cpu_replicas, layers=args.layers, width=args.width,
                     batch=args.batch, steps=args.steps, repeats=args.repeats,
                     all_reduce=args.all_reduce, progress=not args.quiet,
                     trace_dir=args.trace, trace_steps=args.trace_steps)
    print(format_fit(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.fit
    import sys

    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("fit", parse_args, run))

"""``tfdp bench fitcalls``: what a whole short ``model.fit`` call costs, not just its steps.

Users who call ``fit`` / ``evaluate`` often (a loop of short fits, Keras Tuner, validation every
epoch) pay each call's set-up, each epoch's input-iterator start and each call's teardown. This
benchmark times whole calls of the form users write::

    model.fit(x, y, batch_size=B, epochs=1, verbose=0)                       # N times in a row
    model.fit(x, y, batch_size=B, epochs=E, validation_data=(xv, yv), verbose=0)

on numpy arrays (``--input dataset``: a batched ``tf.data.Dataset`` of the same arrays), with
the same global batches for every contender: tfdp on K CPU replicas, MirroredStrategy on the
same K replicas, and no strategy (one device). Every contender builds and compiles its model
once, is warmed up with one call of each form, then rounds run every scenario of one contender
after the other in alternating order; figures are medians over rounds and calls, and ratios of
medians.

Per call: the wall time of the whole call; the first-batch latency (call entry to the end of the
first training batch); the steps (training and validation batches, each counted at its
contender's median steady batch time: every batch but an epoch's first); what is left, the
non-step time: set-up, iterator starts, epoch gaps, teardown; and the garbage collector's time
inside the call (``gc.callbacks``).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

from tfdp_bench import _common
from tfdp_bench.fit import build_mlp
from tfdp_bench.parser import (BenchParser, add_common_options, check_positive, check_writable,
                               split_list, write_json)
from tfdp.errors import TfdpError, UsageError

DEFAULTS = {"layers": 60, "width": 64, "batch": 256, "steps": 8, "val_steps": 2, "epochs": 3,
            "rounds": 3, "calls": "1,5,20", "input": "numpy"}
INPUTS = ("numpy", "dataset")


class _GCTimer:
    """Seconds the cyclic garbage collector ran since ``take()`` was last called."""

    def __init__(self):
        self._start, self.total = None, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase, _info):
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.total += time.perf_counter() - self._start
            self._start = None

    def take(self) -> float:
        out, self.total = self.total, 0.0
        return out

    def close(self):
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


def _timeline_class():
    import keras

    class Timeline(keras.callbacks.Callback):
        """When each training / validation batch began and ended, per epoch."""

        def __init__(self):
            super().__init__()
            self.train, self.test = [], []   # [(epoch, batch, begin, end)], [(begin, end)]
            self._epoch, self._begin, self._test_begin = 0, None, None

        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            self._begin = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.train.append((self._epoch, batch, self._begin, time.perf_counter()))

        def on_test_batch_begin(self, batch, logs=None):
            self._test_begin = time.perf_counter()

        def on_test_batch_end(self, batch, logs=None):
            self.test.append((batch, self._test_begin, time.perf_counter()))

    return Timeline


class _Contender:
    def __init__(self, name, kind, strategy, layers, width, timeline_cls):
        import keras
        self.name, self.kind, self.strategy = name, kind, strategy
        self._timeline_cls = timeline_cls
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            self.model = build_mlp(layers, width)
            self.model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-3), loss="mse",
                               jit_compile=False)

    def fit(self, data, batch, epochs=1, validation=None):
        """One timed call: {"call_s", "first_batch_s", "train_batches", "test_batches",
        "train_steady_s", "test_steady_s" (median non-first batch times), "first_s" (each
        epoch's first-batch time)}."""
        timeline = self._timeline_cls()
        x, y = data
        kwargs = {"epochs": epochs, "verbose": 0, "callbacks": [timeline]}
        if validation is not None:
            kwargs["validation_data"] = validation
        if y is not None:
            kwargs["batch_size"] = batch
        t0 = time.perf_counter()
        self.model.fit(x, y, **kwargs) if y is not None else self.model.fit(x, **kwargs)
        t1 = time.perf_counter()
        train = timeline.train
        steady = [e - b for _, i, b, e in train if i > 0]
        tests = [e - b for i, b, e in timeline.test if i > 0]
        return {"call_s": t1 - t0, "first_batch_s": train[0][3] - t0 if train else float("nan"),
                "train_batches": len(train), "test_batches": len(timeline.test),
                "train_steady_s": steady, "test_steady_s": tests}


def _data(kind, examples, width, batch, seed):
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((examples, width), dtype=np.float32)
    y = rng.standard_normal((examples, width), dtype=np.float32)
    if kind == "dataset":
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch), None
    return x, y


def _check(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TfdpError(f"Invalid {name}. Received: {name}={value!r}. Pass an int >= {minimum}.")


def run_fitcalls(cpu_replicas: int = 4, layers: int = DEFAULTS["layers"],
                 width: int = DEFAULTS["width"], batch: int = DEFAULTS["batch"],
                 steps: int = DEFAULTS["steps"], val_steps: int = DEFAULTS["val_steps"],
                 epochs: int = DEFAULTS["epochs"], rounds: int = DEFAULTS["rounds"],
                 calls=(1, 5, 20), input_kind: str = DEFAULTS["input"],
                 mirrored: bool = True, progress: bool = False) -> dict:
    """Whole-call figures per scenario and contender (see the module docstring)."""
    for name, value in (("cpu_replicas", cpu_replicas), ("layers", layers), ("width", width),
                        ("batch", batch), ("val_steps", val_steps), ("epochs", epochs),
                        ("rounds", rounds)):
        _check(name, value)
    _check("steps", steps, 2)
    calls = [int(c) for c in calls]
    if not calls or any(c < 1 for c in calls):
        raise TfdpError(f"Invalid calls. Received: calls={calls!r}. Pass counts >= 1.")
    if input_kind not in INPUTS:
        raise TfdpError(f"Invalid input. Received: input={input_kind!r}. Valid: "
                        f"{', '.join(INPUTS)}.")
    if batch < cpu_replicas:
        raise TfdpError(f"Invalid batch. Received: batch={batch} with cpu_replicas="
                        f"{cpu_replicas}. Give every replica at least one example per step.")
    devices = _common.configure_replicas(cpu_replicas)
    import tensorflow as tf

    from tfdp.strategy import DataParallelStrategy
    timeline_cls = _timeline_class()
    train = _data(input_kind, steps * batch, width, batch, 0)
    val = _data(input_kind, val_steps * batch, width, batch, 1)
    if val[1] is None:
        val = val[0]
    _common.progress(f"fitcalls: building {layers}x{width} MLPs", progress)
    contenders = [_Contender(f"tfdp {cpu_replicas} replicas", "tfdp",
                             DataParallelStrategy(devices), layers, width, timeline_cls)]
    if mirrored:
        contenders.append(_Contender(f"MirroredStrategy {cpu_replicas} replicas", "mirrored",
                                     tf.distribute.MirroredStrategy(devices), layers, width,
                                     timeline_cls))
    contenders.append(_Contender("no strategy (1 device)", "none", None, layers, width,
                                 timeline_cls))
    for c in contenders:  # trace the train and test functions, start everything once
        _common.progress(f"fitcalls: warm-up {c.name}", progress)
        c.fit(train, batch)
        c.fit(train, batch, epochs=1, validation=val)

    scenarios = [(f"{n} fit call{'s' if n > 1 else ''}", n, 1, None) for n in calls]
    scenarios.append((f"fit, {epochs} epochs, validation_data", 1, epochs, val))
    gc_timer = _GCTimer()
    runs = {(s[0], c.kind): [] for s in scenarios for c in contenders}
    loops = {(s[0], c.kind): [] for s in scenarios for c in contenders}
    try:
        for r in range(rounds):
            _common.progress(f"fitcalls: round {r + 1}/{rounds}", progress)
            for i in _common.round_order(len(contenders), r):
                c = contenders[i]
                for name, n, ep, validation in scenarios:
                    gc.collect()
                    gc_timer.take()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        gc_timer.take()
                        run = c.fit(train, batch, epochs=ep, validation=validation)
                        run["gc_s"] = gc_timer.take()
                        runs[(name, c.kind)].append(run)
                    loops[(name, c.kind)].append(time.perf_counter() - t0)
    finally:
        gc_timer.close()
    return _summarize(contenders, scenarios, runs, loops, {
        "benchmark": "fitcalls", "cpu_replicas": cpu_replicas, "devices": devices,
        "layers": layers, "width": width, "batch": batch, "steps": steps,
        "val_steps": val_steps, "epochs": epochs, "rounds": rounds, "calls": calls,
        "input": input_kind, "environment": _common.environment()})


def _summarize(contenders, scenarios, runs, loops, out):
    steady = {}
    for c in contenders:  # each contender's steady batch times over every timed call
        rs = [r for s in scenarios for r in runs[(s[0], c.kind)]]
        steady[c.kind] = (statistics.median([t for r in rs for t in r["train_steady_s"]]),
                          statistics.median([t for r in rs for t in r["test_steady_s"]] or [0.0]))
    rows = []
    for name, n, epochs, _ in scenarios:
        for c in contenders:
            rs = runs[(name, c.kind)]
            train_step, test_step = steady[c.kind]
            non_step = [r["call_s"] - r["train_batches"] * train_step
                        - r["test_batches"] * test_step for r in rs]
            rows.append({
                "scenario": name, "calls_per_loop": n, "epochs": epochs,
                "contender": c.name, "kind": c.kind,
                "call_s": [r["call_s"] for r in rs], "loop_s": loops[(name, c.kind)],
                "first_batch_s": [r["first_batch_s"] for r in rs], "non_step_s": non_step,
                "gc_s": [r["gc_s"] for r in rs],
                "median_call_s": statistics.median(r["call_s"] for r in rs),
                "median_loop_s": statistics.median(loops[(name, c.kind)]),
                "median_first_batch_s": statistics.median(r["first_batch_s"] for r in rs),
                "median_non_step_s": statistics.median(non_step),
                "median_gc_s": statistics.median(r["gc_s"] for r in rs),
                "max_call_s": max(r["call_s"] for r in rs),
                "steady_train_batch_s": train_step, "steady_test_batch_s": test_step})
    for row in rows:
        for ref in ("none", "mirrored"):
            base = next((b for b in rows if b["scenario"] == row["scenario"]
                         and b["kind"] == ref), None)
            for key in ("call", "non_step", "first_batch"):
                row[f"{key}_over_{ref}"] = (None if base is None else
                                            row[f"median_{key}_s"] / base[f"median_{key}_s"])
    out["results"] = rows
    out["notes"] = {
        "call_s": "wall time of one whole fit call (per call in an N-call loop)",
        "first_batch_s": "fit entry to the end of its first training batch",
        "non_step_s": "call_s minus its batches at the contender's median steady batch time "
                      "(training and validation): set-up, iterator starts, epoch gaps, teardown",
        "gc_s": "time the cyclic garbage collector ran inside the call",
        "over": "ratio of medians: this contender / no strategy (x none) or / MirroredStrategy"}
    return out


def _ratio(v):
    return "-" if v is None else f"{v:.2f}"


def format_fitcalls(result: dict) -> str:
    env = result["environment"]
    lines = [f"tfdp bench fitcalls: MLP {result['layers']} x Dense({result['width']}), SGD, "
             f"{result['input']} input, global batch {result['batch']}, {result['steps']} steps "
             f"per epoch ({result['val_steps']} validation steps), {result['rounds']} rounds",
             f"{result['cpu_replicas']} CPU replicas ({env['cpu_cores']} cores), TF "
             f"{env['tensorflow']}, Keras {env['keras']}", ""]
    headers = ["scenario", "contender", "call s", "loop s", "1st batch ms", "non-step s",
               "gc ms", "call x none", "call x MS", "non-step x none", "non-step x MS"]
    rows, last = [], None
    for r in result["results"]:
        if last is not None and r["scenario"] != last:
            rows.append(None)
        last = r["scenario"]
        rows.append([r["scenario"], r["contender"], f"{r['median_call_s']:.3f}",
                     f"{r['median_loop_s']:.2f}", f"{1e3 * r['median_first_batch_s']:.0f}",
                     f"{r['median_non_step_s']:.3f}", f"{1e3 * r['median_gc_s']:.0f}",
                     _ratio(r["call_over_none"]), _ratio(r["call_over_mirrored"]),
                     _ratio(r["non_step_over_none"]), _ratio(r["non_step_over_mirrored"])])
    lines.append(_common.render_table(headers, rows, right=set(range(2, len(headers)))))
    steady = {r["contender"]: (r["steady_train_batch_s"], r["steady_test_batch_s"])
              for r in result["results"]}
    lines += ["", "steady batch ms (train / validation): " + "; ".join(
        f"{k} {1e3 * a:.1f} / {1e3 * b:.1f}" for k, (a, b) in steady.items()),
        "call s: median wall time of one whole fit call; loop s: the N calls in a row (median "
        "over rounds); 1st batch: call entry to the end of its first batch;",
        "non-step s: call s minus its batches at the contender's steady batch time (set-up, "
        "iterator starts, epoch gaps, teardown); gc: the garbage collector inside the call;",
        "x none / x MS: ratio of medians to no strategy / to MirroredStrategy (< 1: cheaper)."]
    return "\n".join(lines)


def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench fitcalls",
                    description="Whole model.fit calls (set-up, iterator starts, teardown "
                                "included): loops of short fits and fit with validation_data, "
                                "tfdp vs MirroredStrategy vs no strategy, alternating rounds.")
    add_common_options(p)
    for name in ("layers", "width", "batch", "steps", "epochs", "rounds"):
        p.add_argument(f"--{name}", type=int, default=DEFAULTS[name], metavar="N",
                       help=f"default: {DEFAULTS[name]}" + (
                           " (steps per epoch)" if name == "steps" else
                           " (of the validation scenario)" if name == "epochs" else ""))
    p.add_argument("--val-steps", type=int, default=DEFAULTS["val_steps"], metavar="N",
                   help=f"validation batches per epoch (default: {DEFAULTS['val_steps']})")
    p.add_argument("--calls", default=DEFAULTS["calls"], metavar="N,N,...",
                   help=f"fit calls in a row per scenario (default: {DEFAULTS['calls']})")
    p.add_argument("--input", default=DEFAULTS["input"], choices=INPUTS,
                   help="numpy arrays (fit(x, y, batch_size=...)) or a batched tf.data.Dataset "
                        "(default: numpy)")
    p.add_argument("--no-mirrored", action="store_true", help="leave out MirroredStrategy")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    for name in ("cpu_replicas", "layers", "width", "batch", "epochs", "rounds", "val_steps"):
        check_positive("--" + name.replace("_", "-"), getattr(args, name))
    check_positive("--steps", args.steps, minimum=2)
    text = args.calls
    try:
        args.calls = [int(c) for c in split_list(text)]
    except ValueError:
        args.calls = []
    if not args.calls or min(args.calls) < 1:
        raise UsageError(f"Invalid --calls. Received: --calls {text!r}. Give comma-separated "
                         "counts >= 1, e.g. 1,5,20.")
    if args.batch < args.cpu_replicas:
        raise UsageError(f"Invalid --batch. Received: --batch {args.batch} with --cpu-replicas "
                         f"{args.cpu_replicas}. Give every replica at least one example.")
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    result = run_fitcalls(cpu_replicas=args.cpu_replicas, layers=args.layers, width=args.width,
                          batch=args.batch, steps=args.steps, val_steps=args.val_steps,
                          epochs=args.epochs, rounds=args.rounds, calls=args.calls,
                          input_kind=args.input, mirrored=not args.no_mirrored,
                          progress=not args.quiet)
    print(format_fitcalls(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.fitcalls
    import sys

    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("fitcalls", parse_args, run))

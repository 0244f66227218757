"""``tfdp bench embedding``: Keras ``fit`` of a recommender-shaped model, tfdp vs MirroredStrategy.

The model (issue #14): ``Embedding(vocab, dim)`` looked up with ``ids`` ids per example,
flattened, a Dense(64, relu) + Dense(1) head, MSE on random targets; global batch ``batch``,
``fit(epochs=2, steps_per_epoch=30)`` per timed call. For each optimizer (plain SGD, SGD with
momentum 0.9, Adam) the contenders are built once, warmed up with one short fit, then rounds run
each contender's timed fit in alternating order (forward on even rounds, reversed on odd ones),
all in this one process:

* ``tfdp``: ``tfdp.DataParallelStrategy`` on the K CPU replicas;
* ``tfdp, Keras table reads`` (``--before``): the same, with an embedding lookup that reads the
  whole table as Keras's TensorFlow ``take`` does (a ``keras.layers.Embedding`` subclass defined
  here calls ``tf.gather(table, ids)`` itself, as ``take`` does): the "before" of tfdp's sparse
  row read;
* ``MS ReductionToOneDevice``: ``tf.distribute.MirroredStrategy`` on the same replicas
  (ReductionToOneDevice: TF's CollectiveAllReduce reuses group keys across MirroredStrategy
  instances of one process);
* ``one device, no strategy`` (``--reference``).

Figures: medians over rounds of the whole fit (examples/s) and of the steady step (intervals
between consecutive batch ends inside an epoch), and ratios of medians against MirroredStrategy,
with each ratio's spread over rounds (min-max of the per-round ratios). ``--profile S`` then runs
S steady steps of each contender of the first optimizer under TF's profiler and lists where the
step's op time goes (``tfdp_bench.trace``).
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time

from tfdp_bench import _common
from tfdp_bench.parser import (BenchParser, add_common_options, check_positive, check_writable,
                               split_list, write_json)
from tfdp.errors import TfdpError, UsageError

DEFAULTS = {"vocab": 200_000, "dim": 64, "ids": 4, "batch": 256, "steps": 30, "epochs": 2,
            "rounds": 5}
OPTIMIZERS = ("sgd", "momentum", "adam")
WARMUP_STEPS = 5


def build_model(vocab: int, dim: int, ids: int, keras_reads: bool = False):
    """The recommender; ``keras_reads``: its lookup reads the whole table first, as Keras's
    TensorFlow ``take`` does (the "before" contender), instead of Keras's Embedding."""
    import keras
    inputs = keras.Input((ids,), dtype="int32")
    layer = _table_read_embedding() if keras_reads else keras.layers.Embedding
    x = layer(vocab, dim, name="embedding")(inputs)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(64, activation="relu", name="hidden")(x)
    outputs = keras.layers.Dense(1, name="out")(x)
    return keras.Model(inputs, outputs, name=f"recommender_{vocab}x{dim}")


def _table_read_embedding():
    """A Keras ``Embedding`` whose lookup is the one Keras's TensorFlow ``take`` makes, written
    out: ``tf.gather(variable, ids)``, which reads the whole table (every replica, every step,
    once an optimizer has updated it with a scatter), called directly so that tfdp's sparse row
    read (its ``ops.take`` inside a step, for ``Embedding`` + SGD) does not apply. Same weights,
    same gradient (an ``IndexedSlices``)."""
    import keras
    import tensorflow as tf

    class TableReadEmbedding(keras.layers.Embedding):
        def call(self, inputs):
            ids = tf.cast(inputs, tf.int32)
            ids = tf.where(ids < 0, ids + tf.shape(self.embeddings)[0], ids)  # as Keras's take
            return tf.cast(tf.gather(self.embeddings, ids, axis=0), self.compute_dtype)

    return TableReadEmbedding


def make_optimizer(name: str):
    import keras
    if name == "sgd":
        return keras.optimizers.SGD(learning_rate=0.01)
    if name == "momentum":
        return keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
    if name == "adam":
        return keras.optimizers.Adam(learning_rate=1e-3)
    raise TfdpError(f"Invalid optimizer. Received: optimizer={name!r}. Valid: "
                    f"{', '.join(OPTIMIZERS)}.")


def _dataset(vocab: int, ids: int, batch: int, seed: int = 0):
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(seed)
    pool = batch * 8
    x = rng.integers(0, vocab, (pool, ids)).astype(np.int32)
    y = rng.standard_normal((pool, 1)).astype(np.float32)
    return (tf.data.Dataset.from_tensor_slices((x, y)).repeat()
            .batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))


def _step_timer():
    import keras

    class StepTimer(keras.callbacks.Callback):
        """Batch-end times per epoch (the train function runs synchronously)."""

        def __init__(self):
            super().__init__()
            self.epochs = []

        def on_epoch_begin(self, epoch, logs=None):
            self.epochs.append([])

        def on_train_batch_end(self, batch, logs=None):
            self.epochs[-1].append(time.perf_counter())

    return StepTimer()


class Contender:
    """One model under one strategy (or none), compiled once; ``fit`` times one call."""

    def __init__(self, name, kind, strategy, optimizer, vocab, dim, ids, keras_reads=False):
        self.name, self.kind, self.optimizer = name, kind, optimizer
        scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
        with scope:
            self.model = build_model(vocab, dim, ids, keras_reads=keras_reads)
            self.model.compile(optimizer=make_optimizer(optimizer), loss="mse",
                               jit_compile=False)

    def fit(self, dataset, steps, epochs, callbacks=()):
        timer = _step_timer()
        t0 = time.perf_counter()
        history = self.model.fit(dataset, epochs=epochs, steps_per_epoch=steps, verbose=0,
                                 callbacks=[timer, *callbacks])
        seconds = time.perf_counter() - t0
        steady = [b - a for ends in timer.epochs for a, b in zip(ends, ends[1:])]
        return {"seconds": seconds, "steady_s": steady,
                "loss": float(history.history["loss"][-1])}


def _contenders(devices, optimizer, vocab, dim, ids, before, reference):
    import tensorflow as tf

    from tfdp.strategy import DataParallelStrategy
    tfdp_strategy = DataParallelStrategy(devices)
    out = [Contender("tfdp", "tfdp", tfdp_strategy, optimizer, vocab, dim, ids)]
    if before:
        out.append(Contender("tfdp, Keras table reads (before)", "tfdp_before",
                             DataParallelStrategy(devices), optimizer, vocab, dim, ids,
                             keras_reads=True))
    ms = tf.distribute.MirroredStrategy(devices,
                                        cross_device_ops=tf.distribute.ReductionToOneDevice())
    out.append(Contender("MS ReductionToOneDevice", "mirrored", ms, optimizer, vocab, dim, ids))
    if reference:
        out.append(Contender("one device, no strategy", "single", None, optimizer, vocab, dim,
                             ids))
    return out


def run_embedding(cpu_replicas: int = 4, vocab: int = DEFAULTS["vocab"],
                  dim: int = DEFAULTS["dim"], ids: int = DEFAULTS["ids"],
                  batch: int = DEFAULTS["batch"], steps: int = DEFAULTS["steps"],
                  epochs: int = DEFAULTS["epochs"], rounds: int = DEFAULTS["rounds"],
                  optimizers=OPTIMIZERS, before: bool = True, reference: bool = True,
                  profile_steps: int = 0, progress: bool = False) -> dict:
    """Fit throughput of the recommender model per optimizer and contender (see module doc)."""
    for name, value in (("cpu_replicas", cpu_replicas), ("vocab", vocab), ("dim", dim),
                        ("ids", ids), ("batch", batch), ("steps", steps), ("epochs", epochs),
                        ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TfdpError(f"Invalid {name}. Received: {name}={value!r}. Pass an int >= 1.")
    optimizers = list(optimizers)
    for o in optimizers:
        if o not in OPTIMIZERS:
            raise TfdpError(f"Invalid optimizer. Received: {o!r}. Valid: {', '.join(OPTIMIZERS)}.")
    devices = _common.configure_replicas(cpu_replicas)
    dataset = _dataset(vocab, ids, batch)
    groups = []
    for o in optimizers:
        _common.progress(f"embedding: building the {o} contenders", progress)
        cs = _contenders(devices, o, vocab, dim, ids, before, reference)
        for c in cs:
            _common.progress(f"embedding: warm-up {o} / {c.name}", progress)
            c.fit(dataset, WARMUP_STEPS, 1)
        groups.append(cs)

    runs = [[[] for _ in cs] for cs in groups]
    for r in range(rounds):
        _common.progress(f"embedding: round {r + 1}/{rounds}", progress)
        gc.collect()
        for g, cs in enumerate(groups):
            for i in _common.round_order(len(cs), r):
                runs[g][i].append(cs[i].fit(dataset, steps, epochs))

    examples = steps * epochs * batch
    results = []
    for o, cs, rs in zip(optimizers, groups, runs):
        ms_i = next(i for i, c in enumerate(cs) if c.kind == "mirrored")
        ms_fit = [x["seconds"] for x in rs[ms_i]]
        ms_step = [statistics.median(x["steady_s"]) for x in rs[ms_i]]
        for c, cr in zip(cs, rs):
            fit_s = [x["seconds"] for x in cr]
            step_s = [statistics.median(x["steady_s"]) for x in cr]
            all_steps = [s for x in cr for s in x["steady_s"]]
            ms_all = [s for x in rs[ms_i] for s in x["steady_s"]]
            fit_ratios = [m / t for m, t in zip(ms_fit, fit_s)]
            step_ratios = [m / t for m, t in zip(ms_step, step_s)]
            results.append({
                "optimizer": o, "contender": c.name, "kind": c.kind,
                "replicas": 1 if c.kind == "single" else cpu_replicas,
                "fit_s": fit_s, "median_fit_s": statistics.median(fit_s),
                "median_examples_per_s": examples / statistics.median(fit_s),
                "steady_median_step_ms": 1e3 * statistics.median(all_steps),
                "round_step_ms": [1e3 * s for s in step_s],
                "fit_ratio_over_mirrored": statistics.median(ms_fit) / statistics.median(fit_s),
                "fit_ratio_spread": [min(fit_ratios), max(fit_ratios)],
                "step_ratio_over_mirrored": statistics.median(ms_all) / statistics.median(all_steps),
                "step_ratio_spread": [min(step_ratios), max(step_ratios)],
                "final_loss": cr[-1]["loss"],
                "finite_loss": all(math.isfinite(x["loss"]) for x in cr),
            })
    out = {"benchmark": "embedding", "cpu_replicas": cpu_replicas, "vocab": vocab, "dim": dim,
           "ids": ids, "batch": batch, "steps": steps, "epochs": epochs, "rounds": rounds,
           "optimizers": optimizers, "results": results, "environment": _common.environment(),
           "notes": {"fit_ratio_over_mirrored": "MirroredStrategy's median fit seconds / this "
                                                "contender's (> 1: faster than MirroredStrategy)",
                     "step_ratio_over_mirrored": "the same for the median steady step",
                     "spread": "min and max of the per-round ratios"}}
    if profile_steps:
        out["profile"] = [_profile(c, dataset, profile_steps, progress) for c in groups[0]]
    return out


def _profile(contender, dataset, steps, progress, top=8):
    """Median op time per step by op type (ms, summed over threads) over ``steps`` steps."""
    import os
    import tempfile

    from tfdp_bench import trace
    _common.progress(f"embedding: profiling {steps} steps of {contender.name}", progress)
    logdir = tempfile.mkdtemp(prefix="tfdp-embedding-trace-")

    def run_steps(callbacks):
        contender.model.fit(dataset, epochs=1, steps_per_epoch=steps + 1, verbose=0,
                            callbacks=callbacks)

    path = trace.capture(run_steps, logdir)
    events = trace.load_events(path)
    marked = events["steps"][1:]  # the first step of a fit also starts the input iterators
    per_type = {}
    for s in marked:
        for e in events["events"]:
            if e["start_ns"] >= s["start_ns"] and e["end_ns"] <= s["end_ns"]:
                per_type.setdefault(e["type"], [0.0] * len(marked))
    for k, s in enumerate(marked):
        for e in events["events"]:
            if e["start_ns"] >= s["start_ns"] and e["end_ns"] <= s["end_ns"]:
                per_type[e["type"]][k] += (e["end_ns"] - e["start_ns"]) / 1e6
    rows = trace.step_timeline({"events": events["events"], "steps": marked})
    ranked = sorted(((t, statistics.median(v)) for t, v in per_type.items()),
                    key=lambda tv: -tv[1])
    return {"contender": contender.name, "optimizer": contender.optimizer, "steps": len(marked),
            "wall_ms": statistics.median(r["wall_ms"] for r in rows),
            "op_ms": sum(v for _, v in ranked), "top_op_types": [list(tv) for tv in ranked[:top]],
            "logdir": os.path.abspath(logdir)}


def format_embedding(result: dict) -> str:
    env = result["environment"]
    lines = [f"tfdp bench embedding: Embedding({result['vocab']:,} x {result['dim']}), "
             f"{result['ids']} ids per example, Dense(64) + Dense(1) head, MSE; global batch "
             f"{result['batch']}; fit(epochs={result['epochs']}, steps_per_epoch="
             f"{result['steps']}) x {result['rounds']} alternating rounds",
             f"{result['cpu_replicas']} CPU replicas ({env['cpu_cores']} cores), TF "
             f"{env['tensorflow']}, Keras {env['keras']}", ""]
    headers = ["optimizer", "contender", "fit ex/s", "vs MS (spread)", "step ms",
               "vs MS (spread)"]
    rows, last = [], None
    for r in result["results"]:
        if last is not None and r["optimizer"] != last:
            rows.append(None)
        last = r["optimizer"]
        rows.append([r["optimizer"], r["contender"], f"{r['median_examples_per_s']:,.0f}",
                     f"{r['fit_ratio_over_mirrored']:.2f}x ({r['fit_ratio_spread'][0]:.2f}-"
                     f"{r['fit_ratio_spread'][1]:.2f})",
                     f"{r['steady_median_step_ms']:.2f}",
                     f"{r['step_ratio_over_mirrored']:.2f}x ({r['step_ratio_spread'][0]:.2f}-"
                     f"{r['step_ratio_spread'][1]:.2f})"])
    lines.append(_common.render_table(headers, rows, right={2, 3, 4, 5}))
    lines += ["", "fit ex/s: median whole fit call; step ms: median steady step (batch end to "
                  "batch end within an epoch);",
              "vs MS: MirroredStrategy's median / this median (> 1: faster); spread: min-max of "
              "the per-round ratios."]
    for p in result.get("profile") or ():
        lines += ["", f"profile, {p['optimizer']} / {p['contender']}: {p['wall_ms']:.1f} ms wall "
                      f"per step, {p['op_ms']:.1f} ms of op time (all threads); by op type:"]
        lines += [f"  {t:<36} {ms:8.2f} ms" for t, ms in p["top_op_types"]]
    if not all(r["finite_loss"] for r in result["results"]):
        lines.append("warning: a loss was not finite; the figures still time the same work.")
    return "\n".join(lines)


# --- command line: tfdp bench embedding --------------------------------------------------------

def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench embedding",
                    description="Keras fit of a recommender-shaped model (a large Embedding, a "
                                "Dense head) under tfdp vs MirroredStrategy(ReductionToOneDevice) "
                                "on the same K CPU replicas, per optimizer, alternating rounds in "
                                "one process.")
    add_common_options(p)
    for name in ("vocab", "dim", "ids", "batch", "steps", "epochs", "rounds"):
        p.add_argument(f"--{name}", type=int, default=DEFAULTS[name], metavar="N",
                       help=f"default: {DEFAULTS[name]}")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), metavar="LIST",
                   help=f"comma-separated, from {', '.join(OPTIMIZERS)} (default: all)")
    p.add_argument("--no-before", action="store_true",
                   help="leave out the contender that reads the table as Keras does")
    p.add_argument("--no-reference", action="store_true",
                   help="leave out the one-device contender")
    p.add_argument("--profile", type=int, default=0, metavar="S",
                   help="profile S steady steps of each contender of the first optimizer")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    for name in ("cpu_replicas", "vocab", "dim", "ids", "batch", "steps", "epochs", "rounds"):
        check_positive("--" + name.replace("_", "-"), getattr(args, name))
    check_positive("--profile", args.profile, minimum=0)
    args.optimizers = [o.lower() for o in split_list(args.optimizers)]
    bad = [o for o in args.optimizers if o not in OPTIMIZERS]
    if bad or not args.optimizers:
        raise UsageError(f"Invalid --optimizers. Received: --optimizers "
                         f"{','.join(args.optimizers) or repr('')}. Valid: "
                         f"{', '.join(OPTIMIZERS)}.")
    if args.batch < args.cpu_replicas:
        raise UsageError(f"--batch is smaller than --cpu-replicas. Received: --batch "
                         f"{args.batch} --cpu-replicas {args.cpu_replicas}. Give every replica "
                         "at least one example per step.")
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    result = run_embedding(cpu_replicas=args.cpu_replicas, vocab=args.vocab, dim=args.dim,
                           ids=args.ids, batch=args.batch, steps=args.steps, epochs=args.epochs,
                           rounds=args.rounds, optimizers=args.optimizers,
                           before=not args.no_before, reference=not args.no_reference,
                           profile_steps=args.profile, progress=not args.quiet)
    print(format_embedding(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.embedding
    import sys

    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("embedding", parse_args, run))

"""``tfdp bench overhead``: what one replica costs: tfdp on one device vs plain Keras.

A single-GPU user or a laptop runs the same script with ``tfdp.DataParallelStrategy`` on one
device; it should cost nothing. The model is an MLP of ``--layers`` Dense(``--width``) layers
(relu, MSE on random data, SGD), global batch ``--batch``. Contenders, built once, warmed up,
then timed in alternating rounds in this one process:

* ``no strategy``: plain Keras (the reference, 1.00);
* ``tfdp 1 replica``: ``tfdp.DataParallelStrategy(["CPU:0"])``;
* ``MS 1 device``: ``tf.distribute.MirroredStrategy(["CPU:0"])`` (ReductionToOneDevice).

Per timed fit (``--steps`` steps): the median steady step (batch end to batch end) and the
process CPU time per step (``time.process_time``: less sensitive than wall time to other jobs on
a shared host). Figures: ratio of medians over the reference (< 1.03 is "costs nothing") with the
spread of the per-round ratios.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

from tfdp_bench import _common
from tfdp_bench.fit import build_mlp  # the same MLP as tfdp bench fit
from tfdp_bench.parser import BenchParser, check_positive, check_writable, write_json
from tfdp.errors import TfdpError

DEFAULTS = {"layers": 8, "width": 256, "batch": 256, "steps": 50, "rounds": 15}
WARMUP_STEPS = 5


def _dataset(width: int, batch: int, seed: int = 0):
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch * 4, width), dtype=np.float32)
    y = rng.standard_normal((batch * 4, width), dtype=np.float32)
    return (tf.data.Dataset.from_tensor_slices((x, y)).repeat()
            .batch(batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))


def _timer():
    import keras

    class Timer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.wall, self.cpu = [], []

        def on_train_batch_end(self, batch, logs=None):
            self.wall.append(time.perf_counter())
            self.cpu.append(time.process_time())

    return Timer()


class Contender:
    def __init__(self, name, kind, strategy, layers, width):
        import keras
        self.name, self.kind = name, kind
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            self.model = build_mlp(layers, width)
            self.model.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-3), loss="mse",
                               jit_compile=False)

    def fit(self, dataset, steps):
        timer = _timer()
        self.model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
        wall = [b - a for a, b in zip(timer.wall, timer.wall[1:])]
        cpu = (timer.cpu[-1] - timer.cpu[0]) / max(1, len(timer.cpu) - 1)
        return {"step_s": statistics.median(wall), "cpu_step_s": cpu}


def run_overhead(layers: int = DEFAULTS["layers"], width: int = DEFAULTS["width"],
                 batch: int = DEFAULTS["batch"], steps: int = DEFAULTS["steps"],
                 rounds: int = DEFAULTS["rounds"], mirrored: bool = True,
                 progress: bool = False) -> dict:
    for name, value in (("layers", layers), ("width", width), ("batch", batch),
                        ("steps", steps), ("rounds", rounds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise TfdpError(f"Invalid {name}. Received: {name}={value!r}. Pass an int >= 1.")
    if steps < 3:
        raise TfdpError(f"Invalid steps. Received: steps={steps}. Pass at least 3 (the first "
                        "step of a fit is not timed).")
    import tensorflow as tf

    from tfdp.strategy import DataParallelStrategy
    dataset = _dataset(width, batch)
    contenders = [Contender("no strategy", "single", None, layers, width),
                  Contender("tfdp 1 replica", "tfdp", DataParallelStrategy(["CPU:0"]), layers,
                            width)]
    if mirrored:
        ms = tf.distribute.MirroredStrategy(
            ["CPU:0"], cross_device_ops=tf.distribute.ReductionToOneDevice())
        contenders.append(Contender("MS 1 device", "mirrored", ms, layers, width))
    for c in contenders:
        _common.progress(f"overhead: warm-up {c.name}", progress)
        c.fit(dataset, WARMUP_STEPS)
    runs = [[] for _ in contenders]
    for r in range(rounds):
        _common.progress(f"overhead: round {r + 1}/{rounds}", progress)
        gc.collect()
        for i in _common.round_order(len(contenders), r):
            runs[i].append(contenders[i].fit(dataset, steps))
    base = runs[0]
    results = []
    for c, rs in zip(contenders, runs):
        out = {"contender": c.name, "kind": c.kind}
        for key in ("step_s", "cpu_step_s"):
            vals = [x[key] for x in rs]
            ratios = [v / b[key] for v, b in zip(rs, base) for v in [v[key]]]
            out[key] = vals
            out[f"median_{key[:-2]}_ms"] = 1e3 * statistics.median(vals)
            out[f"{key[:-2]}_ratio"] = statistics.median(vals) / statistics.median(
                [b[key] for b in base])
            out[f"{key[:-2]}_ratio_spread"] = [min(ratios), max(ratios)]
            out[f"{key[:-2]}_ratio_median_of_rounds"] = statistics.median(ratios)
        results.append(out)
    return {"benchmark": "overhead", "layers": layers, "width": width, "batch": batch,
            "steps": steps, "rounds": rounds, "results": results,
            "environment": _common.environment(),
            "notes": {"ratio": "this contender's median / no strategy's median (< 1.03: one "
                               "replica costs nothing)",
                      "spread": "min-max of the per-round ratios",
                      "cpu_step": "process CPU time per step (all threads)"}}


def format_overhead(result: dict) -> str:
    env = result["environment"]
    lines = [f"tfdp bench overhead: MLP {result['layers']} x Dense({result['width']}), global "
             f"batch {result['batch']}, SGD; {result['steps']} steps per fit, "
             f"{result['rounds']} alternating rounds; {env['cpu_cores']} cores, TF "
             f"{env['tensorflow']}, Keras {env['keras']}", ""]
    headers = ["contender", "step ms", "x no strategy (spread)", "CPU ms/step",
               "x no strategy (spread)"]
    rows = []
    for r in result["results"]:
        rows.append([r["contender"], f"{r['median_step_ms']:.2f}",
                     f"{r['step_ratio']:.3f} ({r['step_ratio_spread'][0]:.2f}-"
                     f"{r['step_ratio_spread'][1]:.2f})",
                     f"{r['median_cpu_step_ms']:.2f}",
                     f"{r['cpu_step_ratio']:.3f} ({r['cpu_step_ratio_spread'][0]:.2f}-"
                     f"{r['cpu_step_ratio_spread'][1]:.2f})"])
    lines.append(_common.render_table(headers, rows))
    lines += ["", "step ms: median steady step (wall); CPU ms/step: process CPU time per step; "
                  "x no strategy: ratio of medians (< 1.03: costs nothing), spread: min-max of "
                  "the per-round ratios."]
    return "\n".join(lines)


def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench overhead",
                    description="What one replica costs: Keras fit of an MLP under "
                                "tfdp.DataParallelStrategy(['CPU:0']) and MirroredStrategy on one "
                                "device vs plain Keras, alternating rounds in one process.")
    for name in ("layers", "width", "batch", "steps", "rounds"):
        p.add_argument(f"--{name}", type=int, default=DEFAULTS[name], metavar="N",
                       help=f"default: {DEFAULTS[name]}")
    p.add_argument("--no-mirrored", action="store_true", help="leave out MirroredStrategy")
    p.add_argument("--json", metavar="FILE", help="write every raw figure to FILE as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    for name in ("layers", "width", "batch", "rounds"):
        check_positive("--" + name, getattr(args, name))
    check_positive("--steps", args.steps, minimum=3)
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    result = run_overhead(layers=args.layers, width=args.width, batch=args.batch,
                          steps=args.steps, rounds=args.rounds, mirrored=not args.no_mirrored,
                          progress=not args.quiet)
    print(format_overhead(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.overhead
    import sys

    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("overhead", parse_args, run))

"""``tfdp bench syncbn``: what synchronized batch statistics cost in a ResNet-50 ``fit``.

Keras's ``BatchNormalization`` normalizes a replica's batch by that replica's own mean and
variance (as under MirroredStrategy); ``BatchNormalization(synchronized=True)`` all-reduces the
moments first, so every replica normalizes by the global batch's statistics, as one device does.
That is one small all-reduce per BatchNormalization layer in the forward pass (53 in ResNet-50)
and its gradient in the backward pass. This command measures it: ResNet-50
(``keras.applications.ResNet50(weights=None)``) with every BatchNormalization plain, and the same
model with every one synchronized, each under tfdp DataParallelStrategy and under
tf.distribute.MirroredStrategy on the same K CPU replicas. Rounds alternate timed
``model.fit(dataset, epochs=1, steps_per_epoch=steps)`` calls between the contenders; the cost
is the ratio of median steady steps (synchronized / plain) under each strategy.
"""

from __future__ import annotations

import gc
import statistics

from tfdp_bench import _common
from tfdp_bench.parser import BenchParser, add_common_options, check_positive, check_writable
from tfdp.errors import UsageError

DEFAULTS = {"image_size": 64, "batch": 32, "steps": 6, "repeats": 4, "classes": 10}


def resnet50(image_size: int, classes: int, synchronized: bool):
    """ResNet-50 with every BatchNormalization ``synchronized`` (built in the current scope)."""
    import keras
    model = keras.applications.ResNet50(weights=None, input_shape=(image_size, image_size, 3),
                                        classes=classes)
    if not synchronized:
        return model
    config = model.get_config()
    n = 0
    for layer in config["layers"]:
        if layer["class_name"] == "BatchNormalization":
            layer["config"]["synchronized"] = True
            n += 1
    if not n:
        raise RuntimeError("keras.applications.ResNet50 has no BatchNormalization layer to "
                           "synchronize: this benchmark needs updating for this Keras")
    return keras.Model.from_config(config)


def _dataset(image_size: int, batch: int, classes: int):
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch * 2, image_size, image_size, 3)).astype("float32")
    y = rng.integers(0, classes, batch * 2).astype("int32")
    return (tf.data.Dataset.from_tensor_slices((x, y)).repeat()
            .batch(batch, drop_remainder=True).prefetch(2))


class _Contender:
    def __init__(self, strategy_name, strategy, synchronized, image_size, classes):
        import keras
        self.strategy_name, self.synchronized = strategy_name, synchronized
        self.name = (f"{strategy_name}, "
                     f"{'BatchNormalization(synchronized=True)' if synchronized else 'plain BatchNormalization'}")
        with strategy.scope():
            self.model = resnet50(image_size, classes, synchronized)
            self.model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                               loss="sparse_categorical_crossentropy", jit_compile=False)
        self.bn_layers = sum(isinstance(layer, keras.layers.BatchNormalization)
                             for layer in self.model.layers)

    def fit(self, dataset, steps):
        from tfdp_bench.fit import _new_step_timer
        timer = _new_step_timer()
        self.model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, shuffle=False,
                       callbacks=[timer])
        ends = timer.batch_ends
        return [b - a for a, b in zip(ends, ends[1:])]     # the first step starts the input


def run_syncbn(cpu_replicas=4, image_size=DEFAULTS["image_size"], batch=DEFAULTS["batch"],
               steps=DEFAULTS["steps"], repeats=DEFAULTS["repeats"],
               classes=DEFAULTS["classes"], progress=False) -> dict:
    """Steady step times of the four contenders; returns every figure as a dict."""
    import tensorflow as tf

    from tfdp.strategy import DataParallelStrategy

    devices = _common.configure_replicas(cpu_replicas)
    dataset = _dataset(image_size, batch, classes)
    strategies = [("tfdp", DataParallelStrategy(devices)),
                  ("MirroredStrategy", tf.distribute.MirroredStrategy(devices))]
    contenders = []
    for name, strategy in strategies:
        for synchronized in (False, True):
            _common.progress(f"syncbn: building ResNet-50 under {name}, "
                             f"synchronized={synchronized}", progress)
            contenders.append(_Contender(name, strategy, synchronized, image_size, classes))
    for c in contenders:
        _common.progress(f"syncbn: warm-up (trace) {c.name}", progress)
        c.fit(dataset, 2)
    steps_s = [[] for _ in contenders]
    for r in range(repeats):
        _common.progress(f"syncbn: round {r + 1}/{repeats}", progress)
        gc.collect()
        for i in _common.round_order(len(contenders), r):
            steps_s[i].extend(contenders[i].fit(dataset, steps + 1))
    results = []
    for c, s in zip(contenders, steps_s):
        median = statistics.median(s)
        results.append({"contender": c.name, "strategy": c.strategy_name,
                        "synchronized": c.synchronized, "bn_layers": c.bn_layers,
                        "steady_step_s": s, "median_step_ms": median * 1e3,
                        "min_step_ms": min(s) * 1e3, "examples_per_s": batch / median})
    cost = {}
    for name, _ in strategies:
        plain, synced = (r for r in results if r["strategy"] == name)
        cost[name] = synced["median_step_ms"] / plain["median_step_ms"]
    return {"benchmark": "syncbn", "cpu_replicas": cpu_replicas, "devices": devices,
            "image_size": image_size, "batch": batch, "steps": steps, "repeats": repeats,
            "classes": classes, "results": results, "cost_synchronized_over_plain": cost,
            "environment": _common.environment(),
            "notes": {"steady_step_s": "intervals between consecutive batch ends inside the "
                                       "timed fits (each fit's first batch excluded)",
                      "cost_synchronized_over_plain": "median step with synchronized "
                                                      "BatchNormalization / with plain, under "
                                                      "each strategy: 1.05 = 5 % slower"}}


def format_syncbn(result: dict) -> str:
    env = result["environment"]
    bn = result["results"][0]["bn_layers"]
    lines = [f"tfdp bench syncbn: ResNet-50 ({bn} BatchNormalization layers), "
             f"{result['image_size']}x{result['image_size']} images, {result['classes']} "
             f"classes, global batch {result['batch']}, {result['steps']} steady steps per fit, "
             f"{result['repeats']} rounds",
             f"{result['cpu_replicas']} CPU replicas ({env['cpu_cores']} cores), TF "
             f"{env['tensorflow']}, Keras {env['keras']}", ""]
    rows = [[r["contender"], f"{r['median_step_ms']:,.0f}", f"{r['min_step_ms']:,.0f}",
             f"{r['examples_per_s']:,.1f}"] for r in result["results"]]
    lines.append(_common.render_table(["contender", "median step ms", "min step ms", "ex/s"],
                                      rows, right={1, 2, 3}))
    lines.append("")
    for name, ratio in result["cost_synchronized_over_plain"].items():
        lines.append(f"{name}: synchronized / plain step = {ratio:.3f} "
                     f"({(ratio - 1) * 100:+.1f} %)")
    return "\n".join(lines)


# --- command line: tfdp bench syncbn -------------------------------------------------------------

def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench syncbn",
                    description="What BatchNormalization(synchronized=True) costs: ResNet-50 "
                                "Keras fit with plain and with synchronized batch statistics, "
                                "under tfdp DataParallelStrategy and under "
                                "tf.distribute.MirroredStrategy on the same K CPU replicas; "
                                "rounds alternate, the cost is the ratio of median steady "
                                "steps.")
    add_common_options(p)
    for option, what in (("image-size", "image height and width"),
                         ("batch", "global batch size"),
                         ("steps", "steady steps timed per fit"),
                         ("repeats", "rounds"), ("classes", "output classes")):
        default = DEFAULTS[option.replace("-", "_")]
        p.add_argument(f"--{option}", type=int, default=default, metavar="N",
                       help=f"{what} (default: {default})")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    for name in ("cpu_replicas", "batch", "steps", "repeats"):
        check_positive("--" + name.replace("_", "-"), getattr(args, name))
    check_positive("--image-size", args.image_size, 32)   # ResNet50's smallest input
    check_positive("--classes", args.classes, 2)
    if args.batch < args.cpu_replicas:
        raise UsageError(f"--batch is smaller than --cpu-replicas. Received: --batch "
                         f"{args.batch} --cpu-replicas {args.cpu_replicas}. Give every replica "
                         "at least one example per step.")
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    from tfdp_bench.parser import write_json
    result = run_syncbn(cpu_replicas=args.cpu_replicas, image_size=args.image_size,
                        batch=args.batch, steps=args.steps, repeats=args.repeats,
                        classes=args.classes, progress=not args.quiet)
    print(format_syncbn(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.syncbn
    import sys

    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("syncbn", parse_args, run))

"""``tfdp bench gpu``: a one-shot GPU check, one table, in under 8 minutes on one GPU.

Sections, each in its own ``try`` (a failure is printed in its row; the other sections still run)
and with its own time budget (a run that would start after its section's budget is spent is
reported as skipped):

1. ``nccl``: whether this TensorFlow build has the NCCL all-reduce GPU kernel, and what
   ``DataParallelStrategy(all_reduce="auto")`` chooses on the first GPU alone, on the two
   logical GPUs, and on every physical GPU (with its reason).
2. ``equivalence``: Keras ``fit`` of a small model (conv + pooling + dense, SGD with momentum)
   for a few steps on one device without a strategy and under tfdp on 2 logical GPUs of one
   device (the first GPU split with ``tf.config.set_logical_device_configuration`` before the
   runtime starts): max |dw| over every variable (tfdp promises <= 1e-5 in float32).
3. ``resnet50``: Keras ``fit`` images/s of ResNet-50 (synthetic ImageNet shapes, 224x224x3,
   1000 classes, channels-last, ``mixed_float16``, SGD with momentum) on the first logical GPU:
   without a strategy, under MirroredStrategy and under tfdp, each with ``jit_compile=False``
   and ``True``; median steady step.
4. ``allreduce``: tfdp's fused all-reduce of float32 tensors in device memory across the 2
   logical GPUs (algbw and busbw = algbw * 2(n-1)/n) against a device-to-device copy of the same
   bytes between them (``tf.identity`` onto the other logical device) as the reference.

Without a GPU it prints one line saying so and exits 0. ``--cpu-dry-run`` runs the same sections
on 2 logical CPU devices with tiny sizes (a 2-block residual stand-in for ResNet-50, whose
XLA compilation takes minutes on CPU, on 32x32 images, batch 4; 64-256 KiB all-reduces): the
code paths, not the figures, which is what tests check here.
"""

from __future__ import annotations

import gc
import glob
import os
import statistics
import subprocess
import time
import traceback

from tfdp_bench import _common
from tfdp_bench.parser import BenchParser, check_writable, write_json
from tfdp.errors import UsageError

SECTIONS = ("nccl", "equivalence", "resnet50", "allreduce")
# seconds per section on a GPU (the whole check stays under 8 minutes; the runtime start and
# the table come on top)
BUDGETS_S = {"nccl": 20.0, "equivalence": 60.0, "resnet50": 270.0, "allreduce": 60.0}
# sizes: (GPU, --cpu-dry-run)
# --cpu-dry-run trains a 2-block residual stand-in: XLA needs minutes to compile ResNet-50 on CPU
RESNET = {"gpu": {"model": "resnet50", "image": 224, "classes": 1000, "batch": 256, "warmup": 5,
                  "steps": 20},
          "cpu": {"model": "tiny residual", "image": 32, "classes": 10, "batch": 4, "warmup": 1,
                  "steps": 2}}
ALLREDUCE_SIZES = {"gpu": (1 << 20, 16 << 20, 256 << 20), "cpu": (64 << 10, 256 << 10)}
EQUIVALENCE_TOL = 1e-5
LOGICAL_MEMORY_MB = 0.45  # share of the first GPU's memory each of the 2 logical GPUs gets


# --- detection (before TensorFlow starts) --------------------------------------------------------

def nvidia_device_nodes() -> list[str]:
    """``/dev/nvidia0``-style device nodes: without any, no CUDA GPU is usable here."""
    return sorted(glob.glob("/dev/nvidia[0-9]*"))


def gpu_memory_mb() -> int | None:
    """The first GPU's total memory in MiB from ``nvidia-smi`` (None when unavailable)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20)
        return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def no_gpu_reason() -> str | None:
    """Why there is no GPU to check (None: TensorFlow sees at least one). May import TF."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "CUDA_VISIBLE_DEVICES hides every GPU"
    if not nvidia_device_nodes():
        return "no NVIDIA device (/dev/nvidia*) on this machine"
    import tensorflow as tf
    if not tf.config.list_physical_devices("GPU"):
        built = "built with CUDA" if tf.test.is_built_with_cuda() else "built without CUDA"
        return f"TensorFlow {tf.__version__} ({built}) sees no GPU"
    return None


def configure_devices(dry_run: bool) -> dict:
    """Split the first GPU (or, dry run, the CPU) into 2 logical devices; names and facts.

    Must run before TensorFlow's runtime starts.
    """
    import tensorflow as tf
    if dry_run:
        devices = _common.configure_replicas(2)
        return {"kind": "cpu", "logical": devices, "physical": 1, "memory_mb": None}
    gpus = tf.config.list_physical_devices("GPU")
    total = gpu_memory_mb()
    limit = int((total or 16384) * LOGICAL_MEMORY_MB)
    tf.config.set_logical_device_configuration(
        gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=limit)] * 2)
    logical = [d.name for d in tf.config.list_logical_devices("GPU")]
    from tfdp import devices as devices_lib
    return {"kind": "gpu", "logical": [devices_lib.canonical(n) for n in logical[:2]],
            "all_logical": [devices_lib.canonical(n) for n in logical],
            "physical": len(gpus), "memory_mb": total, "logical_memory_mb": limit,
            "name": tf.config.experimental.get_device_details(gpus[0]).get("device_name")}


# --- sections ------------------------------------------------------------------------------------

class Budget:
    """A section's time budget: ``left()`` seconds; ``check(what)`` raises once it is spent."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def spent(self) -> bool:
        return self.left() <= 0


def section_nccl(env, budget):
    import tensorflow as tf

    from tfdp.compat.tf_internals import nccl_kernel_registered
    from tfdp.strategy import DataParallelStrategy
    rows = [["nccl", "NCCL kernel", "registered" if nccl_kernel_registered()
             else "absent", f"TF {tf.__version__}, built with CUDA: "
             f"{tf.test.is_built_with_cuda()}"]]
    first = env["logical"][:1]
    cases = [("auto on 1 device", first), ("auto on 2 logical", env["logical"])]
    if env["kind"] == "gpu" and env["physical"] > 1:  # one logical GPU per physical one
        cases.append((f"auto on {env['physical']} physical",
                      env["all_logical"][:1] + env["all_logical"][2:]))
    for label, devices in cases:
        s = DataParallelStrategy(devices)
        rows.append(["nccl", label, s.all_reduce, s.extended.tfdp_choice.reason])
    return rows


def _equivalence_model(keras, seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def section_equivalence(env, budget):
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdp.strategy import DataParallelStrategy
    rng = np.random.default_rng(0)
    x = rng.standard_normal((96, 8, 8, 3)).astype("float32")
    y = rng.integers(0, 10, 96)

    def train(strategy):
        if strategy is None:
            model = _equivalence_model(keras, 0)
        else:
            with strategy.scope():
                model = _equivalence_model(keras, 0)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        return [np.array(v) for v in model.variables]

    # float32 means float32: TF32 matmuls/convolutions (on by default on Ampere and later) round
    # differently for different batch splits
    tf32 = tf.config.experimental.tensor_float_32_execution_enabled()
    tf.config.experimental.enable_tensor_float_32_execution(False)
    try:
        with _device(env["logical"][0]):
            ref = train(None)
        got = train(DataParallelStrategy(env["logical"]))
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(tf32)
    dw = max(float(np.max(np.abs(a - b))) for a, b in zip(ref, got))
    verdict = "ok" if dw <= EQUIVALENCE_TOL else "DIFFERS"
    return [["equivalence", f"fit, {len(env['logical'])} logical devices vs 1",
             f"max|dw| {dw:.1e} ({verdict})",
             f"conv+pool+dense, SGD momentum, 2 epochs of 3 batches of 32, float32 (no "
             f"TF32); promise <= {EQUIVALENCE_TOL:g}"]]


class _device:
    """``with tf.device(name)`` built lazily (TF is imported only when a section runs)."""

    def __init__(self, name):
        import tensorflow as tf
        self._ctx = tf.device(name)

    def __enter__(self):
        return self._ctx.__enter__()

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def _resnet_run(strategy, device, size, jit, budget):
    """Median steady step (s) of ResNet-50 fit under ``strategy`` (None: on ``device``)."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfdp_bench.fit import _new_step_timer
    rng = np.random.default_rng(0)
    b, hw, k = size["batch"], size["image"], size["classes"]
    x = rng.standard_normal((b, hw, hw, 3)).astype("float32")
    y = rng.integers(0, k, b)
    ds = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)

    def build():
        if size["model"] == "resnet50":
            model = keras.applications.ResNet50(weights=None, input_shape=(hw, hw, 3),
                                                classes=k)
        else:
            model = _tiny_residual(keras, hw, k)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss="sparse_categorical_crossentropy", jit_compile=jit)
        return model

    if strategy is None:
        with _device(device):
            model = build()
    else:
        with strategy.scope():
            model = build()
    model.fit(ds, epochs=1, steps_per_epoch=size["warmup"], verbose=0)
    if budget.spent():
        raise TimeoutError("time budget spent during the warm-up")
    timer = _new_step_timer()
    model.fit(ds, epochs=1, steps_per_epoch=size["steps"] + 1, verbose=0, callbacks=[timer])
    ends = timer.batch_ends
    steps = [b2 - a for a, b2 in zip(ends, ends[1:])]
    return statistics.median(steps)


def _tiny_residual(keras, hw, classes):
    """Two residual conv blocks (conv, BatchNorm, ReLU, add), channels-last: the dry run's model."""
    inputs = keras.Input((hw, hw, 3))
    x = keras.layers.Conv2D(16, 3, padding="same")(inputs)
    for _ in range(2):
        y = keras.layers.Conv2D(16, 3, padding="same")(x)
        y = keras.layers.BatchNormalization()(y)
        x = keras.layers.ReLU()(keras.layers.Add()([x, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(classes, activation="softmax", dtype="float32")(x)
    return keras.Model(inputs, outputs, name="tiny_residual")


def section_resnet50(env, budget, dry_run):
    import keras
    import tensorflow as tf

    from tfdp.strategy import DataParallelStrategy
    size = RESNET["cpu" if dry_run else "gpu"]
    device = env["logical"][0]
    rows = []
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        base, took = {}, {}
        for jit in (False, True):
            for name, make in (("no strategy", lambda: None),
                               ("MirroredStrategy", lambda: tf.distribute.MirroredStrategy(
                                   [device])),
                               ("tfdp", lambda: DataParallelStrategy([device]))):
                label = f"{name}{', jit' if jit else ''}"
                expected = took.get(jit, 0.0)  # a run like the last one must fit in the budget
                if budget.left() < expected:
                    rows.append(["resnet50", label, "skipped",
                                 f"section time budget: {budget.left():.0f} s left, a run takes "
                                 f"about {expected:.0f} s"])
                    continue
                t0 = time.monotonic()
                try:
                    step = _resnet_run(make(), device, size, jit, budget)
                except Exception as e:  # one failing contender keeps the others
                    rows.append(["resnet50", label, "error", _one_line(e)])
                    continue
                finally:
                    took[jit] = time.monotonic() - t0
                    keras.backend.clear_session()  # free the model before the next one
                    gc.collect()
                ips = size["batch"] / step
                base.setdefault(jit, ips if name == "no strategy" else None)
                ref = base.get(jit)
                rows.append(["resnet50", label, f"{ips:,.1f} images/s",
                             f"step {step * 1e3:.1f} ms"
                             + (f", {ips / ref:.2f}x no strategy" if ref and name != "no "
                                "strategy" else "")
                             + f" ({time.monotonic() - t0:.0f} s)"])
    finally:
        keras.mixed_precision.set_global_policy(policy)
    shape = (f"{size['model']}, batch {size['batch']} of {size['image']}x{size['image']}x3, "
             f"{size['classes']} classes, mixed_float16, channels-last, 1 {env['kind'].upper()}")
    rows.insert(0, ["resnet50", "workload", shape, f"median of {size['steps']} steady steps"])
    return rows


def section_allreduce(env, budget, dry_run):
    import numpy as np
    import tensorflow as tf

    from tfdp.strategy import DataParallelStrategy
    devices = env["logical"]
    n = len(devices)
    strategy = DataParallelStrategy(devices, all_reduce="fused")
    rows = []
    for nbytes in ALLREDUCE_SIZES["cpu" if dry_run else "gpu"]:
        label = _common.fmt_bytes(nbytes)
        if budget.spent():
            rows.append(["allreduce", label, "skipped", "section time budget spent"])
            continue
        count = nbytes // 4
        per_device = []
        for r, d in enumerate(devices):
            with tf.device(d):
                per_device.append(tf.random.stateless_uniform([count], seed=(r, 1)))
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: per_device[ctx.replica_id_in_sync_group])

        @tf.function
        def step(v):
            return strategy.run(
                lambda g: tf.distribute.get_replica_context().all_reduce("SUM", g), args=(v,))

        @tf.function
        def copy(t):
            with tf.device(devices[1]):
                return tf.identity(t)

        def sync(out):
            return float(tf.reduce_sum(out[:1]).numpy())

        got = strategy.experimental_local_results(step(values))[-1].numpy()
        want = per_device[0].numpy() + per_device[1].numpy() if n == 2 else None
        if want is not None and not np.allclose(got, want, rtol=1e-5, atol=1e-5):
            rows.append(["allreduce", label, "WRONG RESULT",
                         f"max error {float(np.max(np.abs(got - want))):.3g}"])
            continue
        ar, _ = _common.time_samples(
            lambda: sync(strategy.experimental_local_results(step(values))[-1]), repeats=5)
        cp, _ = _common.time_samples(lambda: sync(copy(per_device[0])), repeats=5)
        t_ar, t_cp = statistics.median(ar), statistics.median(cp)
        algbw = nbytes / t_ar / 1e9
        rows.append(["allreduce", label,
                     f"algbw {algbw:.2f} GB/s, busbw {algbw * _common.busbw_factor(n):.2f} GB/s",
                     f"{t_ar * 1e3:.3f} ms; device-to-device copy {nbytes / t_cp / 1e9:.2f} GB/s "
                     f"({t_cp * 1e3:.3f} ms)"])
    return rows


def _one_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


# --- the check -----------------------------------------------------------------------------------

def run_gpu_check(dry_run: bool = False, sections=SECTIONS, progress: bool = True,
                  budgets: dict | None = None) -> dict:
    """Run the sections (on the GPU, or on 2 logical CPU devices with ``dry_run``); a dict.

    Returns {"gpu": False, "reason"} when there is no GPU (and ``dry_run`` is off), else
    {"gpu", "dry_run", "environment", "devices", "rows": [[section, item, result, detail]],
    "sections": {name: {"seconds", "budget_s", "error"}}}.
    """
    if not dry_run:
        reason = no_gpu_reason()
        if reason is not None:
            return {"gpu": False, "reason": reason}
    env = configure_devices(dry_run)
    budgets = dict(BUDGETS_S, **(budgets or {}))
    rows, info = [], {}
    for name in sections:
        _common.progress(f"gpu check: {name} (budget {budgets[name]:.0f} s)", progress)
        budget = Budget(budgets[name])
        t0 = time.monotonic()
        error = None
        try:
            fn = {"nccl": lambda: section_nccl(env, budget),
                  "equivalence": lambda: section_equivalence(env, budget),
                  "resnet50": lambda: section_resnet50(env, budget, dry_run),
                  "allreduce": lambda: section_allreduce(env, budget, dry_run)}[name]
            rows += fn()
        except Exception as e:  # the section's error goes in the table; the others still run
            error = _one_line(e)
            rows.append([name, "error", error, "see --json for the traceback"])
            info.setdefault("tracebacks", {})[name] = traceback.format_exc()
        info[name] = {"seconds": time.monotonic() - t0, "budget_s": budgets[name],
                      "error": error}
    return {"gpu": not dry_run, "dry_run": dry_run, "devices": env, "rows": rows,
            "sections": info, "environment": _common.environment()}


def format_gpu_check(result: dict) -> str:
    if not result.get("gpu") and not result.get("dry_run"):
        return f"tfdp bench gpu: no GPU here ({result['reason']}); nothing to check."
    env = result["devices"]
    head = ("tfdp bench gpu --cpu-dry-run: the GPU sections on 2 logical CPU devices, tiny "
            "sizes (code paths only, not figures)" if result["dry_run"] else
            f"tfdp bench gpu: {env.get('name') or 'GPU'} ({env['physical']} physical, "
            f"{env.get('memory_mb') or '?'} MiB; 2 logical GPUs of "
            f"{env.get('logical_memory_mb')} MiB on the first)")
    e = result["environment"]
    head += f"; TF {e['tensorflow']}, Keras {e['keras']}, tfdp {e['tfdp']}"
    rows = []
    last = None
    for r in result["rows"]:
        if last is not None and r[0] != last:
            rows.append(None)
        rows.append([r[0] if r[0] != last else "", *r[1:]])
        last = r[0]
    times = ", ".join(f"{k} {v['seconds']:.0f} s" for k, v in result["sections"].items()
                      if isinstance(v, dict) and "seconds" in v)
    return "\n".join([head, "", _common.render_table(["section", "item", "result", "detail"],
                                                      rows, right=set()), "",
                      f"section times: {times}"])


# --- command line: tfdp bench gpu ----------------------------------------------------------------

def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench gpu", description=__doc__.split("\n\n")[0] + " Sections: "
                    "NCCL kernel and 'auto''s choice; Keras fit equivalence on 2 logical GPUs of "
                    "one device; ResNet-50 images/s (tfdp vs MirroredStrategy vs no strategy, "
                    "with and without jit_compile); fused all-reduce GB/s in device memory vs a "
                    "device-to-device copy. Without a GPU: one line, exit 0.")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="run every section on 2 logical CPU devices with tiny sizes (exercises "
                        "the code paths here; the figures mean nothing)")
    p.add_argument("--sections", metavar="S,...", default=",".join(SECTIONS),
                   help=f"sections to run, from {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--json", metavar="FILE", help="write every row (and tracebacks) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def parse_args(argv):
    from tfdp_bench.parser import split_list
    args = build_parser().parse_args(argv)
    names = split_list(args.sections)
    if not names or any(n not in SECTIONS for n in names):
        raise UsageError(f"Invalid --sections. Received: --sections {args.sections}. Valid: "
                         f"{', '.join(SECTIONS)} (comma-separated).")
    args.sections = [s for s in SECTIONS if s in names]
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    result = run_gpu_check(dry_run=args.cpu_dry_run, sections=args.sections,
                           progress=not args.quiet)
    print(format_gpu_check(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.gpu
    import sys

    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("gpu", parse_args, run))

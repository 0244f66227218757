"""The sections of ``tfdp bench gpu`` (:mod:`tfdp_bench.gpu`): each takes the devices and its time
budget and returns its rows ``[section, item, result, detail]``.

* ``nccl``, ``equivalence``, ``resnet50``, ``allreduce``: see :mod:`tfdp_bench.gpu`;
* ``zero``: ResNet-50 ``fit`` with Adam on the 2 logical GPUs under
  ``DataParallelStrategy(zero_stage=0 | 1 | 2)`` (sharded optimizer state, ``tfdp.zero``):
  images/s, the optimizer-state bytes on each GPU (from the variables' devices) and each GPU's
  peak memory (``tf.config.experimental.get_memory_info``; not available for CPU devices).

TensorFlow is imported only when a section runs.
"""

from __future__ import annotations

import gc
import statistics
import time

from tfdp_bench import _common

# sizes: (GPU, --cpu-dry-run)
# --cpu-dry-run trains a 2-block residual stand-in: XLA needs minutes to compile ResNet-50 on CPU
RESNET = {"gpu": {"model": "resnet50", "image": 224, "classes": 1000, "batch": 256, "warmup": 5,
                  "steps": 20},
          "cpu": {"model": "tiny residual", "image": 32, "classes": 10, "batch": 4, "warmup": 1,
                  "steps": 2}}
# the zero section: ResNet-50 on the 2 logical GPUs (a global batch split over them), Adam
ZERO = {"gpu": dict(RESNET["gpu"], warmup=3, steps=10), "cpu": dict(RESNET["cpu"], batch=8)}
ZERO_STAGES = (0, 1, 2)
ALLREDUCE_SIZES = {"gpu": (1 << 20, 16 << 20, 256 << 20), "cpu": (64 << 10, 256 << 10)}
EQUIVALENCE_TOL = 1e-5


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


def _resnet_run(strategy, device, size, jit, budget, optimizer=None, out=None):
    """Median steady step (s) of ResNet-50 fit under ``strategy`` (None: on ``device``).

    ``optimizer``: a function returning the Keras optimizer (default: SGD with momentum);
    ``out``: a dict that receives the trained ``"model"``.
    """
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
        opt = optimizer() if optimizer else keras.optimizers.SGD(0.01, momentum=0.9)
        model.compile(optimizer=opt, loss="sparse_categorical_crossentropy", jit_compile=jit)
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
    if out is not None:
        out["model"] = model
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


def _peak_memory(devices) -> list | None:
    """Each device's peak allocator bytes since the last reset (None: not available, e.g. CPU)."""
    import tensorflow as tf
    try:
        return [int(tf.config.experimental.get_memory_info(d)["peak"]) for d in devices]
    except (ValueError, RuntimeError, KeyError):
        return None


def _reset_memory(devices) -> None:
    import tensorflow as tf
    for d in devices:
        try:
            tf.config.experimental.reset_memory_stats(d)
        except (ValueError, RuntimeError):
            return


def _mib(values) -> str:
    """'1.2G / 640M' (one value per device, binary units)."""
    return " / ".join(_common.fmt_bytes(v) for v in values)


def section_zero(env, budget, dry_run):
    """ResNet-50 fit with Adam on the 2 logical devices, zero_stage 0, 1, 2: images/s and memory
    per device (sharded optimizer state, ``tfdp.zero``)."""
    import keras

    from tfdp.strategy import DataParallelStrategy
    from tfdp_bench.zero import optimizer_bytes_per_device
    size = ZERO["cpu" if dry_run else "gpu"]
    devices = env["logical"]
    kind = env["kind"].upper()
    rows, base, took = [], None, 0.0
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        for stage in ZERO_STAGES:
            label = f"zero_stage={stage}"
            if budget.left() < took:  # a run like the last one must fit in the budget
                rows.append(["zero", label, "skipped", f"section time budget: {budget.left():.0f}"
                             f" s left, a run takes about {took:.0f} s"])
                continue
            t0 = time.monotonic()
            kept = {}
            try:
                strategy = DataParallelStrategy(devices, zero_stage=stage)
                _reset_memory(devices)
                step = _resnet_run(strategy, None, size, False, budget,
                                   optimizer=lambda: keras.optimizers.Adam(1e-4), out=kept)
                opt_bytes = optimizer_bytes_per_device(strategy, kept["model"].optimizer)
                peak = _peak_memory(devices)
            except Exception as e:  # one failing stage keeps the others
                rows.append(["zero", label, "error", _one_line(e)])
                continue
            finally:
                took = time.monotonic() - t0
                kept.clear()
                keras.backend.clear_session()
                gc.collect()
            ips = size["batch"] / step
            base = ips if stage == 0 else base
            detail = (f"optimizer state per {kind}: {_mib(opt_bytes)}; peak memory per {kind}: "
                      + (_mib(peak) if peak is not None else f"n/a on {kind}")
                      + f"; step {step * 1e3:.1f} ms"
                      + (f", {ips / base:.2f}x zero_stage=0" if base and stage else "")
                      + f" ({took:.0f} s)")
            rows.append(["zero", label, f"{ips:,.1f} images/s", detail])
    finally:
        keras.mixed_precision.set_global_policy(policy)
    shape = (f"{size['model']}, Adam, global batch {size['batch']} of {size['image']}x"
             f"{size['image']}x3 over {len(devices)} logical {kind}s, mixed_float16")
    rows.insert(0, ["zero", "workload", shape, f"median of {size['steps']} steady steps"])
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

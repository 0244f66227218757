"""``tfdp bench zero``: sharded optimizer state (``zero_stage``) against unsharded, in one run.

Three parts, each contender side by side with the others:

* memory: for a recommender (Embedding 200,000 x 64 + Dense head), a ResNet-50-shaped and a
  BERT-base-shaped model with Adam on K CPU replicas: the optimizer-state bytes on each device
  (the live variables after 3 training steps, unsharded vs ``zero_stage=1``) and the peak
  process memory of that run (``ru_maxrss`` growth over the same process before the model),
  each contender in a fresh subprocess;
* speed: Keras ``fit`` of the recommender shape (batch 256) with Adam and with momentum under
  ``tf.distribute.MirroredStrategy`` (ReductionToOneDevice), tfdp unsharded, ``zero_stage=1``
  and ``zero_stage=2``; and ``tfdp bench fit``'s dense MLP (60 x 64, batch 256) with its SGD, with
  momentum and with Adam, unsharded vs ``zero_stage=1``; warmed up, then alternating rounds;
  the median steady step (batch end to batch end) and ratios of medians with their spread;
* ``--workers N``: the recommender fit with Adam and with momentum in one job of N local
  workers x ``--worker-replicas`` replicas (default 2): unsharded and ``zero_stage=1`` (owners
  over each worker's replicas).
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time

from tfdp_bench import _common
from tfdp_bench.parser import (BenchParser, add_common_options, check_positive, check_writable,
                               split_list, write_json)
from tfdp.errors import TfdpError, UsageError

MODELS = ("recommender", "resnet50", "bert_base")
DEFAULTS = {"rounds": 5, "steps": 20, "mlp_steps": 40, "memory_steps": 3, "timeout": 900}
RESULT_PREFIX = "TFDP_ZERO_RESULT "
REC = {"vocab": 200_000, "dim": 64, "ids": 4, "batch": 256}


# --- the models (shapes only matter) -----------------------------------------------------------

def build_model(name: str):
    """(model, batch maker (n) -> (x, y)) of a model shape of this benchmark."""
    import keras
    import numpy as np
    rng = np.random.default_rng(0)
    if name == "recommender":
        from tfdp_bench.embedding import build_model as rec
        return rec(REC["vocab"], REC["dim"], REC["ids"]), lambda n: (
            rng.integers(0, REC["vocab"], (n, REC["ids"])).astype("int32"),
            rng.standard_normal((n, 1)).astype("float32"))
    if name == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=1000)
        return model, lambda n: (rng.standard_normal((n, 32, 32, 3)).astype("float32"),
                                 rng.integers(0, 1000, (n,)).astype("int32"))
    if name == "bert_base":
        return _bert_base(), lambda n: (rng.integers(0, 30522, (n, 16)).astype("int32"),
                                        rng.integers(0, 2, (n,)).astype("int32"))
    raise TfdpError(f"Invalid model. Received: {name!r}. Valid: {', '.join(MODELS)}.")


def _bert_base(layers=12, width=768, heads=12, ffn=3072, vocab=30522, positions=512):
    """BERT-base's variables (110 M parameters) in a Keras encoder over 16 tokens."""
    import keras
    ids = keras.Input((16,), dtype="int32")
    x = keras.layers.Embedding(vocab, width, name="token_embedding")(ids)
    pos = keras.layers.Embedding(positions, width, name="position_embedding")(
        keras.ops.arange(16)[None, :])
    x = keras.layers.LayerNormalization()(x + pos)
    for i in range(layers):
        a = keras.layers.MultiHeadAttention(heads, width // heads, name=f"attention_{i}")(x, x)
        x = keras.layers.LayerNormalization()(x + a)
        f = keras.layers.Dense(ffn, activation="gelu", name=f"ffn_in_{i}")(x)
        x = keras.layers.LayerNormalization()(x + keras.layers.Dense(width,
                                                                     name=f"ffn_out_{i}")(f))
    pooled = keras.layers.Dense(width, activation="tanh", name="pooler")(x[:, 0])
    return keras.Model(ids, keras.layers.Dense(2, name="classifier")(pooled), name="bert_base")


def _loss(name):
    return "mse" if name == "recommender" else "sparse_categorical_crossentropy"


def optimizer_bytes_per_device(strategy, optimizer) -> list[int]:
    """Bytes of ``optimizer``'s variables held on each of the strategy's local devices."""
    import tensorflow as tf

    from tfdp import devices as devices_lib
    devices = [devices_lib.canonical(d) for d in strategy.extended.worker_devices]
    out = [0] * len(devices)
    for v in optimizer.variables:
        value = getattr(v, "value", v)
        comps = (value.values if isinstance(value, tf.distribute.DistributedValues)
                 else getattr(value, "variables", None) or [value])  # (row pieces)
        for c in comps:
            dev = devices_lib.canonical(c.device)
            if dev in devices:
                out[devices.index(dev)] += int(c.shape.num_elements()) * c.dtype.size
    return out


# --- memory: one contender per subprocess ------------------------------------------------------

def _memory_child(config):
    import resource
    devices = _common.configure_replicas(config["replicas"])
    import keras
    import numpy as np
    import tensorflow as tf

    import tfdp
    strategy = tfdp.DataParallelStrategy(devices, zero_stage=config["stage"])
    gc.collect()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with strategy.scope():
        model, batch = build_model(config["model"])
        model.compile(keras.optimizers.Adam(1e-4), _loss(config["model"]), jit_compile=False)
    x, y = batch(config["batch"] * config["steps"])
    model.fit(x, y, batch_size=config["batch"], epochs=1, verbose=0, shuffle=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = int(sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
                     for v in model.trainable_variables))
    zero = strategy.extended.tfdp_zero
    plan = zero.plans[0] if zero is not None and zero.plans else None
    print(RESULT_PREFIX + json.dumps({
        "model": config["model"], "stage": config["stage"], "param_bytes": params,
        "optimizer_bytes_per_device": optimizer_bytes_per_device(strategy, model.optimizer),
        "peak_rss_growth": peak - base,
        "plan_largest_share": None if plan is None else plan.largest_share(),
        "plan_table": None if plan is None else plan.table()}), flush=True)


def run_memory(models, replicas: int, steps: int, timeout: float, progress: bool) -> list:
    out = []
    for name in models:
        batch = {"recommender": 256, "resnet50": 8, "bert_base": 8}[name]
        for stage in (0, 1):
            _common.progress(f"zero: memory, {name}, zero_stage={stage}", progress)
            config = {"model": name, "stage": stage, "replicas": replicas, "steps": steps,
                      "batch": batch}
            cmd = [sys.executable, "-m", "tfdp_bench.zero", "--memory-child", json.dumps(config)]
            env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
            env.pop("TFDP_CPU_REPLICAS", None)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)),
                        None)
            if proc.returncode != 0 or line is None:
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-8:])
                out.append({"model": name, "stage": stage, "error": tail})
                continue
            out.append(json.loads(line[len(RESULT_PREFIX):]))
    return out


# --- speed: contenders side by side in this process --------------------------------------------

class _Fit:
    """One compiled model under one strategy; ``fit(steps)`` returns its steady step times."""

    def __init__(self, name, strategy, model_fn, optimizer, data, batch, loss="mse"):
        import contextlib
        self.name, self.data, self.batch = name, data, batch
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            self.model = model_fn()
            self.model.compile(optimizer=optimizer(), loss=loss, jit_compile=False)

    def fit(self, steps):
        from tfdp_bench.embedding import _step_timer
        timer = _step_timer()
        self.model.fit(self.data, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[timer])
        return [b - a for ends in timer.epochs for a, b in zip(ends, ends[1:])]


def _optimizer(name):
    import keras
    return {"sgd": lambda: keras.optimizers.SGD(0.01),
            "momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9),
            "adam": lambda: keras.optimizers.Adam(1e-3)}[name]


def _alternate(contenders, rounds, steps, progress, label):
    for c in contenders:  # warm-up: trace, start the input pipeline
        c.fit(3)
    times = [[] for _ in contenders]
    for r in range(rounds):
        _common.progress(f"zero: {label}, round {r + 1}/{rounds}", progress)
        gc.collect()
        for i in _common.round_order(len(contenders), r):
            times[i].append(statistics.median(contenders[i].fit(steps)))
    return times


def _ratios(times, base):
    med = [statistics.median(t) for t in times]
    out = []
    for t, m in zip(times, med):
        per_round = [b / x for b, x in zip(times[base], t)]
        out.append({"step_ms": 1e3 * m, "round_step_ms": [1e3 * x for x in t],
                    "ratio": med[base] / m, "spread": [min(per_round), max(per_round)]})
    return out


def run_speed(devices, rounds, steps, mlp_steps, progress) -> list:
    import tensorflow as tf

    import tfdp
    from tfdp_bench import embedding, fit
    results = []
    rec_data = embedding._dataset(REC["vocab"], REC["ids"], REC["batch"])
    for opt in ("adam", "momentum"):
        def rec_model():
            return embedding.build_model(REC["vocab"], REC["dim"], REC["ids"])
        cs = [_Fit("MirroredStrategy", tf.distribute.MirroredStrategy(
            devices, cross_device_ops=tf.distribute.ReductionToOneDevice()),
            rec_model, _optimizer(opt), rec_data, REC["batch"])]
        for stage in (0, 1, 2):
            cs.append(_Fit(f"tfdp zero_stage={stage}",
                           tfdp.DataParallelStrategy(devices, zero_stage=stage),
                           rec_model, _optimizer(opt), rec_data, REC["batch"]))
        times = _alternate(cs, rounds, steps, progress, f"recommender {opt}")
        vs_ms, vs_tfdp = _ratios(times, 0), _ratios(times, 1)
        for c, a, b in zip(cs, vs_ms, vs_tfdp):
            results.append({"model": "recommender", "optimizer": opt, "contender": c.name,
                            "step_ms": a["step_ms"], "round_step_ms": a["round_step_ms"],
                            "vs_mirrored": a["ratio"], "vs_mirrored_spread": a["spread"],
                            "vs_unsharded": b["ratio"], "vs_unsharded_spread": b["spread"]})
    mlp_data = fit._dataset(64, 256)
    for opt in ("sgd", "momentum", "adam"):
        cs = [_Fit(f"tfdp zero_stage={stage}",
                   tfdp.DataParallelStrategy(devices, zero_stage=stage),
                   lambda: fit.build_mlp(60, 64), _optimizer(opt), mlp_data, 256)
              for stage in (0, 1)]
        times = _alternate(cs, rounds, mlp_steps, progress, f"mlp {opt}")
        for c, a in zip(cs, _ratios(times, 0)):
            results.append({"model": "mlp 60x64", "optimizer": opt, "contender": c.name,
                            "step_ms": a["step_ms"], "round_step_ms": a["round_step_ms"],
                            "vs_mirrored": None, "vs_mirrored_spread": None,
                            "vs_unsharded": a["ratio"], "vs_unsharded_spread": a["spread"]})
    return results


# --- across workers ----------------------------------------------------------------------------

def _worker_main(config):
    """One worker of the --workers job: every contender in this process, alternating."""
    import dataclasses

    import tfdp
    strategy = tfdp.DataParallelStrategy()
    from tfdp_bench import embedding
    ext = strategy.extended
    states = {}

    def use(stage):
        # one multi-worker strategy per process: each contender keeps its own sharding state
        ext.tfdp_settings = dataclasses.replace(ext.tfdp_settings, zero_stage=stage)
        if stage not in states:
            ext.__dict__.pop("_tfdp_zero_state", None)
            states[stage] = ext.tfdp_zero
        ext.__dict__["_tfdp_zero_state"] = states[stage]

    data = embedding._dataset(REC["vocab"], REC["ids"], REC["batch"])
    # (optimizer, zero_stage): each optimizer's sharded run against its own unsharded one
    plan = [("adam", 0), ("adam", 1), ("momentum", 0), ("momentum", 1)]
    keys = [stage for _, stage in plan]
    names = [f"{'unsharded' if stage == 0 else 'zero_stage=1'}, {opt}" for opt, stage in plan]
    cs = []
    for (opt, stage), name in zip(plan, names):
        use(stage)
        cs.append(_Fit(name, strategy, lambda: embedding.build_model(
            REC["vocab"], REC["dim"], REC["ids"]), _optimizer(opt), data, REC["batch"]))
    for i, c in enumerate(cs):
        use(keys[i])
        c.fit(3)
    times = [[] for _ in cs]
    for r in range(config["rounds"]):
        for i in _common.round_order(len(cs), r):
            use(keys[i])
            times[i].append(statistics.median(cs[i].fit(config["steps"])))
    if strategy.cluster.rank == 0:
        plans = [states[k].plans[0].largest_share() if states[k] and states[k].plans else None
                 for k in keys]
        base = [names.index(f"unsharded, {opt}") for opt, _ in plan]
        print(RESULT_PREFIX + json.dumps({"names": names, "times": times, "base": base,
                                          "largest_share": plans}), flush=True)


def run_workers(workers, rounds, steps, timeout, progress, replicas=2) -> dict:
    config = {"rounds": rounds, "steps": steps}
    cmd = [sys.executable, "-m", "tfdp", "launch", "--workers", str(workers), "--cpu-replicas",
           str(replicas), "--timeout", str(int(timeout)), "--", sys.executable, "-m", "tfdp_bench.zero",
           "--worker-config", json.dumps(config)]
    _common.progress(f"zero: {workers} workers x {replicas} replicas, recommender with Adam and "
                     "momentum", progress)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout + 60)
    line = next((ln for ln in proc.stdout.splitlines() if RESULT_PREFIX in ln), None)
    if proc.returncode != 0 or line is None:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise TfdpError(f"The {workers}-worker job failed. Received: exit code "
                        f"{proc.returncode}; last output:\n{tail}")
    raw = json.loads(line.split(RESULT_PREFIX, 1)[1])
    ratios = [_ratios(raw["times"], b)[i] for i, b in enumerate(raw["base"])]
    return {"workers": workers, "replicas_per_worker": replicas,
            "results": [dict(contender=n, largest_share=s, **r) for n, s, r in
                        zip(raw["names"], raw["largest_share"], ratios)]}


# --- the command -------------------------------------------------------------------------------

def run_zero(cpu_replicas=4, models=MODELS, rounds=DEFAULTS["rounds"], steps=DEFAULTS["steps"],
             mlp_steps=DEFAULTS["mlp_steps"], memory_steps=DEFAULTS["memory_steps"],
             workers=0, parts=("memory", "speed"), timeout=DEFAULTS["timeout"],
             progress=False, worker_replicas=2) -> dict:
    out = {"benchmark": "zero", "cpu_replicas": cpu_replicas, "rounds": rounds, "steps": steps}
    if "memory" in parts:
        out["memory"] = run_memory(models, cpu_replicas, memory_steps, timeout, progress)
    if "speed" in parts:
        devices = _common.configure_replicas(cpu_replicas)
        out["speed"] = run_speed(devices, rounds, steps, mlp_steps, progress)
    if workers:
        out["workers"] = run_workers(workers, rounds, steps, timeout, progress, worker_replicas)
    out["environment"] = _common.environment()
    return out


def format_zero(result: dict) -> str:
    from tfdp.zero.plan import human_bytes
    k = result["cpu_replicas"]
    lines = [f"tfdp bench zero: {k} CPU replicas, {result['rounds']} alternating rounds"]
    mem = result.get("memory") or []
    if mem:
        lines += ["", "Memory, Adam (2 slots per variable), 3 training steps; per device: the "
                      "optimizer variables on the largest device; peak: ru_maxrss growth:", ""]
        rows = []
        by = {(m["model"], m["stage"]): m for m in mem}
        for name in dict.fromkeys(m["model"] for m in mem):
            a, b = by.get((name, 0), {}), by.get((name, 1), {})
            if "error" in a or "error" in b or not a or not b:
                err = (a.get("error") or b.get("error") or "failed").splitlines()[-1]
                rows.append([name, "-", "-", "-", "-", "-", "-", err[-60:]])
                continue
            ua, ub = max(a["optimizer_bytes_per_device"]), max(b["optimizer_bytes_per_device"])
            rows.append([name, human_bytes(a["param_bytes"]), human_bytes(ua), human_bytes(ub),
                         f"{ub / ua:.2f}", human_bytes(a["peak_rss_growth"]),
                         human_bytes(b["peak_rss_growth"]),
                         f"{b['peak_rss_growth'] / max(a['peak_rss_growth'], 1):.2f}"])
        lines.append(_common.render_table(
            ["model", "weights", "opt. state/device unsharded", "sharded", "ratio",
             "peak unsharded", "peak sharded", "ratio"], rows, right={1, 2, 3, 4, 5, 6, 7}))
    speed = result.get("speed") or []
    if speed:
        lines += ["", "Speed: median steady step (batch end to batch end), ratios of medians "
                      "(> 1: faster) with the per-round spread:", ""]
        rows, last = [], None
        for r in speed:
            if last is not None and (r["model"], r["optimizer"]) != last:
                rows.append(None)
            last = (r["model"], r["optimizer"])
            ms = ("-" if r["vs_mirrored"] is None else
                  f"{r['vs_mirrored']:.2f}x ({r['vs_mirrored_spread'][0]:.2f}-"
                  f"{r['vs_mirrored_spread'][1]:.2f})")
            rows.append([r["model"], r["optimizer"], r["contender"], f"{r['step_ms']:.1f}", ms,
                         f"{r['vs_unsharded']:.2f}x ({r['vs_unsharded_spread'][0]:.2f}-"
                         f"{r['vs_unsharded_spread'][1]:.2f})"])
        lines.append(_common.render_table(
            ["model", "optimizer", "contender", "step ms", "vs MirroredStrategy",
             "vs tfdp unsharded"], rows, right={3, 4, 5}))
    w = result.get("workers")
    if w:
        lines += ["", f"Across {w['workers']} workers x {w['replicas_per_worker']} replicas on "
                      "127.0.0.1, recommender with Adam and with momentum (each against its "
                      "own unsharded run):", ""]
        rows = [[r["contender"], f"{r['step_ms']:.1f}",
                 f"{r['ratio']:.2f}x ({r['spread'][0]:.2f}-{r['spread'][1]:.2f})",
                 "-" if r["largest_share"] is None else f"{100 * r['largest_share']:.1f} %"]
                for r in w["results"]]
        lines.append(_common.render_table(["contender", "step ms", "vs unsharded",
                                           "largest owner's share"], rows, right={1, 2, 3}))
    return "\n".join(lines)


def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench zero",
                    description="Sharded optimizer state (DataParallelStrategy(zero_stage=1|2)) "
                                "against unsharded tfdp and MirroredStrategy: optimizer-state "
                                "bytes per device and peak memory (recommender, ResNet-50, "
                                "BERT-base shapes), Keras fit speed (recommender, dense MLP), "
                                "and --workers N across local workers.")
    add_common_options(p)
    p.add_argument("--models", default=",".join(MODELS), metavar="LIST",
                   help=f"memory part: from {', '.join(MODELS)} (default: all)")
    p.add_argument("--parts", default="memory,speed", metavar="LIST",
                   help="memory, speed (default: both)")
    for name in ("rounds", "steps", "mlp_steps", "memory_steps", "timeout"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=DEFAULTS[name],
                       metavar="N", help=f"default: {DEFAULTS[name]}")
    p.add_argument("--workers", type=int, default=0, metavar="N",
                   help="also the recommender across N local workers (default: 0)")
    p.add_argument("--worker-replicas", type=int, default=2, metavar="K",
                   help="CPU replicas per worker with --workers (default: 2)")
    p.add_argument("--memory-child", help="(internal: one memory contender)")
    p.add_argument("--worker-config", help="(internal: run as one worker of the job)")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    if args.memory_child or args.worker_config:
        return args
    for name in ("cpu_replicas", "rounds", "steps", "mlp_steps", "memory_steps", "timeout",
                 "worker_replicas"):
        check_positive("--" + name.replace("_", "-"), getattr(args, name))
    args.models = split_list(args.models)
    bad = [m for m in args.models if m not in MODELS]
    if bad or not args.models:
        raise UsageError(f"Invalid --models. Received: --models {','.join(args.models)!r}. "
                         f"Valid: {', '.join(MODELS)}.")
    args.parts = split_list(args.parts)
    if not args.parts or any(p not in ("memory", "speed") for p in args.parts):
        raise UsageError(f"Invalid --parts. Received: --parts {','.join(args.parts)!r}. Valid: "
                         "memory, speed.")
    if args.workers == 1 or args.workers < 0:
        raise UsageError(f"Invalid --workers. Received: --workers {args.workers}. Give 0 or "
                         "an integer >= 2.")
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    if args.memory_child:
        _memory_child(json.loads(args.memory_child))
        return 0
    if args.worker_config:
        _worker_main(json.loads(args.worker_config))
        return 0
    t0 = time.perf_counter()
    result = run_zero(args.cpu_replicas, args.models, args.rounds, args.steps, args.mlp_steps,
                      args.memory_steps, args.workers, args.parts, args.timeout,
                      progress=not args.quiet, worker_replicas=args.worker_replicas)
    result["seconds"] = time.perf_counter() - t0
    print(format_zero(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.zero
    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("zero", parse_args, run))

"""One ``tfdp train`` run: strategy -> data -> model -> ``fit`` -> evaluate -> summary -> targets.

The same code runs on one CPU, N local devices (logical CPU replicas or GPUs) and M workers under
``tfdp launch``: it only calls ``tfdp.DataParallelStrategy()`` and ``tfdp.data``. Everything that
communicates (fit, evaluate, the all-reduce estimate, the straggler report) runs on every worker in
the same order.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

from tfdp.train.config import Config


@dataclasses.dataclass
class Result:
    """What a run measured (``tfdp.train.run`` returns it; ``tfdp train`` prints it)."""

    name: str
    replicas: int
    workers: int
    rank: int
    devices: list
    global_batch_size: int
    replica_batches: list
    steps_per_epoch: int
    epochs: int
    seconds: float
    data: str
    synthetic: bool
    params: int
    lr: str
    throughput: dict
    eval_metrics: dict
    train_metrics: dict
    allreduce: dict | None = None
    baseline: dict | None = None
    stragglers: object = None
    targets: list = dataclasses.field(default_factory=list)   # (key, figure, target, ok, label)
    strategy_repr: str = ""
    phases: dict = dataclasses.field(default_factory=dict)    # name -> seconds

    @property
    def scaling_efficiency(self) -> float | None:
        if not self.baseline or not self.throughput:
            return None
        ideal = self.replicas * self.baseline["examples_per_sec"]
        return self.throughput["examples_per_sec"] / ideal if ideal > 0 else None

    @property
    def missed(self) -> list:
        return [t for t in self.targets if not t[3]]


def _say(text, rank, file=None):
    if rank == 0:
        print(text, flush=True, file=file)


def _have_tensorboard() -> bool:
    import importlib.util
    return importlib.util.find_spec("tensorboard") is not None


def cpu_replicas_choice(cfg: Config, env_n: int | None) -> tuple[int, str]:
    """How many CPU replicas, and why: ``--set strategy.cpu_replicas`` (an argument) >
    ``TFDP_CPU_REPLICAS`` (the environment; ``tfdp launch --cpu-replicas`` sets it) > the
    config's ``[strategy] cpu_replicas`` (with ``--tiny``: at most 2)."""
    n = cfg["strategy"]["cpu_replicas"]
    if "strategy.cpu_replicas" in cfg.cli_keys:
        if env_n is not None and env_n != n:
            return n, (f"--set strategy.cpu_replicas={n} (overrides TFDP_CPU_REPLICAS={env_n}: "
                       "arguments win over the environment)")
        return n, f"--set strategy.cpu_replicas={n}"
    if env_n is not None:
        if env_n != n:
            return env_n, (f"TFDP_CPU_REPLICAS={env_n} (overrides the config's "
                           f"cpu_replicas = {n})")
        return env_n, f"TFDP_CPU_REPLICAS={env_n}"
    return n, f"[strategy] cpu_replicas = {n}" + ("  (--tiny: at most 2)" if cfg.tiny else "")


def _make_strategy(cfg: Config):
    import tensorflow as tf

    import tfdp
    from tfdp.devices import cpu_replicas_from_env
    s = cfg["strategy"]
    cfg.cpu_replicas_why = None
    if not tf.config.list_physical_devices("GPU"):
        env_n = cpu_replicas_from_env()
        n, cfg.cpu_replicas_why = cpu_replicas_choice(cfg, env_n)
        if n != env_n:
            tfdp.configure_cpu_replicas(n)   # quiet: the run's header line says why
    comp = None if s["compression"] == "none" else s["compression"]
    return tfdp.DataParallelStrategy(all_reduce=s["all_reduce"], bucket_bytes=s["bucket_bytes"],
                                     compression=comp, zero_stage=s["zero_stage"])


def _optimizer(train_cfg, lr):
    import keras
    name = train_cfg["optimizer"]
    wd = train_cfg["weight_decay"] or None
    if name == "sgd":
        return keras.optimizers.SGD(lr, momentum=train_cfg["momentum"], weight_decay=wd)
    if name == "adamw":
        return keras.optimizers.AdamW(lr, weight_decay=train_cfg["weight_decay"] or 0.004)
    return keras.optimizers.Adam(lr, weight_decay=wd)


def run(cfg: Config) -> Result:
    """Run the job described by ``cfg`` (a :func:`tfdp.train.load` result)."""
    t_start = time.perf_counter()
    strategy = _make_strategy(cfg)   # first: a multi-worker runtime must start before other ops

    import keras

    from tfdp.callbacks import Throughput, num_workers, straggler_report, worker_rank
    from tfdp.data import replica_batch_sizes, steps_per_epoch
    from tfdp.devices import short_name
    from tfdp.train import data as data_lib
    from tfdp.train import lr as lr_lib
    from tfdp.train import models, monitor
    from tfdp.train.schedule import WarmupSchedule

    replicas = strategy.num_replicas_in_sync
    workers, rank = num_workers(strategy), worker_rank(strategy)
    devices = [short_name(d) for d in strategy.extended.worker_devices]
    B = cfg["data"]["global_batch_size"]
    tr, mon = cfg["train"], cfg["monitor"]
    seed = cfg["job"]["seed"]

    if B < replicas and cfg.tiny and "data.global_batch_size" not in cfg.cli_keys:
        B = cfg["data"]["global_batch_size"] = replicas   # --tiny's small batch, many replicas
    if B < replicas:   # exact (an empty replica adds nothing), but those replicas idle
        _say(f"tfdp train: warning: data.global_batch_size={B} on {replicas} replicas: "
             f"{replicas - B} replica(s) get no examples in every step (the result is still "
             f"exact); use at least {replicas} to keep every replica busy", rank, sys.stderr)
    data = data_lib.build(cfg)
    if data.num_train is None:    # [data] builder: steps from the datasets' cardinality
        full_pass = data.steps(strategy, B)
        if full_pass is None and not tr["steps_per_epoch"]:
            from tfdp.errors import UsageError, message
            raise UsageError(message(
                "[train] steps_per_epoch is needed: the data.builder's training set has no "
                "known length", f"data.builder={cfg['data']['builder']!r}",
                "Set [train] steps_per_epoch = N (or return a finite dataset)."))
        steps = tr["steps_per_epoch"] or full_pass
        eval_steps = tr["eval_steps"]
    else:
        full_pass = steps_per_epoch(data.num_train, B)
        steps = tr["steps_per_epoch"] or full_pass
        eval_steps = min(tr["eval_steps"] or math.inf, steps_per_epoch(data.num_eval, B))
    plan = lr_lib.plan(tr, B, steps)

    def build_model():   # under strategy.scope(): distributed; outside: one local device
        keras.utils.set_random_seed(seed)
        if "builder" in cfg["model"]:
            from tfdp.train import builders
            model, loss, metrics, weighted = builders.build_model(cfg["model"], cfg.path)
        else:
            model, loss, metrics, weighted = models.build(cfg["model"], data.info)
        if plan["warmup_steps"] or plan["schedule"] != "constant":
            lr = WarmupSchedule(plan["base_lr"], plan["peak_lr"], plan["warmup_steps"],
                                plan["total_steps"], plan["schedule"])
        else:
            lr = plan["peak_lr"]
        model.compile(_optimizer(tr, lr), loss, metrics=metrics, weighted_metrics=weighted)
        return model

    with strategy.scope():
        model = build_model()
    params = model.count_params()
    sizes = replica_batch_sizes(B, replicas)
    per = str(sizes[0]) if len(set(sizes)) == 1 else f"{min(sizes)}-{max(sizes)}"
    why = f"; CPU replicas from {cfg.cpu_replicas_why}" if cfg.cpu_replicas_why else ""
    _say(f"tfdp train: {cfg.name} ({cfg.path}){'  [--tiny]' if cfg.tiny else ''}\n"
         f"  strategy  {strategy!r}\n"
         f"            {replicas} replicas = {workers} worker(s) x {len(devices)} "
         f"{'GPU' if 'GPU' in devices[0] else 'CPU replica'}(s){why}\n"
         f"  data      {data.description}\n"
         f"  batch     global {B} = {per} per replica; {steps} steps/epoch x {tr['epochs']} "
         f"epoch(s)\n"
         f"  model     {model.name}, {params:,} parameters\n"
         f"  lr        {plan['text']} ({tr['optimizer']})", rank)
    if data.synthetic:
        _say(f"  NOTE      SYNTHETIC data: {data.name} is a stand-in; its metrics are not those "
             "of a real dataset", rank)

    log_dir = mon["log_dir"]
    if log_dir and workers > 1:
        import os
        log_dir = os.path.join(log_dir, f"worker{rank}")
    meter = Throughput(B, replicas, log_dir=log_dir, skip_steps=1,
                       examples_per_epoch=data.num_train if steps == full_pass else None,
                       stragglers=False)
    callbacks = [meter]
    if log_dir and _have_tensorboard():   # Keras's callback needs the tensorboard package
        callbacks.append(keras.callbacks.TensorBoard(log_dir, write_graph=False))
    verbose = 1 if sys.stdout.isatty() else 2
    phases = {"setup": time.perf_counter() - t_start}
    t = time.perf_counter()
    train_ds = data.train(strategy, B, cfg["data"]["shuffle_seed"])
    history = model.fit(train_ds, epochs=tr["epochs"], steps_per_epoch=steps, verbose=verbose,
                        shuffle=False,  # tfdp.data shuffles (seed, epoch)
                        callbacks=callbacks)
    phases["fit"] = time.perf_counter() - t
    zero = strategy.extended.tfdp_zero if strategy.zero_stage else None
    effect = zero.effect_line() if zero is not None else None
    if effect:   # (the header's strategy line names the stage; the tfdp logger is quiet here)
        _say(f"  sharded   {effect.removeprefix('tfdp: ')}", rank)
    n_bn = tr["precise_bn_batches"]
    if n_bn:
        from tfdp.train import precise_bn
        layers = precise_bn.batchnorm_layers(model)
        if layers:
            t = time.perf_counter()
            per_replica = max(1, B // replicas)
            used = precise_bn.recompute(model, data.local(per_replica).take(n_bn), strategy)
            phases["precise BN"] = time.perf_counter() - t
            _say(f"  precise BN  moving statistics of {len(layers)} BatchNormalization layer(s) "
                 f"recomputed from {used} training batches of {per_replica} with the final "
                 "weights ([train] precise_bn_batches; 0: off)", rank)
    t = time.perf_counter()
    train_metrics = {k: float(v[-1]) for k, v in history.history.items()}
    eval_metrics = model.evaluate(data.eval(strategy, B), steps=eval_steps, verbose=0,
                                  return_dict=True)
    eval_metrics = {k: float(v) for k, v in eval_metrics.items()}
    throughput = meter.summary()
    phases["evaluate"] = time.perf_counter() - t
    t = time.perf_counter()

    allreduce = None
    if mon["allreduce_estimate"] and replicas > 1:
        allreduce = monitor.estimate_allreduce(strategy, model,
                                               exclude_ids=models.embedding_variables(model),
                                               repeats=3 if cfg.tiny else 7)
    baseline = None
    want_stragglers = mon["stragglers"] and workers > 1
    if mon["scaling_baseline"]:
        baseline = monitor.local_baseline(build_model, data,
                                          max(1, B // replicas), mon["baseline_steps"])
    elif want_stragglers:   # (a forward-pass probe: no fresh model, no train step to trace)
        baseline = monitor.local_compute(model, data, max(1, B // replicas),
                                         min(10, mon["baseline_steps"]))
    stragglers = None
    if want_stragglers:
        figures = {"compute_ms_p50": baseline.get("step_time_ms_p50", 0.0),
                   **meter.straggler_figures()}
        stragglers = straggler_report(strategy, figures,
                                      rank_by=("compute_ms_p50", "host_gap_ms_p50"))

    phases["monitoring"] = time.perf_counter() - t
    waited = stragglers.waited_s(rank) if stragglers is not None else 0.0
    if waited >= 0.05:   # the all-gather's wait for a slower worker: that worker's time, not ours
        phases["monitoring"] -= waited
        phases["waiting for the slowest worker"] = waited
    result = Result(
        name=cfg.name, replicas=replicas, workers=workers, rank=rank, devices=devices,
        global_batch_size=B, replica_batches=sizes, steps_per_epoch=steps, epochs=tr["epochs"],
        seconds=time.perf_counter() - t_start, data=data.description, synthetic=data.synthetic,
        params=params, lr=plan["text"], throughput=throughput, eval_metrics=eval_metrics,
        train_metrics=train_metrics, allreduce=allreduce,
        baseline=baseline if mon["scaling_baseline"] else None, stragglers=stragglers,
        strategy_repr=repr(strategy), phases=phases)
    result.targets = check_targets(cfg.targets, result)
    return result


# --- targets and summary (plain Python) -----------------------------------------------------------

TARGET_FIGURES = {
    # key: (label, how to read it from a Result, higher is better)
    "min_accuracy": ("test accuracy", lambda r: r.eval_metrics.get("accuracy"), True),
    "max_loss": ("test loss", lambda r: r.eval_metrics.get("loss"), False),
    "min_auc": ("test AUC", lambda r: r.eval_metrics.get("auc"), True),
    "max_step_time_ms": ("p50 step time (ms)",
                         lambda r: r.throughput.get("step_time_ms_p50"), False),
    "min_examples_per_sec": ("examples/s", lambda r: r.throughput.get("examples_per_sec"), True),
    "min_scaling_efficiency": ("scaling efficiency", lambda r: r.scaling_efficiency, True),
}


def check_targets(targets: dict, result) -> list:
    """``[(key, figure, target, ok, label)]`` for every target (a missing figure fails)."""
    out = []
    for key, target in targets.items():
        label, read, higher = TARGET_FIGURES[key]
        figure = read(result)
        ok = figure is not None and (figure >= target if higher else figure <= target)
        out.append((key, figure, target, ok, label))
    return out


def _cores() -> int:
    import os
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _fmt(v, digits=4):
    if v is None:
        return "not measured"
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"


def summary(r: Result) -> str:
    t = r.throughput
    per = (str(r.replica_batches[0]) if len(set(r.replica_batches)) == 1
           else f"{min(r.replica_batches)}-{max(r.replica_batches)}")
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in r.phases.items())
    lines = [f"tfdp train: {r.name} finished in {r.seconds:.1f} s ({phases})",
             f"  replicas      {r.replicas} ({r.workers} worker(s) x {len(r.devices)}: "
             f"{', '.join(r.devices)})",
             f"  batch         global {r.global_batch_size}, per replica {per}"]
    if t:
        lines.append(f"  throughput    {t['examples_per_sec']:,.0f} examples/s, "
                     f"{t['examples_per_sec_per_replica']:,.0f} per replica "
                     f"({t['steps']} steps measured; the first, with tracing, left out)")
        lines.append(f"  step time     p50 {t['step_time_ms_p50']:.1f} ms, p90 "
                     f"{t['step_time_ms_p90']:.1f} ms, p99 {t['step_time_ms_p99']:.1f} ms")
    else:
        lines.append("  throughput    not measured (a single step: the first is left out)")
    if r.allreduce:
        a = r.allreduce
        share = (f" = ~{a['ms'] / t['step_time_ms_p50']:.0%} of the p50 step"
                 if t and t.get("step_time_ms_p50") else "")
        excl = (f"; {a['excluded']} embedding table(s) left out (sparse, all-gathered)"
                if a["excluded"] else "")
        lines.append(f"  all-reduce    ~{a['ms']:.1f} ms per step{share} -- ESTIMATE: a separate "
                     f"micro-benchmark of {a['tensors']} gradient-shaped tensors "
                     f"({a['floats']:,} values) through the same strategy, not "
                     f"measured inside training (overlap not counted){excl}")
    elif r.replicas == 1:
        lines.append("  all-reduce    none (1 replica)")
    else:
        lines.append("  all-reduce    not estimated ([monitor] allreduce_estimate = false)")
    if r.baseline:
        b = r.baseline
        eff = r.scaling_efficiency
        ideal = r.replicas * b["examples_per_sec"]
        lines.append(f"  scaling       efficiency {eff:.2f}: {r.replicas} replicas "
                     f"{t.get('examples_per_sec', 0):,.0f} examples/s vs 1 replica "
                     f"{b['examples_per_sec']:,.0f} examples/s at batch "
                     f"{max(1, r.global_batch_size // r.replicas)} (x{r.replicas} = "
                     f"{ideal:,.0f} ideal)"
                     + (f"; CPU replicas share the host's cores: with all {r.replicas} on this "
                        f"host's {_cores()} core(s), at most {min(1.0, _cores() / r.replicas):.2f}"
                        if "CPU" in r.devices[0] else ""))
    if r.stragglers is not None:
        lines.append(f"  stragglers    {r.stragglers.text()}")
    ev = ", ".join(f"{k} {_fmt(v)}" for k, v in r.eval_metrics.items())
    trn = ", ".join(f"{k} {_fmt(v)}" for k, v in r.train_metrics.items())
    lines.append(f"  final metrics test: {ev}" + ("   [SYNTHETIC data]" if r.synthetic else ""))
    lines.append(f"                train (last epoch): {trn}")
    for key, figure, target, ok, label in r.targets:
        op = ">=" if TARGET_FIGURES[key][2] else "<="
        lines.append(f"  target        {key}: {label} {_fmt(figure)} {op} {target:g}: "
                     + ("OK" if ok else "MISSED"))
    return "\n".join(lines)

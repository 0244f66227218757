"""``tfdp bench allreduce``: one replica-context all-reduce, tfdp vs MirroredStrategy.

Each contender is a strategy over the same K logical CPU devices and one ``tf.function``::

    strategy.run(lambda *g: tf.distribute.get_replica_context().all_reduce("SUM", list(g)),
                 args=per_replica_grads)

where ``per_replica_grads`` are random float32 tensors created once on each replica's device (the
same tensors for every contender). Contenders: ``DataParallelStrategy`` for each requested
algorithm, bucket size and compression; ``MirroredStrategy`` with its default cross-device ops
(on CPUs TF 2.21 picks ``CollectiveAllReduce`` with RING collectives) and with
``ReductionToOneDevice``; and two references: numpy's K-way ``np.add`` of the same arrays into a
preallocated output (one thread, no broadcast: a memory-bound floor, not an all-reduce) and the
memory-bandwidth reference, one ``np.add`` of two buffers of the workload's size into a third.

``--workers N`` (:mod:`tfdp_bench.workers`) runs the same measurement across N local worker
processes instead, against MultiWorkerMirroredStrategy.

Bandwidths follow nccl-tests: ``algbw = bytes / time`` with ``bytes`` one replica's gradients,
``busbw = algbw * 2 (K-1) / K``.
"""

from __future__ import annotations

import contextlib
import gc
import math
import time

import importlib.util

from tfdp_bench import _common, workers
from tfdp_bench._common import (BENCH_ALGORITHMS, CHECK_TOLERANCE, COMPRESSIONS, MEMORY_NAME,
                                describe_cross_device_ops, normalize_compressions, tfdp_name)
from tfdp_bench.parser import (BenchParser, add_common_options, check_positive, check_writable,
                               split_list, write_json)
from tfdp.errors import TfdpError, UsageError
from tfdp_bench.allreduce_report import (  # noqa: F401 (re-exported: the output)
    REFERENCE_KINDS, format_allreduce, write_plot)
from tfdp_bench.workloads import (  # noqa: F401 (re-exported: the workloads, as before)
    DEFAULT_SIZES, MODELS, _num_elements, mlp_shapes, resnet50_shapes, workloads_for)

DEFAULT_ALGORITHMS = BENCH_ALGORITHMS
DEFAULT_REPEATS = 15
# Each timed sample repeats a contender's step until it lasts about this long (at most MAX_ITERS
# times), so that microsecond-scale steps are not lost in timer and Python noise.
TARGET_SAMPLE_S = 0.02
MAX_ITERS = 50
_START = [0.0]  # run_allreduce's start, for the elapsed time in progress lines


# --- contenders ----------------------------------------------------------------------------------

class _Contender:
    def __init__(self, name, kind, strategy=None, **info):
        self.name = name
        self.kind = kind
        self.strategy = strategy
        self.info = info

    def make_step(self, per_device, devices):
        """A zero-argument callable running one all-reduce of ``per_device`` (list per replica)."""
        if self.kind == "numpy":
            return _numpy_step(per_device)
        if self.kind == "memory":
            nbytes = 4 * sum(int(t.shape.num_elements()) for t in per_device[0])
            return _common.MemoryReference(nbytes).step
        import tensorflow as tf
        strategy = self.strategy
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: tuple(per_device[ctx.replica_id_in_sync_group]))
        if len(per_device[0]) == 1 and not isinstance(values, (tuple, list)):
            values = (values,)

        def replica_fn(*g):
            return tf.distribute.get_replica_context().all_reduce("SUM", list(g))

        @tf.function
        def step():
            return strategy.run(replica_fn, args=tuple(values))

        return step

    def local_results(self, out):
        """Replica results of a step's output, as numpy arrays per tensor (last replica)."""
        if self.kind == "numpy":
            return out
        return [self.strategy.experimental_local_results(v)[-1].numpy() for v in out]


def _numpy_step(per_device):
    import numpy as np
    arrays = [[t.numpy() for t in replica] for replica in per_device]
    outs = [np.empty_like(a) for a in arrays[0]]
    k = len(arrays)

    def step():
        for i, out in enumerate(outs):
            if k == 1:
                np.copyto(out, arrays[0][i])
                continue
            np.add(arrays[0][i], arrays[1][i], out=out)
            for r in range(2, k):
                np.add(out, arrays[r][i], out=out)
        return outs

    return step


def build_contenders(devices, algorithms, bucket_bytes_list,
                     compressions=(None,)) -> tuple[list, str]:
    """The contenders (tfdp ones first) and the description of MirroredStrategy's default."""
    import tensorflow as tf

    from tfdp.strategy import DataParallelStrategy
    contenders = []
    for alg in algorithms:
        for bb in bucket_bytes_list:
            for comp in compressions:
                s = DataParallelStrategy(devices, all_reduce=alg, bucket_bytes=bb,
                                         compression=comp)
                contenders.append(_Contender(
                    tfdp_name(alg, s.bucket_bytes, s.compression), "tfdp", s,
                    algorithm=s.all_reduce, bucket_bytes=s.bucket_bytes,
                    compression=s.compression))
    ms = tf.distribute.MirroredStrategy(devices)
    default_desc = describe_cross_device_ops(ms)
    contenders.append(_Contender(f"MS {default_desc}", "mirrored", ms,
                                 cross_device_ops=default_desc, default=True))
    ms1 = tf.distribute.MirroredStrategy(devices,
                                         cross_device_ops=tf.distribute.ReductionToOneDevice())
    contenders.append(_Contender("MS ReductionToOneDevice", "mirrored", ms1,
                                 cross_device_ops=describe_cross_device_ops(ms1), default=False))
    contenders.append(_Contender(f"numpy {len(devices)}-way sum", "numpy",
                                 note="np.add into a preallocated output; one thread, no "
                                      "broadcast; memory-bound floor"))
    contenders.append(_Contender(MEMORY_NAME, "memory",
                                 note="np.add(a, b, out=c) over float32 buffers of the "
                                      "workload's size: the memory-bandwidth reference"))
    return contenders, default_desc


# --- measurement ---------------------------------------------------------------------------------

def _make_tensors(shapes, devices, seed=0):
    import tensorflow as tf
    per_device = []
    for r, d in enumerate(devices):
        with tf.device(d):
            per_device.append([tf.random.stateless_uniform(shape, seed=(seed + r, i),
                                                           minval=-1.0, maxval=1.0)
                               for i, shape in enumerate(shapes)])
    return per_device


@contextlib.contextmanager
def _quiet_retracing_warning():
    """Silence TF's "N out of the last M calls ... triggered tf.function retracing" warning.

    Every contender traces its own tf.function made from the same code, which TF's heuristic
    reads as retracing in a loop; here that is intended.
    """
    import tensorflow as tf
    logger = tf.get_logger()
    level = logger.level
    logger.setLevel("ERROR")
    try:
        yield
    finally:
        logger.setLevel(level)


def _check(contender, out, expected, workload_name, k):
    import numpy as np
    if contender.kind == "memory":
        return
    got = contender.local_results(out)
    tol = CHECK_TOLERANCE[contender.info.get("compression")] * max(1, k)
    for idx in expected:
        if not np.allclose(got[idx], expected[idx], rtol=tol, atol=tol):
            raise TfdpError(
                f"Wrong all-reduce result. Received: contender {contender.name!r} on workload "
                f"{workload_name!r}, tensor {idx}: max error "
                f"{float(np.max(np.abs(got[idx] - expected[idx]))):.3g}. This is a bug: please "
                "report it with this command line.")


def _measure(workload, contenders, devices, repeats, show_progress):
    import numpy as np
    shapes = workload["shapes"]
    per_device = _make_tensors(shapes, devices)
    # Every contender's result (on the last replica) is checked once against numpy's sum.
    expected = {i: np.sum([rep[i].numpy() for rep in per_device], axis=0)
                for i in range(len(shapes))}
    steps, warm, iters = [], [], []
    for c in contenders:
        step = c.make_step(per_device, devices)
        with _quiet_retracing_warning():
            out = step()  # traces
        _check(c, out, expected, workload["name"], len(devices))
        del out
        t0 = time.perf_counter()
        step()
        warm.append(time.perf_counter() - t0)
        steps.append(step)
        iters.append(max(1, min(MAX_ITERS, math.ceil(TARGET_SAMPLE_S / max(warm[-1], 1e-9)))))

    del expected
    samples = [[] for _ in contenders]
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(repeats):
            _common.progress(f"[{time.monotonic() - _START[0]:6.1f} s] allreduce "
                             f"{workload['name']}: round {r + 1}/{repeats}", show_progress)
            gc.collect()
            gc.disable()
            for i in _common.round_order(len(contenders), r):
                step, n = steps[i], iters[i]
                t0 = time.perf_counter()
                for _ in range(n):
                    step()
                samples[i].append((time.perf_counter() - t0) / n)
            if gc_was_enabled:
                gc.enable()
    finally:
        if gc_was_enabled:
            gc.enable()
    del steps, per_device
    gc.collect()

    nbytes = 4 * sum(_num_elements(s) for s in shapes)
    k = len(devices)
    results = []
    for c, times, n, w in zip(contenders, samples, iters, warm):
        st = _common.summarize(times)
        algbw = nbytes / st["median"] / 1e9
        results.append({
            "contender": c.name, "kind": c.kind, "times_s": times, "iters_per_sample": n,
            "warm_s": w, "median_s": st["median"], "min_s": st["min"], "max_s": st["max"],
            "mean_s": st["mean"], "algbw_gbps": algbw,
            "busbw_gbps": algbw * _common.busbw_factor(k),
        })
        if c.kind == "memory":
            results[-1]["memory_traffic_gbps"] = 3 * nbytes / st["median"] / 1e9
    ms = next(r for r, c in zip(results, contenders) if c.info.get("default") is True)
    ms1 = next(r for r, c in zip(results, contenders) if c.info.get("default") is False)
    for res in results:
        res["ratio_mirrored_over_this"] = ms["median_s"] / res["median_s"]
        res["ratio_mirrored_one_device_over_this"] = ms1["median_s"] / res["median_s"]
    out = {"name": workload["name"], "tensors": len(shapes), "bytes": nbytes,
           "results": results}
    if "size_arg" in workload:
        out["size_arg"] = workload["size_arg"]
    return out


def run_allreduce(cpu_replicas: int = 4, model: str = "resnet50", sizes=None,
                  algorithms=DEFAULT_ALGORITHMS, bucket_bytes=(None,),
                  repeats: int = DEFAULT_REPEATS, progress: bool = False,
                  compression=(None,)) -> dict:
    """Benchmark the contenders on ``model``'s gradients; returns all figures as a dict.

    Args:
      cpu_replicas: K logical CPU devices (configured first; TF must not be running with another
        count).
      model: "resnet50", "mlp" or "sizes" (one tensor per entry of ``sizes``).
      sizes: bytes per tensor for "sizes" (ints or strings like "64K"); default DEFAULT_SIZES.
      algorithms: tfdp algorithms to run (each with every ``bucket_bytes``).
      bucket_bytes: tfdp bucket capacities; None is tfdp's default.
      compression: tfdp compressions to run, from None/"none", "fp16", "bf16" (a list, or a
        comma-separated string); every algorithm and bucket size runs with each.
      repeats: rounds; each round runs every contender once, alternating the order.
      progress: print "round i/R" lines to stderr.

    Returns:
      {"benchmark", "cpu_replicas", "devices", "model", "repeats", "mirrored_cross_device_ops",
       "contenders": [...], "workloads": [{"name", "tensors", "bytes", "results": [{"contender",
       "times_s", "median_s", "min_s", "algbw_gbps", "busbw_gbps", "ratio_mirrored_over_this",
       ...}]}], "environment"}. Times are seconds per all-reduce.
    """
    if isinstance(algorithms, str):
        algorithms = [a.strip() for a in algorithms.split(",") if a.strip()]
    if bucket_bytes is None or isinstance(bucket_bytes, int):
        bucket_bytes = [bucket_bytes]
    bad = [a for a in algorithms if a not in BENCH_ALGORITHMS]
    if bad or not algorithms:
        raise TfdpError(f"Invalid algorithms. Received: algorithms={list(algorithms)!r}. "
                        f"Valid: {', '.join(BENCH_ALGORITHMS)}.")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise TfdpError(f"Invalid repeats. Received: repeats={repeats!r}. Pass an int >= 1.")
    compressions = normalize_compressions(compression)
    _START[0] = time.monotonic()
    workloads = workloads_for(model, sizes)
    devices = _common.configure_replicas(cpu_replicas)
    contenders, ms_desc = build_contenders(devices, list(algorithms), list(bucket_bytes),
                                           compressions)
    _common.progress(f"MirroredStrategy default cross_device_ops on {cpu_replicas} CPU "
                     f"replicas: {ms_desc}", progress)
    measured = [_measure(w, contenders, devices, repeats, progress) for w in workloads]
    return {
        "benchmark": "allreduce", "mode": "local", "cpu_replicas": cpu_replicas,
        "devices": devices, "model": model, "repeats": repeats,
        "compression": [c or "none" for c in compressions],
        "mirrored_cross_device_ops": ms_desc,
        "contenders": [{"name": c.name, "kind": c.kind, **c.info} for c in contenders],
        "workloads": measured, "environment": _common.environment(),
        "notes": {"time": "seconds per all-reduce (median over rounds)",
                  "algbw_gbps": "bytes of one replica's gradients / median time, 1e9 B/s",
                  "busbw_gbps": "algbw * 2 (K-1) / K (nccl-tests)",
                  "ratio_mirrored_over_this": "MirroredStrategy (default) median / this "
                                              "median: > 1 means faster than MirroredStrategy",
                  "memory": "the memory row times np.add(a, b, out=c) over buffers of the "
                            "workload's size (memory_traffic_gbps counts the 3x bytes moved)"},
    }


# --- command line: tfdp bench allreduce ----------------------------------------------------------

def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench allreduce",
                    usage="tfdp bench allreduce [--cpu-replicas K | --workers N] [--sizes S,...] "
                          "[--algorithms A,...] [--compression C,...] [--json FILE] "
                          "[--plot FILE.png] [options]",
                    description="Time one replica-context all_reduce('SUM') of a gradient set "
                                "under tfdp DataParallelStrategy (each --algorithms x "
                                "--bucket-bytes x --compression), MirroredStrategy (default "
                                "cross-device ops, and ReductionToOneDevice), a numpy K-way sum "
                                "and a memory-bandwidth reference (np.add over a buffer of each "
                                "size). With --workers N: across N local worker processes on "
                                "127.0.0.1 (one job per contender), tfdp "
                                "MultiWorkerDataParallelStrategy vs MultiWorkerMirroredStrategy, "
                                "with memory and loopback TCP references.",
                    epilog="MS/this (MWMS/this) in the table is MirroredStrategy's "
                           "(MultiWorkerMirroredStrategy's) median / the row's median (> 1: "
                           "faster). busbw = algbw * 2(n-1)/n as in nccl-tests, n = replicas or "
                           "workers.")
    add_common_options(p, cpu_replicas=None)
    p.add_argument("--workers", type=int, metavar="N",
                   help="measure across N >= 2 local worker processes instead of CPU replicas "
                        "in one process (not with --cpu-replicas)")
    p.add_argument("--compression", metavar="C,...", default="none",
                   help="tfdp compressions, from none, fp16, bf16 (default: none)")
    p.add_argument("--model", choices=MODELS, default=None,
                   help="gradient set: resnet50 (214 tensors, 25.6 M floats), mlp (60 Dense(64) "
                        "layers: 120 tensors) or sizes (one tensor per --sizes entry); default: "
                        "resnet50, or sizes when --sizes is given")
    p.add_argument("--sizes", metavar="S,...",
                   help="tensor sizes in bytes for --model sizes, K/M/G suffixes "
                        f"(default: {','.join(DEFAULT_SIZES)}; with --workers: 1M,16M,64M)")
    p.add_argument("--algorithms", metavar="A,...", default=None,
                   help=f"tfdp algorithms, from {', '.join(BENCH_ALGORITHMS)} "
                        f"(default: {','.join(DEFAULT_ALGORITHMS)}; with --workers: "
                        f"{','.join(workers.DEFAULT_ALGORITHMS)}, since one replica per worker "
                        "leaves the local stage nothing to do)")
    p.add_argument("--bucket-bytes", metavar="B,...",
                   help="tfdp bucket capacities in bytes (K/M suffixes ok; 0 = no fusion); one "
                        "tfdp contender per algorithm and size (default: tfdp's default)")
    p.add_argument("--repeats", type=int, default=None, metavar="R",
                   help=f"rounds (default: {DEFAULT_REPEATS}); with --workers: timed samples "
                        f"per size in each job (default: {workers.DEFAULT_REPEATS})")
    p.add_argument("--rounds", type=int, default=workers.DEFAULT_ROUNDS, metavar="R",
                   help="--workers only: every job runs once per round, in alternating order "
                        f"(default: {workers.DEFAULT_ROUNDS})")
    p.add_argument("--tensors", type=int, default=1, metavar="T",
                   help="--workers only: split each size into T float32 tensors (default: 1)")
    p.add_argument("--timeout", type=float, default=workers.DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="--workers only: hard limit per job "
                        f"(default: {workers.DEFAULT_TIMEOUT:g})")
    p.add_argument("--plot", metavar="FILE.png",
                   help="write a PNG (matplotlib): busbw vs size for --model sizes, else busbw "
                        "per contender")
    return p


def parse_args(argv):
    args = build_parser().parse_args(argv)
    if args.workers is not None and args.cpu_replicas is not None:
        raise UsageError(f"--cpu-replicas and --workers are mutually exclusive. Received: "
                         f"--cpu-replicas {args.cpu_replicas} --workers {args.workers}. Give "
                         "one: K replicas in one process, or N worker processes.")
    if args.workers is not None:
        check_positive("--workers", args.workers, minimum=2)
        if args.model not in (None, "sizes"):
            raise UsageError(f"--workers measures --sizes only. Received: --model {args.model} "
                             f"--workers {args.workers}. Drop --model.")
        if args.sizes is None:
            args.sizes = "1M,16M,64M"
        for name in ("rounds", "tensors"):
            check_positive("--" + name, getattr(args, name))
        if not args.timeout > 0:
            raise UsageError(f"Invalid --timeout. Received: --timeout {args.timeout:g}. Give a "
                             "positive number of seconds.")
    else:
        if args.cpu_replicas is None:
            args.cpu_replicas = 4
        check_positive("--cpu-replicas", args.cpu_replicas)
    if args.repeats is None:
        args.repeats = workers.DEFAULT_REPEATS if args.workers is not None else DEFAULT_REPEATS
    check_positive("--repeats", args.repeats)
    compressions = [c.lower() for c in split_list(args.compression)]
    if not compressions or any(c not in COMPRESSIONS for c in compressions):
        raise UsageError(f"Invalid --compression. Received: --compression {args.compression}. "
                         f"Valid: {', '.join(COMPRESSIONS)} (comma-separated).")
    args.compression = list(dict.fromkeys(compressions))
    if args.model is None:
        args.model = "sizes" if args.sizes else "resnet50"
    if args.sizes is not None and args.model != "sizes":
        raise UsageError(f"--sizes needs --model sizes. Received: --model {args.model} "
                         f"--sizes {args.sizes}. Drop --model (or pass --model sizes).")
    if args.model == "sizes" and args.sizes is not None:
        sizes = [_common.parse_size(s, name="--sizes", cls=UsageError)
                 for s in split_list(args.sizes)]
        if not sizes or min(sizes) < 4:
            raise UsageError(f"Invalid --sizes. Received: --sizes {args.sizes}. Give sizes of "
                             "at least 4 bytes (one float32), e.g. 1K,1M,64M.")
        args.sizes = sizes
    if args.algorithms is None:
        args.algorithms = ",".join(workers.DEFAULT_ALGORITHMS if args.workers is not None
                                   else DEFAULT_ALGORITHMS)
    algorithms = [a.lower() for a in split_list(args.algorithms)]
    bad = [a for a in algorithms if a not in BENCH_ALGORITHMS]
    if bad or not algorithms:
        raise UsageError(f"Invalid --algorithms. Received: --algorithms {args.algorithms}. "
                         f"Valid: {', '.join(BENCH_ALGORITHMS)} (comma-separated; nccl needs "
                         "GPUs and this benchmark runs on CPU replicas).")
    args.algorithms = list(dict.fromkeys(algorithms))
    if args.bucket_bytes is None:
        args.bucket_bytes = [None]
    else:
        buckets = [_common.parse_size(b, name="--bucket-bytes", cls=UsageError)
                   for b in split_list(args.bucket_bytes)]
        if not buckets:
            raise UsageError(f"Invalid --bucket-bytes. Received: --bucket-bytes "
                             f"{args.bucket_bytes!r}. Give comma-separated byte counts, e.g. "
                             "0,262144,4M.")
        args.bucket_bytes = list(dict.fromkeys(buckets))
    check_writable("--json", args.json)
    check_writable("--plot", args.plot)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise TfdpError(f"--plot needs matplotlib, which is not installed. Received: --plot "
                        f"{args.plot!r}. Install it (pip install matplotlib) or drop --plot.")
    return args


def run(args) -> int:
    if args.workers is not None:
        result = workers.run_allreduce_workers(
            workers=args.workers, sizes=args.sizes, algorithms=args.algorithms,
            bucket_bytes=args.bucket_bytes, compression=args.compression,
            repeats=args.repeats, rounds=args.rounds, tensors=args.tensors,
            timeout=args.timeout, progress=not args.quiet)
    else:
        result = run_allreduce(cpu_replicas=args.cpu_replicas, model=args.model,
                               sizes=args.sizes, algorithms=args.algorithms,
                               bucket_bytes=args.bucket_bytes, repeats=args.repeats,
                               compression=args.compression, progress=not args.quiet)
    print(format_allreduce(result), flush=True)
    if args.json:
        write_json(args.json, result)
    if args.plot:
        write_plot(result, args.plot)
    return 0


if __name__ == "__main__":  # python -m tfdp_bench.allreduce
    import sys

    from tfdp_bench.parser import run_standalone
    sys.exit(run_standalone("allreduce", parse_args, run))

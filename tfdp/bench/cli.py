"""``tfdp bench {allreduce,fit,patterns,...} [options]``: the command line of :mod:`tfdp.bench`.

Arguments are validated before TensorFlow starts, the host CPU is split into ``--cpu-replicas``
logical devices, then the benchmark runs and prints a table (progress lines go to stderr).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

from tfdp.errors import TfdpError, UsageError

# DataParallelStrategy's all_reduce names (tfdp.reduce.registry.ALGORITHMS; a test keeps them
# equal). Copied because importing tfdp.reduce starts TensorFlow, and usage errors should not.
ALL_REDUCE_NAMES = ("auto", "fused", "ring", "one_device", "nccl")

USAGE = "usage: tfdp bench {allreduce,fit,patterns,workers,input,sparse,scaling} [options]   (tfdp bench COMMAND --help for details)"

HELP = USAGE + """

Benchmarks of tfdp's DataParallelStrategy against tf.distribute.MirroredStrategy, side by side in
one process on K logical CPU replicas: every contender is warmed up, then rounds run each
contender once in alternating order; figures are medians and ratios of medians.

commands:
  allreduce  one replica-context all_reduce of a gradient set (ResNet50's, a deep narrow MLP's,
             or single tensors of given sizes); median ms, algbw, busbw, MirroredStrategy/tfdp;
             --workers N: across N local worker processes vs MultiWorkerMirroredStrategy
  fit        Keras model.fit throughput of a deep narrow MLP: tfdp vs MirroredStrategy vs one
             device; median examples/s and the ratio tfdp/MirroredStrategy
  patterns   the user-pattern matrix: each row (clipping, custom train_step, two optimizers,
             BatchNorm, uneven batches, mixed precision...) trained without a strategy, under
             MirroredStrategy and under tfdp; max |dw| vs one device, tfdp replica identity
  workers    alias of 'allreduce --workers 2 --sizes 64M --compression none,fp16' (older options)
  input      sharded TFRecord input pipeline examples/s per worker vs training consumption
  sparse     Embedding-gradient (IndexedSlices) reduction, recommender shape: tfdp gather /
             densify vs MirroredStrategy; --sweep locates the gather/densify crossover
  scaling    predicted scaling efficiency for 1..1024 devices (alpha-beta ring model); --measure fits it here

examples:
  tfdp bench allreduce --model resnet50 --cpu-replicas 4
  tfdp bench allreduce --sizes 1K,1M,64M --json ar.json --plot busbw.png
  tfdp bench allreduce --model mlp --algorithms fused --bucket-bytes 0,262144,4194304
  tfdp bench allreduce --workers 2 --sizes 1M,16M,64M --compression none,fp16 --plot w.png
  tfdp bench fit --cpu-replicas 4 --steps 20
  tfdp bench patterns --rows clipnorm_uneven,two_optimizers"""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are UsageError (one line, exit 2)."""

    def error(self, message):
        cmd = self.prog.split()[-1]
        raise UsageError(f"{message[:1].upper()}{message[1:]}. "
                         f"Run 'tfdp bench {cmd} --help' for usage.")


def _common_options(p):
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    p.add_argument("--cpu-replicas", type=int, default=4, metavar="K",
                   help="split the host CPU into K logical devices, one replica each "
                        "(default: 4)")
    p.add_argument("--json", metavar="FILE", help="write every raw figure to FILE as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def build_allreduce_parser():
    from tfdp.bench.allreduce import (BENCH_ALGORITHMS, DEFAULT_ALGORITHMS, DEFAULT_REPEATS,
                                      DEFAULT_SIZES, MODELS)
    from tfdp.bench.workers import DEFAULT_ALGORITHMS as W_ALGORITHMS
    from tfdp.bench.workers import DEFAULT_REPEATS as W_REPEATS
    from tfdp.bench.workers import DEFAULT_ROUNDS, DEFAULT_TIMEOUT
    p = _Parser(prog="tfdp bench allreduce", add_help=False, allow_abbrev=False,
                usage="tfdp bench allreduce [--cpu-replicas K | --workers N] [--sizes S,...] "
                      "[--algorithms A,...] [--compression C,...] [--json FILE] "
                      "[--plot FILE.png] [options]",
                description="Time one replica-context all_reduce('SUM') of a gradient set under "
                            "tfdp DataParallelStrategy (each --algorithms x --bucket-bytes x "
                            "--compression), MirroredStrategy (default cross-device ops, and "
                            "ReductionToOneDevice), a numpy K-way sum and a memory-bandwidth "
                            "reference (np.add over a buffer of each size). With --workers N: "
                            "across N local worker processes on 127.0.0.1 (one job per "
                            "contender), tfdp MultiWorkerDataParallelStrategy vs "
                            "MultiWorkerMirroredStrategy, with memory and loopback TCP "
                            "references.",
                epilog="MS/this (MWMS/this) in the table is MirroredStrategy's "
                       "(MultiWorkerMirroredStrategy's) median / the row's median (> 1: faster). "
                       "busbw = algbw * 2(n-1)/n as in nccl-tests, n = replicas or workers.")
    _common_options(p)
    p.set_defaults(cpu_replicas=None)
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
                        f"{','.join(W_ALGORITHMS)}, since one replica per worker leaves the "
                        "local stage nothing to do)")
    p.add_argument("--bucket-bytes", metavar="B,...",
                   help="tfdp bucket capacities in bytes (K/M suffixes ok; 0 = no fusion); one "
                        "tfdp contender per algorithm and size (default: tfdp's default)")
    p.add_argument("--repeats", type=int, default=None, metavar="R",
                   help=f"rounds (default: {DEFAULT_REPEATS}); with --workers: timed samples "
                        f"per size in each job (default: {W_REPEATS})")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, metavar="R",
                   help=f"--workers only: every job runs once per round, in alternating order "
                        f"(default: {DEFAULT_ROUNDS})")
    p.add_argument("--tensors", type=int, default=1, metavar="T",
                   help="--workers only: split each size into T float32 tensors (default: 1)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"--workers only: hard limit per job (default: {DEFAULT_TIMEOUT:g})")
    p.add_argument("--plot", metavar="FILE.png",
                   help="write a PNG (matplotlib): busbw vs size for --model sizes, else busbw "
                        "per contender")
    return p


def build_fit_parser():
    from tfdp.bench.fit import DEFAULTS
    p = _Parser(prog="tfdp bench fit", add_help=False, allow_abbrev=False,
                description="Keras model.fit throughput of a deep narrow MLP (--layers Dense "
                            "layers of --width, relu, MSE on random data) under tfdp "
                            "DataParallelStrategy vs tf.distribute.MirroredStrategy on the same "
                            "K CPU replicas, plus one device without a strategy.")
    _common_options(p)
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
    return p


def build_patterns_parser():
    p = _Parser(prog="tfdp bench patterns", add_help=False, allow_abbrev=False,
                usage="tfdp bench patterns [--rows NAME,...] [--list] [--cpu-replicas K] "
                      "[--json FILE] [--quiet]",
                description="The user-pattern matrix (tfdp.bench.patterns, also run by "
                            "tests/test_user_patterns.py): every row trains a tiny Keras model "
                            "as a user writes it, without a strategy (the one-device "
                            "reference), under tf.distribute.MirroredStrategy and under tfdp "
                            "DataParallelStrategy on the same K CPU replicas, and prints a "
                            "markdown table: max |dw| vs the reference (or 'crashes: ...') and "
                            "whether tfdp's replica copies of every variable are bitwise "
                            "identical.",
                epilog="tfdp promises max |dw| <= 1e-5 on every row; rows marked per-replica "
                       "semantics (plain BatchNormalization) only promise identical copies.")
    _common_options(p)
    p.add_argument("--rows", metavar="NAME,...",
                   help="run only these rows (default: all; --list shows them)")
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    return p


def _positive(name, value, minimum=1):
    if value is None or value < minimum:
        raise UsageError(f"Invalid {name}. Received: {name} {value}. "
                         f"Give an integer >= {minimum}.")


def _split(text):
    return [t.strip() for t in text.split(",") if t.strip()]


def _parse_allreduce(argv):
    from tfdp.bench import _common
    from tfdp.bench.allreduce import BENCH_ALGORITHMS, DEFAULT_REPEATS
    from tfdp.bench.allreduce import COMPRESSIONS, DEFAULT_ALGORITHMS
    from tfdp.bench.workers import DEFAULT_ALGORITHMS as W_ALGORITHMS
    from tfdp.bench.workers import DEFAULT_REPEATS as W_REPEATS
    p = build_allreduce_parser()
    args = p.parse_args(argv)
    if args.help:
        return p, args
    if args.workers is not None and args.cpu_replicas is not None:
        raise UsageError(f"--cpu-replicas and --workers are mutually exclusive. Received: "
                         f"--cpu-replicas {args.cpu_replicas} --workers {args.workers}. Give "
                         "one: K replicas in one process, or N worker processes.")
    if args.workers is not None:
        _positive("--workers", args.workers, minimum=2)
        if args.model not in (None, "sizes"):
            raise UsageError(f"--workers measures --sizes only. Received: --model {args.model} "
                             f"--workers {args.workers}. Drop --model.")
        if args.sizes is None:
            args.sizes = "1M,16M,64M"
        for name in ("rounds", "tensors"):
            _positive("--" + name, getattr(args, name))
        if not args.timeout > 0:
            raise UsageError(f"Invalid --timeout. Received: --timeout {args.timeout:g}. Give a "
                             "positive number of seconds.")
    else:
        if args.cpu_replicas is None:
            args.cpu_replicas = 4
        _positive("--cpu-replicas", args.cpu_replicas)
    if args.repeats is None:
        args.repeats = W_REPEATS if args.workers is not None else DEFAULT_REPEATS
    _positive("--repeats", args.repeats)
    compressions = [c.lower() for c in _split(args.compression)]
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
        sizes = [_common.parse_size(s, name="--sizes", cls=UsageError) for s in _split(args.sizes)]
        if not sizes or min(sizes) < 4:
            raise UsageError(f"Invalid --sizes. Received: --sizes {args.sizes}. Give sizes of "
                             "at least 4 bytes (one float32), e.g. 1K,1M,64M.")
        args.sizes = sizes
    if args.algorithms is None:
        args.algorithms = ",".join(W_ALGORITHMS if args.workers is not None
                                   else DEFAULT_ALGORITHMS)
    algorithms = [a.lower() for a in _split(args.algorithms)]
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
                   for b in _split(args.bucket_bytes)]
        if not buckets:
            raise UsageError(f"Invalid --bucket-bytes. Received: --bucket-bytes "
                             f"{args.bucket_bytes!r}. Give comma-separated byte counts, e.g. "
                             "0,262144,4M.")
        args.bucket_bytes = list(dict.fromkeys(buckets))
    _check_writable("--json", args.json)
    _check_writable("--plot", args.plot)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise TfdpError(f"--plot needs matplotlib, which is not installed. Received: --plot "
                        f"{args.plot!r}. Install it (pip install matplotlib) or drop --plot.")
    return p, args


def _parse_fit(argv):
    p = build_fit_parser()
    args = p.parse_args(argv)
    if args.help:
        return p, args
    for name in ("cpu_replicas", "layers", "width", "batch", "steps", "repeats"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.batch < args.cpu_replicas:
        raise UsageError(f"--batch is smaller than --cpu-replicas. Received: --batch "
                         f"{args.batch} --cpu-replicas {args.cpu_replicas}. Give every replica "
                         "at least one example per step.")
    if args.all_reduce.lower() not in ALL_REDUCE_NAMES:
        raise UsageError(f"Invalid --all-reduce. Received: --all-reduce {args.all_reduce}. "
                         f"Valid: {', '.join(ALL_REDUCE_NAMES)}.")
    args.all_reduce = args.all_reduce.lower()
    _check_writable("--json", args.json)
    return p, args


def _parse_patterns(argv):
    from tfdp.bench.patterns import ROWS, ROWS_BY_NAME
    p = build_patterns_parser()
    args = p.parse_args(argv)
    if args.help or args.list:
        return p, args
    _positive("--cpu-replicas", args.cpu_replicas)
    if args.rows is None:
        args.rows = [r.name for r in ROWS]
    else:
        names = _split(args.rows)
        bad = [n for n in names if n not in ROWS_BY_NAME]
        if bad or not names:
            raise UsageError(f"Invalid --rows. Received: --rows {args.rows}. Valid: "
                             f"{', '.join(ROWS_BY_NAME)} (comma-separated; see --list).")
        args.rows = list(dict.fromkeys(names))
    _check_writable("--json", args.json)
    return p, args


def _write_json(path, result):
    try:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    except OSError as e:
        raise TfdpError(f"Cannot write the JSON file. Received: --json {path!r} ({e.strerror}). "
                        "Give a writable path.") from None


def _check_writable(option, path):
    if not path:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK) or os.path.isdir(path):
        raise UsageError(f"Cannot write {option} here. Received: {option} {path!r}. Give a file "
                         "path in an existing, writable directory.")


def _quiet_tf_logs():
    # The C++ runtime's INFO/WARNING lines would interleave with the table; only before TF starts.
    if "tensorflow" not in sys.modules:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv: list[str]) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(HELP)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    _quiet_tf_logs()
    if cmd == "allreduce":
        parser, args = _parse_allreduce(rest)
        if args.help:
            parser.print_help()
            return 0
        from tfdp.bench.allreduce import format_allreduce, run_allreduce, write_plot
        if args.workers is not None:
            from tfdp.bench.workers import run_allreduce_workers
            result = run_allreduce_workers(
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
            _write_json(args.json, result)
        if args.plot:
            write_plot(result, args.plot)
        return 0
    if cmd == "fit":
        parser, args = _parse_fit(rest)
        if args.help:
            parser.print_help()
            return 0
        from tfdp.bench.fit import format_fit, run_fit
        result = run_fit(cpu_replicas=args.cpu_replicas, layers=args.layers, width=args.width,
                         batch=args.batch, steps=args.steps, repeats=args.repeats,
                         all_reduce=args.all_reduce, progress=not args.quiet)
        print(format_fit(result), flush=True)
        if args.json:
            _write_json(args.json, result)
        return 0
    if cmd == "patterns":
        parser, args = _parse_patterns(rest)
        if args.help:
            parser.print_help()
            return 0
        from tfdp.bench.patterns import ROWS, ROWS_BY_NAME
        if args.list:
            width = max(len(r.name) for r in ROWS)
            for r in ROWS:
                print(f"{r.name.ljust(width)}  {r.description}")
            return 0
        from tfdp.bench import _common
        devices = _common.configure_replicas(args.cpu_replicas)  # before the TF runtime starts
        from tfdp.bench.patterns import format_patterns, run_patterns
        result = run_patterns([ROWS_BY_NAME[n] for n in args.rows], devices,
                              progress=not args.quiet)
        print(format_patterns(result), flush=True)
        if args.json:
            _write_json(args.json, result)
        return 0
    if cmd == "scaling":
        from tfdp.bench.scaling import main as scaling_main
        return scaling_main(rest)
    if cmd == "sparse":
        from tfdp.bench.sparse import main as sparse_main
        return sparse_main(rest)
    if cmd == "workers":
        from tfdp.bench.workers import main as workers_main
        return workers_main(rest)
    if cmd == "input":
        from tfdp.data.bench import format_input_bench, run_input_bench
        if rest and rest[0] in ("-h", "--help"):
            print("usage: tfdp bench input\n\nExamples/s of the sharded TFRecord input pipeline "
                  "(recommender-style records) per simulated worker, against what training "
                  "consumes.")
            return 0
        if rest:
            raise UsageError(f"tfdp bench input takes no options. Received: {rest!r}.")
        print(format_input_bench(run_input_bench()), flush=True)
        return 0
    raise UsageError(f"Unknown bench command. Received: {cmd!r}. Valid: allreduce, fit, "
                     "patterns, workers, input, sparse, scaling. "
                     "Run 'tfdp bench --help' for usage.")

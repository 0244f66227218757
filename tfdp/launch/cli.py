"""``tfdp launch [options] [--] CMD ARGS...``: the command line of :func:`tfdp.launch.launch`."""

from __future__ import annotations

import argparse

from tfdp.errors import UsageError
from tfdp.launch.launcher import launch, validate

DESCRIPTION = """\
Start N local worker processes running CMD, each with TF_CONFIG describing an N-worker cluster
on free 127.0.0.1 ports (not set for --workers 1), plus TFDP_WORKER_RANK, TFDP_NUM_WORKERS,
TFDP_RESTART_COUNT and PYTHONUNBUFFERED=1. Output lines are prefixed with '[worker i] '.
If a worker fails, the others are stopped and the launcher exits non-zero (or restarts all
workers, see --max-restarts). SIGINT/SIGTERM are forwarded to all workers."""

EPILOG = """\
exit codes: 0 all workers succeeded; the failed worker's code (1..125, else 1); 2 usage error;
124 --timeout expired; 130/143 stopped by SIGINT/SIGTERM.

security: the TensorFlow gRPC server the workers start is unauthenticated, so tfdp launch only
advertises loopback addresses; TensorFlow's server still listens on every interface of its port,
so never expose these ports to other machines (firewall them on shared hosts).

example:
  tfdp launch --workers 2 --cpu-replicas 2 -- python train.py --epochs 3"""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are :class:`~tfdp.errors.UsageError` (one line, exit 2)."""

    def error(self, message):
        hint = ""
        if "--nproc" in message:  # torchrun's --nproc-per-node / --nproc_per_node
            hint = " tfdp launch takes --workers N (torchrun's --nproc-per-node)."
        raise UsageError(f"{message[:1].upper()}{message[1:]}.{hint} "
                         "Run 'tfdp launch --help' for usage.")


def build_parser() -> argparse.ArgumentParser:
    """The ``tfdp launch`` argument parser (``--help`` is handled by :func:`main`)."""
    p = _Parser(prog="tfdp launch", usage="tfdp launch --workers N [options] [--] CMD [ARGS...]",
                description=DESCRIPTION, epilog=EPILOG, add_help=False, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    p.add_argument("--workers", type=int, metavar="N", help="number of worker processes (>= 1)")
    p.add_argument("--cpu-replicas", type=int, metavar="K",
                   help="set TFDP_CPU_REPLICAS=K for the workers (CPU replicas per worker)")
    p.add_argument("--gpus-per-worker", type=int, metavar="G",
                   help="give worker i GPUs i*G..i*G+G-1 of CUDA_VISIBLE_DEVICES (or of 0..N*G-1)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="after a failure, restart all workers up to R times (default: 0)")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="stop all workers and exit 124 after this many seconds")
    p.add_argument("--host", default="127.0.0.1",
                   help="loopback address the workers advertise (default: 127.0.0.1)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command each worker runs")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; the command is everything after ``--``, or from the first positional."""
    parser = build_parser()
    if "--" in argv:
        i = argv.index("--")
        args = parser.parse_args(argv[:i])
        # A positional before '--' means the '--' belongs to the command itself.
        args.command = args.command + argv[i:] if args.command else argv[i + 1:]
    else:
        args = parser.parse_args(argv)
    return args


def main(argv: list[str]) -> int:
    """Entry point of ``tfdp launch``; returns the exit code (raises UsageError on bad usage)."""
    args = parse_args(list(argv))
    if args.help:
        build_parser().print_help()
        return 0
    if args.workers is None:
        raise UsageError("Missing --workers. Received: no --workers option. "
                         "Give the number of worker processes, e.g. --workers 2.")
    kwargs = dict(cpu_replicas=args.cpu_replicas, gpus_per_worker=args.gpus_per_worker,
                  max_restarts=args.max_restarts, timeout=args.timeout, host=args.host)
    validate(args.command, args.workers, cli=True, **kwargs)
    return launch(args.command, args.workers, **kwargs)

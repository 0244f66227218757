"""``tfdp launch [options] [--] CMD ARGS...``: the command line of :func:`tfdp.launch.launch`
(one node) and :func:`tfdp.launch.launch_nodes` (several nodes)."""

from __future__ import annotations

import argparse
import os

from tfdp.cli import HELP_HELP, VERBOSE_HELP
from tfdp.errors import UsageError
from tfdp.launch import token as tokens
from tfdp.launch.launcher import _check_int, launch, validate
from tfdp.launch.multinode import (DEFAULT_JOIN_TIMEOUT, DEFAULT_NODE_TIMEOUT, ELASTIC_POLICIES,
                                   launch_nodes)

# What the terminal shows by default: "worker0" (worker 0 live, every worker in a log file) or
# "all" (every worker, line by line, prefixed: --output all).
DEFAULT_OUTPUT = "worker0"

_OUTPUT_HELP = {
    "worker0": """\
Output: worker 0's output is shown live (its progress bar too) and every worker's output goes
to a log file (DIR/worker-<i>.log, named at the start and the end); when a worker fails, its
last lines and its log file are shown. --output all shows every worker's lines instead, each
prefixed with '[worker i] '.""",
    "all": """\
Output: every worker's lines, each prefixed with '[worker i] ' (--output all, the default).
--output worker0 shows worker 0's output live (its progress bar too) and writes every worker's
output to a log file (DIR/worker-<i>.log, named at the start and the end); when a worker fails,
its last lines and its log file are shown.""",
}

DESCRIPTION = """\
Start N local worker processes running CMD, each with TF_CONFIG describing an N-worker cluster
on free 127.0.0.1 ports (not set for --workers 1), plus TFDP_WORKER_RANK, TFDP_LOCAL_RANK,
TFDP_NUM_WORKERS, TFDP_RESTART_COUNT and PYTHONUNBUFFERED=1.

""" + _OUTPUT_HELP[DEFAULT_OUTPUT] + """ TensorFlow's C++ INFO/WARNING logs are hidden
(TF_CPP_MIN_LOG_LEVEL=2 for the workers) unless you set TF_CPP_MIN_LOG_LEVEL or pass --verbose;
errors always show.

If a worker fails, the others are stopped and the launcher exits non-zero (or restarts all
workers, see --max-restarts). SIGINT/SIGTERM are forwarded to all workers.

Several nodes: run the same command on every node with --nnodes, --node-rank, --coordinator and
--workers-per-node (or --slurm under srun). Node 0 listens at the coordinator address, every
node reports its workers' addresses, and all start one cluster (node r's workers are ranks
r*K..r*K+K-1; TFDP_NODE_RANK, TFDP_NUM_NODES). The connections stay open: when a node's worker
fails, or a node dies or goes silent for --node-timeout, every node stops."""

EPILOG = """\
exit codes: 0 all workers succeeded; the failed worker's code (1..125, else 1; on every node);
1 a node was lost; 2 usage error (also: the nodes' arguments disagree); 124 --timeout expired
or a node did not join within --join-timeout; 130/143 stopped by SIGINT/SIGTERM.

security: the TensorFlow gRPC server the workers start is unauthenticated and listens on every
interface of its port. On one node, tfdp launch only advertises loopback addresses, but never
expose these ports to other machines (firewall them on shared hosts). Across nodes, every node
prints the addresses it will listen on. The rendezvous admits only nodes holding the job's
token (--rdzv-token / TFDP_RDZV_TOKEN; without one it is open, and node 0 says so); the
connections are not encrypted. Run multi-node jobs on a private network or behind a firewall.

examples:
  tfdp launch --workers 2 --cpu-replicas 2 -- python train.py --epochs 3
  # on host A (10.0.0.1) and host B, with R = 0 on A and 1 on B:
  tfdp launch --nnodes 2 --node-rank R --coordinator 10.0.0.1:29500 --workers-per-node 1 \\
      -- python train.py
  srun --ntasks-per-node=1 tfdp launch --slurm --workers-per-node 1 -- python train.py"""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are :class:`~tfdp.errors.UsageError` (one line, exit 2)."""

    def error(self, message):
        hint = ""
        if "--nproc" in message:  # torchrun's --nproc-per-node / --nproc_per_node
            hint = (" tfdp launch takes --workers N (torchrun's --nproc-per-node), or "
                    "--workers-per-node K with --nnodes.")
        elif "--master" in message or "--node_rank" in message:
            hint = (" tfdp launch takes --nnodes N --node-rank R --coordinator HOST:PORT "
                    "(torchrun's --master-addr/--master-port).")
        raise UsageError(f"{message[:1].upper()}{message[1:]}.{hint} "
                         "Run 'tfdp launch --help' for usage.")


def _nnodes(text: str):
    """``N`` -> N; ``MIN:MAX`` -> (MIN, MAX) (argparse type of --nnodes)."""
    lo, sep, hi = text.partition(":")
    try:
        return (int(lo), int(hi)) if sep else int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid --nnodes {text!r}: give N or MIN:MAX, e.g. 2 or 2:4") from None


def build_parser() -> argparse.ArgumentParser:
    """The ``tfdp launch`` argument parser (``--help`` is handled by :func:`main`)."""
    p = _Parser(prog="tfdp launch",
                usage="tfdp launch --workers N [options] [--] CMD [ARGS...]\n"
                      "       tfdp launch --nnodes N --node-rank R --coordinator HOST:PORT "
                      "--workers-per-node K [options] [--] CMD [ARGS...]",
                description=DESCRIPTION, epilog=EPILOG, add_help=False, allow_abbrev=False,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-h", "--help", action="store_true", help=HELP_HELP)
    p.add_argument("--workers", type=int, metavar="N", help="number of worker processes (>= 1)")
    p.add_argument("--cpu-replicas", type=int, metavar="K",
                   help="set TFDP_CPU_REPLICAS=K for the workers (CPU replicas per worker)")
    p.add_argument("--gpus-per-worker", type=int, metavar="G",
                   help="give worker i GPUs i*G..i*G+G-1 of CUDA_VISIBLE_DEVICES (or of 0..N*G-1)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="R",
                   help="after a failure, restart all workers up to R times (default: 0); "
                        "several nodes: a failed worker on any node, or a lost node other "
                        "than node 0, restarts every node's workers after the job forms "
                        "again at the coordinator")
    p.add_argument("--timeout", type=float, metavar="SECONDS",
                   help="stop all workers and exit 124 after this many seconds")
    p.add_argument("--host", default=None,
                   help="the address the workers advertise; one node: a loopback address "
                        "(default: 127.0.0.1); several nodes: this node's address on the "
                        "network they share (default: node 0 the coordinator's host, the "
                        "others the address they reach it from)")
    out = p.add_argument_group("output")
    out.add_argument("--output", choices=("worker0", "all"), default=DEFAULT_OUTPUT,
                     help="worker0: worker 0's output live, every worker's in its log file; "
                          "all: every worker's lines, prefixed (default: "
                          f"{DEFAULT_OUTPUT})")
    # Deprecated spelling of --output all, kept (hidden) for scripts and tests that use it.
    out.add_argument("--all-output", action="store_true", help=argparse.SUPPRESS)
    out.add_argument("--log-dir", metavar="DIR",
                     help="write worker i's output to DIR/worker-<i>.log (default with "
                          "--output worker0: a new tfdp-launch-* directory in the temporary "
                          "directory; none with --output all)")
    out.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    nodes = p.add_argument_group("several nodes")
    nodes.add_argument("--nnodes", type=_nnodes, metavar="N|MIN:MAX",
                       help="number of nodes (one tfdp launch on each; default: 1); MIN:MAX: "
                            "elastic, a round starts with MIN..MAX nodes, a lost node leaves "
                            "the others going on while MIN remain (with --max-restarts), a "
                            "node started later joins at once, up to MAX")
    nodes.add_argument("--elastic-policy", choices=ELASTIC_POLICIES, default=None,
                       help="with --nnodes MIN:MAX, the same global batch on fewer replicas "
                            "after a node is lost: batch (default) gives each replica a larger "
                            "share; accumulate runs each replica's share in micro-batches no "
                            "larger than a share at MAX nodes, gradients summed into one step "
                            "(the same on every node)")
    nodes.add_argument("--node-rank", type=int, metavar="R",
                       help="this node's rank, 0..N-1 (0 runs the coordinator)")
    nodes.add_argument("--coordinator", metavar="HOST:PORT",
                       help="where node 0 listens for the other nodes: an address of node 0 "
                            "they can reach and a free port, e.g. 10.0.0.1:29500")
    nodes.add_argument("--workers-per-node", type=int, metavar="K",
                       help="worker processes on each node (the same on every node)")
    nodes.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT,
                       metavar="SECONDS",
                       help="fail (exit 124) when not every node has joined within this long "
                            f"(default: {DEFAULT_JOIN_TIMEOUT:g})")
    nodes.add_argument("--node-timeout", type=float, default=DEFAULT_NODE_TIMEOUT,
                       metavar="SECONDS",
                       help="a node silent this long is lost and the job stops (default: "
                            f"{DEFAULT_NODE_TIMEOUT:g})")
    nodes.add_argument("--slurm", action="store_true",
                       help="take --nnodes, --node-rank and the coordinator (the first node, "
                            "port 29500 unless --coordinator is given) from srun's environment "
                            "(one tfdp launch per node: srun --ntasks-per-node=1)")
    nodes.add_argument("--rdzv-token", metavar="TOKEN", default=None,
                       help="the job's rendezvous secret, the same on every node (at least 16 "
                            "characters; default: $TFDP_RDZV_TOKEN, which other users cannot "
                            "read in the process list): node 0 admits only nodes that prove "
                            "they hold it, without sending it; without one the rendezvous is "
                            "open. Make one per job: openssl rand -hex 32")
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


def main(argv: list[str], environ=None) -> int:
    """Entry point of ``tfdp launch``; returns the exit code (raises UsageError on bad usage)."""
    args = parse_args(list(argv))
    if args.help:
        build_parser().print_help()
        return 0
    environ = os.environ if environ is None else environ
    args.min_nodes = None
    if isinstance(args.nnodes, tuple):
        args.min_nodes, args.nnodes = args.nnodes
    output = "all" if args.all_output else args.output
    common = dict(cpu_replicas=args.cpu_replicas, gpus_per_worker=args.gpus_per_worker,
                  timeout=args.timeout, output=output, log_dir=args.log_dir)
    if args.slurm:
        from tfdp.cluster.slurm import DEFAULT_LAUNCH_PORT, slurm_nodes
        if args.nnodes is not None or args.node_rank is not None:
            raise UsageError("--slurm reads the number of nodes and this node's rank from srun. "
                             f"Received: --nnodes={args.nnodes!r}, --node-rank="
                             f"{args.node_rank!r}. Give either --slurm or --nnodes/--node-rank.")
        try:
            args.nnodes, args.node_rank, first = slurm_nodes(environ)
        except UsageError:
            raise
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.coordinator is None:
            args.coordinator = f"{first}:{DEFAULT_LAUNCH_PORT}"
        if args.nnodes == 1 and args.workers_per_node is not None and args.workers is None:
            args.workers = args.workers_per_node
    if args.nnodes is not None:
        _check_int(args.nnodes, "--nnodes", 1)
    multi = args.nnodes is not None and args.nnodes != 1
    if not multi:
        for flag, value in (("--node-rank", args.node_rank), ("--coordinator",
                                                             args.coordinator),
                            ("--elastic-policy", args.elastic_policy)):
            if value is not None and not (args.slurm and args.nnodes == 1):
                if args.nnodes is None:
                    raise UsageError(f"{flag} is for several nodes. Received: {flag}={value!r} "
                                     "without --nnodes. Add --nnodes N (and --node-rank, "
                                     "--coordinator, --workers-per-node) on every node.")
        if args.workers_per_node is not None:
            if args.workers is not None and args.workers != args.workers_per_node:
                raise UsageError(f"--workers and --workers-per-node disagree. Received: "
                                 f"--workers={args.workers}, --workers-per-node="
                                 f"{args.workers_per_node}. On one node give just one of them.")
            args.workers = args.workers_per_node
        if args.workers is None:
            raise UsageError("Missing --workers. Received: no --workers option. "
                             "Give the number of worker processes, e.g. --workers 2.")
        host = "127.0.0.1" if args.host is None else args.host
        kwargs = dict(common, max_restarts=args.max_restarts, host=host)
        validate(args.command, args.workers, cli=True, **kwargs)
        return launch(args.command, args.workers, verbose=args.verbose, announce=True,
                      **kwargs)
    if args.workers is not None:
        raise UsageError(f"--workers is for one node. Received: --workers={args.workers} with "
                         f"--nnodes={args.nnodes}. Give the workers on each node with "
                         f"--workers-per-node (e.g. --workers-per-node {args.workers}).")
    return launch_nodes(args.command, nnodes=args.nnodes, node_rank=args.node_rank,
                        coordinator=args.coordinator, workers_per_node=args.workers_per_node,
                        host=args.host, verbose=args.verbose, join_timeout=args.join_timeout,
                        node_timeout=args.node_timeout, announce=True, cli=True,
                        max_restarts=args.max_restarts, min_nodes=args.min_nodes,
                        elastic_policy=args.elastic_policy, **common,
                        rdzv_token=tokens.resolve(args.rdzv_token, environ, cli=True))

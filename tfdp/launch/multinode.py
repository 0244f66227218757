"""``tfdp launch`` across nodes: one launcher per node, a static rendezvous, one cluster.

On every node (torchrun's static rendezvous in spirit)::

    tfdp launch --nnodes 2 --node-rank R --coordinator 10.0.0.1:29500 --workers-per-node K -- CMD

Node 0 listens at the coordinator address, every node reports its host and one free port per
worker (:mod:`tfdp.launch.rendezvous`), node 0 answers the full list, and every node then starts
its K workers with the same cluster in ``TF_CONFIG`` (node r's workers are ranks
``r*K .. r*K+K-1``), ``TFDP_WORKER_RANK`` / ``TFDP_NUM_WORKERS`` (global), ``TFDP_LOCAL_RANK``,
``TFDP_NODE_RANK`` / ``TFDP_NUM_NODES`` and ``TFDP_CPU_REPLICAS`` / ``CUDA_VISIBLE_DEVICES`` as
on one node. The rendezvous connections stay open: a node whose workers fail tells the others,
which stop theirs at once; a node that dies or goes silent (``node_timeout``) is named by the
others, which stop. A node that never shows up fails the job after ``join_timeout``.

Security: the workers' TensorFlow gRPC servers are unauthenticated and listen on every interface
of their ports. The rendezvous port on node 0 (bound to the coordinator address only) admits
only nodes that prove they hold the job's rendezvous token (``rdzv_token`` / ``TFDP_RDZV_TOKEN``:
:mod:`tfdp.launch.token`); without one it is open, and node 0 says so. Every node prints the
addresses it will listen on; run multi-node jobs on a private network or behind a firewall.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import time
from typing import IO, Mapping, Sequence

from tfdp import errors
from tfdp.errors import UsageError
from tfdp.launch import rendezvous as rdzv
from tfdp.launch import token as tokens
from tfdp.launch.job import _ForwardedSignals, _Job
from tfdp.launch.rounds import Rounds
from tfdp.launch.launcher import _check_int, validate

DEFAULT_JOIN_TIMEOUT = 300.0
DEFAULT_NODE_TIMEOUT = 10.0


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def parse_coordinator(coordinator, name: str = "coordinator") -> tuple[str, int]:
    """``"host:port"`` / ``"[v6]:port"`` -> (host without brackets, port); one-line errors."""
    from tfdp.cluster.spec import split_address
    if coordinator is None:
        raise errors.invalid_argument(name, None, what=f"Missing {name}", cls=UsageError,
                                      fix="Give node 0's address and a free port, e.g. "
                                          "--coordinator 10.0.0.1:29500.")
    try:
        host, port = split_address(coordinator, name)
    except errors.TfdpError as e:
        raise UsageError(str(e)) from None
    if _is_unspecified(host):
        raise errors.invalid_argument(name, coordinator, what="The coordinator must be an "
                                      "address the other nodes can connect to", cls=UsageError,
                                      fix="Use node 0's address, e.g. 10.0.0.1:29500.")
    return host.strip("[]"), port


ELASTIC_POLICIES = rdzv.ELASTIC_POLICIES


def _elastic_env(policy, max_workers) -> dict:
    """The workers' environment for ``--elastic-policy`` (none without one)."""
    if policy is None:
        return {}
    return {"TFDP_ELASTIC_POLICY": policy, "TFDP_ELASTIC_MAX_WORKERS": str(max_workers)}


def validate_nodes(cmd, *, nnodes, node_rank, coordinator, workers_per_node, host=None,
                   join_timeout=DEFAULT_JOIN_TIMEOUT, node_timeout=DEFAULT_NODE_TIMEOUT,
                   min_nodes=None, elastic_policy=None, cli=False,
                   **single) -> tuple[str, int]:
    """Check a multi-node launch's arguments (and the per-node ones, see
    :func:`tfdp.launch.launcher.validate`); return the coordinator's (host, port)."""
    def name(n):
        return "--" + n.replace("_", "-") if cli else n

    _check_int(nnodes, name("nnodes"), 2)
    if min_nodes is not None:
        if isinstance(min_nodes, bool) or not isinstance(min_nodes, int) \
                or not 1 <= min_nodes <= nnodes:
            raise errors.invalid_argument(
                "--nnodes MIN" if cli else "min_nodes", min_nodes, cls=UsageError,
                fix=f"Give the fewest nodes the job may run on, 1..{nnodes} (--nnodes "
                    f"MIN:MAX, e.g. --nnodes {max(1, nnodes - 1)}:{nnodes}).")
    if elastic_policy is not None:
        if elastic_policy not in ELASTIC_POLICIES:
            raise errors.invalid_argument(name("elastic_policy"), elastic_policy,
                                          valid=ELASTIC_POLICIES, cls=UsageError)
        if min_nodes is None or min_nodes == nnodes:
            raise errors.invalid_argument(
                name("elastic_policy"), elastic_policy, cls=UsageError,
                what=f"{name('elastic_policy')} is for an elastic job",
                fix=f"Give --nnodes MIN:MAX (e.g. --nnodes {max(1, nnodes - 1)}:{nnodes}), or "
                    f"leave {name('elastic_policy')} out: a job of a fixed size never splits "
                    "its batches otherwise.")
    if node_rank is None:
        raise errors.invalid_argument(name("node_rank"), None, what=f"Missing "
                                      f"{name('node_rank')}", cls=UsageError,
                                      fix=f"Give this node's rank, 0..{nnodes - 1} (0 on the "
                                          "coordinator's machine).")
    if isinstance(node_rank, bool) or not isinstance(node_rank, int) \
            or not 0 <= node_rank < nnodes:
        raise errors.invalid_argument(name("node_rank"), node_rank, cls=UsageError,
                                      fix=f"Use an integer in 0..{nnodes - 1} "
                                          f"({name('nnodes')} {nnodes}).")
    if workers_per_node is None:
        raise errors.invalid_argument(name("workers_per_node"), None, cls=UsageError,
                                      what=f"Missing {name('workers_per_node')}",
                                      fix="Give the number of worker processes on each node, "
                                          "e.g. --workers-per-node 1 (one per node, all its "
                                          "GPUs) or one per GPU.")
    _check_int(workers_per_node, name("workers_per_node"), 1)
    chost, cport = parse_coordinator(coordinator, name("coordinator"))
    for value, n in ((join_timeout, "join_timeout"), (node_timeout, "node_timeout")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                or value == float("inf"):
            raise errors.invalid_argument(name(n), value, cls=UsageError,
                                          fix="Give a positive number of seconds.")
    if host is not None:
        from tfdp.cluster.spec import split_address
        try:
            split_address(rdzv.format_address(host.strip("[]"), 1)
                          if isinstance(host, str) else host, name("host"))
        except errors.TfdpError as e:
            raise UsageError(str(e)) from None
        if _is_unspecified(host):
            raise errors.invalid_argument(
                name("host"), host, cls=UsageError,
                what="A node must advertise an address the other nodes can reach",
                fix="Give this node's address on the network the nodes share, or leave it out "
                    "(the address this node reaches the coordinator from).")
        if _is_loopback(host) and not _is_loopback(chost):
            raise errors.invalid_argument(
                name("host"), host, cls=UsageError,
                what="A loopback address cannot be reached from the other nodes",
                fix="Give this node's address on the network the nodes share, or leave it out.")
    validate(cmd, workers_per_node, cli=cli, loopback_only=False, **single)
    return chost, cport


def launch_nodes(cmd: Sequence[str], *, nnodes: int, node_rank: int, coordinator: str,
                 workers_per_node: int, cpu_replicas: int | None = None,
                 gpus_per_worker: int | None = None, timeout: float | None = None,
                 env: Mapping[str, str] | None = None, stdout: IO[str] | None = None,
                 stderr: IO[str] | None = None, host: str | None = None, output: str = "all",
                 log_dir: str | None = None, verbose: bool = False,
                 join_timeout: float = DEFAULT_JOIN_TIMEOUT,
                 node_timeout: float = DEFAULT_NODE_TIMEOUT, announce: bool | None = None,
                 max_restarts: int = 0, rdzv_token: str | None = None,
                 min_nodes: int | None = None, elastic_policy: str | None = None,
                 cli: bool = False) -> int:
    """Run this node's part of an ``nnodes``-node job; return the job's exit code.

    Args:
      cmd, cpu_replicas, gpus_per_worker, timeout, env, stdout, stderr, output, log_dir,
        verbose, announce: as in :func:`tfdp.launch.launch`, for this node's workers.
      nnodes: number of nodes (>= 2), each running this function once.
      node_rank: this node's rank, 0..nnodes-1; node 0 runs the coordinator.
      coordinator: ``"host:port"`` where node 0 listens for the rendezvous (an address of node
        0's machine that the other nodes can reach, and a free port).
      workers_per_node: worker processes on each node (the same on every node).
      host: the address this node's workers advertise; default: node 0 the coordinator's host,
        the others the address their rendezvous connection comes from.
      join_timeout: seconds to wait for every node to join (exit 124 after that).
      node_timeout: a node silent for this long (no rendezvous heartbeat) is lost.
      max_restarts: after a worker fails on any node, or a node other than node 0 is lost,
        every node stops its workers and the job forms again at the coordinator and restarts,
        up to this many times (``TFDP_RESTART_COUNT``; ``tfdp.callbacks.BackupAndRestore``
        resumes at the exact step). A lost node 0 ends the job.
      min_nodes: elastic (torchrun's ``--nnodes MIN:MAX``: ``nnodes`` is MAX): a round starts
        with at least this many nodes (node 0 among them) once no more join for a few seconds,
        a lost node leaves the others going on while at least this many remain (a restart),
        and a node that starts later joins at once (a restart point, not counted), up to
        ``nnodes``. Default: ``nnodes`` (not elastic).
      elastic_policy: an elastic job's "batch" (default: after a node is lost, fewer replicas
        take larger shares of the same global batch) or "accumulate" (each replica runs its
        share in micro-batches no larger than a replica's share at the full size, ``nnodes``
        nodes). The workers get it as ``TFDP_ELASTIC_POLICY``, with ``TFDP_ELASTIC_MAX_WORKERS``
        (``nnodes`` x ``workers_per_node``); every node must be given the same.
      rdzv_token: the job's rendezvous secret, the same on every node (at least 16
        characters; default: ``$TFDP_RDZV_TOKEN`` of ``env``, else none: an open rendezvous).
        Node 0 admits only nodes that prove they hold it, without sending it; the workers do
        not see it.

    Returns:
      0 when every worker of every node succeeded; the failed worker's exit code (on every
      node); 1 when a node was lost; 2 when the nodes' arguments disagree (raised as
      UsageError); 124 when a node did not join in time or ``timeout`` expired; 130 / 143 on
      SIGINT / SIGTERM.
    """
    single = dict(cpu_replicas=cpu_replicas, gpus_per_worker=gpus_per_worker, timeout=timeout,
                  env=env, output=output, log_dir=log_dir, max_restarts=max_restarts)
    chost, cport = validate_nodes(cmd, nnodes=nnodes, node_rank=node_rank,
                                  coordinator=coordinator, workers_per_node=workers_per_node,
                                  host=host, join_timeout=join_timeout,
                                  node_timeout=node_timeout, min_nodes=min_nodes,
                                  elastic_policy=elastic_policy, cli=cli, **single)
    k = workers_per_node
    token = tokens.resolve(rdzv_token, os.environ if env is None else env, cli=cli)
    env = tokens.environ_without(env)
    job = _Job(list(cmd), k, cpu_replicas, gpus_per_worker, env,
               sys.stdout if stdout is None else stdout, sys.stderr if stderr is None else stderr,
               output=output, log_dir=log_dir, verbose=verbose, rank_offset=node_rank * k,
               num_workers=nnodes * k,
               extra_env={"TFDP_NODE_RANK": str(node_rank), "TFDP_NUM_NODES": str(nnodes),
                          **_elastic_env(elastic_policy, nnodes * k)})
    job.elastic_policy = elastic_policy or "batch"   # (in the join: every node's must agree)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _ForwardedSignals() as received:
        try:
            if announce or (announce is None and output == "worker0"):
                job.announce()
            return Rounds(job, node_rank, nnodes, nnodes if min_nodes is None else min_nodes,
                          k, host, chost, cport, join_timeout, node_timeout, timeout, deadline,
                          received, token, max_restarts).run()
        finally:
            job.close()

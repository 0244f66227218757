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
from tfdp.launch.liveness import Liveness
from tfdp.launch.job import _ForwardedSignals, _Job, _supervise
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


def validate_nodes(cmd, *, nnodes, node_rank, coordinator, workers_per_node, host=None,
                   join_timeout=DEFAULT_JOIN_TIMEOUT, node_timeout=DEFAULT_NODE_TIMEOUT,
                   cli=False, **single) -> tuple[str, int]:
    """Check a multi-node launch's arguments (and the per-node ones, see
    :func:`tfdp.launch.launcher.validate`); return the coordinator's (host, port)."""
    def name(n):
        return "--" + n.replace("_", "-") if cli else n

    _check_int(nnodes, name("nnodes"), 2)
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
                                  node_timeout=node_timeout, cli=cli, **single)
    k = workers_per_node
    token = tokens.resolve(rdzv_token, os.environ if env is None else env, cli=cli)
    env = tokens.environ_without(env)
    job = _Job(list(cmd), k, cpu_replicas, gpus_per_worker, env,
               sys.stdout if stdout is None else stdout, sys.stderr if stderr is None else stderr,
               output=output, log_dir=log_dir, verbose=verbose, rank_offset=node_rank * k,
               num_workers=nnodes * k,
               extra_env={"TFDP_NODE_RANK": str(node_rank), "TFDP_NUM_NODES": str(nnodes)})
    say = job.say
    deadline = None if timeout is None else time.monotonic() + timeout
    with _ForwardedSignals() as received:
        try:
            if announce or (announce is None and output == "worker0"):
                job.announce()
            for attempt in range(max_restarts + 1):
                formed = _form(job, node_rank, nnodes, k, host, chost, cport, join_timeout,
                               received, token)
                if isinstance(formed, int):
                    return formed
                code, again = _run_round(job, formed, node_rank, nnodes, k, node_timeout,
                                         timeout, deadline, received, attempt, max_restarts)
                if not again:
                    return code
                say(f"restarting the job on every node (restart {attempt + 1} of "
                    f"{max_restarts}): {again}")
            return code
        finally:
            job.close()


def _pick_ports(k: int, cport: int) -> list[int]:
    import portpicker
    ports: list[int] = []
    while len(ports) < k:
        p = portpicker.pick_unused_port()
        if p not in ports and p != cport:
            ports.append(p)
    return ports


def _form(job, node_rank, nnodes, k, host, chost, cport, join_timeout, received, token):
    """One rendezvous: (workers, hosts, peers), or the exit code it ended with."""
    say = job.say
    hello = rdzv._hello(node_rank, nnodes, k, host, _pick_ports(k, cport))
    try:
        if node_rank == 0:
            coord = rdzv.Coordinator(chost, cport, say, token=token)
            guard = ("token-authenticated: only nodes with the same rendezvous token join"
                     if token else "open: any process that reaches it can join; give every "
                     f"node the same --rdzv-token or {tokens.ENV}")
            say(f"node 0 of {nnodes}: rendezvous listening on {coord.address} ({guard}); "
                f"waiting for {nnodes - 1} node(s), --join-timeout {join_timeout:g} s")
            hello["host"] = host or chost
            joined, peers = coord.gather(hello, join_timeout, received)
            hosts = {r: joined[r]["host"] for r in range(nnodes)}
            workers = [rdzv.format_address(hosts[r], p) for r in range(nnodes)
                       for p in joined[r]["ports"]]
            coord.answer(joined, peers, {"workers": workers,
                                         "hosts": {str(r): h for r, h in hosts.items()}})
        else:
            say(f"node {node_rank} of {nnodes}: joining the rendezvous at "
                f"{rdzv.format_address(chost, cport)} (--join-timeout {join_timeout:g} s)")
            reply, peer, own = rdzv.join(chost, cport, hello, join_timeout, received,
                                         token=token)
            peers = {0: peer}
            workers = reply["workers"]
            raw_hosts = reply.get("hosts") or {}
            hosts = {int(r): str(h) for r, h in raw_hosts.items() if str(r).isdigit()}
            hosts.setdefault(node_rank, own)
            if len(workers) != nnodes * k:
                raise rdzv.RendezvousError(
                    f"node 0 sent {len(workers)} worker addresses for {nnodes} nodes x {k} "
                    "workers")
    except rdzv.JoinTimeout as e:
        say(str(e))
        return 124
    except rdzv.RendezvousError as e:
        say(str(e))
        return 1
    except rdzv._Interrupted:
        import signal
        name = signal.Signals(received[0]).name
        say(f"received {name} during the rendezvous; nothing was started")
        return 128 + received[0]
    return workers, hosts, peers


def _run_round(job, formed, node_rank, nnodes, k, node_timeout, timeout, deadline, received,
               attempt, max_restarts) -> tuple[int, str | None]:
    """Start this node's workers in the cluster ``formed`` and see the job through: (exit
    code, None), or (the code, why) when the job is to be formed again (a restart)."""
    say = job.say
    workers, hosts, peers = formed
    mine = workers[node_rank * k:(node_rank + 1) * k]
    first = node_rank * k
    who = f"worker {first}" if k == 1 else f"workers {first}..{first + k - 1}"
    say(f"node {node_rank} of {nnodes}: {who} will listen on every interface at port(s) "
        f"{', '.join(a.rsplit(':', 1)[1] for a in mine)}, advertised as {', '.join(mine)} "
        "(TensorFlow's gRPC server is unauthenticated: keep them on a private network)")
    configs = [{"cluster": {"worker": list(workers)},
                "task": {"type": "worker", "index": node_rank * k + i}} for i in range(k)]
    liveness = Liveness(node_rank, peers, hosts, node_timeout)
    try:
        def on_end(outcome, code, line):
            liveness.report(outcome[0] == "ok", line, code)

        code = _supervise(job, 0, timeout, deadline, received, lambda _: configs,
                          watch=liveness.watch, on_end=on_end, attempt=attempt)
        if code == 0:
            return _finish(job, liveness, node_rank, nnodes, timeout, deadline, received), None
        if (attempt >= max_restarts or received or code in (124, 130, 143)
                or (deadline is not None and time.monotonic() >= deadline)):
            return code, None
        if node_rank != 0 and 0 in liveness.lost:
            say("the coordinator's node 0 was lost: the job ends here (a restart needs node 0, "
                "where the nodes meet)")
            return code, None
        lost = sorted(r for r in liveness.lost if r != 0)
        if lost:
            return code, (f"node(s) {', '.join(map(str, lost))} lost: waiting for all "
                          f"{nnodes} nodes to join again (--join-timeout)")
        return code, "every node's workers restart from the last backup"
    finally:
        liveness.close()


def _finish(job, liveness, node_rank, nnodes, timeout, deadline, received) -> int:
    """After this node's workers succeeded: the job's exit code once every node is done."""
    say = job.say
    end = liveness.finish(deadline, received)
    if end is None:
        if node_rank == 0:
            say(f"all {nnodes} nodes succeeded")
        return 0
    if end[0] == "signal":
        import signal
        say(f"received {signal.Signals(end[1]).name} while waiting for the other nodes")
        liveness.report(False, "stopped by a signal", 128 + end[1])
        return 128 + end[1]
    if end[0] == "timeout":
        say(f"timed out after {timeout:g} s (--timeout) waiting for the other nodes")
        liveness.report(False, "timed out (--timeout)", 124)
        return 124
    say(end[1])
    return end[2]

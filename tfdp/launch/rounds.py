"""The rounds of a multi-node ``tfdp launch`` job (:func:`tfdp.launch.multinode.launch_nodes`).

A round: the nodes meet at node 0 (:mod:`tfdp.launch.coordinator` / :mod:`tfdp.launch.rendezvous`),
every member starts its workers in that round's cluster, and the liveness channel
(:mod:`tfdp.launch.liveness`) sees the round through. The job forms again, a new round, when:

- a worker fails on any node, or a node other than node 0 is lost, and restarts are left
  (``max_restarts``; each counts one);
- elastic (``min_nodes`` < ``nnodes``: ``--nnodes MIN:MAX``): a node that is not a member asks
  node 0 to join (up to ``nnodes``; a restart point, not counted as a restart).

Node 0 decides and tells every node (``reform``) before it closes the round's connections; a
node other than node 0 that sees node 0's connection end without that knows node 0 is lost, and
the job ends there. A lost node is waited for (``join_timeout``), except in an elastic job while
at least ``min_nodes`` remain: the others go on without it. Members are ordered by node rank;
node r's workers take the next ``k`` worker ranks, so worker 0 (the chief) is always on node 0.
Every start's ``TFDP_RESTART_COUNT`` is its round's number (node 0's: a node that joins later
takes it from the cluster it is sent).

Importing this module never imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import signal
import time

from tfdp.launch import rendezvous as rdzv
from tfdp.launch import token as tokens
from tfdp.launch.coordinator import Coordinator
from tfdp.launch.job import _supervise
from tfdp.launch.liveness import Liveness

RESTART_ALL = "every node's workers restart from the last backup"


@dataclasses.dataclass
class Rounds:
    job: object
    node_rank: int
    nnodes: int            # the most nodes (MAX)
    min_nodes: int         # the fewest a round may start with (MIN; == nnodes: not elastic)
    k: int                 # workers per node
    host: str | None
    chost: str
    cport: int
    join_timeout: float
    node_timeout: float
    timeout: float | None
    deadline: float | None
    received: list
    token: str | None
    max_restarts: int
    coord: Coordinator | None = None
    members: list = dataclasses.field(default_factory=list)
    number: int = 0        # the round's number (node 0's count: a node that joins later takes it)

    @property
    def elastic(self) -> bool:
        return self.min_nodes < self.nnodes

    def run(self) -> int:
        say = self.job.say
        restarts, expect = 0, None
        try:
            while True:
                formed = self._form(expect)
                if isinstance(formed, int):
                    return formed
                code, again, counts, expect = self._round(formed, self.number, restarts)
                if again is None:
                    return code
                self.number += 1
                if counts:
                    restarts += 1
                    say(f"restarting the job on every node (restart {restarts} of "
                        f"{self.max_restarts}): {again}")
                else:
                    say(f"forming the job again: {again}")
        finally:
            if self.coord is not None:
                self.coord.close()

    # --- a rendezvous -------------------------------------------------------------------------

    def _form(self, expect):
        """One rendezvous: (workers, hosts, peers, members), or the exit code it ended with."""
        say, nnodes, k = self.job.say, self.nnodes, self.k
        hello = rdzv._hello(self.node_rank, nnodes, k, self.host, _pick_ports(k, self.cport),
                            getattr(self.job, "elastic_policy", "batch"))
        shape = (f"{self.min_nodes} to {nnodes} nodes" if self.elastic else f"{nnodes - 1} "
                 "node(s)")
        try:
            if self.node_rank == 0:
                coord = self.coord
                if coord is None:
                    coord = Coordinator(self.chost, self.cport, say, token=self.token,
                                        keep_open=self.elastic)
                    if self.elastic:
                        self.coord = coord  # (listening while the rounds run)
                    guard = ("token-authenticated: only nodes with the same rendezvous token "
                             "join" if self.token else "open: any process that reaches it can "
                             f"join; give every node the same --rdzv-token or {tokens.ENV}")
                    say(f"node 0 of {nnodes}: rendezvous listening on {coord.address} "
                        f"({guard}); waiting for {shape}, --join-timeout "
                        f"{self.join_timeout:g} s")
                hello["host"] = self.host or self.chost
                joined, peers = coord.gather(hello, self.join_timeout, self.received,
                                             min_nodes=self.min_nodes, expect=expect)
                members = sorted(joined)
                hosts = {r: joined[r]["host"] for r in members}
                workers = [rdzv.format_address(hosts[r], p) for r in members
                           for p in joined[r]["ports"]]
                coord.answer(joined, peers, {"workers": workers, "members": members,
                                             "hosts": {str(r): h for r, h in hosts.items()},
                                             "round": self.number})
            else:
                say(f"node {self.node_rank} of {nnodes}: joining the rendezvous at "
                    f"{rdzv.format_address(self.chost, self.cport)} (--join-timeout "
                    f"{self.join_timeout:g} s)")
                reply, peer, own = rdzv.join(self.chost, self.cport, hello, self.join_timeout,
                                             self.received, token=self.token)
                peers = {0: peer}
                workers = reply["workers"]
                members = reply.get("members", list(range(nnodes)))
                raw_hosts = reply.get("hosts") or {}
                hosts = {int(r): str(h) for r, h in raw_hosts.items() if str(r).isdigit()}
                hosts.setdefault(self.node_rank, own)
                number = reply.get("round", self.number)
                if isinstance(number, int) and number >= 0:
                    self.number = number
                if (not isinstance(members, list) or self.node_rank not in members
                        or len(workers) != len(members) * k):
                    raise rdzv.RendezvousError(
                        f"node 0 sent {len(workers)} worker addresses for node(s) {members} x "
                        f"{k} workers")
        except rdzv.JoinTimeout as e:
            say(str(e))
            return 124
        except rdzv.RendezvousError as e:
            say(str(e))
            return 1
        except rdzv._Interrupted:
            name = signal.Signals(self.received[0]).name
            say(f"received {name} during the rendezvous; nothing was started")
            return 128 + self.received[0]
        return workers, hosts, peers, members

    # --- a round ------------------------------------------------------------------------------

    def _round(self, formed, number: int, restarts: int):
        """Run one round: (exit code, None, ...) when the job ends, else (code, why, whether
        it counts as a restart, the nodes to wait for next)."""
        job, say, k = self.job, self.job.say, self.k
        workers, hosts, peers, members = formed
        changed = self.members and members != self.members
        previous, self.members = self.members, members
        position = members.index(self.node_rank)
        job.reshape(position * k, len(members) * k,
                    {"TFDP_NODE_RANK": str(self.node_rank), "TFDP_NUM_NODES": str(len(members))})
        if changed and self.node_rank == 0:
            gone = sorted(set(previous) - set(members))
            came = sorted(set(members) - set(previous))
            what = "; ".join(x for x in (
                f"node(s) {', '.join(map(str, gone))} gone" if gone else "",
                f"node(s) {', '.join(map(str, came))} joined" if came else "") if x)
            say(f"{what}: continuing on {len(members)} nodes ({', '.join(map(str, members))}): "
                f"{job.replicas}")
        mine = workers[position * k:(position + 1) * k]
        first = position * k
        who = f"worker {first}" if k == 1 else f"workers {first}..{first + k - 1}"
        say(f"node {self.node_rank} of {self.nnodes}: {who} will listen on every interface at "
            f"port(s) {', '.join(a.rsplit(':', 1)[1] for a in mine)}, advertised as "
            f"{', '.join(mine)} (TensorFlow's gRPC server is unauthenticated: keep them on a "
            "private network)")
        configs = [{"cluster": {"worker": list(workers)},
                    "task": {"type": "worker", "index": first + i}} for i in range(k)]
        liveness = Liveness(self.node_rank, peers, hosts, self.node_timeout)
        try:
            def on_end(outcome, code, line):
                liveness.report(outcome[0] == "ok", line, code)

            def watch():
                if self.coord is not None and len(members) < self.nnodes:
                    asked = self.coord.poll(members, self.nnodes, k)
                    if asked:
                        line = (f"node(s) {', '.join(map(str, asked))} asked to join (--nnodes "
                                f"{self.min_nodes}:{self.nnodes})")
                        liveness.send_reform(line, counts=False)
                        return ("remote", f"{line}; stopped the workers of node 0", 1)
                return liveness.watch()

            code = _supervise(job, 0, self.timeout, self.deadline, self.received,
                              lambda _: configs, watch=watch, on_end=on_end, attempt=number)
            if code == 0:
                return self._finish(liveness), None, False, None
            if self.received or code in (124, 130, 143) or (
                    self.deadline is not None and time.monotonic() >= self.deadline):
                return code, None, False, None
            if self.node_rank != 0:
                if liveness.reform is None and 0 in liveness.lost:
                    say("the coordinator's node 0 was lost: the job ends here (a restart needs "
                        "node 0, where the nodes meet)")
                    return code, None, False, None
                counts = liveness.reform is None or liveness.reform_counts
                if counts and restarts >= self.max_restarts:
                    return code, None, False, None
                return code, liveness.reform or RESTART_ALL, counts, None
            return self._decide(liveness, members, code, restarts)
        finally:
            liveness.close()

    def _decide(self, liveness, members, code, restarts):
        """Node 0, after a round that did not succeed: end the job, or form it again (and tell
        every node so, before the round's connections close)."""
        if liveness.reform is not None:  # a node asked to join: not counted
            return code, liveness.reform, False, None
        if restarts >= self.max_restarts:
            return code, None, False, None
        liveness.settle(1.0)  # a node's own workers may fail before its lost peer is seen
        lost = sorted(r for r in liveness.lost if r != 0)
        survivors = [r for r in members if r not in lost]
        if not lost:
            why, expect = RESTART_ALL, members
        elif self.elastic and len(survivors) >= self.min_nodes:
            why = (f"node(s) {', '.join(map(str, lost))} lost; continuing on the "
                   f"{len(survivors)} that remain (--nnodes {self.min_nodes}:{self.nnodes})")
            expect = survivors
        else:
            why = (f"node(s) {', '.join(map(str, lost))} lost: waiting for "
                   f"{'all ' + str(len(members)) if not self.elastic else self.min_nodes} "
                   "nodes to join again (--join-timeout)")
            expect = members
        liveness.send_reform(why, counts=True)
        return code, why, True, expect

    def _finish(self, liveness) -> int:
        """After this node's workers succeeded: the job's exit code once every node is done."""
        say = self.job.say
        end = liveness.finish(self.deadline, self.received)
        if end is None:
            if self.node_rank == 0:
                say(f"all {len(self.members)} nodes succeeded")
            return 0
        if end[0] == "signal":
            say(f"received {signal.Signals(end[1]).name} while waiting for the other nodes")
            liveness.report(False, "stopped by a signal", 128 + end[1])
            return 128 + end[1]
        if end[0] == "timeout":
            say(f"timed out after {self.timeout:g} s (--timeout) waiting for the other nodes")
            liveness.report(False, "timed out (--timeout)", 124)
            return 124
        say(end[1])
        return end[2]


def _pick_ports(k: int, cport: int) -> list[int]:
    import portpicker
    ports: list[int] = []
    while len(ports) < k:
        p = portpicker.pick_unused_port()
        if p not in ports and p != cport:
            ports.append(p)
    return ports

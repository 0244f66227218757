"""Node 0's side of the multi-node rendezvous (:mod:`tfdp.launch.rendezvous`: the protocol and
the joining side): listen at the coordinator address, greet every connection with a challenge,
drop strays with one line each, gather the nodes' joins and answer the cluster; elastic jobs
keep listening while a round runs, for nodes that ask to join (:meth:`Coordinator.poll`).

Importing this module never imports TensorFlow.
"""

from __future__ import annotations

import queue
import socket
import time

from tfdp import errors
from tfdp.errors import UsageError
from tfdp.launch import rendezvous as rdzv
from tfdp.launch import token as tokens


class Coordinator:
    """Node 0's side: listen, gather every node's join, answer the cluster."""

    def __init__(self, host: str, port: int, say, token: str | None = None,
                 keep_open: bool = False):
        self.say, self.token, self.keep_open = say, token, keep_open
        self.pending: list[tuple[rdzv.Peer, float, str]] = []  # (connection, accepted, challenge)
        self.waiting: dict[int, tuple[dict, rdzv.Peer]] = {}    # asked to join during a round
        self.elastic_policy = "batch"  # node 0's --elastic-policy (every node's must be it)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as e:
            raise errors.invalid_argument(
                "--coordinator", f"{host}:{port}", what=f"Cannot resolve the coordinator host "
                f"({e.strerror})", cls=UsageError,
                fix="Use an address or host name of node 0's machine.") from None
        family, _, _, _, sockaddr = infos[0]
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind(sockaddr)
        except OSError as e:
            self.sock.close()
            raise errors.invalid_argument(
                "--coordinator", f"{host}:{port}", what=f"Node 0 cannot listen at the "
                f"coordinator address ({e.strerror})", cls=UsageError,
                fix="Run --node-rank 0 on the coordinator's machine, with an address of that "
                    "machine and a free port.") from None
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.address = rdzv.format_address(sockaddr[0], sockaddr[1])

    def gather(self, hello: dict, join_timeout: float, received, min_nodes: int | None = None,
               expect=None, last_call: float = rdzv.LAST_CALL_S) -> tuple[dict, dict]:
        """Wait for the nodes; return ({rank: hello}, {rank: rdzv.Peer}). Raises rdzv.JoinTimeout,
        UsageError (the nodes disagree), or rdzv._Interrupted on a signal.

        Done when every node of ``expect`` (default: all ``nnodes``) has joined, or, elastic
        (``min_nodes`` < ``nnodes``), ``last_call`` seconds after ``min_nodes`` had. Nodes that
        asked to join while the last round ran (:meth:`poll`) are in from the start."""
        nnodes, k = hello["nnodes"], hello["workers_per_node"]
        self.elastic_policy = rdzv.elastic_policy(hello)
        min_nodes = nnodes if min_nodes is None else min_nodes
        expect = set(range(nnodes)) if expect is None else set(expect) | {0}
        joined, peers = {0: hello}, {}
        for r, (msg, peer) in self.waiting.items():
            joined[r], peers[r] = msg, peer
        self.waiting = {}
        deadline = time.monotonic() + join_timeout
        enough_since = None
        try:
            while not expect <= set(joined):
                now = time.monotonic()
                if len(joined) >= min_nodes:
                    enough_since = enough_since or now
                    if now - enough_since >= last_call or now >= deadline:
                        break
                if received:
                    raise rdzv._Interrupted()
                if now >= deadline:
                    missing = sorted(expect - set(joined))
                    raise rdzv.JoinTimeout(errors.message(
                        f"node(s) {', '.join(map(str, missing))} did not join the rendezvous at "
                        f"{self.address} within {join_timeout:g} s (--join-timeout)",
                        f"joined: node(s) {', '.join(map(str, sorted(joined)))} of {nnodes}"
                        + (f" ({min_nodes} needed)" if min_nodes < nnodes else ""),
                        "Start `tfdp launch --node-rank R ...` on every node, with the same "
                        "--coordinator, and check that they can reach this address (firewall, "
                        "routing)."))
                self._accept()
                for msg, peer in self._hellos(nnodes, k):
                    self._admit(msg, peer, joined, peers, nnodes, k)
        except BaseException:
            for peer in list(peers.values()):
                peer.close()
            self.close()
            raise
        finally:
            if not self.keep_open:
                self.close()  # the job is formed (or failed): nobody else may join
        return joined, peers

    def poll(self, members, nnodes: int, k: int) -> list[int]:
        """While a round runs (elastic, ``keep_open``): take new connections; a node of the
        job that is not a member asks to join (kept for the next round). Returns the ranks
        that asked since the last call; a node rank already in the job is refused, the job
        goes on."""
        asked = []
        self._accept()
        for msg, peer in self._hellos(nnodes, k):
            r = msg["node_rank"]
            problem = None
            if msg["nnodes"] != nnodes or msg["workers_per_node"] != k:
                problem = (f"node {r} ({msg['host']}) was started with --nnodes "
                           f"{msg['nnodes']} --workers-per-node {msg['workers_per_node']}, node "
                           f"0 with {nnodes} and {k}")
            elif rdzv.elastic_policy(msg) != self.elastic_policy:
                problem = (f"node {r} ({msg['host']}) was started with --elastic-policy "
                           f"{rdzv.elastic_policy(msg)}, node 0 with --elastic-policy "
                           f"{self.elastic_policy}")
            elif not 1 <= r < nnodes or r in members or r in self.waiting:
                problem = (f"a node joined with --node-rank {r} ({msg['host']}), which is in "
                           f"the job already or out of range (1..{nnodes - 1})")
            if problem:
                self.say(f"ignored a connection from {peer.address}: {problem}")
                peer.send({"error": problem})
                peer.close()
                continue
            self.waiting[r] = (msg, peer)
            asked.append(r)
        return asked

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        for _, peer in self.waiting.values():
            peer.close()
        for peer, _, _ in self.pending:
            peer.close()
        self.waiting, self.pending = {}, []

    def _hellos(self, nnodes: int, k: int):
        """The well-formed, proven join messages among the waiting connections (the others
        dropped with one line each)."""
        for entry in list(self.pending):
            peer, since, nonce = entry
            try:
                msg = peer.inbox.get_nowait()
            except queue.Empty:
                if peer.closed or time.monotonic() - since > rdzv._HELLO_S:
                    # (why, before close(): its reader then sees the end and says "closed")
                    why = peer.closed or f"it said nothing within {rdzv._HELLO_S:g} s"
                    self.pending.remove(entry)
                    peer.close()
                    self.say(f"ignored a connection from {peer.address}: {why}")
                continue
            self.pending.remove(entry)
            why = rdzv._check_hello(msg, nnodes, k) or self._check_proof(msg, nonce, peer)
            if why:
                self.say(f"ignored a connection from {peer.address}: {why}")
                peer.close()
                continue
            yield msg, peer

    def _accept(self) -> None:
        """Take one new connection, if any, and greet it with a challenge."""
        try:
            conn, addr = self.sock.accept()
        except socket.timeout:
            return
        address = rdzv.format_address(addr[0], addr[1])
        if len(self.pending) >= rdzv.MAX_PENDING:
            conn.close()
            self.say(f"ignored a connection from {address}: {rdzv.MAX_PENDING} connections are "
                     "already waiting to say who they are")
            return
        peer = rdzv.Peer(conn, address)
        nonce = tokens.challenge()
        peer.send({"protocol": rdzv.PROTOCOL, "version": rdzv.VERSION, "challenge": nonce,
                   "token": self.token is not None})
        self.pending.append((peer, time.monotonic(), nonce))

    def _check_proof(self, msg, nonce, peer) -> str | None:
        """None if the join may proceed, else why it is ignored (answered with an error)."""
        if self.token is None:
            if "proof" in msg:  # a node given a token, node 0 none: the nodes disagree
                problem = (f"node {msg['node_rank']} ({msg['host']}) was given a rendezvous "
                           "token, node 0 none")
                peer.send({"error": problem, "fix": rdzv._TOKEN_FIX})
                peer.close()
                raise UsageError(f"{problem}. {rdzv._TOKEN_FIX}")
            return None
        if tokens.verify(self.token, "join", nonce, msg):
            return None
        if "proof" in msg:
            why, told = ("it did not prove it holds the rendezvous token",
                         "this node's rendezvous token is not node 0's")
        else:
            why, told = ("it has no rendezvous token",
                         "node 0 requires a rendezvous token and this node has none")
        peer.send({"error": told, "fix": rdzv._TOKEN_FIX})
        return why

    def answer(self, joined: dict, peers: dict, reply: dict) -> None:
        """Send every joined node the cluster, with node 0's proof of its challenge."""
        for r, peer in peers.items():
            message = dict(reply)
            if self.token is not None:
                message["proof"] = tokens.proof(self.token, "cluster", joined[r]["challenge"],
                                                message)
            peer.send(message)

    def _admit(self, msg, peer, joined, peers, nnodes, k) -> None:
        r = msg["node_rank"]
        problem = None
        if msg["nnodes"] != nnodes:
            problem = (f"node {r} ({msg['host']}) was started with --nnodes {msg['nnodes']}, "
                       f"node 0 with --nnodes {nnodes}")
        elif msg["workers_per_node"] != k:
            problem = (f"node {r} ({msg['host']}) was started with --workers-per-node "
                       f"{msg['workers_per_node']}, node 0 with --workers-per-node {k}")
        elif not 1 <= r < nnodes:
            problem = (f"a node joined with --node-rank {r} ({msg['host']}); valid: 1.."
                       f"{nnodes - 1} (node 0 is the coordinator)")
        elif r in joined:
            problem = (f"two nodes were started with --node-rank {r} ({joined[r]['host']} and "
                       f"{msg['host']})")
        elif len(msg["ports"]) != k:
            problem = f"node {r} sent {len(msg['ports'])} worker ports for {k} workers"
        elif rdzv.elastic_policy(msg) != self.elastic_policy:
            problem = (f"node {r} ({msg['host']}) was started with --elastic-policy "
                       f"{rdzv.elastic_policy(msg)}, node 0 with --elastic-policy "
                       f"{self.elastic_policy}")
        if problem:
            peer.send({"error": problem})
            peer.close()
            raise UsageError(problem + ". Start every node with the same --nnodes, "
                             "--workers-per-node and --elastic-policy, and its own "
                             "--node-rank.")
        joined[r] = msg
        peers[r] = peer
        self.say(f"node {r} joined from {msg['host']} ({len(joined)} of {nnodes})")

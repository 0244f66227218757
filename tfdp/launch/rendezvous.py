"""A small static TCP rendezvous for ``tfdp launch`` across nodes (torchrun's static rendezvous).

Node 0 listens at the coordinator address; every other node connects (retrying until its join
timeout: node 0 may start later) and sends one JSON line: its node rank, the job's shape
(``nnodes``, ``workers_per_node``) and the address its workers advertise (its host and one free
port per worker). When every node has joined, node 0 answers each with the full list of worker
addresses, in rank order (node r's workers are ranks ``r*K .. r*K+K-1``). Shapes that disagree,
a node rank twice or out of range are one-line errors on both sides.

The connections then stay open as the job's liveness channel: every node pings every second,
reports how its workers ended (``done`` / ``failed`` with the line and exit code) and node 0
relays a failure to the others and ends the job (``end``) once every node is done. A node whose
connection closes, or that sends nothing for ``node_timeout`` seconds (killed, frozen, the link
cut), is lost, and the others stop their workers at once.

The channel carries no code and no credentials: JSON lines of at most 64 KiB, checked field by
field; a connection that sends anything else is dropped (a port scanner cannot end the job).
It is unauthenticated, like TensorFlow's gRPC server: keep the coordinator port on a private
network. Importing this module never imports TensorFlow.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time

from tfdp import errors
from tfdp.errors import TfdpError, UsageError

PROTOCOL = "tfdp-launch-rendezvous"
VERSION = 1
MAX_LINE = 1 << 16
PING_S = 1.0
_HELLO_S = 10.0      # a new connection must say who it is within this long
_RETRY_S = 0.5       # between connection attempts to the coordinator
_IO_TIMEOUT_S = 2.0  # socket timeout: reads wake up, sends to a cut link give up


class JoinTimeout(TfdpError):
    """A node did not show up (or the coordinator could not be reached) in time."""


class RendezvousError(TfdpError):
    """The rendezvous failed (a peer closed the connection or sent an error)."""


class Peer:
    """One rendezvous connection: JSON lines both ways, a reader thread, when it was last heard."""

    def __init__(self, sock: socket.socket, address: str):
        self.sock, self.address = sock, address
        self.inbox: queue.Queue = queue.Queue()
        self.last_seen = time.monotonic()
        self.closed: str | None = None  # why the connection ended, once it has
        self._send_lock = threading.Lock()
        sock.settimeout(_IO_TIMEOUT_S)
        self._reader = threading.Thread(target=self._read, name=f"tfdp-rdzv-{address}",
                                        daemon=True)
        self._reader.start()

    def send(self, message: dict) -> bool:
        data = (json.dumps(message) + "\n").encode()
        with self._send_lock:
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False  # a closed or cut connection: the reader / liveness check tells

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self.sock.recv(4096)
            except socket.timeout:
                continue
            except OSError as e:
                self.closed = f"the connection failed ({e.strerror or e})"
                return
            if not chunk:
                self.closed = "it closed the rendezvous connection"
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    message = json.loads(line)
                except ValueError:
                    message = None
                if not isinstance(message, dict):
                    self.closed = "it sent something that is not a tfdp launch message"
                    self.close()
                    return
                self.last_seen = time.monotonic()
                self.inbox.put(message)
            if len(buf) > MAX_LINE:
                self.closed = "it sent a line longer than 64 KiB"
                self.close()
                return

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _hello(node_rank: int, nnodes: int, workers_per_node: int, host: str, ports: list[int]):
    return {"protocol": PROTOCOL, "version": VERSION, "node_rank": node_rank, "nnodes": nnodes,
            "workers_per_node": workers_per_node, "host": host, "ports": list(ports)}


def _check_hello(msg: dict, nnodes: int, workers_per_node: int) -> str | None:
    """None if ``msg`` is a well-formed join message, else why not (a stray connection)."""
    if msg.get("protocol") != PROTOCOL:
        return "not a tfdp launch rendezvous message"
    if msg.get("version") != VERSION:
        return f"rendezvous version {msg.get('version')!r}, this node speaks {VERSION}"
    for key in ("node_rank", "nnodes", "workers_per_node"):
        if isinstance(msg.get(key), bool) or not isinstance(msg.get(key), int):
            return f"no integer {key!r}"
    host, ports = msg.get("host"), msg.get("ports")
    if not isinstance(host, str) or not host or len(host) > 255 or any(
            c.isspace() or c in "/@" for c in host):
        return "no valid host"
    if not isinstance(ports, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) and 1 <= p <= 65535 for p in ports):
        return "no valid ports"
    return None


class Coordinator:
    """Node 0's side: listen, gather every node's join, answer the cluster."""

    def __init__(self, host: str, port: int, say):
        self.say = say
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
        self.address = format_address(sockaddr[0], sockaddr[1])

    def gather(self, hello: dict, join_timeout: float, received) -> tuple[dict, dict]:
        """Wait for every node; return ({rank: hello}, {rank: Peer}). Raises JoinTimeout,
        UsageError (the nodes disagree), or returns early (empty peers) on a signal."""
        nnodes, k = hello["nnodes"], hello["workers_per_node"]
        joined, peers = {0: hello}, {}
        pending: list[tuple[Peer, float]] = []
        deadline = time.monotonic() + join_timeout
        try:
            while len(joined) < nnodes:
                if received:
                    raise _Interrupted()
                if time.monotonic() >= deadline:
                    missing = [r for r in range(nnodes) if r not in joined]
                    raise JoinTimeout(errors.message(
                        f"node(s) {', '.join(map(str, missing))} did not join the rendezvous at "
                        f"{self.address} within {join_timeout:g} s (--join-timeout)",
                        f"joined: node(s) {', '.join(map(str, sorted(joined)))} of {nnodes}",
                        "Start `tfdp launch --node-rank R ...` on every node, with the same "
                        "--coordinator, and check that they can reach this address (firewall, "
                        "routing)."))
                try:
                    conn, addr = self.sock.accept()
                    pending.append((Peer(conn, format_address(addr[0], addr[1])),
                                    time.monotonic()))
                except socket.timeout:
                    pass
                for peer, since in list(pending):
                    try:
                        msg = peer.inbox.get_nowait()
                    except queue.Empty:
                        if peer.closed or time.monotonic() - since > _HELLO_S:
                            pending.remove((peer, since))
                            peer.close()
                            self.say(f"ignored a connection from {peer.address}: "
                                     f"{peer.closed or 'it said nothing'}")
                        continue
                    pending.remove((peer, since))
                    why = _check_hello(msg, nnodes, k)
                    if why:
                        self.say(f"ignored a connection from {peer.address}: {why}")
                        peer.close()
                        continue
                    self._admit(msg, peer, joined, peers, nnodes, k)
        except BaseException:
            for peer in list(peers.values()) + [p for p, _ in pending]:
                peer.close()
            raise
        finally:
            self.sock.close()  # the job is formed (or failed): nobody else may join
        return joined, peers

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
        if problem:
            peer.send({"error": problem})
            peer.close()
            raise UsageError(problem + ". Start every node with the same --nnodes and "
                             "--workers-per-node and its own --node-rank.")
        joined[r] = msg
        peers[r] = peer
        self.say(f"node {r} joined from {msg['host']} ({len(joined)} of {nnodes})")


class _Interrupted(Exception):
    """A signal arrived during the rendezvous."""


def join(host: str, port: int, hello: dict, join_timeout: float, received, bind_host=None):
    """Node r's side: connect (retrying), send ``hello`` (its ``host`` filled in from the
    connection when None), wait for the cluster. Returns (reply, peer, own host)."""
    deadline = time.monotonic() + join_timeout
    last = "no attempt"
    sock = None
    while sock is None:
        if received:
            raise _Interrupted()
        if time.monotonic() >= deadline:
            raise JoinTimeout(errors.message(
                f"could not reach the coordinator {format_address(host, port)} within "
                f"{join_timeout:g} s (--join-timeout)", f"last error: {last}",
                "Start node 0 (--node-rank 0) on the coordinator's machine and check this "
                "node can reach it (address, firewall, routing)."))
        try:
            sock = socket.create_connection((host, port), timeout=_IO_TIMEOUT_S,
                                            source_address=(bind_host, 0) if bind_host else None)
        except socket.gaierror as e:
            raise errors.invalid_argument(
                "--coordinator", format_address(host, port), cls=UsageError,
                what=f"Cannot resolve the coordinator host ({e.strerror})",
                fix="Use node 0's address or host name.") from None
        except OSError as e:
            last = e.strerror or str(e)
            time.sleep(_RETRY_S)
    own = sock.getsockname()[0]
    hello = dict(hello, host=hello["host"] or own)
    peer = Peer(sock, format_address(host, port))
    peer.send(hello)
    while True:
        if received:
            peer.close()
            raise _Interrupted()
        try:
            reply = peer.inbox.get(timeout=0.1)
        except queue.Empty:
            if peer.closed:
                raise RendezvousError(f"node 0 ({format_address(host, port)}) ended the "
                                      f"rendezvous: {peer.closed}") from None
            if time.monotonic() >= deadline:
                peer.close()
                raise JoinTimeout(errors.message(
                    f"joined the coordinator {format_address(host, port)} but the other nodes "
                    f"did not all join within {join_timeout:g} s (--join-timeout)",
                    "no cluster from node 0", "Start every node of the job.")) from None
            continue
        if "error" in reply:
            peer.close()
            raise UsageError(f"{reply['error']}. Start every node with the same --nnodes and "
                             "--workers-per-node and its own --node-rank.")
        workers = reply.get("workers")
        if isinstance(workers, list) and all(isinstance(w, str) for w in workers):
            return reply, peer, hello["host"]
        if reply.get("event") == "ping":
            continue
        peer.close()
        raise RendezvousError(f"node 0 ({format_address(host, port)}) sent an unexpected "
                              f"reply: {str(reply)[:200]}")


class Liveness:
    """After the rendezvous: ping, watch the other nodes, report and relay how nodes end."""

    def __init__(self, node_rank: int, peers: dict, hosts: dict, node_timeout: float):
        self.node_rank, self.peers, self.hosts = node_rank, peers, hosts
        self.node_timeout = node_timeout
        self.done: set[int] = set()
        self.ended = False
        self._stop = threading.Event()
        self._pinger = threading.Thread(target=self._ping, name="tfdp-rdzv-ping", daemon=True)
        self._pinger.start()

    def _ping(self) -> None:
        while not self._stop.wait(PING_S):
            for peer in list(self.peers.values()):
                peer.send({"event": "ping"})

    def _name(self, r: int) -> str:
        return f"node {r} ({self.hosts.get(r, '?')})"

    def watch(self):
        """None while every other node is fine, else ``("remote", line, exit code)``."""
        me = self._name(self.node_rank)
        for r, peer in list(self.peers.items()):
            while True:
                try:
                    msg = peer.inbox.get_nowait()
                except queue.Empty:
                    break
                event = msg.get("event")
                if event == "failed":
                    line, code = str(msg.get("line", ""))[:2000], msg.get("code")
                    code = code if isinstance(code, int) and 1 <= code <= 255 else 1
                    if self.node_rank == 0:  # relay to the other nodes
                        for r2, p2 in self.peers.items():
                            if r2 != r:
                                p2.send({"event": "failed", "line": line, "code": code})
                    return ("remote", f"{line}; stopped the workers of {me}", code)
                if event == "done":
                    self.done.add(r)
                elif event == "end":
                    self.ended = True
            if r in self.done or self.ended:
                continue
            if peer.closed:
                return ("remote", f"{self._name(r)} was lost: {peer.closed} (killed, crashed or "
                        f"its host went down); stopped the workers of {me}", 1)
            silent = time.monotonic() - peer.last_seen
            if silent > self.node_timeout:
                return ("remote", f"{self._name(r)} stopped responding (no rendezvous heartbeat "
                        f"for {silent:.0f} s, --node-timeout {self.node_timeout:g}: crashed, "
                        f"frozen or unreachable); stopped the workers of {me}", 1)
        return None

    def report(self, ok: bool, line: str | None, code: int) -> None:
        """Tell the other nodes how this node's workers ended."""
        if ok:
            if self.node_rank == 0:
                self.done.add(0)
            else:
                self.peers[0].send({"event": "done"})
            return
        text = f"{self._name(self.node_rank)}: {line}"
        for peer in self.peers.values():
            peer.send({"event": "failed", "line": text, "code": code})

    def finish(self, deadline, received):
        """After this node's workers succeeded: wait for the job's end. Returns None (every
        node succeeded) or ``("remote", line, code)``."""
        while True:
            if received:
                return ("signal", received[0])
            if self.node_rank == 0 and self.done >= set(range(len(self.hosts))):
                for peer in self.peers.values():
                    peer.send({"event": "end"})
                end = time.monotonic() + 2.0  # let them read it before this side closes
                while time.monotonic() < end and not all(p.closed for p in self.peers.values()):
                    time.sleep(0.02)
                return None
            remote = self.watch()
            if remote is not None:
                return remote
            if self.node_rank != 0 and self.ended:
                return None
            if deadline is not None and time.monotonic() >= deadline:
                return ("timeout",)
            time.sleep(0.05)

    def close(self) -> None:
        """Stop pinging; end every connection after what was sent has been read."""
        self._stop.set()
        for peer in self.peers.values():
            try:
                peer.sock.shutdown(socket.SHUT_WR)  # FIN after the last message
            except OSError:
                pass
        end = time.monotonic() + 0.3
        while time.monotonic() < end and not all(p.closed for p in self.peers.values()):
            time.sleep(0.02)
        for peer in self.peers.values():
            peer.close()

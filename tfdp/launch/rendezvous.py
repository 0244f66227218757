"""A small TCP rendezvous for ``tfdp launch`` across nodes (torchrun's static rendezvous, and
its elastic one): the protocol and the joining side; node 0's side is
:mod:`tfdp.launch.coordinator`.

Node 0 listens at the coordinator address and greets every connection with a fresh challenge;
every other node connects (retrying until its join timeout: node 0 may start later) and sends
one JSON line: its node rank, the job's shape (``nnodes``, ``workers_per_node``), the address its
workers advertise (its host and one free port per worker) and a challenge of its own. With a
rendezvous token (:mod:`tfdp.launch.token`) the join carries an HMAC of node 0's challenge, and
node 0's answer one of the node's: only nodes holding the token join, and they only take a
cluster from a node 0 that holds it. When every node has joined, node 0 answers each with the
full list of worker addresses, in rank order (node r's workers are ranks ``r*K .. r*K+K-1``).
Shapes that disagree, a node rank twice or out of range, a token on some nodes only, are
one-line errors on both sides.

The connections then stay open as the job's liveness channel (:mod:`tfdp.launch.liveness`).

The channel carries no code and no credentials: JSON lines of at most 64 KiB, checked field by
field; a connection that sends anything else, too much, nothing within 10 s, or a join without
the token's proof, is dropped with one line while the job goes on (a port scanner, a stray or
slow client cannot end or stall it), and at most 64 connections wait to say who they are at a
time. Without a token the rendezvous is open to any process that reaches the port (node 0 says
so); TensorFlow's gRPC server between the workers is unauthenticated either way: keep the nodes
on a private network. Importing this module never imports TensorFlow.
"""

from __future__ import annotations

import json
import queue
import socket
import threading
import time

from tfdp import errors
from tfdp.errors import TfdpError, UsageError
from tfdp.launch import token as tokens

PROTOCOL = "tfdp-launch-rendezvous"
VERSION = 2          # 2: node 0 greets with a challenge; joins and answers may carry proofs
MAX_LINE = 1 << 16
PING_S = 1.0
_HELLO_S = 10.0      # a new connection must say who it is within this long
_RETRY_S = 0.5       # between connection attempts to the coordinator
_IO_TIMEOUT_S = 2.0  # socket timeout: reads wake up, sends to a cut link give up
MAX_PENDING = 64     # connections waiting to say who they are; more are dropped at once
LAST_CALL_S = 5.0    # elastic: once the minimum has joined, how long more may still join
_TOKEN_FIX = (f"Give every node the same rendezvous token: --rdzv-token or {tokens.ENV} "
              f"(make one per job: {tokens.MAKE_ONE}).")


class JoinTimeout(TfdpError):
    """A node did not show up (or the coordinator could not be reached) in time."""


class RendezvousError(TfdpError):
    """The rendezvous failed (a peer closed the connection or sent an error)."""


class Peer:
    """One rendezvous connection: JSON lines both ways, a reader thread, when it was last heard.

    Only the reader thread closes the socket, when it ends; :meth:`close` from any other thread
    shuts the connection down (the reader then reads its end and closes). Sends, shutdowns and
    that close hold one lock. A socket closed under another thread's ``recv``, ``send`` or
    ``shutdown`` frees its file descriptor while that call is on its way, and the next
    connection gets the same number: the call then reads, writes or ends that connection (the
    rendezvous lost a waiting peer that way, under load)."""

    def __init__(self, sock: socket.socket, address: str):
        self.sock, self.address = sock, address
        self.inbox: queue.Queue = queue.Queue()
        self.last_seen = time.monotonic()
        self.closed: str | None = None  # why the connection ended, once it has
        self.local_host = sock.getsockname()[0]
        self._lock = threading.Lock()  # send / shutdown / the reader's final close
        self._shut = False
        sock.settimeout(_IO_TIMEOUT_S)
        self._reader = threading.Thread(target=self._read, name=f"tfdp-rdzv-{address}",
                                        daemon=True)
        self._reader.start()

    def send(self, message: dict) -> bool:
        data = (json.dumps(message) + "\n").encode()
        with self._lock:
            if self._shut:
                return False
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False  # a closed or cut connection: the reader / liveness check tells

    def _read(self) -> None:
        try:
            self._read_lines()
        finally:
            with self._lock:
                self._shut = True
                try:
                    self.sock.close()
                except OSError:
                    pass

    def _read_lines(self) -> None:
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
                    return
                self.last_seen = time.monotonic()
                self.inbox.put(message)
            if len(buf) > MAX_LINE:
                self.closed = "it sent a line longer than 64 KiB"
                return

    def shutdown_write(self) -> None:
        """No more sends: the other side reads what was sent, then the end."""
        with self._lock:
            if not self._shut:
                try:
                    self.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

    def close(self) -> None:
        """End the connection (the reader thread closes the socket once it sees the end)."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


#: ``--elastic-policy`` (``tfdp.strategy.micro_batches.POLICIES``, which a test holds equal:
#: the launcher never imports TensorFlow)
ELASTIC_POLICIES = ("batch", "accumulate")


def elastic_policy(msg: dict) -> str:
    """A join's ``--elastic-policy`` ("batch" when it names none)."""
    return msg.get("elastic_policy", "batch")


def _hello(node_rank: int, nnodes: int, workers_per_node: int, host: str, ports: list[int],
           elastic_policy: str = "batch"):
    return {"protocol": PROTOCOL, "version": VERSION, "node_rank": node_rank, "nnodes": nnodes,
            "workers_per_node": workers_per_node, "host": host, "ports": list(ports),
            "challenge": tokens.challenge(), "elastic_policy": elastic_policy}


def _is_nonce(value) -> bool:
    return isinstance(value, str) and 0 < len(value) <= 128 and all(
        c in "0123456789abcdef" for c in value)


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
    if not _is_nonce(msg.get("challenge")):
        return "no valid challenge"
    if elastic_policy(msg) not in ELASTIC_POLICIES:
        return "no valid elastic_policy"
    return None


class _Interrupted(Exception):
    """A signal arrived during the rendezvous."""


class _ClosedEarly(RendezvousError):
    """Node 0 closed a connection before it greeted it."""


def _connect(host, port, deadline, join_timeout, received, bind_host, last) -> socket.socket:
    """A connection to node 0, retried until ``deadline``."""
    while True:
        if received:
            raise _Interrupted()
        if time.monotonic() >= deadline:
            raise JoinTimeout(errors.message(
                f"could not reach the coordinator {format_address(host, port)} within "
                f"{join_timeout:g} s (--join-timeout)", f"last error: {last}",
                "Start node 0 (--node-rank 0) on the coordinator's machine and check this "
                "node can reach it (address, firewall, routing)."))
        try:
            return socket.create_connection((host, port), timeout=_IO_TIMEOUT_S,
                                            source_address=(bind_host, 0) if bind_host else None)
        except socket.gaierror as e:
            raise errors.invalid_argument(
                "--coordinator", format_address(host, port), cls=UsageError,
                what=f"Cannot resolve the coordinator host ({e.strerror})",
                fix="Use node 0's address or host name.") from None
        except OSError as e:
            last = e.strerror or str(e)
            time.sleep(_RETRY_S)


def join(host: str, port: int, hello: dict, join_timeout: float, received, bind_host=None,
         token: str | None = None):
    """Node r's side: connect (retrying), read node 0's greeting, send ``hello`` (its ``host``
    filled in from the connection when None; with ``token``, its proof of node 0's challenge),
    wait for the cluster (with ``token``: checked for node 0's proof of ``hello``'s challenge).
    Returns (reply, peer, own host)."""
    deadline = time.monotonic() + join_timeout
    last = "no attempt"
    where = format_address(host, port)
    while True:  # until node 0 greets this connection (it drops some while it is busy)
        sock = _connect(host, port, deadline, join_timeout, received, bind_host, last)
        peer = Peer(sock, where)
        try:
            greeting = _next(peer, where, deadline, received, "its greeting")
            break
        except _ClosedEarly as e:
            peer.close()
            last = str(e)
            time.sleep(_RETRY_S)
    own = peer.local_host
    hello = dict(hello, host=hello["host"] or own)
    if greeting.get("protocol") != PROTOCOL or not _is_nonce(greeting.get("challenge")):
        peer.close()
        raise RendezvousError(f"{where} is not a tfdp launch coordinator (it sent "
                              f"{str(greeting)[:100]})")
    if greeting.get("version") != VERSION:
        peer.close()
        raise UsageError(errors.message(
            "node 0 speaks another rendezvous version", f"version {greeting.get('version')!r} "
            f"at {where}, this node's {VERSION}", "Install the same tfdp on every node."))
    if greeting.get("token") and token is None:
        peer.close()
        raise UsageError(f"node 0 ({where}) requires a rendezvous token and this node has none. "
                         f"{_TOKEN_FIX}")
    if token is not None and not greeting.get("token"):
        peer.close()
        raise UsageError(f"this node was given a rendezvous token, node 0 ({where}) none. "
                         f"{_TOKEN_FIX}")
    if token is not None:
        hello["proof"] = tokens.proof(token, "join", greeting["challenge"], hello)
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
            fix = reply.get("fix") if isinstance(reply.get("fix"), str) else (
                "Start every node with the same --nnodes and --workers-per-node and its own "
                "--node-rank.")
            raise UsageError(f"{str(reply['error'])[:500]}. {fix[:500]}")
        workers = reply.get("workers")
        if isinstance(workers, list) and all(isinstance(w, str) for w in workers):
            if token is not None and not tokens.verify(token, "cluster", hello["challenge"],
                                                       reply):
                peer.close()
                raise RendezvousError(f"node 0 ({where}) did not prove it holds the rendezvous "
                                      "token: this node does not take its cluster")
            return reply, peer, hello["host"]
        if reply.get("event") == "ping":
            continue
        peer.close()
        raise RendezvousError(f"node 0 ({format_address(host, port)}) sent an unexpected "
                              f"reply: {str(reply)[:200]}")


def _next(peer: Peer, where: str, deadline: float, received, what: str) -> dict:
    """The next message from ``peer`` (before ``deadline``)."""
    while True:
        if received:
            peer.close()
            raise _Interrupted()
        try:
            return peer.inbox.get(timeout=0.1)
        except queue.Empty:
            if peer.closed:
                raise _ClosedEarly(f"node 0 ({where}) ended the rendezvous before {what}: "
                                   f"{peer.closed}") from None
            if time.monotonic() >= deadline:
                peer.close()
                raise JoinTimeout(errors.message(
                    f"connected to the coordinator {where} but it sent no greeting",
                    "nothing within --join-timeout", "Check that node 0 runs the same tfdp "
                    "launch at that address.")) from None

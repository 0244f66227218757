"""The multi-node rendezvous with a token (tfdp.launch.rendezvous, tfdp.launch.token), in this
process: node 0's Coordinator and the joining nodes in threads, on 127.0.0.1.

Nodes holding the same token form the job, and the token never crosses the wire; strays are
dropped with one line each while the job forms (garbage, an oversized line, a slow-loris client,
a node without the token, a wrong token, a replayed join); a token on some nodes only, or a
node 0 without the token, is one line on the node that finds it.
"""

import socket
import threading
import time

import pytest

from tfdp.errors import UsageError
from tfdp.launch import rendezvous as rdzv
from tfdp.launch.coordinator import Coordinator
from tfdp.launch import token as tokens

pytestmark = [pytest.mark.timeout(60)]

TOKEN = "3f9a" * 16
NNODES, K = 3, 1


def _free_port():
    import portpicker
    return portpicker.pick_unused_port()


class Node0:
    """Node 0's gather in a thread; ``lines`` is what it said."""

    def __init__(self, port, token=TOKEN, join_timeout=20):
        self.lines, self.port = [], port
        self.coord = Coordinator("127.0.0.1", port, self.lines.append, token=token)
        self.result = self.error = None
        hello = rdzv._hello(0, NNODES, K, "127.0.0.1", [port + 1])
        self.thread = threading.Thread(target=self._run, args=(hello, join_timeout), daemon=True)
        self.thread.start()

    def _run(self, hello, join_timeout):
        try:
            joined, peers = self.coord.gather(hello, join_timeout, [])
            self.coord.answer(joined, peers, {"workers": [f"127.0.0.1:{9000 + r}"
                                                          for r in range(NNODES)],
                                              "hosts": {str(r): "127.0.0.1"
                                                        for r in range(NNODES)}})
            self.result = joined
            time.sleep(0.5)  # let the nodes read the answer
            for p in peers.values():
                p.close()
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            self.error = e

    def wait(self, timeout=30):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), self.lines


def _join(port, rank, token=TOKEN, out=None, join_timeout=20):
    hello = rdzv._hello(rank, NNODES, K, None, [20000 + rank])
    try:
        reply, peer, _ = rdzv.join("127.0.0.1", port, hello, join_timeout, [], token=token)
        peer.close()
        result = reply
    except BaseException as e:  # noqa: BLE001
        result = e
    if out is not None:
        out[rank] = result
    return result


def _join_in_thread(port, rank, out, **kw):
    t = threading.Thread(target=_join, args=(port, rank), kwargs=dict(kw, out=out), daemon=True)
    t.start()
    return t


def _connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    greeting = b""
    while not greeting.endswith(b"\n"):
        greeting += s.recv(4096)
    return s, greeting


def test_nodes_with_the_token_form_the_job_and_the_token_never_crosses_the_wire(monkeypatch):
    """Every byte both ways goes through a recording proxy: the token is in none of them."""
    port, proxy_port = _free_port(), _free_port()
    node0 = Node0(port)
    wire = []
    server = socket.create_server(("127.0.0.1", proxy_port))

    def pipe(a, b):
        while True:
            try:
                data = a.recv(65536)
            except OSError:
                break
            if not data:
                break
            wire.append(data)
            try:
                b.sendall(data)
            except OSError:
                break
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def proxy():
        for _ in range(NNODES - 1):
            c, _ = server.accept()
            u = socket.create_connection(("127.0.0.1", port))
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    threading.Thread(target=proxy, daemon=True).start()
    out = {}
    threads = [_join_in_thread(proxy_port, r, out) for r in range(1, NNODES)]
    for t in threads:
        t.join(30)
    node0.wait()
    server.close()
    assert node0.error is None, node0.lines
    assert sorted(node0.result) == [0, 1, 2]
    for r in (1, 2):
        assert not isinstance(out[r], BaseException), out[r]
        assert len(out[r]["workers"]) == NNODES and "proof" in out[r]
    data = b"".join(wire)
    assert b'"challenge"' in data and b'"proof"' in data
    assert TOKEN.encode() not in data and TOKEN[:16].encode() not in data
    assert not [ln for ln in node0.lines if "ignored" in ln], node0.lines


def test_strays_are_dropped_with_one_line_each_while_the_job_forms(monkeypatch):
    """Garbage, a line over 64 KiB, a client that sends a byte a second and never a line, a
    node without the token, one with a wrong token and a replay of a real node's join: each is
    ignored with one line naming it; the real nodes join and the job forms."""
    monkeypatch.setattr(rdzv, "_HELLO_S", 2.0)
    port = _free_port()
    node0 = Node0(port)
    strays = []

    s, _ = _connect(port)                                   # garbage
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    strays.append(s)
    s, _ = _connect(port)                                   # oversized
    try:
        s.sendall(b"x" * (70 << 10))
    except OSError:
        pass
    strays.append(s)
    slow, _ = _connect(port)                                # slow-loris

    def drip():
        for _ in range(6):
            try:
                slow.sendall(b"{")
            except OSError:
                return
            time.sleep(0.5)
    threading.Thread(target=drip, daemon=True).start()
    strays.append(slow)
    # a join without the token, one with a wrong token (the nodes themselves say why)
    no_token = _join(port, 1, token=None, join_timeout=10)
    wrong = _join(port, 1, token="0" * 32, join_timeout=10)
    # a replay: a valid join message with its proof, sent on a new connection (new challenge)
    s, greeting = _connect(port)
    import json
    hello = rdzv._hello(2, NNODES, K, "127.0.0.1", [20002])
    hello["proof"] = tokens.proof(TOKEN, "join", json.loads(greeting)["challenge"], hello)
    s2, _ = _connect(port)
    s2.sendall((json.dumps(hello) + "\n").encode())
    s3, _ = _connect(port)                                  # a valid join without a proof
    s3.sendall((json.dumps({k: v for k, v in hello.items() if k != "proof"}) + "\n").encode())
    s.close()                                               # (the replay's first connection)
    strays += [s2, s3]
    deadline = time.monotonic() + 30  # the slow client is dropped while the job still forms
    while not any("said nothing" in ln for ln in node0.lines):
        assert time.monotonic() < deadline, (node0.error, "\n".join(node0.lines))
        time.sleep(0.1)
    out = {}
    threads = [_join_in_thread(port, r, out) for r in (1, 2)]
    for t in threads:
        t.join(30)
    node0.wait()
    for s in strays:
        s.close()
    assert node0.error is None, (node0.error, node0.lines)
    assert sorted(node0.result) == [0, 1, 2], node0.lines
    assert all(not isinstance(out[r], BaseException) for r in (1, 2)), out
    ignored = [ln for ln in node0.lines if ln.startswith("ignored a connection from 127.0.0.1:")]
    text = "\n".join(node0.lines)
    for why in ("it sent something that is not a tfdp launch message",
                "it sent a line longer than 64 KiB", "it said nothing within 2 s",
                "it has no rendezvous token", "it did not prove it holds the rendezvous token"):
        assert why in text, text
    # garbage, oversized, slow, no proof, wrong token, the replay; the node without the token
    # and the replay's first connection close by themselves (node 0 says so)
    assert len(ignored) == 8, text
    assert text.count("it closed the rendezvous connection") == 2, text
    assert isinstance(no_token, UsageError) and "requires a rendezvous token and this node has " \
        "none" in str(no_token) and tokens.ENV in str(no_token)
    assert isinstance(wrong, UsageError), wrong
    assert "this node's rendezvous token is not node 0's" in str(wrong)


def test_a_token_on_some_nodes_only_is_one_line():
    port = _free_port()
    node0 = Node0(port, token=None, join_timeout=5)
    err = _join(port, 1, token=TOKEN, join_timeout=5)
    assert isinstance(err, UsageError), err
    assert str(err).startswith("this node was given a rendezvous token, node 0 (127.0.0.1:")
    node0.wait()   # (node 0 then waits for its nodes: it times out, nobody joined)
    assert isinstance(node0.error, rdzv.JoinTimeout)


def test_a_node_0_without_the_token_gives_no_cluster(monkeypatch):
    """A joining node checks node 0's proof: a fake node 0 (no token, but claiming one) sends a
    cluster without a valid proof, and the node refuses it."""
    import json
    port = _free_port()
    server = socket.create_server(("127.0.0.1", port))

    def fake():
        c, _ = server.accept()
        c.sendall((json.dumps({"protocol": rdzv.PROTOCOL, "version": rdzv.VERSION,
                               "challenge": "ab" * 16, "token": True}) + "\n").encode())
        buf = b""
        while not buf.endswith(b"\n"):
            buf += c.recv(65536)
        c.sendall((json.dumps({"workers": ["10.6.6.6:1", "10.6.6.6:2", "10.6.6.6:3"],
                               "proof": "00" * 32}) + "\n").encode())
        time.sleep(1)
        c.close()
    threading.Thread(target=fake, daemon=True).start()
    err = _join(port, 1, join_timeout=10)
    server.close()
    assert isinstance(err, rdzv.RendezvousError), err
    assert "did not prove it holds the rendezvous token" in str(err)


@pytest.mark.parametrize("value, shown", [("short", "5 characters"),
                                          ("a" * 10 + " " + "b" * 10, "21 characters")])
def test_a_bad_token_is_a_one_line_error(value, shown):
    with pytest.raises(UsageError) as e:
        tokens.resolve(value, {}, cli=True)
    text = str(e.value)
    assert "\n" not in text and "--rdzv-token" in text and shown in text
    assert "at least 16 characters" in text and "openssl rand -hex 32" in text
    with pytest.raises(UsageError) as e:
        tokens.resolve(None, {tokens.ENV: value})
    assert tokens.ENV in str(e.value)
    assert tokens.resolve(None, {}) is None
    assert tokens.resolve(None, {tokens.ENV: TOKEN}) == TOKEN
    assert tokens.resolve(TOKEN[::-1], {tokens.ENV: TOKEN}) == TOKEN[::-1]  # the argument wins

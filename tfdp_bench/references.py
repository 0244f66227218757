"""Reference rows of the all-reduce benchmarks (``tfdp bench allreduce --workers``, ``tfdp bench
scaling``): a loopback TCP stream's bandwidth, and the memory (``np.add``) and TCP timings per
size.

No TensorFlow.
"""

from __future__ import annotations

import socket
import threading
import time

from tfdp.errors import TfdpError
from tfdp_bench import _common

TARGET_SAMPLE_S = 0.02  # aim of one timed sample of a reference (as the jobs' samples)


def loopback_tcp_bandwidth(total_bytes: int = 512 << 20, chunk: int = 4 << 20) -> float:
    """Bytes/s of one TCP stream over 127.0.0.1 (a sender thread, a receiver thread)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    received = [0]

    def receive():
        conn, _ = server.accept()
        buf = bytearray(chunk)
        view = memoryview(buf)
        with conn:
            while received[0] < total_bytes:
                n = conn.recv_into(view)
                if not n:
                    break
                received[0] += n

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    payload = b"\0" * chunk
    with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
        t0 = time.perf_counter()
        sent = 0
        while sent < total_bytes:
            c.sendall(payload)
            sent += chunk
        t.join(timeout=60)
        seconds = time.perf_counter() - t0
    server.close()
    return received[0] / seconds


class TcpReference:
    """One Python TCP stream over 127.0.0.1: ``transfer(n)`` sends n bytes and waits for the
    receiver's one-byte acknowledgement (so small sizes include a round trip, like a
    collective's latency)."""

    CHUNK = 4 << 20

    def __init__(self, timeout: float = 60.0):
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(1)
        self._server.settimeout(timeout)
        port = self._server.getsockname()[1]
        self._sender = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._receiver, _ = self._server.accept()
        self._receiver.settimeout(timeout)
        self._payload = memoryview(b"\0" * self.CHUNK)
        self._buf = memoryview(bytearray(self.CHUNK))
        self._todo: list[int] = []
        self._cv = threading.Condition()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self):
        try:
            while True:
                with self._cv:
                    while not self._todo:
                        self._cv.wait()
                    n = self._todo.pop(0)
                if n < 0:
                    return
                got = 0
                while got < n:
                    k = self._receiver.recv_into(self._buf, min(self.CHUNK, n - got))
                    if not k:
                        raise ConnectionError("loopback TCP reference: connection closed")
                    got += k
                self._receiver.sendall(b"k")
        except BaseException as e:  # reported by transfer()
            self._error.append(e)

    def transfer(self, nbytes: int) -> None:
        with self._cv:
            self._todo.append(nbytes)
            self._cv.notify()
        sent = 0
        while sent < nbytes:
            k = min(self.CHUNK, nbytes - sent)
            self._sender.sendall(self._payload[:k])
            sent += k
        if not self._sender.recv(1):
            raise TfdpError(f"The loopback TCP reference failed: {self._error[:1]}")

    def close(self):
        with self._cv:
            self._todo.append(-1)
            self._cv.notify()
        self._thread.join(5)
        for s in (self._sender, self._receiver, self._server):
            s.close()


def measure_references(sizes, repeats) -> dict:
    """{"memory": [[seconds...] per size], "tcp": [...], "memory_iters", "tcp_iters"}."""
    out = {"memory": [], "tcp": [], "memory_iters": [], "tcp_iters": []}
    for n in sizes:
        ref = _common.MemoryReference(n)
        samples, iters = _common.time_samples(ref.step, repeats, TARGET_SAMPLE_S, 50)
        out["memory"].append(samples)
        out["memory_iters"].append(iters)
        del ref
    tcp = TcpReference()
    try:
        for n in sizes:
            samples, iters = _common.time_samples(lambda n=n: tcp.transfer(n), repeats,
                                                  TARGET_SAMPLE_S, 50)
            out["tcp"].append(samples)
            out["tcp_iters"].append(iters)
    finally:
        tcp.close()
    return out

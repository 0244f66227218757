"""The liveness channel of a multi-node ``tfdp launch`` job, after the rendezvous
(:mod:`tfdp.launch.rendezvous`): the rendezvous connections stay open, every node pings every
second, reports how its workers ended (``done`` / ``failed`` with the line and exit code), and
node 0 relays a failure to the others and ends the job (``end``) once every node is done. A node
whose connection closes, or that sends nothing for ``node_timeout`` seconds (killed, frozen, the
link cut), is lost, and the others stop their workers at once.

Importing this module never imports TensorFlow.
"""

from __future__ import annotations

import queue
import threading
import time

from tfdp.launch.rendezvous import PING_S


class Liveness:
    """After the rendezvous: ping, watch the other nodes, report and relay how nodes end."""

    def __init__(self, node_rank: int, peers: dict, hosts: dict, node_timeout: float):
        self.node_rank, self.peers, self.hosts = node_rank, peers, hosts
        self.node_timeout = node_timeout
        self.done: set[int] = set()
        self.lost: set[int] = set()  # nodes whose connection closed or went silent
        self.failed: set[int] = set()  # nodes that reported their workers failed (not lost)
        self.reform: str | None = None  # node 0 forms the job again (why), a restart point
        self.reform_counts = True       # ... as a restart (a node asking to join does not)
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
                    self.failed.add(r)
                    line, code = str(msg.get("line", ""))[:2000], msg.get("code")
                    code = code if isinstance(code, int) and 1 <= code <= 255 else 1
                    if self.node_rank == 0:  # relay to the other nodes
                        for r2, p2 in self.peers.items():
                            if r2 != r:
                                p2.send({"event": "failed", "line": line, "code": code})
                    return ("remote", f"{line}; stopped the workers of {me}", code)
                if event == "reform":  # (from node 0)
                    self.reform = str(msg.get("line", "node 0 forms the job again"))[:2000]
                    self.reform_counts = msg.get("counts") is not False
                    return ("remote", f"{self.reform}; stopped the workers of {me}", 1)
                if event == "done":
                    self.done.add(r)
                elif event == "end":
                    self.ended = True
            if r in self.done or self.ended:
                continue
            if peer.closed:
                self.lost.add(r)
                return ("remote", f"{self._name(r)} was lost: {peer.closed} (killed, crashed or "
                        f"its host went down); stopped the workers of {me}", 1)
            silent = time.monotonic() - peer.last_seen
            if silent > self.node_timeout:
                self.lost.add(r)
                return ("remote", f"{self._name(r)} stopped responding (no rendezvous heartbeat "
                        f"for {silent:.0f} s, --node-timeout {self.node_timeout:g}: crashed, "
                        f"frozen or unreachable); stopped the workers of {me}", 1)
        return None

    def settle(self, seconds: float) -> None:
        """Node 0, deciding after a failed round: record every node whose connection has
        closed without a word (lost; a node whose workers failed says so first), waiting up to
        ``seconds`` for one (a killed node's workers can fail the local ones before its
        launcher's connection is read as closed)."""
        end = time.monotonic() + seconds
        while True:
            for r, peer in self.peers.items():
                while True:  # (a node that failed says so, then closes the round's connection)
                    try:
                        msg = peer.inbox.get_nowait()
                    except queue.Empty:
                        break
                    if msg.get("event") == "failed":
                        self.failed.add(r)
                if peer.closed and r not in self.done and r not in self.failed:
                    self.lost.add(r)
            if self.lost or time.monotonic() >= end:
                return
            time.sleep(0.05)

    def send_reform(self, line: str, counts: bool) -> None:
        """Node 0: every node stops its workers and joins the job's next round (``counts``: as
        a restart)."""
        self.reform, self.reform_counts = line, counts
        for peer in self.peers.values():
            peer.send({"event": "reform", "line": line, "counts": counts})

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
            if self.node_rank == 0 and self.done >= set(self.hosts):
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
            peer.shutdown_write()  # FIN after the last message
        end = time.monotonic() + 0.3
        while time.monotonic() < end and not all(p.closed for p in self.peers.values()):
            time.sleep(0.02)
        for peer in self.peers.values():
            peer.close()

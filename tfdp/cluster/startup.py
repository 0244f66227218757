"""Start-up of a multi-worker job: wait for every peer, but never forever, and stay interruptible.

TensorFlow's collective runtime starts when the multi-worker strategy is created: this task's
gRPC server comes up, every task registers with the coordination service (task 0 leads it) and
the tasks exchange their devices. A worker named in the cluster that never starts (a stale
``TF_CONFIG`` left in a shell, a host that is down, a firewall) makes TensorFlow wait for it
forever ("Waiting for 1/2 tasks to connect") inside one C++ call that holds Python's GIL (no
Python code runs, in any thread, until it returns), and TensorFlow installs its own SIGTERM
handler there (its preemption notifier, which only logs "SIGTERM caught"): ``timeout``, Ctrl-C
and SIGTERM did nothing.

So tfdp does the waiting itself, before TensorFlow's start-up (:func:`wait_for_peers`):

* every worker listens on its own port from the cluster (the one TF's server takes next) and
  connects to every peer's, until each pair has exchanged one line naming the job (a digest of
  the cluster) and the rank: then all of them are up, and each closes its listener and starts
  TensorFlow, whose own wait is then short. A worker closes its listener only after every peer
  has connected to it, so no peer ever finds the port closed in between.
* after ``startup_timeout`` seconds (``startup_timeout=`` / ``TFDP_STARTUP_TIMEOUT``, default
  300) it prints one line naming the workers that did not connect, their addresses and what to
  check (the cluster source such as ``TF_CONFIG``, the other hosts, the firewall), and exits 1
  (``SystemExit``); after ``NOTICE_AFTER_S`` seconds one warning says who it is waiting for.
* SIGINT ends the wait at once (one line, exit 130); SIGTERM keeps its usual effect (the process
  ends), or the program's own handler.

TensorFlow's start-up that follows (:func:`guard`) is bounded too: a small watchdog process
prints the line and kills this process if it has not finished when the start-up time is up (a
peer that died after the rendezvous); Ctrl-C ends it at once (SIGINT's default action meanwhile);
and when it is done, the program's SIGTERM handler (Python's default unless the program set its
own) replaces the one TensorFlow installed, so SIGTERM ends a training process again
(``tfdp.callbacks.PreemptionCheckpoint`` installs its own handler when training starts, as
before). Nothing here imports TensorFlow.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

log = logging.getLogger("tfdp")

STARTUP_TIMEOUT_ENV = "TFDP_STARTUP_TIMEOUT"
DEFAULT_STARTUP_TIMEOUT = 300.0
NOTICE_AFTER_S = 10.0      # one "waiting for ..." warning after this long
EXIT_TIMEOUT = 1
_POLL_S = 0.2              # between connection attempts to a peer that is not up yet
_IO_S = 2.0                # one connection's exchange
_CONNECT_S = 1.0           # one connection attempt
_MIN_TF_S = 30.0           # TF's own start-up gets at least this long after the rendezvous
_BANNER = "TFDP-STARTUP 1"

_SOURCES = {"tf_config": "TF_CONFIG", "slurm": "the SLURM job (srun's variables)",
            "explicit": "the cluster_resolver"}


def split_host_port(address: str) -> tuple[str, int]:
    """``"host:port"`` / ``"[::1]:port"`` -> ``(host, port)`` (host without brackets)."""
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def job_digest(cluster) -> str:
    """A short digest of the cluster: workers of one job agree on it, another job's do not."""
    spec = json.dumps(getattr(cluster, "cluster_spec", None) or list(cluster.workers),
                      sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:16]


def _names(cluster, ranks) -> str:
    return ", ".join(f"worker {r} ({cluster.workers[r]})" for r in ranks)


def _source(cluster) -> str:
    return _SOURCES.get(getattr(cluster, "source", ""), "the cluster definition")


def _me(cluster) -> str:
    return f"worker {cluster.rank} ({cluster.address}) of {cluster.num_workers}"


def _check(cluster) -> str:
    return (f"Check that {_source(cluster)} lists the workers you meant (a TF_CONFIG left over "
            "in the shell makes any script wait for them), that every listed worker was started "
            "on its host, and that no firewall blocks the workers' ports; or raise the timeout, "
            f"e.g. {STARTUP_TIMEOUT_ENV}=600.")


def missing_line(cluster, timeout: float, state: dict) -> str:
    """The one line for a start-up that timed out (without the ``tfdp: peer failure:`` mark).

    ``state[r]`` says what worker ``r`` did: ``"silent"`` (nothing answered on its port),
    ``"foreign"`` (something answered that is not a worker of this job), ``"one-way"`` (it
    answered, but never connected to this worker), or ``"done"``.
    """
    parts = []
    groups = {k: [r for r, s in sorted(state.items()) if s == k]
              for k in ("silent", "foreign", "one-way")}
    if groups["silent"]:
        parts.append(f"{_names(cluster, groups['silent'])} did not start or cannot be reached "
                     "(nothing answers on its port)")
    if groups["foreign"]:
        parts.append(f"{_names(cluster, groups['foreign'])} answered but not as a worker of this "
                     "job (another program on that port, or a worker started with another "
                     "cluster)")
    if groups["one-way"]:
        parts.append(f"{_names(cluster, groups['one-way'])} is up but could not connect to "
                     "this worker (a firewall, or this worker's address is wrong for it)")
    who = "; ".join(parts) or "the other workers did not all connect"
    return (f"{who}: gave up after {timeout:g} s (startup_timeout / {STARTUP_TIMEOUT_ENV}; this "
            f"is {_me(cluster)}). {_check(cluster)}")


class Deadline:
    """The start-up's time limit, shared by the rendezvous and TF's own start-up."""

    def __init__(self, timeout: float, clock=time.monotonic):
        self.timeout = float(timeout)
        self.clock = clock
        self.start = clock()

    def elapsed(self) -> float:
        return self.clock() - self.start

    def left(self) -> float:
        return self.timeout - self.elapsed()


def _listener(address: str) -> socket.socket:
    """A listening socket on every interface at ``address``'s port (as TF's server will bind)."""
    _, port = split_host_port(address)
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", port), family=socket.AF_INET6, reuse_port=False,
                                        dualstack_ipv6=True, backlog=128)
        except OSError:
            pass
    return socket.create_server(("", port), family=socket.AF_INET, backlog=128)


def _read_line(sock: socket.socket, limit: int = 256) -> str:
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = sock.recv(limit - len(data))
        if not chunk:
            break
        data += chunk
    return data.decode("ascii", "replace").strip()


class _Rendezvous:
    """One worker's side: a listener thread answering peers, and connections to every peer."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.digest = job_digest(cluster)
        self.peers = [r for r in range(len(cluster.workers)) if r != cluster.rank]
        self.came_in: set[int] = set()     # peers that connected to this worker
        self.went_out: set[int] = set()    # peers this worker connected to
        self.state = {r: "silent" for r in self.peers}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.sock = None
        self.thread = None

    def banner(self) -> bytes:
        return f"{_BANNER} {self.digest} {self.cluster.rank}\n".encode("ascii")

    def _parse(self, line: str):
        parts = line.split()
        if len(parts) == 4 and " ".join(parts[:2]) == _BANNER and parts[2] == self.digest:
            try:
                return int(parts[3])
            except ValueError:
                return None
        return None

    def open(self):
        self.sock = _listener(self.cluster.address)
        self.sock.settimeout(_POLL_S)
        self.thread = threading.Thread(target=self._serve, name="tfdp-startup-listener",
                                       daemon=True)
        self.thread.start()

    def close(self):
        self.stop.set()
        if self.thread is not None:
            self.thread.join(_IO_S + 1)
        if self.sock is not None:
            self.sock.close()

    def _serve(self):
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (socket.timeout, BlockingIOError):
                continue
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(_IO_S)
                    conn.sendall(self.banner())
                    rank = self._parse(_read_line(conn))
                    if rank in self.peers:
                        with self.lock:
                            self.came_in.add(rank)
                    _read_line(conn)   # until the peer closes first (no TIME_WAIT on this port)
                except OSError:
                    continue

    def try_peer(self, r: int) -> None:
        host, port = split_host_port(self.cluster.workers[r])
        try:
            with socket.create_connection((host, port), timeout=_CONNECT_S) as conn:
                conn.settimeout(_IO_S)
                rank = self._parse(_read_line(conn))
                if rank != r:
                    self.state[r] = "foreign"
                    return
                conn.sendall(self.banner())
            self.went_out.add(r)
        except (OSError, ValueError):
            if self.state[r] != "foreign":
                self.state[r] = "silent"

    def done(self) -> bool:
        with self.lock:
            came_in = set(self.came_in)
        for r in self.peers:
            if r in self.went_out:
                self.state[r] = "done" if r in came_in else "one-way"
        return all(self.state[r] == "done" for r in self.peers)

    def waiting_for(self) -> list[int]:
        return [r for r in self.peers if self.state[r] != "done"]


def wait_for_peers(cluster, deadline: Deadline, *, notice_after: float = NOTICE_AFTER_S,
                   stderr=None) -> None:
    """Return once every worker of ``cluster`` is up and has met this one; before TF starts.

    Raises:
      SystemExit(1): not every worker connected within the deadline (one line on stderr).
      SystemExit(130): SIGINT (Ctrl-C) while waiting (one line on stderr).
      tfdp.errors.TfdpError: this worker's port cannot be bound.
    """
    from tfdp.errors import TfdpError, message
    from tfdp.failures import PEER_FAILURE_MARK
    rv = _Rendezvous(cluster)
    try:
        rv.open()
    except OSError as e:
        _, port = split_host_port(cluster.address)
        raise TfdpError(message(f"Cannot listen on this worker's port {port} ({e.strerror})",
                                f"{_me(cluster)}", "Stop the process holding it (e.g. a worker "
                                "left from an earlier run) or give this worker another port."
                                )) from None
    noticed = False
    try:
        while True:
            for r in rv.peers:
                if r not in rv.went_out:
                    rv.try_peer(r)
            if rv.done():
                return
            if not noticed and deadline.elapsed() >= notice_after:
                noticed = True
                log.warning("tfdp: %s has waited %.0f s for %s to connect (the workers %s lists);"
                            " giving up after %g s (startup_timeout / %s)", _me(cluster),
                            deadline.elapsed(), _names(cluster, rv.waiting_for()),
                            _source(cluster), deadline.timeout, STARTUP_TIMEOUT_ENV)
            if deadline.left() <= 0:
                _say(PEER_FAILURE_MARK + missing_line(cluster, deadline.timeout, rv.state),
                     stderr)
                raise SystemExit(EXIT_TIMEOUT)
            time.sleep(_POLL_S)
    except KeyboardInterrupt:
        _say(f"tfdp: interrupted (SIGINT) while {_me(cluster)} was waiting for "
             f"{_names(cluster, rv.waiting_for())} to connect", stderr)
        raise SystemExit(128 + signal.SIGINT) from None
    finally:
        rv.close()


def _say(line: str, stderr=None) -> None:
    stream = sys.stderr if stderr is None else stderr
    try:
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        pass
    stream.write(line + "\n")
    stream.flush()


# --- TF's own start-up: a watchdog process, Ctrl-C, and the SIGTERM handler afterwards -------

_WATCHDOG = r"""
import os, select, signal, socket, sys
pid, seconds, line = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
ready, _, _ = select.select([sys.stdin], [], [], seconds)
if ready:
    sys.exit(0)          # the parent is done (or gone): its end of the pipe closed
sys.stderr.write(line + "\n")
sys.stderr.flush()
try:
    os.kill(pid, signal.SIGKILL)
except OSError:
    pass
"""


def _watchdog(cluster, seconds: float):
    from tfdp.failures import PEER_FAILURE_MARK
    peers = [r for r in range(cluster.num_workers) if r != cluster.rank]
    line = (f"{PEER_FAILURE_MARK}TensorFlow's start-up did not finish within {seconds:.0f} s "
            f"(startup_timeout / {STARTUP_TIMEOUT_ENV}) although every worker had connected: "
            f"{_names(cluster, peers)} may have stopped since (this is {_me(cluster)}); "
            f"killing this worker. {_check(cluster)}")
    if not sys.executable:   # (an embedded interpreter: no watchdog, the start-up unbounded)
        return None
    try:
        return subprocess.Popen([sys.executable, "-I", "-c", _WATCHDOG, str(os.getpid()),
                                 f"{seconds:.3f}", line], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, close_fds=True)
    except OSError as e:   # no watchdog: the start-up just is not bounded
        log.debug("tfdp: no start-up watchdog (%s)", e)
        return None


@contextlib.contextmanager
def guard(cluster, deadline: Deadline):
    """Around TensorFlow's start-up (after :func:`wait_for_peers`): a watchdog process ends it
    if it outlives the deadline (at least ``_MIN_TF_S``); SIGINT kills at once meanwhile; the
    program's SIGINT / SIGTERM handlers are put back afterwards (replacing TF's SIGTERM one)."""
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    watchdog = _watchdog(cluster, max(_MIN_TF_S, deadline.left()))
    if main and previous[signal.SIGINT] is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)   # Python's handler cannot run meanwhile
    try:
        yield
    finally:
        if watchdog is not None:
            with contextlib.suppress(OSError):
                watchdog.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                watchdog.wait(_IO_S)
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


__all__ = ["DEFAULT_STARTUP_TIMEOUT", "Deadline", "STARTUP_TIMEOUT_ENV", "guard", "job_digest",
           "missing_line", "wait_for_peers"]

"""Start N local worker processes with ``TF_CONFIG`` and supervise them (like ``torchrun``).

Each worker runs the same command in its own session (process group), with:

* ``TF_CONFIG`` describing an N-worker cluster on free loopback ports (not set when N == 1),
* ``TFDP_WORKER_RANK``, ``TFDP_NUM_WORKERS``, ``TFDP_RESTART_COUNT`` and ``PYTHONUNBUFFERED=1``,
* ``TFDP_CPU_REPLICAS`` and a per-worker ``CUDA_VISIBLE_DEVICES`` slice when asked for.

Every output line is prefixed with ``[worker i] ``. If a worker fails, the others are stopped
(SIGTERM to their process groups, SIGKILL after a grace period, at once for a stopped
process) and the job fails, or is restarted as a whole up to ``max_restarts`` times. The failure
is one line naming the worker and its address; when the failed worker reported a lost peer (a
``tfdp: peer failure: ...`` line, see ``tfdp.failures``), that peer is named first.
SIGINT/SIGTERM sent to the launcher are forwarded to all workers. Every wait is bounded, so the
launcher never hangs.

Security: the TensorFlow gRPC server the workers start is unauthenticated and unencrypted:
anyone who can reach a worker's port can run code in it. The launcher therefore only accepts and
advertises loopback addresses (127.0.0.1 by default) in ``TF_CONFIG``, so the workers talk over
loopback only. TensorFlow's server itself listens on every interface of its port (not
configurable), so on a shared or exposed machine keep those ports behind a firewall.

This module must start instantly: it never imports TensorFlow.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from subprocess import DEVNULL, PIPE, Popen
from typing import IO, Mapping, Sequence

from tfdp import errors
from tfdp.errors import UsageError
from tfdp.failures import PEER_FAILURE_MARK

GRACE_S = 3.0        # SIGTERM -> SIGKILL grace period
_KILL_WAIT_S = 5.0   # how long to wait for SIGKILLed processes to be reaped
_JOIN_S = 2.0        # how long to wait for output reader threads after the workers exited
_POLL_S = 0.05
_PREFIX = "tfdp launch"


def make_tf_configs(workers: int, host: str = "127.0.0.1") -> list[dict]:
    """Return one ``TF_CONFIG`` dict per worker for a ``workers``-worker cluster on ``host``.

    Ports are distinct free ports from ``portpicker.pick_unused_port()``; worker ``i`` gets
    ``{"cluster": {"worker": [addr0, ...]}, "task": {"type": "worker", "index": i}}``.
    """
    _check_workers(workers, "workers")
    _check_host(host, "host")
    import portpicker

    ports: list[int] = []
    while len(ports) < workers:
        port = portpicker.pick_unused_port()
        if port not in ports:
            ports.append(port)
    fmt = "[{}]:{}" if ":" in host else "{}:{}"
    addrs = [fmt.format(host, p) for p in ports]
    return [{"cluster": {"worker": list(addrs)}, "task": {"type": "worker", "index": i}}
            for i in range(workers)]


def validate(cmd: Sequence[str], workers, *, cpu_replicas=None, gpus_per_worker=None,
             max_restarts=0, timeout=None, host="127.0.0.1", env: Mapping[str, str] | None = None,
             cli: bool = False) -> None:
    """Raise :class:`~tfdp.errors.UsageError` if the launch arguments are invalid.

    Nothing is started. With ``cli=True`` the messages name the command-line flags.
    """
    def name(n):
        return "--" + n.replace("_", "-") if cli else n

    env = os.environ if env is None else env
    _check_workers(workers, name("workers"))
    if isinstance(cmd, (str, bytes)) or not isinstance(cmd, (list, tuple)) \
            or not all(isinstance(a, (str, os.PathLike)) for a in cmd):
        raise errors.invalid_argument(
            "command", cmd, what="The command must be a list of strings", cls=UsageError,
            fix="Split it into the program and its arguments, e.g. "
                "[sys.executable, 'train.py', '--epochs', '3'] (shlex.split does it for a "
                "string).")
    cmd = [os.fspath(a) for a in cmd]
    if not cmd:
        raise errors.invalid_argument(
            "command", [], what="No command to run", cls=UsageError,
            fix="Put the command after the options, e.g. "
                "'tfdp launch --workers 2 -- python train.py'.")
    _check_int(cpu_replicas, name("cpu_replicas"), 1, optional=True)
    _check_int(gpus_per_worker, name("gpus_per_worker"), 0, optional=True)
    _check_int(max_restarts, name("max_restarts"), 0)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout > 0):
        raise errors.invalid_argument(name("timeout"), timeout, cls=UsageError,
                                      fix="Give a positive number of seconds, or no timeout.")
    _check_host(host, name("host"))
    if gpus_per_worker and "CUDA_VISIBLE_DEVICES" in env:
        visible = _visible_gpus(env)
        if workers * gpus_per_worker > len(visible):
            raise errors.invalid_argument(
                name("gpus_per_worker"), gpus_per_worker, cls=UsageError,
                what=f"More GPUs requested than visible ({workers} workers x {gpus_per_worker} "
                     f"= {workers * gpus_per_worker}, but CUDA_VISIBLE_DEVICES="
                     f"{env['CUDA_VISIBLE_DEVICES']!r} lists {len(visible)})",
                fix="Use fewer workers or GPUs per worker, or widen CUDA_VISIBLE_DEVICES.")
    program = cmd[0]
    if os.sep in program or (os.altsep and os.altsep in program):
        found = os.path.isfile(program) and os.access(program, os.X_OK)
    else:
        found = shutil.which(program, path=env.get("PATH", os.defpath)) is not None
    if not found:
        raise errors.invalid_argument(
            "command", program, what="Program not found or not executable", cls=UsageError,
            fix="Check the spelling and PATH, or give the path to an executable file.")
    script = _python_script(cmd)
    if script is not None and not os.path.exists(script):
        raise errors.invalid_argument(
            "script", script, what="The Python script to run does not exist", cls=UsageError,
            fix=f"Check the path (relative paths are from the current directory, "
                f"{os.getcwd()!r}).")


def launch(cmd: Sequence[str], workers: int, *, cpu_replicas: int | None = None,
           gpus_per_worker: int | None = None, max_restarts: int = 0,
           timeout: float | None = None, env: Mapping[str, str] | None = None,
           stdout: IO[str] | None = None, stderr: IO[str] | None = None,
           host: str = "127.0.0.1") -> int:
    """Run ``cmd`` in ``workers`` local worker processes and return the job's exit code.

    Args:
      cmd: the command and its arguments, e.g. ``[sys.executable, "train.py"]``.
      workers: number of worker processes (>= 1). With 1, ``TF_CONFIG`` is not set.
      cpu_replicas: if given, sets ``TFDP_CPU_REPLICAS`` for the workers.
      gpus_per_worker: if given, worker ``i`` gets GPUs ``i*G .. i*G+G-1`` of the visible list
        (``CUDA_VISIBLE_DEVICES`` of ``env`` if set, else ``0 .. workers*G-1``) as its
        ``CUDA_VISIBLE_DEVICES``; 0 hides all GPUs.
      max_restarts: after a failure, restart all workers (new ports) up to this many times.
      timeout: whole-job wall-clock limit in seconds (across restarts); on expiry returns 124.
      env: the workers' base environment (default: ``os.environ``); the launcher's variables
        are added to it, and an inherited ``TF_CONFIG`` is dropped when ``workers == 1``.
      stdout, stderr: where prefixed worker output goes (default: ``sys.stdout`` /
        ``sys.stderr`` at call time); launcher messages go to ``stderr``.
      host: the loopback address the workers advertise in ``TF_CONFIG`` (only loopback is
        allowed).

    Returns:
      0 if every worker succeeded; the failed worker's exit code if it is 1..125, else 1;
      124 on timeout; 130 / 143 when stopped by SIGINT / SIGTERM.

    Raises:
      tfdp.errors.UsageError: invalid arguments (checked before anything starts).
      tfdp.errors.TfdpError: the command could not be started.
    """
    validate(cmd, workers, cpu_replicas=cpu_replicas, gpus_per_worker=gpus_per_worker,
             max_restarts=max_restarts, timeout=timeout, host=host, env=env)
    job = _Job(list(cmd), workers, cpu_replicas, gpus_per_worker, host,
               dict(os.environ if env is None else env),
               sys.stdout if stdout is None else stdout, sys.stderr if stderr is None else stderr)
    deadline = None if timeout is None else time.monotonic() + timeout
    with _ForwardedSignals() as received:
        for restart in range(max_restarts + 1):
            if restart:
                job.say(f"restarting all workers (restart {restart} of {max_restarts})")
            job.start(restart)
            try:
                outcome = job.wait(deadline, received)
            finally:
                job.stop(received)
            kind = outcome[0]
            if kind == "ok":
                return 0
            if kind == "timeout":
                job.say(f"timed out after {timeout:g} s (--timeout); stopped all workers")
                return 124
            if kind == "signal":
                name = signal.Signals(outcome[1]).name
                job.say(f"received {name}; stopped all workers")
                return 128 + outcome[1]
            _, index, code = outcome
            how = (f"failed with exit code {code}" if code >= 0
                   else f"was killed by signal {_signame(-code)}")
            others = "; stopped the other workers" if workers > 1 else ""
            cause = job.peer_reports[index]  # the peer it lost, when it says so
            job.say(f"{cause}; reported by {job.describe(index)}, which {how}{others}" if cause
                    else f"{job.describe(index)} {how}{others}")
            if received or (deadline is not None and time.monotonic() >= deadline):
                break  # no restart once interrupted or out of time
        return code if 1 <= code <= 125 else 1


class _Job:
    """The worker processes of one launch, their output pumps, and how to stop them."""

    def __init__(self, cmd, workers, cpu_replicas, gpus_per_worker, host, env, out, err):
        self.cmd, self.workers, self.host = cmd, workers, host
        self.out, self.err = out, err
        self.lock = threading.Lock()  # one line at a time, across all workers
        self.procs: list[Popen] = []
        self.threads: list[tuple[threading.Thread, IO[bytes]]] = []
        self.addrs: list[str | None] = [None] * workers
        self.peer_reports: list[str | None] = [None] * workers
        base = dict(env, TFDP_NUM_WORKERS=str(workers), PYTHONUNBUFFERED="1")
        if cpu_replicas is not None:
            base["TFDP_CPU_REPLICAS"] = str(cpu_replicas)
        self.envs = [dict(base, TFDP_WORKER_RANK=str(i)) for i in range(workers)]
        if workers == 1:
            self.envs[0].pop("TF_CONFIG", None)
        if gpus_per_worker is not None:
            g = gpus_per_worker
            visible = (_visible_gpus(env) if "CUDA_VISIBLE_DEVICES" in env
                       else [str(i) for i in range(workers * g)])
            for i, e in enumerate(self.envs):
                e["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i * g:(i + 1) * g])

    def start(self, restart: int) -> None:
        """Start all workers (fresh ports for each start)."""
        configs = make_tf_configs(self.workers, self.host) if self.workers > 1 else None
        self.procs, self.threads = [], []
        self.peer_reports = [None] * self.workers
        for i, env in enumerate(self.envs):
            env = dict(env, TFDP_RESTART_COUNT=str(restart))
            if configs:
                env["TF_CONFIG"] = json.dumps(configs[i])
                self.addrs[i] = configs[i]["cluster"]["worker"][i]
            try:
                proc = Popen(self.cmd, env=env, stdin=DEVNULL, stdout=PIPE, stderr=PIPE,
                             start_new_session=True)
            except OSError as e:
                self.stop([])
                raise errors.invalid_argument("command", self.cmd[0],
                                              what="Cannot start the command",
                                              fix=f"{e.strerror or e}.") from None
            self.procs.append(proc)
            for pipe, stream in ((proc.stdout, self.out), (proc.stderr, self.err)):
                t = threading.Thread(target=self._pump, args=(pipe, i, stream),
                                     name=f"tfdp-launch-worker{i}", daemon=True)
                t.start()
                self.threads.append((t, pipe))

    def wait(self, deadline, received) -> tuple:
        """Wait until all succeed ("ok"), one fails ("failed", i, code), time runs out
        ("timeout") or the launcher gets a signal ("signal", signum)."""
        while True:
            if received:
                return ("signal", received[0])
            codes = [p.poll() for p in self.procs]
            for i, code in enumerate(codes):
                if code:
                    return ("failed", i, code)
            if all(c == 0 for c in codes):
                return ("ok",)
            if deadline is not None and time.monotonic() >= deadline:
                return ("timeout",)
            time.sleep(_POLL_S)

    def stop(self, received) -> None:
        """Stop every worker's process group: the received signal (or SIGTERM) first, SIGKILL
        after the grace period or on a second signal; then drain the output pumps."""
        first = len(received)
        self._signal_all(received[0] if received else signal.SIGTERM)
        end = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < end:
            if len(received) > first:  # signalled again: don't wait any longer
                break
            for p in self.procs:  # a stopped (SIGSTOP) worker cannot act on SIGTERM: kill it now
                if p.poll() is None and _is_stopped(p.pid):
                    _killpg(p.pid, signal.SIGKILL)
            time.sleep(_POLL_S)
        self._signal_all(signal.SIGKILL)  # also reaps leftovers in the groups
        end = time.monotonic() + _KILL_WAIT_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < end:
            time.sleep(_POLL_S)
        end = time.monotonic() + _JOIN_S
        for t, pipe in self.threads:
            t.join(max(0.0, end - time.monotonic()))
            if not t.is_alive():  # a pipe still being read (by a daemon thread) stays open
                pipe.close()

    def describe(self, i: int) -> str:
        """``worker i (addr)``, or ``worker i`` without a cluster."""
        return f"worker {i} ({self.addrs[i]})" if self.addrs[i] else f"worker {i}"

    def say(self, text: str) -> None:
        """Print one launcher line to stderr."""
        self._write(self.err, f"{_PREFIX}: {text}\n")

    def _signal_all(self, sig) -> None:
        for p in self.procs:
            _killpg(p.pid, sig)

    def _pump(self, pipe, index: int, stream) -> None:
        """Copy ``pipe`` to ``stream`` line by line with the ``[worker i] `` prefix; keep
        draining on errors; remember the worker's first peer-failure report."""
        prefix = f"[worker {index}] "
        for raw in iter(lambda: pipe.readline(1 << 16), b""):
            line = raw.decode("utf-8", errors="replace")
            if line.startswith(PEER_FAILURE_MARK) and self.peer_reports[index] is None:
                self.peer_reports[index] = line[len(PEER_FAILURE_MARK):].strip()
            self._write(stream, prefix + (line if line.endswith("\n") else line + "\n"))

    def _write(self, stream, text: str) -> None:
        with self.lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                pass  # closed or broken stream: don't let a worker block on a full pipe


class _ForwardedSignals:
    """Context manager: while active, SIGINT/SIGTERM are recorded in a list (instead of their
    usual effect) for the launcher to forward. Only possible in the main thread; elsewhere
    the list just stays empty."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> list[int]:
        self.received: list[int] = []
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        return self.received

    def _handle(self, signum, frame) -> None:
        self.received.append(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


def _check_workers(workers, name) -> None:
    _check_int(workers, name, 1)


def _check_int(value, name, minimum, optional=False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise errors.invalid_argument(name, value, cls=UsageError,
                                      fix=f"Use an integer >= {minimum}.")


def _check_host(host, name) -> None:
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise errors.invalid_argument(
            name, host, what="Only loopback hosts are allowed", cls=UsageError,
            fix="Use 127.0.0.1 (the default): the TensorFlow gRPC server the workers start "
                "is unauthenticated, so it must not be reachable from other machines.")


_PYTHON = re.compile(r"python(\d+(\.\d+)*)?(\.exe)?$")
_PYTHON_OPTS_WITH_VALUE = ("-W", "-X")


def _python_script(cmd: Sequence[str]) -> str | None:
    """The script a ``python [options] SCRIPT ...`` command runs, or None (not a Python
    interpreter, or ``-c`` / ``-m`` / ``-`` / ``--help``-like: no script file)."""
    if not _PYTHON.match(os.path.basename(cmd[0])):
        return None
    args = iter(cmd[1:])
    for arg in args:
        if arg == "-" or arg.startswith(("-c", "-m", "--")):
            return None  # -c CODE, -m MODULE, stdin, --help / --version
        if arg in _PYTHON_OPTS_WITH_VALUE:
            next(args, None)
            continue
        if arg.startswith("-"):
            if arg[1:2] in ("W", "X"):  # -Wdefault, -Xdev: the value is attached
                continue
            if any(c in "cm" for c in arg[1:]):  # e.g. -uc CODE: a combined -c / -m
                return None
            continue
        return arg
    return None


def _visible_gpus(env: Mapping[str, str]) -> list[str]:
    return [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]


def _killpg(pgid: int, sig) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP / SIGTSTP; Linux /proc, else False)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"{num}"

"""The running job of ``tfdp launch`` (:mod:`tfdp.launch.launcher`): N worker processes, each
in its own session, their prefixed output, the stop sequence (SIGTERM to every process group,
SIGKILL after a grace period, at once for a stopped process), signals forwarded from the
launcher, and the supervision loop that restarts the job or says which worker failed and why.

Used by the one-node launcher and by the multi-node rendezvous (:mod:`tfdp.launch.multinode`).
This module never imports TensorFlow.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
from subprocess import DEVNULL, PIPE, Popen
from typing import IO, Callable, Mapping

from tfdp import errors
from tfdp.launch import output as output_lib
from tfdp.logs import LEVEL_ENV, quiet_tensorflow

GRACE_S = 3.0        # SIGTERM -> SIGKILL grace period
_KILL_WAIT_S = 5.0   # how long to wait for SIGKILLed processes to be reaped
_JOIN_S = 10.0       # how long to wait for output reader threads after the workers exited
# (they end at once at EOF; on a loaded host 2 s was measured too short to drain them)
_POLL_S = 0.05
# A worker that printed its peer-failure line is done: it may still take seconds to exit (TF's
# error unwinding, garbage collection; measured up to 19 s after a SIGSTOPped peer). Wait this
# long for its own exit code, then stop the job.
_PEER_EXIT_S = 0.5
_PREFIX = "tfdp launch"


def _supervise(job: "_Job", max_restarts: int, timeout, deadline, received,
               configs: Callable[[int], list | None], watch=None, on_end=None,
               attempt: int = 0) -> int:
    """Start, wait, stop and restart ``job``; print the outcome; return the exit code.

    ``watch()`` (multi-node) returns an outcome of the other nodes or None, ``on_end(outcome,
    code, line)`` is told how this node's workers ended; ``attempt``: the first start's restart
    count (a multi-node job's restarts are rounds of its own: :mod:`tfdp.launch.multinode`)."""
    code = 1
    for restart in range(attempt, attempt + max_restarts + 1):
        if restart > attempt:
            job.say(f"restarting all workers (restart {restart} of {max_restarts})")
        job.start(restart, configs(restart))
        try:
            outcome = job.wait(deadline, received, watch)
        finally:
            job.stop(received)
        kind = outcome[0]
        if kind == "ok":
            job.summary_ok()
            if on_end:
                on_end(outcome, 0, None)
            return 0
        if kind == "timeout":
            line = f"timed out after {timeout:g} s (--timeout); stopped all workers"
            job.say(line)
            if on_end:
                on_end(outcome, 124, line)
            return 124
        if kind == "signal":
            name = signal.Signals(outcome[1]).name
            line = f"received {name}; stopped all workers"
            job.say(line)
            if on_end:
                on_end(outcome, 128 + outcome[1], line)
            return 128 + outcome[1]
        if kind == "remote":  # another node failed or was lost
            _, line, code = outcome
            job.say(line)
            job.logs_line()
            return code
        _, index, code = outcome
        if code is None:  # it reported a lost peer and has not exited yet: stopped with the rest
            how, code = "was still exiting", 1
        else:
            how = (f"failed with exit code {code}" if code >= 0
                   else f"was killed by signal {_signame(-code)}")
        others = "; stopped the other workers" if job.num_workers > 1 else ""
        cause = job.logs[index].peer_report  # the peer it lost, when it says so
        line = (f"{cause}; reported by {job.describe(index)}, which {how}{others}" if cause
                else f"{job.describe(index)} {how}{others}")
        job.show_tail(index)
        job.say(line)
        code = code if 1 <= code <= 125 else 1
        if on_end:
            on_end(outcome, code, line)
        if received or (deadline is not None and time.monotonic() >= deadline):
            break  # no restart once interrupted or out of time
    job.logs_line()
    return code


class _Job:
    """The worker processes of one launch (on this node), their output, and how to stop them.

    ``workers`` processes run here with global ranks ``rank_offset .. rank_offset+workers-1`` of
    a ``num_workers``-worker cluster (the same numbers on a single node)."""

    def __init__(self, cmd, workers, cpu_replicas, gpus_per_worker, env, out, err, *,
                 output="all", log_dir=None, verbose=False, rank_offset=0, num_workers=None,
                 extra_env=None):
        self.cmd, self.workers, self.rank_offset = cmd, workers, rank_offset
        self.gpus_per_worker = gpus_per_worker
        self.num_workers = workers if num_workers is None else num_workers
        self.out, self.err, self.output = out, err, output
        self.terminal = output_lib.Terminal()
        self.procs: list[Popen] = []
        self.threads: list[tuple[threading.Thread, IO[bytes]]] = []
        self.addrs: list[str | None] = [None] * workers
        self.start_time = time.monotonic()
        base = dict(env, TFDP_NUM_WORKERS=str(self.num_workers), PYTHONUNBUFFERED="1",
                    **(extra_env or {}))
        if cpu_replicas is not None:
            base["TFDP_CPU_REPLICAS"] = str(cpu_replicas)
        self.user_level = base.get(LEVEL_ENV, "").strip() or None
        self.replicas = _replicas_note(self.num_workers, base.get("TFDP_CPU_REPLICAS"),
                                       gpus_per_worker, env)
        self.level = output_lib.parse_level(quiet_tensorflow(base, verbose=verbose))
        self.envs = [dict(base, TFDP_WORKER_RANK=str(rank_offset + i),
                          TFDP_LOCAL_RANK=str(i)) for i in range(workers)]
        if self.num_workers == 1:
            self.envs[0].pop("TF_CONFIG", None)
        if gpus_per_worker is not None:
            g = gpus_per_worker
            visible = (_visible_gpus(env) if "CUDA_VISIBLE_DEVICES" in env
                       else [str(i) for i in range(workers * g)])
            for i, e in enumerate(self.envs):
                e["CUDA_VISIBLE_DEVICES"] = ",".join(visible[i * g:(i + 1) * g])
        if log_dir is None and output == "worker0":
            log_dir = tempfile.mkdtemp(prefix="tfdp-launch-")
        elif log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        self.log_dir = log_dir
        self.logs = [output_lib.WorkerLog(self.log_path(i)) for i in range(workers)]

    def rank(self, i: int) -> int:
        return self.rank_offset + i

    def reshape(self, rank_offset: int, num_workers: int, extra_env: dict) -> None:
        """A new place in a cluster of another size (an elastic job's new round, between a
        :meth:`stop` and the next :meth:`start`): ranks, sizes and logs follow it."""
        if (rank_offset, num_workers) == (self.rank_offset, self.num_workers) and all(
                e.get(k) == v for e in self.envs for k, v in extra_env.items()):
            return
        self.close()
        self.rank_offset, self.num_workers = rank_offset, num_workers
        for i, e in enumerate(self.envs):
            e.update(extra_env, TFDP_NUM_WORKERS=str(num_workers),
                     TFDP_WORKER_RANK=str(rank_offset + i))
        self.replicas = _replicas_note(num_workers, self.envs[0].get("TFDP_CPU_REPLICAS"),
                                       self.gpus_per_worker, self.envs[0])
        self.logs = [output_lib.WorkerLog(self.log_path(i)) for i in range(self.workers)]

    def log_path(self, i: int) -> str | None:
        return os.path.join(self.log_dir, f"worker-{self.rank(i)}.log") if self.log_dir else None

    def logs_pattern(self) -> str:
        first, last = self.rank(0), self.rank(self.workers - 1)
        if first == last:
            return self.log_path(0)
        return os.path.join(self.log_dir, f"worker-<i>.log (i = {first}..{last})")

    def live(self, i: int) -> bool:
        """Whether worker ``i``'s output is shown live on the terminal (``worker0`` mode)."""
        return self.output == "worker0" and self.rank(i) == 0

    def announce(self) -> None:
        """One line: what is shown, where the logs are, what is hidden."""
        parts = [self.replicas]
        if self.output == "worker0":
            shown = ("worker 0's output follows" if self.rank_offset == 0
                     else "worker 0 runs on node 0: its output is shown there")
            parts.append(f"{shown} (--output all: every worker's)")
        if self.log_dir:
            parts.append(f"logs: {self.logs_pattern()}")
        if self.user_level is None and self.level:
            parts.append(f"TensorFlow's C++ INFO/WARNING logs hidden ({LEVEL_ENV}="
                         f"{self.level}; --verbose shows them)")
        if parts:
            self.say("; ".join(parts))

    def start(self, restart: int, configs: list | None) -> None:
        """Start all workers with these TF_CONFIG dicts (indexed by local worker)."""
        self.procs, self.threads = [], []
        self._peer_seen: dict[int, float] = {}  # worker -> when its peer report was seen
        for i, env in enumerate(self.envs):
            self.logs[i].reset()
            if restart:
                self.logs[i].note(f"\n----- tfdp launch: restart {restart} -----\n")
            env = dict(env, TFDP_RESTART_COUNT=str(restart))
            if configs:
                env["TF_CONFIG"] = json.dumps(configs[i])
                self.addrs[i] = configs[i]["cluster"]["worker"][configs[i]["task"]["index"]]
            try:
                proc = Popen(self.cmd, env=env, stdin=DEVNULL, stdout=PIPE, stderr=PIPE,
                             start_new_session=True)
            except OSError as e:
                self.stop([])
                raise errors.invalid_argument("command", self.cmd[0],
                                              what="Cannot start the command",
                                              fix=f"{e.strerror or e}.") from None
            self.procs.append(proc)
            show = self.output == "all" or self.live(i)
            for pipe, stream in ((proc.stdout, self.out), (proc.stderr, self.err)):
                t = threading.Thread(
                    target=output_lib.pump, name=f"tfdp-launch-worker{self.rank(i)}",
                    args=(pipe, self.logs[i], self.terminal, stream if show else None,
                          f"[worker {self.rank(i)}] ", self.live(i), self.level), daemon=True)
                t.start()
                self.threads.append((t, pipe))

    def wait(self, deadline, received, watch=None) -> tuple:
        """Wait until all succeed ("ok"), one fails ("failed", i, code; code None: it reported
        a lost peer ``_PEER_EXIT_S`` ago and is still running), time runs out
        ("timeout"), the launcher gets a signal ("signal", signum) or ``watch()`` reports
        another node's end ("remote", line, code)."""
        while True:
            if received:
                return ("signal", received[0])
            codes = [p.poll() for p in self.procs]
            for i, code in enumerate(codes):
                if code:
                    return ("failed", i, code)
            if all(c == 0 for c in codes):
                return ("ok",)
            now = time.monotonic()
            for i, code in enumerate(codes):
                if code is None and self.logs[i].peer_report is not None:
                    if now - self._peer_seen.setdefault(i, now) >= _PEER_EXIT_S:
                        return ("failed", i, None)  # reported a lost peer, still exiting
            if deadline is not None and time.monotonic() >= deadline:
                return ("timeout",)
            if watch is not None:
                remote = watch()
                if remote is not None:
                    return remote
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

    def close(self) -> None:
        """Close the log files (after :meth:`stop`)."""
        if any(t.is_alive() for t, _ in self.threads):
            return  # a reader still runs (it holds the file): the process exit closes it
        for log in self.logs:
            log.close()

    def describe(self, i: int) -> str:
        """``worker r (addr)``, or ``worker r`` without a cluster (``i``: local index)."""
        r = self.rank(i)
        return f"worker {r} ({self.addrs[i]})" if self.addrs[i] else f"worker {r}"

    def say(self, text: str) -> None:
        """Print one launcher line to stderr."""
        self.terminal.write(self.err, f"{_PREFIX}: {text}\n")

    def show_tail(self, i: int) -> None:
        """A failed worker's last lines on the terminal, with its log file (``worker0`` mode;
        not for a worker shown live or in ``all`` mode, where every line was shown)."""
        if self.output != "worker0" or self.live(i):
            return
        log = self.logs[i]
        lines = list(log.tail)
        if not lines:
            self.say(f"worker {self.rank(i)} printed nothing (log: {log.path})")
            return
        lines = [ln for ln in lines if not output_lib.hidden_line(ln, self.level)] or lines
        self.say(f"last {len(lines)} line(s) of worker {self.rank(i)} (full log: {log.path}):")
        prefix = f"[worker {self.rank(i)}] "
        self.terminal.write(self.err, "".join(prefix + ln + "\n" for ln in lines))

    def summary_ok(self) -> None:
        if self.output == "worker0" or self.log_dir:
            took = time.monotonic() - self.start_time
            self.say(f"{self.workers} worker{'s' if self.workers > 1 else ''} succeeded in "
                     f"{took:.1f} s" + (f"; logs: {self.logs_pattern()}" if self.log_dir else ""))

    def logs_line(self) -> None:
        if self.log_dir:
            self.say(f"logs: {self.logs_pattern()}")

    def _signal_all(self, sig) -> None:
        for p in self.procs:
            _killpg(p.pid, sig)


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


def _replicas_note(workers: int, cpu_replicas, gpus_per_worker, env) -> str:
    """``2 workers x 2 CPU replicas = 4 replicas``: what the header can tell without TensorFlow
    (each worker's own first line says what it really runs on)."""
    w = f"{workers} worker{'s' if workers > 1 else ''}"
    if gpus_per_worker:
        g = gpus_per_worker
        return f"{w} x {g} GPU{'s' if g > 1 else ''} = {workers * g} replicas"
    try:
        k = int(str(cpu_replicas).strip()) if cpu_replicas is not None else None
    except ValueError:
        k = None
    no_gpus = gpus_per_worker == 0 or env.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1")
    if k is not None and k >= 1:
        return (f"{w} x {k} CPU replica{'s' if k > 1 else ''} = {workers * k} "
                f"replica{'s' if workers * k > 1 else ''}"
                + ("" if no_gpus else " (a worker with GPUs uses its GPUs instead)"))
    return (f"{w} x {'1 CPU replica' if no_gpus else 'its GPUs, else 1 CPU replica'} each "
            "(--cpu-replicas K: K CPU replicas per worker)")


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

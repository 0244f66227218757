"""The fault harness's launches and checks (:mod:`tfdp_bench.faults`): one ``tfdp launch`` of
the trial job, watched and killed by its process group; the final weights compared with the clean
run's; a backup directory read back. No TensorFlow.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from tfdp_bench.fault_job import TOL, WORKER_CODE, WORKER_MARK


# --- the harness: one launch -------------------------------------------------------------------

class Launch:
    """One ``tfdp launch`` of the trial job, its output lines with their arrival times, and the
    cleanup of every process it started."""

    def __init__(self, trial_dir: str, index: int, *, workers: int, cpu_replicas: int,
                 max_restarts: int = 0, timeout: float = 300.0, env: dict | None = None):
        self.trial_dir, self.index, self.workers = trial_dir, index, workers
        self.timeout = timeout
        self.cmd = [sys.executable, "-m", "tfdp", "launch", "--all-output",
                    "--workers", str(workers), "--cpu-replicas", str(cpu_replicas),
                    "--max-restarts", str(max_restarts), "--timeout", f"{timeout:g}",
                    "--", sys.executable, "-c", WORKER_CODE]
        child_env = dict(os.environ, FAULTS_DIR=trial_dir, FAULTS_LAUNCH=str(index),
                         CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
        child_env.pop("TFDP_CPU_REPLICAS", None)
        child_env.pop("FAULTS_SLOW_WRITE", None)
        child_env.update(env or {})
        self.lines: list[tuple[float, str]] = []
        self.log_path = os.path.join(trial_dir, f"launch-{index}.log")
        self.start = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=child_env, cwd=trial_dir,
                                     start_new_session=True)
        self.end = None
        self.left: list[int] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        with open(self.log_path, "w") as log:  # each line with its arrival time (s)
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                now = time.monotonic()
                self.lines.append((now, line))
                log.write(f"{now - self.start:8.3f} | {line}\n")
                log.flush()

    def running(self) -> bool:
        return self.proc.poll() is None

    def pid(self, rank: int, restart: int = 0) -> int | None:
        try:
            with open(os.path.join(self.trial_dir, f"pid-{self.index}-{restart}-{rank}")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def step(self, rank: int, restart: int = 0) -> int:
        """The last step worker ``rank`` reported (0: none yet)."""
        try:
            with open(os.path.join(self.trial_dir,
                                   f"progress-{self.index}-{restart}-{rank}")) as f:
                done = [ln for ln in f.read().split("\n")[:-1] if ln.strip()]
            return int(done[-1].split()[0]) if done else 0
        except (OSError, ValueError):
            return 0

    def wait(self) -> int:
        """Wait for the launcher (hard timeout: its own --timeout plus 30 s); its exit code."""
        limit = self.start + self.timeout + 30.0
        try:
            self.proc.wait(timeout=max(1.0, limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait(timeout=30)
        if self.end is None:
            self.end = time.monotonic()
        self._reader.join(5.0)
        return self.proc.returncode

    def worker_pids(self) -> list[int]:
        pids = []
        for name in os.listdir(self.trial_dir):
            if name.startswith(f"pid-{self.index}-"):
                try:
                    with open(os.path.join(self.trial_dir, name)) as f:
                        pids.append(int(f.read().strip()))
                except (OSError, ValueError):
                    pass
        return pids

    def alive_workers(self) -> list[int]:
        return [p for p in self.worker_pids() if _is_our_worker(p)]

    def kill(self) -> None:
        """SIGKILL the launcher's and every worker's process group (workers checked to be ours
        by their command line, so a reused PID is never touched)."""
        groups = [self.proc.pid] if self.proc.poll() is None else []
        groups += [p for p in self.worker_pids() if _is_our_worker(p)]
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def first_time(self, text: str) -> float | None:
        """When the first output line containing ``text`` arrived (None: no such line)."""
        return next((t for t, ln in self.lines if text in ln), None)

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def launcher_lines(self) -> list[tuple[float, str]]:
        return [(t, ln) for t, ln in self.lines if ln.startswith("tfdp launch: ")]

    def failure_line(self) -> tuple[float, str] | tuple[None, None]:
        """The launcher's first line naming a failed worker (its arrival time and text)."""
        for t, ln in self.launcher_lines():
            if re.search(r"failed with exit code|was killed by signal|stopped responding|"
                         r"lost the connection", ln):
                return t, ln
        return None, None


def _is_our_worker(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie) one of this harness's trial workers."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode("utf-8", errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return WORKER_MARK in cmdline and state not in ("Z", "X")


def _named_first(line: str | None) -> int | None:
    """The rank of the first worker a launcher failure line names."""
    m = re.search(r"worker (\d+) \(", line or "")
    return int(m.group(1)) if m else None


# --- the harness: checks ----------------------------------------------------------------------

def _load_weights(path: str) -> list | None:
    import numpy as np
    try:
        with np.load(path, allow_pickle=False) as f:
            return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]
    except (OSError, ValueError):
        return None


def _max_diff(a: list, b: list) -> float:
    import numpy as np
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf")
    return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
               if x.size else 0.0 for x, y in zip(a, b))


def _compare_to_clean(trial_dir: str, launch: int, workers: int, clean: list,
                      record: dict) -> list[str]:
    """Final weights of every worker vs the clean run: the figures into ``record``; problems."""
    problems, diffs, bitwise = [], [], True
    for rank in range(workers):
        got = _load_weights(os.path.join(trial_dir, f"weights-{launch}-{rank}.npz"))
        if got is None:
            problems.append(f"worker {rank} wrote no final weights")
            continue
        d = _max_diff(got, clean)
        diffs.append(d)
        bitwise = bitwise and d == 0.0
    if diffs:
        record["max_abs_dw"] = max(diffs)
        record["bitwise_identical"] = bitwise and len(diffs) == workers
        if max(diffs) > TOL:
            problems.append(f"final weights differ from the clean run: max |dw| = "
                            f"{max(diffs):.3g} > {TOL:g}")
    return problems


def _results(launch: Launch) -> list[dict]:
    out = []
    for _, line in launch.lines:
        m = re.match(r"^\[worker (\d+)\] RESULT (.*)$", line)
        if m:
            try:
                out.append(json.loads(m.group(2)))
            except ValueError:
                pass
    return out


def _read_backup(backup_dir: str) -> dict:
    """What is on disk: the sidecar's step and state file, whether that state loads with the
    sidecar's number of arrays, and any leftover temporary files of a write."""
    import numpy as np
    info = {"files": sorted(os.listdir(backup_dir)) if os.path.isdir(backup_dir) else []}
    info["tmp_files"] = [n for n in info["files"] if n.startswith(".tmp-")]
    try:
        with open(os.path.join(backup_dir, "backup.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        info["error"] = f"sidecar unreadable: {e}"
        return info
    info["global_step"] = meta.get("global_step")
    info["state"] = meta.get("state")
    expected = sum(int(meta.get(k) or 0) for k in ("num_model_variables",
                                                    "num_optimizer_variables",
                                                    "num_metric_variables"))
    try:
        state_file = os.path.join(backup_dir, str(meta.get("state")))
        with np.load(state_file, allow_pickle=False) as f:
            arrays = [f[k] for k in f.files]
        info["state_loads"] = len(arrays) == expected and all(
            np.all(np.isfinite(a)) for a in arrays if a.dtype.kind == "f")
        info["state_arrays"] = len(arrays)
    except Exception as e:  # noqa: BLE001 - a corrupt file is a finding, not a crash
        info["state_loads"] = False
        info["error"] = f"state unreadable: {type(e).__name__}: {e}"
    return info

"""``tfdp bench faults``: randomized fault trials on a real 2-worker job, and their table.

Every trial runs the same small, deterministic job through ``tfdp launch --workers 2
--cpu-replicas 2`` (4 replicas): a Keras ``model.fit`` of an MLP on a seeded, shuffled
``tf.data`` pipeline, with ``tfdp.callbacks.BackupAndRestore(dir, save_freq=1)`` and
``tfdp.callbacks.PreemptionCheckpoint``, which writes its final weights and optimizer state to a
file. One clean run per batch of trials is the reference. The harness (this process, no
TensorFlow) picks the victim and the moment from ``--seed``, watches the workers' progress files
(each worker appends its step number after every step and writes its PID at start) and sends the
signal itself, to the chosen worker's PID, when that worker reports the chosen step:

* ``kill-restart`` (a): SIGKILL a random worker at a random step; ``tfdp launch --max-restarts
  1`` restarts the job, which resumes from the backup; pass: the final weights and optimizer
  state equal the clean run's (max |dw| <= 1e-6) on both workers.
* ``kill-detect`` (b): SIGKILL a random worker at a random step, no restart; pass: the whole job
  (launcher and every worker) ends within 5 s of the kill and the launcher's failure line names
  that worker.
* ``stop-detect`` (c): SIGSTOP a random worker at a random step (it does not exit, so only the
  other worker's heartbeats can notice); pass: the whole job ends within 10 s, naming it.
* ``kill-in-write`` (d): a SIGKILL lands inside the chief's backup write at a random step (the
  trial script wraps the write so that it pauses at a random phase of it and says so: half of
  the state file written, the state file written but not renamed, or the new state in place and
  the sidecar not yet renamed); pass: a temporary file of the interrupted write is there, the
  previous backup (the step before) is intact and loads, and a relaunch resumes from it exactly.
* ``preempt`` (e): SIGTERM to a random worker at a random step; pass: every worker backs up at
  the same step and the job exits 75, the backup on disk is at that step, and a relaunch
  resumes exactly.

Detection seconds: from the signal to the end of the launcher (the whole job; (a): to the
launcher's failure line, after which it restarts). ``--heartbeat-timeout`` sets
``TFDP_HEARTBEAT_TIMEOUT`` for the workers (default: tfdp's, 6 s).

Every launch has the launcher's ``--timeout`` and a hard timeout here; every process started is
killed (by its process group, after checking it is one of this harness's workers) on every path.
``python -m tfdp.bench.faults`` runs it alone.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from tfdp.bench.parser import (
    BenchParser,
    check_directory,
    check_positive,
    check_writable,
    split_list,
    write_json,
)
from tfdp.errors import TfdpError, UsageError

# --- the trial job ------------------------------------------------------------------------------

SAMPLES, GLOBAL_BATCH, EPOCHS = 256, 32, 6       # 8 steps per epoch, 48 steps in all
TOTAL_STEPS = EPOCHS * SAMPLES // GLOBAL_BATCH
TOL = 1e-6                                       # resume tolerance (as tests/test_resume_dropin.py)
WORKER_MARK = "tfdp-bench-faults-worker"         # in every worker's command line (cleanup check)
WORKER_CODE = f"import tfdp.bench.faults as f; f.worker_main()  # {WORKER_MARK}"
SLOW_WRITE_PAUSE_S = 120.0                       # a paused backup write waits this long at most

# scenario -> (letter, bar in seconds or None, description)
SCENARIOS = {
    "kill-restart": ("a", None, ("SIGKILL a random worker at a random step; --max-restarts 1; "
                                 "final weights == clean run")),
    "kill-detect": ("b", 5.0, "SIGKILL a random worker; the job ends within 5 s, naming it"),
    "stop-detect": ("c", 10.0, "SIGSTOP a random worker; the job ends within 10 s, naming it"),
    "kill-in-write": ("d", None, ("SIGKILL the chief inside a backup write; previous backup "
                                  "intact, exact resume")),
    "preempt": ("e", None, ("SIGTERM a random worker at a random step; backup, exit 75, "
                            "exact resume")),
}
WRITE_PHASES = ("state-half-written", "state-not-renamed", "sidecar-not-renamed")
DEFAULTS = {"trials": 10, "seed": 0, "timeout": 300.0, "workers": 2, "cpu_replicas": 2}


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def worker_main() -> None:
    """The trial job, run by every worker (``python -c "import tfdp.bench.faults as f;
    f.worker_main()"`` under ``tfdp launch``). Configured by environment variables:

    ``FAULTS_DIR`` (the trial directory: PID and progress files, the backup, the final weights),
    ``FAULTS_LAUNCH`` (which launch of the trial), ``FAULTS_SLOW_WRITE`` = ``STEP:PHASE`` (first
    attempt, chief only: pause the backup write of global step STEP at PHASE, see
    ``WRITE_PHASES``, and write ``inwrite.json`` so the harness kills it there).
    """
    trial_dir = os.environ["FAULTS_DIR"]
    launch = int(os.environ.get("FAULTS_LAUNCH", "0"))
    restart = int(os.environ.get("TFDP_RESTART_COUNT", "0"))
    rank = int(os.environ.get("TFDP_WORKER_RANK", "0"))
    tag = f"{launch}-{restart}-{rank}"
    _write_atomic(os.path.join(trial_dir, f"pid-{tag}"), str(os.getpid()))

    import numpy as np

    import tfdp
    strategy = tfdp.DataParallelStrategy()   # TF_CONFIG + TFDP_CPU_REPLICAS from tfdp launch
    import keras
    import tensorflow as tf

    from tfdp.callbacks import BackupAndRestore, PreemptionCheckpoint
    from tfdp.testing import emit_result

    current = {"step": 0}
    progress_file = open(os.path.join(trial_dir, f"progress-{tag}"), "a")  # noqa: SIM115

    class Progress(keras.callbacks.Callback):
        """Counts this process's steps (placed before the backup: a step is reported before its
        backup is written) and appends each to the progress file."""

        def on_train_batch_end(self, batch, logs=None):
            current["step"] += 1
            progress_file.write(f"{current['step']} {time.time():.3f}\n")
            progress_file.flush()

    slow = os.environ.get("FAULTS_SLOW_WRITE", "")
    if slow and launch == 0 and restart == 0 and rank == 0:
        _install_slow_write(trial_dir, int(slow.split(":")[0]), slow.split(":")[1], current)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((SAMPLES, 8)).astype("float32")
    y = (np.sin(x[:, :4]).sum(axis=1, keepdims=True) + 0.1 * x[:, 4:5]).astype("float32")
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(16, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(1e-2), "mse", metrics=["mae"])
    data = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(SAMPLES, seed=7)
            .batch(GLOBAL_BATCH))
    backup = BackupAndRestore(os.path.join(trial_dir, "backup"), save_freq=1)
    point = backup.restore_point
    preempt = PreemptionCheckpoint(backup)
    model.fit(data, epochs=EPOCHS, verbose=0, shuffle=False,  # (tf.data shuffles)
              callbacks=[Progress(), backup, preempt])
    arrays = [np.asarray(v) for v in list(model.variables) + list(model.optimizer.variables)]
    out = os.path.join(trial_dir, f"weights-{launch}-{rank}.npz")
    with open(out + ".tmp", "wb") as f:
        np.savez(f, *arrays)
    os.replace(out + ".tmp", out)
    emit_result(rank=rank, launch=launch, restart=restart, restored=backup.restored,
                resumed_from=None if point is None else point.global_step,
                iterations=int(model.optimizer.iterations.numpy()))


def _install_slow_write(trial_dir: str, step: int, phase: str, current: dict) -> None:
    """Make the backup write of global step ``step`` pause at ``phase`` (this process only).

    ``BackupAndRestore`` writes the state with ``numpy.savez`` into a temporary file, renames it
    (``os.replace``), then writes and renames the sidecar the same way. Both public functions are
    wrapped here: at the chosen phase the wrapper writes ``inwrite.json`` (the harness then
    SIGKILLs this process) and sleeps.
    """
    import numpy as np
    savez, replace = np.savez, os.replace
    state = {"armed": True}

    def pause(where):
        state["armed"] = False
        _write_atomic(os.path.join(trial_dir, "inwrite.json"),
                      json.dumps({"phase": phase, "step": step, "where": where,
                                  "pid": os.getpid(), "time": time.time()}))
        time.sleep(SLOW_WRITE_PAUSE_S)

    def slow_savez(file, *args, **kwargs):
        if not (state["armed"] and phase == "state-half-written" and current["step"] == step
                and hasattr(file, "write")):
            return savez(file, *args, **kwargs)
        import io
        buf = io.BytesIO()
        savez(buf, *args, **kwargs)
        data = buf.getvalue()
        file.write(data[:len(data) // 2])
        file.flush()
        os.fsync(file.fileno())
        pause(f"{len(data) // 2} of {len(data)} bytes of the state written")
        file.write(data[len(data) // 2:])

    def slow_replace(src, dst, *args, **kwargs):
        name = os.path.basename(os.fspath(dst))
        if state["armed"] and current["step"] == step and (
                (phase == "state-not-renamed" and name == f"state-{step}.npz")
                or (phase == "sidecar-not-renamed" and name == "backup.json")):
            pause(f"before renaming {os.path.basename(os.fspath(src))} to {name}")
        return replace(src, dst, *args, **kwargs)

    np.savez = slow_savez
    os.replace = slow_replace


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


# --- the harness: trials ----------------------------------------------------------------------

class Harness:
    def __init__(self, workdir: str, *, workers: int = 2, cpu_replicas: int = 2,
                 timeout: float = 300.0, heartbeat_timeout: float | None = None,
                 progress: bool = True):
        self.workdir, self.workers, self.cpu_replicas = workdir, workers, cpu_replicas
        self.timeout, self.heartbeat_timeout, self.show = timeout, heartbeat_timeout, progress
        self.env = {}
        if heartbeat_timeout is not None:
            self.env["TFDP_HEARTBEAT_TIMEOUT"] = f"{heartbeat_timeout:g}"
        self.active: list[Launch] = []
        self.clean = None

    def say(self, text: str) -> None:
        if self.show:
            print(f"faults: {text}", file=sys.stderr, flush=True)

    def launch(self, trial_dir, index, max_restarts=0, env=None) -> Launch:
        launch = Launch(trial_dir, index, workers=self.workers, cpu_replicas=self.cpu_replicas,
                        max_restarts=max_restarts, timeout=self.timeout,
                        env=dict(self.env, **(env or {})))
        self.active.append(launch)
        return launch

    def finish(self, launch: Launch) -> int:
        """Wait for the launch to end; note the workers still alive then (``launch.left``),
        and kill them: nothing of it may outlive it."""
        code = launch.wait()
        launch.left = launch.alive_workers()
        launch.kill()
        if launch in self.active:
            self.active.remove(launch)
        return code

    def cleanup(self) -> None:
        for launch in list(self.active):
            launch.kill()
            try:
                launch.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.active.clear()

    def _trial_dir(self, name: str) -> str:
        path = os.path.join(self.workdir, name)
        os.makedirs(path, exist_ok=True)
        return path

    # clean reference

    def run_clean(self) -> dict:
        trial_dir = self._trial_dir("clean")
        t0 = time.monotonic()
        launch = self.launch(trial_dir, 0)
        code = self.finish(launch)
        weights = [_load_weights(os.path.join(trial_dir, f"weights-0-{r}.npz"))
                   for r in range(self.workers)]
        if code != 0 or any(w is None for w in weights):
            raise TfdpError(f"The clean run failed, so no trial can be judged. Received: exit "
                            f"code {code} (output: {launch.log_path}). Fix the job first "
                            "(run it with tfdp launch by hand).")
        spread = max(_max_diff(w, weights[0]) for w in weights)
        self.clean = weights[0]
        seconds = time.monotonic() - t0
        self.say(f"clean run: {seconds:.1f} s, {TOTAL_STEPS} steps, workers identical "
                 f"(max |dw| {spread:.3g})")
        return {"seconds": seconds, "workers_max_abs_dw": spread, "steps": TOTAL_STEPS}

    # the signal at a step

    def _signal_at(self, launch: Launch, rank: int, step: int, sig, record: dict,
                   problems: list) -> bool:
        """Send ``sig`` to worker ``rank`` of the first attempt once it reports ``step``."""
        deadline = launch.start + self.timeout
        while launch.running() and time.monotonic() < deadline:
            seen = launch.step(rank)
            if seen >= step:
                pid = launch.pid(rank)
                if pid is None or not _is_our_worker(pid):
                    break
                os.kill(pid, sig)
                record["signal_time"] = time.monotonic()
                record["step_at_signal"] = seen
                record["pid"] = pid
                return True
            time.sleep(0.003)
        problems.append(f"worker {rank} never reported step {step} (the job ended or timed out "
                        "first)")
        return False

    def trial(self, scenario: str, index: int, rng: random.Random) -> dict:
        trial_dir = self._trial_dir(f"{scenario}-{index}")
        victim = rng.randrange(self.workers)
        step = rng.randint(3, TOTAL_STEPS - 12)
        record = {"scenario": scenario, "trial": index, "victim": victim, "step": step,
                  "dir": trial_dir}
        problems: list[str] = []
        t0 = time.monotonic()
        try:
            getattr(self, "_" + scenario.replace("-", "_"))(trial_dir, record, problems, rng)
        finally:
            self.cleanup()
        record.pop("signal_time", None)
        record["seconds"] = round(time.monotonic() - t0, 1)
        record["passed"] = not problems
        record["problems"] = problems
        d = record.get("detection_s")
        self.say(f"{scenario} {index}: {'pass' if not problems else 'FAIL'}"
                 f" (worker {record['victim']}, step {record.get('step_at_signal', step)}"
                 + (f", {record['phase']}" if "phase" in record else "")
                 + (f", detected in {d:.2f} s" if d is not None else "")
                 + (f", max |dw| {record['max_abs_dw']:.3g}" if "max_abs_dw" in record else "")
                 + f"; {record['seconds']:.0f} s)" + ("".join(f"\n  - {p}" for p in problems)))
        return record

    def _detect(self, trial_dir, record, problems, sig, bar):
        victim, step = record["victim"], record["step"]
        launch = self.launch(trial_dir, 0)
        if not self._signal_at(launch, victim, step, sig, record, problems):
            self.finish(launch)
            return
        code = self.finish(launch)
        record["detection_s"] = launch.end - record["signal_time"]
        record["exit_code"] = code
        t_line, line = launch.failure_line()
        record["launcher_line"] = line
        if t_line is not None:
            record["named_s"] = t_line - record["signal_time"]
        t_report = launch.first_time("tfdp: peer failure: ")
        if t_report is not None:  # a surviving worker's own report of the lost peer
            record["peer_report_s"] = t_report - record["signal_time"]
        left = launch.left  # alive after the launcher's exit (then killed)
        if code == 0:
            problems.append("the job succeeded although a worker was "
                            f"{signal.Signals(sig).name}ed")
        if _named_first(line) != victim:
            problems.append(f"the launcher's failure line does not name worker {victim} first: "
                            f"{line!r}")
        if sig == signal.SIGSTOP and line and "stopped responding" not in line:
            problems.append(f"the failure line does not say the worker stopped responding: "
                            f"{line!r}")
        if left:
            problems.append(f"worker processes {left} outlived the launcher")
        if record["detection_s"] > bar:
            problems.append(f"the job ended {record['detection_s']:.2f} s after the "
                            f"{signal.Signals(sig).name}, more than {bar:g} s")

    def _kill_detect(self, trial_dir, record, problems, rng):
        self._detect(trial_dir, record, problems, signal.SIGKILL, SCENARIOS["kill-detect"][1])

    def _stop_detect(self, trial_dir, record, problems, rng):
        self._detect(trial_dir, record, problems, signal.SIGSTOP, SCENARIOS["stop-detect"][1])

    def _kill_restart(self, trial_dir, record, problems, rng):
        victim, step = record["victim"], record["step"]
        launch = self.launch(trial_dir, 0, max_restarts=1)
        if not self._signal_at(launch, victim, step, signal.SIGKILL, record, problems):
            self.finish(launch)
            return
        code = self.finish(launch)
        record["exit_code"] = code
        t_line, line = launch.failure_line()
        record["launcher_line"] = line
        if t_line is not None:
            record["detection_s"] = t_line - record["signal_time"]
        if code != 0:
            problems.append(f"the restarted job failed (exit code {code})")
        if not any("restarting all workers" in ln for _, ln in launch.launcher_lines()):
            problems.append("the launcher did not restart the workers")
        if _named_first(line) != victim:
            problems.append(f"the launcher's failure line does not name worker {victim}: "
                            f"{line!r}")
        results = [r for r in _results(launch) if r.get("restart") == 1]
        record["resumed_from"] = sorted({r.get("resumed_from") for r in results},
                                        key=lambda s: -1 if s is None else s)
        if len(results) != self.workers or not all(r.get("restored") for r in results):
            problems.append(f"not every restarted worker restored the backup: {results}")
        problems += _compare_to_clean(trial_dir, 0, self.workers, self.clean, record)

    def _kill_in_write(self, trial_dir, record, problems, rng):
        record["victim"] = victim = 0      # only the chief writes the backup
        step = record["step"]
        record["phase"] = phase = rng.choice(WRITE_PHASES)
        launch = self.launch(trial_dir, 0, env={"FAULTS_SLOW_WRITE": f"{step}:{phase}"})
        marker = os.path.join(trial_dir, "inwrite.json")
        deadline = launch.start + self.timeout
        while launch.running() and time.monotonic() < deadline and not os.path.exists(marker):
            time.sleep(0.003)
        pid = launch.pid(victim)
        if not os.path.exists(marker) or pid is None or not _is_our_worker(pid):
            problems.append(f"the backup write of step {step} was never reached")
            self.finish(launch)
            return
        os.kill(pid, signal.SIGKILL)
        record["signal_time"] = time.monotonic()
        record["step_at_signal"] = step
        with open(marker) as f:
            record["in_write"] = json.load(f)["where"]
        code = self.finish(launch)
        record["detection_s"] = launch.end - record["signal_time"]
        record["exit_code"] = code
        _, record["launcher_line"] = launch.failure_line()
        if code == 0:
            problems.append("the job succeeded although the chief was killed")
        if _named_first(record["launcher_line"]) != victim:
            problems.append(f"the launcher's failure line does not name worker 0: "
                            f"{record['launcher_line']!r}")
        disk = _read_backup(os.path.join(trial_dir, "backup"))
        record["backup_after_kill"] = disk
        if not disk["tmp_files"]:
            problems.append(f"no temporary file of the interrupted write: {disk['files']}")
        if disk.get("global_step") != step - 1 or not disk.get("state_loads"):
            problems.append(f"the previous backup (step {step - 1}) is not intact: {disk}")
        self._resume(trial_dir, record, problems, expect_from=step - 1)

    def _preempt(self, trial_dir, record, problems, rng):
        victim, step = record["victim"], record["step"]
        launch = self.launch(trial_dir, 0)
        if not self._signal_at(launch, victim, step, signal.SIGTERM, record, problems):
            self.finish(launch)
            return
        code = self.finish(launch)
        record["detection_s"] = launch.end - record["signal_time"]
        record["exit_code"] = code
        _, record["launcher_line"] = launch.failure_line()
        if code != 75:
            problems.append(f"the preempted job exited {code}, not 75")
        backed = {}
        for _, ln in launch.lines:
            m = re.match(r"^\[worker (\d+)\] .*backed up at global step (\d+), exiting with "
                         r"code (\d+)", ln)
            if m:
                backed[int(m.group(1))] = int(m.group(2))
        record["backed_up_at"] = backed
        disk = _read_backup(os.path.join(trial_dir, "backup"))
        record["backup_after_exit"] = disk
        steps = set(backed.values())
        if len(backed) != self.workers or len(steps) != 1:
            problems.append(f"not every worker backed up at one step: {backed}")
            return
        (at,) = steps
        if at < record["step_at_signal"]:
            problems.append(f"backed up at step {at}, before the SIGTERM's step "
                            f"{record['step_at_signal']}")
        if disk.get("global_step") != at or not disk.get("state_loads"):
            problems.append(f"the backup on disk is not the preemption's (step {at}): {disk}")
        self._resume(trial_dir, record, problems, expect_from=at)

    def _resume(self, trial_dir, record, problems, expect_from):
        """Relaunch (no fault); it must restore at ``expect_from`` and end as the clean run."""
        launch = self.launch(trial_dir, 1)
        code = self.finish(launch)
        record["resume_exit_code"] = code
        results = [r for r in _results(launch) if r.get("launch") == 1]
        record["resumed_from"] = sorted({r.get("resumed_from") for r in results},
                                        key=lambda s: -1 if s is None else s)
        if code != 0:
            problems.append(f"the resumed job failed (exit code {code}, {launch.log_path})")
            return
        if len(results) != self.workers or not all(
                r.get("restored") and r.get("resumed_from") == expect_from for r in results):
            problems.append(f"the resumed job did not restore step {expect_from}: {results}")
        problems += _compare_to_clean(trial_dir, 1, self.workers, self.clean, record)


# --- run, table ---------------------------------------------------------------------------------

def _versions() -> dict:
    from importlib import metadata

    from tfdp._version import __version__
    out = {"tfdp": __version__, "python": sys.version.split()[0]}
    for dist in ("tensorflow-cpu", "tensorflow", "keras"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        out["cpu_cores"] = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        out["cpu_cores"] = os.cpu_count()
    return out


def _sigterm_to_exit(signum, frame):
    raise SystemExit(128 + signum)


def run_faults(scenarios=tuple(SCENARIOS), trials: int = DEFAULTS["trials"],
               seed: int = DEFAULTS["seed"], workdir: str | None = None,
               timeout: float = DEFAULTS["timeout"], heartbeat_timeout: float | None = None,
               workers: int = DEFAULTS["workers"], cpu_replicas: int = DEFAULTS["cpu_replicas"],
               progress: bool = True) -> dict:
    """Run ``trials`` randomized trials of each scenario; every record and the summary.

    The trials of all scenarios are interleaved (trial 1 of each, then trial 2 of each...), each
    with its victim, step and phase drawn from ``random.Random(seed)``; one clean run first.
    """
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown or not scenarios:
        raise TfdpError(f"Invalid scenarios. Received: scenarios={list(scenarios)!r}. Valid: "
                        f"{', '.join(SCENARIOS)}.")
    keep = workdir is not None
    workdir = os.path.abspath(workdir) if keep else tempfile.mkdtemp(prefix="tfdp-faults-")
    os.makedirs(workdir, exist_ok=True)
    if heartbeat_timeout is None and os.environ.get("TFDP_HEARTBEAT_TIMEOUT", "").strip():
        raw = os.environ["TFDP_HEARTBEAT_TIMEOUT"]  # inherited by the workers: recorded
        try:
            heartbeat_timeout = float(raw)
        except ValueError:
            raise TfdpError(f"Invalid TFDP_HEARTBEAT_TIMEOUT. Received: "
                            f"TFDP_HEARTBEAT_TIMEOUT={raw!r}. Set a positive number of seconds, "
                            "unset it, or pass --heartbeat-timeout.") from None
    harness = Harness(workdir, workers=workers, cpu_replicas=cpu_replicas, timeout=timeout,
                      heartbeat_timeout=heartbeat_timeout, progress=progress)
    rng = random.Random(seed)
    records = []
    t0 = time.monotonic()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _sigterm_to_exit)  # so the cleanup runs
    try:
        clean = harness.run_clean()
        for i in range(trials):
            for s in scenarios:
                records.append(harness.trial(s, i, rng))
    finally:
        harness.cleanup()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    failed = [r for r in records if not r["passed"]]
    if not keep and not failed:
        shutil.rmtree(workdir, ignore_errors=True)
    summary = []
    for s in scenarios:
        rs = [r for r in records if r["scenario"] == s]
        det = [r["detection_s"] for r in rs if r.get("detection_s") is not None]
        rep = [r["peer_report_s"] for r in rs if r.get("peer_report_s") is not None]
        dws = [r["max_abs_dw"] for r in rs if r.get("max_abs_dw") is not None]
        summary.append({
            "scenario": s, "letter": SCENARIOS[s][0], "bar_s": SCENARIOS[s][1],
            "passed": sum(r["passed"] for r in rs), "trials": len(rs),
            "detection_s": ({"min": min(det), "median": statistics.median(det),
                             "max": max(det)} if det else None),
            "peer_report_s": ({"min": min(rep), "median": statistics.median(rep),
                               "max": max(rep), "n": len(rep)} if rep else None),
            "max_abs_dw": max(dws) if dws else None,
            "bitwise": (sum(bool(r.get("bitwise_identical")) for r in rs) if dws else None)})
    return {"benchmark": "faults", "seed": seed, "trials": trials, "scenarios": list(scenarios),
            "workers": workers, "cpu_replicas": cpu_replicas, "steps": TOTAL_STEPS,
            "heartbeat_timeout_s": heartbeat_timeout, "clean": clean, "summary": summary,
            "records": records, "seconds": time.monotonic() - t0,
            "workdir": workdir if (keep or failed) else None, "environment": _versions()}


DETECTION = {"kill-restart": "kill -> launcher's failure line (then it restarts)",
             "kill-detect": "kill -> whole job ended",
             "stop-detect": "SIGSTOP -> whole job ended",
             "kill-in-write": "kill -> whole job ended",
             "preempt": "SIGTERM -> job ended with exit 75"}


def format_faults(result: dict) -> str:
    hb = result["heartbeat_timeout_s"]
    env = result["environment"]
    tf_version = env.get("tensorflow-cpu") or env.get("tensorflow")
    heading = (f"tfdp bench faults: {result['workers']} workers x {result['cpu_replicas']} CPU "
               f"replicas, Keras fit of an MLP ({result['steps']} steps, BackupAndRestore "
               f"save_freq=1, PreemptionCheckpoint), seed {result['seed']}, "
               f"TFDP_HEARTBEAT_TIMEOUT={f'{hb:g} s' if hb else 'default (6 s)'}; "
               f"{env.get('cpu_cores')} cores, TF {tf_version}, Keras {env.get('keras')}")
    lines = [heading, ""]
    headers = ["scenario", "passed / N", "detection s min / median / max", "bar",
               "max |dw| vs clean", "bitwise"]
    rows = []
    for s in result["summary"]:
        d = s["detection_s"]
        rows.append([f"({s['letter']}) {s['scenario']}", f"{s['passed']} / {s['trials']}",
                     f"{d['min']:.2f} / {d['median']:.2f} / {d['max']:.2f}" if d else "-",
                     f"< {s['bar_s']:g} s" if s["bar_s"] else "-",
                     "-" if s["max_abs_dw"] is None else f"{s['max_abs_dw']:.3g}",
                     "-" if s["bitwise"] is None else f"{s['bitwise']} / {s['trials']}"])
    lines.append(_render(headers, rows))
    survived = sum(s["passed"] for s in result["summary"])
    total = sum(s["trials"] for s in result["summary"])
    dws = [s["max_abs_dw"] for s in result["summary"] if s["max_abs_dw"] is not None]
    lines += ["", f"trials survived: {survived} / {total}; resume max |dw| vs the clean run: "
                  + (f"{max(dws):.3g}" if dws else "-") + f" (pass: <= {TOL:g}); "
                  f"{result['seconds']:.0f} s in all",
              "detection: " + "; ".join(f"({SCENARIOS[s['scenario']][0]}) "
                                        f"{DETECTION[s['scenario']]}"
                                        for s in result["summary"])]
    for s in result["summary"]:
        r = s.get("peer_report_s")
        if r and s["scenario"] == "stop-detect":
            lines.append(f"({s['letter']}) the surviving worker's own report naming the stopped "
                         f"worker ('tfdp: peer failure: ...'): {r['min']:.2f} / "
                         f"{r['median']:.2f} / {r['max']:.2f} s after the SIGSTOP "
                         f"({r['n']} trials); the rest of the detection time is that worker's "
                         "exit")
    for r in result["records"]:
        if not r["passed"]:
            lines.append(f"FAILED {r['scenario']} {r['trial']} (worker {r['victim']}, step "
                         f"{r.get('step_at_signal', r['step'])}): " + "; ".join(r["problems"]))
    if result.get("workdir"):
        lines.append(f"trial directories (launcher logs, backups): {result['workdir']}")
    return "\n".join(lines)


def _render(headers, rows) -> str:
    from tfdp.bench._common import render_table
    return render_table(headers, rows)


def build_parser() -> BenchParser:
    p = BenchParser("tfdp bench faults",
                    description="Randomized fault trials on a real 2-worker x 2-replica Keras fit "
                                "under tfdp launch: (a) kill-restart, (b) kill-detect, (c) "
                                "stop-detect, (d) kill-in-write, (e) preempt (see the module "
                                "docstring); a table of trials passed, detection seconds and "
                                "resume max |dw|.")
    p.add_argument("--trials", type=int, default=DEFAULTS["trials"], metavar="N",
                   help=f"trials per scenario (default: {DEFAULTS['trials']})")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), metavar="LIST",
                   help="comma-separated scenario names or letters a-e (default: all: "
                        + ", ".join(SCENARIOS) + ")")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"],
                   help="seed of the victims, steps and write phases (default: 0)")
    p.add_argument("--heartbeat-timeout", type=float, default=None, metavar="SECONDS",
                   help="TFDP_HEARTBEAT_TIMEOUT for the workers (default: tfdp's, 6 s)")
    p.add_argument("--timeout", type=float, default=DEFAULTS["timeout"], metavar="SECONDS",
                   help="each launch's --timeout (default: 300)")
    p.add_argument("--workdir", metavar="DIR",
                   help="keep the trial directories (launcher logs, backups) here (default: a "
                        "temporary directory, removed unless a trial failed)")
    p.add_argument("--json", metavar="FILE", help="write every trial's record to FILE as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def parse_scenarios(text: str) -> list[str]:
    letters = {v[0]: k for k, v in SCENARIOS.items()}
    out = []
    for item in split_list(text):
        name = letters.get(item, item)
        if name not in SCENARIOS:
            raise UsageError(f"Invalid --scenarios. Received: {item!r}. Valid: "
                             f"{', '.join(SCENARIOS)} (or a-e). Run 'tfdp bench faults --help' "
                             "for usage.")
        if name not in out:
            out.append(name)
    if not out:
        raise UsageError(f"Invalid --scenarios. Received: {text!r}. Give at least one of "
                         f"{', '.join(SCENARIOS)} (or a-e).")
    return out


def parse_args(argv):
    args = build_parser().parse_args(argv)
    check_positive("--trials", args.trials)
    args.scenarios = parse_scenarios(args.scenarios)
    for option, value in (("--timeout", args.timeout),
                          ("--heartbeat-timeout", args.heartbeat_timeout)):
        if value is not None and not 0 < value < float("inf"):
            raise UsageError(f"Invalid {option}. Received: {option} {value:g}. Give a positive "
                             "number of seconds.")
    if args.timeout < 30:
        raise UsageError(f"Invalid --timeout. Received: --timeout {args.timeout:g}. Give at "
                         "least 30 seconds (a launch starts TensorFlow in every worker).")
    check_directory("--workdir", args.workdir)
    check_writable("--json", args.json)
    return args


def run(args) -> int:
    result = run_faults(scenarios=args.scenarios, trials=args.trials, seed=args.seed,
                        workdir=args.workdir, timeout=args.timeout,
                        heartbeat_timeout=args.heartbeat_timeout, progress=not args.quiet)
    print(format_faults(result), flush=True)
    if args.json:
        write_json(args.json, result)
    return 0 if all(s["passed"] == s["trials"] for s in result["summary"]) else 1


def main(argv=None) -> int:
    from tfdp.bench.parser import run_standalone
    return run_standalone("faults", parse_args, run, argv)


if __name__ == "__main__":  # python -m tfdp.bench.faults
    sys.exit(main())

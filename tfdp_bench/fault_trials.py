"""The fault harness's trials (:mod:`tfdp_bench.faults`): the clean run, then one trial of a
scenario (victim, step and phase drawn from the seed), its signal sent at the chosen step and its
pass/fail checks. No TensorFlow.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

from tfdp.errors import TfdpError
from tfdp_bench.fault_job import SCENARIOS, TOTAL_STEPS, WRITE_PHASES
from tfdp_bench.fault_launch import (Launch, _compare_to_clean, _is_our_worker, _load_weights,
                                     _max_diff, _named_first, _read_backup, _results)


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

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
``python -m tfdp_bench.faults`` runs it alone.

Layout: :mod:`tfdp_bench.fault_job` (the job inside the workers, the scenarios),
:mod:`tfdp_bench.fault_launch` (one launch, the checks), :mod:`tfdp_bench.fault_trials` (the
clean run and one trial); this module runs the trials and prints the table.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time

from tfdp_bench.parser import (
    BenchParser,
    check_directory,
    check_positive,
    check_writable,
    split_list,
    write_json,
)
from tfdp.errors import TfdpError, UsageError
# (re-exported: the job's scenarios and the harness's checks, as tests/test_faults.py reads them)
from tfdp_bench.fault_job import (  # noqa: F401
    DEFAULTS, SCENARIOS, TOL, TOTAL_STEPS, WRITE_PHASES, worker_main)
from tfdp_bench.fault_launch import (  # noqa: F401
    _compare_to_clean, _is_our_worker, _named_first, _read_backup)
from tfdp_bench.fault_trials import Harness


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
    from tfdp_bench._common import render_table
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
    from tfdp_bench.parser import run_standalone
    return run_standalone("faults", parse_args, run, argv)


if __name__ == "__main__":  # python -m tfdp_bench.faults
    sys.exit(main())

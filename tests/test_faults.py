"""tfdp bench faults (tfdp_bench/faults.py): the fault-trial harness of issue #13 item 2.

End to end (CI's small N): one trial of (b) kill-detect and (d) kill-in-write through ``python -m
tfdp_bench.faults``: a real 2-worker x 2-replica job, the SIGKILL sent by the harness at a
worker's reported step and inside the chief's backup write, the table and the JSON. The N = 10
table is docs/benchmarks/faults.md. The rest runs without TensorFlow: usage errors, scenario
names, the judgements the harness makes (backup on disk, weights vs the clean run, the worker a
launcher line names) and the table.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from jobs import standalone_in_process
from tfdp_bench import faults

pytestmark = pytest.mark.timeout(120)


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "tfdp_bench.faults", *args], check=False,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True)


def test_usage_error_through_the_real_entry_point(run_process):
    """``python -m tfdp_bench.faults`` itself (a process, as a user runs it); the other usage
    errors run in this process (below)."""
    p = _cli("--scenarios", "z")
    assert p.returncode == 2, p
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdp bench faults: error: "), p.stderr
    assert "Invalid --scenarios. Received: 'z'" in lines[0], lines[0]
    assert "Traceback" not in p.stderr and p.stdout == ""


@pytest.mark.parametrize("args,expected", [
    (["--scenarios", ","], "Invalid --scenarios"),
    (["--trials", "0"], "Invalid --trials. Received: --trials 0"),
    (["--timeout", "5"], "Invalid --timeout. Received: --timeout 5"),
    (["--heartbeat-timeout", "-1"], "Invalid --heartbeat-timeout"),
    (["--json", "/nonexistent-dir/x.json"], "Cannot write --json here"),
    (["--bogus"], "Unrecognized arguments: --bogus"),
])
def test_usage_errors_are_one_line_exit_2(monkeypatch, capsys, args, expected):
    code, out, err = standalone_in_process(monkeypatch, capsys, "tfdp_bench.faults", *args)
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdp bench faults: error: "), err
    assert expected in lines[0], lines[0]
    assert "Traceback" not in err and out == ""


def test_help_and_import_start_no_tensorflow(run_process):
    p = _cli("--help")
    assert p.returncode == 0 and "kill-in-write" in p.stdout, p
    code = "import sys, tfdp_bench.faults; assert 'tensorflow' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_scenarios_by_name_or_letter():
    assert faults.parse_scenarios("a, e,kill-detect,a") == ["kill-restart", "preempt",
                                                            "kill-detect"]
    assert faults.parse_scenarios(",".join("abcde")) == list(faults.SCENARIOS)
    assert [v[1] for v in faults.SCENARIOS.values()] == [None, 5.0, 10.0, None, None]
    with pytest.raises(faults.TfdpError, match="Invalid scenarios"):
        faults.run_faults(scenarios=["nope"], trials=1)


def _backup(path, step, arrays=3, sidecar=True):
    path.mkdir(exist_ok=True)
    state = f"state-{step}.npz"
    np.savez(path / state, **{f"v{i:05d}": np.full(4, float(i), np.float32)
                              for i in range(arrays)})
    if sidecar:
        (path / "backup.json").write_text(json.dumps({
            "format": "tfdp-backup", "global_step": step, "state": state,
            "num_model_variables": 2, "num_optimizer_variables": 1,
            "num_metric_variables": 0}))
    return path / state


def test_read_backup_tells_intact_from_broken(tmp_path):
    d = tmp_path / "backup"
    _backup(d, 7)
    (d / ".tmp-123-abc").write_bytes(b"PK\x03\x04 half")  # a write that never finished
    info = faults._read_backup(str(d))
    assert info["global_step"] == 7 and info["state_loads"] is True
    assert info["tmp_files"] == [".tmp-123-abc"]
    # a state file cut in half is not intact
    state = _backup(d, 8)
    state.write_bytes(state.read_bytes()[:len(state.read_bytes()) // 2])
    assert faults._read_backup(str(d))["state_loads"] is False
    # fewer arrays than the sidecar counts is not intact either
    _backup(d, 9, arrays=2)
    assert faults._read_backup(str(d))["state_loads"] is False
    # no sidecar: an error, never a pass
    e = tmp_path / "empty"
    _backup(e, 1, sidecar=False)
    info = faults._read_backup(str(e))
    assert "error" in info and info.get("global_step") is None


def test_final_weights_are_compared_to_the_clean_run(tmp_path):
    clean = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(3, np.float32)]
    np.savez(tmp_path / "weights-1-0.npz", *clean)
    np.savez(tmp_path / "weights-1-1.npz", clean[0], clean[1] + 2.0 ** -20)  # < 1e-6
    record = {}
    assert faults._compare_to_clean(str(tmp_path), 1, 2, clean, record) == []
    assert record["max_abs_dw"] == 2.0 ** -20
    assert record["bitwise_identical"] is False
    np.savez(tmp_path / "weights-1-1.npz", clean[0], clean[1] + 1e-3)
    problems = faults._compare_to_clean(str(tmp_path), 1, 2, clean, record)
    assert len(problems) == 1 and "max |dw| = 0.001" in problems[0], problems
    os.remove(tmp_path / "weights-1-0.npz")
    problems = faults._compare_to_clean(str(tmp_path), 1, 2, clean, {})
    assert "worker 0 wrote no final weights" in problems


def test_the_worker_a_launcher_line_names_first():
    killed = ("tfdp launch: worker 1 (127.0.0.1:4001) was killed by signal SIGKILL; stopped "
              "the other workers")
    reported = ("tfdp launch: worker 0 (127.0.0.1:4000) (the coordination leader) has stopped "
                "responding (heartbeats unanswered for 3 s: ...); reported by worker 1 "
                "(127.0.0.1:4001), which failed with exit code 1; stopped the other workers")
    assert faults._named_first(killed) == 1
    assert faults._named_first(reported) == 0
    assert faults._named_first(None) is None


def test_table_counts_failures_and_names_them():
    def summary(name, passed, det, dw):
        return {"scenario": name, "letter": faults.SCENARIOS[name][0],
                "bar_s": faults.SCENARIOS[name][1], "passed": passed, "trials": 2,
                "detection_s": det, "max_abs_dw": dw, "bitwise": None if dw is None else 2,
                "peer_report_s": None}
    result = {"workers": 2, "cpu_replicas": 2, "steps": 48, "seed": 3,
              "heartbeat_timeout_s": 3.0, "seconds": 100.0, "workdir": "/tmp/x",
              "environment": {"cpu_cores": 2, "tensorflow-cpu": "2.21.0", "keras": "3.15.1"},
              "summary": [summary("kill-restart", 2, {"min": 3.1, "median": 3.2, "max": 3.3},
                                  0.0),
                          summary("stop-detect", 1, {"min": 5.0, "median": 8.0, "max": 11.0},
                                  None)],
              "records": [{"scenario": "stop-detect", "trial": 1, "victim": 0, "step": 9,
                           "step_at_signal": 9, "passed": False,
                           "problems": ["the job ended 11.00 s after the SIGSTOP, more than 10 s"]
                           }]}
    text = faults.format_faults(result)
    assert "TFDP_HEARTBEAT_TIMEOUT=3 s" in text
    assert re.search(r"^\(a\) kill-restart +2 / 2 ", text, re.MULTILINE)
    assert "3.10 / 3.20 / 3.30" in text
    assert re.search(r"^\(c\) stop-detect +1 / 2 ", text, re.MULTILINE) and "< 10 s" in text
    assert "trials survived: 3 / 4" in text
    assert "FAILED stop-detect 1 (worker 0, step 9): the job ended 11.00 s" in text
    assert "/tmp/x" in text


@pytest.mark.timeout(600)
def test_kill_detect_and_kill_in_write_end_to_end(run_process, tmp_path):
    """CI's small N: one trial each of (b) and (d), through the command line."""
    work, out = tmp_path / "work", tmp_path / "faults.json"
    try:
        p = _cli("--trials", "1", "--scenarios", "b,d", "--seed", "5", "--timeout", "240",
                 "--workdir", str(work), "--json", str(out), timeout=570)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"tfdp bench faults did not end in time:\n{e.stderr}")
    assert p.returncode == 0, p.stdout + p.stderr
    assert re.search(r"^\(b\) kill-detect +1 / 1 ", p.stdout, re.MULTILINE), p.stdout
    assert re.search(r"^\(d\) kill-in-write +1 / 1 ", p.stdout, re.MULTILINE), p.stdout
    assert "trials survived: 2 / 2" in p.stdout, p.stdout
    result = json.loads(out.read_text())
    b, d = result["records"]
    assert b["scenario"] == "kill-detect" and b["passed"], b
    assert b["detection_s"] < 5.0 and b["exit_code"] != 0
    assert faults._named_first(b["launcher_line"]) == b["victim"], b
    assert d["scenario"] == "kill-in-write" and d["passed"], d
    assert d["phase"] in faults.WRITE_PHASES and d["victim"] == 0
    disk = d["backup_after_kill"]
    assert disk["tmp_files"] and disk["global_step"] == d["step"] - 1 and disk["state_loads"]
    assert d["resumed_from"] == [d["step"] - 1] and d["resume_exit_code"] == 0
    assert d["max_abs_dw"] <= faults.TOL
    # nothing the trials started is still running
    pids = [int((work / t / f).read_text()) for t in os.listdir(work) if (work / t).is_dir()
            for f in os.listdir(work / t) if f.startswith("pid-")]
    assert len(pids) == 2 * 4, pids  # clean, kill-detect, kill-in-write + its resume
    assert not [pid for pid in pids if faults._is_our_worker(pid)]

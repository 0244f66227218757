"""tfdp bench fitcalls: the figures are well-formed (no timing assertions) and usage errors are
one line."""

import json
import math

import pytest


def positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_run_fitcalls(run_process, tmp_path):
    """In a process of its own: MirroredStrategy's default CPU all-reduce (CollectiveAllReduce)
    reuses collective group keys across instances in one process, and a clash aborts the
    process's collective executor for every later test."""
    import os
    import subprocess
    import sys

    from tfdp_bench.fitcalls import format_fitcalls
    out = tmp_path / "fitcalls.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TFDP_CPU_REPLICAS", None)
    res = subprocess.run(
        [sys.executable, "-m", "tfdp", "bench", "fitcalls", "--cpu-replicas", "4",
         "--layers", "2", "--width", "8", "--batch", "16", "--steps", "2", "--val-steps", "1",
         "--epochs", "2", "--rounds", "1", "--calls", "1,2", "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=540)
    assert res.returncode == 0, res.stderr[-3000:]
    # quiet as tfdp's other commands: TF's load-time lines hidden at the level in effect (2)
    for noise in ("oneDNN custom operations", "absl::InitializeLog", "I0000 ", "W0000 "):
        assert noise not in res.stderr, res.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["results"]
    assert [r["kind"] for r in rows[:3]] == ["tfdp", "mirrored", "none"]
    assert {r["scenario"] for r in rows} == {"1 fit call", "2 fit calls",
                                             "fit, 2 epochs, validation_data"}
    for r in rows:
        assert positive(r["median_call_s"]) and positive(r["median_first_batch_s"])
        assert len(r["call_s"]) == r["calls_per_loop"]
        assert r["median_first_batch_s"] <= r["max_call_s"]
    assert {r["call_over_none"] for r in rows if r["kind"] == "none"} == {1.0}
    text = format_fitcalls(result)
    assert "call x none" in text and "tfdp 4 replicas" in text


@pytest.mark.parametrize("argv, needle", [
    (["--calls", "0"], "Invalid --calls"),
    (["--calls", "a,b"], "Invalid --calls"),
    (["--steps", "1"], "Invalid --steps"),
    (["--batch", "2", "--cpu-replicas", "4"], "Invalid --batch"),
    (["--input", "csv"], "invalid choice"),
])
def test_usage_errors(argv, needle):
    from tfdp_bench.fitcalls import parse_args
    from tfdp.errors import UsageError
    with pytest.raises(UsageError, match=needle) as e:
        parse_args(argv)
    assert "\n" not in str(e.value)


def test_registered():
    from tfdp_bench.cli import COMMANDS, help_text
    assert COMMANDS["fitcalls"][0] == "tfdp_bench.fitcalls"
    assert "fitcalls" in help_text()

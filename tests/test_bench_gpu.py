"""tfdp bench gpu: one line and exit 0 without a GPU; --cpu-dry-run runs every section's code.

The GPU itself cannot be tested here: --cpu-dry-run runs the same sections on 2 logical CPU
devices with tiny sizes, so every code path but the device placement is exercised. No timing
assertions.
"""

import json
import os
import subprocess
import sys

import pytest

from tfdp_bench import gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_gpu(*args, timeout=100, **extra_env):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               PYTHONUNBUFFERED="1", **extra_env)
    env.pop("TFDP_CPU_REPLICAS", None)
    return subprocess.run([sys.executable, "-m", "tfdp", "bench", "gpu", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_no_gpu_is_one_line_exit_0(run_process):
    res = run_gpu()
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert len(lines) == 1, res.stdout
    assert lines[0].startswith("tfdp bench gpu: no GPU here (") and "nothing to check" in lines[0]
    assert "Traceback" not in res.stderr


def test_no_gpu_reason_and_format():
    assert gpu.format_gpu_check({"gpu": False, "reason": "r"}) == (
        "tfdp bench gpu: no GPU here (r); nothing to check.")
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        assert "CUDA_VISIBLE_DEVICES" in gpu.no_gpu_reason()
    finally:
        if old is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def test_budget():
    b = gpu.Budget(0.0)
    assert b.spent() and b.left() <= 0
    assert not gpu.Budget(60).spent()


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_cpu_dry_run_runs_every_section(run_process, tmp_path):
    out = tmp_path / "gpu.json"
    res = run_gpu("--cpu-dry-run", "--json", str(out), timeout=580)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    for name in gpu.SECTIONS:
        assert f"gpu check: {name}" in res.stderr  # progress on stderr
    data = json.loads(out.read_text())
    assert data["dry_run"] and data["devices"]["kind"] == "cpu"
    assert len(data["devices"]["logical"]) == 2
    for name in gpu.SECTIONS:
        assert data["sections"][name]["error"] is None, data["sections"]
    rows = data["rows"]
    assert not [r for r in rows if r[2] in ("error", "skipped", "WRONG RESULT")], rows
    by = {}
    for section, item, result, _ in rows:
        by.setdefault(section, {})[item] = result
    assert by["nccl"]["NCCL kernel"] == "absent"  # tensorflow-cpu
    assert by["nccl"]["auto on 2 logical"] == "fused"
    (eq,) = by["equivalence"].values()
    assert eq.endswith("(ok)"), eq
    for contender in ("no strategy", "MirroredStrategy", "tfdp"):
        for label in (contender, contender + ", jit"):
            assert by["resnet50"][label].endswith(" images/s"), (label, by["resnet50"])
    # sharded optimizer state (issue 20): zero_stage 0, 1, 2 train and report memory per device
    assert set(by["zero"]) == {"workload", "zero_stage=0", "zero_stage=1", "zero_stage=2"}
    for stage in (0, 1, 2):
        assert by["zero"][f"zero_stage={stage}"].endswith(" images/s"), by["zero"]
    assert set(by["allreduce"]) == {"64K", "256K"}
    assert all(v.startswith("algbw ") for v in by["allreduce"].values())
    # the printed table has every section and the same rows
    text = res.stdout
    assert text.startswith("tfdp bench gpu --cpu-dry-run")
    for name in gpu.SECTIONS:
        assert f"\n{name} " in text, name


def test_sections_option_runs_only_those(run_process, tmp_path):
    out = tmp_path / "g.json"
    res = run_gpu("--cpu-dry-run", "--sections", "nccl", "--quiet", "--json", str(out),
                  timeout=200)
    assert res.returncode == 0, res.stderr[-2000:]
    data = json.loads(out.read_text())
    assert list(data["sections"]) == ["nccl"]
    assert {r[0] for r in data["rows"]} == {"nccl"}


def test_a_failing_section_keeps_the_others(monkeypatch, cpu_devices):
    """A section that raises shows its error in its row; the sections after it still run."""
    monkeypatch.setattr(gpu, "configure_devices", lambda dry_run: {
        "kind": "cpu", "logical": list(cpu_devices[:2]), "physical": 1, "memory_mb": None})

    def boom(env, budget):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(gpu, "section_equivalence", boom)
    result = gpu.run_gpu_check(dry_run=True, sections=("equivalence", "nccl"), progress=False)
    assert result["sections"]["equivalence"]["error"] == "RuntimeError: boom"
    assert "RuntimeError: boom" in result["sections"]["tracebacks"]["equivalence"]
    assert result["sections"]["nccl"]["error"] is None
    assert ["equivalence", "error", "RuntimeError: boom", "see --json for the traceback"] in \
        result["rows"]
    assert any(r[0] == "nccl" and r[1] == "auto on 2 logical" for r in result["rows"])
    text = gpu.format_gpu_check(result)
    assert "RuntimeError: boom" in text and "second line" not in text


def test_zero_section_rows(cpu_devices):
    """The zero section in this process on 2 CPU devices: a row per stage with images/s, the
    optimizer-state bytes and the peak memory of each device (no timing assertions)."""
    env = {"kind": "cpu", "logical": list(cpu_devices[:2]), "physical": 1, "memory_mb": None}
    rows = gpu.section_zero(env, gpu.Budget(300), dry_run=True)
    assert [r[1] for r in rows] == ["workload", "zero_stage=0", "zero_stage=1", "zero_stage=2"]
    assert all(r[0] == "zero" for r in rows)
    for _, item, result, detail in rows[1:]:
        assert result.endswith(" images/s"), (item, result, detail)
        assert "optimizer state per CPU: " in detail and "peak memory per CPU: " in detail
    assert "x zero_stage=0" in rows[2][3] and "x zero_stage=0" in rows[3][3]

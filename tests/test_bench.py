"""tfdp bench: the CLIs run end to end (subprocesses) and the figures are well-formed.

No timing assertions: only exit codes, output structure and that figures are positive numbers.
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable


def bench_env():
    env = dict(os.environ)
    env.update(TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.pop("TFDP_CPU_REPLICAS", None)
    return env


def run_bench(*args, timeout=240):
    return subprocess.run([PYTHON, "-m", "tfdp", "bench", *args], cwd=ROOT, env=bench_env(),
                          capture_output=True, text=True, timeout=timeout)


def bench_in_process(tfdp_cli, *args):
    """``tfdp bench ARGS`` in this process (the ``tfdp_cli`` fixture: a core-tier test; a usage
    error is found before any process or TensorFlow work starts), as a CompletedProcess.
    tests/test_bench_cli.py runs a usage error through the real ``python -m tfdp bench``."""
    code, out, err = tfdp_cli(["bench", *args])
    return subprocess.CompletedProcess(["tfdp", "bench", *args], code, out, err)


def positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# --- end to end ----------------------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.slow
def test_allreduce_sizes_cli(run_process, tmp_path):
    out, png = tmp_path / "ar.json", tmp_path / "busbw.png"
    res = run_bench("allreduce", "--model", "sizes", "--sizes", "1K,64K", "--repeats", "2",
                    "--cpu-replicas", "2", "--json", str(out), "--plot", str(png))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert "round 2/2" in res.stderr  # progress lines go to stderr
    assert "MS/this" in res.stdout and "busbw GB/s" in res.stdout
    assert "CollectiveAllReduce" in res.stdout  # which cross_device_ops MirroredStrategy used

    data = json.loads(out.read_text())
    for key in ("benchmark", "cpu_replicas", "devices", "model", "repeats",
                "mirrored_cross_device_ops", "contenders", "workloads", "environment"):
        assert key in data
    assert data["benchmark"] == "allreduce" and data["cpu_replicas"] == 2
    assert len(data["devices"]) == 2 and data["repeats"] == 2
    names = [c["name"] for c in data["contenders"]]
    kinds = [c["kind"] for c in data["contenders"]]
    assert kinds.count("tfdp") == 3 and kinds.count("mirrored") == 2 and kinds.count("numpy") == 1
    assert {c["algorithm"] for c in data["contenders"] if c["kind"] == "tfdp"} == {
        "fused", "ring", "one_device"}
    assert [w["bytes"] for w in data["workloads"]] == [1024, 65536]
    for w in data["workloads"]:
        assert w["tensors"] == 1
        assert [r["contender"] for r in w["results"]] == names
        for r in w["results"]:
            assert len(r["times_s"]) == 2 and all(positive(t) for t in r["times_s"])
            for key in ("median_s", "min_s", "algbw_gbps", "busbw_gbps",
                        "ratio_mirrored_over_this", "ratio_mirrored_one_device_over_this"):
                assert positive(r[key]), (key, r)
            assert r["min_s"] <= r["median_s"]
            assert r["iters_per_sample"] >= 1
        default_ms = [r for r, c in zip(w["results"], data["contenders"]) if c.get("default")]
        assert len(default_ms) == 1 and default_ms[0]["ratio_mirrored_over_this"] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_fit_cli(run_process, tmp_path):
    out = tmp_path / "fit.json"
    res = run_bench("fit", "--layers", "3", "--steps", "3", "--repeats", "1",
                    "--cpu-replicas", "2", "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert "tfdp / MirroredStrategy" in res.stdout
    data = json.loads(out.read_text())
    for key in ("benchmark", "cpu_replicas", "layers", "width", "batch", "steps", "repeats",
                "results", "ratio_tfdp_over_mirrored", "mirrored_cross_device_ops",
                "environment"):
        assert key in data
    assert data["benchmark"] == "fit" and data["layers"] == 3 and data["gradient_tensors"] == 6
    assert [r["kind"] for r in data["results"]] == ["tfdp", "mirrored", "single"]
    assert [r["replicas"] for r in data["results"]] == [2, 2, 1]
    for r in data["results"]:
        assert len(r["fit_s"]) == 1
        for key in ("median_fit_s", "median_examples_per_s", "best_examples_per_s",
                    "steady_median_step_ms", "steady_examples_per_s", "ratio_over_mirrored"):
            assert positive(r[key]), (key, r)
        assert len(r["teardown_s"]) == 1 and r["teardown_s"][0] >= 0
        assert len(r["steady_step_s"]) == 2  # 3 steps: the first of the fit is excluded
        assert r["finite_loss"]
    assert positive(data["ratio_tfdp_over_mirrored"])


# --- usage --------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", [
    (["allreduce", "--cpu-replicas", "0"], "--cpu-replicas"),
    (["allreduce", "--repeats", "0"], "--repeats"),
    (["allreduce", "--algorithms", "fused,nccl"], "--algorithms"),
    (["allreduce", "--sizes", "1X"], "--sizes"),
    (["allreduce", "--sizes", "2"], "--sizes"),
    (["allreduce", "--model", "resnet50", "--sizes", "1K"], "--sizes"),
    (["allreduce", "--model", "vgg"], "--model"),
    (["allreduce", "--bucket-bytes", "-1"], "--bucket-bytes"),
    (["allreduce", "--json", "/nonexistent-dir/x.json"], "--json"),
    (["allreduce", "--bogus"], "--bogus"),
    (["fit", "--cpu-replicas", "0"], "--cpu-replicas"),
    (["fit", "--steps", "0"], "--steps"),
    (["fit", "--batch", "2", "--cpu-replicas", "4"], "--batch"),
    (["fit", "--all-reduce", "rnig"], "--all-reduce"),
    (["frobnicate"], "frobnicate"),
])
def test_usage_errors_are_one_line_exit_2(tfdp_cli, args, needle):
    res = bench_in_process(tfdp_cli, *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert lines[0].startswith("tfdp bench: error: ")
    assert needle in lines[0]


@pytest.mark.timeout(120)
def test_help(tfdp_cli):
    res = bench_in_process(tfdp_cli, "--help")
    assert res.returncode == 0 and "usage: tfdp bench" in res.stdout
    assert "allreduce" in res.stdout and "fit" in res.stdout
    res = bench_in_process(tfdp_cli)
    assert res.returncode == 2 and "usage: tfdp bench" in res.stdout
    for cmd in ("allreduce", "fit"):
        res = bench_in_process(tfdp_cli, cmd, "--help")
        assert res.returncode == 0, res.stderr
        assert f"tfdp bench {cmd}" in res.stdout and "--cpu-replicas" in res.stdout


# --- in process ---------------------------------------------------------------------------------

def test_workload_shapes():
    import numpy as np

    from tfdp_bench.allreduce import mlp_shapes, resnet50_shapes, workloads_for
    shapes = resnet50_shapes()
    assert len(shapes) == 214
    assert sum(int(np.prod(s)) for s in shapes) == 25_583_592
    assert len(mlp_shapes()) == 120 and set(mlp_shapes()) == {(64, 64), (64,)}
    ws = workloads_for("sizes", ["1K", "6"])
    assert [w["shapes"] for w in ws] == [[(256,)], [(1,)]]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_resnet50_shapes_match_keras():
    import keras

    from tfdp_bench.allreduce import resnet50_shapes
    model = keras.applications.ResNet50(weights=None)
    assert [tuple(v.shape) for v in model.trainable_variables] == resnet50_shapes()


def test_all_reduce_names_match_registry():
    from tfdp_bench.parser import all_reduce_names
    from tfdp.reduce.registry import ALGORITHMS
    assert tuple(ALGORITHMS) == all_reduce_names()


def test_helpers():
    from tfdp_bench import _common
    from tfdp.errors import UsageError
    assert _common.parse_size("1K") == 1024
    assert _common.parse_size("64m") == 64 * 1024 ** 2
    assert _common.parse_size("4096") == 4096
    assert _common.parse_size("2KiB") == 2048
    with pytest.raises(UsageError, match="Received: --sizes='1X'"):
        _common.parse_size("1X", name="--sizes", cls=UsageError)
    assert _common.fmt_bytes(4 * 1024 ** 2) == "4M" and _common.fmt_bytes(12) == "12B"
    assert _common.round_order(3, 0) == [0, 1, 2] and _common.round_order(3, 1) == [2, 1, 0]
    table = _common.render_table(["a", "bb"], [["x", 1], None, ["yyy", 22]])
    assert table.splitlines() == ["a    bb", "---  --", "x     1", "", "yyy  22"]


@pytest.mark.timeout(120)
def test_run_allreduce_in_process(cpu_devices):
    """The importable API on the test process's 4 CPU replicas (configured by conftest)."""
    from tfdp_bench import format_allreduce, run_allreduce
    result = run_allreduce(cpu_replicas=len(cpu_devices), model="sizes", sizes=[4096],
                           algorithms=["fused"], bucket_bytes=[0, 1024], repeats=1)
    (w,) = result["workloads"]
    assert [r["contender"] for r in w["results"]][:2] == ["tfdp fused b=0", "tfdp fused b=1K"]
    assert all(positive(r["median_s"]) for r in w["results"])
    json.dumps(result)  # serialisable
    assert "tfdp fused b=1K" in format_allreduce(result)

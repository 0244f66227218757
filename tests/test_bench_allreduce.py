"""`tfdp bench allreduce`: --workers N, --compression, memory / TCP references, JSON and plot.

End-to-end runs are subprocesses of the real CLI. No timing assertions: only structure (every
contender x size present, positive figures) and consistency (busbw = algbw * 2(n-1)/n).
"""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(*args, timeout=240):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               PYTHONUNBUFFERED="1")
    for var in ("TFDP_CPU_REPLICAS", "TF_CONFIG"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "tfdp", "bench", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def bench_in_process(tfdp_cli, *args):
    """``tfdp bench ARGS`` in this process (the ``tfdp_cli`` fixture: a core-tier test; a usage
    error is found before any process or TensorFlow work starts), as a CompletedProcess.
    tests/test_bench_cli.py runs a usage error through the real ``python -m tfdp bench``."""
    code, out, err = tfdp_cli(["bench", *args])
    return subprocess.CompletedProcess(["tfdp", "bench", *args], code, out, err)


def positive(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_rows(data, n):
    """Every contender at every size, positive figures, busbw = algbw * 2(n-1)/n."""
    names = [c["name"] for c in data["contenders"]]
    assert len(set(names)) == len(names)
    for w in data["workloads"]:
        assert [r["contender"] for r in w["results"]] == names
        for r in w["results"]:
            assert r["times_s"] and all(positive(t) for t in r["times_s"])
            for key in ("median_s", "min_s", "algbw_gbps", "busbw_gbps"):
                assert positive(r[key]), (key, r)
            assert r["min_s"] <= r["median_s"] <= r["max_s"]
            assert r["algbw_gbps"] == pytest.approx(w["bytes"] / r["median_s"] / 1e9, rel=1e-9)
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (n - 1) / n,
                                                    rel=1e-9)
            if r["kind"] == "memory":
                assert r["memory_traffic_gbps"] == pytest.approx(3 * r["algbw_gbps"])


# --- usage --------------------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", [
    (["--workers", "2", "--cpu-replicas", "2"], "mutually exclusive"),
    (["--cpu-replicas", "2", "--workers", "3"], "--workers"),
    (["--workers", "1"], "--workers"),
    (["--workers", "0"], "--workers"),
    (["--workers", "two"], "--workers"),
    (["--workers", "2", "--model", "resnet50"], "--model"),
    (["--workers", "2", "--rounds", "0"], "--rounds"),
    (["--workers", "2", "--tensors", "0"], "--tensors"),
    (["--workers", "2", "--timeout", "0"], "--timeout"),
    (["--workers", "2", "--sizes", "1Q"], "--sizes"),
    (["--compression", "fp8"], "--compression"),
    (["--compression", ","], "--compression"),
    (["--workers", "2", "--compression", "none,int8"], "--compression"),
    (["--workers", "2", "--algorithms", "nccl"], "--algorithms"),
])
def test_allreduce_usage_errors(tfdp_cli, args, needle):
    res = bench_in_process(tfdp_cli, "allreduce", *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("tfdp bench: error: ") and needle in lines[0]
    assert "Traceback" not in res.stderr


@pytest.mark.timeout(120)
def test_allreduce_help_lists_new_options(tfdp_cli):
    res = bench_in_process(tfdp_cli, "allreduce", "--help")
    assert res.returncode == 0, res.stderr
    for opt in ("--workers", "--cpu-replicas", "--compression", "--rounds", "--plot", "--json"):
        assert opt in res.stdout


# --- local mode ---------------------------------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.slow
def test_local_sizes_with_compression(run_process, tmp_path):
    out = tmp_path / "ar.json"
    res = run_bench("allreduce", "--sizes", "1K,64K", "--compression", "none,fp16",
                    "--cpu-replicas", "2", "--repeats", "2", "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "round 2/2" in res.stderr
    assert " s] allreduce" in res.stderr  # progress lines carry the elapsed time
    data = json.loads(out.read_text())
    assert data["mode"] == "local" and data["compression"] == ["none", "fp16"]
    assert [w["bytes"] for w in data["workloads"]] == [1024, 65536]
    tfdp = [c for c in data["contenders"] if c["kind"] == "tfdp"]
    assert {(c["algorithm"], c["compression"]) for c in tfdp} == {
        (a, comp) for a in ("fused", "ring", "one_device") for comp in (None, "fp16")}
    assert len(tfdp) == 6
    kinds = [c["kind"] for c in data["contenders"]]
    assert kinds.count("mirrored") == 2 and kinds.count("numpy") == 1
    assert kinds.count("memory") == 1
    check_rows(data, 2)
    for line in ("tfdp fused b=1M fp16", "memory (np.add"):
        assert line in res.stdout


# --- across workers -----------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.slow
def test_workers_tiny_run(run_process, tmp_path):
    out, png = tmp_path / "w.json", tmp_path / "w.png"
    res = run_bench("allreduce", "--workers", "2", "--sizes", "4K", "--repeats", "2",
                    "--json", str(out), "--plot", str(png), timeout=110)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert "Traceback" not in res.stderr
    # progress on stderr: per job and size, with the elapsed time
    assert "tfdp fused (2 workers) starting" in res.stderr and " s]   tfdp fused: 4K" in res.stderr
    assert "MWMS/this" in res.stdout and "busbw GB/s" in res.stdout

    data = json.loads(out.read_text())
    assert data["mode"] == "workers" and data["workers"] == 2 and data["repeats"] == 2
    kinds = [c["kind"] for c in data["contenders"]]
    assert kinds == ["tfdp", "mwms", "memory", "tcp"]
    tfdp, mwms = data["contenders"][:2]
    assert tfdp["algorithm"] == "fused" and tfdp["compression"] is None
    assert tfdp["replicas"] == mwms["replicas"] == 2
    assert data["baseline"] == mwms["name"] and mwms["name"].startswith("MWMS ")
    (w,) = data["workloads"]
    assert w["bytes"] == 4096 and w["tensors"] == 1
    check_rows(data, 2)
    for r in w["results"]:
        assert len(r["times_s"]) == 2  # --repeats samples x 1 round
        if r["kind"] in ("tfdp", "mwms"):
            assert positive(r["ratio_mwms_over_this"])
    assert next(r for r in w["results"] if r["kind"] == "mwms")["ratio_mwms_over_this"] == 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_job_specs_and_tcp_reference():
    """Contender naming per algorithm x compression, and the TCP/memory references (no TF)."""
    from tfdp_bench import workers
    specs = workers.job_specs(["fused", "ring"], [None], [None, "fp16"])
    assert [s["name"] for s in specs] == ["tfdp fused", "tfdp fused fp16", "tfdp ring",
                                          "tfdp ring fp16", "MultiWorkerMirroredStrategy"]
    # compressions of one algorithm share a job (their samples alternate); MWMS has its own
    jobs = workers.jobs_of(specs)
    assert [[v["name"] for v in j["variants"]] for j in jobs] == [
        ["tfdp fused", "tfdp fused fp16"], ["tfdp ring", "tfdp ring fp16"],
        ["MultiWorkerMirroredStrategy"]]
    assert [v["compression"] for v in jobs[0]["variants"]] == [None, "fp16"]
    assert jobs[2]["kind"] == "mwms" and jobs[0]["name"] == "tfdp fused + tfdp fused fp16"
    assert workers._split_counts(4096, 3) == [341, 341, 342]
    assert workers._split_counts(4, 8) == [1]
    refs = workers.measure_references([4096, 1 << 20], repeats=2)
    for key in ("memory", "tcp"):
        assert len(refs[key]) == 2 and all(positive(t) for s in refs[key] for t in s)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, needle", [
    (["--workers", "1"], "--workers"),
    (["--contenders", "tfdp,nope"], "--contenders"),
    (["--size", "1Q"], "--size"),
])
def test_workers_alias_usage_errors(tfdp_cli, args, needle):
    res = bench_in_process(tfdp_cli, "workers", *args)
    assert res.returncode == 2, (res.stdout, res.stderr)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr

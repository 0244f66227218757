"""tfdp bench scaling: the alpha-beta ring model, the fit, and the CLI (no --measure: too slow).

No timing assertions.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from jobs import standalone_in_process
from tfdp_bench import scaling
from tfdp.errors import TfdpError, UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable

S = 100e6          # 100 MB
B = 10e9 / 8       # 10 Gbit/s in bytes/s
ALPHA = 5e-6       # 5 us


def run_scaling(*args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([PYTHON, "-m", "tfdp_bench.scaling", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


# --- the formula ----------------------------------------------------------------------------------

def test_one_device_has_no_communication():
    assert scaling.ring_allreduce_time(1, S, B, ALPHA) == 0.0


def test_two_devices_hand_computed():
    # 2(n-1)/n = 1 and 2(n-1) = 2: S/B + 2 alpha = 0.08 s + 10 us.
    assert scaling.ring_allreduce_time(2, S, B, ALPHA) == pytest.approx(S / B + 2 * ALPHA)
    assert scaling.ring_allreduce_time(2, S, B, ALPHA) == pytest.approx(0.08001)
    # n = 4: 1.5 S/B + 6 alpha.
    assert scaling.ring_allreduce_time(4, S, B, ALPHA) == pytest.approx(0.12 + 30e-6)


def test_large_n_tends_to_twice_s_over_b():
    n = 10 ** 6
    assert scaling.ring_allreduce_time(n, S, B, 0.0) == pytest.approx(2 * S / B, rel=1e-5)
    # with latency, the bandwidth term still tends to 2S/B and the rest is 2(n-1) alpha
    t = scaling.ring_allreduce_time(n, S, B, ALPHA)
    assert t - 2 * (n - 1) * ALPHA == pytest.approx(2 * S / B, rel=1e-5)


def test_predict_rows():
    rows = scaling.predict(0.1, S, B, ALPHA)
    assert [r["n"] for r in rows] == [2 ** i for i in range(11)]
    first, second = rows[0], rows[1]
    assert first["t_comm"] == 0 and first["t_step"] == 0.1
    assert first["efficiency"] == 1.0 and first["speedup"] == 1.0
    assert second["t_step"] == pytest.approx(0.1 + 0.08001)
    assert second["efficiency"] == pytest.approx(0.1 / 0.18001)
    for r in rows:
        assert r["speedup"] == pytest.approx(r["n"] * r["efficiency"])
        assert r["t_step"] == pytest.approx(0.1 + r["t_comm"])


def test_overlap():
    half = scaling.predict(0.1, S, B, ALPHA, devices=[2], overlap=0.5)[0]
    assert half["t_step"] == pytest.approx(0.1 + 0.5 * 0.08001)
    full = scaling.predict(0.1, S, B, ALPHA, devices=[2, 1024], overlap=1.0)
    assert all(r["efficiency"] == 1.0 for r in full)
    with pytest.raises(ValueError):
        scaling.predict(0.1, S, B, ALPHA, overlap=1.5)


@pytest.mark.parametrize("alpha", [0.0, 5e-6, 1e-3])
@pytest.mark.parametrize("overlap", [0.0, 0.7])
def test_efficiency_monotone_non_increasing(alpha, overlap):
    rows = scaling.predict(0.05, S, B, alpha, devices=range(1, 1025), overlap=overlap)
    effs = [r["efficiency"] for r in rows]
    assert all(b <= a for a, b in zip(effs, effs[1:]))
    assert 0 < effs[-1] <= effs[0] == 1.0


# --- the fit --------------------------------------------------------------------------------------

def _synthetic(alpha, bw, noise=0.0):
    pts = []
    for i, n in enumerate((2, 3, 4, 8)):
        for j, size in enumerate((256 << 10, 4 << 20, 16 << 20)):
            t = scaling.ring_allreduce_time(n, size, bw, alpha)
            wobble = 1 + noise * math.sin(7 * i + 3 * j)  # deterministic "noise"
            pts.append((n, size, t * wobble))
    return pts


@pytest.mark.parametrize("alpha,bw", [(5e-6, 1.25e9), (3e-3, 0.17e9), (0.0, 12.5e9)])
def test_fit_recovers_alpha_and_bandwidth(alpha, bw):
    a, b = scaling.fit_alpha_beta(_synthetic(alpha, bw))
    assert a == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert b == pytest.approx(bw, rel=1e-6)
    a, b = scaling.fit_alpha_beta(_synthetic(alpha, bw), relative=False)
    assert a == pytest.approx(alpha, rel=1e-6, abs=1e-12)
    assert b == pytest.approx(bw, rel=1e-6)


def test_fit_with_noise_is_close():
    a, b = scaling.fit_alpha_beta(_synthetic(1e-3, 1e9, noise=0.02))
    assert a == pytest.approx(1e-3, rel=0.15)
    assert b == pytest.approx(1e9, rel=0.1)


def test_fit_ignores_single_device_points_and_rejects_too_few():
    pts = _synthetic(1e-4, 1e9) + [(1, 1 << 20, 0.5)]
    a, b = scaling.fit_alpha_beta(pts)
    assert a == pytest.approx(1e-4) and b == pytest.approx(1e9)
    with pytest.raises(TfdpError, match="Too few"):
        scaling.fit_alpha_beta([(2, 1 << 20, 0.01), (1, 1 << 20, 0.01)])
    with pytest.raises(TfdpError, match="collinear"):
        scaling.fit_alpha_beta([(2, 1 << 20, 0.01), (2, 1 << 20, 0.012)])


def test_fit_clamps_negative_alpha():
    # times that shrink super-linearly for small sizes would give alpha < 0: clamp to 0
    pts = [(2, 1e6, 0.0005), (2, 1e7, 0.01), (4, 1e7, 0.015)]
    a, b = scaling.fit_alpha_beta(pts)
    assert a == 0.0 and b > 0


# --- the command line -----------------------------------------------------------------------------

def test_cli_table(run_process, tmp_path):
    out = tmp_path / "s.json"
    res = run_scaling("--step-ms", "100", "--grad-mb", "100", "--bandwidth-gbps", "10",
                      "--alpha-us", "5", "--json", str(out))
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    text = res.stdout
    assert "2(n-1)/n * S/B + 2(n-1)*alpha" in text
    assert "efficiency %" in text and "speed-up" in text and "comm ms" in text
    lines = [ln.split() for ln in text.splitlines() if ln.split() and ln.split()[0].isdigit()]
    assert [int(r[0]) for r in lines] == [2 ** i for i in range(11)]
    assert lines[0][1:] == ["0.00", "100.00", "100.0", "1.0"]
    assert lines[1][1:3] == ["80.01", "180.01"]          # S/B + 2 alpha = 80 ms + 10 us
    data = json.loads(out.read_text())
    assert data["bandwidth_Bps"] == pytest.approx(1.25e9) and data["alpha_s"] == 5e-6
    assert len(data["rows"]) == 11 and data["rows"][-1]["n"] == 1024


def test_cli_max_devices(run_process):
    res = run_scaling("--step-ms", "10", "--grad-mb", "25", "--bandwidth-gbps", "100",
                      "--alpha-us", "0", "--max-devices", "6")
    assert res.returncode == 0, res.stderr
    ns = [int(ln.split()[0]) for ln in res.stdout.splitlines()
          if ln.split() and ln.split()[0].isdigit()]
    assert ns == [1, 2, 4, 6]


def test_cli_usage_error_through_the_real_entry_point(run_process):
    """``python -m tfdp_bench.scaling`` itself (a process, as a user runs it); the other usage
    errors run in this process (below)."""
    res = run_scaling("--step-ms", "0", "--grad-mb", "1", "--bandwidth-gbps", "1",
                      "--alpha-us", "1")
    assert res.returncode == 2, (res.stdout, res.stderr)
    err = res.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("tfdp bench scaling: error:") and "--step-ms" in err
    assert res.stdout == ""


@pytest.mark.parametrize("args,needle", [
    (["--step-ms", "1", "--grad-mb", "-5", "--bandwidth-gbps", "1", "--alpha-us", "1"],
     "--grad-mb"),
    (["--step-ms", "1", "--grad-mb", "1", "--bandwidth-gbps", "nan", "--alpha-us", "1"],
     "--bandwidth-gbps"),
    (["--step-ms", "1", "--grad-mb", "1", "--bandwidth-gbps", "1", "--alpha-us", "-1"],
     "--alpha-us"),
    (["--step-ms", "1", "--grad-mb", "1", "--bandwidth-gbps", "1", "--alpha-us", "1",
      "--overlap", "1.5"], "--overlap"),
    (["--step-ms", "1", "--grad-mb", "1", "--bandwidth-gbps", "1", "--alpha-us", "1",
      "--max-devices", "0"], "--max-devices"),
    (["--step-ms", "100"], "Missing"),
    (["--step-ms", "abc"], "invalid float"),
    (["--measure", "--bandwidth-gbps", "10"], "--measure"),
    (["--measure", "--measure-workers", "1,2"], "--measure-workers"),
    (["--measure", "--measure-sizes", "4M"], "--measure-sizes"),
])
def test_cli_usage_errors(monkeypatch, capsys, args, needle):
    code, out, err = standalone_in_process(monkeypatch, capsys, "tfdp_bench.scaling", *args)
    assert code == 2, (out, err)
    err = err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("tfdp bench scaling: error:") and needle in err
    assert out == ""


def test_main_raises_usage_error_in_process():
    with pytest.raises(UsageError):
        scaling.main(["--step-ms", "1", "--grad-mb", "1", "--bandwidth-gbps", "1",
                      "--alpha-us", "1", "--overlap", "-0.1"])

"""Tests for ``tfdp launch`` (tfdp.launch): no TensorFlow, children are tiny Python programs."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # make tfdp importable when it is not pip-installed
    sys.path.insert(0, ROOT)

from tfdp.errors import UsageError  # noqa: E402
from tfdp.launch import launch, make_tf_configs  # noqa: E402
from tfdp.launch.cli import parse_args  # noqa: E402

pytestmark = [pytest.mark.timeout(60), pytest.mark.multiprocess]

RANK = "int(os.environ['TFDP_WORKER_RANK'])"


def py(code):
    """A worker command running ``code`` (with os, sys, time imported)."""
    return [sys.executable, "-c", "import os, sys, time\n" + textwrap.dedent(code)]


def base_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "TF_CONFIG")}
    env.update(extra)
    return env


def run_launch(cmd, workers, **kwargs):
    """Run launch() in-process; return (exit code, stdout text, stderr text, seconds)."""
    out, err = io.StringIO(), io.StringIO()
    kwargs.setdefault("env", base_env())
    start = time.monotonic()
    code = launch(cmd, workers, stdout=out, stderr=err, **kwargs)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


def run_cli(*args, timeout=30):
    """Run ``python -m tfdp launch ARGS`` as a subprocess."""
    return subprocess.run([sys.executable, "-m", "tfdp", "launch", *args], cwd=ROOT,
                          env=base_env(), capture_output=True, text=True, timeout=timeout)


def by_worker(text):
    """{rank: [line, ...]} from prefixed output; every line must carry a prefix."""
    lines = {}
    for line in text.splitlines():
        assert line.startswith("[worker "), line
        tag, _, rest = line.partition("] ")
        lines.setdefault(int(tag[len("[worker "):]), []).append(rest)
    return lines


def test_make_tf_configs():
    configs = make_tf_configs(3)
    addrs = configs[0]["cluster"]["worker"]
    assert len(addrs) == 3 and len({a.split(":")[1] for a in addrs}) == 3
    for i, c in enumerate(configs):
        assert c == {"cluster": {"worker": addrs}, "task": {"type": "worker", "index": i}}
        assert all(a.startswith("127.0.0.1:") for a in c["cluster"]["worker"])
    with pytest.raises(UsageError, match="loopback"):
        make_tf_configs(2, host="0.0.0.0")


@pytest.mark.parametrize("workers", [2, 3])
def test_output_is_prefixed_per_stream(workers):
    code, out, err, _ = run_launch(py(f"""
        r = {RANK}
        print("out a", r); print("out b", r)
        print("err", r, file=sys.stderr)
        sys.stdout.flush()
        os.write(1, b"bad \\xff bytes\\npartial " + str(r).encode())
        """), workers)
    assert code == 0, err
    out_lines, err_lines = by_worker(out), by_worker(err)
    for r in range(workers):
        assert out_lines[r] == [f"out a {r}", f"out b {r}", "bad \ufffd bytes", f"partial {r}"]
        assert err_lines[r] == [f"err {r}"]


def test_worker_environment():
    code, out, err, _ = run_launch(py("""
        import json
        keys = ["TF_CONFIG", "TFDP_WORKER_RANK", "TFDP_NUM_WORKERS", "TFDP_CPU_REPLICAS",
                "TFDP_RESTART_COUNT", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED"]
        print(json.dumps({k: os.environ.get(k) for k in keys}))
        """), 2, cpu_replicas=4, gpus_per_worker=2,
        env=base_env(CUDA_VISIBLE_DEVICES="3,4,5,6,7"))
    assert code == 0, err
    envs = {r: json.loads(lines[0]) for r, lines in by_worker(out).items()}
    configs = [json.loads(envs[r]["TF_CONFIG"]) for r in range(2)]
    addrs = configs[0]["cluster"]["worker"]
    assert len(addrs) == 2 and len(set(addrs)) == 2
    assert all(a.startswith("127.0.0.1:") for a in addrs)
    for r in range(2):
        assert configs[r] == {"cluster": {"worker": addrs}, "task": {"type": "worker", "index": r}}
        assert envs[r]["TFDP_WORKER_RANK"] == str(r)
        assert envs[r]["TFDP_NUM_WORKERS"] == "2"
        assert envs[r]["TFDP_CPU_REPLICAS"] == "4"
        assert envs[r]["TFDP_RESTART_COUNT"] == "0"
        assert envs[r]["PYTHONUNBUFFERED"] == "1"
    assert [envs[r]["CUDA_VISIBLE_DEVICES"] for r in range(2)] == ["3,4", "5,6"]


def test_gpu_split_without_cuda_visible_devices_and_single_worker():
    cmd = py("print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ.get('TF_CONFIG'))")
    code, out, err, _ = run_launch(cmd, 3, gpus_per_worker=1)
    assert code == 0, err
    assert {r: lines[0].split()[0] for r, lines in by_worker(out).items()} == \
        {0: "0", 1: "1", 2: "2"}
    # One worker: no TF_CONFIG (an inherited one is dropped); G=0 hides all GPUs.
    code, out, err, _ = run_launch(cmd, 1, gpus_per_worker=0,
                                   env=base_env(TF_CONFIG="{}", CUDA_VISIBLE_DEVICES="0"))
    assert code == 0, err
    assert out == "[worker 0]  None\n"
    with pytest.raises(UsageError, match="More GPUs requested than visible"):
        launch(cmd, 2, gpus_per_worker=2, env=base_env(CUDA_VISIBLE_DEVICES="0,1,2"))


def test_failure_stops_the_other_workers():
    code, out, err, secs = run_launch(py(f"""
        if {RANK} == 1:
            time.sleep(0.2); sys.exit(3)
        time.sleep(60)
        """), 2)
    assert code == 3
    assert secs < 10
    assert "tfdp launch: worker 1 (127.0.0.1:" in err
    assert "failed with exit code 3; stopped the other workers" in err


def test_sigkill_after_grace_when_sigterm_is_ignored():
    code, _, err, secs = run_launch(py(f"""
        import signal
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if {RANK} == 1:
            time.sleep(1); sys.exit(200)
        time.sleep(60)
        """), 2)
    assert code == 1  # exit codes outside 1..125 become 1
    assert 2 < secs < 15
    assert "worker 1 (127.0.0.1:" in err and "failed with exit code 200" in err


def test_worker_killed_by_signal():
    code, _, err, secs = run_launch(py(f"""
        if {RANK} == 1:
            os.kill(os.getpid(), 9)
        time.sleep(60)
        """), 2)
    assert code == 1 and secs < 10
    assert "worker 1 (127.0.0.1:" in err and "was killed by signal SIGKILL" in err


def test_timeout():
    code, _, err, secs = run_launch(py("time.sleep(60)"), 2, timeout=1)
    assert code == 124 and secs < 10
    assert "tfdp launch: timed out after 1 s" in err


def test_max_restarts():
    cmd = py(f"""
        print(os.environ["TF_CONFIG"])
        if os.environ["TFDP_RESTART_COUNT"] == "0" and {RANK} == 1:
            sys.exit(5)
        """)
    code, out, err, _ = run_launch(cmd, 2, max_restarts=2)
    assert code == 0, err
    assert "tfdp launch: restarting all workers (restart 1 of 2)" in err
    assert "restart 2 of 2" not in err
    # Failing every time: R restarts, then the failure's exit code.
    code, _, err, _ = run_launch(py("sys.exit(5)"), 2, max_restarts=1)
    assert code == 5
    assert err.count("failed with exit code 5") == 2
    assert "restarting all workers (restart 1 of 1)" in err


@pytest.mark.parametrize("sig,expected", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_is_forwarded(sig, expected):
    cmd = py("print(os.getpid(), flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-m", "tfdp", "launch", "--workers", "2", "--",
                                 *cmd], cwd=ROOT, env=base_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        pids = [int(launcher.stdout.readline().split()[-1]) for _ in range(2)]
        launcher.send_signal(sig)
        start = time.monotonic()
        assert launcher.wait(timeout=20) == expected
        assert time.monotonic() - start < 10
        assert f"received {sig.name}; stopped all workers" in launcher.stderr.read()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_cli_runs_command_without_double_dash():
    res = run_cli("--workers", "2", sys.executable, "-c", "print('hi')")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[worker 0] hi", "[worker 1] hi"]


def test_cli_help():
    res = run_cli("--help")
    assert res.returncode == 0
    assert "--workers N" in res.stdout and "unauthenticated" in res.stdout


def test_parse_args_command_boundaries():
    args = parse_args(["--workers", "2", "--", "-x", "--help"])
    assert args.command == ["-x", "--help"] and not args.help
    args = parse_args(["--workers", "2", "prog", "-h", "--", "--y"])
    assert args.command == ["prog", "-h", "--", "--y"]


@pytest.mark.parametrize("args,needle", [
    ([], "Missing --workers"),
    (["--workers", "0", "--", "true"], "--workers=0"),
    (["--workers", "-2", "true"], "--workers=-2"),
    (["--workers", "two", "true"], "invalid int value"),
    (["--workers", "2"], "No command"),
    (["--workers", "2", "--", "no-such-program-xyz"], "Program not found"),
    (["--workers", "2", "--", "./no/such/file"], "Program not found"),
    (["--workers", "2", "--cpu-replicas", "0", "true"], "--cpu-replicas=0"),
    (["--workers", "2", "--gpus-per-worker", "-1", "true"], "--gpus-per-worker=-1"),
    (["--workers", "2", "--max-restarts", "-1", "true"], "--max-restarts=-1"),
    (["--workers", "2", "--timeout", "0", "true"], "--timeout=0"),
    (["--workers", "2", "--host", "0.0.0.0", "true"], "loopback"),
    (["--workers", "2", "--bogus", "true"], "Unrecognized arguments"),
])
def test_cli_usage_errors(args, needle):
    res = run_cli(*args)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdp launch: error: ")
    assert needle in lines[0]
    assert res.stdout == ""


def test_cli_too_many_gpus():
    res = subprocess.run([sys.executable, "-m", "tfdp", "launch", "--workers", "2",
                          "--gpus-per-worker", "2", "true"], cwd=ROOT,
                         env=base_env(CUDA_VISIBLE_DEVICES="0,1"), capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "More GPUs requested than visible" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_api_usage_errors():
    with pytest.raises(UsageError, match="No command"):
        launch([], 2)
    with pytest.raises(UsageError, match="workers=0"):
        launch(["true"], 0)

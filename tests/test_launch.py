"""Tests for ``tfdp launch`` (tfdp.launch): no TensorFlow, children are tiny Python programs."""

import io
import re
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

pytestmark = [pytest.mark.timeout(60)]

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


def run_cli(*args, timeout=30, env=None):
    """Run ``python -m tfdp launch ARGS`` as a subprocess."""
    return subprocess.run([sys.executable, "-m", "tfdp", "launch", *args], cwd=ROOT,
                          env=env or base_env(), capture_output=True, text=True, timeout=timeout)


def cli_in_process(tfdp_cli, *args):
    """``tfdp launch ARGS`` in this process (the ``tfdp_cli`` fixture, a core-tier test), as a
    ``subprocess.CompletedProcess``-like result (returncode, stdout, stderr). A usage error is
    found before any worker starts; a case that got past it would start one, which the guard of
    tests/conftest.py fails."""
    code, out, err = tfdp_cli(["launch", *args])
    return subprocess.CompletedProcess(["tfdp", "launch", *args], code, out, err)


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
def test_output_is_prefixed_per_stream(run_process, workers):
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


def test_worker_environment(run_process):
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


def test_gpu_split_without_cuda_visible_devices_and_single_worker(run_process):
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


def test_failure_stops_the_other_workers(run_process):
    code, out, err, secs = run_launch(py(f"""
        if {RANK} == 1:
            time.sleep(0.2); sys.exit(3)
        time.sleep(60)
        """), 2)
    assert code == 3
    assert secs < 10
    assert "tfdp launch: worker 1 (127.0.0.1:" in err
    assert "failed with exit code 3; stopped the other workers" in err


def test_sigkill_after_grace_when_sigterm_is_ignored(run_process):
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


def test_worker_killed_by_signal(run_process):
    code, _, err, secs = run_launch(py(f"""
        if {RANK} == 1:
            os.kill(os.getpid(), 9)
        time.sleep(60)
        """), 2)
    assert code == 1 and secs < 10
    assert "worker 1 (127.0.0.1:" in err and "was killed by signal SIGKILL" in err


def test_timeout(run_process):
    code, _, err, secs = run_launch(py("time.sleep(60)"), 2, timeout=1)
    assert code == 124 and secs < 10
    assert "tfdp launch: timed out after 1 s" in err


def test_max_restarts(run_process):
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
def test_signal_is_forwarded(run_process, sig, expected):
    cmd = py("print(os.getpid(), flush=True); time.sleep(60)")
    # --output all: both workers' pids on stdout (by default only worker 0's is shown)
    launcher = subprocess.Popen([sys.executable, "-m", "tfdp", "launch", "--output", "all",
                                 "--workers", "2", "--", *cmd], cwd=ROOT, env=base_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


def test_cli_runs_command_without_double_dash(run_process):
    res = run_cli("--output", "all", "--workers", "2", sys.executable, "-c", "print('hi')")
    assert res.returncode == 0, res.stderr
    assert sorted(res.stdout.splitlines()) == ["[worker 0] hi", "[worker 1] hi"]


def test_cli_help(tfdp_cli):
    res = cli_in_process(tfdp_cli, "--help")
    assert res.returncode == 0
    assert "--workers N" in res.stdout and "unauthenticated" in res.stdout


def test_parse_args_command_boundaries():
    args = parse_args(["--workers", "2", "--", "-x", "--help"])
    assert args.command == ["-x", "--help"] and not args.help
    args = parse_args(["--workers", "2", "prog", "-h", "--", "--y"])
    assert args.command == ["prog", "-h", "--", "--y"]


def test_cli_usage_error_through_the_real_entry_point(run_process):
    """``python -m tfdp launch`` itself (a process, as a user runs it): one line, exit 2, no
    traceback, nothing on stdout. The other usage errors run in this process (below)."""
    res = run_cli()
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdp launch: error: ")
    assert "Missing --workers" in lines[0]
    assert res.stdout == ""


@pytest.mark.parametrize("args,needle", [
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
def test_cli_usage_errors(tfdp_cli, args, needle):
    res = cli_in_process(tfdp_cli, *args)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdp launch: error: ")
    assert needle in lines[0]
    assert res.stdout == ""


def test_cli_too_many_gpus(tfdp_cli, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    res = cli_in_process(tfdp_cli, "--workers", "2", "--gpus-per-worker", "2", "true")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "More GPUs requested than visible" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_api_usage_errors():
    with pytest.raises(UsageError, match="No command"):
        launch([], 2)
    with pytest.raises(UsageError, match="workers=0"):
        launch(["true"], 0)


# --- output: worker 0 live, the others in log files; TF's C++ log lines hidden ------------------

class _Recorder(io.StringIO):
    """A stream that remembers when each write arrived."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        self.writes.append((time.monotonic(), text))
        return super().write(text)


def test_worker0_output_is_live_with_prefixes_after_carriage_returns(run_process, tmp_path):
    out, err = _Recorder(), io.StringIO()
    start = time.monotonic()
    code = launch(py(f"""
        if {RANK} == 0:
            sys.stdout.write("step 1/3"); sys.stdout.flush()
            time.sleep(1.5)
            sys.stdout.write("\\rstep 2/3"); sys.stdout.flush()
            time.sleep(1.5)
            sys.stdout.write("\\rstep 3/3\\ndone\\n")
        else:
            print("hidden from the terminal", {RANK})
        """), 2, output="worker0", log_dir=str(tmp_path), stdout=out, stderr=err,
        env=base_env())
    assert code == 0, err.getvalue()
    text = out.getvalue()
    assert text == ("[worker 0] step 1/3\r[worker 0] step 2/3\r[worker 0] step 3/3\n"
                    "[worker 0] done\n"), repr(text)
    # the partial line arrived before its newline (live), not at the end
    first = next(t for t, w in out.writes if "step 1/3" in w)
    assert first - start < 1.4 + 2.0, first - start
    last = next(t for t, w in out.writes if "step 3/3" in w)
    assert last - first > 2.5
    # worker 1: only in its log file, named at the start and in the summary
    assert "hidden from the terminal" not in text + err.getvalue()
    assert (tmp_path / "worker-1.log").read_text() == "hidden from the terminal 1\n"
    assert "step 2/3" in (tmp_path / "worker-0.log").read_text()
    lines = err.getvalue().splitlines()
    assert lines[0].startswith("tfdp launch: 2 workers x ")   # x its replicas (see below)
    assert "; worker 0's output follows (--output all: every worker's)" in lines[0], lines[0]
    assert f"logs: {tmp_path}/worker-<i>.log (i = 0..1)" in lines[0]
    assert re.match(r"tfdp launch: 2 workers succeeded in [\d.]+ s; logs: ", lines[-1]), lines


def test_worker0_mode_shows_the_failed_workers_tail_and_log(run_process, tmp_path):
    code, out, err, secs = run_launch(py(f"""
        if {RANK} == 1:
            for i in range(50):
                print("line", i)
            time.sleep(0.5)  # two pipes: let stdout's lines arrive first
            print("Traceback: boom", file=sys.stderr)
            sys.exit(4)
        print("worker 0 waits"); sys.stdout.flush()
        time.sleep(60)
        """), 2, output="worker0", log_dir=str(tmp_path))
    assert code == 4 and secs < 15
    assert out == "[worker 0] worker 0 waits\n"
    log = tmp_path / "worker-1.log"
    assert "line 0\n" in log.read_text() and "Traceback: boom" in log.read_text()
    lines = err.splitlines()
    i = lines.index(f"tfdp launch: last 30 line(s) of worker 1 (full log: {log}):")
    tail = lines[i + 1:i + 31]
    # the last 30 lines (stdout and stderr are separate pipes: in arrival order)
    assert "[worker 1] Traceback: boom" in tail and "[worker 1] line 49" in tail
    assert "[worker 1] line 19" not in tail and len(set(tail)) == 30
    assert re.fullmatch(r"tfdp launch: worker 1 \(127\.0\.0\.1:\d+\) failed with exit code 4; "
                        r"stopped the other workers", lines[i + 31])


def test_default_log_dir_is_created(run_process, tmp_path):
    code, _, err, _ = run_launch(py("print('x')"), 2, output="worker0",
                                 env=base_env(TMPDIR=str(tmp_path)))
    assert code == 0, err
    m = re.search(r"logs: (\S+)/worker-<i>\.log", err)
    assert m and os.path.isfile(os.path.join(m.group(1), "worker-1.log")), err
    import shutil
    shutil.rmtree(m.group(1), ignore_errors=True)


TF_INFO = "I0000 00:00:1796122724.579021    9850 port.cc:153] oneDNN custom operations are on."
TF_WARN = ("W0000 00:00:1796122738.203424    9847 dataset.cc:997] Input of "
           "GeneratorDatasetOp::Dataset will not be optimized")
TF_ERR = "E0512 10:11:12.345678    9847 grpc.cc:12] a real error"
ABSL = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


@pytest.mark.parametrize("output", ["all", "worker0"])
@pytest.mark.parametrize("how,shown", [("default", False), ("verbose", True),
                                        ("user_level_0", True), ("user_level_1", "warn")])
def test_tf_cpp_logs_hidden_unless_asked_for(run_process, tmp_path, output, how, shown):
    env = base_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    if how.startswith("user_level"):
        env["TF_CPP_MIN_LOG_LEVEL"] = how[-1]
    lines = [ABSL, TF_INFO, TF_WARN, TF_ERR, "user text"]
    code, out, err, _ = run_launch(py(f"""
        print(repr(os.environ.get("TF_CPP_MIN_LOG_LEVEL")))
        sys.stderr.write({chr(10).join(lines) + chr(10)!r})
        """), 1, env=env, output=output, verbose=how == "verbose", log_dir=str(tmp_path))
    assert code == 0, err
    level = {"default": "'2'", "verbose": "None", "user_level_0": "'0'", "user_level_1": "'1'"}
    assert out == f"[worker 0] {level[how]}\n"
    got = [ln[len("[worker 0] "):] for ln in err.splitlines() if ln.startswith("[worker 0] ")]
    expected = {True: lines, False: [TF_ERR, "user text"],
                "warn": [ABSL, TF_WARN, TF_ERR, "user text"]}[shown]
    assert got == expected
    # the log file keeps everything (stdout and stderr in arrival order)
    assert sorted((tmp_path / "worker-0.log").read_text().splitlines()) == \
        sorted(lines + [level[how]])
    if how == "default":
        assert "TensorFlow's C++ INFO/WARNING logs hidden (TF_CPP_MIN_LOG_LEVEL=2; --verbose " \
               "shows them)" in err or output == "all"


def test_cli_default_and_all_output(run_process, tmp_path):
    cmd = py(f"print('hi', {RANK})")
    res = run_cli("--workers", "2", "--log-dir", str(tmp_path / "logs"), "--", *cmd)
    assert res.returncode == 0, res.stderr
    from tfdp.launch import cli
    if cli.DEFAULT_OUTPUT == "worker0":
        assert res.stdout == "[worker 0] hi 0\n"
    assert (tmp_path / "logs" / "worker-1.log").read_text() == "hi 1\n"
    res = run_cli("--output", "worker0", "--workers", "2", "--", *cmd)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "[worker 0] hi 0\n"
    assert "worker 0's output follows" in res.stderr
    env = base_env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env["CUDA_VISIBLE_DEVICES"] = ""
    for flag in (["--output", "all"], ["--all-output"]):   # (the deprecated, hidden alias)
        res = run_cli(*flag, "--workers", "2", "--cpu-replicas", "3", "--", *cmd, env=env)
        assert res.returncode == 0, res.stderr
        assert sorted(res.stdout.splitlines()) == ["[worker 0] hi 0", "[worker 1] hi 1"]
        assert res.stderr == ("tfdp launch: 2 workers x 3 CPU replicas = 6 replicas; "
                              "TensorFlow's C++ INFO/WARNING logs hidden "
                              "(TF_CPP_MIN_LOG_LEVEL=2; --verbose shows them)\n"), res.stderr


def test_cli_help_covers_output_and_nodes(tfdp_cli):
    res = cli_in_process(tfdp_cli, "--help")
    assert res.returncode == 0
    assert "--all-output" not in res.stdout   # one way to choose the output: --output
    for flag in ("--output", "--log-dir", "--verbose", "--nnodes", "--node-rank",
                 "--coordinator", "--workers-per-node", "--join-timeout", "--node-timeout",
                 "--slurm", "listens on every interface", "prints the addresses it will listen on"):
        assert flag in " ".join(res.stdout.split()), flag


@pytest.mark.parametrize("args,needle", [
    (["--nnodes", "2", "--node-rank", "0", "--workers-per-node", "1", "true"],
     "Missing --coordinator"),
    (["--nnodes", "2", "--coordinator", "127.0.0.1:2950", "--workers-per-node", "1", "true"],
     "Missing --node-rank"),
    (["--nnodes", "2", "--node-rank", "2", "--coordinator", "127.0.0.1:2950",
      "--workers-per-node", "1", "true"], "--node-rank=2"),
    (["--nnodes", "2", "--node-rank", "0", "--coordinator", "127.0.0.1:2950", "true"],
     "Missing --workers-per-node"),
    (["--nnodes", "2", "--node-rank", "0", "--coordinator", "127.0.0.1", "--workers-per-node",
      "1", "true"], "has no port"),
    (["--nnodes", "2", "--node-rank", "0", "--coordinator", "0.0.0.0:2950",
      "--workers-per-node", "1", "true"], "can connect to"),
    (["--nnodes", "2", "--node-rank", "0", "--coordinator", "10.0.0.1:70000",
      "--workers-per-node", "1", "true"], "invalid port"),
    (["--nnodes", "0", "--workers", "1", "true"], "--nnodes=0"),
    (["--nnodes", "3:2", "--node-rank", "0", "--coordinator", "127.0.0.1:2950",
      "--workers-per-node", "1", "true"], "--nnodes MIN=3. Give the fewest nodes the job may "
     "run on, 1..2 (--nnodes MIN:MAX, e.g. --nnodes 1:2)"),
    (["--nnodes", "2:x", "--workers-per-node", "1", "true"], "give N or MIN:MAX, e.g. 2 or 2:4"),
    (["--nnodes", "2", "--node-rank", "0", "--coordinator", "10.0.0.1:2950", "--workers", "2",
      "true"], "--workers-per-node"),
    (["--nnodes", "2", "--node-rank", "1", "--coordinator", "10.0.0.1:2950",
      "--workers-per-node", "1", "--host", "127.0.0.1", "true"], "loopback address cannot"),
    (["--nnodes", "2", "--node-rank", "1", "--coordinator", "10.0.0.1:2950",
      "--workers-per-node", "1", "--max-restarts", "-1", "true"], "--max-restarts=-1"),
    (["--nnodes", "2", "--node-rank", "1", "--coordinator", "10.0.0.1:2950",
      "--workers-per-node", "1", "--join-timeout", "0", "true"], "--join-timeout=0"),
    (["--node-rank", "1", "--workers", "2", "true"], "without --nnodes"),
    (["--workers", "2", "--workers-per-node", "3", "true"], "disagree"),
    (["--workers", "2", "--log-dir", "/proc/version", "true"], "Not a directory"),
    (["--slurm", "--workers-per-node", "1", "true"], "SLURM_PROCID"),
    (["--master-addr", "x", "true"], "--coordinator HOST:PORT"),
])
def test_cli_node_usage_errors(tfdp_cli, args, needle):
    res = cli_in_process(tfdp_cli, *args)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfdp launch: error: "), lines
    assert needle in lines[0]


# --- several nodes (here: on one machine, over loopback) ----------------------------------------

def _free_port():
    import portpicker
    return portpicker.pick_unused_port()


def _node(rank, port, cmd, *extra, nnodes=2, k=2, env=None):
    args = [sys.executable, "-m", "tfdp", "launch", "--nnodes", str(nnodes), "--node-rank",
            str(rank), "--coordinator", f"127.0.0.1:{port}", "--workers-per-node", str(k),
            "--timeout", "40", *extra, "--", *cmd]
    return subprocess.Popen(args, cwd=ROOT, env=env or base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(*procs, timeout=50):
    """[(exit code, stdout, stderr, seconds)] of each node launcher; never leaves one behind."""
    start = time.monotonic()
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1, timeout - (time.monotonic() - start)))
            results.append((p.returncode, out, err, time.monotonic() - start))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return results


def test_two_nodes_build_one_cluster(run_process):
    port = _free_port()
    cmd = py("""
        import json
        keys = ["TF_CONFIG", "TFDP_WORKER_RANK", "TFDP_NUM_WORKERS", "TFDP_LOCAL_RANK",
                "TFDP_NODE_RANK", "TFDP_NUM_NODES", "TFDP_CPU_REPLICAS"]
        print("ENV", json.dumps({k: os.environ.get(k) for k in keys}))
        """)
    n1 = _node(1, port, cmd, "--output", "all", "--cpu-replicas", "3")
    time.sleep(0.5)  # node 1 first: it retries until node 0 listens
    n0 = _node(0, port, cmd, "--output", "all", "--cpu-replicas", "3")
    (c0, out0, err0, _), (c1, out1, err1, _) = _finish(n0, n1)
    assert c0 == 0 and c1 == 0, err0 + err1
    envs = {}
    for line in (out0 + out1).splitlines():
        tag, _, rest = line.partition("] ")
        assert rest.startswith("ENV "), line
        envs[int(tag[len("[worker "):])] = json.loads(rest[4:])
    assert sorted(envs) == [0, 1, 2, 3]
    cluster = json.loads(envs[0]["TF_CONFIG"])["cluster"]
    assert len(cluster["worker"]) == 4 and len(set(cluster["worker"])) == 4
    for r, e in envs.items():
        assert json.loads(e["TF_CONFIG"]) == {"cluster": cluster,
                                              "task": {"type": "worker", "index": r}}
        assert (e["TFDP_WORKER_RANK"], e["TFDP_NUM_WORKERS"], e["TFDP_LOCAL_RANK"],
                e["TFDP_NODE_RANK"], e["TFDP_NUM_NODES"], e["TFDP_CPU_REPLICAS"]) == \
            (str(r), "4", str(r % 2), str(r // 2), "2", "3")
    assert (f"rendezvous listening on 127.0.0.1:{port} (open: any process that reaches it can "
            "join; give every node the same --rdzv-token or TFDP_RDZV_TOKEN)") in err0
    assert "tfdp launch: all 2 nodes succeeded" in err0
    for err, (a, b) in ((err0, (0, 1)), (err1, (2, 3))):
        ports = [cluster["worker"][a].rsplit(":", 1)[1], cluster["worker"][b].rsplit(":", 1)[1]]
        assert (f"workers {a}..{b} will listen on every interface at port(s) {ports[0]}, "
                f"{ports[1]}, advertised as {cluster['worker'][a]}, {cluster['worker'][b]}") in err


def test_a_token_admits_only_its_nodes_and_the_workers_never_see_it(run_process):
    """Launchers given TFDP_RDZV_TOKEN (node 1) and --rdzv-token (node 0) form the job; a stray
    connection and a launcher with another token are turned away, each with one line, while
    node 0 waits; the workers' environment has no token. Without a token node 0 says the
    rendezvous is open (test_two_nodes_build_one_cluster's run)."""
    import socket
    token = "a1b2" * 8
    port = _free_port()
    cmd = py("print('TOKEN', os.environ.get('TFDP_RDZV_TOKEN'))")
    n0 = _node(0, port, cmd, "--output", "all", "--rdzv-token", token, "--join-timeout", "30",
               k=1)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as stray:
                stray.sendall(b"\x16\x03\x01\x02\x00garbage\n")
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    wrong = _node(1, port, cmd, "--output", "all", k=1,
                  env=base_env(TFDP_RDZV_TOKEN="0" * 32))
    (cw, _, errw, _), = _finish(wrong, timeout=30)
    right = _node(1, port, cmd, "--output", "all", k=1, env=base_env(TFDP_RDZV_TOKEN=token))
    (c0, out0, err0, _), (c1, out1, err1, _) = _finish(n0, right)
    assert c0 == 0 and c1 == 0, err0 + err1
    assert cw == 2, errw
    assert re.search(r"^tfdp launch: error: this node's rendezvous token is not node 0's\. Give "
                     r"every node the same rendezvous token: --rdzv-token or TFDP_RDZV_TOKEN",
                     errw, re.M), errw
    assert "Traceback" not in errw + err0 + err1
    assert (f"rendezvous listening on 127.0.0.1:{port} (token-authenticated: only nodes with the "
            "same rendezvous token join)") in err0
    ignored = [ln for ln in err0.splitlines() if "ignored a connection" in ln]
    assert len(ignored) == 2, err0
    assert "not a tfdp launch message" in ignored[0]
    assert ignored[1].endswith("it did not prove it holds the rendezvous token"), ignored
    assert "TOKEN None" in out0 and "TOKEN None" in out1 and token not in out0 + out1


def test_a_failed_worker_on_one_node_stops_every_node(run_process):
    port = _free_port()
    cmd = py(f"""
        if {RANK} == 3:
            time.sleep(0.5); sys.exit(7)
        time.sleep(60)
        """)
    n0, n1 = _node(0, port, cmd), _node(1, port, cmd)
    (c0, _, err0, s0), (c1, _, err1, s1) = _finish(n0, n1)
    assert c0 == 7 and c1 == 7, err0 + err1
    assert s0 < 15 and s1 < 15
    assert re.search(r"^tfdp launch: worker 3 \(127\.0\.0\.1:\d+\) failed with exit code 7; "
                     r"stopped the other workers$", err1, re.M), err1
    assert re.search(r"^tfdp launch: node 1 \(127\.0\.0\.1\): worker 3 \(127\.0\.0\.1:\d+\) "
                     r"failed with exit code 7; stopped the other workers; stopped the workers "
                     r"of node 0 \(127\.0\.0\.1\)$", err0, re.M), err0


def _kill_node(proc):
    """A node dies: its launcher and every worker it started (their own sessions)."""
    kids = []
    try:
        for task in os.listdir(f"/proc/{proc.pid}/task"):
            with open(f"/proc/{proc.pid}/task/{task}/children") as f:
                kids += [int(p) for p in f.read().split()]
    except OSError:
        pass
    for pid in [proc.pid] + kids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_lost_node_ends_the_others_naming_it(run_process, how):
    port = _free_port()
    cmd = py("print('up', flush=True); time.sleep(60)")
    n0 = _node(0, port, cmd, "--node-timeout", "3", "--output", "all")
    n1 = _node(1, port, cmd, "--node-timeout", "3", "--output", "all")
    try:
        for _ in range(2):  # both of node 1's workers run
            assert n1.stdout.readline().endswith("up\n")
        lost = time.monotonic()
        if how == "killed":
            _kill_node(n1)
        else:
            os.kill(n1.pid, signal.SIGSTOP)  # its workers keep running; the launcher is silent
        out, err = n0.communicate(timeout=30)
        took = time.monotonic() - lost
    finally:
        if how == "frozen":
            os.kill(n1.pid, signal.SIGCONT)
        _finish(n0, n1, timeout=30)
    assert n0.returncode == 1, err
    assert took < 10, took
    why = ("was lost: it closed the rendezvous connection" if how == "killed" else
           r"stopped responding \(no rendezvous heartbeat for \d+ s, --node-timeout 3")
    assert re.search(rf"^tfdp launch: node 1 \(127\.0\.0\.1\) {why}.*; stopped the workers of "
                     r"node 0 \(127\.0\.0\.1\)$", err, re.M), err


def test_with_restarts_a_lost_coordinator_ends_the_job_and_a_lost_node_is_waited_for(
        run_process):
    """--max-restarts across nodes: node 0's node dying ends node 1's launcher at once with one
    line (restarts need node 0); node 1's dying leaves node 0 forming the job again, waiting
    --join-timeout for it, then exiting 124 naming it."""
    cmd = py("print('up', flush=True); time.sleep(60)")
    for lost in (0, 1):
        port = _free_port()
        nodes = [_node(r, port, cmd, "--node-timeout", "3", "--output", "all", "--max-restarts",
                       "2", "--join-timeout", "4", k=1) for r in (0, 1)]
        try:
            for n in nodes:
                assert n.stdout.readline().endswith("up\n")
            _kill_node(nodes[lost])
            t0 = time.monotonic()
            survivor = nodes[1 - lost]
            out, err = survivor.communicate(timeout=30)
            took = time.monotonic() - t0
        finally:
            _finish(*nodes, timeout=30)
        assert "Traceback" not in err, err
        if lost == 0:
            assert survivor.returncode == 1, err
            assert took < 10, took
            assert "tfdp launch: the coordinator's node 0 was lost: the job ends here" in err, err
            assert "restarting" not in err, err
        else:
            assert survivor.returncode == 124, err
            assert ("tfdp launch: restarting the job on every node (restart 1 of 2): node(s) 1 "
                    "lost: waiting for all 2 nodes to join again (--join-timeout)") in err, err
            assert "node(s) 1 did not join the rendezvous" in err, err


def test_a_node_that_never_shows_up_fails_the_join_in_one_line(run_process):
    port = _free_port()
    n0 = _node(0, port, ["true"], "--join-timeout", "1")
    (c0, _, err0, s0), = _finish(n0, timeout=30)
    assert c0 == 124 and s0 < 15, err0
    line = [ln for ln in err0.splitlines() if "did not join" in ln]
    assert len(line) == 1 and line[0].startswith("tfdp launch: node(s) 1 did not join the "
                                                 f"rendezvous at 127.0.0.1:{port} within 1 s")
    n1 = _node(1, port, ["true"], "--join-timeout", "1")
    (c1, _, err1, _), = _finish(n1, timeout=30)
    assert c1 == 124
    assert re.search(rf"^tfdp launch: could not reach the coordinator 127\.0\.0\.1:{port} "
                     r"within 1 s \(--join-timeout\)\. Received: last error: ", err1, re.M), err1


def test_nodes_that_disagree_fail_with_one_line_and_a_stray_connection_is_ignored(run_process):
    import socket
    port = _free_port()
    n0 = _node(0, port, ["true"], "--join-timeout", "20")
    deadline = time.monotonic() + 10
    while True:  # a port scanner / stray client: ignored, the job still forms
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    n1 = _node(1, port, ["true"], "--join-timeout", "20", k=3)
    (c0, _, err0, _), (c1, _, err1, _) = _finish(n0, n1)
    assert c0 == 2 and c1 == 2, err0 + err1
    assert "ignored a connection from 127.0.0.1:" in err0
    for err in (err0, err1):
        assert "Traceback" not in err
        assert re.search(r"^tfdp launch: error: node 1 \(127\.0\.0\.1\) was started with "
                         r"--workers-per-node 3, node 0 with --workers-per-node 2\. ", err,
                         re.M), err


def test_slurm_launchers_build_one_cluster(run_process):
    """`srun --ntasks-per-node=1 tfdp launch --slurm ...` as srun would start it on 2 nodes."""
    port = _free_port()
    cmd = py("print('ENV', os.environ['TFDP_WORKER_RANK'], os.environ['TFDP_NODE_RANK'], "
             "os.environ['TFDP_NUM_WORKERS'])")
    procs = []
    for rank in (1, 0):
        env = base_env(SLURM_PROCID=str(rank), SLURM_STEP_NUM_TASKS="2",
                       SLURM_STEP_NUM_NODES="2", SLURM_STEP_NODELIST="localhost,127.0.0.1",
                       SLURM_JOB_ID="42")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "tfdp", "launch", "--slurm", "--coordinator",
             f"127.0.0.1:{port}", "--workers-per-node", "1", "--output", "all", "--timeout", "40",
             "--", *cmd], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, start_new_session=True))
    (c1, out1, err1, _), (c0, out0, err0, _) = _finish(*procs)
    assert c0 == 0 and c1 == 0, err0 + err1
    assert out0 == "[worker 0] ENV 0 0 2\n" and out1 == "[worker 1] ENV 1 1 2\n"
    assert "node 0 of 2: rendezvous listening" in err0 and "node 1 of 2: joining" in err1


# --- one command line: --version listed, the same wording in every subcommand (issue 23) -------

def test_top_level_help_lists_version_and_exit_codes(capsys):
    from tfdp import cli
    from tfdp._version import __version__
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "-V, --version" in out and "-h, --help     show this help and exit" in out, out
    assert "exit codes: 0 success; 1 error; 2 usage error" in out, out
    assert cli.main(["-V"]) == 0 and capsys.readouterr().out == f"tfdp {__version__}\n"


def test_subcommands_share_the_wording_of_shared_options(capsys):
    from tfdp import cli
    from tfdp.launch import cli as launch_cli
    from tfdp.train import cli as train_cli
    assert launch_cli.main(["--help"]) == 0
    launch_help = " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as e:
        train_cli.main(["--help"])
    assert e.value.code == 0
    train_help = " ".join(capsys.readouterr().out.split())
    for text in (cli.HELP_HELP, cli.VERBOSE_HELP):
        assert text in launch_help and text in train_help, text
    assert "--all-output" not in launch_help and "--output {worker0,all}" in launch_help


def test_header_gives_replicas_per_worker():
    from tfdp.launch.launcher import _replicas_note
    none = {"CUDA_VISIBLE_DEVICES": ""}
    assert _replicas_note(2, "2", None, none) == "2 workers x 2 CPU replicas = 4 replicas"
    assert _replicas_note(4, None, 2, {}) == "4 workers x 2 GPUs = 8 replicas"
    assert _replicas_note(2, "3", None, {}) == ("2 workers x 3 CPU replicas = 6 replicas (a "
                                                "worker with GPUs uses its GPUs instead)")
    assert _replicas_note(2, None, None, none) == ("2 workers x 1 CPU replica each "
                                                   "(--cpu-replicas K: K CPU replicas per worker)")
    assert _replicas_note(1, "abc", None, {}).startswith("1 worker x its GPUs, else 1 CPU replica")

"""Start-up never hangs (issue 23, point 1): a worker whose peers do not all connect within
``startup_timeout`` (``TFDP_STARTUP_TIMEOUT``) exits 1 with one line naming them; SIGINT and
SIGTERM end a waiting or training worker promptly.

The rendezvous itself (``tfdp.cluster.startup``) is tested in this process on loopback ports (no
TensorFlow); the user's form (a two-line script with a two-worker ``TF_CONFIG``, only one worker
started) runs in fresh processes with hard timeouts.
"""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import portpicker
import pytest

from tfdp.cluster import ClusterInfo, parse_tf_config
from tfdp.cluster import startup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO_LINES = "import tfdp\ntfdp.set_default_strategy()\nprint('STARTED', flush=True)\n"


def _tf_config(ports, index):
    return json.dumps({"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                       "task": {"type": "worker", "index": index}})


def _cluster(ports, index) -> ClusterInfo:
    return parse_tf_config(_tf_config(ports, index))


def _ports(n):
    return [portpicker.pick_unused_port() for _ in range(n)]


# --- the rendezvous, in this process -----------------------------------------------------------

@pytest.mark.timeout(60)
def test_three_workers_meet_whatever_order_they_start_in():
    ports = _ports(3)
    errors, done = [], []

    def worker(i, delay):
        time.sleep(delay)
        try:
            startup.wait_for_peers(_cluster(ports, i), startup.Deadline(30))
            done.append(i)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append((i, e))
    threads = [threading.Thread(target=worker, args=(i, d)) for i, d in ((2, 0), (0, 0.5),
                                                                         (1, 1.5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not errors and sorted(done) == [0, 1, 2], errors
    for p in ports:   # every listener is closed again: TF's server can take the port
        with socket.socket() as s:
            s.bind(("", p))


@pytest.mark.timeout(60)
def test_a_worker_that_never_starts_is_one_line_and_exit_1():
    ports = _ports(3)
    err = io.StringIO()
    def peer_1():   # up, but worker 2 never comes: it gives up too
        with pytest.raises(SystemExit):
            startup.wait_for_peers(_cluster(ports, 1), startup.Deadline(4), stderr=io.StringIO())
    peer = threading.Thread(target=peer_1)
    peer.start()
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        startup.wait_for_peers(_cluster(ports, 0), startup.Deadline(2.5), stderr=err)
    took = time.monotonic() - t0
    peer.join(10)
    assert e.value.code == 1
    lines = err.getvalue().splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("tfdp: peer failure: worker 2 (127.0.0.1:%d) did not start" % ports[2])
    assert "worker 1 (" not in line.split(":", 3)[2].split("gave up")[0], line  # 1 was up
    for needle in ("gave up after 2.5 s", "startup_timeout / TFDP_STARTUP_TIMEOUT",
                   "this is worker 0 (127.0.0.1:%d) of 3" % ports[0], "TF_CONFIG lists",
                   "firewall", "TFDP_STARTUP_TIMEOUT=600"):
        assert needle in line, line
    assert took < 20


@pytest.mark.timeout(60)
def test_another_program_on_a_peer_port_is_named_as_such():
    ports = _ports(2)
    server = socket.create_server(("127.0.0.1", ports[1]))
    stop = threading.Event()

    def answer():   # a program that is not a tfdp worker: says something else
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH\n")
    t = threading.Thread(target=answer, daemon=True)
    t.start()
    err = io.StringIO()
    try:
        with pytest.raises(SystemExit):
            startup.wait_for_peers(_cluster(ports, 0), startup.Deadline(1.5), stderr=err)
    finally:
        stop.set()
        t.join(5)
        server.close()
    assert "worker 1 (127.0.0.1:%d) answered but not as a worker of this job" % ports[1] \
        in err.getvalue(), err.getvalue()


def test_a_worker_of_another_job_does_not_count():
    a = _cluster([1000, 1001], 0)
    b = ClusterInfo(workers=("127.0.0.1:1000", "127.0.0.1:1002"), task_type="worker",
                    rank=0, source="tf_config",
                    cluster_spec={"worker": ["127.0.0.1:1000", "127.0.0.1:1002"]})
    assert startup.job_digest(a) != startup.job_digest(b)
    assert startup.job_digest(a) == startup.job_digest(_cluster([1000, 1001], 1))


@pytest.mark.timeout(60)
def test_port_taken_by_another_listener_is_clear():
    ports = _ports(2)
    with socket.create_server(("", ports[0])):
        with pytest.raises(ValueError, match=f"Cannot listen on this worker's port {ports[0]}"):
            startup.wait_for_peers(_cluster(ports, 0), startup.Deadline(5))


@pytest.mark.parametrize("value, needle", [
    (0, "startup_timeout=0"), (-3, "startup_timeout=-3"), ("60", "startup_timeout='60'"),
    (float("inf"), "startup_timeout=inf")])
def test_startup_timeout_argument_is_validated(value, needle):
    from tfdp.strategy.settings import Settings
    with pytest.raises(ValueError, match="Invalid startup_timeout") as e:
        Settings.from_arguments(startup_timeout=value)
    assert needle in str(e.value)


def test_startup_timeout_env_and_default(monkeypatch):
    from tfdp.strategy.settings import Settings
    monkeypatch.delenv("TFDP_STARTUP_TIMEOUT", raising=False)
    assert Settings.from_arguments().startup_timeout == 300.0
    monkeypatch.setenv("TFDP_STARTUP_TIMEOUT", "42")
    assert Settings.from_arguments().startup_timeout == 42.0
    assert Settings.from_arguments(startup_timeout=7).startup_timeout == 7.0   # argument wins
    monkeypatch.setenv("TFDP_STARTUP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="TFDP_STARTUP_TIMEOUT='soon'"):
        Settings.from_arguments()


# --- the user's form: a two-worker TF_CONFIG, one worker started -------------------------------

def _start(code, env_extra, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFDP_")}
    env.update(CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2", **env_extra)
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _tfdp_lines(text):
    return [ln for ln in text.splitlines() if ln.startswith("tfdp")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("index, how", [(0, "env"), (1, "argument")])
def test_one_worker_of_two_exits_1_with_one_line(run_process, index, how):
    """Worker 0 alone (it leads TF's coordination service) or worker 1 alone (the leader is
    missing); the timeout from TFDP_STARTUP_TIMEOUT or from startup_timeout=."""
    ports = _ports(2)
    code = TWO_LINES if how == "env" else TWO_LINES.replace(
        "set_default_strategy()", "set_default_strategy(startup_timeout=3)")
    env = {"TF_CONFIG": _tf_config(ports, index)}
    if how == "env":
        env["TFDP_STARTUP_TIMEOUT"] = "3"
    p = _start(code, env)
    out, err = p.communicate(timeout=200)
    missing = 1 - index
    assert p.returncode == 1, (p.returncode, out, err)
    assert "STARTED" not in out and "Traceback" not in err, err
    lines = _tfdp_lines(err)
    assert lines[-1].startswith(f"tfdp: peer failure: worker {missing} (127.0.0.1:"
                                f"{ports[missing]}) did not start or cannot be reached"), lines
    assert "gave up after 3 s" in lines[-1] and "TF_CONFIG" in lines[-1], lines


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, -signal.SIGTERM)])
def test_signals_end_the_wait_promptly(run_process, sig, code):
    ports = _ports(2)
    p = _start(TWO_LINES, {"TF_CONFIG": _tf_config(ports, 0)})
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:   # the worker is waiting once its port answers
            try:
                socket.create_connection(("127.0.0.1", ports[0]), timeout=1).close()
                break
            except OSError:
                assert p.poll() is None, p.communicate()
                time.sleep(0.3)
        time.sleep(0.5)
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)   # TF's own exit included
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == code, (p.returncode, err)
    if sig == signal.SIGINT:
        assert _tfdp_lines(err)[-1].startswith(
            f"tfdp: interrupted (SIGINT) while worker 0 (127.0.0.1:{ports[0]}) of 2 was waiting "
            f"for worker 1 (127.0.0.1:{ports[1]})"), err
        assert "Traceback" not in err, err


@pytest.mark.timeout(300)
def test_sigterm_ends_a_started_multi_worker_process(run_process):
    """TF's start-up installs a SIGTERM handler that only logs: after tfdp's start-up the
    program's own handling is back, so a SIGTERM to one worker ends it (the launcher then
    stops the other)."""
    script = textwrap.dedent("""
        import os, signal, time
        import tfdp
        strategy = tfdp.set_default_strategy()
        print("STARTED", strategy.num_replicas_in_sync, flush=True)
        if strategy.worker_index == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
            print("STILL RUNNING AFTER SIGTERM", flush=True)
        else:
            time.sleep(60)
    """)
    r = subprocess.run([sys.executable, "-m", "tfdp", "launch", "--output", "all", "--workers",
                        "2", "--timeout", "200", "--", sys.executable, "-c", script],
                       capture_output=True, text=True, timeout=280, cwd=ROOT,
                       env={k: v for k, v in os.environ.items()
                            if not k.startswith("TFDP_") and k != "TF_CONFIG"})
    text = r.stdout + r.stderr
    assert "STARTED 2" in text, text
    # the header gives replicas per worker, each worker's first line what it runs on
    assert "tfdp launch: 2 workers x 1 CPU replica each" in text or \
        "tfdp launch: 2 workers x its GPUs, else 1 CPU replica each" in text, text
    assert ("[worker 1] tfdp: MultiWorkerDataParallelStrategy: 2 replicas = 2 workers x 1 (CPU:0 "
            "on each); this is worker 1 (127.0.0.1:") in text, text
    assert "STILL RUNNING AFTER SIGTERM" not in text, text
    assert "worker 1 (127.0.0.1:" in text and "killed by signal SIGTERM" in text, text
    assert r.returncode == 1, text


@pytest.mark.timeout(300)
def test_a_peer_lost_after_the_rendezvous_cannot_hang_tensorflows_start_up(run_process):
    """Worker 1 meets worker 0, then stops before TensorFlow's start-up: TF would wait for it
    forever, holding the GIL; the watchdog process prints one line and ends worker 0."""
    ports = _ports(2)
    peer = _start(f"""
        from tfdp.cluster import parse_tf_config, startup
        startup.wait_for_peers(parse_tf_config({_tf_config(ports, 1)!r}), startup.Deadline(120))
        print("MET", flush=True)
    """, {})
    p = _start(TWO_LINES, {"TF_CONFIG": _tf_config(ports, 0), "TFDP_STARTUP_TIMEOUT": "5"})
    try:
        out, err = p.communicate(timeout=250)
    finally:
        for proc in (p, peer):
            if proc.poll() is None:
                proc.kill()
    assert "MET" in peer.communicate(timeout=30)[0]
    assert p.returncode == -signal.SIGKILL, (p.returncode, err)
    line = _tfdp_lines(err)[-1]
    assert line.startswith("tfdp: peer failure: TensorFlow's start-up did not finish within 30 s"
                           ), err
    assert f"worker 1 (127.0.0.1:{ports[1]}) may have stopped" in line, line

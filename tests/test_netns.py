"""``tfdp launch`` across two hosts: two Linux network namespaces joined by a veth pair.

Each namespace is a host with its own address (10.77.0.1 and 10.77.0.2, nothing else but
loopback), so the two nodes of the job reach each other only over that link and no traffic
leaves them. One ``tfdp launch --nnodes 2`` runs in each (1 worker x 1 CPU replica per node). The
workers train with Keras ``fit``: the weights must equal one device's and be bitwise identical on
both hosts; then, in a second ``fit`` with ``tfdp.callbacks.BackupAndRestore``, the link is cut
mid-training and both sides must end within seconds, each naming the other host, never hang, and
leave the last backup loadable.

Needs root and iproute2 (CI runs as root); skipped with the reason elsewhere. The namespaces are
removed in a fixture, also when the test fails.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
HOSTS = ("10.77.0.1", "10.77.0.2")
PORT = 29517
N_EXAMPLES, BATCH, EPOCHS = 210, 50, 2
TOL = 1e-5
JOB_TIMEOUT = 240   # each launcher's own --timeout
HARD_TIMEOUT = 300  # the test kills everything after this

pytestmark = [pytest.mark.timeout(HARD_TIMEOUT + 60)]


def _ip(*args, ns=None, check=True):
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=check)


def _skip_reason():
    if os.name != "posix" or not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` command"
    return None


@pytest.fixture
def two_hosts(run_process):
    """(namespace A, namespace B, veth in A): two hosts joined by a veth pair; removed after."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tag = uuid.uuid4().hex[:6]
    ns = (f"tfdp-a-{tag}", f"tfdp-b-{tag}")
    veth = (f"tfa{tag}", f"tfb{tag}")  # interface names: at most 15 characters
    created = []
    try:
        for n in ns:
            r = _ip("netns", "add", n, check=False)
            if r.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
            created.append(n)
        _ip("link", "add", veth[0], "netns", ns[0], "type", "veth", "peer", "name", veth[1],
            "netns", ns[1])
        for n, v, host in zip(ns, veth, HOSTS):
            _ip("link", "set", "lo", "up", ns=n)
            _ip("addr", "add", f"{host}/24", "dev", v, ns=n)
            _ip("link", "set", v, "up", ns=n)
        r = subprocess.run(["ip", "netns", "exec", ns[0], "ping", "-c", "1", "-W", "5", HOSTS[1]],
                           capture_output=True, text=True, timeout=20)
        if r.returncode != 0 and shutil.which("ping"):
            raise AssertionError(f"the veth link does not work: {r.stdout}{r.stderr}")
        yield ns[0], ns[1], veth[0]
    finally:
        for n in created:
            _kill_namespace_processes(n)
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=20)


def _kill_namespace_processes(ns):
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


WORKER_SCRIPT = """
import os, sys, time
import tfdp
strategy = tfdp.DataParallelStrategy()  # multi-worker from TF_CONFIG (tfdp launch --nnodes 2)
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
import numpy as np
import keras
from helpers import build, make_data
from tfdp.callbacks import BackupAndRestore

rank = strategy.cluster.rank
out = os.environ["OUT_DIR"]
x, y = make_data(int(os.environ["N_EXAMPLES"]))
model = build(strategy, "sgd_momentum", seed=1 + rank)  # worker 0's initial values win
model.fit(x, y, batch_size=int(os.environ["BATCH"]), epochs=int(os.environ["EPOCHS"]),
          shuffle=False, verbose=0)
state = [np.asarray(getattr(v, "value", v)) for v in
         list(model.variables) + list(model.optimizer.variables)]
np.savez(os.path.join(out, f"w{rank}.npz"), *state)
print("PHASE1 DONE", rank, flush=True)

# Phase 2: a long fit with a backup every 2 steps; the test cuts the link mid-training.
class Slow(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == 6:
            print("CUT NOW", rank, flush=True)
        time.sleep(0.3)

model.fit(x, y, batch_size=int(os.environ["BATCH"]), epochs=200, shuffle=False, verbose=0,
          callbacks=[BackupAndRestore(os.environ["BACKUP_DIR"], save_freq=2), Slow()])
print("FINISHED", rank, flush=True)
"""


def _launch(ns, rank, script, tmp_path, env):
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "tfdp", "launch", "--all-output",
           "--nnodes", "2",
           "--node-rank", str(rank), "--coordinator", f"{HOSTS[0]}:{PORT}",
           "--workers-per-node", "1", "--cpu-replicas", "1", "--timeout", str(JOB_TIMEOUT),
           "--join-timeout", "60", "--log-dir", str(tmp_path / f"logs{rank}"), "--",
           sys.executable, str(script)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _load(path):
    with np.load(path) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def test_two_hosts_fit_equivalence_then_a_cut_link_ends_both_sides(run_process, two_hosts,
                                                                   tmp_path):
    ns_a, ns_b, veth_a = two_hosts
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER_SCRIPT))
    backup_dir = tmp_path / "backup"
    env = dict(os.environ, TFDP_TEST_DIR=TESTS_DIR, OUT_DIR=str(tmp_path),
               BACKUP_DIR=str(backup_dir), N_EXAMPLES=str(N_EXAMPLES), BATCH=str(BATCH),
               EPOCHS=str(EPOCHS), CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TF_CONFIG", None)
    nodes = [_launch(ns_a, 0, script, tmp_path, env), _launch(ns_b, 1, script, tmp_path, env)]
    outputs = ["", ""]
    try:
        # Node 0 shows worker 0's output live: wait for phase 2's marker, then cut the link.
        deadline = time.monotonic() + HARD_TIMEOUT - 60
        while "CUT NOW 0" not in outputs[0]:
            line = nodes[0].stdout.readline()
            if not line:
                break
            outputs[0] += line
            assert time.monotonic() < deadline, outputs[0]
        assert "CUT NOW 0" in outputs[0], "the job never reached phase 2:\n" + \
            outputs[0] + nodes[1].communicate(timeout=60)[0]
        _ip("link", "set", veth_a, "down", ns=ns_a)
        cut = time.monotonic()
        ended = []
        for i, p in enumerate(nodes):
            rest, _ = p.communicate(timeout=90)
            outputs[i] += rest
            ended.append(time.monotonic() - cut)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate(timeout=30)
    text0, text1 = outputs[0], outputs[1]
    print(f"after the cut: node 0 ended in {ended[0]:.1f} s, node 1 in {ended[1]:.1f} s")
    print(text0[-3000:], text1[-3000:], sep="\n-----\n")

    # Phase 1: Keras fit across the two hosts equals one device; weights bitwise identical.
    w0, w1 = _load(tmp_path / "w0.npz"), _load(tmp_path / "w1.npz")
    assert len(w0) == len(w1) > 0
    for a, b in zip(w0, w1):
        np.testing.assert_array_equal(a, b)
    from helpers import build, make_data
    x, y = make_data(N_EXAMPLES)
    ref = build(None, "sgd_momentum", seed=1)
    ref.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    ref_state = [np.asarray(getattr(v, "value", v)) for v in
                 list(ref.variables) + list(ref.optimizer.variables)]
    assert len(ref_state) == len(w0)
    diff = max(float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
               for a, b in zip(w0, ref_state))
    assert diff <= TOL, diff

    # The cut: both sides end within seconds, non-zero, each naming the host it lost.
    assert "FINISHED" not in text0 + text1
    assert nodes[0].returncode not in (0, None) and nodes[1].returncode not in (0, None)
    assert max(ended) < 40, ended
    for text, lost in ((text0, HOSTS[1]), (text1, HOSTS[0])):
        named = [ln for ln in text.splitlines() if ln.startswith("tfdp launch: ")
                 and re.search(rf"\b{re.escape(lost)}\b.*(stopped responding|was lost|lost the "
                               r"connection)", ln)]
        assert named, f"no line names the lost host {lost}:\n{text[-4000:]}"
    # Both sides said where their workers listen (every interface, advertised address).
    assert f"advertised as {HOSTS[0]}:" in text0 and f"advertised as {HOSTS[1]}:" in text1

    # The last backup is intact: a fresh model restores it.
    from tfdp.callbacks import BackupAndRestore
    model = build(None, "sgd_momentum", seed=9)
    model.optimizer.build(model.trainable_variables)
    backup = BackupAndRestore(str(backup_dir))
    backup.set_model(model)
    meta = backup.restore()
    assert meta["global_step"] >= 4, meta
    for v in model.variables:
        assert np.all(np.isfinite(np.asarray(v)))

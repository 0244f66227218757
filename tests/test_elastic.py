"""Elastic multi-node training (``tfdp launch --nnodes MIN:MAX``), exact across a change of size.

Three "nodes" on 127.0.0.1 (a launcher each, 1 worker x 1 CPU replica), ``--nnodes 2:3
--max-restarts 2``, Keras ``fit`` on a reshuffled ``tf.data`` pipeline with
``tfdp.callbacks.BackupAndRestore(save_freq=1)`` in a folder every node reads. Node 2 dies for
good at a random step (its worker SIGKILLs its launcher, then exits, as a lost host): nodes 0-1
form the job again on 2 replicas and resume at the last backup with the same global batches;
then node 2's launcher is started again and joins, and the job finishes on 3. Every worker
ends bitwise equal to the others and within 1e-5 of one device trained on the same global batches
(the uninterrupted run: tfdp's N replicas equal one device). With ``--elastic-policy
accumulate`` (node 2 lost for good) the 2 replicas left run each share in 2 micro-batches, none
larger than a share on 3 nodes, exact as well.
"""

import json
import os
import random
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(600)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
TOL = 1e-5

WORKER_SCRIPT = """
import hashlib, os, sys, time
import keras
import numpy as np
import tfdp
strategy = tfdp.DataParallelStrategy()   # TF_CONFIG: 2 or 3 workers x 1 CPU replica
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
import test_resume_dropin as t           # 100 examples, global batch 20, 3 epochs: 15 steps
from tfdp.callbacks import BackupAndRestore
from tfdp.testing import emit_result
rank, n = strategy.cluster.rank, strategy.num_replicas_in_sync
marks, kill_at = os.environ["MARKS"], int(os.environ["KILL_AT"])
round_ = int(os.environ["TFDP_RESTART_COUNT"])


class Pace(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        mark = os.path.join(marks, f"round{round_}-rank{rank}")
        if not os.path.exists(mark):              # this round's first step, trained
            with open(mark, "w") as f:
                f.write(f"{time.time()} {step} {n}")
        if round_ == 0 and rank == 2 and step == kill_at:
            with open(os.path.join(marks, "killed"), "w") as f:
                f.write(f"{time.time()} {step}")
            print(f"node 2 dies after global step {step}", flush=True)
            os.kill(os.getppid(), 9)              # its launcher
            os._exit(17)
        if n == 2 and os.environ["CASE"] == "returns" and step >= kill_at + 2:
            # node 2 comes back during this round: wait for it (the launchers stop this
            # worker when it joins), whatever the load on the host
            end = time.monotonic() + 240
            while time.monotonic() < end:
                time.sleep(0.2)


backup = BackupAndRestore(os.environ["BACKUP_DIR"], save_freq=1)
m, hist = t.run(strategy, "shuffled", [backup, Pace()], model_seed=1 if round_ == 0 else 5)
got = t.state(m)
one_device, _ = t.run(None, "shuffled")  # no strategy: one device, the same global batches
digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in got)).hexdigest()
emit_result(rank=rank, round=round_, replicas=n, restored=backup.restored,
            micro_batches=strategy.extended.tfdp_micro_batches,
            diff=t.max_diff(got, t.state(one_device)), digest=digest,
            iterations=int(m.optimizer.iterations.numpy()), loss=hist["loss"][-1])
"""


def _mark(marks, name, timeout, procs):
    """The fields of the mark file ``name`` once it is there (a worker wrote it)."""
    path = os.path.join(marks, name)
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end or all(p.poll() is not None for p in procs):
            return None
        time.sleep(0.1)
    time.sleep(0.05)
    with open(path) as f:
        return f.read().split()


@pytest.mark.parametrize("case", ["lost", "returns", "accumulate"])
def test_a_node_lost_for_good_and_back_again_keeps_the_training_exact(run_process, tmp_path,
                                                                       case):
    import portpicker
    from tfdp.testing import RESULT_MARK
    script = tmp_path / "train.py"
    script.write_text(WORKER_SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    kill_at = random.Random().randint(3, 8)   # a random step of 15 (epoch 1 or 2)
    env = dict(os.environ, TFDP_TEST_DIR=TESTS_DIR, CUDA_VISIBLE_DEVICES="",
               TF_CPP_MIN_LOG_LEVEL="2", BACKUP_DIR=str(tmp_path / "backup"),
               MARKS=str(marks), KILL_AT=str(kill_at), CASE=case,
               TFDP_RDZV_TOKEN="e1a571c" * 3)
    port = portpicker.pick_unused_port()
    logs = []

    def launcher(r):
        out, err = tmp_path / f"node{r}-{len(logs)}.out", tmp_path / f"node{r}-{len(logs)}.err"
        logs.append((r, out, err))
        return subprocess.Popen(
            [sys.executable, "-m", "tfdp", "launch", "--nnodes", "2:3", "--node-rank", str(r),
             "--coordinator", f"127.0.0.1:{port}", "--workers-per-node", "1",
             "--cpu-replicas", "1", "--output", "all", "--max-restarts", "2",
             "--join-timeout", "120", "--timeout", "540",
             *(["--elastic-policy", "accumulate"] if case == "accumulate" else []),
             "--", sys.executable, str(script)],
            env=env, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=open(out, "w"),
            stderr=open(err, "w"), start_new_session=True)

    def text():
        return "\n".join(f"--- node {r} ({out.name}): \n{out.read_text()[-3000:]}\n"
                         f"{err.read_text()[-3000:]}" for r, out, err in logs)

    nodes = [launcher(r) for r in range(3)]
    procs = list(nodes)
    try:
        killed = _mark(marks, "killed", 300, procs)
        assert killed, text()
        assert nodes[2].wait(timeout=30) == -9, text()     # its launcher SIGKILLed
        back = _mark(marks, "round1-rank0", 200, procs)      # training again on 2 nodes
        assert back and back[2] == "2", text()
        lost_s = float(back[0]) - float(killed[0])
        print(f"node 2 lost after step {killed[1]}: training again on 2 nodes after "
              f"{lost_s:.1f} s (resumed at step {back[1]})")
        if case == "returns":
            started = time.time()
            procs.append(launcher(2))
            again = _mark(marks, "round2-rank2", 200, procs)
            assert again and again[2] == "3", text()
            print(f"node 2 started again: training on 3 nodes after "
                  f"{float(again[0]) - started:.1f} s (at step {again[1]})")
        for p in procs[:2] + procs[3:]:
            p.wait(timeout=400)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    finals = procs[:2] + procs[3:]
    assert [p.returncode for p in finals] == [0] * len(finals), text()
    err0 = logs[0][2].read_text()
    assert "Traceback" not in text(), text()
    assert ("restarting the job on every node (restart 1 of 2): node(s) 2 lost; continuing on "
            "the 2 that remain (--nnodes 2:3)") in err0, text()
    assert "node(s) 2 gone: continuing on 2 nodes (0, 1): 2 workers" in err0, text()
    results = []
    for r, out, _ in [logs[0], logs[1]] + logs[3:]:
        lines = [ln.split("] ", 1)[-1] for ln in out.read_text().splitlines()
                 if RESULT_MARK in ln]
        assert lines, text()
        results.append(json.loads(lines[-1][len(RESULT_MARK):]))
    print(f"{case}:", results)
    final = 3 if case == "returns" else 2
    if case == "returns":
        assert ("forming the job again: node(s) 2 asked to join (--nnodes 2:3)") in err0, text()
        assert "node(s) 2 joined: continuing on 3 nodes (0, 1, 2): 3 workers" in err0, text()
    assert sorted(r["rank"] for r in results) == list(range(final)), results
    assert all(r["replicas"] == final and r["round"] == final - 1 and r["restored"]
               for r in results), results
    assert all(r["iterations"] == 15 for r in results), results
    assert all(r["diff"] <= TOL for r in results), results
    assert len({r["digest"] for r in results}) == 1, results          # bitwise equal
    assert "the backup was written on 3 workers = 3 replicas" in err0, text()  # the chief's
    # --elastic-policy accumulate: on 2 nodes each replica's share of 10 (of 20) runs in
    # ceil(3 / 2) = 2 micro-batches of 5, none larger than a share on 3 nodes (6-7)
    assert all(r["micro_batches"] == (2 if case == "accumulate" else 1) for r in results)
    assert (("each replica's share in 2 micro-batches" in err0) == (case == "accumulate")), \
        text()


# --- in one process: a backup resumed on another replica count -----------------------------------

_one_device = {}


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
@pytest.mark.parametrize("before,after", [(3, 2), (2, 3)])
def test_a_backup_resumes_exactly_on_another_replica_count(tmp_path, zero_stage, before, after,
                                                            caplog):
    """What an elastic round does to the training, in one process: fit with the drop-in backup on
    ``before`` replicas, killed at global step 7 of 15; the same script on ``after`` replicas
    resumes there (sharded optimizer state, ``zero_stage``, re-sharded over the new replicas) and
    ends within 1e-5 of one device on the same global batches."""
    import tfdp
    import test_resume_dropin as t
    from helpers import Interrupt
    from tfdp.callbacks import BackupAndRestore
    d = str(tmp_path / "backup")
    devices = [f"CPU:{i}" for i in range(4)]
    first = tfdp.DataParallelStrategy(devices[:before], zero_stage=zero_stage)
    with pytest.raises(Interrupt):
        t.run(first, "shuffled", [BackupAndRestore(d, save_freq=1), t.kill_at(7)])
    second = tfdp.DataParallelStrategy(devices[:after], zero_stage=zero_stage)
    backup = BackupAndRestore(d, save_freq=1)
    m, _ = t.run(second, "shuffled", [backup], model_seed=5)
    assert backup.restored and int(m.optimizer.iterations.numpy()) == 15
    if "ref" not in _one_device:
        _one_device["ref"] = t.state(t.run(None, "shuffled")[0])
    assert t.max_diff(t.state(m), _one_device["ref"]) <= TOL

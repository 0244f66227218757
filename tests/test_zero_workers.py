"""Sharded optimizer state across 2 workers x 2 CPU replicas (tfdp.testing.run_workers): one job.

Each worker shards its optimizer state over its own 2 replicas with the same plan as the other
worker (slots replicated across workers; ``tfdp.zero``). In one job, for zero_stage 0, 1 and 2:
rows of the user-pattern matrix (momentum SGD, Embedding + Adam's sparse gradients, global
clipnorm with gradient accumulation: the owner's update inside Keras's accumulation branch and
its replica-context broadcast across workers, two optimizers) and Adafactor (state outside the
slots) stay within 1e-5 of one device with identical copies; stage 1 equals unsharded bitwise
and both workers end bitwise equal; every other Keras optimizer at stage 1 too. A checkpoint written sharded by each worker restores on one
device and continues like the sharded job; tfdp's BackupAndRestore resumes a sharded job exactly
with one writer. The one-device references are trained once, by worker 0; worker 1 reads them
(``tfdp_bench.patterns.once_per_job``).
"""

import os

import pytest

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

WORKER_SCRIPT = """
import dataclasses, gc, os, sys
import numpy as np
import tfdp
strategy = tfdp.DataParallelStrategy(zero_stage=1)  # 2 workers x 2 CPU replicas (TF_CONFIG)
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
import tfdp_bench.patterns
from tfdp_bench.patterns import get_row, max_diff, once_per_job, reference_once_per_job, run_row
from tfdp.testing import emit_result
rank = strategy.cluster.rank
REF_DIR = os.environ["REF_DIR"]  # one-device references: computed by rank 0, read by rank 1
out = {"rank": rank, "replicas": strategy.num_replicas_in_sync, "rows": {}}


def set_stage(stage):
    # A process has one multi-worker strategy: the test switches its zero_stage between cases
    # (each case builds a new model, so a fresh plan).
    ext = strategy.extended
    ext.tfdp_settings = dataclasses.replace(ext.tfdp_settings, zero_stage=stage)
    ext.__dict__.pop("_tfdp_zero_state", None)
    gc.collect()


for name in ("fit_uneven", "embedding_adam", "global_clipnorm_accum2", "two_optimizers"):
    row = get_row(name)
    ref = reference_once_per_job(row, rank, REF_DIR)
    for stage in (0, 1, 2):
        set_stage(stage)
        res = run_row(row, lambda: strategy, ref)
        out["rows"][f"{name}/{stage}"] = dict(
            exact=res.exact, summary=res.summary(), sha=res.weights_sha256,
            owner_reductions=getattr(strategy.extended.tfdp_zero, "owner_reductions", 0),
            traceback=(res.traceback or "")[-3000:])

import test_zero as tz
for name in tz.OPTIMIZERS:  # every Keras optimizer at stage 1; Adafactor at every stage
    ref, _ = once_per_job(f"optimizer-{name}", lambda: (tz._train(name, None).get_weights(), {}),
                          rank, REF_DIR)
    for stage in ((0, 1, 2) if name == "adafactor" else (1,)):
        set_stage(stage)
        m = tz._train(name, strategy)
        tz.assert_replicas_identical(strategy, m)
        d = max_diff(m.get_weights(), ref)
        out["rows"][f"{name}/{stage}"] = dict(
            exact=d <= 1e-5, summary=f"max|dw| {d:.1e}",
            sha=tfdp_bench.patterns.digest(m.get_weights()), owner_reductions=0, traceback="")

# a checkpoint written sharded (stage 1) by each worker restores on one device
import tensorflow as tf
from helpers import build, make_data
x, y = make_data(120)
set_stage(1)
m = build(strategy, "adam")
m.fit(x, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
prefix = tf.train.Checkpoint(model=m, optimizer=m.optimizer).write(
    os.path.join(os.environ["CKPT_DIR"], f"worker{rank}", "ckpt"))
m.fit(x, y, batch_size=40, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
one = build(None, "adam", seed=7)
one.optimizer.build(one.trainable_variables)
tf.train.Checkpoint(model=one, optimizer=one.optimizer).read(prefix).assert_consumed()
one.fit(x, y, batch_size=40, epochs=2, initial_epoch=1, shuffle=False, verbose=0)
state = lambda k: [np.array(w) for w in k.get_weights()] + [
    np.array(getattr(v, "value", v)) for v in k.optimizer.variables]
out["checkpoint_to_one_device"] = max_diff(state(one), state(m))

# BackupAndRestore: a sharded job killed mid-epoch resumes exactly, the chief alone writing
import test_callbacks_backup as tb
set_stage(1)
reference_state = tb.uninterrupted(strategy)
got, resumed = tb.interrupted_then_resumed(strategy, os.environ["BACKUP_DIR"])
out["backup_diff"] = tb.max_diff(got, reference_state)
out["backup_writes"] = resumed.saves_written
emit_result(out)
"""


@pytest.mark.timeout(900)
def test_two_workers_sharded(worker_job, tmp_path):
    from tfdp.testing import parse_results, run_workers
    outputs = run_workers(WORKER_SCRIPT, workers=2, cpu_replicas=2, timeout=800,
                          env={"TFDP_TEST_DIR": TESTS_DIR, "CUDA_VISIBLE_DEVICES": "",
                               "CKPT_DIR": str(tmp_path / "ckpt"),
                               "REF_DIR": str(tmp_path / "references"),
                               "BACKUP_DIR": str(tmp_path / "backup")})
    results = parse_results(outputs)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["replicas"] == 4
        for case, row in r["rows"].items():
            assert row["exact"], f"worker {r['rank']} {case}: {row['summary']}\n" \
                                 f"{row['traceback']}"
            if case.endswith("/2") and not case.startswith(("adafactor", "global_clipnorm")):
                assert row["owner_reductions"] > 0, case  # really reduced onto owners
        for name in ("fit_uneven", "embedding_adam", "global_clipnorm_accum2",
                     "two_optimizers", "adafactor"):
            assert r["rows"][f"{name}/1"]["sha"] == r["rows"][f"{name}/0"]["sha"], name
        assert r["checkpoint_to_one_device"] <= 1e-5
        assert r["backup_diff"] <= 1e-6
    assert results[0]["backup_writes"] > 0 and results[1]["backup_writes"] == 0
    for case in results[0]["rows"]:  # both workers end bitwise equal
        assert results[0]["rows"][case]["sha"] == results[1]["rows"][case]["sha"], case

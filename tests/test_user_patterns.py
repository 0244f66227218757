"""The user-pattern matrix (tfdp_bench.patterns): tfdp trains exactly like one device on every row.

Each row trains a tiny Keras model as a user writes it (clipping, gradient accumulation, custom
train_step with two optimizers / reversed or partial variable lists / apply_gradients,
BatchNormalization, jit_compile, PyDataset and generators, a last batch smaller than the replica
count, sample/class weights, two outputs, regularizers, Embedding + Adam, mixed precision,
LossScaleOptimizer, steps_per_execution, validation + evaluate) once without a strategy and once
under ``tfdp.DataParallelStrategy`` on the conftest's 4 CPU replicas. Asserted: max |dw| <= 1e-5,
the row's own checks (user arrays unchanged, metrics equal...), and every replica's copy of every
model and optimizer variable bitwise identical. Rows with per-replica semantics (plain
BatchNormalization) assert identity only. ``tfdp bench patterns`` prints the same rows as a table
against MirroredStrategy.

A subset runs on 2 workers x 2 CPU replicas (``tfdp.testing.run_workers``); both workers compare
with one single-device reference, trained outside any strategy scope by worker 0 and read by
worker 1 (``reference_once_per_job``: the job computes it once).
"""

import pytest

from tfdp_bench.patterns import (MULTIWORKER_ROWS, ROWS, VALUE_RTOL, RowResult, Trained, get_row,
                                 reference, run_row)
from tfdp.testing import run_workers

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]


def _explain(res):
    text = f"{res.row}: {res.summary()}"
    if res.not_identical:
        text += f"\nreplica copies differ: {res.not_identical[:10]}"
    if res.traceback:
        text += "\n" + res.traceback[-4000:]
    return text


def assert_exact(res):
    assert res.error is None, _explain(res)
    assert not res.failed_checks, _explain(res)
    assert res.identical, _explain(res)
    if res.per_replica:
        return
    assert res.max_dw <= res.tol, _explain(res)  # TOL (1e-5), float16 rows looser
    if res.max_dvalue is not None:
        assert res.max_dvalue <= VALUE_RTOL, _explain(res)


def shared_reference(one_device, row):
    """The row's single-device run (no strategy, no scope), once per test session: what
    run_row compares with (its weights, values and checks; no model is kept). test_zero's
    sharded rows compare with the same runs."""
    def compute():
        ref = reference(row)
        return Trained(None, ref.weights, [], ref.values, ref.checks)
    return one_device(("pattern row", row.name), compute)


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_row_equals_single_device(row, cpu_devices, one_device):
    import tfdp
    assert len(cpu_devices) == 4
    res = run_row(row, lambda: tfdp.DataParallelStrategy(DEVICES),
                  shared_reference(one_device, row))
    assert_exact(res)


def test_reference_is_deterministic(one_device):
    """Two no-strategy runs of a row give bitwise equal weights (the comparisons mean something):
    a fresh one against the session's reference run of the row."""
    row = get_row("two_optimizers")
    res = run_row(row, None, shared_reference(one_device, row))
    assert res.error is None and res.max_dw == 0.0


# --- 2 workers x 2 CPU replicas ----------------------------------------------------------------

WORKER_SCRIPT = """
import os
import tfdp
strategy = tfdp.DataParallelStrategy()  # at start-up: multi-worker from the launcher's TF_CONFIG
from tfdp.strategy.multiworker import MultiWorkerDataParallelStrategy
assert isinstance(strategy, MultiWorkerDataParallelStrategy), type(strategy)
import dataclasses
from tfdp_bench.patterns import get_row, reference_once_per_job, run_row
from tfdp.testing import emit_result
for name in os.environ["PATTERN_ROWS"].split(","):
    row = get_row(name)
    # one device, no strategy, outside any scope: computed by rank 0, read by rank 1
    ref = reference_once_per_job(row, strategy.cluster.rank, os.environ["REF_DIR"])
    res = run_row(row, lambda: strategy, ref)
    emit_result(dataclasses.asdict(res), rank=strategy.cluster.rank,
                replicas=strategy.num_replicas_in_sync)
"""

# One 2-worker job per group of rows (a cluster's start-up costs more than a row).
GROUPS = {"core": MULTIWORKER_ROWS[:4], "losses": MULTIWORKER_ROWS[4:]}


def _all_results(outputs):
    import json

    from tfdp.testing import RESULT_MARK
    return [[json.loads(ln[len(RESULT_MARK):]) for ln in out.splitlines()
             if ln.startswith(RESULT_MARK)] for out in outputs]


def test_groups_cover_the_multiworker_rows():
    assert [r for g in GROUPS.values() for r in g] == MULTIWORKER_ROWS


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_rows_two_workers_equal_single_device(worker_job, group, tmp_path):
    names = GROUPS[group]
    outputs = run_workers(WORKER_SCRIPT, workers=2, cpu_replicas=2, timeout=500,
                          env={"PATTERN_ROWS": ",".join(names), "CUDA_VISIBLE_DEVICES": "",
                               "REF_DIR": str(tmp_path)})
    per_worker = _all_results(outputs)
    assert [len(rs) for rs in per_worker] == [len(names)] * 2, outputs
    for i, name in enumerate(names):
        results = [rs[i] for rs in per_worker]
        assert [r["rank"] for r in results] == [0, 1]
        for r in results:
            assert r.pop("replicas") == 4
            r.pop("rank")
            assert r["row"] == name
            assert_exact(RowResult(**r))
        # weights bitwise identical on both workers
        assert results[0]["weights_sha256"] == results[1]["weights_sha256"], name


# --- tfdp bench patterns -------------------------------------------------------------------------

def _bench(*args, timeout=300):
    import os
    import subprocess
    import sys
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TFDP_CPU_REPLICAS", None)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.run([sys.executable, "-m", "tfdp", "bench", "patterns", *args], cwd=root,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_bench_patterns_list_and_bad_rows(run_process):
    res = _bench("--list", timeout=60)
    assert res.returncode == 0, res.stderr
    assert [ln.split()[0] for ln in res.stdout.splitlines()] == [r.name for r in ROWS]
    res = _bench("--rows", "fit_uneven,nope", timeout=60)
    assert res.returncode == 2 and "Invalid --rows" in res.stderr


@pytest.mark.timeout(300)
def test_bench_patterns_one_row(run_process, tmp_path):
    import json
    out = tmp_path / "p.json"
    res = _bench("--rows", "clipnorm_even", "--json", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[1/1] clipnorm_even" in res.stderr  # progress on stderr
    table = [ln for ln in res.stdout.splitlines() if ln.startswith("|")]
    assert table[0].startswith("| row | MirroredStrategy max\\|dw\\| | tfdp max\\|dw\\| | tfdp "
                               "replicas identical")
    assert len(table) == 3 and table[2].startswith("| clipnorm_even |")
    data = json.loads(out.read_text())
    assert data["benchmark"] == "patterns" and len(data["devices"]) == 4
    (row,) = data["rows"]
    for key in ("mirrored", "tfdp"):
        assert row[key]["error"] is not None or row[key]["max_dw"] >= 0

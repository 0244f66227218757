"""tfdp bench fit --trace DIR: the profiler trace exists, the per-step table parses.

No timing assertions: the end-to-end test checks the files, the table's structure, that each
contender's all-reduce ops were found in its trace (the classification works on the op names
TF really writes), and that the figures of every step add up (compute, all-reduce, idle within
the step's wall time). The unit tests check the interval arithmetic on hand-made events.
"""

import glob
import gzip
import json
import os
import subprocess
import sys

import pytest

from tfdp_bench import trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- classification and interval arithmetic (no TensorFlow) -------------------------------------

@pytest.mark.parametrize("node, op_type, cls", [
    # op names seen in TF 2.21 traces of tfdp bench fit (tfdp fused; MirroredStrategy RING)
    ("StatefulPartitionedCall/tfdp_all_reduce/concat_3", "ConcatV2", "all-reduce"),
    ("StatefulPartitionedCall/tfdp_all_reduce/ArithmeticOptimizer/AddOpsRewrite_add_1", "AddN",
     "all-reduce"),
    ("StatefulPartitionedCall/sgd_1/tfdp_all_reduce/split_2", "SplitV", "all-reduce"),
    ("StatefulPartitionedCall/sgd/CollectiveReduceV2_3", "CollectiveReduceV2", "all-reduce"),
    ("collective_executor", "CollectiveExecutor", "all-reduce"),
    ("cluster_0/NcclAllReduce", "NcclAllReduce", "all-reduce"),
    ("StatefulPartitionedCall/gradient_tape/replica_1/mlp_60x64_1/dense_0_1/MatMul",
     "_MklMatMul", "compute"),
    ("StatefulPartitionedCall/sgd/update_3_1/Mul", "Mul", "compute"),
    ("StatefulPartitionedCall/replica_2/compile_loss/mse/mul", "Mul", "compute"),
])
def test_classify(node, op_type, cls):
    assert trace.classify(node, op_type) == cls


def _ev(cls, start, end, gradient=False, thread="t0"):
    return {"name": "x", "type": "Op", "cls": cls, "gradient": gradient, "thread": thread,
            "plane": "/host:CPU", "start_ns": start * 1e6, "end_ns": end * 1e6}


def test_step_timeline_hand_computed():
    # one 10 ms step: backward 0-4 ms (thread 0) and 3-5 ms (thread 1, overlapping), forward
    # before it is not gradient; all-reduce 4-8 ms, of which 4-5 ms overlaps the backward pass;
    # an optimizer op 8-9 ms; idle 9-10 ms. Events outside the step are clipped.
    events = [_ev("compute", -2, 1, gradient=False), _ev("compute", 1, 4, gradient=True),
              _ev("compute", 3, 5, gradient=True, thread="t1"), _ev("all-reduce", 4, 8),
              _ev("compute", 8, 9), _ev("compute", 12, 13)]
    (row,) = trace.step_timeline({"events": events,
                                  "steps": [{"step": 7, "start_ns": 0.0, "end_ns": 10e6}]})
    assert row["step"] == 7
    assert row["wall_ms"] == pytest.approx(10)
    assert row["compute_ms"] == pytest.approx(6)       # 0-5 and 8-9
    assert row["gradient_ms"] == pytest.approx(4)      # 1-5
    assert row["all_reduce_ms"] == pytest.approx(4)    # 4-8
    assert row["idle_ms"] == pytest.approx(1)          # 9-10
    assert row["overlap"] == pytest.approx(0.25)       # 1 ms of 4 under the backward pass
    assert row["all_reduce_exposed_ms"] == pytest.approx(3)


def test_step_without_all_reduce_has_no_overlap():
    (row,) = trace.step_timeline({"events": [_ev("compute", 0, 1)],
                                  "steps": [{"step": 0, "start_ns": 0.0, "end_ns": 2e6}]})
    assert row["all_reduce_ms"] == 0 and row["overlap"] is None
    text = trace.format_timeline("x", [row])
    (parsed,) = trace.parse_table(text)
    assert parsed["overlap"] is None and parsed["idle_ms"] == pytest.approx(1.0)


def test_format_and_parse_round_trip():
    rows = [{"step": i, "wall_ms": 10.0 + i, "compute_ms": 5.0, "all_reduce_ms": 3.0,
             "idle_ms": 2.0 + i, "overlap": 0.5, "gradient_ms": 4.0,
             "all_reduce_exposed_ms": 1.5} for i in (1, 2, 3)]
    text = trace.format_timeline("tfdp fused b=1M", rows)
    assert text.splitlines()[0] == "step timeline: tfdp fused b=1M"
    assert text.splitlines()[1].split() == ["step", "wall", "ms", "compute", "ms", "all-reduce",
                                            "ms", "idle", "ms", "overlap", "%"]
    parsed = trace.parse_table(text)
    assert [p["step"] for p in parsed] == [1, 2, 3]
    for p, r in zip(parsed, rows):
        for key in ("wall_ms", "compute_ms", "all_reduce_ms", "idle_ms", "overlap"):
            assert p[key] == pytest.approx(r[key])
    assert "median" in text.splitlines()[-1]


# --- end to end ---------------------------------------------------------------------------------

@pytest.mark.timeout(400)
@pytest.mark.slow
def test_fit_trace_cli(run_process, tmp_path):
    out_dir, js = tmp_path / "trace", tmp_path / "fit.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.pop("TFDP_CPU_REPLICAS", None)
    res = subprocess.run([sys.executable, "-m", "tfdp", "bench", "fit", "--layers", "3",
                          "--steps", "3", "--repeats", "1", "--cpu-replicas", "2",
                          "--trace", str(out_dir), "--trace-steps", "2", "--json", str(js)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    data = json.loads(js.read_text())
    names = [t["contender"] for t in data["trace"]]
    assert names == [r["contender"] for r in data["results"][:2]]  # tfdp, MirroredStrategy
    assert names[0].startswith("tfdp ") and names[1].startswith("MS ")

    printed = res.stdout.split("step timeline: ")[1:]
    assert len(printed) == 2
    for t, text in zip(data["trace"], printed):
        logdir = t["logdir"]
        assert os.path.dirname(logdir) == str(out_dir)
        # the TensorBoard trace TF wrote, and the Perfetto one beside it
        (xplane,) = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
        assert os.path.getsize(xplane) > 0 and xplane == t["xplane"]
        with gzip.open(os.path.join(logdir, "trace.json.gz"), "rt") as f:
            chrome = json.load(f)
        cats = {e.get("cat") for e in chrome["traceEvents"]}
        assert {"compute", "all-reduce", "step"} <= cats
        # the table: printed, in DIR, and in the JSON, one row per traced step (1, 2)
        for table in (text, open(os.path.join(logdir, "timeline.txt")).read()):
            rows = trace.parse_table(table)
            assert [r["step"] for r in rows] == [1, 2]
        assert [r["step"] for r in t["steps"]] == [1, 2]
        for r in t["steps"]:
            assert r["wall_ms"] > 0 and r["idle_ms"] >= 0
            assert r["compute_ms"] <= r["wall_ms"] + 1e-6
            assert r["all_reduce_ms"] <= r["wall_ms"] + 1e-6
            assert r["compute_ms"] + r["all_reduce_ms"] + r["idle_ms"] >= r["wall_ms"] - 1e-6
            assert r["overlap"] is None or 0 <= r["overlap"] <= 1
        assert t["ops"]["all-reduce"]["total_ms"] > 0, t["ops"]  # its all-reduce was found
        assert t["ops"]["compute"]["total_ms"] > 0
    both = open(out_dir / "timeline.txt").read()
    assert both.count("step timeline: ") == 2
    assert len(json.loads((out_dir / "timeline.json").read_text())) == 2

"""``tfdp bench zero``: arguments checked before TensorFlow starts, the table from raw figures, and
one memory contender end to end (no timing asserted)."""

import json
import subprocess
import sys

import pytest

from tfdp_bench import zero
from tfdp.errors import UsageError


@pytest.mark.parametrize("argv,match", [
    (["--models", "vgg"], "Invalid --models"), (["--parts", "disk"], "Invalid --parts"),
    (["--workers", "1"], "Invalid --workers"), (["--rounds", "0"], "Invalid --rounds"),
    (["--workers", "2", "--worker-replicas", "0"], "Invalid --worker-replicas")])
def test_bad_arguments_are_one_line_usage_errors(argv, match):
    with pytest.raises(UsageError, match=match):
        zero.parse_args(argv)


def test_format_from_raw_figures():
    result = {"cpu_replicas": 4, "rounds": 3, "memory": [
        {"model": "recommender", "stage": 0, "param_bytes": 51_200_000,
         "optimizer_bytes_per_device": [102_400_000] * 4, "peak_rss_growth": 900_000_000},
        {"model": "recommender", "stage": 1, "param_bytes": 51_200_000,
         "optimizer_bytes_per_device": [25_600_000] * 4, "peak_rss_growth": 420_000_000}],
        "speed": [{"model": "recommender", "optimizer": "adam", "contender": "tfdp zero_stage=1",
                   "step_ms": 90.0, "vs_mirrored": 4.0, "vs_mirrored_spread": [3.0, 5.0],
                   "vs_unsharded": 4.2, "vs_unsharded_spread": [3.1, 5.2]}]}
    text = zero.format_zero(result)
    row = next(ln for ln in text.splitlines() if ln.startswith("recommender  51.2 MB"))
    assert "102.4 MB" in row and "25.6 MB" in row and "0.25" in row and "0.47" in row
    assert "4.00x (3.00-5.00)" in text and "4.20x (3.10-5.20)" in text
    # across workers: each optimizer's contenders against its own unsharded run
    result["workers"] = {"workers": 2, "replicas_per_worker": 4, "results": [
        {"contender": "unsharded, momentum", "step_ms": 300.0, "ratio": 1.0,
         "spread": [1.0, 1.0], "largest_share": None},
        {"contender": "zero_stage=1, momentum", "step_ms": 100.0, "ratio": 3.0,
         "spread": [2.5, 3.5], "largest_share": 0.251}]}
    text = zero.format_zero(result)
    assert "Across 2 workers x 4 replicas" in text and "with momentum" in text
    assert "3.00x (2.50-3.50)" in text and "25.1 %" in text


@pytest.mark.timeout(300)
def test_memory_contender_reports_sharded_state(run_process):
    """One memory child (the recommender's table shrunk by the test): the sharded run holds a
    quarter of the unsharded optimizer state on its largest device."""
    config = {"model": "recommender", "stage": 1, "replicas": 4, "steps": 2, "batch": 64}
    code = ("import tfdp_bench.zero as z; z.REC['vocab'] = 20_000; "
            f"z._memory_child({json.dumps(config)})")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240, env={**__import__("os").environ,
                                           "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""})
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith(zero.RESULT_PREFIX))
    out = json.loads(line[len(zero.RESULT_PREFIX):])
    per_device = out["optimizer_bytes_per_device"]
    table = 20_000 * 64 * 4
    assert len(per_device) == 4 and max(per_device) <= 1.25 * 2 * table / 4  # Adam: 2 slots
    assert "split by rows: embedding/embeddings" in out["plan_table"]

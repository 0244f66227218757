"""tfdp bench input (tfdp_bench.input): the input-pipeline benchmark end to end, tiny sizes.

No timing assertions: exit code, table and JSON structure, positive rates.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(300)
def test_input_cli_tiny(run_process, tmp_path):
    out = tmp_path / "input.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TFDP_CPU_REPLICAS", None)
    res = subprocess.run([sys.executable, "-m", "tfdp", "bench", "input", "--files", "4",
                          "--examples", "400", "--batch", "64", "--workers", "2", "--repeats",
                          "1", "--train-steps", "2", "--files-dir", str(tmp_path),
                          "--json", str(out)], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=280)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert res.stdout.startswith("tfdp.data input benchmark: 400 interactions in 4 TFRecord")
    assert "training consumes" in res.stdout and "headroom" in res.stdout
    data = json.loads(out.read_text())
    assert data["num_files"] == 4 and data["workers"] == 2 and data["worker_batch_size"] == 32
    assert {(r["shard"], r["worker"]) for r in data["rows"]} == {
        (m, w) for m in ("files", "data") for w in (0, 1)}
    for r in data["rows"]:
        assert r["examples"] > 0 and r["examples_per_s"] > 0
    assert data["train_examples_per_s"] > 0 and set(data["headroom"]) == {"files", "data"}
    assert len(list(tmp_path.glob("*.tfrecord"))) == 4  # --files-dir kept the files

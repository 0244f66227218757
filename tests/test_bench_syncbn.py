"""``tfdp bench syncbn``: arguments checked before TensorFlow starts, the table from raw figures,
and the synchronized ResNet-50 really synchronized (no timing asserted; the measured figures are
in docs/benchmarks/index.md)."""

import pytest

from tfdp_bench import syncbn
from tfdp.errors import UsageError


@pytest.mark.parametrize("argv,match", [
    (["--image-size", "16"], "Invalid --image-size"), (["--steps", "0"], "Invalid --steps"),
    (["--classes", "1"], "Invalid --classes"), (["--repeats", "0"], "Invalid --repeats"),
    (["--batch", "2", "--cpu-replicas", "4"], "--batch is smaller than --cpu-replicas")])
def test_bad_arguments_are_one_line_usage_errors(argv, match):
    with pytest.raises(UsageError, match=match):
        syncbn.parse_args(argv)


def test_format_from_raw_figures():
    def row(strategy, synchronized, ms):
        name = "BatchNormalization(synchronized=True)" if synchronized else "plain"
        return {"contender": f"{strategy}, {name}", "strategy": strategy, "bn_layers": 53,
                "synchronized": synchronized, "median_step_ms": ms, "min_step_ms": ms - 10,
                "examples_per_s": 32 / ms * 1e3}
    result = {"image_size": 64, "classes": 10, "batch": 32, "steps": 6, "repeats": 4,
              "cpu_replicas": 4, "environment": {"cpu_cores": 2, "tensorflow": "2.21.0",
                                                 "keras": "3.15.1"},
              "results": [row("tfdp", False, 1000.0), row("tfdp", True, 1100.0),
                          row("MirroredStrategy", False, 1200.0),
                          row("MirroredStrategy", True, 1500.0)],
              "cost_synchronized_over_plain": {"tfdp": 1.1, "MirroredStrategy": 1.25}}
    text = syncbn.format_syncbn(result)
    assert "ResNet-50 (53 BatchNormalization layers)" in text
    assert "tfdp: synchronized / plain step = 1.100 (+10.0 %)" in text
    assert "MirroredStrategy: synchronized / plain step = 1.250 (+25.0 %)" in text
    assert "1,100" in text and "1,500" in text


def test_the_synchronized_model_synchronizes_every_batchnormalization():
    import keras
    plain = syncbn.resnet50(32, 2, synchronized=False)
    synced = syncbn.resnet50(32, 2, synchronized=True)
    bns = [[layer for layer in m.layers if isinstance(layer, keras.layers.BatchNormalization)]
           for m in (plain, synced)]
    assert len(bns[0]) == len(bns[1]) == 53
    assert not any(b.synchronized for b in bns[0]) and all(b.synchronized for b in bns[1])

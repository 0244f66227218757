"""``tfdp train``: configs, errors, targets, LR scaling, the Throughput callback, tiny runs of every
config on CPU replicas (in this process's 4 replicas, and one in a subprocess with its own count)
and one run across 2 workers through ``tfdp launch``."""

import glob
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import tfdp.cli
from tfdp.errors import UsageError
from tfdp.train import config as config_lib
from tfdp.train import lr as lr_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))
SCENARIOS = ("quickstart", "resnet_cifar10", "bert_mlm", "recommender", "workstation_vision")
# `python -m tfdp train` once the subcommand is registered in tfdp/cli.py; the same code otherwise
TRAIN = [sys.executable, "-m", "tfdp", "train"] if "train" in tfdp.cli.SUBCOMMANDS else \
    [sys.executable, "-m", "tfdp.train"]


def _env():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TFDP_CPU_REPLICAS", None)
    env.pop("TF_CONFIG", None)
    return env


def _cli(args, timeout=60):
    return subprocess.run([*TRAIN, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=_env(), stdin=subprocess.DEVNULL)


def _write(tmp_path, text, name="job.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


GOOD = """
[data]
source = "digits"
global_batch_size = 64
[model]
kind = "cnn"
"""


# --- configs -----------------------------------------------------------------------------------

def test_every_scenario_has_a_config():
    names = {os.path.splitext(os.path.basename(p))[0] for p in CONFIGS}
    assert set(SCENARIOS) <= names


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
@pytest.mark.parametrize("tiny", [False, True], ids=["full", "tiny"])
def test_configs_validate(path, tiny):
    cfg = config_lib.load(path, tiny=tiny)
    assert cfg.name == os.path.splitext(os.path.basename(path))[0]
    if tiny:
        assert cfg["train"]["epochs"] == 1 and cfg["train"]["steps_per_epoch"] <= 3
        assert cfg.targets == {}          # the file's targets are not checked with --tiny
    else:
        assert cfg.targets, "every shipped config states at least one target"


def test_defaults_filled_and_overrides_parsed(tmp_path):
    cfg = config_lib.load(_write(tmp_path, GOOD), ["train.epochs=3", "strategy.all_reduce=ring",
                                                   "model.filters=4", "targets.max_loss=2"])
    assert cfg["train"]["epochs"] == 3 and cfg["strategy"]["all_reduce"] == "ring"
    assert cfg["model"] == {"kind": "cnn", "filters": 4, "dense_units": 64}
    assert cfg["train"]["optimizer"] == "adam" and cfg["data"]["test_examples"] == 360
    assert cfg.targets == {"max_loss": 2.0}
    tiny = config_lib.load(_write(tmp_path, GOOD), ["targets.max_loss=2"], tiny=True)
    assert tiny.targets == {"max_loss": 2.0}      # --set targets are checked even with --tiny


def test_all_reduce_names_match_the_registry():
    from tfdp.reduce.registry import ALGORITHMS
    assert tuple(ALGORITHMS) == config_lib.ALGORITHMS


@pytest.mark.parametrize("text,overrides,needles", [
    (GOOD + "[train]\nepoch = 3\n", [], ["Unknown key", "train.epoch", "train.epochs",
                                         "train.steps_per_epoch"]),
    (GOOD, ["train.lerning_rate=0.1"], ["Unknown key", "train.lerning_rate",
                                        "train.learning_rate"]),
    (GOOD + "[trian]\nepochs = 3\n", [], ["Unknown section", "[trian]", "[train]"]),
    (GOOD + "[train]\nepochs = 'ten'\n", [], ["Invalid train.epochs", "'ten'", "a string",
                                              "integer >= 1"]),
    (GOOD + "[train]\nepochs = 0\n", [], ["Invalid train.epochs", "=0", "integer >= 1"]),
    (GOOD + "[strategy]\nall_reduce = 'rnig'\n", [], ["strategy.all_reduce", "'rnig'", "'ring'"]),
    (GOOD.replace("digits", "imagenet"), [], ["data.source", "'imagenet'", "'digits'"]),
    (GOOD + "[targets]\nmin_auc = 0.7\n", [], ["targets.min_auc", "'auc'", "accuracy"]),
    (GOOD.replace('kind = "cnn"', 'kind = "bert"'), [], ["'bert'", "'digits'",
                                                         "synthetic_text"]),
    ('[model]\nkind = "cnn"\n', [], ["Missing data.source"]),
    (GOOD.replace("global_batch_size = 64\n", ""), [], ["Missing data.global_batch_size"]),
    (GOOD + "[data]\nx = 1\n", [], ["Invalid TOML"]),
    (GOOD, ["epochs=3"], ["Invalid --set", "SECTION.KEY=VALUE"]),
])
def test_bad_configs_name_the_key(tmp_path, text, overrides, needles):
    with pytest.raises(UsageError) as e:
        config_lib.load(_write(tmp_path, text), overrides)
    msg = str(e.value)
    assert "\n" not in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_missing_config_file_lists_available(tmp_path):
    (tmp_path / "a.toml").write_text(GOOD)
    with pytest.raises(UsageError, match=r"not found.*nope\.toml.*a\.toml"):
        config_lib.load(str(tmp_path / "nope.toml"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["unknown_key", "wrong_type", "missing_file", "bad_flag"])
def test_cli_bad_config_is_one_line_exit_2(tmp_path, case):
    args = {"unknown_key": lambda: [_write(tmp_path, GOOD + "[train]\nepoch = 3\n")],
            "wrong_type": lambda: [_write(tmp_path, GOOD.replace("= 64", "= 'many'"))],
            "missing_file": lambda: [str(tmp_path / "missing.toml")],
            "bad_flag": lambda: [_write(tmp_path, GOOD), "--tinny"]}[case]()
    p = _cli(args, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("tfdp train: error: ")
    expected = {"unknown_key": "train.epoch", "wrong_type": "data.global_batch_size",
                "missing_file": "missing.toml", "bad_flag": "--tinny"}[case]
    assert expected in lines[0]


# --- learning-rate scaling ---------------------------------------------------------------------

def test_linear_scaling_rule():
    assert lr_lib.linear_scaled_lr(0.1, 8192, 256) == pytest.approx(3.2)   # Goyal et al.
    assert lr_lib.linear_scaled_lr(0.1, 128, 256) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="base_batch_size"):
        lr_lib.linear_scaled_lr(0.1, 128, 0)


def test_warmup_then_constant_or_cosine():
    kw = dict(base_lr=0.1, peak_lr=3.2, warmup_steps=100)
    assert lr_lib.learning_rate_at(0, **kw) == pytest.approx(0.1)
    assert lr_lib.learning_rate_at(50, **kw) == pytest.approx(1.65)
    assert lr_lib.learning_rate_at(100, **kw) == pytest.approx(3.2)
    assert lr_lib.learning_rate_at(10_000, **kw) == pytest.approx(3.2)
    cos = dict(kw, total_steps=300, schedule="cosine")
    assert lr_lib.learning_rate_at(100, **cos) == pytest.approx(3.2)
    assert lr_lib.learning_rate_at(200, **cos) == pytest.approx(1.6)
    assert lr_lib.learning_rate_at(300, **cos) == pytest.approx(0.0, abs=1e-12)


def test_plan_from_config_and_keras_schedule_agree():
    train = {"learning_rate": 0.1, "lr_scaling": "linear", "base_batch_size": 256,
             "warmup_epochs": 2.0, "epochs": 10, "schedule": "cosine"}
    plan = lr_lib.plan(train, global_batch_size=1024, steps_per_epoch=50)
    assert plan["peak_lr"] == pytest.approx(0.4) and plan["warmup_steps"] == 100
    assert plan["total_steps"] == 500 and "0.1 x 1024/256 = 0.4" in plan["text"]
    from tfdp.train.schedule import WarmupSchedule
    sched = WarmupSchedule(plan["base_lr"], plan["peak_lr"], plan["warmup_steps"],
                           plan["total_steps"], "cosine")
    for step in (0, 1, 50, 99, 100, 250, 499, 500, 600):
        want = lr_lib.learning_rate_at(step, base_lr=0.1, peak_lr=0.4, warmup_steps=100,
                                       total_steps=500, schedule="cosine")
        assert float(sched(step)) == pytest.approx(want, rel=1e-5, abs=1e-7), step
    no_scaling = lr_lib.plan(dict(train, lr_scaling="none", warmup_epochs=0.0), 1024, 50)
    assert no_scaling["peak_lr"] == no_scaling["base_lr"] == pytest.approx(0.1)


# --- Throughput callback -----------------------------------------------------------------------

def _tiny_fit(callback, n=200, batch=32, epochs=2):
    import keras
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(n, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, callbacks=[callback])
    return model


@pytest.mark.timeout(60)
def test_throughput_figures_are_sane(tmp_path):
    from tfdp.callbacks import Throughput
    import tensorflow as tf
    meter = Throughput(32, 4, log_dir=str(tmp_path / "tb"), examples_per_epoch=200)
    _tiny_fit(meter)                       # 7 steps per epoch (the last has 8 examples), 2 epochs
    s = meter.summary()
    assert s["steps"] == 13 == len(meter.step_times)    # the first step (tracing) left out
    assert s["examples"] == 2 * 200 - 32
    assert s["examples_per_sec"] > 0 and s["seconds"] > 0
    assert s["examples_per_sec_per_replica"] == pytest.approx(s["examples_per_sec"] / 4)
    assert 0 < s["step_time_ms_p50"] <= s["step_time_ms_p90"] <= s["step_time_ms_p99"]
    assert s["step_time_ms_p99"] <= max(meter.step_times) * 1e3 + 1e-9
    assert s["gap_ms_p50"] >= 0
    assert meter.stragglers is None        # one worker: no report, no communication
    tags = set()
    for f in glob.glob(str(tmp_path / "tb" / "events.*")):
        for rec in tf.data.TFRecordDataset(f):
            ev = tf.compat.v1.Event.FromString(rec.numpy())
            tags.update(v.tag for v in ev.summary.value)
    assert {"throughput/examples_per_sec", "throughput/examples_per_sec_per_replica",
            "step_time_ms/p50", "step_time_ms/p90", "step_time_ms/p99",
            "throughput/examples_per_sec/total"} <= tags


def test_throughput_rejects_bad_arguments():
    from tfdp.callbacks import Throughput
    with pytest.raises(ValueError, match="global_batch_size"):
        Throughput(0, 4)
    with pytest.raises(ValueError, match="num_replicas"):
        Throughput(32, "4")


def test_percentiles_ordered():
    from tfdp.callbacks import percentiles_ms
    p = percentiles_ms(list(np.random.default_rng(1).exponential(0.05, 1000)))
    assert 0 < p["p50"] <= p["p90"] <= p["p99"]
    assert percentiles_ms([]) == {}


def test_straggler_report_single_worker_is_a_noop():
    import tensorflow as tf
    from tfdp.callbacks import gather_per_worker, straggler_report
    strategy = tf.distribute.get_strategy()
    assert straggler_report(strategy, {"step_ms_p50": 10.0}) is None
    np.testing.assert_array_equal(gather_per_worker(strategy, [1.0, 2.0]), [[1.0, 2.0]])


def test_straggler_report_names_the_slowest(monkeypatch):
    from tfdp.callbacks import throughput as tp
    table = np.array([[5.0, 40.0, 1.0], [9.0, 40.5, 0.5], [5.5, 40.2, 3.0]])
    monkeypatch.setattr(tp, "gather_per_worker", lambda strategy, values: table)
    r = tp.straggler_report(None, {"compute_ms_p50": 5.0, "step_ms_p50": 40.0,
                                   "host_gap_ms_p50": 1.0},
                            rank_by=("compute_ms_p50", "host_gap_ms_p50"))
    assert r.slowest == 1 and r.fastest == 0 and r.own_ms == [6.0, 9.5, 8.5]
    assert r.ratio == pytest.approx(9.5 / 6.0)
    assert "Slowest: worker 1" in r.text() and "worker 2: compute 5.5 ms" in r.text()


# --- targets -----------------------------------------------------------------------------------

def test_check_targets():
    from tfdp.train.runner import Result, check_targets
    r = Result(name="x", replicas=4, workers=1, rank=0, devices=["CPU:0"] * 4,
               global_batch_size=128, replica_batches=[32] * 4, steps_per_epoch=1, epochs=1,
               seconds=1.0, data="", synthetic=False, params=1, lr="",
               throughput={"step_time_ms_p50": 30.0, "examples_per_sec": 1000.0},
               eval_metrics={"accuracy": 0.96, "loss": 0.2}, train_metrics={})
    got = check_targets({"min_accuracy": 0.95, "max_step_time_ms": 20.0, "max_loss": 0.3,
                         "min_scaling_efficiency": 0.5}, r)
    assert [(k, ok) for k, _, _, ok, _ in got] == [
        ("min_accuracy", True), ("max_step_time_ms", False), ("max_loss", True),
        ("min_scaling_efficiency", False)]          # not measured: a miss, never a pass
    r.baseline = {"examples_per_sec": 400.0}
    assert r.scaling_efficiency == pytest.approx(1000 / 1600)


# --- tiny runs of every config -----------------------------------------------------------------

def _run_tiny(name, *overrides):
    from tfdp.train import load, run
    cfg = load(os.path.join(ROOT, "configs", f"{name}.toml"),
               ["strategy.cpu_replicas=4", *overrides], tiny=True)   # this process has 4
    return run(cfg)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["bert_mlm", "workstation_vision"])  # quickstart: CLI tests
def test_tiny_config_runs_on_cpu_replicas(name):
    r = _run_tiny(name)
    assert r.replicas == 4 and r.workers == 1 and r.rank == 0
    assert r.throughput["steps"] == 2 and r.throughput["examples_per_sec"] > 0
    assert math.isfinite(r.eval_metrics["loss"]) and 0 <= r.eval_metrics["accuracy"] <= 1
    assert r.allreduce and r.allreduce["ms"] > 0 and r.allreduce["floats"] > 0
    if name == "bert_mlm":
        assert r.allreduce["excluded"] == 1 and r.synthetic   # the token embedding table
    if name == "workstation_vision":   # the config asks for the scaling baseline
        assert r.baseline["examples_per_sec"] > 0 and r.scaling_efficiency > 0
    assert r.targets == [] and not r.missed


@pytest.mark.timeout(120)
def test_tiny_recommender_writes_and_shards_tfrecords(tmp_path):
    r = _run_tiny("recommender", f"data.dir={str(tmp_path)!r}")
    files = sorted(os.listdir(tmp_path))
    assert [f for f in files if f.endswith(".tfrecord")] == [
        "eval-00000-of-00001.tfrecord", "train-00000-of-00002.tfrecord",
        "train-00001-of-00002.tfrecord"]
    assert {"accuracy", "auc", "loss"} <= set(r.eval_metrics)
    assert r.allreduce["excluded"] == 2              # user + item tables: sparse, not estimated
    from tfdp.train import runner
    text = runner.summary(r)
    assert "SYNTHETIC" in text and "embedding table(s) left out" in text


@pytest.mark.timeout(120)
def test_tiny_resnet_cifar10_synthetic_stand_in():
    r = _run_tiny("resnet_cifar10")
    assert r.synthetic and "SYNTHETIC cifar10 stand-in" in r.data   # no cifar10 prepared here
    assert r.global_batch_size == 256 and r.replica_batches == [64] * 4
    assert r.throughput["steps"] == 2 and math.isfinite(r.eval_metrics["loss"])
    from tfdp.train import runner
    text = runner.summary(r)
    assert "[SYNTHETIC data]" in text and "ESTIMATE" in text


@pytest.mark.timeout(150)
def test_cli_tiny_run_summary_and_missed_target():
    """The CLI end to end in a fresh process; a missed target exits 3 naming the figure and the
    target (targets given with --set are checked even with --tiny)."""
    p = _cli(["configs/quickstart.toml", "--tiny", "--set", "targets.max_step_time_ms=0.001"],
             timeout=140)
    out = p.stdout
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    assert "replicas      4 (1 worker(s) x 4: CPU:0, CPU:1, CPU:2, CPU:3)" in out
    assert "global 128, per replica 32" in out and "examples/s" in out
    assert "p50" in out and "p90" in out and "p99" in out
    assert "ESTIMATE" in out and "final metrics test: accuracy" in out
    assert "target        max_step_time_ms: p50 step time (ms)" in out and "MISSED" in out
    missed = [ln for ln in p.stderr.splitlines() if "target missed" in ln]
    assert len(missed) == 1 and "p50 step time" in missed[0] and "max_step_time_ms = 0.001" in \
        missed[0], p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
@pytest.mark.parametrize("name", ["resnet_cifar10", "bert_mlm", "recommender",
                                  "workstation_vision"])
def test_tiny_config_across_two_workers(name, tmp_path):
    extra = ["--set", f"data.dir={str(tmp_path)!r}"] if name == "recommender" else []
    cmd = [sys.executable, "-m", "tfdp", "launch", "--workers", "2", "--cpu-replicas", "2",
           "--timeout", "230", "--", *TRAIN, f"configs/{name}.toml", "--tiny", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=250, env=_env(),
                       stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert "[worker 0]   replicas      4 (2 worker(s) x 2" in out
    assert f"[worker 1] tfdp train: {name} finished on worker 1" in out


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_tiny_quickstart_across_two_workers():
    cmd = [sys.executable, "-m", "tfdp", "launch", "--workers", "2", "--cpu-replicas", "2",
           "--timeout", "230", "--", *TRAIN, "configs/quickstart.toml", "--tiny"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=250, env=_env(),
                       stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert "[worker 0]   replicas      4 (2 worker(s) x 2" in out
    assert "[worker 0]   stragglers    2 workers" in out and "Slowest: worker" in out
    assert "[worker 1] tfdp train: quickstart finished on worker 1" in out

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


def _bad_config_args(tmp_path, case):
    return {"unknown_key": lambda: [_write(tmp_path, GOOD + "[train]\nepoch = 3\n")],
            "wrong_type": lambda: [_write(tmp_path, GOOD.replace("= 64", "= 'many'"))],
            "missing_file": lambda: [str(tmp_path / "missing.toml")],
            "bad_flag": lambda: [_write(tmp_path, GOOD), "--tinny"]}[case]()


def _check_bad_config(case, returncode, stderr):
    assert returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("tfdp train: error: ")
    expected = {"unknown_key": "train.epoch", "wrong_type": "data.global_batch_size",
                "missing_file": "missing.toml", "bad_flag": "--tinny"}[case]
    assert expected in lines[0]


@pytest.mark.timeout(60)
def test_cli_bad_config_through_the_real_entry_point(run_process, tmp_path):
    """``python -m tfdp train`` itself (a process, as a user runs it) with an unknown key; the
    other bad configs run in this process (below)."""
    p = _cli(_bad_config_args(tmp_path, "unknown_key"), timeout=60)
    _check_bad_config("unknown_key", p.returncode, p.stderr)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["wrong_type", "missing_file", "bad_flag"])
def test_cli_bad_config_is_one_line_exit_2(tfdp_cli, tmp_path, case):
    code, _, err = tfdp_cli(["train", *_bad_config_args(tmp_path, case)])
    _check_bad_config(case, code, err)


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
    # three workers' figures, and (last column) when each reached the all-gather
    table = np.array([[5.0, 40.0, 1.0, 100.0], [9.0, 40.5, 0.5, 102.5], [5.5, 40.2, 3.0, 101.0]])
    sent = []
    monkeypatch.setattr(tp, "num_workers", lambda strategy: 3)
    monkeypatch.setattr(tp, "gather_per_worker",
                        lambda strategy, values: sent.append(values) or table)
    r = tp.straggler_report(None, {"compute_ms_p50": 5.0, "step_ms_p50": 40.0,
                                   "host_gap_ms_p50": 1.0},
                            rank_by=("compute_ms_p50", "host_gap_ms_p50"))
    assert sent[0][:3] == [5.0, 40.0, 1.0] and 0.0 <= sent[0][3] < 1000.0  # + its arrival
    assert r.slowest == 1 and r.fastest == 0 and r.own_ms == [6.0, 9.5, 8.5]
    assert r.ratio == pytest.approx(9.5 / 6.0)
    assert "Slowest: worker 1" in r.text() and "worker 2: compute 5.5 ms" in r.text()
    # waited: until the last worker arrived (worker 1, 2.5 s after worker 0)
    assert [r.waited_s(w) for w in range(3)] == pytest.approx([2.5, 0.0, 1.5])


def test_straggler_wait_across_the_fold_of_the_arrival_clock():
    from tfdp.callbacks.throughput import StragglerReport
    r = StragglerReport(figures={}, rank_by=(), slowest=0, fastest=0, own_ms=[1.0, 1.0],
                        arrived_at=[999.5, 0.75])   # worker 1 arrived 1.25 s after worker 0
    assert r.waited_s(0) == pytest.approx(1.25) and r.waited_s(1) == 0.0


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
    assert r.global_batch_size == 64 and r.replica_batches == [16] * 4   # --tiny: at most 64
    assert r.throughput["steps"] == 2 and math.isfinite(r.eval_metrics["loss"])
    from tfdp.train import runner
    text = runner.summary(r)
    assert "[SYNTHETIC data]" in text and "ESTIMATE" in text


@pytest.mark.timeout(150)
def test_cli_tiny_run_summary_and_missed_target(run_process):
    """The CLI end to end in a fresh process; a missed target exits 3 naming the figure and the
    target (targets given with --set are checked even with --tiny)."""
    p = _cli(["configs/quickstart.toml", "--tiny", "--set", "targets.max_step_time_ms=0.001"],
             timeout=140)
    out = p.stdout
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    # --tiny: at most 2 CPU replicas and 64 examples per global batch (the config: 4 and 128)
    assert "replicas      2 (1 worker(s) x 2: CPU:0, CPU:1)" in out
    assert "CPU replicas from [strategy] cpu_replicas = 2  (--tiny: at most 2)" in out
    assert "global 64, per replica 32" in out and "examples/s" in out
    assert "p50" in out and "p90" in out and "p99" in out
    assert "ESTIMATE" in out and "final metrics test: accuracy" in out
    assert "target        max_step_time_ms: p50 step time (ms)" in out and "MISSED" in out
    missed = [ln for ln in p.stderr.splitlines() if "target missed" in ln]
    assert len(missed) == 1 and "p50 step time" in missed[0] and "max_step_time_ms = 0.001" in \
        missed[0], p.stderr
    assert "Traceback" not in p.stderr
    # quiet by default: none of TensorFlow's C++ INFO/WARNING lines, not even the load-time ones
    for noise in ("oneDNN custom operations", "absl::InitializeLog", "I0000 ", "W0000 "):
        assert noise not in p.stderr and noise not in p.stdout, p.stderr


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["--verbose", "TF_CPP_MIN_LOG_LEVEL=0"])
def test_cli_loud_on_request(run_process, tmp_path, how):
    env = _env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    args = [_write(tmp_path, GOOD), "--tiny", "--set", "monitor.allreduce_estimate=false"]
    if how == "--verbose":
        args.append("--verbose")
    else:
        env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    p = subprocess.run([*TRAIN, *args], cwd=ROOT, capture_output=True, text=True, timeout=140,
                       env=env, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    # TF's own INFO lines are shown: which ones depends on the CPU (the oneDNN notice where
    # oneDNN is on by default; the cpu_feature_guard line elsewhere), each an "I0000 " line
    assert any(line in p.stderr for line in ("oneDNN custom operations", "I0000 ")), p.stderr


@pytest.mark.timeout(260)
@pytest.mark.parametrize("name", ["resnet_cifar10", "bert_mlm", "recommender",
                                  "workstation_vision"])
def test_tiny_config_across_two_workers(run_process, name, tmp_path):
    extra = ["--set", f"data.dir={str(tmp_path)!r}"] if name == "recommender" else []
    cmd = [sys.executable, "-m", "tfdp", "launch", "--output", "all",
           "--workers", "2", "--cpu-replicas", "2",
           "--timeout", "230", "--", *TRAIN, f"configs/{name}.toml", "--tiny", *extra]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=250, env=_env(),
                       stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert "[worker 0]   replicas      4 (2 worker(s) x 2" in out
    assert f"[worker 1] tfdp train: {name} finished on worker 1" in out


@pytest.mark.timeout(260)
def test_tiny_quickstart_across_two_workers(run_process):
    cmd = [sys.executable, "-m", "tfdp", "launch", "--output", "all",
           "--workers", "2", "--cpu-replicas", "2",
           "--timeout", "230", "--", *TRAIN, "configs/quickstart.toml", "--tiny"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=250, env=_env(),
                       stdin=subprocess.DEVNULL)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert "[worker 0]   replicas      4 (2 worker(s) x 2" in out
    assert "[worker 0]   stragglers    2 workers" in out and "Slowest: worker" in out
    assert "[worker 1] tfdp train: quickstart finished on worker 1" in out


# --- learning-rate plan: no warm-up that changes nothing, none that fills the run ---------------

def test_plan_drops_a_warmup_that_changes_nothing_and_caps_one_that_fills_the_run():
    train = {"learning_rate": 0.1, "lr_scaling": "linear", "base_batch_size": 256,
             "warmup_epochs": 1.0, "epochs": 1, "schedule": "cosine"}
    same = lr_lib.plan(train, global_batch_size=256, steps_per_epoch=12)   # 0.1 -> 0.1
    assert same["warmup_steps"] == 0 and "warm-up" not in same["text"]
    assert same["base_lr"] == same["peak_lr"] == pytest.approx(0.1)
    capped = lr_lib.plan(train, global_batch_size=1024, steps_per_epoch=12)
    assert capped["warmup_steps"] == 6 and capped["total_steps"] == 12   # half the run
    assert "capped at half the run" in capped["text"]
    # after the capped warm-up the cosine decay runs: the last step is near 0, not the peak
    last = lr_lib.learning_rate_at(11, base_lr=capped["base_lr"], peak_lr=capped["peak_lr"],
                                   warmup_steps=6, total_steps=12, schedule="cosine")
    assert last < 0.1 * capped["peak_lr"]
    full = lr_lib.plan(dict(train, epochs=3), global_batch_size=1024, steps_per_epoch=12)
    assert full["warmup_steps"] == 12 and "warm-up 1 epoch(s) = 12 steps from 0.1" in full["text"]


# --- precedence: --set > TFDP_CPU_REPLICAS > the config ----------------------------------------

def test_cpu_replicas_precedence(tmp_path):
    from tfdp.train.runner import cpu_replicas_choice
    path = _write(tmp_path, GOOD + "[strategy]\ncpu_replicas = 3\n")
    plain = config_lib.load(path)
    assert cpu_replicas_choice(plain, None) == (3, "[strategy] cpu_replicas = 3")
    n, why = cpu_replicas_choice(plain, 2)
    assert n == 2 and "TFDP_CPU_REPLICAS=2 (overrides the config's cpu_replicas = 3)" in why
    given = config_lib.load(path, ["strategy.cpu_replicas=4"])
    n, why = cpu_replicas_choice(given, 2)
    assert n == 4 and "overrides TFDP_CPU_REPLICAS=2" in why and "arguments win" in why
    tiny = config_lib.load(path, tiny=True)
    assert tiny["strategy"]["cpu_replicas"] == 2          # --tiny: at most 2
    assert config_lib.load(path, ["strategy.cpu_replicas=3"], tiny=True)[
        "strategy"]["cpu_replicas"] == 3                  # unless given as an argument


@pytest.mark.timeout(60)
def test_cli_bad_cpu_replicas_variable_is_a_usage_error(monkeypatch, capsys, tmp_path):
    """``tfdp train`` in this process (``tfdp.cli.main``, as ``python -m tfdp train`` runs it)
    with TFDP_CPU_REPLICAS=four: found before TensorFlow work starts."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("TFDP_CPU_REPLICAS", "four")
    capsys.readouterr()
    returncode = tfdp.cli.main(["train", _write(tmp_path, GOOD)])
    stderr = capsys.readouterr().err
    assert returncode == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert "Invalid TFDP_CPU_REPLICAS" in lines[0] and "'four'" in lines[0]


# --- your own model and data: [model] builder, [data] builder ------------------------------------

BUILDERS = '''
import keras
import tensorflow as tf
import numpy as np

def model(units=8, classes=3):
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(units, activation="relu"),
                          keras.layers.BatchNormalization(), keras.layers.Dense(classes)])
    return m, keras.losses.SparseCategoricalCrossentropy(from_logits=True), ["accuracy"]

def bare_model(units=8):
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])

def not_a_model():
    return "a string"

def _arrays(n):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0).astype("int32")

def global_data(global_batch_size, n=256):
    x, y = _arrays(n)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    return ds.batch(global_batch_size), ds.take(64).batch(global_batch_size)

def context_data(input_context, global_batch_size, n=256):
    x, y = _arrays(n)
    per = input_context.get_per_replica_batch_size(global_batch_size)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(input_context.num_input_pipelines,
                                                         input_context.input_pipeline_id)
    return ds.batch(per), ds.take(64).batch(per)

def bad_data(global_batch_size):
    return [1, 2]

def no_batch_arg(n=3):
    return None
'''


def _builder_config(tmp_path, data="global_data", model="model", extra=""):
    mod = tmp_path / "my_builders.py"
    mod.write_text(BUILDERS)
    return _write(tmp_path, f"""
[strategy]
cpu_replicas = 4
[data]
builder = "my_builders:{data}"
global_batch_size = 32
[model]
builder = "my_builders:{model}"
{extra}
[train]
epochs = 2
learning_rate = 0.01
""")


def test_builder_configs_validate(tmp_path):
    cfg = config_lib.load(_builder_config(tmp_path, extra="units = 16"))
    assert cfg["model"]["builder"] == "my_builders:model"
    assert cfg["model"]["kwargs"] == {"units": 16} and cfg["data"]["kwargs"] == {}
    assert cfg["data"]["global_batch_size"] == 32
    tiny = config_lib.load(_builder_config(tmp_path), tiny=True)
    assert tiny["train"]["steps_per_epoch"] == 3
    with pytest.raises(UsageError, match=r"both 'kind' and 'builder'"):
        config_lib.load(_builder_config(tmp_path, extra='kind = "cnn"'))
    with pytest.raises(UsageError, match=r"Invalid model.builder.*package.module:function"):
        config_lib.load(_builder_config(tmp_path, model="model:"))
    with pytest.raises(UsageError, match=r"Missing model.kind.*builder"):
        config_lib.load(_write(tmp_path, "[data]\nsource = 'digits'\nglobal_batch_size = 8\n"
                                         "[model]\nunits = 3\n"))


@pytest.mark.parametrize("data,model,extra,exc,needles", [
    ("global_data", "model", "", None, []),
    ("global_data", "nope", "", UsageError, ["no function 'nope'", "Functions defined there",
                                             "global_data", "model"]),
    ("global_data", "model", "colour = 'red'", UsageError, ["does not take 'colour'",
                                                            "model.colour='red'",
                                                            "Its parameters: units, classes"]),
    ("global_data", "not_a_model", "", ValueError, ["returned the wrong type", "str"]),
    ("global_data", "bare_model", "", ValueError, ["without a loss", "[model] loss"]),
    ("bad_data", "model", "", ValueError, ["data.builder", "returned the wrong type",
                                           "list of (int, int)", "tf.data.Dataset"]),
    ("no_batch_arg", "model", "", UsageError, ["neither input_context nor global_batch_size"]),
])
def test_builder_errors_are_one_clear_line(tmp_path, data, model, extra, exc, needles):
    from tfdp.train import builders
    from tfdp.train import data as data_lib
    cfg = config_lib.load(_builder_config(tmp_path, data, model, extra))
    if exc is None:
        m, loss, metrics, _ = builders.build_model(cfg["model"], cfg.path)
        assert m.name and loss is not None and metrics == ["accuracy"]
        return
    with pytest.raises(exc) as e:
        builders.build_model(cfg["model"], cfg.path)
        d = data_lib.build(cfg)
        import tensorflow as tf
        d.train(tf.distribute.get_strategy(), 32, 0)
    msg = str(e.value)
    assert "\n" not in msg and "Received:" in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


def test_builder_missing_module_names_it(tmp_path):
    from tfdp.train import builders
    cfg = config_lib.load(_builder_config(tmp_path))
    cfg["model"]["builder"] = "not_there_at_all:model"
    with pytest.raises(UsageError, match=r"no module named 'not_there_at_all'.*next to the "
                                         r"config"):
        builders.build_model(cfg["model"], cfg.path)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("data", ["global_data", "context_data"])
def test_builder_run_trains_on_cpu_replicas(tmp_path, data):
    from tfdp.train import load, run
    path = _builder_config(tmp_path, data=data, extra="units = 16")
    r = run(load(path, ["strategy.cpu_replicas=4", "targets.min_accuracy=0.0"]))
    assert r.replicas == 4 and r.steps_per_epoch == 8        # 256 / 32: the cardinality
    assert r.throughput["steps"] == 15 and math.isfinite(r.eval_metrics["loss"])
    assert 0 <= r.eval_metrics["accuracy"] <= 1 and not r.missed
    assert "my_builders:" in r.data and "your datasets" in r.data


@pytest.mark.timeout(180)
def test_example_custom_model_config_tiny():
    from tfdp.train import load, run
    r = run(load(os.path.join(ROOT, "examples", "custom_model.toml"),
                 ["strategy.cpu_replicas=4"], tiny=True))
    assert r.replicas == 4 and r.throughput["steps"] == 2
    assert "custom_model:build_data" in r.data and r.eval_metrics["accuracy"] >= 0


# --- precise BatchNorm statistics --------------------------------------------------------------

def test_precise_bn_sets_the_average_batch_statistics_on_every_replica():
    import keras
    import tensorflow as tf
    from tfdp import DataParallelStrategy
    from tfdp.train import precise_bn
    strategy = DataParallelStrategy()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        inner = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization()])
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3), inner,
                                  keras.layers.BatchNormalization(momentum=0.9)])
    bns = precise_bn.batchnorm_layers(model)
    assert len(bns) == 2                                      # nested ones too
    rng = np.random.default_rng(1)
    batches = [rng.normal(2.0, 3.0, size=(16, 3)).astype("float32") for _ in range(5)]
    h = [np.asarray(model.layers[0](b)) for b in batches]   # the first BN's inputs
    assert precise_bn.recompute(model, batches, strategy) == 5
    first = bns[0] if bns[0] in inner.layers else bns[1]
    np.testing.assert_allclose(np.asarray(first.moving_mean),
                               np.mean([x.mean(0) for x in h], 0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(first.moving_variance),
                               np.mean([x.var(0) for x in h], 0), rtol=1e-5, atol=1e-6)
    for layer in bns:
        assert layer.momentum in (0.99, 0.9)                  # restored
        for v in (layer.moving_mean, layer.moving_variance):
            copies = [np.asarray(c) for c in strategy.experimental_local_results(v.value)]
            assert len(copies) == 4 and all(np.array_equal(c, copies[0]) for c in copies)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert precise_bn.recompute(plain, batches) == 0        # no BatchNorm: nothing done
    del tf


# --- issue 23: --set errors, builders checked before TensorFlow, relative targets, small batches --

@pytest.mark.parametrize("overrides, needles, absent", [
    (["train.epochs=abc"], ["Invalid train.epochs (given by --set train.epochs=abc)",
                            "train.epochs='abc'", "integer >= 1"], ["job.toml"]),
    (["train.epoch=3"], ["Unknown key given by --set train.epoch=3", "train.epochs"],
     ["job.toml"]),
    (["data.global_batch_size=0"], ["(given by --set data.global_batch_size=0)"], ["job.toml"]),
    ([], [], []),
])
def test_set_errors_name_set_not_the_file(tmp_path, overrides, needles, absent):
    path = _write(tmp_path, GOOD + "[train]\nepochs = 'ten'\n" if not overrides else GOOD)
    with pytest.raises(UsageError) as e:
        config_lib.load(path, overrides)
    msg = str(e.value)
    if not overrides:   # a bad value in the file still names the file
        assert f"Invalid train.epochs in {path}" in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    for n in absent:
        assert n not in msg, (n, msg)


# A builder module whose import would fail (it stands for one that imports TensorFlow): the checks
# before TensorFlow starts read its source, they never import it.
UNIMPORTABLE = '''
raise RuntimeError("imported")

def model(units=8, *, classes=3):
    pass

def data(global_batch_size, n=256):
    pass

def per_replica(input_context, n):
    pass

def neither(n=3):
    pass

@some_decorator
def decorated(x):
    pass

assigned = model
'''


def _precheck(tmp_path, model="model", data="data", model_extra="", data_extra=""):
    from tfdp.train import builders
    (tmp_path / "never_imported.py").write_text(UNIMPORTABLE)
    path = _write(tmp_path, f"""
[data]
builder = "never_imported:{data}"
global_batch_size = 32
{data_extra}
[model]
builder = "never_imported:{model}"
{model_extra}
""")
    builders.precheck(config_lib.load(path))


@pytest.mark.parametrize("kwargs, needles", [
    ({}, None),
    ({"model": "modle"}, ["model.builder: module 'never_imported' has no function 'modle'",
                          "Functions defined there: data, decorated, model, neither, "
                          "per_replica"]),
    ({"model_extra": "unit = 3"}, ["does not take 'unit'", "Its parameters: units, classes"]),
    ({"data_extra": "m = 3"}, ["data.builder: never_imported:data does not take 'm'"]),
    ({"data": "per_replica"}, ["never_imported:per_replica needs 'n'", "[data] without n"]),
    ({"data": "neither"}, ["takes neither input_context nor global_batch_size"]),
    ({"model": "decorated", "data": "data"}, None),   # a decorator may change it: at the run
    ({"model": "assigned"}, None),
    ({"data": "nowhere:data"}, ["data.builder: no module named 'nowhere'"]),
])
def test_builder_mistakes_are_found_without_importing_the_module(tmp_path, kwargs, needles):
    import sys
    sys.modules.pop("never_imported", None)
    if "data" in kwargs and ":" in kwargs["data"]:   # another module entirely
        kwargs = dict(kwargs, data=kwargs["data"].replace("nowhere:data", "data"))
        (tmp_path / "never_imported.py").write_text(UNIMPORTABLE)
        from tfdp.train import builders
        path = _write(tmp_path, '[data]\nbuilder = "nowhere:data"\nglobal_batch_size = 32\n'
                                '[model]\nbuilder = "never_imported:model"\n')
        with pytest.raises(UsageError) as e:
            builders.precheck(config_lib.load(path))
    elif needles is None:
        _precheck(tmp_path, **kwargs)
        assert "never_imported" not in sys.modules
        return
    else:
        with pytest.raises(UsageError) as e:
            _precheck(tmp_path, **kwargs)
    assert "never_imported" not in sys.modules
    msg = str(e.value)
    assert "\n" not in msg and "Received:" in msg, msg
    for n in needles:
        assert n in msg, (n, msg)


@pytest.mark.timeout(60)
def test_cli_builder_mistake_is_one_line_before_tensorflow(run_process, tmp_path):
    (tmp_path / "never_imported.py").write_text(UNIMPORTABLE)
    path = _write(tmp_path, '[data]\nbuilder = "never_imported:data"\nglobal_batch_size = 32\n'
                            '[model]\nbuilder = "never_imported:model"\nhidden = 3\n')
    p = _cli([path], timeout=60)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        "tfdp train: error: model.builder: never_imported:model does not take 'hidden'. "
        "Received: model.hidden=3. Its parameters: units, classes. Remove the key or add the "
        "parameter."], p.stderr


SHIPPED = CONFIGS + sorted(glob.glob(os.path.join(ROOT, "examples", "*.toml")))


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_targets_are_quality_or_relative(path):
    """Absolute speed targets fail on a loaded or slower machine (issue 23, point 4): shipped
    configs state quality (accuracy, AUC, loss) and relative figures only."""
    targets = config_lib.load(path).targets
    assert targets and set(targets) <= {"min_accuracy", "min_auc", "max_loss",
                                        "min_scaling_efficiency"}, targets


@pytest.mark.timeout(240)
def test_a_global_batch_smaller_than_the_replicas_trains_with_a_warning(run_process):
    p = _cli(["configs/quickstart.toml", "--tiny", "--set", "data.global_batch_size=2",
              "--set", "strategy.cpu_replicas=4"], timeout=220)
    assert p.returncode == 0, p.stdout + p.stderr
    assert ("tfdp train: warning: data.global_batch_size=2 on 4 replicas: 2 replica(s) get no "
            "examples in every step") in p.stderr, p.stderr
    assert "batch         global 2, per replica 0-1" in p.stdout, p.stdout


@pytest.mark.timeout(120)
def test_tiny_run_with_sharded_state_says_so(capsys):
    """zero_stage=1: the header's strategy names it and the run prints the plan's effect."""
    r = _run_tiny("quickstart", "strategy.zero_stage=1")
    out = capsys.readouterr().out
    assert "zero_stage=1)" in r.strategy_repr and "zero_stage=1)\n" in out, out
    effect = [ln for ln in out.splitlines() if ln.startswith("  sharded   ")]
    assert len(effect) == 1, out
    assert effect[0].startswith("  sharded   zero_stage=1: optimizer state per device "), effect

"""Sharded optimizer state (``DataParallelStrategy(zero_stage=1 | 2)``, tfdp.zero), locally.

* The owner plan: sorted-greedy by bytes, deterministic (pure Python).
* Every Keras optimizer, both stages, on 4 CPU replicas: weights within 1e-5 of one device;
  stage 1 bitwise equal to unsharded tfdp (weights and every optimizer variable); every
  replica's copy of every variable identical; each sharded slot exists once, on its owner, or
  split by rows among the owners (element-wise optimizers: the largest device holds at most
  1.25 / N of the slot bytes).
* Patterns of the user-pattern matrix that touch the update path (accumulation, two optimizers,
  LossScaleOptimizer, mixed precision, Embedding + Adam, steps_per_execution) under both stages.
* What cannot be sharded exactly is refused with one line naming the fix; bad arguments.
"""

import numpy as np
import pytest

from tfdp.zero import plan as plan_lib

DEVICES = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
N, BATCH = 210, 50   # uneven: 13,13,13,11 per step, last batch 10 (3,3,3,1)


# --- the plan (no TensorFlow) ------------------------------------------------------------------

def test_assign_owners_sorted_greedy_and_deterministic():
    sizes = [10, 400, 30, 400, 5, 100, 100]
    owners = plan_lib.assign_owners(sizes, 3)
    # largest first (ties: earlier first), each to the least-loaded owner (ties: lowest index)
    assert owners == [2, 0, 2, 1, 2, 2, 2] or owners == plan_lib.assign_owners(sizes, 3)
    assert owners[1] == 0 and owners[3] == 1          # the two 400s on owners 0 and 1
    assert owners[5] == 2 and owners[6] == 2          # 100 + 100 on the empty third owner
    assert plan_lib.assign_owners(sizes, 3) == owners  # deterministic
    loads = [0, 0, 0]
    plan_lib.assign_owners(sizes, 3, loads)
    assert sum(loads) == sum(sizes) and max(loads) == 400
    assert plan_lib.assign_owners([], 4) == []
    with pytest.raises(ValueError):
        plan_lib.assign_owners([1], 0)


def test_plan_table():
    plan = plan_lib.OwnerPlan(2, [plan_lib.Entry("a", 3000, 0), plan_lib.Entry("b", 1000, 1),
                                  plan_lib.Entry("c", 1000, 1)], "Adam", ("CPU:0", "CPU:1"))
    assert plan.loads() == [3000, 2000] and plan.counts() == [1, 2]
    assert plan.largest_share() == pytest.approx(0.6) and plan.balance() == pytest.approx(1.2)
    table = plan.table()
    assert "| 0 | CPU:0 | 1 | 3.0 KB | 60.0 % |" in table
    assert "largest owner 60.0 %" in table and "ideal 50.0 %" in table


def test_zero_stage_argument_is_validated(monkeypatch):
    import tfdp
    from tfdp.errors import TfdpError
    from tfdp.zero import validate_stage
    for bad in (3, -1, "1", 1.0, True):
        with pytest.raises(TfdpError, match="Invalid zero_stage"):
            tfdp.DataParallelStrategy(DEVICES, zero_stage=bad)
    monkeypatch.setenv("TFDP_ZERO_STAGE", "2")
    assert validate_stage(None) == 2 and validate_stage(0) == 0
    monkeypatch.setenv("TFDP_ZERO_STAGE", "x")
    with pytest.raises(TfdpError, match="TFDP_ZERO_STAGE"):
        validate_stage(None)
    monkeypatch.delenv("TFDP_ZERO_STAGE")
    assert tfdp.DataParallelStrategy(DEVICES).zero_stage == 0
    assert tfdp.DataParallelStrategy(DEVICES, zero_stage=1).zero_stage == 1


# --- every Keras optimizer, both stages --------------------------------------------------------

def _optimizer(name):
    import keras
    o = keras.optimizers
    return {
        "sgd": lambda: o.SGD(0.05),
        "momentum": lambda: o.SGD(0.05, momentum=0.9),
        "nesterov": lambda: o.SGD(0.05, momentum=0.9, nesterov=True),
        "adam": lambda: o.Adam(1e-2),
        "adam_global_clipnorm": lambda: o.Adam(1e-2, global_clipnorm=0.05),
        "adamw": lambda: o.AdamW(1e-2),
        "adamax": lambda: o.Adamax(1e-2),
        "nadam": lambda: o.Nadam(1e-2),
        "rmsprop": lambda: o.RMSprop(1e-2),
        "adagrad": lambda: o.Adagrad(0.05),
        "adadelta": lambda: o.Adadelta(1.0),
        "adafactor": lambda: o.Adafactor(1e-2),
        "ftrl": lambda: o.Ftrl(0.05),
        "lion": lambda: o.Lion(1e-3),
        "lamb": lambda: o.Lamb(1e-2),
        "muon": lambda: o.Muon(1e-2),
        "adam_ema": lambda: o.Adam(1e-2, use_ema=True),
        "loss_scale_adam": lambda: o.LossScaleOptimizer(o.Adam(1e-2)),
    }[name]


NOT_ELEMENTWISE = ("adafactor", "lamb", "muon")
OPTIMIZERS = ["sgd", "momentum", "nesterov", "adam", "adam_global_clipnorm", "adamw", "adamax",
              "nadam", "rmsprop", "adagrad", "adadelta", "adafactor", "ftrl", "lion", "lamb",
              "muon", "adam_ema", "loss_scale_adam"]


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 6)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(6, 1))).astype("float32")
    return x, y


def _model():
    import keras
    keras.utils.set_random_seed(1)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


def _train(name, strategy):
    import contextlib
    x, y = _data()
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = _model()
        model.compile(_optimizer(name)(), "mse")
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def _values(variables):
    return [np.array(v) for v in variables]


_cache = {}


def _reference(name):
    """(one device, unsharded tfdp) of optimizer ``name``, trained once per test process."""
    if name not in _cache:
        import tfdp
        single = _train(name, None)
        s0 = tfdp.DataParallelStrategy(DEVICES)
        model0 = _train(name, s0)
        _cache[name] = (single.get_weights(), model0.get_weights(),
                        _values(model0.optimizer.variables))
    return _cache[name]


def assert_replicas_identical(strategy, model):
    from tfdp_bench.patterns import Trained, differing_replica_copies
    trained = Trained(model, model.get_weights(), [model.optimizer])
    assert differing_replica_copies(strategy, trained) == []


# Stage 2 changes only the gradient reduction (the same for every optimizer): the optimizers that
# read the reduced gradients in replica context (global norm, loss-scale finite check, sparse
# rows) and one with non-slot state.
CASES = ([(name, 1) for name in OPTIMIZERS]
         + [(name, 2) for name in ("momentum", "adam_global_clipnorm", "adafactor",
                                   "loss_scale_adam")])


@pytest.mark.parametrize("name,stage", CASES, ids=[f"{n}-stage{s}" for n, s in CASES])
def test_optimizer_sharded_equals_one_device(name, stage):
    import tensorflow as tf

    import tfdp
    from tfdp_bench.patterns import max_diff
    ref, unsharded, unsharded_opt = _reference(name)
    strategy = tfdp.DataParallelStrategy(DEVICES, zero_stage=stage)
    model = _train(name, strategy)
    assert max_diff(model.get_weights(), ref) <= 1e-5
    if stage == 1:  # the owner applies Keras's unchanged update: bitwise what every replica did
        assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), unsharded))
        assert all(np.array_equal(a, b) for a, b in
                   zip(_values(model.optimizer.variables), unsharded_opt))
    assert_replicas_identical(strategy, model)
    zero = strategy.extended.tfdp_zero
    assert (zero.owner_reductions > 0) == (stage == 2 and name != "sgd")
    sharded = [v for v in model.optimizer.variables
               if not isinstance(getattr(v, "value", v), tf.distribute.DistributedValues)]
    if name == "sgd":  # no per-variable state: nothing sharded, every replica updates
        assert sharded == [] and sum(zero.slot_bytes()) == 0
        return
    assert sharded, "no optimizer slot was sharded"
    assert all(zero.handles(v) for v in model.trainable_variables)
    split = [v for v in model.trainable_variables if zero.split_of(v) is not None]
    # element-wise optimizers split the dominant kernel by rows; the others own whole variables
    assert bool(split) == (name not in NOT_ELEMENTWISE), [v.path for v in split]
    owners = {zero.owner_of(v) for v in model.trainable_variables} - {None}
    assert len(owners) > 1 or split  # spread over several replicas
    per_device = zero.slot_bytes()  # each slot once: on its owner, or one piece per owner
    assert sum(per_device) == sum(int(np.prod(v.shape)) * 4 for v in sharded)
    if split:
        assert max(per_device) <= 1.25 / len(DEVICES) * sum(per_device)
    for v in sharded:
        pieces = getattr(v.value, "variables", [v.value])
        assert len(pieces) == (len(DEVICES) if len(pieces) > 1 else 1)
    assert {tf.DeviceSpec.from_string(v.value.device).device_index for v in sharded
            if not hasattr(v.value, "variables")} <= owners


# --- patterns of the user-pattern matrix that touch the update path ----------------------------

# (tfdp bench patterns --zero-stage 1,2 runs every row; docs/benchmarks/zero.md)
ROWS = [("global_clipnorm_accum2", 1), ("two_optimizers", 1), ("mixed_float16", 1),
        ("embedding_adam", 1), ("loss_scale_clipnorm", 2), ("last_batch_1_embedding", 2)]


@pytest.mark.parametrize("row,stage", ROWS, ids=[f"{r}-stage{s}" for r, s in ROWS])
def test_pattern_rows_sharded(row, stage, one_device):
    import tfdp
    from tfdp_bench.patterns import get_row, run_row
    from test_user_patterns import assert_exact, shared_reference
    res = run_row(get_row(row), lambda: tfdp.DataParallelStrategy(DEVICES, zero_stage=stage),
                  shared_reference(one_device, get_row(row)))
    assert_exact(res)


# --- refused, never approximated ---------------------------------------------------------------

def test_adafactor_with_accumulation_is_refused_with_the_fix():
    import keras

    import tfdp
    from tfdp.errors import TfdpError
    x, y = _data()
    strategy = tfdp.DataParallelStrategy(DEVICES, zero_stage=1)
    with strategy.scope():
        model = _model()
        model.compile(keras.optimizers.Adafactor(1e-2, gradient_accumulation_steps=2), "mse")
    with pytest.raises(TfdpError) as e:
        model.fit(x, y, batch_size=40, epochs=1, verbose=0)
    text = str(e.value).splitlines()[0]
    assert "zero_stage=1 cannot shard Adafactor with gradient_accumulation_steps" in text
    assert "Fix: use zero_stage=0" in text


def test_zero_hook_points_are_listed_in_compat_names():
    from tfdp import compat
    from tfdp.compat import names
    listed = {(id(names.home(e)), e.name) for e in (*names.NAMES, *names.PUBLIC)}
    for owner, attr in compat.keras_zero_hook_points().values():
        assert (id(owner), attr) in listed


# --- the same argument in tfdp train configs and tfdp.set_default_strategy --------------------

def test_train_config_key_and_default_strategy(monkeypatch):
    import os

    import tensorflow as tf

    import tfdp
    from tfdp.train import config as config_lib
    from tfdp.train import runner
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = config_lib.load(os.path.join(root, "configs", "quickstart.toml"),
                          ["strategy.cpu_replicas=4", "strategy.zero_stage=2"], tiny=True)
    assert cfg["strategy"]["zero_stage"] == 2
    assert runner._make_strategy(cfg).zero_stage == 2
    from tfdp.errors import UsageError
    with pytest.raises(UsageError, match="strategy.zero_stage"):
        config_lib.load(os.path.join(root, "configs", "quickstart.toml"),
                        ["strategy.zero_stage=3"], tiny=True)
    strategy = tfdp.set_default_strategy(devices=DEVICES, zero_stage=1)
    try:
        assert strategy.zero_stage == 1 and tf.distribute.get_strategy() is strategy
    finally:
        tf.distribute.experimental_set_strategy(None)


# --- sharding is visible (issue 33, point 2) -----------------------------------------------------

def test_repr_and_the_creation_line_name_the_stage():
    import tfdp
    from tfdp.strategy.announce import strategy_line
    for stage, needle in ((1, "optimizer state sharded over the 4 local replicas"),
                          (2, "gradients summed onto their owners")):
        strategy = tfdp.DataParallelStrategy(DEVICES, zero_stage=stage)
        assert repr(strategy).endswith(f", zero_stage={stage})"), repr(strategy)
        line = strategy_line(strategy)
        assert f"; zero_stage={stage}: " in line and needle in line, line
    plain = tfdp.DataParallelStrategy(DEVICES)
    assert "zero_stage" not in repr(plain) and "zero_stage" not in strategy_line(plain)


def _effect_lines(caplog, optimizer, stage=1, fits=2):
    import logging

    import keras

    import tfdp
    from tfdp_bench.zero import optimizer_bytes_per_device
    strategy = tfdp.DataParallelStrategy(DEVICES, zero_stage=stage)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,), dtype="int32"),
                                  keras.layers.Embedding(4000, 16), keras.layers.Flatten(),
                                  keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(optimizer(), "mse")
    x = np.random.default_rng(0).integers(0, 4000, size=(64, 3)).astype("int32")
    y = np.ones((64, 1), "float32")
    with caplog.at_level(logging.INFO, logger="tfdp"):
        for _ in range(fits):
            model.fit(x, y, batch_size=16, verbose=0)
    lines = [r.getMessage() for r in caplog.records if "optimizer state per device" in
             r.getMessage() or "zero_stage=1: nothing to shard" in r.getMessage()]
    return lines, optimizer_bytes_per_device(strategy, model.optimizer)


def test_the_first_step_shows_the_plans_effect_once(caplog):
    import keras
    lines, per_device = _effect_lines(caplog, lambda: keras.optimizers.Adam(1e-3))
    assert len(lines) == 1, lines   # two fits, one line
    # unsharded, every device would hold the whole state: Embedding 4000 x 16 and the Dense
    # layers, two Adam slots each, + iterations and learning rate; sharded: the largest device
    weights = (4000 * 16 + 48 * 8 + 8 + 8 + 1) * 4
    before = plan_lib.human_bytes(2 * weights + 8 + 4)
    after = plan_lib.human_bytes(max(per_device))
    assert lines[0].startswith(f"tfdp: zero_stage=1: optimizer state per device {before} -> "
                               f"{after} (the largest of 4 replicas; Adam: "), lines
    assert max(per_device) < 0.35 * (2 * weights), per_device   # about a quarter
    assert "1 split by rows" in lines[0] and "the owner plan is logged at INFO" in lines[0]


def test_nothing_to_shard_is_said_too(caplog):
    import keras
    lines, _ = _effect_lines(caplog, lambda: keras.optimizers.SGD(0.1), fits=1)
    assert lines == ["tfdp: zero_stage=1: nothing to shard: SGD keeps no per-variable optimizer "
                     "state (every replica updates its variables, as with zero_stage=0)"], lines


def test_no_line_without_sharding(caplog):
    import keras
    lines, _ = _effect_lines(caplog, lambda: keras.optimizers.Adam(1e-3), stage=0, fits=1)
    assert lines == []

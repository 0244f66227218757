"""What tfdp does on a TensorFlow / Keras that lacks a private name it uses (tfdp/compat/names.py):
every name is hidden from tfdp's lookup in turn. A name of an essential feature is refused when
the strategy (or the callback that needs it) is created, in one line; a name of an extra turns
that feature off with one warning, and training stays exact (N replicas == one device)."""

import logging

import numpy as np
import pytest

import keras
import tensorflow as tf

import tfdp
from tfdp.compat import names, versions
from tfdp.keras import adapter

from helpers import TOL, build, make_data, max_diff

DEVS = ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
ESSENTIAL = [e for e in names.NAMES if names.FEATURES[e.feature].essential]
EXTRAS = [e for e in names.NAMES if not names.FEATURES[e.feature].essential]


def _id(entry):
    return f"{entry.feature}:{entry.owner.rsplit('.', 1)[-1]}.{entry.name}"


def test_every_feature_is_described_and_has_names():
    assert {e.feature for e in names.NAMES} == set(names.FEATURES)
    for feature in names.FEATURES.values():
        assert feature.what
        assert bool(feature.without) != feature.essential, feature.name
    # the hook sets name features that exist; the essential ones are what the strategy refuses
    assert {s.feature for s in adapter.SETS.values()} - {None} <= set(names.FEATURES)
    assert set(names.ESSENTIAL) == {"strategy", "gradient_path", "multi_worker"}


@pytest.mark.parametrize("entry", [e for e in ESSENTIAL if e.feature != "resume"], ids=_id)
def test_a_missing_essential_name_is_refused_in_one_line_at_strategy_creation(entry):
    with names.hiding(entry), pytest.raises(names.UnsupportedVersionError) as e:
        tfdp.DataParallelStrategy(DEVS[:2])
    text = str(e.value)
    assert "\n" not in text
    assert f"{entry.owner.replace(':', '.')}.{entry.name}" in text
    assert text.startswith("tfdp") and " cannot run on this TensorFlow / Keras: " in text
    assert f"Received: tensorflow {versions._version(versions._TF_DISTS)}, keras " in text
    assert "tested: TensorFlow 2.19-2.22, Keras 3.12-3.16" in text
    assert 'pip install "tensorflow-cpu>=2.19,<2.23" "keras>=3.12,<3.17"' in text
    assert isinstance(e.value, tfdp.errors.TfdpError)  # (the CLI prints it as one line)


def test_a_missing_resume_name_is_refused_when_the_callback_is_created(tmp_path):
    entry = next(e for e in ESSENTIAL if e.feature == "resume")
    with names.hiding(entry), pytest.raises(names.UnsupportedVersionError) as e:
        tfdp.callbacks.BackupAndRestore(str(tmp_path / "b"))
    assert "tfdp.callbacks.BackupAndRestore cannot run" in str(e.value)
    assert "_initial_epoch" in str(e.value)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and " is off on this TensorFlow / Keras" in
            r.getMessage()]


_HOOK_SET = {"symbolic_build": "symbolic_build", "sparse_reads": "perf", "zero": "zero",
             "input_position": "input_position", "shared_files": "shared_files"}


def _use_feature(entry, tmp_path):
    """Create what uses ``entry``'s feature; returns it (it holds no hook set of the feature)."""
    feature = entry.feature
    if feature == "input_position":
        owner = tfdp.callbacks.BackupAndRestore(str(tmp_path / "b"))
    elif feature == "shared_files":
        owner = type("Owner", (), {})()
        assert adapter.use(owner, "shared_files") == []
    else:
        owner = tfdp.DataParallelStrategy(DEVS[:2],
                                          zero_stage=1 if feature == "zero" else None)
        if feature == "zero":
            assert owner.zero_stage == 0 and owner.extended.tfdp_zero is None
    assert _HOOK_SET.get(feature) not in adapter.held_by(owner)  # its hooks are not in use
    return owner


@pytest.mark.parametrize("entry", EXTRAS, ids=_id)
def test_a_missing_extra_name_turns_its_feature_off_with_one_warning(entry, tmp_path, caplog):
    feature = names.FEATURES[entry.feature]
    with names.hiding(entry), caplog.at_level(logging.WARNING, logger="tfdp"):
        owners = [_use_feature(entry, tmp_path), _use_feature(entry, tmp_path)]  # (one warning)
        assert not names.available(entry.feature)
    lines = _warnings(caplog)
    assert len(lines) == 1, lines
    assert feature.what in lines[0] and feature.without in lines[0]
    assert f"{entry.owner.replace(':', '.')}.{entry.name}" in lines[0]
    assert "training stays exact" in lines[0]
    del owners


def test_the_hook_sets_are_held_when_nothing_is_missing(tmp_path):
    """(The check above can fail: with every name there, the owners hold the sets.)"""
    strategy = tfdp.DataParallelStrategy(DEVS[:2], zero_stage=1)
    strategy.extended.tfdp_zero  # (sharded state hooks in from first use)
    assert {"gradient_path", "symbolic_build", "perf", "zero"} <= adapter.held_by(strategy)
    callback = tfdp.callbacks.BackupAndRestore(str(tmp_path / "b"))
    assert adapter.held_by(callback) == {"input_position"}


# --- each extra off: the run is still exact ------------------------------------------------------

_REFERENCE = {}


def _fit(strategy, opt, **kw):
    x, y = make_data(n=90)
    m = build(strategy, opt)
    m.fit(x, y, batch_size=22, epochs=2, shuffle=False, verbose=0, **kw)  # (uneven batches)
    return m.get_weights()


def _reference(opt):
    if opt not in _REFERENCE:
        _REFERENCE[opt] = _fit(None, opt)
    return _REFERENCE[opt]


_SGD = lambda: keras.optimizers.SGD(0.05)  # noqa: E731  (plain SGD: sparse reads apply)


@pytest.mark.parametrize("feature, opt", [
    ("symbolic_build", "adam"), ("sparse_reads", _SGD), ("zero", "adam"),
    ("fast_iterators", "sgd_momentum"), ("pipeline_walk", "sgd_momentum"),
    ("input_position", "sgd_momentum")])
def test_the_run_stays_exact_with_the_feature_off(feature, opt, tmp_path, caplog):
    entries = [e for e in names.NAMES if e.feature == feature]
    with names.hiding(*entries), caplog.at_level(logging.WARNING, logger="tfdp"):
        strategy = tfdp.DataParallelStrategy(DEVS, zero_stage=1 if feature == "zero" else None)
        callbacks = []
        if feature == "input_position":
            callbacks = [tfdp.callbacks.BackupAndRestore(str(tmp_path / "b"))]
        weights = _fit(strategy, opt, callbacks=callbacks)
    assert any(names.FEATURES[feature].without in line for line in _warnings(caplog))
    key = "sgd" if opt is _SGD else opt
    if key not in _REFERENCE:
        _REFERENCE[key] = _fit(None, opt)
    assert max_diff(weights, _REFERENCE[key]) <= TOL
    if feature == "zero":
        assert strategy.zero_stage == 0


def test_hidden_names_come_back_after_the_block():
    entry = EXTRAS[0]
    with names.hiding(entry):
        assert not names.available(entry.feature)
    assert names.available(entry.feature)
    assert names.missing() == []


def test_a_name_at_its_other_home_is_found(monkeypatch):
    """Keras 3.16 keeps TensorFlowTrainer's methods on ``Trainer`` in the same module: an
    entry's ``also`` is tried when its owner lacks the name (no version strings)."""
    entry = names.Private("keras.src.backend.tensorflow.trainer:NoSuchTrainer", "_make_function",
                          "wrap", "test", also=("keras:Model",))
    assert names.home(entry) is keras.Model
    gone = names.Private("keras.src.no_such_module", "x", "call", "", also=("keras:NoSuch",))
    assert names.home(gone) is None


def test_reference_weights_are_not_all_equal():
    """(The exactness checks above can fail: two optimizers give different weights.)"""
    assert max_diff(_reference("adam"), _reference("sgd_momentum")) > 1e-3
    assert np.isfinite(max_diff(_reference("adam"), _reference("adam")))

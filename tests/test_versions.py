"""Supported TensorFlow / Keras releases: what setup.py declares, what CI tests, what is installed.

setup.py states the ranges (``TF_RANGE``, ``KERAS_RANGE``); .ci/run runs the whole suite on the
newest TensorFlow and the compatibility subset (.ci/compat_subset.txt) on each older one
(``COMPAT_STAGES``). These tests keep the three in agreement, so the range cannot be widened
without a CI stage that tests it, and the subset cannot silently lose a test.
"""

from __future__ import annotations

import ast
import os
import re

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup_constant(name: str) -> str:
    tree = ast.parse(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read())
    for node in tree.body:
        if (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name} = '<specifier>' assignment")


def _ci_stages() -> list[tuple[str, str]]:
    text = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    m = re.search(r'COMPAT_STAGES=\$\{TFDP_CI_COMPAT_STAGES:?-"([^"]*)"\}', text)
    assert m, ".ci/run defines no COMPAT_STAGES default"
    pairs = [p.split(":") for p in m.group(1).split()]
    assert pairs and all(len(p) == 2 for p in pairs), m.group(1)
    return [(tf, keras) for tf, keras in pairs]


def _ci_next_stages() -> list[tuple[str, str]]:
    """The next stages' (TF, Keras) versions: pinned pre-release builds (``NAME==VERSION``)."""
    text = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    keras = re.search(r'NIGHTLY_KERAS="([^"]+)"', text)
    m = re.search(r'NEXT_STAGES=\$\{TFDP_CI_NEXT_STAGES:?-"([^"]*)"\}', text)
    assert keras and m, ".ci/run defines no NEXT_STAGES default"
    out = []
    for pair in m.group(1).replace("\\\n", " ").replace("$NIGHTLY_KERAS", keras.group(1)).split():
        tf_pin, keras_pin = pair.split(":")
        assert "==" in tf_pin and "==" in keras_pin, f"a next stage is not pinned: {pair}"
        out.append((tf_pin.split("==")[1], keras_pin.split("==")[1]))
    return out


def test_next_stages_pin_pre_releases_of_the_next_tensorflow_and_keras():
    stages = _ci_next_stages()
    assert len(stages) >= 1
    text = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert re.search(r'^\s*run_stage "next: main venv \+ \$NIGHTLY_KERAS" stage_next_keras$', text,
                     re.M), "the next Keras on the main venv's TensorFlow has no stage"
    assert all(Version(k).is_prerelease for _, k in stages)
    keras_next = {Version(k).release[:2] for _, k in stages}
    assert keras_next == {_minors(KERAS_SPEC, 3)[-1]}, (
        "the next stages test the newest Keras setup.py allows", keras_next)
    tf_next = {Version(tf).release[:2] for tf, _ in stages if Version(tf).is_prerelease}
    assert _minors(TF_SPEC, 2)[-1] in tf_next, "the newest TF setup.py allows has no stage"


def _minors(spec: SpecifierSet, major: int) -> list[tuple[int, int]]:
    return [(major, m) for m in range(100) if Version(f"{major}.{m}.0") in spec]


TF_SPEC = SpecifierSet(_setup_constant("TF_RANGE"))
KERAS_SPEC = SpecifierSet(_setup_constant("KERAS_RANGE"))


def test_declared_ranges_are_bounded_and_cover_the_supported_releases():
    tf_minors = _minors(TF_SPEC, 2)
    keras_minors = _minors(KERAS_SPEC, 3)
    assert {(2, 19), (2, 20), (2, 21), (2, 22)} <= set(tf_minors), tf_minors
    # both ends bounded: a release tfdp was never tested with is not installed by pip
    assert Version("2.99.0") not in TF_SPEC and Version("3.0.0") not in TF_SPEC
    assert Version("3.99.0") not in KERAS_SPEC and Version("4.0.0") not in KERAS_SPEC
    assert keras_minors and (3, 16) in keras_minors, keras_minors


def test_ci_tests_every_supported_tensorflow_and_both_ends_of_the_keras_range():
    stages = _ci_stages()
    tf_minors = _minors(TF_SPEC, 2)
    keras_minors = _minors(KERAS_SPEC, 3)
    for tf, keras in stages:
        assert Version(tf) in TF_SPEC, f"CI stage TF {tf} is outside setup.py's {TF_SPEC}"
        assert Version(keras) in KERAS_SPEC, f"CI stage Keras {keras} outside {KERAS_SPEC}"
    # the main suite runs on what setup.py resolves to: the newest TF released (2.21); the
    # newest of the range (2.22) is tested before its release, in a next stage
    # (and the next Keras runs on the main stage's TF: stage_next_keras)
    next_stages = _ci_next_stages()
    staged = {Version(tf).release[:2] for tf, _ in stages}
    staged_next = {Version(tf).release[:2] for tf, _ in next_stages}
    main = set(tf_minors) - staged - staged_next
    assert len(main) == 1, (
        f"TF minors in {TF_SPEC} other than the main stage's without a CI stage: {sorted(main)}")
    assert max(main) < min(staged_next), "the next stages test a TF newer than the main stage's"
    nightly_keras = re.search(r'NIGHTLY_KERAS="[\w-]+==([^"]+)"',
                              open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read())
    staged_keras = {Version(k).release[:2] for _, k in stages + next_stages}
    staged_keras.add(Version(nightly_keras.group(1)).release[:2])
    assert keras_minors[0] in staged_keras, (
        f"no CI stage tests the lowest Keras tfdp declares ({keras_minors[0]})")
    assert keras_minors[-1] in staged_keras, (
        f"no CI stage tests the newest Keras tfdp declares ({keras_minors[-1]})")


def test_installed_tensorflow_and_keras_are_in_the_declared_range():
    import keras
    import tensorflow as tf
    assert Version(tf.__version__) in TF_SPEC, (tf.__version__, str(TF_SPEC))
    assert Version(keras.__version__) in KERAS_SPEC, (keras.__version__, str(KERAS_SPEC))


def _subset_entries() -> list[str]:
    out = []
    with open(os.path.join(ROOT, ".ci", "compat_subset.txt"), encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(line)
    return out


def _defined_tests(path: str) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read())
    return {n.name for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")}


def test_compat_subset_names_existing_tests():
    entries = _subset_entries()
    assert len(entries) >= 10, entries
    files = set()
    for entry in entries:
        node = entry.split("=", 1)[1] if entry.startswith("--deselect=") else entry
        assert not node.startswith("-") or entry.startswith("--deselect="), (
            f"unexpected option in the subset: {entry!r}")
        path, _, rest = node.partition("::")
        full = os.path.join(ROOT, path)
        assert path.startswith("tests/") and os.path.isfile(full), f"no such test file: {path}"
        files.add(path)
        if rest:
            name = rest.split("[", 1)[0].split("::")[-1]
            assert name in _defined_tests(full), f"{path} defines no test {name!r}"
    # the categories the issue names (equivalence, multi-worker fit, accumulation, sparse, bad
    # input) and these version checks
    for required in ("tests/test_keras.py", "tests/test_gradient_path.py",
                     "tests/test_multiworker.py", "tests/test_accumulation.py",
                     "tests/test_sparse.py", "tests/test_bad_input.py", "tests/test_versions.py"):
        assert required in files, f"the compatibility subset runs nothing from {required}"


@pytest.mark.parametrize("flavour, name", [("cpu", "tensorflow-cpu"), ("gpu", "tensorflow")])
def test_both_tensorflow_flavours_get_the_same_range(flavour, name, monkeypatch):
    import setuptools
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: captured.update(kw))
    monkeypatch.setenv("TFDP_TF_PACKAGE", flavour)
    code = compile(open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read(),
                   os.path.join(ROOT, "setup.py"), "exec")
    exec(code, {"__file__": os.path.join(ROOT, "setup.py"), "__name__": "setup"})  # noqa: S102
    from packaging.requirements import Requirement
    reqs = {Requirement(r).name: Requirement(r) for r in captured["install_requires"]}
    assert reqs[name].specifier == TF_SPEC, reqs
    assert reqs["keras"].specifier == KERAS_SPEC, reqs
    assert "0.7.0" not in reqs["ml_dtypes"].specifier, reqs  # (docs/install.md: Install)


def test_installed_ml_dtypes_is_not_the_slow_release():
    from importlib.metadata import version
    assert version("ml_dtypes") != "0.7.0", "pip install -e . again: setup.py excludes it"


# --- Keras before 3.10 (metric variables sync-on-write): one clear error, not wrong metrics -----

def test_installed_keras_creates_metric_variables_sync_on_read():
    from tfdp import compat
    assert compat.keras_metric_variables_sync_on_read()


def test_strategy_refuses_a_keras_with_sync_on_write_metric_variables(monkeypatch):
    from tfdp.compat import keras_internals
    from tfdp.errors import TfdpError
    from tfdp.keras import gradient_path
    # tfdp.compat caches what it loads: patched there first (what it holds now is what the undo
    # puts back), then at the source (deleting it there instead left the stand-in cached in
    # tfdp.compat for the next tests in the process when it had not been loaded yet)
    monkeypatch.setattr("tfdp.compat.keras_metric_variables_sync_on_read", lambda: False)
    monkeypatch.setattr(keras_internals, "keras_metric_variables_sync_on_read", lambda: False)
    monkeypatch.setattr(gradient_path, "_installed", False)
    with pytest.raises(TfdpError, match=r"sync-on-write .*Received: keras==3\.\d+.*"
                                        r'pip install "keras>=3\.12,<3\.17"'):
        gradient_path.install()
    assert gradient_path._installed is False

"""Every private TensorFlow / Keras name tfdp relies on is listed in tfdp/compat/names.py, still
exists in the installed versions, and is touched nowhere else; untested versions warn once."""

import ast
import inspect
import logging
import os

import pytest

from tfdp.compat import names, versions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "tfdp")
LISTED = {(e.owner, e.name) for e in names.NAMES}
LISTED_NAMES = {e.name for e in names.NAMES}


def test_every_listed_private_name_exists_in_the_installed_tensorflow_and_keras():
    assert [(e.owner, e.name, e.kind) for e in names.missing()] == []


def test_the_check_can_fail():
    fake = names.Private("tensorflow.python.distribute.mirrored_strategy:MirroredExtended",
                         "_no_such_method_in_tf", "override", "test")
    assert not names._present(fake)
    assert not names._present(names.Private("tensorflow.python.no_such_module", "x", "call", ""))
    state = names.Private("tensorflow.python.distribute.collective_all_reduce_strategy:"
                          "CollectiveAllReduceExtended", "_no_such_state", "state", "")
    assert not names._present(state)


def _python_files():
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(dirpath, f)


def test_only_tfdp_compat_imports_private_modules():
    offenders = []
    for path in _python_files():
        if os.sep + "compat" + os.sep in path:
            continue
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for m in mods:
                if m.startswith(("tensorflow.python", "tensorflow.tsl", "keras.src", "tf_keras")):
                    offenders.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {m}")
    assert offenders == []


def _tfdp_subclasses_of_tf():
    from tfdp.reduce.reducer import Reducer
    from tfdp.strategy.local import LocalExtended
    from tfdp.strategy.multiworker import MultiWorkerExtended
    return [LocalExtended, MultiWorkerExtended, Reducer]


def test_every_overridden_private_hook_is_listed():
    """A tfdp method named like a private method of a TF/Keras base class overrides it: listed."""
    unlisted = []
    for cls in _tfdp_subclasses_of_tf():
        tf_bases = [b for b in inspect.getmro(cls)
                    if b.__module__.startswith(("tensorflow", "keras"))]
        for klass in inspect.getmro(cls):
            if not klass.__module__.startswith("tfdp"):
                continue
            for attr in vars(klass):
                if not attr.startswith("_") or attr.startswith("__") or attr.startswith("_tfdp"):
                    continue
                if any(attr in vars(b) for b in tf_bases) and attr not in LISTED_NAMES:
                    unlisted.append(f"{klass.__name__}.{attr}")
    assert unlisted == []


def _listed_homes():
    return {(id(names.home(e)), e.name) for e in (*names.NAMES, *names.PUBLIC)
            if names.home(e) is not None}


def test_every_wrapped_keras_point_is_listed():
    from tfdp import compat
    points = {}
    points.update(compat.keras_hook_points())
    points.update(compat.keras_symbolic_build_points())
    points.update(compat.keras_callbacks_hook_points())
    points.update(compat.keras_perf_hook_points())
    points.update(compat.keras_zero_hook_points())
    listed = _listed_homes()
    unlisted = [(getattr(owner, "__qualname__", owner.__name__), attr)
                for owner, attr in points.values() if (id(owner), attr) not in listed]
    assert unlisted == []


def test_untested_versions_warn_once(monkeypatch, caplog):
    installed = {"tensorflow": None, "tensorflow-cpu": "2.23.1", "keras": "3.15.1"}
    monkeypatch.setattr(versions, "_version", lambda dists: next(
        (installed[d] for d in dists if installed.get(d)), None))
    assert versions.untested_versions() == ["tensorflow 2.23.1 (tested: 2.19-2.22)"]
    monkeypatch.setattr(versions, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="tfdp"):
        versions.warn_if_untested()
        versions.warn_if_untested()
    lines = [r.getMessage() for r in caplog.records if "untested" in r.getMessage()]
    assert len(lines) == 1 and "tensorflow 2.23.1 (tested: 2.19-2.22)" in lines[0]
    installed.update({"tensorflow-cpu": "2.19.0", "keras": "3.9.0"})
    assert versions.untested_versions() == ["keras 3.9.0 (tested: 3.12-3.16)"]
    installed.update({"keras": "3.12.0"})
    assert versions.untested_versions() == []


def test_installed_versions_are_tested():
    assert versions.untested_versions() == []


@pytest.mark.parametrize("entry", names.NAMES, ids=lambda e: f"{e.owner}.{e.name}")
def test_every_entry_says_why(entry):
    assert entry.kind in ("import", "call", "override", "wrap", "state")
    assert entry.why.strip()


def test_tested_range_is_the_range_setup_py_installs():
    import re
    text = open(os.path.join(ROOT, "setup.py"), encoding="utf-8").read()
    tf_range = re.search(r'TF_RANGE = ">=(\d+\.\d+),<(\d+)\.(\d+)"', text)
    keras_range = re.search(r'KERAS_RANGE = ">=(\d+\.\d+),<(\d+)\.(\d+)"', text)
    assert tf_range and keras_range
    for (low, major, minor_end), tested in ((tf_range.groups(), versions.TESTED_TENSORFLOW),
                                            (keras_range.groups(), versions.TESTED_KERAS)):
        assert tested == (low, f"{major}.{int(minor_end) - 1}")

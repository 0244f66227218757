"""tfdp's Keras adapter (tfdp.keras.adapter) is scoped: nothing of tfdp stays in Keras.

In a process that imports tfdp without creating a strategy, and in one whose tfdp strategies
(and tfdp callbacks) have all been dropped (``del strategy; gc.collect()``), every Keras function
and method at tfdp's hook points, ``tf.GradientTape.gradient``, the eager context's ``device``
and ``sys.excepthook`` are the same as in a process that never imported tfdp (compared by what
identifies a function across processes: its type, module, qualified name, source file and first
line, and whether it is the owner's own entry), no function or class of tfdp sits anywhere in
Keras's or TensorFlow's modules and classes, and a plain model (no strategy) trains bitwise as in
the clean process. The check can fail: a process that keeps a strategy alive is told apart.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

# Every point any hook set of the adapter wraps ("module:Class" or "module", attribute).
_TRAINER = ("keras.src.backend.tensorflow.trainer:TensorFlowTrainer"
            "|keras.src.backend.tensorflow.trainer:Trainer")  # (Keras 3.16: Trainer)
POINTS = [  # (owner: "module:Class" or "module"; "a|b": the first that exists)
    ("keras.src.losses.loss", "scale_loss_for_distribution"),
    ("keras.src.losses.loss", "unscale_loss_for_distribution"),
    ("keras.src.losses.loss", "reduce_weighted_values"),
    ("keras.metrics:Mean", "update_state"),
    ("keras:Model", "predict_on_batch"),
    ("keras:Model", "get_metrics_result"),
    ("tensorflow:GradientTape", "gradient"),
    ("keras.optimizers:Optimizer", "apply"),
    ("keras.optimizers:Optimizer", "_clip_gradients"),
    ("keras.optimizers:Optimizer", "build"),
    ("keras.optimizers:Optimizer", "_backend_apply_gradients"),
    ("keras.optimizers:LossScaleOptimizer", "apply"),
    ("keras.optimizers:Optimizer", "_all_reduce_sum_gradients"),
    (_TRAINER, "_maybe_symbolic_build"),
    (_TRAINER, "_make_function"),
    ("keras.src.backend.tensorflow.numpy|keras.src.backend.tensorflow.ops.numpy", "take"),
    ("keras.optimizers:SGD", "build"),
    ("keras.src.backend.tensorflow.trainer:TFEpochIterator", "__init__"),
    ("keras.src.backend.tensorflow.trainer:TFEpochIterator", "_get_iterator"),
    ("keras.callbacks:BackupAndRestore", "_save_model"),
    ("keras.callbacks:BackupAndRestore", "on_train_end"),
    ("keras.callbacks:ModelCheckpoint", "_save_model"),
    ("keras.callbacks:CSVLogger", "on_train_begin"),
]

# (in the snapshot process and in test_the_points_checked_are_every_point_the_adapter_wraps)
_RESOLVE = '''def resolve(spec):
    for one in spec.split("|"):
        module, _, cls = one.partition(":")
        try:
            obj = importlib.import_module(module)
            return getattr(obj, cls) if cls else obj
        except (ImportError, AttributeError):
            continue
    raise LookupError(spec)
'''

_SNAPSHOT = r'''
import gc, importlib, json, os, sys, types
import numpy as np
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras

def use_tfdp(kind, tmp):
    import tfdp, tfdp.callbacks, tfdp.keras, tfdp.zero  # noqa: F401 (every part imported)
    if kind == "imported":
        return None
    x = np.random.default_rng(1).normal(size=(24, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    kept = []
    for zero_stage in (0, 1):
        s = tfdp.DataParallelStrategy(["CPU:0", "CPU:1"], zero_stage=zero_stage)
        with s.scope():
            m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                                  keras.layers.Dense(1)])
            m.compile(keras.optimizers.Adam(0.01), "mse")
        backup = tfdp.callbacks.BackupAndRestore(os.path.join(tmp, f"b{zero_stage}"),
                                                 save_freq=2)
        m.fit(x, y, batch_size=6, epochs=1, verbose=0, shuffle=False, callbacks=[backup])
        kept.append((s, m, backup))
    if kind == "kept":
        return kept          # still alive: the hooks must still be there
    del s, m, backup, kept
    gc.collect()
    return None

def stored(owner, attr):
    if isinstance(owner, type):
        for k in owner.__mro__:
            if attr in vars(k):
                return vars(k)[attr], k is owner
    own = getattr(owner, "__dict__", {})
    if attr in own:
        return own[attr], True
    return getattr(owner, attr), False

def describe(v, own):
    fn = getattr(v, "__func__", v)
    code = getattr(fn, "__code__", None)
    out = {"own": own, "type": f"{type(v).__module__}.{type(v).__qualname__}",
           "module": getattr(fn, "__module__", None),
           "qualname": getattr(fn, "__qualname__", None),
           "tfdp_attrs": sorted(a for a in getattr(fn, "__dict__", {}) if "tfdp" in a)}
    if code is not None:
        f = code.co_filename
        out.update(file=f.split("site-packages" + os.sep)[-1], line=code.co_firstlineno)
    return out

''' + _RESOLVE + r'''
def tfdp_things():
    """Anything of tfdp (functions, classes, instances) in Keras's and TF's namespaces."""
    found = []
    def check(where, v):
        try:
            if type(v).__module__.startswith("tfdp"):
                found.append(where)
            elif isinstance(v, (types.FunctionType, type)):
                if (getattr(v, "__module__", "") or "").startswith("tfdp") or any(
                        "tfdp" in a for a in getattr(v, "__dict__", {})):
                    found.append(where)
        except Exception:  # noqa: BLE001
            pass
    for name, module in list(sys.modules.items()):
        if not name.startswith(("keras", "tensorflow")) or not isinstance(module, types.ModuleType):
            continue
        for key, v in list(vars(module).items()):
            check(f"{name}.{key}", v)
            if isinstance(v, type) and v.__module__ == name:
                for attr, w in list(vars(v).items()):
                    check(f"{name}.{key}.{attr}", getattr(w, "__func__", w))
    return sorted(set(found))

kind, tmp, points = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
kept = None if kind == "clean" else use_tfdp(kind, tmp)
from tensorflow.python.eager import context as _context   # (the eager context: its device)
ctx = _context.context()
snap = {f"{o}.{a}": describe(*stored(resolve(o), a)) for o, a in points}
snap["Context.device"] = {"instance_attr": "device" in vars(ctx),
                          **describe(*stored(type(ctx), "device"))}
snap["sys.excepthook"] = {"is_default": sys.excepthook is sys.__excepthook__,
                          "type": type(sys.excepthook).__qualname__}
# a plain model, no strategy: Keras's own training (clipping, accumulation, embedding + SGD)
rng = np.random.default_rng(0)
ids = rng.integers(0, 50, size=(64, 3)); x = rng.normal(size=(64, 5)).astype("float32")
y = rng.normal(size=(64, 1)).astype("float32")
keras.utils.set_random_seed(3)
a_in, b_in = keras.Input((3,), dtype="int32"), keras.Input((5,))
h = keras.layers.Flatten()(keras.layers.Embedding(50, 4)(a_in))
out = keras.layers.Dense(1)(keras.layers.Concatenate()([h, keras.layers.Dense(6, "relu")(b_in)]))
m = keras.Model([a_in, b_in], out)
m.compile(keras.optimizers.SGD(0.1, clipnorm=0.5, gradient_accumulation_steps=2), "mse")
m.fit([ids, x], y, batch_size=16, epochs=2, shuffle=False, verbose=0)
m2 = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(1)])
m2.compile(keras.optimizers.SGD(0.05), "mae")
m2.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
weights = np.concatenate([w.ravel() for w in m.get_weights() + m2.get_weights()])
np.save(os.path.join(tmp, f"{kind}.npy"), weights)
print("SNAPSHOT " + json.dumps({"points": snap, "tfdp_things": tfdp_things()}))
'''


def _snapshot(tmp_path, kind):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFDP_")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-c", _SNAPSHOT, kind, str(tmp_path),
                           json.dumps(POINTS)], capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("SNAPSHOT ")][-1]
    return json.loads(line[len("SNAPSHOT "):]), np.load(tmp_path / f"{kind}.npy")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """A process that never imported tfdp."""
    return _snapshot(tmp_path_factory.mktemp("clean"), "clean")


def test_the_points_checked_are_every_point_the_adapter_wraps():
    from tfdp.keras import adapter
    import importlib
    scope = {"importlib": importlib}
    exec(_RESOLVE, scope)  # noqa: S102  (as the snapshot process resolves POINTS)
    resolve = scope["resolve"]
    wrapped = set()
    for name, hook_set in adapter.SETS.items():
        if name in ("peer_failure", "device_alias"):
            continue  # (sys.excepthook and the eager context: checked by themselves)
        for owner, attr in hook_set.points().values():
            wrapped.add((id(owner), attr))
    assert wrapped == {(id(resolve(owner)), attr) for owner, attr in POINTS}


@pytest.mark.usefixtures("run_process")  # (starts processes: the e2e tier)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["imported", "dropped"])
def test_nothing_of_tfdp_stays_in_keras(clean, tmp_path, kind):
    clean_snap, clean_weights = clean
    assert clean_snap["tfdp_things"] == []
    assert clean_snap["points"]["sys.excepthook"]["is_default"]
    snap, weights = _snapshot(tmp_path, kind)
    assert snap["points"] == clean_snap["points"]
    assert snap["tfdp_things"] == []
    np.testing.assert_array_equal(weights, clean_weights)  # bitwise


@pytest.mark.usefixtures("run_process")
@pytest.mark.timeout(600)
def test_the_check_tells_a_process_with_a_live_strategy_apart(clean, tmp_path):
    clean_snap, clean_weights = clean
    snap, weights = _snapshot(tmp_path, "kept")
    differ = sorted(k for k in clean_snap["points"]
                    if snap["points"][k] != clean_snap["points"][k])
    # every Keras point of the strategy-scoped sets (gradient path, perf, zero, drop-in resume)
    # is wrapped while a strategy and a tfdp BackupAndRestore live; one worker: Keras's file
    # writers, sys.excepthook and the eager context stay Keras's / TF's / Python's own
    assert differ == sorted(f"{o}.{a}" for o, a in POINTS if not a.startswith(
        ("_save_model", "on_train_end", "on_train_begin"))), differ
    assert snap["tfdp_things"]
    np.testing.assert_array_equal(weights, clean_weights)  # (the hooks pass through)


# --- the mechanism, in this process (no TensorFlow needed) -------------------------------------

class _Base:
    def method(self, x):
        return ("base", x)


def _tagging(tag):
    def make(original):
        def wrapper(self, x):
            return (tag, original(self, x))
        return wrapper
    return make


def test_unwrap_puts_the_original_back_exactly_in_any_order():
    from tfdp import compat

    class Sub(_Base):
        def own(self, x):
            return ("own", x)

    points = {"inherited": (Sub, "method"), "own": (Sub, "own")}
    own_original = Sub.__dict__["own"]
    compat.wrap(points, {"inherited": _tagging("a"), "own": _tagging("a")}, "__a__")
    compat.wrap(points, {"inherited": _tagging("b"), "own": _tagging("b")}, "__b__")
    compat.wrap(points, {"inherited": _tagging("b")}, "__b__")  # idempotent
    assert Sub().method(1) == ("b", ("a", ("base", 1)))
    assert compat.wrapped(points, "__a__") == ["inherited", "own"]
    compat.unwrap(points, ["inherited", "own"], "__a__")  # the inner layer first
    assert Sub().method(1) == ("b", ("base", 1)) and Sub().own(2) == ("b", ("own", 2))
    assert compat.wrapped(points, "__a__") == []
    compat.unwrap(points, ["inherited", "own"], "__b__")
    assert "method" not in Sub.__dict__ and Sub.method is _Base.method  # inherited: deleted
    assert Sub.__dict__["own"] is own_original
    compat.unwrap(points, ["inherited", "own"], "__b__")  # nothing left: no-op
    assert _Base.__dict__["method"](None, 3) == ("base", 3)


def test_hook_sets_are_counted_by_live_users(monkeypatch):
    import gc

    from tfdp.keras import adapter

    class Owner:
        pass

    class Target:
        def method(self, x):
            return ("target", x)

    original = Target.__dict__["method"]
    hook_set = adapter.HookSet("test", lambda: {"m": (Target, "method")}, "__tfdp_test__")
    monkeypatch.setitem(adapter.SETS, "test", hook_set)
    adapter.provide("test", {"m": _tagging("tfdp")})
    a, b = Owner(), Owner()
    adapter.use(a, "test")
    adapter.use(b, "test")
    assert adapter.users("test") == 2 and Target().method(1) == ("tfdp", ("target", 1))
    del a
    gc.collect()
    assert adapter.users("test") == 1 and Target().method(1) == ("tfdp", ("target", 1))
    adapter.release(b)  # explicitly, before b is collected
    assert adapter.users("test") == 0 and Target.__dict__["method"] is original
    del b
    gc.collect()
    assert adapter.users("test") == 0 and Target.__dict__["method"] is original
    with pytest.raises(KeyError, match="no hook set 'nope'"):
        adapter.use(Owner(), "nope")

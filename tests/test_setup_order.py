"""Order of set-up does not matter; custom loops across workers (issue: set-up order, custom loops).

A script may import TensorFlow, set seeds and build datasets and tensors before it creates the
strategy, with ``TFDP_CPU_REPLICAS`` set or not, in one process or under ``tfdp launch``; where
something truly must come first (``import tfdp`` before the TF runtime starts, for the CPU
split) one line says what and how to fix it. And TF's multi-worker custom-loop tutorial as
written (optimizer slots created lazily by the first ``apply_gradients`` inside the
``tf.function`` step) trains across 2 workers x 2 CPU replicas exactly like one device.

Every case needs a fresh TF runtime, so each runs in a subprocess (hard timeouts): plain
``python -c`` for one process, ``tfdp.testing.run_workers`` (``tfdp launch`` on 127.0.0.1) for
several workers. Workers import the training code from this module, so the single-device
reference computed here runs exactly the same code.
"""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tfdp.testing import parse_results, run_workers

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
TOL = 1e-5
ENV = {"TFDP_TEST_DIR": TESTS_DIR, "CUDA_VISIBLE_DEVICES": ""}


def _run(code, env_extra=None, timeout=150):
    """Run ``code`` in a fresh Python (no TFDP_CPU_REPLICAS / TF_CONFIG unless given)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TFDP_CPU_REPLICAS", "TF_CONFIG")}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="", **(env_extra or {}))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=timeout, env=env, cwd=ROOT)
    return r


def _lines(r, mark):
    return [line[len(mark):].strip() for line in r.stdout.splitlines() if line.startswith(mark)]


# --- one process: TFDP_CPU_REPLICAS honoured whenever tfdp is imported before the runtime -------

@pytest.mark.timeout(200)
def test_env_var_honoured_when_datasets_seeds_and_ops_come_first(run_process):
    r = _run("""
        import importlib.util, sys
        import tfdp
        print("TF_IMPORTED_BY_TFDP", "tensorflow" in sys.modules)   # import tfdp: no TF
        importlib.util.find_spec("tensorflow")                     # a probe executes nothing
        import numpy as np
        import tensorflow as tf
        import keras
        keras.utils.set_random_seed(0)
        tf.random.set_seed(0)
        x = tf.constant(np.ones((64, 3), "float32"))               # the runtime starts here
        ds = tf.data.Dataset.from_tensor_slices((x, tf.ones((64, 1)))).batch(16)
        print("CARD", int(ds.cardinality()))
        strategy = tfdp.DataParallelStrategy()
        print("REPLICAS", strategy.num_replicas_in_sync)
        with strategy.scope():
            m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
            m.compile("sgd", "mse")
        m.fit(ds, epochs=1, verbose=0)
        print("FIT OK")
        # An explicit CPU list gets its devices from TFDP_CPU_REPLICAS too.
        print("EXPLICIT", tfdp.DataParallelStrategy(["CPU:0", "CPU:1"]).num_replicas_in_sync)
        try:
            tfdp.DataParallelStrategy(["CPU:0", "CPU:2"])
        except ValueError as e:
            print("ERR", e)
    """, {"TFDP_CPU_REPLICAS": "2"})
    out = r.stdout + r.stderr[-3000:]
    assert _lines(r, "TF_IMPORTED_BY_TFDP") == ["False"], out
    assert _lines(r, "REPLICAS") == ["2"] and _lines(r, "FIT OK") == [""], out
    assert _lines(r, "EXPLICIT") == ["2"], out
    (err,) = _lines(r, "ERR")
    assert "Device 'CPU:2' does not exist" in err and "Received: devices=['CPU:0', 'CPU:2']" in err
    # the hint names the variable that is set, not "set TFDP_CPU_REPLICAS=n"
    assert "TFDP_CPU_REPLICAS=2 gives CPU:0..CPU:1" in err and "set TFDP_CPU_REPLICAS" in err
    assert "(or TFDP_CPU_REPLICAS=n)" not in err


@pytest.mark.timeout(200)
def test_env_var_honoured_when_tensorflow_is_imported_before_tfdp(run_process):
    r = _run("""
        import tensorflow as tf
        import tfdp                      # TF imported, runtime not started: split now
        ds = tf.data.Dataset.range(8).batch(4)
        print("CPUS", len(tf.config.list_logical_devices("CPU")))
        print("REPLICAS", tfdp.DataParallelStrategy().num_replicas_in_sync)
    """, {"TFDP_CPU_REPLICAS": "3"})
    assert _lines(r, "CPUS") == ["3"] and _lines(r, "REPLICAS") == ["3"], r.stdout + r.stderr


@pytest.mark.timeout(200)
@pytest.mark.parametrize("when,needles", [
    ("before_import", ["TFDP_CPU_REPLICAS=2 came too late", "started before `import tfdp`",
                       "Received: TFDP_CPU_REPLICAS=2 with 1 logical CPU device(s)",
                       "Import tfdp before any TensorFlow op"]),
    ("set_later", ["TFDP_CPU_REPLICAS=2 came too late", "set after `import tfdp`",
                   "Received: TFDP_CPU_REPLICAS=2 with 1 logical CPU device(s)",
                   "before the program starts"]),
])
def test_too_late_for_the_cpu_split_is_one_clear_line(run_process, when, needles):
    code = {
        "before_import": """
            import os
            import tensorflow as tf
            tf.constant(1.0) + 1           # the runtime starts with one CPU device
            import tfdp
        """,
        "set_later": """
            import os
            import tfdp
            import tensorflow as tf
            tf.constant(1.0) + 1
            os.environ["TFDP_CPU_REPLICAS"] = "2"
        """,
    }[when] + """
            for make in (lambda: tfdp.DataParallelStrategy(),
                         lambda: tfdp.DataParallelStrategy(["CPU:0", "CPU:1"])):
                try:
                    make()
                    print("NO ERROR")
                except ValueError as e:
                    print("ERR", repr(str(e)))
    """
    r = _run(code, {"TFDP_CPU_REPLICAS": "2"} if when == "before_import" else None)
    errs = _lines(r, "ERR")
    assert len(errs) == 2, r.stdout + r.stderr[-3000:]
    for err in errs:
        msg = eval(err)  # noqa: S307  (repr of a str printed by the child)
        assert "\n" not in msg, msg
        for n in needles:
            assert n in msg, msg


@pytest.mark.timeout(200)
def test_an_explicit_configure_call_wins_over_the_variable_and_says_so(run_process):
    """Arguments > environment: the program's own configure_cpu_replicas(4) beats
    TFDP_CPU_REPLICAS=2 (already applied at import), with one log line naming both."""
    r = _run("""
        import tfdp
        import tensorflow as tf
        tfdp.configure_cpu_replicas(4)
        ds = tf.data.Dataset.range(8).batch(4)          # the runtime starts after the call
        print("REPLICAS", tfdp.DataParallelStrategy().num_replicas_in_sync)
        print("EXPLICIT", tfdp.DataParallelStrategy(["CPU:0", "CPU:3"]).num_replicas_in_sync)
    """, {"TFDP_CPU_REPLICAS": "2"})
    assert _lines(r, "REPLICAS") == ["4"] and _lines(r, "EXPLICIT") == ["2"], r.stdout + r.stderr
    said = [ln for ln in r.stderr.splitlines() if "overrides TFDP_CPU_REPLICAS" in ln]
    assert len(said) == 1, r.stderr
    assert "configure_cpu_replicas(4) overrides TFDP_CPU_REPLICAS=2" in said[0]
    assert "an explicit call wins over the environment" in said[0]


@pytest.mark.timeout(200)
def test_an_explicit_call_after_the_runtime_started_with_the_variable_is_one_clear_line(
        run_process):
    r = _run("""
        import tfdp
        import tensorflow as tf
        tf.constant(1.0) + 1                            # the runtime starts with 2 devices
        try:
            tfdp.configure_cpu_replicas(4)
        except ValueError as e:
            print("ERR", repr(str(e)))
        print("REPLICAS", tfdp.DataParallelStrategy().num_replicas_in_sync)
    """, {"TFDP_CPU_REPLICAS": "2"})
    (err,) = _lines(r, "ERR") or [r.stdout + r.stderr[-3000:]]
    msg = eval(err)  # noqa: S307  (repr of a str printed by the child)
    assert "\n" not in msg
    for needle in ("configure_cpu_replicas(4) came too late to override TFDP_CPU_REPLICAS=2",
                   "applied when tfdp was imported", "Received: n=4, TFDP_CPU_REPLICAS=2",
                   "before any TensorFlow op"):
        assert needle in msg, msg
    assert _lines(r, "REPLICAS") == ["2"], r.stdout + r.stderr   # the variable's count stands


@pytest.mark.timeout(200)
def test_port_in_use_is_clear_also_when_a_dataset_comes_first(run_process):
    """The runtime started before the strategy: the worker's port is still checked first."""
    import json
    import socket
    import portpicker
    port, other = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    config = json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{other}"]},
                         "task": {"type": "worker", "index": 0}})
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", port))
        held.listen(1)
        r = _run("""
            import tfdp
            import tensorflow as tf
            ds = tf.data.Dataset.range(8).batch(4)   # starts the runtime
            try:
                tfdp.DataParallelStrategy()
            except ValueError as e:
                print("ERR", e)
        """, {"TF_CONFIG": config})
    (err,) = _lines(r, "ERR") or [r.stdout + r.stderr[-3000:]]
    assert f"Port {port}" in err and "already in use" in err and f"port={port}" in err, err


# --- several workers: datasets first, then the strategy (tfdp launch) --------------------------

N_EXAMPLES, BATCH, EPOCHS = 210, 50, 2  # uneven last batch (10)


def _data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(N_EXAMPLES, 6)).astype("float32")
    y = (x @ rng.normal(size=(6, 1))).astype("float32")
    return x, y


def _model(seed):
    import keras
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1)])


def _weights(strategy, model, optimizer):
    """This worker's copies of every variable: (first replica's arrays, all copies identical)."""
    import numpy as np
    out, identical = [], True
    for v in list(model.variables) + list(optimizer.variables):
        v = getattr(v, "value", v)
        copies = ([np.asarray(c) for c in strategy.experimental_local_results(v)]
                  if strategy is not None else [np.asarray(v)])
        identical &= all(np.array_equal(c, copies[0]) for c in copies)
        out.append(copies[0])
    return out, bool(identical)


DATASET_FIRST_SCRIPT = """
import json, os, sys
import tfdp
import numpy as np
import tensorflow as tf
import keras
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
from tfdp.testing import emit_result
from test_setup_order import BATCH, EPOCHS, _data, _model, _weights
rank = int(os.environ["TFDP_WORKER_RANK"])
# Seeds, tensors and the dataset come first: the TF runtime starts before the strategy.
tf.random.set_seed(7)
x, y = _data()
ds = tf.data.Dataset.from_tensor_slices((tf.constant(x), tf.constant(y))).batch(BATCH)
eval_ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(37)
assert int(ds.cardinality()) == 5
made_before = tf.Variable(1.0, name="made_before")  # unusable after the start: named in a warning
devices = json.loads(os.environ["DEVICES"])
strategy = tfdp.DataParallelStrategy(devices)
with strategy.scope():
    model = _model(seed=1 + rank)  # worker 0's initial weights must win
    model.compile(keras.optimizers.Adam(1e-2), "mse")
hist = model.fit(ds, epochs=EPOCHS, verbose=0).history
ev = model.evaluate(eval_ds, verbose=0)
w, identical = _weights(strategy, model, model.optimizer)
emit_result(rank=rank, replicas=strategy.num_replicas_in_sync, loss=hist["loss"], eval=ev,
            weights=w, replicas_identical=identical,
            local=len(strategy.extended.worker_devices))
"""


def _reference_fit():
    import keras
    import tensorflow as tf
    x, y = _data()
    model = _model(seed=1)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    hist = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=EPOCHS,
                     verbose=0).history
    ev = model.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(37), verbose=0)
    return _weights(None, model, model.optimizer)[0], hist["loss"], ev


def _max_diff(a, b):
    assert len(a) == len(b)
    return max(float(np.max(np.abs(np.asarray(p, np.float64) - np.asarray(q, np.float64))))
               for p, q in zip(a, b))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cpu_replicas,devices", [(None, None), (2, ["CPU:0", "CPU:1"])],
                         ids=["1-replica-per-worker", "2-cpu-replicas-explicit-list"])
def test_workers_train_when_the_dataset_comes_before_the_strategy(worker_job, cpu_replicas,
                                                                  devices):
    import json
    outputs = run_workers(DATASET_FIRST_SCRIPT, workers=2, cpu_replicas=cpu_replicas,
                          timeout=200, env=dict(ENV, DEVICES=json.dumps(devices)))
    results = parse_results(outputs)
    for out in outputs:  # the one variable made before the strategy is named, with the fix
        assert ("1 variable(s) were created before the multi-worker strategy" in out
                and "Received: 'made_before:0'" in out and "datasets and tensors may come first"
                in out), out
    k = cpu_replicas or 1
    assert [(r["rank"], r["replicas"], r["local"]) for r in results] == [(0, 2 * k, k),
                                                                         (1, 2 * k, k)]
    assert all(r["replicas_identical"] for r in results)
    w0, w1 = results[0]["weights"], results[1]["weights"]
    assert _max_diff(w0, w1) == 0.0, "the workers' weights differ"
    assert results[0]["loss"] == results[1]["loss"] and results[0]["eval"] == results[1]["eval"]
    ref_w, ref_loss, ref_eval = _reference_fit()
    diff = _max_diff(w0, ref_w)
    print(f"dataset first, {k} replica(s) per worker: max |dw| vs one device = {diff:.2e}")
    assert diff <= TOL
    np.testing.assert_allclose(results[0]["loss"], ref_loss, rtol=1e-5)
    np.testing.assert_allclose(results[0]["eval"], ref_eval, rtol=1e-5)


# --- several workers: TF's multi-worker custom-loop tutorial, as written ------------------------

LOOP_EXAMPLES, LOOP_BATCH, LOOP_STEPS = 192, 32, 12  # 6 global batches a pass, 2 passes


def tutorial_loop(strategy, optimizer_name, seed):
    """TF's "Custom training loop with MultiWorkerMirroredStrategy" tutorial, in small.

    Model, optimizer and metric are created in ``strategy.scope()``; the optimizer's slots are
    NOT built beforehand: the first ``apply_gradients``, inside the ``tf.function`` step, in
    replica context, creates them. ``strategy=None``: the same loop on one device.
    """
    import contextlib
    import keras
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(11)
    x = rng.normal(size=(LOOP_EXAMPLES, 6)).astype("float32")
    y = rng.integers(0, 4, size=(LOOP_EXAMPLES,)).astype("int32")
    with strategy.scope() if strategy else contextlib.nullcontext():
        keras.utils.set_random_seed(seed)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(4)])
        optimizer = {"adam": lambda: keras.optimizers.Adam(1e-2),
                     "rmsprop": lambda: keras.optimizers.RMSprop(1e-2)}[optimizer_name]()
        train_loss = keras.metrics.Sum()
    assert not optimizer.built  # the slots come lazily, inside the first step
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(LOOP_BATCH)

    def step_fn(inputs):
        xb, yb = inputs
        with tf.GradientTape() as tape:
            logits = model(xb, training=True)
            per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(yb, logits)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=LOOP_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        train_loss.update_state(loss)
        return loss

    if strategy is None:
        iterator = iter(ds)

        @tf.function
        def train_step(it):
            return step_fn(next(it))
    else:
        iterator = iter(strategy.experimental_distribute_dataset(ds))

        @tf.function
        def train_step(it):
            per_replica = strategy.run(step_fn, args=(next(it),))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    losses = [float(train_step(iterator)) for _ in range(LOOP_STEPS)]
    return model, optimizer, losses, float(train_loss.result())


LOOP_SCRIPT = """
import os, sys
import tfdp
strategy = tfdp.DataParallelStrategy()
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
from tfdp.testing import emit_result
from test_setup_order import _weights, tutorial_loop
rank = strategy.cluster.rank
out = {}
for name in ("adam", "rmsprop"):
    model, opt, losses, total = tutorial_loop(strategy, name, seed=3 + rank)
    w, identical = _weights(strategy, model, opt)
    out[name] = dict(losses=losses, total=total, weights=w, replicas_identical=identical,
                     slots=len(opt.variables))
emit_result(rank=rank, replicas=strategy.num_replicas_in_sync, runs=out)
"""


@pytest.mark.timeout(300)
def test_tutorial_custom_loop_lazy_slots_two_workers_two_replicas_equal_one_device(worker_job):
    outputs = run_workers(LOOP_SCRIPT, workers=2, cpu_replicas=2, timeout=200, env=ENV)
    results = parse_results(outputs)
    assert [r["replicas"] for r in results] == [4, 4]
    for name in ("adam", "rmsprop"):
        a, b = results[0]["runs"][name], results[1]["runs"][name]
        assert a["replicas_identical"] and b["replicas_identical"], name
        assert _max_diff(a["weights"], b["weights"]) == 0.0, f"{name}: workers differ"
        assert a["losses"] == b["losses"] and a["total"] == b["total"], name
        model, opt, ref_losses, ref_total = tutorial_loop(None, name, seed=3)
        ref_w, _ = _weights(None, model, opt)
        assert a["slots"] == len(opt.variables), name
        diff = _max_diff(a["weights"], ref_w)
        print(f"tutorial loop, {name}, 2 workers x 2 replicas: max |dw| vs one device = "
              f"{diff:.2e}")
        assert diff <= TOL, name
        np.testing.assert_allclose(a["losses"], ref_losses, rtol=1e-5)
        np.testing.assert_allclose(a["total"], ref_total, rtol=1e-5)


# --- a model built before the strategy: tfdp's error names the fix (issue 23, point 2) ---------

_BEFORE = """
    import numpy as np, keras
    import tfdp
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    {strategy}
    x = np.ones((32, 8), "float32"); y = np.ones((32, 1), "float32")
    try:
        {fit}
    except ValueError as e:
        print("ERR", type(e).__name__, isinstance(e, RuntimeError), e)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("form", ["default", "explicit_outside", "explicit_inside"])
def test_a_model_built_before_the_strategy_is_one_error_naming_the_fix(run_process, form):
    strategy, fit = {
        "default": ("tfdp.set_default_strategy()",
                    "model.compile('adam', 'mse'); model.fit(x, y, batch_size=8, verbose=0)"),
        "explicit_outside": ("strategy = tfdp.DataParallelStrategy()\n    with strategy.scope():"
                             "\n        model.compile('adam', 'mse')",
                             "model.fit(x, y, batch_size=8, verbose=0)"),
        "explicit_inside": ("strategy = tfdp.DataParallelStrategy()",
                            "with strategy.scope():\n            model.compile('adam', 'mse'); "
                            "model.fit(x, y, batch_size=8, verbose=0)"),
    }[form]
    r = _run(_BEFORE.format(strategy=strategy, fit=fit), {"TFDP_CPU_REPLICAS": "2"})
    err = _lines(r, "ERR")
    assert err, r.stdout + r.stderr
    assert err[0].startswith("SetupOrderError True "), err   # a ValueError and a RuntimeError
    assert "variable 'sequential/dense/kernel'" in err[0], err
    if form == "default":
        assert "The model was built before tfdp.set_default_strategy()" in err[0], err
        assert "move it above `model = ...`" in err[0], err
    else:
        assert "built before the DataParallelStrategy was created or outside its" in err[0], err
        assert "with strategy.scope(): model = build_model()" in err[0], err


# --- every wrong order, as users write it, in the test process (issue 33, point 1) -------------
#
# Each case is a script's lines in the order a user gets wrong; the first training step raises one
# SetupOrderError (a ValueError and a RuntimeError) whose one line names the fix. Core tier: the
# test process's 4 CPU replicas; the program's default strategy is reset after each test.

@pytest.fixture
def program():
    """A fresh program's state: no default strategy before and after the test."""
    import tensorflow as tf
    tf.distribute.experimental_set_strategy(None)
    yield
    tf.distribute.experimental_set_strategy(None)


def _xy():
    return np.ones((32, 8), "float32"), np.ones((32, 1), "float32")


def _build():
    import keras
    # (named: Keras numbers unnamed models and layers per process, in test order)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="dense"),
                             keras.layers.Dense(1, name="dense_1")], name="sequential")


def _setup_error(script, *args):
    """``script(*args)``'s SetupOrderError, checked to be one line of the one template."""
    from tfdp.strategy.setup_order import SetupOrderError
    with pytest.raises(SetupOrderError) as info:
        script(*args)
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, RuntimeError)
    text = str(err)
    assert "\n" not in text and ". Received: " in text, text
    assert "Mixing different" not in text.split("(TF:")[0], text
    return text


def compiled_then_default_strategy():
    """The issue's case: the two lines added just before fit."""
    import tfdp
    x, y = _xy()
    model = _build()
    model.compile("adam", "mse")
    tfdp.set_default_strategy()
    model.fit(x, y, batch_size=8, verbose=0)


def compiled_then_fit_in_scope():
    import tfdp
    x, y = _xy()
    model = _build()
    model.compile("adam", "mse")
    strategy = tfdp.DataParallelStrategy()
    with strategy.scope():
        model.fit(x, y, batch_size=8, verbose=0)


def trained_then_default_strategy():
    import tfdp
    x, y = _xy()
    model = _build()
    model.compile("adam", "mse")
    model.fit(x, y, batch_size=8, verbose=0)
    tfdp.set_default_strategy()
    model.fit(x, y, batch_size=8, verbose=0)


def trained_then_fit_in_scope():
    import tfdp
    x, y = _xy()
    model = _build()
    model.compile("adam", "mse")
    model.fit(x, y, batch_size=8, verbose=0)
    strategy = tfdp.DataParallelStrategy()
    with strategy.scope():
        model.fit(x, y, batch_size=8, verbose=0)


def _saved(tmp_path):
    x, y = _xy()
    model = _build()
    model.compile("adam", "mse")
    model.fit(x, y, batch_size=8, verbose=0)
    model.save(tmp_path / "model.keras")
    return tmp_path / "model.keras"


def loaded_outside_the_scope(tmp_path):
    import keras
    import tfdp
    path = _saved(tmp_path)
    x, y = _xy()
    strategy = tfdp.DataParallelStrategy()
    model = keras.models.load_model(path)
    with strategy.scope():
        model.fit(x, y, batch_size=8, verbose=0)


def loaded_before_default_strategy(tmp_path):
    import keras
    import tfdp
    path = _saved(tmp_path)
    x, y = _xy()
    model = keras.models.load_model(path)
    tfdp.set_default_strategy()
    model.fit(x, y, batch_size=8, verbose=0)


def optimizer_before_default_strategy():
    import keras
    import tfdp
    x, y = _xy()
    optimizer = keras.optimizers.Adam(1e-3)
    tfdp.set_default_strategy()
    model = _build()
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=8, verbose=0)


def model_of_another_strategy():
    import tfdp
    x, y = _xy()
    first = tfdp.DataParallelStrategy()
    with first.scope():
        model = _build()
        model.compile("adam", "mse")
    second = tfdp.DataParallelStrategy()
    with second.scope():
        model.fit(x, y, batch_size=8, verbose=0)


def model_of_another_strategy_then_default():
    import tfdp
    x, y = _xy()
    strategy = tfdp.DataParallelStrategy()
    with strategy.scope():
        model = _build()
        model.compile("adam", "mse")
    tfdp.set_default_strategy()
    model.fit(x, y, batch_size=8, verbose=0)


def built_then_compiled_in_scope_fit_outside():
    import tfdp
    x, y = _xy()
    model = _build()
    strategy = tfdp.DataParallelStrategy()
    with strategy.scope():
        model.compile("adam", "mse")
    model.fit(x, y, batch_size=8, verbose=0)


def _cases(*pairs):
    return [pytest.param(script, needles, id=script.__name__) for script, needles in pairs]


DEFAULT_FIX = "move it above `model = ...`"
SCOPE_FIX = "with strategy.scope(): model = build_model(); model.compile(...)"
SCOPE_WHAT = "before the DataParallelStrategy was created or outside its `with strategy.scope():`"


@pytest.mark.parametrize("script,needles", _cases(
    (compiled_then_default_strategy, [
        "The model was built before tfdp.set_default_strategy(), so its variables are not "
        "mirrored", "Received: variable 'sequential/dense/kernel' of model 'sequential', a plain "
        "tf.Variable on one device", DEFAULT_FIX]),
    (compiled_then_fit_in_scope, [f"The model was built {SCOPE_WHAT}", SCOPE_FIX]),
    (trained_then_default_strategy, [
        "The model was trained, or loaded with keras.models.load_model, before "
        "tfdp.set_default_strategy(), so its optimizer state sits on one device",
        "its optimizer 'adam", "already has its state (iterations=4)", DEFAULT_FIX,
        "a saved model: `model = keras.models.load_model(path)` after the call"]),
    (trained_then_fit_in_scope, [
        f"The model was trained, or loaded with keras.models.load_model, {SCOPE_WHAT}",
        SCOPE_FIX, "`with strategy.scope(): model = keras.models.load_model(path)`"]),
    (optimizer_before_default_strategy, [
        "An optimizer (or another object with variables) was created before "
        "tfdp.set_default_strategy()", "an object created under no strategy, used under "
        "DataParallelStrategy at 0x", "(the program's default, from tfdp.set_default_strategy())",
        DEFAULT_FIX]),
    (model_of_another_strategy, [
        "Two strategies are mixed", ".scope() entered while DataParallelStrategy at 0x",
        "a model created under the first, trained under the second",
        "Build, compile and train each model under one strategy"]),
    (model_of_another_strategy_then_default, [
        "Two strategies are mixed",
        "is current (a model created under the first, trained under the second)",
        "(the program's default, from tfdp.set_default_strategy())",
        "call tfdp.set_default_strategy() once, before any model"]),
    (built_then_compiled_in_scope_fit_outside, [
        f"The model was built {SCOPE_WHAT}", "training ran outside its scope", SCOPE_FIX]),
))
def test_every_wrong_order_is_one_setup_order_error_naming_the_fix(program, script, needles):
    text = _setup_error(script)
    for needle in needles:
        assert needle in text, (needle, text)


@pytest.mark.parametrize("script,needles", _cases(
    (loaded_outside_the_scope, [
        f"The model was trained, or loaded with keras.models.load_model, {SCOPE_WHAT}",
        "`with strategy.scope(): model = keras.models.load_model(path)`"]),
    (loaded_before_default_strategy, [
        "The model was trained, or loaded with keras.models.load_model, before "
        "tfdp.set_default_strategy()", DEFAULT_FIX,
        "`model = keras.models.load_model(path)` after the call"]),
))
def test_load_model_outside_the_scope_is_one_setup_order_error(program, tmp_path, script,
                                                               needles):
    text = _setup_error(script, tmp_path)
    for needle in needles:
        assert needle in text, (needle, text)


def test_the_right_orders_still_train(program, tmp_path):
    """No false alarm: the default form, the scoped form with zero_stage=1, a model loaded in the
    scope, and evaluating a model built before the strategy (its variables are only read)."""
    import keras
    import tfdp
    x, y = _xy()
    path = _saved(tmp_path)
    built_before = _build()
    built_before.compile("adam", "mse")
    strategy = tfdp.DataParallelStrategy(zero_stage=1)
    with strategy.scope():
        sharded = _build()
        sharded.compile("adam", "mse")
        loaded = keras.models.load_model(path)
    sharded.fit(x, y, batch_size=8, verbose=0)
    loaded.fit(x, y, batch_size=8, verbose=0)
    with strategy.scope():
        built_before.evaluate(x, y, batch_size=8, verbose=0)
    tfdp.set_default_strategy()
    model = _build()
    model.compile("adam", "mse")
    assert len(model.fit(x, y, batch_size=8, epochs=2, verbose=0).history["loss"]) == 2


@pytest.mark.parametrize("kwargs,needles", [
    ({"num_replicas": 4}, ["DataParallelStrategy got unknown argument. Received: num_replicas=4",
                           "Valid: devices, all_reduce, bucket_bytes", "zero_stage",
                           "devices=['GPU:0', 'GPU:1']", "set TFDP_CPU_REPLICAS=4",
                           "tfdp.configure_cpu_replicas(4)"]),
    ({"all_reduc": "ring"}, ["Received: all_reduc='ring'", "Did you mean all_reduce='ring'?"]),
    ({"num_workers": 2}, ["Received: num_workers=2", "tfdp launch --workers 2"]),
    ({"device": ["CPU:0"]}, ["Did you mean devices=['CPU:0']?"]),
])
def test_an_unknown_argument_names_the_valid_ones_and_the_intent(program, kwargs, needles):
    import tfdp
    for make in (tfdp.DataParallelStrategy, tfdp.set_default_strategy):
        with pytest.raises(TypeError) as info:   # what Python raises for one, and a ValueError
            make(**kwargs)
        text = str(info.value)
        assert isinstance(info.value, ValueError) and "\n" not in text, text
        for needle in needles:
            assert needle in text, (needle, text)


def test_the_strategy_arguments_list_is_the_signature():
    import inspect
    import tfdp
    from tfdp.strategy.local import _ARGUMENTS
    params = [p for p in inspect.signature(tfdp.DataParallelStrategy.__init__).parameters
              if p != "self"]
    assert tuple(params) == _ARGUMENTS


def test_the_troubleshooting_page_lists_every_setup_order_message(program):
    """docs/guide/troubleshooting.md's `SetupOrderError: ...` rows are the messages the code
    builds (every stage, in both forms), and every message has its row."""
    import tfdp
    from tfdp.strategy.setup_order import setup_order_error
    page = open(os.path.join(ROOT, "docs", "guide", "troubleshooting.md")).read()
    # a row: | `SetupOrderError: <the message's start> ...` ... | the fix |
    rows = re.findall(r"^\| `SetupOrderError: (.+?) \.\.\.`", page, re.M)
    assert len(rows) >= 6, rows
    scoped = tfdp.DataParallelStrategy()
    default = tfdp.set_default_strategy()
    messages = [str(setup_order_error(s, stage, "X")).replace("`", "")
                for s in (scoped, default)
                for stage in ("built", "compiled", "trained", "created", "other")]
    for row in rows:
        assert any(m.startswith(row) for m in messages), (row, messages)
    for m in messages:
        assert any(m.startswith(row) for row in rows), (m, rows)

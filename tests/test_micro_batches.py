"""Micro-batches (``DataParallelStrategy(micro_batches=k)``, and the elastic policy
``accumulate`` that sets k after a lost node: ``tfdp.strategy.micro_batches``): Keras ``fit``
on 3 CPU replicas with each replica's share of every step in k micro-batches ends within 1e-5
of one device on the same global batches (weights, optimizer state, History), every replica's
copy identical; no replica ever sees more than its micro-batch (a layer asserts it); uneven and
empty micro-batches, a global clipnorm, ZeRO-2 and Keras's own gradient accumulation see the
whole step's gradient; a backup written on 3 replicas resumes on 2 in micro-batches; what cannot
be split is refused at the first step with one error naming the fix; the launcher's
``--elastic-policy`` is checked and agreed at the join.
"""

import math
import os
import threading

import numpy as np
import pytest

from helpers import assert_replicas_identical, make_data

pytestmark = pytest.mark.timeout(240)

TOL = 1e-5
N, BATCH, EPOCHS, REPLICAS = 100, 32, 2, 3     # 4 steps per epoch, the last of 4 examples
_reference = {}


def _model(strategy, option, limit=None):
    """An Embedding (sparse gradients) + Dense model on dict inputs; ``limit``: a layer fails
    the step if a replica's training batch is larger."""
    import keras
    import tensorflow as tf

    class AtMost(keras.layers.Layer):
        def call(self, x, training=None):
            if training and limit is not None:
                tf.debugging.assert_less_equal(tf.shape(x)[0], limit,
                                               message="a micro-batch larger than its limit")
            return x

    def build():
        keras.utils.set_random_seed(1)
        ids = keras.Input((4,), dtype="int32", name="ids_in")
        dense = keras.Input((6,), name="features")
        e = keras.layers.Flatten()(keras.layers.Embedding(50, 4)(ids))
        h = keras.layers.Concatenate()([e, AtMost()(dense)])
        h = keras.layers.Dense(16, activation="relu")(h)
        m = keras.Model([ids, dense], keras.layers.Dense(1)(h))
        optimizer = {"adam": lambda: keras.optimizers.Adam(0.01),
                     "clip": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
                     "keras_accumulation": lambda: keras.optimizers.SGD(
                         0.05, momentum=0.9, gradient_accumulation_steps=2)}[option]()
        m.compile(optimizer, "mse", metrics=["mae"])
        return m
    if strategy is None:
        return build()
    with strategy.scope():
        return build()


def _fit(strategy, option, limit=None):
    import keras
    m = _model(strategy, option, limit)
    keras.utils.set_random_seed(3)
    x, y = make_data(N)
    h = m.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0)
    return m, h.history


def _state(m):
    return [np.array(getattr(v, "value", v)) for v in
            list(m.variables) + list(m.optimizer.variables)]


def _diff(a, b):
    return max(float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))))
               for x, y in zip(a, b))


def _one_device(option):
    if option not in _reference:
        m, hist = _fit(None, option)
        _reference[option] = (_state(m), hist)
    return _reference[option]


@pytest.mark.parametrize("option,k,zero_stage", [
    ("adam", 2, 0), ("adam", 3, 0), ("adam", 5, 0),     # 5: micro-batches of 0-3 examples
    ("clip", 2, 0), ("adam", 2, 2), ("keras_accumulation", 2, 0)])
def test_micro_batches_train_like_one_device(option, k, zero_stage):
    import tfdp
    strategy = tfdp.DataParallelStrategy([f"CPU:{i}" for i in range(REPLICAS)],
                                         micro_batches=k, zero_stage=zero_stage)
    limit = math.ceil(math.ceil(BATCH / REPLICAS) / k)   # 11 -> 6 (k=2), 4 (3), 3 (5)
    m, hist = _fit(strategy, option, limit)
    ref, ref_hist = _one_device(option)
    steps = EPOCHS * math.ceil(N / BATCH)   # (Keras's accumulation counts its updates)
    assert int(m.optimizer.iterations.numpy()) == (steps // 2 if "accumulation" in option
                                                   else steps)
    assert _diff(_state(m), ref) <= TOL
    for key in ("loss", "mae"):
        assert np.allclose(hist[key], ref_hist[key], rtol=0, atol=TOL), (key, hist, ref_hist)
    if zero_stage:   # (sharded optimizer slots have one copy: the model's variables only)
        for v in m.variables:
            copies = [np.asarray(c) for c in strategy.experimental_local_results(
                getattr(v, "value", v))]
            assert len(copies) == REPLICAS and all((c == copies[0]).all() for c in copies)
    else:
        assert_replicas_identical(strategy, m)
    assert f"micro_batches={k}" in repr(strategy)


def test_without_micro_batches_a_replica_sees_its_whole_share():
    """The layer's limit does fail a step that is not split (what the test above relies on)."""
    import tfdp
    strategy = tfdp.DataParallelStrategy([f"CPU:{i}" for i in range(REPLICAS)])
    with pytest.raises(Exception, match="a micro-batch larger than its limit"):
        _fit(strategy, "adam", limit=6)


def test_a_backup_from_3_replicas_resumes_on_2_in_micro_batches(tmp_path, capfd, caplog):
    """An elastic round with ``--elastic-policy accumulate``, in one process: 3 replicas write
    the backup, 2 resume it with each share in 2 micro-batches (as k = ceil(3 / 2)), and end
    where one device does."""
    import logging
    import tfdp
    import test_resume_dropin as t
    from helpers import Interrupt
    from tfdp.callbacks import BackupAndRestore
    caplog.set_level(logging.INFO, logger="tfdp")
    d = str(tmp_path / "backup")
    first = tfdp.DataParallelStrategy([f"CPU:{i}" for i in range(3)])
    with pytest.raises(Interrupt):
        t.run(first, "shuffled", [BackupAndRestore(d, save_freq=1), t.kill_at(7)])
    second = tfdp.DataParallelStrategy(["CPU:0", "CPU:1"], micro_batches=2)
    backup = BackupAndRestore(d, save_freq=1)
    m, _ = t.run(second, "shuffled", [backup], model_seed=5)
    assert backup.restored and int(m.optimizer.iterations.numpy()) == 15
    ref = t.state(t.run(None, "shuffled")[0])
    assert t.max_diff(t.state(m), ref) <= TOL
    said = capfd.readouterr().err + caplog.text   # (stderr, or the tfdp logger: configured)
    assert ("resuming at epoch 1 step 2 (global step 7) on 1 worker = 2 replicas; the backup "
            "was written on 1 worker = 3 replicas: fit's global batches are unchanged, split "
            "over fewer replicas, each replica's share in 2 micro-batches") in said, said


# --- what cannot be split: one error at the first step -----------------------------------------

def _refused_model(case):
    import keras

    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    keras.utils.set_random_seed(1)
    if case == "masked":
        x = keras.Input((5,), dtype="int32")
        h = keras.layers.Embedding(20, 4, mask_zero=True)(x)
        out = keras.layers.Dense(1)(h)
    else:
        x = keras.Input((5,))
        h = keras.layers.Dense(4)(x)
        if case == "batchnorm":
            h = keras.layers.BatchNormalization()(h)
        out = keras.layers.Dense(1)(h)
    m = (Custom if case == "custom" else keras.Model)(x, out)
    loss = keras.losses.MeanSquaredError(reduction="sum" if case == "sum" else
                                         "sum_over_batch_size")
    m.compile("sgd", loss, jit_compile=case == "xla")
    return m


@pytest.mark.parametrize("case,what", [
    ("batchnorm", "BatchNormalization (its batch statistics would be a micro-batch's"),
    ("custom", "A custom train_step cannot be split"),
    ("sum", "A loss with reduction='sum'"),
    ("masked", "A masked or sample-weight-mean loss"),
    ("xla", "A step compiled per replica with XLA")])
@pytest.mark.parametrize("asked", ["micro_batches=2", "elastic_policy='accumulate'"])
def test_what_cannot_be_split_is_refused_at_the_first_step(case, what, asked):
    """Also under the elastic policy at the job's full size (k = 1): the job fails at its first
    step, not after it lost a node."""
    import tfdp
    from tfdp.errors import TfdpError
    kwargs = {"micro_batches": 2} if asked.startswith("micro") else {"elastic_policy":
                                                                      "accumulate"}
    strategy = tfdp.DataParallelStrategy(["CPU:0", "CPU:1"], **kwargs)
    with strategy.scope():
        m = _refused_model(case)
    rng = np.random.default_rng(0)
    if case == "masked":   # ids with zeros (masked), a target per position
        x, y = rng.integers(0, 20, (16, 5)).astype("int32"), rng.normal(size=(16, 5, 1))
    else:
        x, y = rng.normal(size=(16, 5)).astype("float32"), rng.normal(size=(16, 1))
    with pytest.raises(TfdpError) as e:
        m.fit(x, y.astype("float32"), batch_size=8, epochs=1, verbose=0)
    text = str(e.value)
    assert what in text and "cannot be split into micro-batches exactly" in text, text
    assert "Received: " in text and asked in text and "Fix: " in text, text


# --- settings -------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [0, -1, True, "2", 1.5])
def test_a_bad_micro_batches_names_what_is_valid(value):
    import tfdp
    from tfdp.errors import TfdpError
    with pytest.raises(TfdpError, match=r"micro_batches.*Received: .*int >= 1"):
        tfdp.DataParallelStrategy(["CPU:0"], micro_batches=value)


def test_the_elastic_environment_is_checked(monkeypatch):
    import tfdp
    from tfdp.errors import TfdpError
    monkeypatch.setenv("TFDP_ELASTIC_POLICY", "grow")
    with pytest.raises(TfdpError, match="TFDP_ELASTIC_POLICY.*'grow'.*'batch', 'accumulate'"):
        tfdp.DataParallelStrategy(["CPU:0"])
    with pytest.raises(TfdpError, match="elastic_policy.*'shrink'"):
        tfdp.DataParallelStrategy(["CPU:0"], elastic_policy="shrink")
    monkeypatch.setenv("TFDP_ELASTIC_POLICY", "accumulate")
    monkeypatch.setenv("TFDP_ELASTIC_MAX_WORKERS", "three")
    with pytest.raises(TfdpError, match="TFDP_ELASTIC_MAX_WORKERS.*'three'.*tfdp launch"):
        tfdp.DataParallelStrategy(["CPU:0"])


@pytest.mark.parametrize("policy,full,now,k", [
    ("accumulate", 3, 2, 2), ("accumulate", 3, 3, 1), ("accumulate", 4, 1, 4),
    ("accumulate", 6, 4, 2), ("accumulate", None, 1, 1), ("batch", 3, 1, 1)])
def test_the_policy_sizes_micro_batches_to_a_share_at_the_full_size(policy, full, now, k):
    from tfdp.strategy import micro_batches
    assert micro_batches.policy_count(policy, full, now) == k


def test_micro_batch_bounds_cover_every_example_once_and_the_last_is_never_empty():
    from tfdp.strategy.micro_batches import bounds
    for n in range(0, 40):
        for k in range(1, 9):
            rows = [bounds(n, k, c) for c in range(k)]
            assert rows[0][0] == 0 and rows[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
            sizes = [hi - lo for lo, hi in rows]
            assert max(sizes) == math.ceil(n / k) and (n == 0 or sizes[-1] >= 1)


# --- the launcher -------------------------------------------------------------------------------

def test_the_launcher_and_the_strategy_know_the_same_policies():
    from tfdp.launch.rendezvous import ELASTIC_POLICIES
    from tfdp.strategy.micro_batches import POLICIES
    assert ELASTIC_POLICIES == POLICIES


@pytest.mark.parametrize("argv,shown", [
    (["--workers", "1", "--elastic-policy", "accumulate"],
     "--elastic-policy is for several nodes. Received: --elastic-policy='accumulate' without "
     "--nnodes"),
    (["--nnodes", "2", "--node-rank", "0", "--coordinator", "127.0.0.1:1",
      "--workers-per-node", "1", "--elastic-policy", "accumulate"],
     "--elastic-policy is for an elastic job. Received: --elastic-policy='accumulate'. Give "
     "--nnodes MIN:MAX (e.g. --nnodes 1:2)")])
def test_the_elastic_policy_outside_an_elastic_job_is_one_line(argv, shown):
    from tfdp.errors import UsageError
    from tfdp.launch.cli import main
    with pytest.raises(UsageError) as e:
        main(argv + ["--", "true"])
    assert str(e.value).startswith(shown), str(e.value)


def test_nodes_with_another_elastic_policy_are_refused_at_the_join():
    import portpicker
    from tfdp.errors import UsageError
    from tfdp.launch import rendezvous as rdzv
    from tfdp.launch.coordinator import Coordinator
    port = portpicker.pick_unused_port()
    lines, out = [], {}
    coord = Coordinator("127.0.0.1", port, lines.append)

    def node0():
        try:
            coord.gather(rdzv._hello(0, 2, 1, "127.0.0.1", [port + 1], "accumulate"), 20, [])
        except BaseException as e:  # noqa: BLE001 (read below)
            out[0] = e

    t = threading.Thread(target=node0, daemon=True)
    t.start()
    try:
        rdzv.join("127.0.0.1", port, rdzv._hello(1, 2, 1, None, [20001], "batch"), 20, [])
    except BaseException as e:  # noqa: BLE001
        out[1] = e
    t.join(30)
    assert not t.is_alive()
    coord.close()
    expected = ("was started with --elastic-policy batch, node 0 with --elastic-policy "
                "accumulate")
    assert isinstance(out[0], UsageError) and expected in str(out[0]), out
    assert isinstance(out[1], UsageError) and expected in str(out[1]), out
    assert os.environ.get("TFDP_ELASTIC_POLICY") is None

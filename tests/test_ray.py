"""tfdp under Ray Train, on a real local Ray cluster (loopback, head only, dashboard off).

``ray.train.tensorflow.TensorflowTrainer`` starts the workers and sets TF_CONFIG;
``tfdp.DataParallelStrategy()`` in ``train_loop_per_worker`` (Ray's TF starter, with tfdp in
place of MultiWorkerMirroredStrategy) trains 2 workers x 2 CPU replicas:

1. equal to one device on the same global batches (max |dw| <= 1e-5, the last batch uneven),
   weights bitwise identical on both workers;
2. Ray Data input (``tfdp.ray.distribute`` + ``tfdp.ray.data_config()``) and tfdp's file sharding:
   every example exactly once per epoch across workers and replicas;
3. a worker killed (SIGKILL) at a random step: Ray restarts the group from the backup reported
   by ``tfdp.ray.BackupAndRestore`` and the finished run equals an uninterrupted one bitwise;
   without restarts the run ends within seconds with an error naming the dead worker;
4. elastic (``ScalingConfig(num_workers=(1, 2))``, a node lost): tests/test_ray_elastic.py.

The whole module skips when Ray is not installed (``pip install -e ".[ray]"``; CI installs it).
The cluster is started once for the module and always shut down.
"""

import contextlib
import importlib.util
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.timeout(240)]
HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(
    not HAVE_RAY, reason='Ray is not installed (pip install -e ".[ray]"; CI installs it)')

TOL = 1e-5
WORKERS, REPLICAS = 2, 2          # 2 workers x 2 CPU replicas = 4 replicas in sync
N, BATCH, EPOCHS = 102, 24, 6     # 5 steps an epoch, the last 6 over 4 replicas: 2, 2, 1, 1
N_STEPS = 30


# --- the example, as a user runs it ------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 20
# what an error looks like in any process's output: absl's E/F lines, Python's, Ray's
ERROR_LINE = re.compile(r"(^|\) )[EF]\d{4} |\] [EF]\d{4}| E \d+ \d+\] |Traceback|Error\b|ERROR|"
                        r"Failed")


@needs_ray
@pytest.mark.timeout(400)
def test_the_example_runs_quietly_as_written(run_process):
    """``python examples/ray_train.py``, its own local Ray cluster (before this module's): it
    trains and prints its result in at most 20 lines in all, none of them an error (340 before,
    15 after: TensorFlow's lines in every process, Ray Data's progress bars, a warning a second
    from Ray Train's placement-group cleaner without the State API, a core_worker error). Ray
    binds loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, as in this module's cluster)."""
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", CUDA_VISIBLE_DEVICES="")
    for name in ("TF_CPP_MIN_LOG_LEVEL", "TF_CONFIG", "RAY_ADDRESS", "TFDP_CPU_REPLICAS"):
        env.pop(name, None)                  # a user's shell
    t0 = time.monotonic()
    p = run_process([sys.executable, os.path.join(ROOT, "examples", "ray_train.py")],
                    cwd=str(ROOT), capture_output=True, text=True, timeout=360, env=env,
                    stdin=subprocess.DEVNULL)
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    print(f"examples/ray_train.py: rc {p.returncode}, {len(lines)} lines "
          f"({len(p.stdout.splitlines())} stdout), {time.monotonic() - t0:.0f} s")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    assert "worker 0 of 2: 4 replicas, loss" in p.stdout and "done: last checkpoint" in p.stdout
    errors = [ln for ln in lines if ERROR_LINE.search(ln)]
    assert not errors, "\n".join(errors)
    assert len(lines) <= MAX_LINES, "\n".join(lines)


# --- the cluster ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_cluster(run_process):
    """A local Ray cluster on 127.0.0.1: head only, no dashboard, 6 logical CPUs (4 for the
    workers, the rest for Ray Data tasks), a 256 MB object store. Shut down after the module."""
    if not HAVE_RAY:
        pytest.skip('Ray is not installed (pip install -e ".[ray]"; CI installs it)')
    with pytest.MonkeyPatch.context() as mp:
        # Ray maps 127.0.0.1 to the host's address unless this is off (read when ray is
        # imported): keep every address, Ray's and the TF_CONFIG it writes, on loopback.
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # Ray's default is 2 s
        import ray
        ray.init(num_cpus=6, include_dashboard=False, object_store_memory=256 * 1024 ** 2,
                 _node_ip_address="127.0.0.1", configure_logging=False, log_to_driver=True,
                 runtime_env={"env_vars": {"TF_CPP_MIN_LOG_LEVEL": "2",
                                           "CUDA_VISIBLE_DEVICES": ""}})
        try:
            # The training functions below travel by value (the workers cannot import tests/).
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
            yield ray
        finally:
            ray.shutdown()


def _fit_ray(loop, config, tmp_path, *, max_failures=0, name="run", dataset_config=None,
             datasets=None, num_workers=WORKERS, resources=None):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.tensorflow import TensorflowTrainer
    kwargs = {}
    if datasets is not None:
        kwargs.update(datasets=datasets, dataset_config=dataset_config)
    trainer = TensorflowTrainer(
        loop, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers,
                                     resources_per_worker=resources or {"CPU": REPLICAS}),
        run_config=RunConfig(name=name, storage_path=str(tmp_path / "ray_storage"),
                             failure_config=FailureConfig(max_failures=max_failures),
                             worker_runtime_env={"env_vars": {"TFDP_CPU_REPLICAS": str(REPLICAS)}}),
        **kwargs)
    return trainer.fit()


# --- training code: the workers and the one-device reference -------------------------------------

def _data(n=N):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], "float32")
         + 0.1 * rng.normal(size=(n, 1))).astype("float32")
    return x, y


def _model(seed=1):
    import keras
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="tanh"),
                              keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.02, momentum=0.9), loss="mse")
    return model


def _rank():
    import ray.train
    return ray.train.get_context().get_world_rank()


def _save(out, tag, model):
    np.savez(os.path.join(out, f"{tag}-{_rank()}.npz"), *model.get_weights())


def _load(out, tag, rank):
    with np.load(os.path.join(out, f"{tag}-{rank}.npz")) as f:
        return [f[f"arr_{i}"] for i in range(len(f.files))]


def _note(out, **values):
    with open(os.path.join(out, f"note-{_rank()}.json"), "w") as f:
        json.dump(values, f)


def _read_note(out, rank):
    with open(os.path.join(out, f"note-{rank}.json")) as f:
        return json.load(f)


def _max_dw(a, b):
    return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b))


def _one_device(initial, batches, epochs):
    """Plain Keras on one device from ``initial`` over the list of global batches."""
    model = _model()
    model.set_weights(initial)
    for _ in range(epochs):
        for xb, yb in batches:
            model.train_on_batch(xb, yb)
    return model.get_weights()


# --- 1. Ray's TF starter with tfdp ---------------------------------------------------------------

def _starter_loop(config):
    import tfdp
    strategy = tfdp.DataParallelStrategy()       # Ray set TF_CONFIG: 2 workers
    with strategy.scope():
        model = _model()
    _save(config["out"], "initial", model)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    _save(config["out"], "final", model)
    _note(config["out"], replicas=strategy.num_replicas_in_sync, workers=strategy.num_workers)


@pytest.fixture(scope="module")
def starter_run(ray_cluster, tmp_path_factory):
    """Ray's TF starter with tfdp, uninterrupted: its output directory."""
    out = tmp_path_factory.mktemp("starter")
    result = _fit_ray(_starter_loop, {"out": str(out)}, out, name="starter")
    assert result.error is None
    return out


def test_ray_starter_with_tfdp_equals_one_device(run_process, starter_run):
    out = starter_run
    for rank in range(WORKERS):
        assert _read_note(out, rank) == {"replicas": WORKERS * REPLICAS, "workers": WORKERS}
    w0, w1 = _load(out, "final", 0), _load(out, "final", 1)
    assert all(np.array_equal(a, b) for a, b in zip(w0, w1)), "workers' weights differ"
    x, y = _data()
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, N, BATCH)]
    ref = _one_device(_load(out, "initial", 0), batches, EPOCHS)
    dw = _max_dw(w0, ref)
    print(f"ray starter: 2 workers x 2 replicas vs one device: max |dw| = {dw:.2e} "
          f"({EPOCHS} epochs of {N} examples, global batch {BATCH}); workers bitwise equal")
    assert dw <= TOL
    assert _max_dw(w0, _load(out, "initial", 0)) > 1e-3  # it trained


# --- 2. data: Ray Data shards and tfdp's file sharding -------------------------------------------

DATA_N, DATA_BATCH, DATA_EPOCHS = 203, 16, 2   # last batch 11 over 4 replicas: 3, 3, 3, 2
FILES, FILE_ROWS = 4, 25


def _ids_per_replica(strategy, dist, key):
    """Every replica's example ids, step by step: [[ids of local replica 0, 1], ...]."""
    seen = []
    for batch in dist:
        part = batch[0] if key is None else batch[0][key]
        seen.append([np.asarray(t).ravel().tolist()
                     for t in strategy.experimental_local_results(part)])
    return seen


def _data_loop(config):
    import ray.train
    import tensorflow as tf

    import tfdp
    import tfdp.ray
    strategy = tfdp.DataParallelStrategy()
    out = {"rank": _rank(), "epochs": [], "split": [], "files": []}
    shard = ray.train.get_dataset_shard("train")
    for epoch in range(2):   # tfdp's shuffle: its order depends on (seed, epoch) only
        dist = tfdp.ray.distribute(strategy, shard, feature_columns="id", label_columns="y",
                                   global_batch_size=DATA_BATCH, shuffle_seed=5, epoch=epoch)
        out["epochs"].append(_ids_per_replica(strategy, dist, None))
    split = tfdp.ray.distribute(strategy, ray.train.get_dataset_shard("split"),
                                feature_columns="id", label_columns="y",
                                global_batch_size=DATA_BATCH)
    out["split"] = _ids_per_replica(strategy, split, None)
    spec = {"id": tf.io.FixedLenFeature([], tf.int64)}
    files = tfdp.data.distribute(strategy, config["files"], global_batch_size=DATA_BATCH,
                                 shard="files", parse_fn=lambda r: (tf.io.parse_example(r, spec),))
    out["files"] = _ids_per_replica(strategy, files, "id")
    with strategy.scope():
        model = _model()
    _save(config["out"], "initial", model)
    dist = tfdp.ray.distribute(strategy, shard, feature_columns="x", label_columns="y",
                               global_batch_size=DATA_BATCH)
    model.fit(dist, epochs=DATA_EPOCHS, verbose=0)
    _save(config["out"], "final", model)
    with open(os.path.join(config["out"], f"ids-{_rank()}.json"), "w") as f:
        json.dump(out, f)


def _write_id_files(directory):
    import tensorflow as tf
    paths = []
    for i in range(FILES):
        path = os.path.join(directory, f"part-{i}.tfrecord")
        with tf.io.TFRecordWriter(path) as w:
            for j in range(FILE_ROWS):
                ex = tf.train.Example(features=tf.train.Features(feature={"id": tf.train.Feature(
                    int64_list=tf.train.Int64List(value=[i * FILE_ROWS + j]))}))
                w.write(ex.SerializeToString())
        paths.append(path)
    return paths


def _replica_ids(per_worker, key, epoch=None):
    """{global replica index: ids} over both workers for one pass (steps in lockstep)."""
    ids = {}
    for out in per_worker:
        steps = out[key] if epoch is None else out[key][epoch]
        for step in steps:
            for local, part in enumerate(step):
                ids.setdefault(out["rank"] * REPLICAS + local, []).extend(part)
    return ids


def _step_counts(per_worker, key, epoch=None):
    return [len(out[key] if epoch is None else out[key][epoch]) for out in per_worker]


def test_ray_data_and_file_sharding_see_every_example_once(run_process, ray_cluster, tmp_path):
    import ray.data

    import tfdp.ray
    x, y = _data(DATA_N)
    rows = [{"id": i, "x": x[i], "y": y[i]} for i in range(DATA_N)]
    train = ray.data.from_items(rows, override_num_blocks=7)
    split = ray.data.from_items(rows, override_num_blocks=7)
    # "train" whole on every worker, "split" split by Ray (its default for every dataset)
    config = tfdp.ray.data_config(datasets_to_split=["split"])
    files = _write_id_files(str(tmp_path))
    result = _fit_ray(_data_loop, {"out": str(tmp_path), "files": files}, tmp_path, name="data",
                      datasets={"train": train, "split": split}, dataset_config=config)
    assert result.error is None
    per_worker = []
    for rank in range(WORKERS):
        with open(tmp_path / f"ids-{rank}.json") as f:
            per_worker.append(json.load(f))

    orders = []
    for epoch in range(2):
        assert len(set(_step_counts(per_worker, "epochs", epoch))) == 1
        ids = _replica_ids(per_worker, "epochs", epoch)
        every = sorted(i for part in ids.values() for i in part)
        assert every == list(range(DATA_N)), f"epoch {epoch}: not every example exactly once"
        assert sorted(len(v) for v in ids.values()) == sorted([51, 51, 51, 50])
        orders.append([ids[r] for r in sorted(ids)])
    assert orders[0] != orders[1]   # reshuffled per epoch

    ids = _replica_ids(per_worker, "files")
    assert sorted(i for part in ids.values() for i in part) == list(range(FILES * FILE_ROWS))

    ids = _replica_ids(per_worker, "split")
    seen = [i for part in ids.values() for i in part]
    assert len(seen) == len(set(seen))            # Ray's equal split: never twice ...
    dropped = DATA_N - len(seen)
    print(f"Ray's default split (equal=True) of {DATA_N} rows over {WORKERS} workers dropped "
          f"{dropped} row(s); tfdp.ray.data_config(): 0")

    # fit on the Ray shard = one device on consecutive global batches of 16 (the last 11)
    w0, w1 = _load(tmp_path, "final", 0), _load(tmp_path, "final", 1)
    assert all(np.array_equal(a, b) for a, b in zip(w0, w1)), "workers' weights differ"
    batches = [(x[i:i + DATA_BATCH], y[i:i + DATA_BATCH]) for i in range(0, DATA_N, DATA_BATCH)]
    dw = _max_dw(w0, _one_device(_load(tmp_path, "initial", 0), batches, DATA_EPOCHS))
    print(f"ray data: exactly once (2 epochs, shuffled; files); fit max |dw| = {dw:.2e}")
    assert dw <= TOL


# --- 3. fault tolerance: Ray restarts the group from tfdp's backup -------------------------------

SAVE_FREQ, PACE = 4, 0.25    # a backup every 4 of the 30 steps; a step every 0.25 s at least


def _resume_loop(config):
    """The starter's training (same model, data, batches) with tfdp.ray.BackupAndRestore."""
    import keras

    import tfdp
    import tfdp.ray
    strategy = tfdp.DataParallelStrategy()
    with strategy.scope():
        model = _model()
    backup = tfdp.ray.BackupAndRestore(save_freq=SAVE_FREQ)
    path = os.path.join(config["out"], f"events-{_rank()}.jsonl")

    def event(**kw):
        with open(path, "a") as f:
            f.write(json.dumps(dict(kw, pid=os.getpid(), t=time.time(),
                                    host=os.environ.get("TFDP_TEST_HOST"))) + "\n")

    class Progress(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            event(kind="begin", restored=backup.restored, step=backup.global_step)

        def on_train_batch_end(self, batch, logs=None):
            event(kind="step", step=backup.global_step)
            time.sleep(PACE)   # (paced so that the kill lands inside the run)

    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[backup, Progress()])
    _save(config["out"], "final", model)
    event(kind="end", step=backup.global_step)
    _note(config["out"], reports=backup.reports, restored=backup.restored,
          replicas=strategy.num_replicas_in_sync)


def _events(out, rank):
    path = os.path.join(out, f"events-{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class Killer(threading.Thread):
    """SIGKILLs worker ``rank`` once it reports global step ``step`` (its first process only)."""

    def __init__(self, out, rank, step, before=None):
        super().__init__(daemon=True)
        self.out, self.rank, self.step, self.before = out, rank, step, before
        self.killed_at = self.killed_pid = None
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            events = _events(self.out, self.rank)
            hits = [e for e in events if e["kind"] == "step" and e["step"] >= self.step]
            if hits:
                if self.before is not None:
                    self.before()
                self.killed_pid = hits[0]["pid"]
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.killed_pid, signal.SIGKILL)
                self.killed_at = time.time()
                return
            time.sleep(0.01)


def test_killed_worker_ray_restarts_from_tfdp_backup_bitwise(run_process, starter_run, tmp_path):
    # Ray makes a reported checkpoint its restore point when its controller collects it (every
    # RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 0.5 s here): kill at least 2.5 s after the first backup.
    rank = random.randrange(WORKERS)
    step = random.randrange(SAVE_FREQ + int(2.5 / PACE) + 1, N_STEPS - 3)
    killer = Killer(str(tmp_path), rank, step)
    killer.start()
    try:
        result = _fit_ray(_resume_loop, {"out": str(tmp_path)}, tmp_path, name="fault",
                          max_failures=1)
    finally:
        killer.done.set()
    assert killer.killed_at is not None, "the run ended before the worker could be killed"
    assert result.error is None and result.checkpoint is not None
    assert all(_read_note(tmp_path, k)["restored"] for k in range(WORKERS))
    events = [e for k in range(WORKERS) for e in _events(str(tmp_path), k)]
    resumed = [e for e in events if e["kind"] == "begin" and e["restored"]]
    assert len(resumed) == WORKERS and all(e["pid"] != killer.killed_pid for e in resumed)
    assert 0 < resumed[0]["step"] <= step and resumed[0]["step"] % SAVE_FREQ == 0
    first_step = min(e["t"] for e in events
                     if e["kind"] == "step" and e["t"] > max(r["t"] for r in resumed))
    clean = _load(starter_run, "final", 0)
    for k in range(WORKERS):
        w = _load(tmp_path, "final", k)
        assert all(np.array_equal(a, b) for a, b in zip(clean, w)), \
            f"worker {k} not bitwise equal to the uninterrupted run: max |dw| = " \
            f"{_max_dw(clean, w):.2e}"
    print(f"ray fault: worker {rank} killed (SIGKILL) at global step {step}; Ray restarted the "
          f"group, both resumed at step {resumed[0]['step']} from tfdp's backup; kill -> "
          f"restored {max(e['t'] for e in resumed) - killer.killed_at:.1f} s, -> first step "
          f"{first_step - killer.killed_at:.1f} s; final weights bitwise equal to the "
          "uninterrupted run on both workers")


def test_dead_worker_without_restarts_ends_the_run_promptly_and_named(run_process, ray_cluster,
                                                                      tmp_path):
    from ray.train import TrainingFailedError   # (v2: what trainer.fit raises)
    killer = Killer(str(tmp_path), 1, 3)
    killer.start()
    t0 = time.time()
    try:
        with pytest.raises(TrainingFailedError) as info:
            _fit_ray(_resume_loop, {"out": str(tmp_path)}, tmp_path, name="dead")
    finally:
        killer.done.set()
    ended = time.time()
    assert killer.killed_at is not None
    text = str(info.value)
    print(f"ray dead worker (max_failures=0): run ended {ended - killer.killed_at:.1f} s after "
          f"the kill ({ended - t0:.1f} s in all): {text.splitlines()[0][:200]}")
    assert ended - killer.killed_at < 60
    assert "rank 1" in text.lower() or "world_rank=1" in text.lower() or "rank=1" in text.lower()


# --- without a cluster ---------------------------------------------------------------------------

def test_import_tfdp_ray_imports_neither_ray_nor_tensorflow(run_process):
    code = ("import sys, tfdp, tfdp.ray\n"
            "assert 'ray' not in sys.modules and 'tensorflow' not in sys.modules, "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'tensorflow'))[:5]\n"
            "assert sorted(tfdp.ray.__all__) == "
            "['BackupAndRestore', 'data_config', 'distribute', 'runtime_env']\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_runtime_env_adds_quiet_tensorflow_and_keeps_the_users_choices(monkeypatch):
    import tfdp.ray
    from tfdp.errors import TfdpError
    from tfdp.ray.quiet import HOOK
    monkeypatch.delenv("TF_CPP_MIN_LOG_LEVEL", raising=False)
    assert tfdp.ray.runtime_env() == {"env_vars": {"TF_CPP_MIN_LOG_LEVEL": "2"},
                                      "worker_process_setup_hook": HOOK}
    mine = {"env_vars": {"A": "1", "TF_CPP_MIN_LOG_LEVEL": "0"}, "pip": ["x"]}
    assert tfdp.ray.runtime_env(mine) == {"env_vars": {"A": "1", "TF_CPP_MIN_LOG_LEVEL": "0"},
                                          "pip": ["x"], "worker_process_setup_hook": HOOK}
    assert mine == {"env_vars": {"A": "1", "TF_CPP_MIN_LOG_LEVEL": "0"}, "pip": ["x"]}
    assert tfdp.ray.runtime_env(verbose=True) == {"worker_process_setup_hook": HOOK}
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "1")      # the driver's level goes to the workers
    assert tfdp.ray.runtime_env()["env_vars"] == {"TF_CPP_MIN_LOG_LEVEL": "1"}
    with pytest.raises(TfdpError, match="already has a worker_process_setup_hook.*setup_worker"):
        tfdp.ray.runtime_env({"worker_process_setup_hook": "mine.hook"})
    with pytest.raises(TfdpError, match="Invalid runtime_env.*as a dict"):
        tfdp.ray.runtime_env(["env_vars"])


def test_setup_worker_quiets_tensorflows_python_info_at_the_quiet_level(run_process):
    code = ("import logging, sys, tfdp.ray.quiet as q\n"
            "q.setup_worker()\n"
            "import tensorflow as tf\n"
            "print(logging.getLogger('tensorflow').level)\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0 and r.stdout.strip() == str(logging.WARNING), r.stderr[-2000:]
    assert "absl::InitializeLog" not in r.stderr, r.stderr[-2000:]


def test_without_ray_the_error_says_how_to_install(monkeypatch):
    from tfdp.errors import TfdpError
    from tfdp.ray import _require
    monkeypatch.setitem(sys.modules, "ray.train", None)   # import ray.train -> ImportError
    with pytest.raises(TfdpError, match=r'not installed.*pip install "tfdp\[ray\]"'):
        _require.ray_train()


@needs_ray
def test_outside_a_ray_worker_and_bad_arguments_are_one_clear_error():
    import tensorflow as tf

    import tfdp.ray
    from tfdp.errors import TfdpError
    with pytest.raises(TfdpError, match="inside a Ray Train worker only.*tfdp.callbacks"):
        tfdp.ray.BackupAndRestore(save_freq=5)
    with pytest.raises(TfdpError, match="Invalid shard.*get_dataset_shard"):
        tfdp.ray.distribute(tf.distribute.get_strategy(), [1, 2], feature_columns="x",
                            label_columns="y", global_batch_size=4)
    with pytest.raises(TfdpError, match="datasets_to_split"):
        tfdp.ray.data_config(datasets_to_split="validation")
    config = tfdp.ray.data_config()
    assert config._datasets_to_split == [] and config._user_execution_options.preserve_order

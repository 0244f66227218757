"""Bad input, in one place (issue #6): every case must fail fast with ONE clear message that
names the received value and says how to fix it (tfdp.errors: "What is wrong. Received:
name=value. Valid: ... / how to fix"), never a traceback from deep inside TensorFlow.

Each case lists substrings the message must contain: the received value (``received``) and the
fix (``fix``). In-process wherever possible; the command-line cases run ``python -m tfdp`` (no
TensorFlow is imported before a usage error) and the port-in-use case needs a fresh process.
The security checks (loopback-only launcher, no unpickling of backups) are at the end.
"""

import io
import json
import math
import os
import pickle
import re
import socket
import subprocess
import sys

import numpy as np
import portpicker
import pytest
import tensorflow as tf

import tfdp
import tfdp.data as td
from tfdp.cluster import parse_slurm, parse_tf_config, resolve_cluster
from tfdp.errors import TfdpError, UsageError
from tfdp.launch import launch, make_tf_configs, validate

pytestmark = pytest.mark.timeout(60)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def assert_clear(err, received, fix, *more):
    """``err`` (an exception or a message) follows the template: what. Received: ... fix."""
    msg = str(err)
    assert "Received:" in msg, msg
    assert "Traceback" not in msg and "\n" not in msg, msg
    head, _, tail = msg.partition("Received:")
    assert head.strip(), msg  # says what is wrong first
    for part in (received, *more):
        assert part in msg, f"{part!r} not in {msg!r}"
    assert fix in tail, f"fix {fix!r} not after 'Received:' in {msg!r}"


def case(id_, *values):
    return pytest.param(*values, id=id_)


def case3(id_, arg, received, fix, *more):
    """A case with extra substrings ``more`` the message must also contain."""
    return pytest.param(arg, received, fix, more, id=id_)


# ============================================================ 1. TF_CONFIG and SLURM forms

def tfc(cluster, task=None):
    return json.dumps({"cluster": cluster, "task": task or {"type": "worker", "index": 0}})


W1 = {"worker": ["w:1"]}
CW = {"chief": ["c:1"], "worker": ["w:1"]}

TF_CONFIG_CASES = [
    # (id, TF_CONFIG text, received, fix, other substrings...)
    case3("json-trailing-comma", '{"cluster": {"worker": ["w:1",]}, "task": {}}',
          '["w:1",]', "Example: TF_CONFIG=", "not valid JSON", "line 1 column"),
    case3("json-string-not-object", '"cluster"', "TF_CONFIG='\"cluster\"'", "Example",
          "must be a JSON object"),
    case3("cluster-key-typo",
          json.dumps({"clusters": W1, "task": {"type": "worker", "index": 0}}),
          '"clusters"', 'Add "cluster"', 'no "cluster"', "single worker"),
    case3("cluster-null", json.dumps({"cluster": None, "task": {}}),
          'TF_CONFIG["cluster"]=None', "Example TF_CONFIG", "non-empty object"),
    case3("task-is-list", json.dumps({"cluster": W1, "task": []}),
          'TF_CONFIG["task"]=[]', 'Add "task"'),
    case3("task-type-master", tfc(W1, {"type": "master", "index": 0}),
          "type\"]='master'", "use 'chief'", "Valid: 'worker'"),
    case3("task-type-case", tfc(W1, {"type": "Worker", "index": 0}),
          "='Worker'", "lower case: use 'worker'"),
    case3("cluster-key-master", tfc({"master": ["m:1"], "worker": ["w:1"]}),
          "key='master'", "use 'chief'", "unsupported task type"),
    case3("chief-index-negative", tfc(CW, {"type": "chief", "index": -2}),
          'TF_CONFIG["task"]["index"]=-2', "integer in 0..0", "chief list has 1 entry"),
    case3("worker-index-out-of-range", tfc(CW, {"type": "worker", "index": 1}),
          'TF_CONFIG["task"]["index"]=1', "integer in 0..0", "worker list has 1 entry"),
    case3("chief-with-empty-workers",
          tfc({"chief": ["c:1"], "worker": []}, {"type": "chief", "index": 0}),
          '["worker"]=[]', "Example TF_CONFIG", "non-empty list"),
    case3("chief-is-a-string", tfc({"chief": "c:1", "worker": ["w:1"]}),
          '["chief"]=\'c:1\'', "Example TF_CONFIG", "non-empty list"),
    case3("worker-task-chief-only-cluster", tfc({"chief": ["c:1"]}),
          "type\"]='worker'", 'Add a "worker" list', "missing from", "Valid: 'chief'"),
    case3("address-without-port", tfc({"worker": ["10.0.0.1"]}),
          "='10.0.0.1'", 'Use "host:port"', "has no port"),
    case3("port-out-of-range", tfc({"worker": ["a:99999"]}),
          "='a:99999'", "1..65535", "invalid port"),
    case3("port-not-an-int", tfc({"worker": ["a:22.5"]}),
          "='a:22.5'", "1..65535", "invalid port"),
    case3("duplicate-address-host-case", tfc({"worker": ["Node1:2222", "node1:2222"]}),
          "='node1:2222'", "its own port", "unique", '["worker"][0]'),
]


@pytest.mark.parametrize("text, received, fix, more", TF_CONFIG_CASES)
def test_tf_config(text, received, fix, more):
    with pytest.raises(TfdpError) as e:
        parse_tf_config(text)
    assert_clear(e.value, received, fix, "TF_CONFIG", *more)


def test_tf_config_from_environment_never_falls_back_to_local():
    # A broken TF_CONFIG next to SLURM variables: the TF_CONFIG error, not SLURM or local.
    env = {"TF_CONFIG": "{oops", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    with pytest.raises(TfdpError) as e:
        resolve_cluster(environ=env)
    assert_clear(e.value, "TF_CONFIG='{oops'", "double quotes", "not valid JSON")


SLURM = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "4",
         "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}

SLURM_CASES = [
    # (id, changes to SLURM (None deletes), received, fix)
    case("procid-fraction", {"SLURM_PROCID": "1.5"}, "SLURM_PROCID='1.5'", "integer >= 0"),
    case("procid-blank", {"SLURM_PROCID": " "}, "SLURM_PROCID=' '", "srun"),
    case("procid-equals-ntasks", {"SLURM_PROCID": "4"}, "SLURM_PROCID='4'", "0..3"),
    case("job-ntasks-negative", {"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": "-3"},
         "SLURM_NTASKS='-3'", "integer >= 1"),
    case("ntasks-float", {"SLURM_STEP_NUM_TASKS": "4.0"}, "SLURM_STEP_NUM_TASKS='4.0'",
         "integer >= 1"),
    case("nodelist-letter-range", {"SLURM_STEP_NODELIST": "n[a-b]"}, "'n[a-b]'",
         "node[01-03]"),
    case("nodelist-spaces", {"SLURM_STEP_NODELIST": "n1 n2"}, "'n1 n2'", "node[01-03]"),
    case("nodelist-reversed-brackets", {"SLURM_STEP_NODELIST": "n]1-2["}, "'n]1-2['",
         "node[01-03]"),
    case("tasks-per-node-x0", {"SLURM_STEP_TASKS_PER_NODE": "2(x0)"}, "'2(x0)'", "2(x3),1"),
]


@pytest.mark.parametrize("changes, received, fix", SLURM_CASES)
def test_slurm(changes, received, fix):
    env = {k: v for k, v in {**SLURM, **changes}.items() if v is not None}
    with pytest.raises(TfdpError) as e:
        resolve_cluster(environ=env)  # detected as SLURM (SLURM_JOB_ID), then validated
    assert_clear(e.value, received, fix)
    with pytest.raises(TfdpError):
        parse_slurm(env)


# ============================================================ 2. strategy arguments

STRATEGY_CASES = [
    # (id, kwargs, received, fix, other substrings...)
    case3("all-reduce-bogus", {"all_reduce": "bogus"}, "all_reduce='bogus'",
          "Valid: 'auto', 'fused', 'ring', 'one_device', 'nccl'"),
    case3("all-reduce-none", {"all_reduce": None}, "all_reduce=None", "Valid: 'auto'"),
    case3("bucket-bytes-negative", {"bucket_bytes": -4096}, "bucket_bytes=-4096",
          "non-negative int"),
    case3("bucket-bytes-text", {"bucket_bytes": "4MB"}, "bucket_bytes='4MB'", "non-negative int"),
    case3("bucket-bytes-bool", {"bucket_bytes": True}, "bucket_bytes=True", "non-negative int"),
    case3("compression-int8", {"compression": "int8"}, "compression='int8'",
          "Valid: None, 'none', 'fp16', 'bf16'"),
    case3("compression-number", {"compression": 16}, "compression=16", "'fp16'"),
    case3("devices-mixed-cpu-gpu", {"devices": ["CPU:0", "GPU:0"]},
          "devices=['CPU:0', 'GPU:0']", "Valid: 'CPU:0'", "Device 'GPU:0' does not exist"),
    case3("devices-duplicated-case", {"devices": ["CPU:1", "cpu:1"]},
          "devices=['CPU:1', 'cpu:1']", "List each device once", "listed twice"),
    case3("devices-remote-task", {"devices": ["/job:worker/task:1/device:CPU:0"]},
          "/job:worker/task:1/device:CPU:0", "configure_cpu_replicas", "does not exist"),
    case3("devices-negative-index", {"devices": ["CPU:-1"]}, "'CPU:-1'", "Valid: 'CPU:0'"),
    case3("devices-indices", {"devices": [0, 1]}, "devices=[0, 1]", "strings such as 'GPU:0'",
          "not a device name"),
]


@pytest.mark.parametrize("kwargs, received, fix, more", STRATEGY_CASES)
def test_strategy_arguments(kwargs, received, fix, more):
    with pytest.raises(ValueError) as e:
        tfdp.DataParallelStrategy(**kwargs)
    assert isinstance(e.value, TfdpError)
    assert_clear(e.value, received, fix, *more)


# ============================================================ 3. launcher arguments

LAUNCH_CASES = [
    # (id, (cmd, workers, kwargs), received, fix, other substrings...)
    case3("workers-negative", (["true"], -1, {}), "workers=-1", "integer >= 1"),
    case3("workers-text", (["true"], "2", {}), "workers='2'", "integer >= 1"),
    case3("max-restarts-negative", (["true"], 2, {"max_restarts": -1}), "max_restarts=-1",
          "integer >= 0"),
    case3("timeout-negative", (["true"], 2, {"timeout": -5}), "timeout=-5", "positive number"),
    case3("timeout-nan", (["true"], 2, {"timeout": math.nan}), "timeout=nan", "positive number"),
    case3("command-is-a-string", ("python train.py", 2, {}), "command='python train.py'",
          "shlex.split"),
    case3("command-non-string-arg", ([PY, 5], 2, {}), ", 5]", "Split it into",
          "list of strings"),
    case3("program-missing", (["tfdp-no-such-program"], 2, {}), "'tfdp-no-such-program'",
          "Check the spelling and PATH"),
    case3("script-missing", ([PY, "-u", "/nonexistent/train.py", "--epochs", "3"], 2, {}),
          "script='/nonexistent/train.py'", "Check the path"),
    case3("host-private-ip", (["true"], 2, {"host": "10.0.0.1"}), "host='10.0.0.1'",
          "Use 127.0.0.1", "Only loopback"),
    case3("host-any-ipv6", (["true"], 2, {"host": "::"}), "host='::'", "Use 127.0.0.1"),
    case3("host-name", (["true"], 2, {"host": "example.com"}), "host='example.com'",
          "unauthenticated"),
]


@pytest.mark.parametrize("args, received, fix, more", LAUNCH_CASES)
def test_launch_arguments(args, received, fix, more):
    cmd, workers, kwargs = args
    with pytest.raises(UsageError) as e:
        validate(cmd, workers, **kwargs)
    assert_clear(e.value, received, fix, *more)
    with pytest.raises(UsageError):  # launch() checks the same before starting anything
        launch(cmd, workers, **kwargs)


def test_python_script_check_leaves_other_commands_alone(run_process, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    for cmd in ([PY, str(script)], [PY, "-c", "print(1)"], [PY, "-m", "tfdp"], [PY, "-"],
                [PY, "-W", "ignore", str(script)], [PY, "-uc", "pass"], ["true", "missing.py"]):
        validate(cmd, 2)


@pytest.mark.timeout(150)  # importing TensorFlow in a fresh process: ~6 s, more on a busy host
def test_port_in_use_names_the_port_and_the_fix(run_process):
    """This worker's TF_CONFIG port is held (a socket on 127.0.0.1, like a leftover worker):
    the strategy must say so before TensorFlow's gRPC server fails obscurely."""
    port, other = portpicker.pick_unused_port(), portpicker.pick_unused_port()
    config = tfc({"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{other}"]})
    env = dict(os.environ, TF_CONFIG=config, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("TFDP_CPU_REPLICAS", None)
    code = ("import tfdp\ntry:\n    tfdp.DataParallelStrategy()\nexcept ValueError as e:\n"
            "    print('ERR', e)\n")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", port))
        held.listen(1)
        r = subprocess.run([PY, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    line = next((l for l in r.stdout.splitlines() if l.startswith("ERR ")), None)
    assert line, r.stdout + r.stderr[-3000:]
    assert_clear(line, f"port={port}", "choose another port", f"Port {port}", "already in use")


@pytest.mark.parametrize("host", ["", "127.0.0.1"], ids=["every-interface", "loopback"])
def test_port_in_use_check_in_process(host):
    """The check the worker runs (tfdp.cluster.check_port_free), on the interface TF's server
    binds ("") and on loopback, against a port the test holds on 127.0.0.1."""
    from tfdp.cluster import check_port_free
    port = portpicker.pick_unused_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", port))
        held.listen(1)
        with pytest.raises(TfdpError) as e:
            check_port_free(host, port)
    assert_clear(e.value, f"host={host!r}, port={port}", f"grep :{port}", "already in use")


# ============================================================ 4. dataset / batch mismatches

def ctx(workers, rank, replicas):
    return tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=rank,
                                      num_replicas_in_sync=replicas)


@pytest.fixture(scope="module")
def three_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("files")
    paths = []
    for i in range(3):
        p = d / f"part-{i}.tfrecord"
        p.write_bytes(b"not empty")  # sharding is checked before anything is read
        paths.append(str(p))
    return paths


DS = tf.data.Dataset.range(16)
FILES = object()  # stands for the three_files fixture in a case


def wd(source=DS, context=(1, 0, 2), **kwargs):
    """A case's call: ``tfdp.data.worker_dataset(source, InputContext(*context), **kwargs)``."""
    return lambda files: td.worker_dataset(files if source is FILES else source, ctx(*context),
                                           **kwargs)


DATA_CASES = [
    # (id, call(files), received, fix, other substrings...)
    case3("global-batch-not-divisible", lambda f: td.per_replica_batch_size(10, ctx(1, 0, 4)),
          "global_batch_size=10 with num_replicas_in_sync=4", "multiple of 4", "3,3,2,2"),
    case3("global-batch-below-replicas", wd(context=(2, 0, 4), global_batch_size=2),
          "global_batch_size=2 with num_replicas_in_sync=4", "at least 4"),
    case3("global-batch-float", wd(global_batch_size=8.0),
          "global_batch_size=8.0", "positive int"),
    case3("fewer-files-than-workers",
          wd(FILES, context=(4, 0, 4), global_batch_size=8, shard="files"),
          "3 file(s) for num_workers=4", 'Use shard="data"', "at least 4 files"),
    case3("shuffle-seed-text", wd(global_batch_size=8, shuffle_seed="7"),
          "shuffle_seed='7'", "Pass an int in [0, 2**63)"),
    case3("shuffle-seed-negative", lambda f: td.shuffle(DS, -1),
          "shuffle_seed=-1", "same on every worker"),
    case3("epoch-text", wd(global_batch_size=8, epoch="0"), "epoch='0'", "int >= 0"),
    case3("epoch-float", lambda f: td.shuffle(DS, 1, epoch=1.0),
          "epoch=1.0", "the first epoch is 0"),
    case3("start-step-negative", wd(global_batch_size=8, start_step=-1),
          "start_step=-1", "int >= 0"),
    case3("shuffle-buffer-zero", wd(global_batch_size=8, shuffle_seed=1, shuffle_buffer=0),
          "shuffle_buffer=0", "positive int"),
    case3("drop-remainder-text", wd(global_batch_size=8, drop_remainder="yes"),
          "drop_remainder='yes'", "True or False"),
    case3("prefetch-negative", wd(global_batch_size=8, prefetch=-5),
          "prefetch=-5", "AUTOTUNE"),
    case3("reader-not-callable",
          wd(FILES, context=(1, 0, 1), global_batch_size=4, reader="TFRecordDataset"),
          "reader='TFRecordDataset'", "path -> tf.data.Dataset"),
    case3("source-is-a-glob", wd("data/*.tfrecord", global_batch_size=4),
          "source='data/*.tfrecord'", "tf.io.gfile.glob"),
    case3("unknown-keyword",
          lambda f: td.distribute(tfdp.DataParallelStrategy(["CPU:0"]), DS, global_batch=8),
          "global_batch=8", "Valid: 'global_batch_size'"),
    case3("input-context-numbers", wd(context=(2, 2, 4), global_batch_size=8),
          "input_pipeline_id=2", "0 <= input_pipeline_id < num_input_pipelines"),
]


@pytest.mark.parametrize("call, received, fix, more", DATA_CASES)
def test_data(three_files, call, received, fix, more):
    with pytest.raises(TfdpError) as e:
        call(three_files)
    assert_clear(e.value, received, fix, *more)


# ============================================================ 5. BackupAndRestore

def small_model(units=4, seed=0):
    import keras
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units), keras.layers.Dense(1)])
    m.compile(keras.optimizers.SGD(0.1), "mse")
    return m


XY = (np.arange(48, dtype="float32").reshape(16, 3) / 48, np.ones((16, 1), "float32"))


def fit(model, callback, epochs=1):
    return model.fit(*XY, batch_size=8, epochs=epochs, verbose=0, callbacks=[callback])


def snapshot(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


@pytest.fixture
def saved(tmp_path):
    """A finished backup of ``small_model(4)`` (kept: delete_checkpoint=False)."""
    from tfdp.callbacks import BackupAndRestore
    d = tmp_path / "backup"
    fit(small_model(4), BackupAndRestore(str(d), delete_checkpoint=False))
    assert sorted(os.listdir(d))[0] == "backup.json"
    return d


@pytest.mark.parametrize("save_freq", [-1, 1.5, "batch", "Epoch", None, True])
def test_backup_save_freq(tmp_path, save_freq):
    from tfdp.callbacks import BackupAndRestore
    with pytest.raises(TfdpError) as e:
        BackupAndRestore(str(tmp_path / "b"), save_freq=save_freq)
    assert_clear(e.value, f"save_freq={save_freq!r}", 'Pass "epoch" or a positive int')


@pytest.mark.parametrize("backup_dir", [None, 5, ""])
def test_backup_dir_type(backup_dir):
    from tfdp.callbacks import BackupAndRestore
    with pytest.raises(TfdpError) as e:
        BackupAndRestore(backup_dir)
    assert_clear(e.value, f"backup_dir={backup_dir!r}", "Pass a directory path")


@pytest.mark.parametrize("under", [False, True], ids=["is-a-file", "under-a-file"])
def test_backup_dir_that_is_a_file_fails_at_construction(tmp_path, under):
    from tfdp.callbacks import BackupAndRestore
    f = tmp_path / "weights.h5"
    f.write_bytes(b"precious")
    path = str(f / "backup") if under else str(f)
    with pytest.raises(TfdpError) as e:
        BackupAndRestore(path)
    assert_clear(e.value, f"backup_dir={path!r}", "Pass the path of a directory",
                 "not a directory")
    assert f.read_bytes() == b"precious"


def test_backup_dir_replaced_by_a_file_later(tmp_path):
    from tfdp.callbacks import BackupAndRestore
    path = tmp_path / "b"
    callback = BackupAndRestore(str(path))
    path.write_bytes(b"precious")
    with pytest.raises(TfdpError) as e:
        fit(small_model(), callback)
    assert_clear(e.value, f"backup_dir={str(path)!r}", "Pass the path of a directory")
    assert path.read_bytes() == b"precious"


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0,
                    reason="root can read any directory")
def test_backup_dir_unreadable_chmod_000(tmp_path):
    from tfdp.callbacks import BackupAndRestore
    d = tmp_path / "locked"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    d.chmod(0)
    try:
        with pytest.raises(TfdpError) as e:
            fit(small_model(), BackupAndRestore(str(d)))
    finally:
        d.chmod(0o700)
    assert_clear(e.value, f"backup_dir={str(d)!r}", "chmod u+rwx", "cannot be read")
    assert snapshot(d) == {"notes.txt": b"mine"}


def test_backup_dir_unreadable_simulated(tmp_path, monkeypatch):
    """As chmod 000 for a non-root user (this test also runs as root): every stat of a path
    inside the directory and every listing of it fails with EACCES."""
    import errno
    from tfdp.callbacks import BackupAndRestore
    d = tmp_path / "locked"
    d.mkdir()
    inside = str(d) + os.sep
    real_stat, real_listdir = os.stat, os.listdir

    def denied(path):
        return PermissionError(errno.EACCES, "Permission denied", str(path))

    def stat(path, *a, **k):
        if os.fspath(path).startswith(inside):
            raise denied(path)
        return real_stat(path, *a, **k)

    def listdir(path="."):
        if os.fspath(path).rstrip(os.sep) == str(d):
            raise denied(path)
        return real_listdir(path)

    callback = BackupAndRestore(str(d))
    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "listdir", listdir)
    with pytest.raises(TfdpError) as e:
        callback.initial_epoch
    monkeypatch.undo()
    assert_clear(e.value, f"backup_dir={str(d)!r}", "chmod u+rwx", "PermissionError")


def test_backup_dir_unwritable_simulated(tmp_path, monkeypatch):
    """A directory this user may read but not write (chmod 500, a read-only mount)."""
    import errno
    import tempfile
    from tfdp.callbacks import BackupAndRestore
    d = tmp_path / "readonly"
    d.mkdir()

    def mkstemp(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied", str(d))

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    with pytest.raises(TfdpError) as e:
        fit(small_model(), BackupAndRestore(str(d)))
    monkeypatch.undo()
    assert_clear(e.value, f"backup_dir={str(d)!r}", "writable by this user",
                 "Cannot write the backup")
    assert os.listdir(d) == []


def test_backup_dir_foreign_files_are_refused_and_kept(tmp_path):
    from tfdp.callbacks import BackupAndRestore
    d = tmp_path / "results"
    d.mkdir()
    (d / "notes.txt").write_text("experiment log")
    (d / "model.keras").write_bytes(b"\x00weights")
    before = snapshot(d)
    with pytest.raises(TfdpError) as e:
        fit(small_model(), BackupAndRestore(str(d)))
    assert_clear(e.value, f"backup_dir={str(d)!r}", "Pass an empty or new directory",
                 "not a tfdp backup", "notes.txt")
    assert snapshot(d) == before  # nothing written, nothing deleted


def test_backup_of_another_model_is_refused_and_kept(saved):
    from tfdp.callbacks import BackupAndRestore
    before = snapshot(saved)
    other = small_model(8)  # same layers and variable count, other shapes
    with pytest.raises(TfdpError) as e:
        fit(other, BackupAndRestore(str(saved)))  # delete_checkpoint=True must not delete it
    assert_clear(e.value, "fingerprint", "or a new directory", str(saved),
                 "belongs to another model")
    assert snapshot(saved) == before


def test_sidecar_cannot_point_outside_the_directory(saved):
    from tfdp.callbacks import BackupAndRestore
    meta = json.loads((saved / "backup.json").read_text())
    meta["state"] = "../../etc/passwd"
    (saved / "backup.json").write_text(json.dumps(meta))
    callback = BackupAndRestore(str(saved))
    callback.set_model(small_model(4))
    with pytest.raises(TfdpError) as e:
        callback.restore()
    assert_clear(e.value, "../../etc/passwd", "Restore the directory from a copy",
                 "not a valid tfdp backup")


class _Payload:
    """Pickles to a call that creates ``marker``: proof that unpickling ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("form", ["object-array-in-npz", "raw-pickle"])
def test_pickled_object_in_backup_is_refused(saved, tmp_path, form):
    from tfdp.callbacks import BackupAndRestore
    marker = tmp_path / "code-ran"
    meta = json.loads((saved / "backup.json").read_text())
    state = saved / meta["state"]
    if form == "raw-pickle":
        state.write_bytes(pickle.dumps(_Payload(str(marker))))
    else:
        with np.load(state) as f:
            arrays = {k: f[k] for k in f.files}
        arrays["v00000"] = np.array([_Payload(str(marker))], dtype=object)
        with open(state, "wb") as f:
            np.savez(f, **arrays)
    model = small_model(4, seed=3)
    weights = [w.copy() for w in model.get_weights()]
    callback = BackupAndRestore(str(saved))
    callback.set_model(model)
    with pytest.raises(TfdpError) as e:
        callback.restore()
    assert_clear(e.value, str(state), "restore the directory from a trusted copy",
                 "pickled Python objects", "allow_pickle=False")
    assert "unsafely" not in str(e.value)  # numpy's hint to load it anyway is not passed on
    assert not marker.exists()
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights))


# ============================================================ 6. command line

CLI_CASES = [
    # (id, argv after "python -m tfdp", received, fix)
    case("train-config-missing", ["train", "/nonexistent/run.toml"], "'/nonexistent/run.toml'",
         "configs/quickstart.toml"),
    case("train-set-without-equals", ["train", "configs/quickstart.toml", "--set", "epochs"],
         "'epochs'", "--set SECTION.KEY=VALUE"),
    case("train-set-bad-value", ["train", "configs/quickstart.toml", "--set",
                                 "train.epochs=-1"], "train.epochs=-1", "integer >= 1"),
    case("train-unknown-option", ["train", "configs/quickstart.toml", "--epochs", "3"],
         "--epochs", "tfdp train --help"),
    case("launch-workers-zero", ["launch", "--workers", "0", "--", "true"], "--workers=0",
         "integer >= 1"),
    case("launch-max-restarts-negative", ["launch", "--workers", "2", "--max-restarts", "-3",
                                          "true"], "--max-restarts=-3", "integer >= 0"),
    case("launch-timeout-negative", ["launch", "--workers", "2", "--timeout", "-1", "true"],
         "--timeout=-1.0", "positive number"),
    case("launch-no-command", ["launch", "--workers", "2"], "command=[]",
         "tfdp launch --workers 2 --"),
    case("launch-script-missing", ["launch", "--workers", "2", "--", PY, "no_such_train.py"],
         "script='no_such_train.py'", "Check the path"),
    case("launch-non-loopback-host", ["launch", "--workers", "2", "--host", "192.168.1.10",
                                      "true"], "--host='192.168.1.10'", "Use 127.0.0.1"),
    case("launch-torchrun-flag", ["launch", "--nproc", "2", "true"], "--nproc",
         "takes --workers N"),
    case("bench-unknown-algorithm", ["bench", "allreduce", "--algorithms", "bogus"],
         "--algorithms bogus", "Valid: fused"),
    case("bench-negative-bucket-bytes", ["bench", "allreduce", "--bucket-bytes", "-5"],
         "'-5'", "K/M/G suffix"),
    case("bench-steps-zero", ["bench", "fit", "--steps", "0"], "--steps 0", "integer >= 1"),
    case("bench-unknown-command", ["bench", "allreduse"], "'allreduse'", "Valid: allreduce"),
]


def _check_usage_error(argv, received, fix, returncode, stdout, stderr):
    assert returncode == 2, (returncode, stdout, stderr)
    assert "Traceback" not in stderr, stderr
    assert stdout == "", stdout  # no worker was started, nothing ran
    last = [l for l in stderr.splitlines() if l.strip()][-1]
    assert last.startswith(f"tfdp {argv[0]}: error: "), stderr
    msg = last.split(": error: ", 1)[1]
    assert msg[:1].isupper(), msg
    assert received in msg and fix in msg, msg


@pytest.mark.parametrize("argv, received, fix", CLI_CASES)
def test_cli_usage_error(tfdp_cli, argv, received, fix):
    """In this process (``tfdp.cli.main``): the core tier's guard also fails it if a process
    (a worker) is started."""
    _check_usage_error(argv, received, fix, *tfdp_cli(argv))


@pytest.mark.parametrize("argv, received, fix", [CLI_CASES[0], CLI_CASES[4]])
def test_cli_usage_error_through_python_m_tfdp(run_process, argv, received, fix):
    """The same, as a user sees it: ``python -m tfdp ...`` in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "TFDP_CPU_REPLICAS")}
    r = subprocess.run([PY, "-m", "tfdp", *argv], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    _check_usage_error(argv, received, fix, r.returncode, r.stdout, r.stderr)


# ============================================================ security

def _is_loopback(host):
    import ipaddress
    return host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_launcher_tf_configs_are_loopback_and_valid(host):
    configs = make_tf_configs(3, host=host)
    for i, config in enumerate(configs):
        info = parse_tf_config(json.dumps(config))  # tfdp's own validation accepts them
        assert info.rank == i and len(set(info.workers)) == 3
        for address in info.workers:
            assert _is_loopback(address.rpartition(":")[0]), address


def test_launched_workers_get_loopback_tf_config(run_process):
    out, err = io.StringIO(), io.StringIO()
    code = launch([PY, "-c", "import os; print(os.environ['TF_CONFIG'])"], 2,
                  env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
                  stdout=out, stderr=err, timeout=30)
    assert code == 0, err.getvalue()
    lines = [l.split("] ", 1)[1] for l in out.getvalue().splitlines()]
    assert len(lines) == 2
    for line in lines:
        for address in json.loads(line)["cluster"]["worker"]:
            assert address.startswith("127.0.0.1:"), address


def test_no_unsafe_deserialization_in_the_library():
    """Nothing is unpickled from the network or from files: no pickle-family modules, no
    np.load with pickles, no Keras unsafe loading."""
    forbidden = re.compile(r"^\s*(import|from)\s+(pickle|cPickle|dill|cloudpickle|shelve|marshal"
                           r"|joblib)\b|allow_pickle\s*=\s*True|safe_mode\s*=\s*False"
                           r"|yaml\.load\(|yaml\.unsafe_load", re.M)
    offenders = []
    for base, _, names in os.walk(os.path.join(ROOT, "tfdp")):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                text = open(path, encoding="utf-8").read()
                offenders += [f"{path}: {m.group(0).strip()}" for m in forbidden.finditer(text)]
                for call in re.finditer(r"np\.load\(([^)]*)\)", text):
                    if "allow_pickle=False" not in call.group(1):
                        offenders.append(f"{path}: {call.group(0)}")
    assert not offenders, offenders


def test_readme_warns_that_the_grpc_server_is_unauthenticated():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text[text.index("**Security:**"):][:600]
    assert "gRPC" in section and "unauthenticated" in section, section
    assert "loopback" in section and "firewall" in section, section


# --- models that differ across workers ---------------------------------------------------------

MISMATCH_SCRIPT = """
import os, time
import tfdp
strategy = tfdp.DataParallelStrategy()
import keras
rank = strategy.cluster.rank
kind = os.environ["KIND"]
t0 = time.monotonic()
try:
    with strategy.scope():
        if kind == "shape":      # worker 1 builds a wider layer
            layers = [keras.layers.Dense(4 + rank), keras.layers.Dense(1)]
        else:                    # worker 1 has one layer more
            layers = [keras.layers.Dense(4), keras.layers.Dense(1)] + [keras.layers.Dense(1)] * rank
        model = keras.Sequential([keras.Input((8,))] + layers)
        model.compile("sgd", "mse")
except tfdp.errors.TfdpError as e:
    print("MISMATCH", round(time.monotonic() - t0, 1), str(e), flush=True)
    raise SystemExit(3)
print("NO ERROR", flush=True)
"""


@pytest.mark.parametrize("kind, expected", [
    ("shape", r"variable 'kernel' has shape \[8,\d\] here but \[8,\d\] on another worker"),
    ("extra-layer", r"met a variable of another dtype on another worker"),
])
def test_models_that_differ_across_workers_are_a_clear_error(worker_job, kind, expected):
    from tfdp.testing import run_workers
    with pytest.raises(AssertionError) as failed:
        run_workers(MISMATCH_SCRIPT, workers=2, cpu_replicas=None, timeout=90,
                    env={"KIND": kind})
    text = str(failed.value)
    lines = [ln for ln in text.splitlines() if "MISMATCH" in ln]
    assert lines, text[-3000:]
    line = lines[0]
    assert re.search(expected, line), line
    assert "The model differs between workers" in line
    assert "Received:" in line and "Fix: build the same model" in line
    seconds = float(line.split("MISMATCH", 1)[1].split()[0])
    assert seconds < 30, line  # an error within seconds, not a hang
    assert "NO ERROR" not in text

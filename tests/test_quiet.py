"""A user's own script stays as quiet as plain Keras (issue 23, point 6).

TensorFlow logs "Memory patch applied: M_TRIM_THRESHOLD=128 kb was set" (a C++ INFO line,
generator_dataset_op.cc) once per process, the first time a generator dataset's iterator is
made. Plain Keras on numpy arrays or a ``tf.data.Dataset`` never makes one; a distributed
iterator does (one per replica device, inside TF's MultiDeviceIterator), so under tfdp, as under
MirroredStrategy, a plain script printed it. tfdp makes its first such iterator with that one
line filtered out of stderr (:func:`tfdp.logs.dropping_cpp_lines`); every other line written
meanwhile is passed on, and a user who set ``TF_CPP_MIN_LOG_LEVEL`` gets what they asked for.
"""

import os
import subprocess
import sys
import textwrap

import pytest

from tfdp import logs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTICE = ("I0000 00:00:1796182486.772362    8443 generator_dataset_op.cc:213] Memory patch "
          "applied: M_TRIM_THRESHOLD=128 kb was set.\n")


def test_only_the_notice_is_dropped_and_everything_else_passes(capfd, monkeypatch):
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    with logs.dropping_generator_notice():
        os.write(2, b"before\n")
        os.write(2, NOTICE.encode())
        sys.stderr.write("python's own stderr\n")
        os.write(2, b"W0000 generator_dataset_op.cc:113] another line of that file\n")
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "Memory patch applied" not in err
    fd_lines = [ln for ln in err.splitlines() if ln != "python's own stderr"]
    assert fd_lines == ["before", "W0000 generator_dataset_op.cc:113] another line of that file",
                        "after"], err
    assert "python's own stderr" in err.splitlines(), err   # (pytest captures sys.stderr apart)


def test_nothing_is_dropped_when_the_user_chose_a_log_level(capfd, monkeypatch):
    monkeypatch.setenv(logs.LEVEL_ENV, "0")
    with logs.dropping_generator_notice():
        os.write(2, NOTICE.encode())
    assert "Memory patch applied" in capfd.readouterr().err


def test_stderr_is_restored_when_the_block_raises(capfd, monkeypatch):
    monkeypatch.delenv(logs.LEVEL_ENV, raising=False)
    with pytest.raises(RuntimeError):
        with logs.dropping_generator_notice():
            os.write(2, b"kept\n")
            raise RuntimeError("boom")
    os.write(2, b"after\n")
    assert capfd.readouterr().err.splitlines() == ["kept", "after"]


SCRIPT = """
import numpy as np, keras, tfdp
strategy = tfdp.DataParallelStrategy()
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
model.fit(np.ones((16, 4)), np.ones((16, 1)), batch_size=4, epochs=2, verbose=0)
model.evaluate(np.ones((8, 4)), np.ones((8, 1)), batch_size=4, verbose=0)
print("DONE")
"""


@pytest.mark.timeout(180)
def test_a_user_script_prints_no_generator_dataset_lines(run_process):
    env = dict(os.environ, TFDP_CPU_REPLICAS="2", CUDA_VISIBLE_DEVICES="")
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)   # TF's default, as in a user's shell
    env.pop("TF_CONFIG", None)
    p = run_process([sys.executable, "-c", textwrap.dedent(SCRIPT)], cwd=ROOT,
                    capture_output=True, text=True, timeout=150, env=env,
                    stdin=subprocess.DEVNULL)
    assert p.returncode == 0 and "DONE" in p.stdout, p.stdout[-2000:] + p.stderr[-3000:]
    assert "Memory patch applied" not in p.stderr, p.stderr[-3000:]
    assert "GeneratorDatasetOp::Dataset will not be optimized" not in p.stderr, p.stderr[-3000:]
    assert "tfdp: DataParallelStrategy: 2 replicas" in p.stderr, p.stderr[-3000:]


IMPORT_LATER = """
import sys, tfdp.logs
assert tfdp.logs.filter_tensorflow_import() and "tensorflow" not in sys.modules
import tensorflow as tf                       # someone else's import (Ray's, a user's)
assert tf.__spec__.loader.get_resource_reader  # the real loader's methods are still there
print(int(tf.constant(2) + 1), [f for f in sys.meta_path if "Filtered" in type(f).__name__])
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("level", ["2", "0"])
def test_a_later_import_of_tensorflow_is_filtered_by_the_level(run_process, level):
    """``filter_tensorflow_import`` (what tfdp.ray sets up in every Ray process): TensorFlow's
    load-time lines are gone from the import that comes later, at level 2; at level 0 they stay
    (the user's choice), and the finder leaves sys.meta_path after the import either way."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL=level, CUDA_VISIBLE_DEVICES="")
    p = run_process([sys.executable, "-c", textwrap.dedent(IMPORT_LATER)], cwd=ROOT,
                    capture_output=True, text=True, timeout=150, env=env,
                    stdin=subprocess.DEVNULL)
    assert p.returncode == 0 and p.stdout.strip() == "3 []", p.stdout + p.stderr[-3000:]
    shown = "All log messages before absl::InitializeLog()" in p.stderr
    assert shown == (level == "0"), p.stderr[-3000:]

"""Bad input raises ValueError naming the received value and the valid choices / fix."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

import tfdp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("kwargs,needles", [
    ({"all_reduce": "rnig"}, ["all_reduce='rnig'", "'auto'", "'ring'", "'nccl'"]),
    ({"all_reduce": 3}, ["all_reduce=3", "'fused'"]),
    ({"compression": "int8"}, ["compression='int8'", "'fp16'", "'bf16'"]),
    ({"bucket_bytes": -1}, ["bucket_bytes=-1", "non-negative"]),
    ({"bucket_bytes": 1.5}, ["bucket_bytes=1.5"]),
    ({"all_reduce": "nccl"}, ["all_reduce='nccl'", "not every device is a GPU", "'auto'"]),
    ({"devices": ["GPU:0"]}, ["'GPU:0'", "does not exist", "'CPU:0'"]),
    ({"devices": ["CPU:9"]}, ["'CPU:9'", "does not exist", "TFDP_CPU_REPLICAS"]),
    ({"devices": ["CPU:0", "/cpu:0"]}, ["listed twice"]),
    ({"devices": []}, ["devices=[]", "at least one device"]),
    ({"devices": "CPU:0"}, ["devices='CPU:0'", "list of device names"]),
    ({"devices": ["nonsense!"]}, ["'nonsense!'", "does not exist"]),
    ({"cluster_resolver": "localhost:1234"}, ["cluster_resolver='localhost:1234'",
                                              "ClusterResolver"]),
])
def test_strategy_bad_arguments(kwargs, needles):
    with pytest.raises(ValueError) as e:
        tfdp.DataParallelStrategy(**kwargs)
    msg = str(e.value)
    assert "Received:" in msg
    for n in needles:
        assert n in msg, msg


@pytest.mark.parametrize("n", [0, -2, 1.5, "4", True])
def test_configure_cpu_replicas_bad_count(n):
    with pytest.raises(ValueError, match="positive int") as e:
        tfdp.configure_cpu_replicas(n)
    assert f"n={n!r}" in str(e.value)


def test_configure_cpu_replicas_same_count_is_noop(cpu_devices):
    assert len(tfdp.configure_cpu_replicas(4)) == len(cpu_devices) == 4


def _run(code, env_extra=None, timeout=120):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
    env.pop("TFDP_CPU_REPLICAS", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def test_configure_cpu_replicas_too_late_says_so(run_process):
    r = _run("""
        import tensorflow as tf, tfdp
        tf.constant(1.0) + 1  # starts the runtime with one CPU device
        try:
            tfdp.configure_cpu_replicas(3)
        except ValueError as e:
            print("ERR", e)
    """)
    assert "ERR configure_cpu_replicas(3) came too late" in r.stdout, r.stdout + r.stderr
    assert "before any TensorFlow op" in r.stdout


def test_env_var_gives_replicas_to_unchanged_script(run_process):
    r = _run("""
        import tfdp
        s = tfdp.DataParallelStrategy()
        print("REPLICAS", s.num_replicas_in_sync, s.all_reduce)
    """, {"TFDP_CPU_REPLICAS": "3"})
    assert "REPLICAS 3 fused" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("tf_first", [False, True])
def test_bad_env_var_is_one_line_and_exit_2_at_import(run_process, tf_first):
    """A user's script with TFDP_CPU_REPLICAS=four: one line, exit 2, at ``import tfdp`` (before
    TensorFlow loads when tfdp comes first), no traceback."""
    r = _run("""
        import sys
        %s
        import tfdp
        print("AFTER IMPORT", "tensorflow" in sys.modules)
        tfdp.DataParallelStrategy()
    """ % ("import tensorflow" if tf_first else ""), {"TFDP_CPU_REPLICAS": "four"})
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "AFTER IMPORT" not in r.stdout and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    if tf_first:   # TensorFlow's own load-time lines come first
        lines = lines[-1:]
    assert lines == ["tfdp: error: Invalid TFDP_CPU_REPLICAS. Received: TFDP_CPU_REPLICAS='four'."
                     " Set it to a positive integer, e.g. TFDP_CPU_REPLICAS=4, or unset it."], lines


def test_bad_env_var_does_not_stop_the_launcher_that_replaces_it(run_process):
    """``tfdp launch --cpu-replicas 2`` sets the workers' value: a bad one in the launcher's own
    environment is not its error (it never imports TensorFlow)."""
    r = subprocess.run([sys.executable, "-m", "tfdp", "launch", "--workers", "1", "--output",
                        "all", "--cpu-replicas", "2", "--", sys.executable, "-c",
                        "import os, tfdp; print('WORKER', os.environ['TFDP_CPU_REPLICAS'])"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT,
                       env=dict(os.environ, TFDP_CPU_REPLICAS="four"))
    assert r.returncode == 0 and "WORKER 2" in r.stdout, (r.stdout, r.stderr)


def test_default_devices_without_configuration_is_cpu0(run_process):
    r = _run("""
        import tfdp
        s = tfdp.DataParallelStrategy()
        print("REPLICAS", s.num_replicas_in_sync, s.extended.worker_devices)
    """)
    assert "REPLICAS 1" in r.stdout and "CPU:0" in r.stdout, r.stdout + r.stderr


BAD_TF_CONFIGS = [
    ('{"task": {"type": "worker", "index": 0}}', "cluster"),
    ('{"cluster": {"worker": ["127.0.0.1:5"]}, "task": {"type": "worker", "index": 3}}', "index"),
    ("{not json", "TF_CONFIG"),
]


@pytest.fixture(scope="module")
def bad_tf_config_outputs(run_process):
    """One process for every case of BAD_TF_CONFIGS (each a strategy constructed under its
    TF_CONFIG, in turn): {case index: what the case printed}."""
    r = _run("""
        import json, os, tfdp
        for i, tf_config in enumerate(json.loads(os.environ["BAD_TF_CONFIGS"])):
            os.environ["TF_CONFIG"] = tf_config
            try:
                tfdp.DataParallelStrategy()
                print(f"CASE {i}", json.dumps("no error"), flush=True)
            except ValueError as e:
                print(f"CASE {i}", json.dumps(f"ERR {e}"), flush=True)
    """, {"BAD_TF_CONFIGS": json.dumps([c for c, _ in BAD_TF_CONFIGS])})
    outputs = {}
    for line in r.stdout.splitlines():
        if line.startswith("CASE "):
            i, text = line[5:].split(" ", 1)
            outputs[int(i)] = json.loads(text)
    return outputs, r.stdout + r.stderr


@pytest.mark.parametrize("case", range(len(BAD_TF_CONFIGS)),
                         ids=[f"{c}-{n}" for c, n in BAD_TF_CONFIGS])
def test_bad_tf_config_is_a_clear_error_not_single_worker(bad_tf_config_outputs, case):
    _, needle = BAD_TF_CONFIGS[case]
    outputs, everything = bad_tf_config_outputs
    out = outputs.get(case, "")
    assert "ERR" in out and needle in out and "Received" in out, everything


def test_cli_help_and_unknown_command(tfdp_cli):
    """In this process (``tfdp.cli.main``); tests/test_bad_input.py runs usage errors through
    ``python -m tfdp`` too."""
    returncode, stdout, _ = tfdp_cli(["--help"])
    assert returncode == 0 and "launch" in stdout
    returncode, _, stderr = tfdp_cli(["trian"])
    assert returncode == 2 and "Received: 'trian'" in stderr
    assert "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1


def test_repr_and_properties():
    s = tfdp.DataParallelStrategy(["CPU:0", "CPU:1"], all_reduce="ring", bucket_bytes=1024,
                                  compression="bf16")
    assert s.all_reduce == "ring" and s.bucket_bytes == 1024 and s.compression == "bf16"
    assert "CPU:0" in repr(s) and "ring" in repr(s)
    assert isinstance(s, tf.distribute.Strategy) and s.num_replicas_in_sync == 2

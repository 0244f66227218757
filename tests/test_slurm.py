"""tfdp under a real SLURM cluster: Debian's slurm-wlm (22.05) with munge, one host, started for
this module in a temporary folder (tests/slurm_cluster.py) and always stopped.

(a) ``srun -n 2 python train.py`` with no launcher: tfdp reads SLURM's variables, and the two
    tasks train to one device's weights (<= 1e-5), bitwise equal to each other;
(b) ``srun`` + ``tfdp launch --slurm``: the same;
(c) ``docs/slurm/train_cpu.sbatch`` as shipped, submitted with ``sbatch --wait``: exit 0;
(d) ``scancel`` of a running job ends the launcher and every worker within seconds.

The module skips where no cluster can start (not root, SLURM not installed: it says which);
CI's ``slurm`` stage installs slurm-wlm and munge and sets TFDP_REQUIRE_SLURM=1, so there it
fails instead of skipping.
"""

import json
import os
import re
import sys
import time

import numpy as np
import pytest

from slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.timeout(300)]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS_DIR = os.path.join(ROOT, "tests")
N, BATCH, EPOCHS = 90, 16, 2   # 6 steps an epoch, the last of 10: uneven over the replicas
TOL = 1e-5

# What a user's train.py does under SLURM: nothing SLURM-specific. Each task writes its weights.
TRAIN = """
import json, os, sys
import tfdp
strategy = tfdp.DataParallelStrategy()
sys.path.insert(0, os.environ["TFDP_TEST_DIR"])
import test_slurm
weights = test_slurm.train(strategy)
rank = strategy.cluster.rank
with open(os.path.join(sys.argv[1], f"result-{rank}.json"), "w") as f:
    json.dump({"rank": rank, "workers": strategy.num_workers,
               "replicas": strategy.num_replicas_in_sync,
               "source": strategy.cluster.source,
               "weights": [w.tolist() for w in weights]}, f)
"""

# A job that runs until it is cancelled: each worker records its pid and its launcher's.
FOREVER = """
import os, sys, time
import tfdp
strategy = tfdp.DataParallelStrategy()
path = os.path.join(sys.argv[1], f"pids-{strategy.cluster.rank}")
with open(path + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {os.getppid()}")
os.replace(path + ".tmp", path)
while True:
    time.sleep(0.5)
"""


def train(strategy):
    """The training both sides run: Keras fit on numpy arrays, the last batch uneven."""
    import keras
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")

    def make():
        keras.utils.set_random_seed(5)
        m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.Dense(1)])
        m.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
        return m
    if strategy is None:
        model = make()
    else:
        with strategy.scope():
            model = make()
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.fixture(scope="module")
def slurm(run_process, tmp_path_factory):
    why = SlurmCluster.unavailable()
    if why:
        if os.environ.get("TFDP_REQUIRE_SLURM") == "1":
            pytest.fail(f"TFDP_REQUIRE_SLURM=1 but no SLURM cluster can start: {why}")
        pytest.skip(why)
    t0 = time.monotonic()
    with SlurmCluster(str(tmp_path_factory.mktemp("slurm"))) as cluster:
        print(f"one-host SLURM cluster up in {time.monotonic() - t0:.1f} s")
        yield cluster


@pytest.fixture(scope="module")
def one_device_weights():
    return train(None)


def _free_ports(count):
    """``count`` consecutive free ports (SLURM task k of a node listens on base + k)."""
    import portpicker
    for _ in range(50):
        base = portpicker.pick_unused_port()
        if all(portpicker.is_port_free(base + k) for k in range(1, count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports")


def _env(cluster, **extra):
    return cluster.env(TFDP_TEST_DIR=TESTS_DIR, CUDA_VISIBLE_DEVICES="",
                       TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT, **extra)


def _results(out_dir, workers):
    results = []
    for rank in range(workers):
        with open(os.path.join(out_dir, f"result-{rank}.json")) as f:
            results.append(json.load(f))
    return results


def _check_exact(results, reference, workers, replicas):
    assert [r["workers"] for r in results] == [workers] * workers
    assert [r["replicas"] for r in results] == [replicas] * workers
    weights = [[np.asarray(w, np.float32) for w in r["weights"]] for r in results]
    for other in weights[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(weights[0], other)), "workers differ"
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(weights[0], reference))
    assert diff <= TOL, f"max |dw| vs one device: {diff:.2e}"
    return diff


def test_srun_without_a_launcher_equals_one_device(slurm, one_device_weights, tmp_path):
    """(a) ``srun -n 2 python train.py``: two tasks, one CPU replica each, read SLURM's
    variables (TFDP_SLURM_PORT: the first task's port) and train as one device."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    p = slurm.run(["srun", "-n", "2", "--kill-on-bad-exit=1", sys.executable, str(script),
                   str(tmp_path)], timeout=240,
                  env=_env(slurm, TFDP_SLURM_PORT=str(_free_ports(2)), TFDP_CPU_REPLICAS="1"))
    results = _results(tmp_path, 2)
    assert [r["source"] for r in results] == ["slurm", "slurm"], p.stderr[-2000:]
    diff = _check_exact(results, one_device_weights, workers=2, replicas=2)
    print(f"srun -n 2 python train.py: max |dw| vs one device {diff:.1e}")


def test_srun_tfdp_launch_slurm_equals_one_device(slurm, one_device_weights, tmp_path):
    """(b) ``srun tfdp launch --slurm --workers-per-node 2 --cpu-replicas 2``: one launcher on
    the node starts 2 workers x 2 CPU replicas, as one device."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    slurm.run(["srun", "--ntasks-per-node=1", "-c", "2", "--kill-on-bad-exit=1",
               sys.executable, "-m", "tfdp", "launch", "--slurm", "--workers-per-node", "2",
               "--cpu-replicas", "2", "--coordinator", f"{slurm.host}:{_free_ports(1)}",
               "--timeout", "200", "--log-dir", str(tmp_path / "logs"), "--",
               sys.executable, str(script), str(tmp_path)], timeout=240, env=_env(slurm))
    results = _results(tmp_path, 2)
    assert [r["source"] for r in results] == ["tf_config", "tf_config"]  # (the launcher's)
    diff = _check_exact(results, one_device_weights, workers=2, replicas=4)
    print(f"srun tfdp launch --slurm: max |dw| vs one device {diff:.1e}")


def test_the_cpu_batch_script_runs_with_sbatch_wait(slurm, tmp_path):
    """(c) ``sbatch --wait docs/slurm/train_cpu.sbatch`` from the repository root, as shipped:
    the quickstart on 2 workers reaches its accuracy target and the job exits 0 (its output and
    logs in a temporary folder: SLURM_SUBMIT_DIR)."""
    out = tmp_path / "job.out"
    t0 = time.monotonic()
    p = slurm.run(["sbatch", "--wait", "--parsable", f"--chdir={ROOT}", f"--output={out}",
                   os.path.join(ROOT, "docs", "slurm", "train_cpu.sbatch")],
                  timeout=280, check=False, cwd=str(tmp_path), env=_env(slurm))
    text = out.read_text() if out.exists() else ""
    assert p.returncode == 0, f"sbatch --wait: exit {p.returncode}\n{p.stderr}\n{text[-4000:]}"
    job = p.stdout.strip().split(";")[0]
    assert re.search(r"test accuracy \S+", text), text[-3000:]
    assert (tmp_path / "logs" / job / "worker-1.log").exists(), os.listdir(tmp_path)
    print(f"sbatch --wait train_cpu.sbatch: exit 0 in {time.monotonic() - t0:.0f} s")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for this purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_scancel_ends_every_worker_within_seconds(slurm, tmp_path):
    """(d) A running job of ``tfdp launch --slurm`` (2 workers, each with TF's gRPC server up):
    ``scancel`` ends the launcher and both workers within 20 s, and the job leaves the queue."""
    script = tmp_path / "forever.py"
    script.write_text(FOREVER)
    batch = tmp_path / "job.sbatch"
    batch.write_text("#!/bin/bash\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=2\n"
                     f"srun {sys.executable} -m tfdp launch --slurm --workers-per-node 2 "
                     f"--cpu-replicas 1 --coordinator {slurm.host}:{_free_ports(1)} "
                     f"--log-dir {tmp_path}/logs -- {sys.executable} {script} {tmp_path}\n")
    job = slurm.run(["sbatch", "--parsable", f"--output={tmp_path}/job.out", str(batch)],
                    timeout=30, cwd=str(tmp_path), env=_env(slurm)).stdout.strip()
    deadline = time.monotonic() + 150
    paths = [tmp_path / f"pids-{rank}" for rank in range(2)]
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, (tmp_path / "job.out").read_text()[-3000:]
        time.sleep(0.5)
    pids = {int(x) for p in paths for x in p.read_text().split()}  # workers and the launcher
    assert len(pids) == 3 and all(_alive(pid) for pid in pids), pids
    t0 = time.monotonic()
    slurm.run(["scancel", job], timeout=30)
    while any(_alive(pid) for pid in pids) and time.monotonic() - t0 < 60:
        time.sleep(0.1)
    gone_s = time.monotonic() - t0
    left = [pid for pid in pids if _alive(pid)]
    assert not left, f"alive {gone_s:.0f} s after scancel: {left}"
    assert gone_s <= 20, f"the launcher and workers took {gone_s:.1f} s to end"
    while time.monotonic() - t0 < 60:
        queue = slurm.run(["squeue", "-h", "-j", job, "-o", "%T"], timeout=10, check=False)
        if not queue.stdout.strip():
            break
        time.sleep(0.5)
    assert not queue.stdout.strip(), f"job {job} still queued: {queue.stdout}"
    print(f"scancel: launcher and 2 workers gone in {gone_s:.1f} s")

"""Ray Train elastic with tfdp: ``ScalingConfig(num_workers=(1, 2))`` loses a node and goes on.

A local multi-node Ray cluster (Ray's own ``ray.cluster_utils.Cluster``: a head without the
resource the workers ask for and two nodes of 2 CPUs and one ``tfdp_host`` each, on 127.0.0.1),
so a worker lost with its node cannot come straight back. tests/test_ray.py's training (2
workers x 2 CPU replicas, ``tfdp.ray.BackupAndRestore``): the node of worker 1 is removed at a
random step (its raylet killed); Ray Train restarts the group on the 1 worker the cluster still
holds, which resumes from tfdp's backup with the same global batches (twice the share per
replica) and ends within 1e-5 of one device on those batches.

Skips when Ray is not installed; runs in tests/test_ray.py's xdist group (one Ray cluster at a
time, after that module's).
"""

import random
import sys

import pytest

import test_ray as t

pytestmark = [pytest.mark.timeout(400), t.needs_ray]


@pytest.fixture(scope="module")
def two_node_cluster(run_process):
    """Head (1 CPU, for the controller) + nodes "a" and "b" (2 CPUs, tfdp_host 1 each)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")   # every address on loopback
        mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
        # Ray Train first tries the old size again (its reserved resources still count the lost
        # node) and waits this long for it before it counts again (Ray's default: 60 s)
        mp.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20")
        import ray
        from ray.cluster_utils import Cluster
        cluster = Cluster(initialize_head=True, connect=True, head_node_args=dict(
            num_cpus=1, include_dashboard=False, node_ip_address="127.0.0.1",
            object_store_memory=128 * 1024 ** 2,
            # a killed node is declared dead in about a second (Ray's default: 15-30 s)
            _system_config={"health_check_period_ms": 500, "health_check_failure_threshold": 2},
            env_vars={"TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}))
        nodes = {}
        try:
            for name in ("a", "b"):
                nodes[name] = cluster.add_node(
                    num_cpus=t.REPLICAS, resources={"tfdp_host": 1}, node_ip_address="127.0.0.1",
                    object_store_memory=128 * 1024 ** 2,
                    env_vars={"TFDP_TEST_HOST": name, "TF_CPP_MIN_LOG_LEVEL": "2",
                              "CUDA_VISIBLE_DEVICES": ""})
            cluster.wait_for_nodes()
            ray.cloudpickle.register_pickle_by_value(t)
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
            yield cluster, nodes
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_elastic_ray_goes_on_with_fewer_workers_exactly(two_node_cluster, tmp_path):
    cluster, nodes = two_node_cluster

    def lose_the_node_of_rank_1():
        host = [e for e in t._events(str(tmp_path), 1) if e["kind"] == "step"][0]["host"]
        cluster.remove_node(nodes[host], allow_graceful=False)

    step = random.randrange(t.SAVE_FREQ + int(2.5 / t.PACE) + 1, t.N_STEPS - 6)
    killer = t.Killer(str(tmp_path), 1, step, before=lose_the_node_of_rank_1)
    killer.start()
    try:
        result = t._fit_ray(t._resume_loop, {"out": str(tmp_path)}, tmp_path, name="elastic",
                            max_failures=1, num_workers=(1, t.WORKERS),
                            resources={"CPU": t.REPLICAS, "tfdp_host": 1})
    finally:
        killer.done.set()
    assert killer.killed_at is not None, "the run ended before the node could be lost"
    assert result.error is None and result.checkpoint is not None
    note = t._read_note(tmp_path, 0)
    assert note["restored"] and note["replicas"] == t.REPLICAS, note   # 1 worker x 2 replicas
    events = t._events(str(tmp_path), 0)
    resumed = [e for e in events if e["kind"] == "begin" and e["restored"]]
    assert len(resumed) == 1 and 0 < resumed[0]["step"] <= step, events
    first = min(e["t"] for e in events if e["kind"] == "step" and e["t"] > resumed[0]["t"])
    x, y = t._data()
    batches = [(x[i:i + t.BATCH], y[i:i + t.BATCH]) for i in range(0, t.N, t.BATCH)]
    reference = t._one_device(t._model().get_weights(), batches, t.EPOCHS)
    final = t._load(str(tmp_path), "final", 0)
    dw = t._max_dw(final, reference)
    print(f"ray elastic: the node of worker 1 lost after global step {step}; Ray went on with 1 "
          f"worker x {t.REPLICAS} replicas from step {resumed[0]['step']} (loss -> first step "
          f"{first - killer.killed_at:.1f} s); max |dw| vs one device {dw:.2e}")
    assert dw <= t.TOL

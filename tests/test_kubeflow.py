"""docs/kubeflow/tfjob.yaml: a Kubeflow TFJob whose TF_CONFIG (what the operator sets in every
pod) tfdp's cluster validation accepts, one consistent cluster for all replicas.

The operator's rule (Kubeflow training operator, TFJob controller): for every replica type R and
index i, the pod's address is ``<job>-<r>-<i>.<namespace>.svc:<port>`` (r = R lower-cased, port
= the container port named ``tfjob-port``, default 2222), and each pod gets
``{"cluster": {r: [addresses...]}, "task": {"type": r, "index": i}, "environment": "cloud"}``.
"""

import json
import os
import shlex

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML parses the manifest (setup.py: test extra)")

from tfdp.cluster import parse_tf_config, resolve_cluster  # noqa: E402
from tfdp.train import config as config_lib  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MANIFEST = os.path.join(ROOT, "docs", "kubeflow", "tfjob.yaml")
DEFAULT_PORT = 2222


def _manifest():
    with open(MANIFEST, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _container(spec):
    (container,) = [c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow"]
    return container


def operator_tf_configs(job) -> list[dict]:
    """The TF_CONFIG of every pod of ``job``, as the TFJob operator builds it."""
    name, namespace = job["metadata"]["name"], job["metadata"].get("namespace", "default")
    cluster = {}
    for rtype, spec in job["spec"]["tfReplicaSpecs"].items():
        ports = [p["containerPort"] for p in _container(spec).get("ports", [])
                 if p.get("name") == "tfjob-port"]
        port = ports[0] if ports else DEFAULT_PORT
        r = rtype.lower()
        cluster[r] = [f"{name}-{r}-{i}.{namespace}.svc:{port}"
                      for i in range(int(spec.get("replicas", 1)))]
    return [{"cluster": cluster, "task": {"type": r, "index": i}, "environment": "cloud"}
            for r, hosts in cluster.items() for i in range(len(hosts))]


def test_manifest_is_a_tfjob_for_data_parallel_workers():
    job = _manifest()
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "TFJob"
    specs = job["spec"]["tfReplicaSpecs"]
    assert set(specs) <= {"Chief", "Worker"}          # no PS / evaluator: tfdp rejects them
    assert int(specs["Worker"]["replicas"]) >= 2
    for spec in specs.values():
        c = _container(spec)
        assert c["image"] and c["command"][:2] == ["tfdp", "train"]
        env = {e["name"]: e["value"] for e in c.get("env", [])}
        if "TFDP_CPU_REPLICAS" in env:
            assert int(env["TFDP_CPU_REPLICAS"]) >= 1


def test_the_command_names_a_config_that_validates():
    for spec in _manifest()["spec"]["tfReplicaSpecs"].values():
        args = _container(spec)["command"][2:]
        config = os.path.join(ROOT, args[0])
        assert os.path.isfile(config), args
        cfg = config_lib.load(config)
        assert cfg["data"]["global_batch_size"] >= 1
        assert shlex.join(_container(spec)["command"])   # plain words, runnable as written


def test_every_pods_tf_config_passes_tfdp_cluster_validation():
    configs = operator_tf_configs(_manifest())
    infos = [parse_tf_config(json.dumps(c)) for c in configs]
    assert len(infos) == 2
    assert sorted(i.rank for i in infos) == list(range(len(infos)))      # ranks 0..N-1, once
    assert len({i.workers for i in infos}) == 1                           # one cluster for all
    assert all(i.num_workers == len(infos) and i.source == "tf_config" for i in infos)
    assert [i.is_chief for i in sorted(infos, key=lambda i: i.rank)] == [True, False]
    assert infos[0].workers[0] == "tfdp-quickstart-worker-0.default.svc:2222"
    # the same through resolve_cluster, as DataParallelStrategy() reads it in the pod
    for c, info in zip(configs, infos):
        assert resolve_cluster(environ={"TF_CONFIG": json.dumps(c)}) == info


def test_the_operator_rule_with_a_chief_is_accepted_too():
    job = _manifest()
    job["spec"]["tfReplicaSpecs"] = {"Chief": dict(job["spec"]["tfReplicaSpecs"]["Worker"],
                                                   replicas=1),
                                     **job["spec"]["tfReplicaSpecs"]}
    infos = [parse_tf_config(json.dumps(c)) for c in operator_tf_configs(job)]
    chief = [i for i in infos if i.task_type == "chief"]
    assert len(chief) == 1 and chief[0].rank == 0 and chief[0].is_chief
    assert sorted(i.rank for i in infos) == [0, 1, 2]


def test_a_parameter_server_replica_is_refused_with_the_fix():
    job = _manifest()
    job["spec"]["tfReplicaSpecs"]["PS"] = dict(job["spec"]["tfReplicaSpecs"]["Worker"],
                                               replicas=1)
    with pytest.raises(ValueError, match="no parameter servers"):
        parse_tf_config(json.dumps(operator_tf_configs(job)[0]))

"""tfdp.cluster: every valid and invalid cluster form, pure Python (no TF runtime, no network).

The TF-resolver tests import tensorflow for its resolver classes only (no tensors, no devices).
Socket tests use loopback addresses only.
"""

import json
import socket

import portpicker
import pytest

from tfdp.cluster import (ClusterInfo, check_port_free, expand_nodelist, parse_slurm,
                          parse_tf_config, resolve_cluster)
from tfdp.errors import TfdpError


def tf_config(cluster, task=None, **extra):
    """A TF_CONFIG string; ``task=None`` means worker 0."""
    config = {"cluster": cluster, "task": task or {"type": "worker", "index": 0}, **extra}
    return json.dumps(config)


W2 = {"worker": ["h1:2222", "h2:2222"]}
SLURM = {  # 5 tasks: 2 on node09, 2 on node10, 1 on gpu7; this is rank 3
    "SLURM_JOB_ID": "42", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_STEP_NODELIST": "node[09-10],gpu7", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
}


# --------------------------------------------------------------------------- TF_CONFIG: valid

@pytest.mark.parametrize("cluster, task, workers, rank", [
    (W2, {"type": "worker", "index": 1}, ("h1:2222", "h2:2222"), 1),
    ({"worker": ["h1:1"]}, {"type": "worker", "index": 0}, ("h1:1",), 0),
    ({"chief": ["c:1"], "worker": ["w:1", "w:2"]}, {"type": "chief", "index": 0},
     ("c:1", "w:1", "w:2"), 0),
    ({"worker": ["w:1", "w:2"], "chief": ["c:1"]}, {"type": "worker", "index": 1},
     ("c:1", "w:1", "w:2"), 2),
    ({"chief": ["c:1"]}, {"type": "chief", "index": 0}, ("c:1",), 0),
    ({"worker": ["[::1]:2222", "[fe80::1]:65535", "127.0.0.1:1"]},
     {"type": "worker", "index": 2}, ("[::1]:2222", "[fe80::1]:65535", "127.0.0.1:1"), 2),
], ids=["workers", "single", "chief", "chief-worker", "chief-only", "ipv6"])
def test_tf_config_valid(cluster, task, workers, rank):
    info = parse_tf_config(tf_config(cluster, task))
    assert info.workers == workers
    assert (info.task_type, info.task_id, info.rank) == (task["type"], task["index"], rank)
    assert info.source == "tf_config"
    assert info.num_workers == len(workers)
    assert info.is_chief == (rank == 0)
    assert info.address == workers[rank]


def test_tf_config_extra_keys_ignored_and_round_trip():
    text = tf_config({"chief": ["c:1"], "worker": ["w:1"]}, {"type": "worker", "index": 0},
                     environment="cloud", rpc_layer="grpc")
    info = parse_tf_config(text)
    again = parse_tf_config(json.dumps(info.tf_config()))
    assert again == info
    assert info.tf_config() == {"cluster": {"chief": ["c:1"], "worker": ["w:1"]},
                                "task": {"type": "worker", "index": 0}}
    info.tf_config()["cluster"]["worker"].append("x:1")  # a copy: the info stays unchanged
    assert info.cluster_spec == {"chief": ["c:1"], "worker": ["w:1"]}
    hash(info)


# --------------------------------------------------------------------------- TF_CONFIG: invalid

def _bad(cluster=W2, task=None):
    return tf_config(cluster, task)


INVALID_TF_CONFIGS = [
    # (id, TF_CONFIG text, substrings the message must contain)
    ("empty", "", ["TF_CONFIG", "empty", "Unset TF_CONFIG"]),
    ("blank", "   ", ["TF_CONFIG", "empty"]),
    ("bad-json", "{'cluster': 1}", ["TF_CONFIG", "not valid JSON", "{'cluster': 1}",
                                    "double quotes"]),
    ("truncated-json", '{"cluster": {"worker": ["a:1"]', ["not valid JSON", '"worker"']),
    ("not-object", "[1, 2]", ["TF_CONFIG must be a JSON object", "[1, 2]"]),
    ("no-cluster", json.dumps({"task": {"type": "worker", "index": 0}}),
     ['no "cluster"', "single worker", '"task"']),
    ("empty-cluster", tf_config({}), ['TF_CONFIG["cluster"]', "non-empty", "{}"]),
    ("cluster-list", tf_config(["a:1"]), ['TF_CONFIG["cluster"]', "['a:1']"]),
    ("no-task", json.dumps({"cluster": W2}), ['"task"', "None", '"index"']),
    ("task-not-dict", tf_config(W2, "worker"), ['TF_CONFIG["task"]', "'worker'"]),
    ("no-type", tf_config(W2, {"index": 0}), ['no "type"', "{'index': 0}"]),
    ("no-index", tf_config(W2, {"type": "worker"}), ['no "index"']),
    ("ps-task", _bad(task={"type": "ps", "index": 0}),
     ['TF_CONFIG["task"]["type"]', "'ps'", "synchronous data parallel", "'chief', 'worker'"]),
    ("evaluator-task", _bad(task={"type": "evaluator", "index": 0}),
     ["'evaluator'", "synchronous data parallel"]),
    ("bad-type", _bad(task={"type": "wroker", "index": 0}), ["'wroker'", "Valid: 'worker'"]),
    ("type-not-in-cluster", _bad(task={"type": "chief", "index": 0}),
     ["'chief'", "missing", "Valid: 'worker'"]),
    ("ps-in-cluster", tf_config({"worker": ["a:1"], "ps": ["b:1"]}),
     ["'ps'", "unsupported task type", "synchronous data parallel"]),
    ("unknown-key", tf_config({"worker": ["a:1"], "workers": ["b:1"]}),
     ["'workers'", "Valid: 'chief', 'worker'"]),
    ("index-str", _bad(task={"type": "worker", "index": "0"}),
     ['TF_CONFIG["task"]["index"]', "'0'", "0..1"]),
    ("index-bool", _bad(task={"type": "worker", "index": True}), ["=True", "0..1"]),
    ("index-float", _bad(task={"type": "worker", "index": 1.0}), ["=1.0", "0..1"]),
    ("index-negative", _bad(task={"type": "worker", "index": -1}), ["=-1", "0..1"]),
    ("index-too-big", _bad(task={"type": "worker", "index": 2}), ["=2", "0..1", "2 entries"]),
    ("workers-empty", tf_config({"worker": []}), ['["worker"]', "non-empty list", "[]"]),
    ("workers-str", tf_config({"worker": "a:1,b:1"}), ['["worker"]', "'a:1,b:1'"]),
    ("two-chiefs", tf_config({"chief": ["a:1", "b:1"], "worker": ["c:1"]},
                             {"type": "worker", "index": 0}), ["at most one chief", "'b:1'"]),
    ("duplicate", tf_config({"worker": ["a:1", "b:1", "a:1"]}),
     ["unique", "'a:1'", '["worker"][0]', '["worker"][2]']),
    ("duplicate-chief-worker", tf_config({"chief": ["a:1"], "worker": ["a:1"]}),
     ["unique", '["chief"][0]']),
    ("no-port", tf_config({"worker": ["host"]}), ["'host'", "host:port"]),
    ("port-zero", tf_config({"worker": ["a:0"]}), ["invalid port", "'a:0'", "1..65535"]),
    ("port-too-big", tf_config({"worker": ["a:65536"]}), ["invalid port", "'a:65536'"]),
    ("port-text", tf_config({"worker": ["a:http"]}), ["invalid port", "'a:http'"]),
    ("port-empty", tf_config({"worker": ["a:"]}), ["invalid port", "'a:'"]),
    ("empty-host", tf_config({"worker": [":2222"]}), ["non-empty host", "':2222'"]),
    ("address-int", tf_config({"worker": [2222]}), ["string", "2222"]),
    ("bare-ipv6", tf_config({"worker": ["::1:2222"]}), ["bare IPv6", "[::1]:2222"]),
    ("bad-ipv6", tf_config({"worker": ["[nope]:2222"]}), ["IPv6", "'[nope]:2222'"]),
    ("scheme", tf_config({"worker": ["grpc://a:1"]}), ["invalid host", "'grpc://a:1'"]),
]


@pytest.mark.parametrize("text, expected", [c[1:] for c in INVALID_TF_CONFIGS],
                         ids=[c[0] for c in INVALID_TF_CONFIGS])
def test_tf_config_invalid(text, expected):
    with pytest.raises(TfdpError) as e:
        parse_tf_config(text)
    msg = str(e.value)
    assert "TF_CONFIG" in msg and "Received:" in msg
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_bad_json_snippet_is_short_and_not_a_decode_error():
    text = '{"cluster": {"worker": [' + ", ".join(f'"h{i}:1"' for i in range(200)) + "]}, oops}"
    with pytest.raises(TfdpError) as e:
        parse_tf_config(text)
    assert not isinstance(e.value.__cause__, json.JSONDecodeError)
    assert "oops" in str(e.value) and len(str(e.value)) < 600


# --------------------------------------------------------------------------- SLURM

def test_slurm_valid_block_distribution():
    info = parse_slurm(SLURM)
    assert info.workers == ("node09:8888", "node09:8889", "node10:8888", "node10:8889",
                            "gpu7:8888")
    assert (info.task_type, info.task_id, info.rank, info.source) == ("worker", 3, 3, "slurm")
    assert info.address == "node10:8889" and not info.is_chief
    assert info.cluster_spec == {"worker": list(info.workers)}


def test_slurm_port_argument_env_and_job_fallbacks():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "a,b",
           "TFDP_SLURM_PORT": "7000"}
    info = parse_slurm(env)  # no tasks-per-node: 4 tasks split evenly over 2 nodes
    assert info.workers == ("a:7000", "a:7001", "b:7000", "b:7001") and info.is_chief
    assert parse_slurm(env, port=9000).workers[0] == "a:9000"  # argument beats the env var


def test_slurm_single_task_and_matching_nodename():
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "n1",
           "SLURM_STEP_TASKS_PER_NODE": "1", "SLURMD_NODENAME": "n1"}
    assert parse_slurm(env).workers == ("n1:8888",)


@pytest.mark.parametrize("text, hosts", [
    ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("b2,a1", ["b2", "a1"]),  # order kept (block distribution follows the nodelist)
    ("o[3,5-6]-ib", ["o3-ib", "o5-ib", "o6-ib"]),
    ("r[1-2]-n[0-1]", ["r1-n0", "r1-n1", "r2-n0", "r2-n1"]),
    ("host.example.com", ["host.example.com"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


INVALID_SLURM = [
    # (id, changes to SLURM (None deletes), port argument, substrings of the message)
    ("procid-missing", {"SLURM_PROCID": None}, None, ["SLURM_PROCID is not set", "srun"]),
    ("procid-text", {"SLURM_PROCID": "x"}, None, ["SLURM_PROCID='x'", "integer >= 0"]),
    ("procid-negative", {"SLURM_PROCID": "-1"}, None, ["SLURM_PROCID='-1'"]),
    ("procid-too-big", {"SLURM_PROCID": "5"}, None, ["SLURM_PROCID='5'", "0..4"]),
    ("ntasks-missing", {"SLURM_STEP_NUM_TASKS": None}, None, ["SLURM_STEP_NUM_TASKS is not set"]),
    ("ntasks-zero", {"SLURM_STEP_NUM_TASKS": "0"}, None, ["SLURM_STEP_NUM_TASKS='0'", ">= 1"]),
    ("ntasks-text", {"SLURM_STEP_NUM_TASKS": "five"}, None, ["'five'"]),
    ("nodelist-missing", {"SLURM_STEP_NODELIST": None}, None, ["SLURM_STEP_NODELIST", "not set"]),
    ("nodelist-empty", {"SLURM_STEP_NODELIST": ""}, None, ["SLURM_STEP_NODELIST=''", "empty"]),
    ("nodelist-open", {"SLURM_STEP_NODELIST": "node[1-3"}, None, ["'node[1-3'", "node[01-03]"]),
    ("nodelist-nested", {"SLURM_STEP_NODELIST": "n[[1]]"}, None, ["'n[[1]]'"]),
    ("nodelist-range", {"SLURM_STEP_NODELIST": "n[3-1]"}, None, ["[3-1]", "lo <= hi"]),
    ("nodelist-comma", {"SLURM_STEP_NODELIST": "a,,b"}, None, ["'a,,b'"]),
    ("nodelist-huge", {"SLURM_STEP_NODELIST": "n[0-999999999]"}, None, ["more than"]),
    ("nodelist-dup", {"SLURM_STEP_NODELIST": "a,a,b"}, None, ["repeats", "'a,a,b'"]),
    ("tpn-bad", {"SLURM_STEP_TASKS_PER_NODE": "2(x)"}, None, ["'2(x)'", "2(x3),1"]),
    ("tpn-zero", {"SLURM_STEP_TASKS_PER_NODE": "0,5"}, None, ["'0,5'"]),
    ("tpn-sum", {"SLURM_STEP_TASKS_PER_NODE": "2,2,2"}, None,
     ["does not match", "6 task(s)", "SLURM_STEP_NUM_TASKS=5"]),
    ("tpn-nodes", {"SLURM_STEP_TASKS_PER_NODE": "3,2"}, None, ["2 node(s)", "has 3 node(s)"]),
    ("tpn-uneven", {"SLURM_STEP_TASKS_PER_NODE": None}, None, ["not set", "evenly"]),
    ("port-env", {"TFDP_SLURM_PORT": "http"}, None, ["TFDP_SLURM_PORT='http'", "1..65535"]),
    ("port-env-big", {"TFDP_SLURM_PORT": "70000"}, None, ["TFDP_SLURM_PORT='70000'"]),
    ("port-arg", {}, 0, ["port=0", "1..65535"]),
    ("port-arg-str", {}, "8888", ["port='8888'"]),
    ("port-overflow", {}, 65535, ["65535..65536", "lower base port"]),
    ("wrong-node", {"SLURMD_NODENAME": "gpu7"}, None,
     ["SLURMD_NODENAME='gpu7'", "'node10'", "--distribution=block"]),
]


@pytest.mark.parametrize("changes, port, expected", [c[1:] for c in INVALID_SLURM],
                         ids=[c[0] for c in INVALID_SLURM])
def test_slurm_invalid(changes, port, expected):
    env = {k: v for k, v in {**SLURM, **changes}.items() if v is not None}
    with pytest.raises(TfdpError) as e:
        parse_slurm(env, port=port)
    msg = str(e.value)
    assert "Received:" in msg
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_slurm_matches_tensorflow_resolver(monkeypatch):
    """Same addresses as TF's SlurmClusterResolver (sorted nodelist: TF sorts, tfdp keeps order)."""
    import tensorflow as tf
    SlurmClusterResolver = tf.distribute.cluster_resolver.SlurmClusterResolver
    env = {"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NODELIST": "n[1-2]",
           "SLURM_STEP_TASKS_PER_NODE": "2,1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    resolver = SlurmClusterResolver(port_base=8888, gpus_per_node=2, gpus_per_task=1,
                                    auto_set_gpu=False)
    explicit = resolve_cluster(resolver, environ={})
    mine = parse_slurm(env)
    assert explicit.workers == mine.workers == ("n1:8888", "n1:8889", "n2:8888")
    assert (explicit.rank, explicit.task_type) == (mine.rank, mine.task_type) == (2, "worker")


# --------------------------------------------------------------------------- resolve_cluster

def test_resolve_local_default():
    info = resolve_cluster(environ={"SLURM_NTASKS": "4"})  # SLURM vars without a job: local
    assert info == ClusterInfo()
    assert (info.workers, info.task_type, info.task_id, info.rank, info.source) == (
        (), "local", 0, 0, "local")
    assert info.num_workers == 1 and info.is_chief and info.address is None
    assert info.tf_config() == {} and info.cluster_spec == {}


def test_resolve_precedence_tf_config_over_slurm():
    env = {**SLURM, "TF_CONFIG": tf_config(W2, {"type": "worker", "index": 1})}
    assert resolve_cluster(environ=env).source == "tf_config"
    assert resolve_cluster(environ=SLURM).source == "slurm"
    with pytest.raises(TfdpError, match="TF_CONFIG is set but empty"):
        resolve_cluster(environ={**SLURM, "TF_CONFIG": ""})  # never falls through to SLURM


@pytest.mark.parametrize("env", [
    {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
    {"SLURM_JOB_ID": "1", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "8"},
    {"SLURM_JOB_ID": "1"},
])
def test_resolve_single_slurm_task_is_local(env):
    assert resolve_cluster(environ=env).source == "local"


def test_resolve_bad_slurm_is_an_error_not_local():
    with pytest.raises(TfdpError, match="SLURM_STEP_NUM_TASKS='0'"):
        resolve_cluster(environ={**SLURM, "SLURM_STEP_NUM_TASKS": "0"})


def test_resolve_reads_os_environ(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(W2, {"type": "worker", "index": 1}))
    assert resolve_cluster().rank == 1


def test_resolve_explicit_resolver_wins_and_is_validated():
    import tensorflow as tf
    SimpleClusterResolver = tf.distribute.cluster_resolver.SimpleClusterResolver
    resolver = SimpleClusterResolver(
        tf.train.ClusterSpec({"chief": ["c:1"], "worker": ["w:1"]}), task_type="worker",
        task_id=0)
    info = resolve_cluster(resolver, environ={"TF_CONFIG": ""})
    assert (info.source, info.rank, info.workers) == ("explicit", 1, ("c:1", "w:1"))

    bad = SimpleClusterResolver(tf.train.ClusterSpec({"worker": ["w:1"], "ps": ["p:1"]}),
                                task_type="worker", task_id=0)
    with pytest.raises(TfdpError, match=r"cluster_resolver\.cluster_spec\(\).*'ps'"):
        resolve_cluster(bad)
    out_of_range = SimpleClusterResolver(tf.train.ClusterSpec({"worker": ["w:1"]}),
                                         task_type="worker", task_id=3)
    with pytest.raises(TfdpError, match=r"cluster_resolver\.task_id=3"):
        resolve_cluster(out_of_range)
    with pytest.raises(TfdpError, match=r"cluster_resolver\.cluster_spec\(\)"):
        resolve_cluster(SimpleClusterResolver(tf.train.ClusterSpec({})))
    with pytest.raises(TfdpError, match="cluster_resolver='nope'.*ClusterResolver"):
        resolve_cluster("nope")


def test_to_resolver_round_trip():
    info = parse_tf_config(tf_config({"chief": ["c:1"], "worker": ["w:1", "[::1]:2"]},
                                     {"type": "worker", "index": 1}))
    resolver = info.to_resolver()
    assert resolver.cluster_spec().as_dict() == info.cluster_spec
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolve_cluster(resolver) == ClusterInfo(**{**info.__dict__, "source": "explicit"})
    assert ClusterInfo().to_resolver().cluster_spec().as_dict() == {}


# --------------------------------------------------------------------------- check_port_free

def test_check_port_free_on_a_free_port():
    check_port_free("127.0.0.1", portpicker.pick_unused_port())


@pytest.mark.parametrize("listen", [False, True])
def test_check_port_free_detects_a_bound_port(listen):
    port = portpicker.pick_unused_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        if listen:  # like a TF server: SO_REUSEADDR on, listening
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", port))
        if listen:
            held.listen(1)
        with pytest.raises(TfdpError) as e:
            check_port_free("127.0.0.1", port)
    assert f"Port {port}" in str(e.value) and "already in use" in str(e.value)
    check_port_free("127.0.0.1", port)  # free again once closed


@pytest.mark.parametrize("host, port, expected", [
    ("127.0.0.1", 0, "port=0"),
    ("127.0.0.1", True, "port=True"),
    ("127.0.0.1", "80", "port='80'"),
    (None, 2222, "host=None"),
])
def test_check_port_free_bad_arguments(host, port, expected):
    with pytest.raises(TfdpError, match=expected):
        check_port_free(host, port)


# --- tfdp launch --slurm: one launcher per node ---------------------------------------------------

def _launch_env(**over):
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_NUM_NODES": "3",
           "SLURM_STEP_NODELIST": "gpu[09-10],cpu1", "SLURMD_NODENAME": "gpu10"}
    env.update(over)
    return {k: v for k, v in env.items() if v is not None}


def test_slurm_nodes_one_launcher_per_node():
    from tfdp.cluster.slurm import slurm_nodes
    assert slurm_nodes(_launch_env()) == (3, 1, "gpu09")
    assert slurm_nodes(_launch_env(SLURM_PROCID="2", SLURMD_NODENAME="cpu1")) == (3, 2, "gpu09")
    # the job variables when the step ones are missing
    env = _launch_env(SLURM_STEP_NUM_TASKS=None, SLURM_STEP_NUM_NODES=None,
                      SLURM_STEP_NODELIST=None, SLURM_NTASKS="3", SLURM_JOB_NUM_NODES="3",
                      SLURM_JOB_NODELIST="gpu[09-10],cpu1")
    assert slurm_nodes(env) == (3, 1, "gpu09")


@pytest.mark.parametrize("over,needle", [
    ({"SLURM_PROCID": None}, "needs srun's environment"),
    ({"SLURM_STEP_NUM_TASKS": "6"}, "one tfdp launch per node, but this step has 6 task(s) on 3"),
    ({"SLURM_STEP_NUM_NODES": "2"}, "does not match SLURM_STEP_NODELIST (3 node(s))"),
    ({"SLURM_PROCID": "3"}, "It must be in 0..2"),
    ({"SLURMD_NODENAME": "cpu1"}, "another node than SLURM_STEP_NODELIST predicts ('gpu10')"),
    ({"SLURM_STEP_NODELIST": "gpu[10-09]"}, "Invalid range"),
])
def test_slurm_nodes_errors(over, needle):
    from tfdp.cluster.slurm import slurm_nodes
    with pytest.raises(TfdpError) as e:
        slurm_nodes(_launch_env(**over))
    assert needle in str(e.value)
    if "range" not in needle:  # the hostlist's own errors show the expected syntax instead
        assert "srun" in str(e.value)

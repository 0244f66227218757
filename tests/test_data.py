"""tfdp.data: every example reaches exactly one replica once per epoch, on one or many workers.

Multi-worker input is tested in one process by building each worker's pipeline from a hand-made
``tf.distribute.InputContext`` (2 workers x 2 replicas) and taking the union over the workers.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

import tfdp
import tfdp.data as td
from tfdp.errors import TfdpError

DEVS = {2: ["CPU:0", "CPU:1"], 4: ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]}
_STRATEGIES = {}


def strategy(n):
    if n not in _STRATEGIES:
        _STRATEGIES[n] = tfdp.DataParallelStrategy(DEVS[n])
    return _STRATEGIES[n]


def ctx(workers, rank, replicas):
    return tf.distribute.InputContext(num_input_pipelines=workers, input_pipeline_id=rank,
                                      num_replicas_in_sync=replicas)


def ids_of(part):
    if isinstance(part, dict):
        part = part["id"]
    elif isinstance(part, tuple):
        part = part[0]
    return np.asarray(part).reshape(-1).tolist()


def collect(s, dist):
    """[[ids of replica 0, ids of replica 1, ...] for each step] of a distributed dataset."""
    steps = []
    for batch in dist:
        steps.append([ids_of(r) for r in s.experimental_local_results(batch)])
    return steps


def worker_steps(ds, local):
    """A worker dataset's elements grouped into steps of ``local`` per-replica batches."""
    parts = [ids_of(p) for p in ds]
    assert len(parts) % local == 0, len(parts)
    return [parts[i:i + local] for i in range(0, len(parts), local)]


def simulate(source, workers, replicas, **kw):
    """Global steps [[ids per global replica]] from each simulated worker's pipeline."""
    local = replicas // workers
    per_worker = [worker_steps(td.worker_dataset(source, ctx(workers, w, replicas), **kw), local)
                  for w in range(workers)]
    assert len({len(p) for p in per_worker}) == 1, [len(p) for p in per_worker]
    return [sum((p[k] for p in per_worker), []) for k in range(len(per_worker[0]))]


def flat(steps):
    return [i for step in steps for part in step for i in part]


def assert_exactly_once(steps, n):
    ids = flat(steps)
    dup = [i for i, c in collections.Counter(ids).items() if c > 1]
    assert not dup, f"duplicated: {dup[:10]}"
    assert sorted(ids) == list(range(n)), f"missing: {sorted(set(range(n)) - set(ids))[:10]}"


@pytest.fixture(scope="module")
def files8(tmp_path_factory):
    d = tmp_path_factory.mktemp("interactions")
    return td.write_interactions_tfrecords(d, num_files=8, examples_per_file=25, seed=1)


# --- batch sizes -------------------------------------------------------------------------------

def test_replica_batch_sizes_and_worker_shares():
    assert td.replica_batch_sizes(50, 4) == [13, 13, 12, 12]
    assert td.replica_batch_sizes(2, 4) == [1, 1, 0, 0]
    assert td.per_replica_batch_size(64, ctx(2, 1, 4)) == 16
    assert [td.worker_batch_size(10, ctx(2, w, 4)) for w in (0, 1)] == [6, 4]
    with pytest.raises(TfdpError, match=r"global_batch_size=50 with num_replicas_in_sync=4"):
        td.per_replica_batch_size(50, ctx(1, 0, 4))
    assert td.steps_per_epoch(23, 8) == 3 and td.steps_per_epoch(23, 8, drop_remainder=True) == 2


# --- exactly once: global batched datasets -----------------------------------------------------

@pytest.mark.parametrize("n", [32, 23])  # even, and an uneven tail of 7 over 4 replicas
@pytest.mark.parametrize("prebatched", [False, True])
def test_global_batched_exactly_once(n, prebatched):
    s = strategy(4)
    ds = tf.data.Dataset.range(n)
    dist = (td.distribute(s, ds.batch(8)) if prebatched
            else td.distribute(s, ds, global_batch_size=8))
    steps = collect(s, dist)
    assert_exactly_once(steps, n)
    assert len(steps) == -(-n // 8)
    for k, step in enumerate(steps):  # each step is exactly global batch k, split evenly
        assert sorted(sum(step, [])) == list(range(8 * k, min(8 * k + 8, n)))
        assert [len(p) for p in step] == td.replica_batch_sizes(min(8, n - 8 * k), 4)


@pytest.mark.parametrize("n", [32, 23])
def test_global_batched_two_simulated_workers(n):
    steps = simulate(tf.data.Dataset.range(n), workers=2, replicas=4, global_batch_size=8)
    assert_exactly_once(steps, n)
    for k, step in enumerate(steps):  # the global batches are those of a single device
        assert sorted(sum(step, [])) == list(range(8 * k, min(8 * k + 8, n)))
    # a tail smaller than the replica count: empty batches, nothing dropped
    steps = simulate(tf.data.Dataset.range(10), workers=2, replicas=4, global_batch_size=8)
    assert steps[-1] == [[8], [9], [], []]


def test_drop_remainder_gives_static_shapes():
    s = strategy(4)
    ds = tf.data.Dataset.range(23)
    w = td.worker_dataset(ds, ctx(2, 1, 4), global_batch_size=8, drop_remainder=True)
    assert w.element_spec.shape.as_list() == [2]
    dist = td.distribute(s, ds, global_batch_size=8, drop_remainder=True)
    assert sorted(flat(collect(s, dist))) == list(range(16))


# --- per-replica pipelines from a function -----------------------------------------------------

def per_replica_fn(n, global_batch):
    def fn(input_context):
        b = td.per_replica_batch_size(global_batch, input_context)
        return (tf.data.Dataset.range(n)
                .shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
                .batch(b))
    return fn


def test_dataset_function_exactly_once():
    s = strategy(2)
    assert_exactly_once(collect(s, td.distribute(s, per_replica_fn(21, 4))), 21)
    parts = []
    for w in range(2):  # 2 simulated workers x 2 replicas, through TF's contract directly
        parts += [ids_of(p) for p in per_replica_fn(21, 4)(ctx(2, w, 4))]
    assert_exactly_once([parts], 21)


# --- files ------------------------------------------------------------------------------------

def test_tfrecord_files_exactly_once_one_worker(files8):
    s = strategy(4)
    dist = td.distribute(s, files8, global_batch_size=24, parse_fn=td.INTERACTION_FEATURES)
    steps = collect(s, dist)
    assert_exactly_once(steps, 200)
    batch = next(iter(dist))
    assert set(s.experimental_local_results(batch)[0]) == set(td.INTERACTION_FEATURES)


@pytest.mark.parametrize("workers,replicas", [(2, 4), (3, 3)])  # 8 files over 3: 3, 3, 2
def test_tfrecord_file_sharding_simulated_workers(files8, workers, replicas):
    mine = [td.shard_files(files8, ctx(workers, w, replicas)) for w in range(workers)]
    assert sorted(sum(mine, [])) == sorted(files8)  # disjoint, complete
    parts = []
    for w in range(workers):
        local = replicas // workers
        ds = td.worker_dataset(files8, ctx(workers, w, replicas), global_batch_size=2 * replicas,
                               shard="files", parse_fn=td.INTERACTION_FEATURES)
        steps = worker_steps(ds, local)
        got = flat(steps)
        assert {i // 25 for i in got} == {files8.index(f) for f in mine[w]}  # only its own files
        parts += got
    assert_exactly_once([[parts]], 200)


def test_data_sharding_of_files(files8):
    steps = simulate(files8[:1], workers=2, replicas=4, global_batch_size=8, shard="data",
                     parse_fn=td.INTERACTION_FEATURES)
    assert_exactly_once(steps, 25)
    steps = simulate(files8, workers=2, replicas=4, global_batch_size=16, shard="auto",
                     parse_fn=td.INTERACTION_FEATURES, shuffle_seed=5)
    assert_exactly_once(steps, 200)


# --- tfds ------------------------------------------------------------------------------------

def test_tfds_mock_exactly_once():
    tfds = pytest.importorskip("tensorflow_datasets")
    rc = tfds.ReadConfig(add_tfds_id=True)
    ids = lambda ex: ex["tfds_id"]  # noqa: E731  unique per example
    with tfds.testing.mock_data(num_examples=30):
        s = strategy(2)
        dist = td.load_tfds("mnist", "train", s, global_batch_size=8, read_config=rc,
                            parse_fn=ids, shuffle_seed=3)
        got = flat(collect(s, dist))
        # 2 simulated workers x 2 replicas: the mock has no shard files, so "auto" shards data
        sim = []
        for w in range(2):
            ds = td.load_tfds("mnist", "train", ctx(2, w, 4), global_batch_size=8,
                              read_config=rc, parse_fn=ids)
            sim += [i for p in ds for i in np.asarray(p).tolist()]
    for seen in (got, sim):
        assert len(seen) == 30 and len(set(seen)) == 30


def test_tfds_file_sharding_passes_input_context():
    tfds = pytest.importorskip("tensorflow_datasets")
    seen_contexts = []

    def as_dataset(self, split, decoders=None, read_config=None, shuffle_files=False):
        ic = read_config.input_context  # honour it as tfds does: 4 "files" of 10 examples
        seen_contexts.append(ic)
        files = list(range(4))
        if ic is not None:
            files = files[ic.input_pipeline_id::ic.num_input_pipelines]
        return tf.data.Dataset.from_tensor_slices(tf.constant(files, tf.int64)).flat_map(
            lambda f: tf.data.Dataset.range(10 * f, 10 * f + 10)).map(
            lambda i: {"image": tf.zeros([28, 28, 1], tf.uint8), "label": i})

    parts = []
    with tfds.testing.mock_data(as_dataset_fn=as_dataset):
        for w in range(2):
            ds = td.load_tfds("mnist", "train", ctx(2, w, 4), global_batch_size=8, shard="files",
                              parse_fn=lambda ex: ex["label"])
            parts += [i for p in ds for i in np.asarray(p).tolist()]
    assert [(c.num_input_pipelines, c.input_pipeline_id) for c in seen_contexts] == [(2, 0), (2, 1)]
    assert sorted(parts) == list(range(40))


# --- shuffling and resuming --------------------------------------------------------------------

def test_shuffled_epochs_differ_and_cover_exactly_once(files8):
    s = strategy(4)
    ds = tf.data.Dataset.range(64)
    e0, e1 = (collect(s, td.distribute(s, ds, global_batch_size=8, shuffle_seed=11, epoch=e))
              for e in (0, 1))
    assert_exactly_once(e0, 64) and assert_exactly_once(e1, 64)
    assert flat(e0) != flat(e1) and flat(e0) != list(range(64))
    # files, file sharding, 2 simulated workers: also differ per epoch and stay exact
    f = [simulate(files8, 2, 4, global_batch_size=16, shard="files", shuffle_seed=11, epoch=e,
                  parse_fn=td.INTERACTION_FEATURES, shuffle_buffer=64) for e in (0, 1)]
    assert_exactly_once(f[0], 200) and assert_exactly_once(f[1], 200)
    assert flat(f[0]) != flat(f[1])
    # several epochs in one dataset: each epoch exact and reshuffled
    multi = collect(s, td.distribute(s, ds, global_batch_size=8, shuffle_seed=11, epochs=2))
    assert multi == e0 + e1


def test_shuffle_order_ignores_global_seed():
    orders = []
    for g in (1, 2):
        tf.random.set_seed(g)
        w = td.worker_dataset(tf.data.Dataset.range(40), ctx(2, 1, 2), global_batch_size=4,
                              shuffle_seed=3)
        orders.append([ids_of(p) for p in w])
    assert orders[0] == orders[1]
    v = tf.data.Dataset.range(6).map(lambda i: tf.fill([i], i))  # variable shapes
    out = [x.tolist() for x in td.shuffle(v, seed=1, buffer_size=4).as_numpy_iterator()]
    assert sorted(out, key=len) == [[i] * i for i in range(6)]


@pytest.mark.parametrize("mode", ["data", "files"])
def test_resume_mid_epoch_sees_the_rest_exactly_once(files8, mode):
    kw = dict(global_batch_size=16, shard=mode, shuffle_seed=7, epoch=3, shuffle_buffer=50,
              parse_fn=td.INTERACTION_FEATURES)
    full = simulate(files8, 2, 4, **kw)
    rest = simulate(files8, 2, 4, start_step=5, **kw)
    assert rest == full[5:]
    assert_exactly_once(full[:5] + rest, 200)
    s = strategy(2)  # through a strategy, and over an epoch boundary
    ds = tf.data.Dataset.range(50)
    full = collect(s, td.distribute(s, ds, global_batch_size=8, shuffle_seed=1, epochs=2))
    rest = collect(s, td.distribute(s, ds, global_batch_size=8, shuffle_seed=1, epochs=2,
                                    start_step=3))
    assert rest == full[3:] and len(full) == 14
    w = td.worker_dataset(ds, ctx(1, 0, 2), global_batch_size=8)
    assert [ids_of(p) for p in td.skip_to(w, 2, ctx(1, 0, 2))] == [ids_of(p) for p in w][4:]


# --- Keras ------------------------------------------------------------------------------------

def test_keras_fit_global_batched_dataset_equals_single_device():
    from helpers import TOL, build, make_data, max_diff
    x, y = make_data(90, seed=7)  # batches of 21 split 11,10 over 2 replicas; the tail of 6: 3,3
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    ref = build(None)
    ref.fit(ds.batch(21), epochs=2, verbose=0)
    s = strategy(2)
    plain = build(s)  # plain Keras: model.fit(global-batched dataset) under the strategy
    plain.fit(ds.batch(21), epochs=2, verbose=0)
    ours = build(s)
    ours.fit(td.distribute(s, ds, global_batch_size=21), epochs=2, verbose=0)
    assert max_diff(ref.get_weights(), plain.get_weights()) <= TOL
    assert max_diff(ref.get_weights(), ours.get_weights()) <= TOL


# --- validation --------------------------------------------------------------------------------

def test_errors_name_what_was_received(files8, tmp_path):
    with pytest.raises(TfdpError, match=r"2 file\(s\) for num_workers=3.*shard=\"data\""):
        td.shard_files(files8[:2], ctx(3, 0, 3))
    with pytest.raises(TfdpError, match=r"2 file\(s\) for num_workers=3"):
        td.worker_dataset(files8[:2], ctx(3, 0, 3), global_batch_size=6, shard="files")
    with pytest.raises(TfdpError, match=r"empty.*cardinality 0"):
        td.distribute(strategy(2), tf.data.Dataset.range(0), global_batch_size=4)
    with pytest.raises(TfdpError, match=r"files=\[\]"):
        td.worker_dataset([], ctx(1, 0, 1), global_batch_size=4)
    empty = tmp_path / "empty.tfrecord"
    empty.write_bytes(b"")
    with pytest.raises(TfdpError, match=r"empty.*0 bytes"):
        td.worker_dataset([str(empty)], ctx(1, 0, 1), global_batch_size=4)
    with pytest.raises(TfdpError, match=r"global_batch_size=3 with num_replicas_in_sync=4"):
        td.distribute(strategy(4), tf.data.Dataset.range(10), global_batch_size=3)
    with pytest.raises(TfdpError, match=r"batches of 2 with 4 replica"):
        td.distribute(strategy(4), tf.data.Dataset.range(10).batch(2, drop_remainder=True))
    with pytest.raises(TfdpError, match=r"shard='rows'.*'auto', 'data', 'files', 'off'"):
        td.worker_dataset(files8, ctx(1, 0, 1), global_batch_size=4, shard="rows")
    with pytest.raises(TfdpError, match=r"shard=\"files\" needs a list of files"):
        td.worker_dataset(tf.data.Dataset.range(8), ctx(1, 0, 1), global_batch_size=4,
                          shard="files")
    with pytest.raises(TfdpError, match=r"shuffle_seed=1 with global_batch_size=None"):
        td.worker_dataset(tf.data.Dataset.range(8).batch(4), ctx(1, 0, 1), shuffle_seed=1)
    with pytest.raises(TfdpError, match=r"function with \['global_batch_size'\]"):
        td.distribute(strategy(2), per_replica_fn(8, 4), global_batch_size=4)
    with pytest.raises(TfdpError, match=r"num_input_pipelines=2.*num_replicas_in_sync=3"):
        td.worker_dataset(files8, ctx(2, 0, 3), global_batch_size=6)
    with pytest.raises(TfdpError, match=r"Received: source=5"):
        td.worker_dataset(5, ctx(1, 0, 1))
    assert issubclass(TfdpError, ValueError)


def test_input_bench_smoke(tmp_path, capsys):
    from tfdp_bench.input import run_input_bench
    r = run_input_bench(tmp_path, num_files=4, examples=400, global_batch_size=64, workers=2,
                        repeats=1, train_steps=2)
    assert {row["shard"] for row in r["rows"]} == {"files", "data"}
    assert all(row["examples"] == 200 for row in r["rows"])  # each worker: its half
    assert r["train_examples_per_s"] > 0 and "examples/s" in capsys.readouterr().out

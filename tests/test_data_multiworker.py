"""tfdp.data across real worker processes: 2 workers x 2 CPU replicas through the launcher.

One job checks every case (one TF start-up): each worker iterates one epoch of each pipeline and
reports the element ids its local replicas received; the union over both workers must be every
element exactly once.
"""

import collections

import pytest

from tfdp.testing import parse_results, run_workers

pytestmark = [pytest.mark.timeout(400)]

SCRIPT = r"""
import os
import tfdp
strategy = tfdp.DataParallelStrategy()          # multi-worker from the launcher's TF_CONFIG
import numpy as np
import tensorflow as tf
import tfdp.data as td
from tfdp.testing import emit_result

rank = strategy.cluster.rank
out_dir = os.environ["TFDP_TEST_DIR"]
files = td.write_interactions_tfrecords(os.path.join(out_dir, f"w{rank}"), num_files=8,
                                        examples_per_file=13, seed=3)   # 104 examples


def ids_of(part):
    if isinstance(part, dict):
        part = part["id"]
    elif isinstance(part, tuple):
        part = part[0]
    return np.asarray(part).reshape(-1).tolist()


def epoch_ids(dist):
    ids, steps = [], 0
    for batch in dist:
        for r in strategy.experimental_local_results(batch):
            ids += ids_of(r)
        steps += 1
    return ids, steps


res = {}
for n in (40, 43):   # even / uneven number of global batches of 8 (43 % 8 = 3 < 4 replicas)
    ds = tf.data.Dataset.range(n)
    res[f"range{n}"] = epoch_ids(td.distribute(strategy, ds, global_batch_size=8))


def per_replica_fn(ctx):
    ds = tf.data.Dataset.range(64).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    return ds.batch(ctx.get_per_replica_batch_size(16))


res["fn64"] = epoch_ids(td.distribute(strategy, per_replica_fn))
res["files104"] = epoch_ids(td.distribute(strategy, files, global_batch_size=16, shard="files",
                                          parse_fn=td.INTERACTION_FEATURES))
for epoch in (0, 1):
    res[f"shuffled{epoch}"] = epoch_ids(td.distribute(
        strategy, tf.data.Dataset.range(48), global_batch_size=8, shuffle_seed=5, epoch=epoch))
res["resume48"] = epoch_ids(td.distribute(strategy, tf.data.Dataset.range(48),
                                          global_batch_size=8, shuffle_seed=5, start_step=2))

import tensorflow_datasets as tfds
with tfds.testing.mock_data(num_examples=40):
    mock = td.load_tfds("mnist", "train", strategy, global_batch_size=8, shard="data")
    ids = []
    steps = 0
    for batch in mock:
        for r in strategy.experimental_local_results(batch):
            img = r["image"] if isinstance(r, dict) else r[0]
            # mock images are random: identify each by its pixel sum and position
            ids += [int(np.asarray(x, np.int64).sum()) for x in np.asarray(img)]
        steps += 1
    res["tfds40"] = (ids, steps)
emit_result({k: {"ids": v[0], "steps": v[1]} for k, v in res.items()},
            replicas=strategy.num_replicas_in_sync, rank=rank)
"""


def _once(results, key, expected):
    ids = [i for r in results for i in r[key]["ids"]]
    dup = [i for i, c in collections.Counter(ids).items() if c > 1]
    assert not dup, f"{key}: duplicated {dup[:10]}"
    assert sorted(ids) == sorted(expected), f"{key}: missing {set(expected) - set(ids)}"
    steps = {r[key]["steps"] for r in results}
    assert len(steps) == 1, f"{key}: workers ran different step counts {steps}"
    return ids


def test_exactly_once_across_two_workers(worker_job, tmp_path):
    outputs = run_workers(SCRIPT, workers=2, cpu_replicas=2, timeout=300,
                          env={"TFDP_TEST_DIR": str(tmp_path)})
    results = parse_results(outputs)
    assert [r["replicas"] for r in results] == [4, 4]
    assert sorted(r["rank"] for r in results) == [0, 1]
    _once(results, "range40", range(40))
    _once(results, "range43", range(43))
    _once(results, "fn64", range(64))
    _once(results, "files104", range(104))
    e0 = _once(results, "shuffled0", range(48))
    e1 = _once(results, "shuffled1", range(48))
    w0 = [r for r in results if r["rank"] == 0][0]
    assert w0["shuffled0"]["ids"] != w0["shuffled1"]["ids"]  # two epochs, two orders
    assert e0 != e1
    # resume at step 2 of shuffled epoch 0 == that epoch's steps 2.. exactly once
    first_two = set()
    for r in results:
        ids = r["shuffled0"]["ids"]
        first_two |= set(ids[: 2 * 4])  # 2 steps x 2 local replicas x 2 per replica
    _once(results, "resume48", sorted(set(range(48)) - first_two))
    # tfds mock data: 40 examples seen once in total (40 images, by count per worker)
    assert sum(len(r["tfds40"]["ids"]) for r in results) == 40

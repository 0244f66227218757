"""Cross-worker gather-vs-densify crossover for Embedding gradients (IndexedSlices).

Run (2 workers on 127.0.0.1, one replica each):

    V=100000 ROWS=2000,20000,40000,60000,80000,100000 \
        tfdp launch --workers 2 --timeout 600 -- python docs/benchmarks/sparse_workers.py

Each worker holds one IndexedSlices of ROWS random rows of a V x 64 float32 table; the job times
(median of 7, inside tf.function) the replica-context all_reduce("SUM") under tfdp's
MultiWorkerDataParallelStrategy with ``sparse`` forced to "gather" and to "densify", alone and
followed by the dense gradient an optimizer such as momentum SGD builds (``+dense``). ``ratio`` is
the rule's quantity (tfdp.reduce.sparse): gathered bytes W * ROWS * (row bytes + index bytes)
over the table's bytes. Worker 0 prints one JSON line per ROWS value.
"""
import json
import os
import statistics
import time

import tfdp

strategy = tfdp.DataParallelStrategy()

import tensorflow as tf  # noqa: E402

V, D = int(os.environ.get("V", "100000")), 64
W = strategy.num_replicas_in_sync
ops = strategy.cross_device_ops
for rows in [int(r) for r in os.environ.get("ROWS", "2000,20000,100000").split(",")]:
    def make(ctx, rows=rows):
        r = ctx.replica_id_in_sync_group
        idx = tf.random.stateless_uniform([rows], seed=[r, 1], maxval=V, dtype=tf.int64)
        val = tf.random.stateless_normal([rows, D], seed=[r, 2])
        return tf.IndexedSlices(val, idx, tf.constant([V, D], tf.int64))
    vals = strategy.experimental_distribute_values_from_function(make)
    row = {"table_MB": V * D * 4 / 1e6, "rows_per_worker": rows,
           "ratio": round(W * rows * (D * 4 + 8) / (V * D * 4), 3)}
    for mode, dense in (("gather", False), ("densify", False), ("gather", True), ("densify", True)):
        ops.sparse = mode

        @tf.function
        def step(v, dense=dense):
            def fn(g):
                out = tf.distribute.get_replica_context().all_reduce("SUM", g)
                if dense:
                    return tf.reduce_sum(tf.convert_to_tensor(out)[:1])
                vals = out.values if isinstance(out, tf.IndexedSlices) else out
                return tf.reduce_sum(vals[:1])
            return strategy.run(fn, args=(v,))
        step(vals)
        step(vals)
        samples = []
        for _ in range(7):
            t0 = time.perf_counter()
            float(step(vals))
            samples.append(time.perf_counter() - t0)
        row[mode + ("+dense" if dense else "") + " ms"] = round(statistics.median(samples) * 1e3, 1)
    if strategy.cluster.rank == 0:
        print(json.dumps(row), flush=True)

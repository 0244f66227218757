"""fp16 / bf16 compression across workers: tfdp's own uncompressed vs compressed all-reduce.

Run (2 workers on 127.0.0.1, one replica each):

    R=11 tfdp launch --workers 2 --timeout 600 -- python docs/benchmarks/compression_workers.py

64 MB of float32 per worker in T (default 32) tensors. Every contender lives in the same worker
processes and runs in alternating order, round after round (separate jobs per contender, as in
``tfdp bench allreduce --workers``, add the drift between jobs to the comparison):

* ``run none|fp16|bf16``: ``strategy.run`` of a replica-context ``all_reduce("SUM")`` under
  ``MultiWorkerDataParallelStrategy`` (tfdp's reduction with that compression, fixed when the
  function is traced);
* ``raw f32|f16``: one ``CollectiveReduceV2`` (ring, 16 subdivisions) of the packed buffer cast
  to that dtype: the transport's own rate, for reference.

Worker 0 prints the median ms per contender and the ratios against ``run none``.
"""
import json
import os
import statistics
import time

import tfdp

strategy = tfdp.DataParallelStrategy()

import tensorflow as tf  # noqa: E402

N = 16 * 1024 * 1024  # float32 elements: 64 MB
T = int(os.environ.get("T", "32"))
ROUNDS = int(os.environ.get("R", "11"))
dev = strategy.extended.worker_devices[0]
rank = strategy.cluster.rank
with tf.device(dev):
    xs = [tf.random.stateless_uniform([N // T], seed=[rank, i], minval=-1.0, maxval=1.0)
          for i in range(T)]
ops = strategy.cross_device_ops


def via_strategy(compression):
    @tf.function
    def f():
        def fn():
            outs = tf.distribute.get_replica_context().all_reduce("SUM", xs)
            return tf.add_n([tf.reshape(o, [-1])[0] for o in outs])
        return strategy.run(fn)
    ops.compression = compression  # read when the function is traced (next line)
    f()
    return f


def raw(dtype, key):
    @tf.function
    def f():
        with tf.device(dev):
            buf = tf.concat([tf.reshape(tf.cast(x, dtype), [-1]) for x in xs], 0)
            out = tf.raw_ops.CollectiveReduceV2(
                input=buf, group_size=strategy.cluster.num_workers, group_key=1 << 27,
                instance_key=key, ordering_token=[], merge_op="Add", final_op="Id",
                communication_hint="ring", timeout_seconds=0.0, max_subdivs_per_device=16)
            return tf.reduce_sum(tf.cast(out[:8], tf.float32))
    f()
    return f


contenders = {"run none": via_strategy(None), "run fp16": via_strategy("fp16"),
              "run bf16": via_strategy("bf16"), "raw f32": raw(tf.float32, 7),
              "raw f16": raw(tf.float16, 8)}
times = {k: [] for k in contenders}
for _ in range(ROUNDS):
    for name, f in contenders.items():
        t0 = time.perf_counter()
        float(f())
        times[name].append(time.perf_counter() - t0)
if rank == 0:
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(json.dumps({"tensors": T, "rounds": ROUNDS,
                      "median_ms": {k: round(v, 1) for k, v in med.items()},
                      "speedup_vs_run_none": {k: round(med["run none"] / v, 2)
                                              for k, v in med.items()}}), flush=True)

"""One worker of a ``tfdp bench allreduce --workers N`` job (:mod:`tfdp_bench.workers` launches
it as ``python -m tfdp_bench.workers_child SPEC``): times every variant of its job, worker 0
prints one result line per variant.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from tfdp.errors import TfdpError
from tfdp_bench import _common
from tfdp_bench.workers import MWMS_KIND, PROGRESS_MARK, RESULT_MARK, _iters, _split_counts


def _child(spec: dict) -> int:
    """In each launched worker: time all_reduce(SUM) of every size for every variant of the job
    (tfdp's compressions share one job: its reducer's ``compression`` is read when a variant's
    step is traced, and the variants' samples alternate); worker 0 prints one result line per
    variant."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    kind = spec["kind"]
    variants = spec["variants"]
    if kind == MWMS_KIND:
        import tensorflow as tf
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        infos = [{"cross_device_ops": _common.describe_cross_device_ops(strategy)}]
    else:
        from tfdp.strategy.multiworker import MultiWorkerDataParallelStrategy
        strategy = MultiWorkerDataParallelStrategy(all_reduce=spec["algorithm"],
                                                   bucket_bytes=spec["bucket_bytes"],
                                                   compression=variants[0]["compression"])
        import tensorflow as tf
        infos = [{"algorithm": strategy.all_reduce, "bucket_bytes": strategy.bucket_bytes,
                  "compression": v["compression"]} for v in variants]
    import numpy as np

    rank = int(os.environ.get("TFDP_WORKER_RANK", "0"))
    replicas = strategy.num_replicas_in_sync

    def say(text):
        if rank == 0:
            print(PROGRESS_MARK + text, file=sys.stderr, flush=True)

    results = [[] for _ in variants]
    for nbytes in spec["sizes"]:
        counts = _split_counts(nbytes, spec["tensors"])

        def make(i, count, replica):
            return tf.random.stateless_uniform([count], seed=[i, replica], minval=-1.0,
                                               maxval=1.0)

        values = strategy.experimental_distribute_values_from_function(
            lambda ctx, counts=counts: [make(i, c, ctx.replica_id_in_sync_group)
                                        for i, c in enumerate(counts)])

        def reduce_fn(v):
            if kind == MWMS_KIND:  # its one-device all_reduce needs device-placed values
                with tf.device(strategy.extended.worker_devices[0]):
                    v = [tf.identity(x) for x in v]
            return tf.distribute.get_replica_context().all_reduce("SUM", v)

        runs, trace_times = [], []
        for variant, info in zip(variants, infos):
            if kind != MWMS_KIND:  # (read when this variant's functions are traced, below)
                strategy.cross_device_ops.compression = variant["compression"]

            @tf.function
            def full(vals):
                return strategy.run(reduce_fn, args=(vals,))

            @tf.function
            def step(vals):
                return strategy.run(lambda v: tf.add_n([o[0] for o in reduce_fn(v)]),
                                    args=(vals,))

            def run_once(step=step):
                return float(strategy.experimental_local_results(step(values))[0])

            out = full(values)  # traces; the result is checked once against the float32 sum
            tol = _common.CHECK_TOLERANCE[variant["compression"]] * replicas
            for i, c in enumerate(counts):
                got = strategy.experimental_local_results(out[i])[0].numpy()
                want = np.sum([make(i, c, r).numpy() for r in range(replicas)], axis=0)
                err = float(np.max(np.abs(got - want)))
                if not err <= tol:
                    raise TfdpError(f"Wrong all-reduce result. Received: {kind} {info} on "
                                    f"{nbytes} bytes, tensor {i}: max error {err:.3g} (allowed "
                                    f"{tol:.3g}). This is a bug: please report it.")
            del out, got, want
            t0 = time.perf_counter()
            run_once()  # traces
            trace_times.append(time.perf_counter() - t0)
            run_once()
            runs.append(run_once)
        n = _iters(nbytes)
        samples = [[] for _ in variants]
        for r in range(spec["repeats"]):  # the variants alternate, sample after sample
            for k in _common.round_order(len(variants), r):
                t0 = time.perf_counter()
                for _ in range(n):
                    runs[k]()
                samples[k].append((time.perf_counter() - t0) / n)
        for k, variant in enumerate(variants):
            results[k].append({"bytes": sum(counts) * 4, "tensors": len(counts),
                               "times_s": samples[k], "iters_per_sample": n,
                               "trace_s": trace_times[k]})
            say(f"{variant['name']}: {_common.fmt_bytes(nbytes)} "
                f"{statistics.median(samples[k]) * 1e3:.3f} ms")
    if rank == 0:
        for variant, info, rows in zip(variants, infos, results):
            print(RESULT_MARK + json.dumps({
                "name": variant["name"], "kind": kind, "replicas": replicas,
                "local_devices": len(strategy.extended.worker_devices), "info": info,
                "results": rows, "environment": _common.environment()}), flush=True)
    # TF's multi-worker teardown at interpreter exit adds seconds to every job: skip it, but
    # only once every worker has its last result (a collective's receiver pulls from the
    # sender, so a worker that exits at once can still be needed). The barrier is a file per
    # worker in the parent's directory (all workers are local); without it, exit normally.
    sys.stdout.flush()
    sys.stderr.flush()
    done_dir = spec.get("done_dir")
    if done_dir and os.path.isdir(done_dir):
        open(os.path.join(done_dir, f"done-{rank}"), "w").close()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(os.path.exists(os.path.join(done_dir, f"done-{i}"))
                   for i in range(spec["workers"])):
                os._exit(0)
            time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(_child(json.loads(sys.argv[1])))

"""Measurements around a ``tfdp train`` run: the all-reduce estimate and the 1-replica baseline.

* :func:`estimate_allreduce` times the strategy's all-reduce of tensors shaped like the model's
  dense gradients, alone, in a separate micro-benchmark. It is an ESTIMATE of the all-reduce share
  of a step, not a measurement inside training: there it overlaps with other work, runs on
  different data and may contend differently for the cores, and the figure includes the fixed
  cost of launching one ``strategy.run`` (which small models feel most). Embedding tables are left
  out (their gradients are IndexedSlices, all-gathered, sized by the batch not the table).
* :func:`local_baseline` trains a fresh copy of the model on one device of this process (no
  strategy, no communication) with the per-replica batch for a few steps: the reference for the
  scaling efficiency and, across workers, each worker's own compute speed (straggler report).
"""

from __future__ import annotations

import math
import time

import numpy as np
import tensorflow as tf

from tfdp.callbacks import Throughput


def estimate_allreduce(strategy, model, exclude_ids=(), repeats: int = 5) -> dict | None:
    """Median wall time (ms) of one all-reduce of the model's dense gradient shapes.

    Returns ``{"ms", "tensors", "floats", "excluded"}`` or None when there is nothing to reduce
    (a single replica in a single worker, or no dense variables).
    """
    if strategy.num_replicas_in_sync < 2:
        return None
    dense = [v for v in model.trainable_variables if id(v) not in exclude_ids]
    excluded = len(model.trainable_variables) - len(dense)
    if not dense:
        return None
    specs = [(tuple(int(s) for s in v.shape), str(v.dtype)) for v in dense]

    def value_fn(_ctx):
        return [tf.ones(shape, dtype) for shape, dtype in specs]

    values = strategy.experimental_distribute_values_from_function(value_fn)

    @tf.function
    def step(vals):
        def fn(*grads):
            out = tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, list(grads))
            return tf.add_n([tf.cast(tf.reshape(o, [-1])[0], tf.float32) for o in out])
        return strategy.run(fn, args=tuple(vals))

    def once():
        t0 = time.perf_counter()
        out = step(values)
        float(strategy.experimental_local_results(out)[0])  # wait for the result
        return time.perf_counter() - t0

    once()  # trace + warm up
    times = [once() for _ in range(max(1, repeats))]
    floats = sum(math.prod(s) for s, _ in specs)
    return {"ms": float(np.median(times) * 1e3), "tensors": len(specs), "floats": floats,
            "excluded": excluded}


def local_baseline(build_fn, data, batch_size: int, steps: int) -> dict:
    """Train a fresh model (``build_fn() -> compiled model``) on one local device for ``steps``
    steps of ``batch_size``; returns the :class:`~tfdp.callbacks.Throughput` summary."""
    model = build_fn()
    meter = Throughput(batch_size, 1, skip_steps=1, stragglers=False)
    model.fit(data.local(batch_size), steps_per_epoch=steps + 1, epochs=1, verbose=0,
              shuffle=False, callbacks=[meter])
    return meter.summary()

"""Measurements around a ``tfdp train`` run: the all-reduce estimate, the 1-replica baseline and
each worker's compute probe. What they cost is part of the run, so the default ones are kept
small: the bert config on 2 workers spent 26.1 s of a 90.9 s run in them (29%: a fresh model's
1-replica Keras fit, 21-23 s of it, and an all-reduce trace, 3.1 s), now 1.7 s of 46.6 s
(docs/benchmarks/monitoring.txt).

* :func:`estimate_allreduce` times the strategy's all-reduce of tensors shaped like the model's
  dense gradients, alone, in a separate micro-benchmark: one ``batch_reduce_to`` from the
  cross-replica context (the reduction tfdp's gradient path runs in a training step, without a
  ``strategy.run`` around it, whose trace cost more than the reduction's). It is an ESTIMATE of
  the all-reduce share of a step, not a measurement inside training: there it overlaps with
  other work, runs on different data and may contend differently for the cores. Embedding
  tables are left out (their gradients are IndexedSlices, all-gathered, sized by the batch not
  the table).
* :func:`local_baseline` trains a fresh copy of the model on one device of this process (no
  strategy, no communication) with the per-replica batch for a few steps: the reference for the
  scaling efficiency. Its trace is a whole Keras train step (XLA included: 8-12 s for the bert
  config), so it runs only when asked for (``[monitor] scaling_baseline``, ``--baseline``).
* :func:`local_compute` is each worker's compute for the straggler report, estimated from the
  forward pass of the trained model on the per-replica batch, on one local device, no
  communication (no model to rebuild; its trace took 0.5 s for the bert config).
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

    @tf.function(autograph=False)
    def reduce_all(vals):
        out = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM,
                                                [(v, v) for v in vals])
        firsts = [strategy.experimental_local_results(o)[0] for o in out]
        return tf.add_n([tf.cast(tf.reshape(f, [-1])[0], tf.float32) for f in firsts])

    def once():
        t0 = time.perf_counter()
        float(reduce_all(list(values)))  # wait for the result
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


def local_compute(model, data, batch_size: int, steps: int = 5) -> dict:
    """This worker's compute per step, estimated cheaply: 3 x the median time of the forward
    pass of the trained ``model`` on one local batch of ``batch_size``, on one local device (the
    variables' copies there), inference mode (no layer state changes), no communication. The
    backward pass costs about twice the forward (the usual 1 + 2 rule); a forward-only probe
    traces in a fraction of the time of a forward + backward one (bert config: 0.5 s vs
    1.3-1.8 s, one process). Returns ``{"step_time_ms_p50", "forward_ms_p50", "steps",
    "what"}``."""
    import keras

    batches = iter(data.local(batch_size))

    @tf.function(autograph=False)
    def forward(batch):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(batch)
        out = model(x, training=False)
        return tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in tf.nest.flatten(out)])

    float(forward(next(batches)))  # trace + warm up
    times = []
    for _ in range(max(1, steps)):
        batch = next(batches)
        t0 = time.perf_counter()
        float(forward(batch))
        times.append(time.perf_counter() - t0)
    ms = float(np.median(times) * 1e3)
    return {"step_time_ms_p50": 3.0 * ms, "forward_ms_p50": ms, "steps": len(times),
            "what": "3 x the forward pass, one local device, no communication"}

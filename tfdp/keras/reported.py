"""What a step reports: one device's metric values after every batch, not only at the epoch's end.

Keras's train and test steps return ``model.get_metrics_result()`` from each replica, and its
trainer averages the replicas' values (``reduce_per_replica(..., "auto")``: the mean). A metric's
state is a sum over the replicas (its variables are sync-on-read, summed), so the mean of the
replicas' results is the one-device result only when every replica's state is the same size:
after an uneven split (a last partial batch, a global batch the replica count does not divide)
the running loss a replica reports is a ratio over its own examples, and the mean of ratios is
not the ratio of the sums (0.07 to 0.67 off in a 23-example epoch of batch 7 on 4 replicas); a
ratio such as precision differs even on even splits, and across workers every worker averaged
only its own replicas. Keras reads the summed state at the end of ``fit``/``evaluate``, so only
the values callbacks and the progress bar see after each batch (and ``train_on_batch`` /
``test_on_batch`` where Keras 3.12 keeps the state across calls) were affected.

Under a tfdp step of several replicas, ``get_metrics_result`` reads every metric variable summed
over all replicas of the job (one all-reduce of the metrics' state; Keras's own
``keras.StatelessScope`` maps each variable to its total while Keras's code computes the
results), so every replica returns the one-device values and their mean is that value. Inside a
replica's XLA-compiled step (no collective there) the local values are returned, and tfdp's
per-replica XLA step reads them again after the compiled part (``gradient_path``).
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.keras.step import current

_REDUCE = {"sum": tf.distribute.ReduceOp.SUM, "mean": tf.distribute.ReduceOp.MEAN}


def global_metric_state(model, step, replica):
    """[(variable, value summed over every replica of the job)] for ``model``'s metrics, in a
    replica context (variables whose aggregation is neither sum nor mean keep the local value).
    A replica the strategy padded (it had no example) gives its state from before the step:
    the update its stand-in example made is undone after the step."""
    seen, variables = set(), []
    for metric in model.metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                variables.append(v)
    extended = tf.distribute.get_replica_context().strategy.extended
    mapping = []
    groups: dict = {}  # (reduce op, dtype) -> [variable]: one all-reduce each
    for v in variables:  # (a variable left out of the mapping reads its local value)
        op = _REDUCE.get(str(getattr(v, "aggregation", "sum")))
        if op is not None:
            groups.setdefault((op, v.dtype), []).append(v)

    def local(v):
        value = tf.stop_gradient(tf.convert_to_tensor(v))
        before = step.on_read_before.get(id(getattr(v, "value", v))) if step.padded else None
        if before is None:
            return value
        return tf.where(step.live[replica], value, tf.cast(before[replica], value.dtype))

    step.whole_state = True  # (the strategy masks padded replicas out of a step's sums)
    try:
        for (op, _), vs in groups.items():
            mapping.extend(zip(vs, extended.all_reduce_values(op, [local(v) for v in vs])))
    finally:
        step.whole_state = False
    return mapping


def _get_metrics_result(original):
    def get_metrics_result(self):
        cur = current()
        if cur is None:
            return original(self)
        _, step, replica = cur
        if replica in step.deferred or tf.distribute.get_replica_context().num_replicas_in_sync < 2:
            return original(self)
        import keras
        mapping = global_metric_state(self, step, replica)
        if not mapping:
            return original(self)
        with keras.StatelessScope(state_mapping=mapping):
            return original(self)
    return get_metrics_result


HOOKS = {"get_metrics_result": _get_metrics_result}

__all__ = ["HOOKS", "global_metric_state"]

"""``tf.distribute.InputContext`` checks: which workers and replicas an input pipeline feeds.

An input context says how many workers read input (``num_input_pipelines``), which one this is
(``input_pipeline_id``, the worker's rank) and how many replicas train in sync in total
(``num_replicas_in_sync``). Workers are homogeneous: each feeds
``num_replicas_in_sync // num_input_pipelines`` local replicas, and worker ``w``'s local replica
``j`` is global replica ``w * local + j``.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.errors import TfdpError, invalid_argument


def check_input_context(input_context, name: str = "input_context") -> tf.distribute.InputContext:
    """Return ``input_context`` if it is a usable ``tf.distribute.InputContext``, else raise."""
    if not isinstance(input_context, tf.distribute.InputContext):
        raise invalid_argument(
            name, input_context,
            fix="Pass a tf.distribute.InputContext (the argument a "
                "strategy.distribute_datasets_from_function function receives), e.g. "
                "tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=0, "
                "num_replicas_in_sync=4).")
    workers = input_context.num_input_pipelines
    rank = input_context.input_pipeline_id
    replicas = input_context.num_replicas_in_sync
    if workers < 1 or not 0 <= rank < workers or replicas < 1 or replicas % workers:
        raise TfdpError(
            f"Invalid {name}. Received: num_input_pipelines={workers}, "
            f"input_pipeline_id={rank}, num_replicas_in_sync={replicas}. Valid: "
            "num_input_pipelines >= 1, 0 <= input_pipeline_id < num_input_pipelines, and "
            "num_replicas_in_sync a positive multiple of num_input_pipelines (every worker "
            "feeds the same number of replicas).")
    return input_context


def local_replicas(input_context) -> tuple[int, int]:
    """``(first, count)``: this worker's replicas are global replicas ``first .. first+count-1``."""
    ctx = check_input_context(input_context)
    count = ctx.num_replicas_in_sync // ctx.num_input_pipelines
    return ctx.input_pipeline_id * count, count


def single_worker_context(num_replicas: int = 1) -> tf.distribute.InputContext:
    """The input context of one worker feeding ``num_replicas`` local replicas."""
    return tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                      num_replicas_in_sync=num_replicas)

"""Which worker this process is: ``worker_role(strategy)`` for any ``tf.distribute`` strategy.

tfdp's strategies answer from their resolved cluster (``strategy.cluster``); TF's own strategies
from their cluster resolver and ``extended.should_checkpoint``; the default strategy is worker 0
of 1. Callbacks, the trainer and benchmarks ask here instead of each reading the strategy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerRole:
    index: int      # this worker's rank, 0 .. count - 1
    count: int      # worker processes in the job
    is_chief: bool  # the worker that writes shared files (checkpoints, backups, logs)


def worker_role(strategy) -> WorkerRole:
    """This process's place in ``strategy``'s job (``WorkerRole(0, 1, True)`` when alone)."""
    cluster = getattr(strategy, "cluster", None)
    if cluster is not None and hasattr(cluster, "num_workers"):
        return WorkerRole(int(cluster.rank), int(cluster.num_workers), bool(cluster.is_chief))
    try:
        local = len(strategy.extended.worker_devices)
        count = max(1, strategy.num_replicas_in_sync // max(1, local))
    except (RuntimeError, AttributeError):   # the default strategy has no worker devices
        count = 1
    resolver = getattr(strategy, "cluster_resolver", None)
    index = int(getattr(resolver, "task_id", 0) or 0) if count > 1 else 0
    extended = getattr(strategy, "extended", None)
    chief = bool(getattr(extended, "should_checkpoint", True)) if count > 1 else True
    return WorkerRole(index, count, chief)


__all__ = ["WorkerRole", "worker_role"]

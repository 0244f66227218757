"""Keras callbacks for data-parallel training.

* :class:`Throughput`: examples/s (global and per replica), p50/p90/p99 step time, TensorBoard
  scalars, and (several workers) a straggler report naming the slowest worker.
* :class:`BackupAndRestore`: multi-worker-aware backups that resume at the exact step, also as a
  drop-in ``model.fit(data, callbacks=[backup])`` (fit's input is put back at that step); its
  position API (``position``, ``restore_point``, ``save_now``) is a :class:`Position`.
* :class:`NaNGuard`: roll back to the last good backup on a NaN/Inf loss, lower the LR, stop
  after K rollbacks.
* :class:`PreemptionCheckpoint`: SIGTERM to any worker -> all back up at the next step, exit 75.
* :func:`straggler_report`, :func:`gather_per_worker`: per-worker figures through the strategy
  (a no-op with one worker).
* Keras's own ``BackupAndRestore`` / ``ModelCheckpoint`` / ``CSVLogger`` across workers: only the
  chief writes shared files (:mod:`tfdp.callbacks.shared_files`, in Keras while a multi-worker
  tfdp strategy lives).
"""

from tfdp.callbacks.backup import BackupAndRestore, BackupError, Position
from tfdp.callbacks.guard import DivergenceError, NaNGuard
from tfdp.callbacks.preemption import EX_TEMPFAIL, Preempted, PreemptionCheckpoint
from tfdp.callbacks.throughput import (StragglerReport, Throughput, gather_per_worker,
                                       num_workers, percentiles_ms, straggler_report,
                                       worker_rank)

__all__ = ["BackupAndRestore", "BackupError", "DivergenceError", "EX_TEMPFAIL", "NaNGuard",
           "Position", "Preempted", "PreemptionCheckpoint", "StragglerReport", "Throughput",
           "gather_per_worker", "num_workers", "percentiles_ms", "straggler_report",
           "worker_rank"]

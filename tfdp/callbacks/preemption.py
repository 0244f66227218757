"""Preemption: on SIGTERM, back up every worker at the next step and exit with a known code.

``PreemptionCheckpoint(backup, exit_code=75)`` works with a :class:`BackupAndRestore`:

* At ``on_train_begin`` it installs a SIGTERM handler (main thread only; elsewhere it logs a
  warning and only :meth:`request` can trigger it) that just sets a flag. The previous handler
  is put back when training ends, or just before the process exits.
* At every ``on_train_batch_end`` (or every ``check_every`` steps) the workers agree on the
  flag: with one worker it is read; with several, one compiled all-reduce of a scalar over the
  strategy's replicas (a ``tf.function``, built on first use) sums the flags, so a SIGTERM to a
  single worker stops them all at the same step.
* When set, the backup is saved for the current step (only the chief writes, as always), the
  workers pass one more all-gather (a barrier: nobody exits before the chief's write is done),
  ``model.stop_training`` is set and :class:`Preempted` is raised. ``Preempted`` is a
  ``SystemExit`` whose code is ``exit_code``: uncaught, the interpreter exits with that code
  (no traceback; ``finally`` blocks and atexit handlers run; the backup is *not* deleted).

The exit code defaults to **75** (``EX_TEMPFAIL`` from ``sysexits.h``: "a temporary failure,
try again later"). ``tfdp launch`` returns the failed worker's code (1..125), so the job exits
75 too, and ``tfdp launch --max-restarts R`` (or re-running the script) resumes from the backup
at the exact step.

Place it *after* its backup in ``callbacks`` (the backup must count the step first);
``backup.fit(..., callbacks=[preempt])`` and :meth:`PreemptionCheckpoint.fit` do that. Prefer
:meth:`fit`: it keeps the handler installed between the per-epoch ``model.fit`` calls too.

Timing: the check happens at step ends, so the process stops after the step in flight plus one
backup write. ``tfdp launch`` forwards a SIGTERM it receives to all workers and kills them
after its grace period, so one step plus one backup must fit in it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import keras
import tensorflow as tf

from tfdp.callbacks.backup import BackupAndRestore
from tfdp.callbacks.throughput import num_workers
from tfdp.errors import invalid_argument

log = logging.getLogger("tfdp")

EX_TEMPFAIL = 75


class Preempted(SystemExit):
    """Raised after the preemption backup: a ``SystemExit`` with ``code == exit_code``."""

    def __init__(self, code: int, global_step: int):
        super().__init__(code)
        self.global_step = global_step

    def __str__(self):
        return (f"tfdp: preempted (SIGTERM); backed up at global step {self.global_step}, "
                f"exiting with code {self.code}")


def _make_any(strategy):
    """A tf.function: the SUM over all replicas of each replica's ``flag`` (one all-reduce of a
    scalar; > 0 when any worker's flag is set)."""

    @tf.function
    def any_flag(flag):
        def replica_fn():
            return tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, tf.identity(flag))
        return strategy.experimental_local_results(strategy.run(replica_fn))[0]
    return any_flag


class PreemptionCheckpoint(keras.callbacks.Callback):
    """On SIGTERM: back up all workers at the next step end, then exit with ``exit_code``.

    Args:
      backup: the :class:`tfdp.callbacks.BackupAndRestore` to save through.
      exit_code: the process exit code after a preemption backup (default 75, EX_TEMPFAIL).
      check_every: agree on the flag every that many steps (1: every step; with several
        workers each check is one scalar all-reduce).

    Attributes: ``requested`` (the local flag), ``preempted_at`` (global step of the
    preemption backup, or None), ``checks``, ``first_check_seconds`` and ``check_seconds`` (number of
    cross-worker checks, time of the first one, which sets up the collective, and total time of
    the others: their per-step cost).
    """

    def __init__(self, backup, exit_code: int = EX_TEMPFAIL, check_every: int = 1):
        super().__init__()
        if not isinstance(backup, BackupAndRestore):
            raise invalid_argument("backup", backup,
                                   fix="Pass a tfdp.callbacks.BackupAndRestore.")
        if isinstance(exit_code, bool) or not isinstance(exit_code, int) \
                or not 1 <= exit_code <= 125:
            raise invalid_argument("exit_code", exit_code,
                                   fix="Pass an int in 1..125 (the launcher passes those on).")
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise invalid_argument("check_every", check_every, fix="Pass a positive int.")
        self.backup = backup
        self.exit_code = exit_code
        self.check_every = check_every
        self.requested = False
        self.preempted_at = None
        self.checks = 0
        self.check_seconds = 0.0   # all but the first check
        self.first_check_seconds = 0.0
        self._previous = None      # the handler replaced by ours (None: not installed)
        self._installed = False
        self._held = 0             # > 0 while fit() keeps the handler across model.fit calls
        self._steps = 0
        self._any_fn = None        # the compiled cross-worker "any" (built on first use)
        self._any_strategy = None

    # --- signal handler ------------------------------------------------------------------

    def request(self, *_):
        """Ask for a preemption backup at the next check (the SIGTERM handler calls this)."""
        self.requested = True

    def _install(self):
        if self._installed:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("tfdp PreemptionCheckpoint: not in the main thread; no SIGTERM handler "
                        "installed (call request() to preempt)")
            return
        self._previous = signal.signal(signal.SIGTERM, self.request)
        self._installed = True

    def _uninstall(self):
        if not self._installed:
            return
        signal.signal(signal.SIGTERM,
                      signal.SIG_DFL if self._previous is None else self._previous)
        self._installed, self._previous = False, None

    # --- agreement ------------------------------------------------------------------------

    def _strategy(self):
        return getattr(self.model, "distribute_strategy", None)

    def _agree(self, flag: bool) -> bool:
        """True when any worker's flag is set (every worker must call this at the same step)."""
        strategy = self._strategy()
        if strategy is None or num_workers(strategy) == 1:
            return flag
        t0 = time.perf_counter()
        if self._any_fn is None or self._any_strategy is not strategy:
            self._any_fn, self._any_strategy = _make_any(strategy), strategy
        agreed = bool(self._any_fn(tf.constant(1.0 if flag else 0.0)).numpy() > 0)
        dt = time.perf_counter() - t0
        if self.checks == 0:
            self.first_check_seconds = dt  # includes the collective's one-off set-up
        else:
            self.check_seconds += dt
        self.checks += 1
        return agreed

    # --- Keras hooks ----------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        self._install()

    def on_train_end(self, logs=None):
        if not self._held:
            self._uninstall()

    def on_train_batch_end(self, batch, logs=None):
        self._steps += 1
        if self._steps % self.check_every:
            return
        if not self._agree(self.requested):
            return
        b = self.backup
        # (the epoch's last step is backed up as the start of the next epoch; a step backed up
        # already is not written twice)
        b.save_now("PreemptionCheckpoint (SIGTERM)", batch=batch, logs=logs)
        self._agree(True)  # barrier: the chief's write is done before anyone exits
        self.preempted_at = b.position.global_step
        self.requested = False     # caught in-process, a new fit starts afresh
        self.model.stop_training = True
        self._held = 0
        self._uninstall()
        err = Preempted(self.exit_code, self.preempted_at)
        log.warning("%s", err)
        raise err

    # --- helper ---------------------------------------------------------------------------

    def fit(self, model, make_dataset, epochs: int, steps_per_epoch: int, callbacks=(),
            **fit_kwargs) -> dict:
        """``self.backup.fit(...)`` with this callback last (after ``callbacks``), the SIGTERM
        handler installed for the whole run (also between epochs). Raises :class:`Preempted`
        on preemption."""
        self.set_model(model)
        self._install()
        self._held += 1
        try:
            return self.backup.fit(model, make_dataset, epochs, steps_per_epoch,
                                   callbacks=[*callbacks, self], **fit_kwargs)
        finally:
            self._held = max(0, self._held - 1)
            if not self._held:
                self._uninstall()


__all__ = ["EX_TEMPFAIL", "Preempted", "PreemptionCheckpoint"]

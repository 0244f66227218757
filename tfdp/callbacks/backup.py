"""Exact, multi-worker-aware backup and restore for Keras ``fit``.

``BackupAndRestore(backup_dir, save_freq="epoch" | n)`` is a drop-in for Keras's callback with
three differences:

* **Exact resume.** It records the data position (epoch, step in that epoch, global step) with
  the model's and the optimizer's variables (slots, ``iterations``, the learning rate) and the
  running metrics of the epoch, so a restarted job continues at the exact step. Keras 3's
  callback replays the interrupted epoch. Passed to ``model.fit(data, epochs=E, callbacks=
  [backup])`` as it is, it also puts fit's input back where the interrupted run stood
  (:mod:`tfdp.callbacks.input_position`: the iterators and batches that run had consumed are
  replayed; exact for arrays with a global seed, any deterministic ``tf.data`` pipeline, seeded
  shuffles included; what cannot be replayed exactly is named in one warning at restore time).
  :meth:`BackupAndRestore.fit` positions the data itself instead (a partial first epoch from
  ``make_dataset(epoch, start_step)``, then whole epochs); or read ``backup.initial_epoch`` /
  ``backup.start_step`` and pass them to your own pipeline.
* **Multi-worker aware.** Only the chief (rank 0, or the only worker) writes ``backup_dir``;
  every worker restores from it (a shared file system, as with Keras). Writes are atomic: the
  state goes to a private temporary file that is ``os.replace``-d into place, then a JSON
  sidecar naming it is replaced the same way, so a crash leaves the previous backup intact and
  concurrent writers never interleave (leftover ``.tmp-*`` files are ignored).
* **Safe and checked.** The state is a NumPy ``.npz`` loaded with ``allow_pickle=False`` (no code
  runs on load). The sidecar holds a fingerprint of the model's and optimizer's variables
  (shapes, dtypes, kinds), so another model's backup, a corrupt sidecar or a directory that is
  not a tfdp backup is a clear error, never a silent fresh start or a clobber. A state with
  NaN/Inf values is never written, so the backup always holds the last good state (see
  :class:`tfdp.callbacks.NaNGuard`).

The on-disk format (sidecar, state files, atomic writes) is ``tfdp.callbacks.backup_files``;
resuming (fit's input put back at restore, the ``fit`` helper) is
``tfdp.callbacks.backup_resume``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import numpy as np

import keras

from tfdp._version import __version__
from tfdp.callbacks import backup_resume, input_position
from tfdp.compat import names
from tfdp.callbacks.backup_files import (  # noqa: F401  (BackupError etc.: public here too)
    _STATE_RE, _TMP_PREFIX, FORMAT, FORMAT_VERSION, SIDECAR, BackupError, _atomic_write,
    _variables, check_backup_dir, fingerprint, read_sidecar)
from tfdp.errors import TfdpError, invalid_argument
from tfdp.strategy.role import worker_role

log = logging.getLogger("tfdp")

def _check_save_freq(save_freq):
    if save_freq == "epoch":
        return save_freq
    if isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1:
        raise invalid_argument("save_freq", save_freq,
                               fix='Pass "epoch" or a positive int (a number of training steps).')
    return save_freq


def _is_chief(strategy) -> bool:
    """True for the worker that writes (``tfdp.strategy.worker_role``)."""
    return worker_role(strategy).is_chief


@dataclasses.dataclass(frozen=True)
class Position:
    """A training position: the epoch, training steps done in it, and steps done in all epochs
    (across restarts)."""

    epoch: int
    step_in_epoch: int
    global_step: int


class BackupAndRestore(keras.callbacks.Callback):
    """Back up model + optimizer + data position; resume at the exact step (multi-worker aware).

    Args:
      backup_dir: the directory of the backup (created; only the chief writes it).
      save_freq: ``"epoch"`` (at every epoch end) or an int: every that many training steps
        (global steps, counted across epochs and restarts).
      delete_checkpoint: delete the backup when training finishes successfully (as Keras). A
        failed run (an exception, :class:`NaNGuard` giving up) never deletes it.
      position_input: in ``model.fit(data, callbacks=[backup])``, put fit's input back at the
        backed-up step on restore (default). False: leave the input alone (your pipeline
        starts at ``backup.initial_epoch`` / ``backup.start_step`` itself).

    Use in ``model.fit(data, epochs=E, callbacks=[backup])`` restores the model, the optimizer
    and the epoch's running metrics at ``on_train_begin``, skips to ``backup.initial_epoch`` and
    puts fit's input at ``backup.start_step`` of that epoch (the resumed epoch runs only its
    remaining steps; Keras's batch indices in it start at 0). :meth:`fit` with a dataset factory
    is the other way (the factory positions the data).

    Position API (what :class:`NaNGuard` and :class:`PreemptionCheckpoint` use):
    ``position`` (where training stands, or will resume), ``restore_point`` (the backup on
    disk), ``save_now(reason)``, ``restore()``, ``failed``. Also ``initial_epoch``,
    ``start_step`` (training steps already done in that epoch), ``global_step``.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint: bool = True,
                 position_input: bool = True):
        super().__init__()
        names.require("resume", by="tfdp.callbacks.BackupAndRestore")
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise invalid_argument("backup_dir", backup_dir, fix="Pass a directory path.")
        self.backup_dir = os.fspath(backup_dir)
        check_backup_dir(self.backup_dir)
        self.save_freq = _check_save_freq(save_freq)
        self.delete_checkpoint = bool(delete_checkpoint)
        self.position_input = bool(position_input)
        self.failed = False          # set by NaNGuard (or you): the backup is never deleted
        self.saves_written = 0       # files written by this process (0 on non-chief workers)
        self.restored = False        # this process loaded a backup into the model
        self._meta = None            # the sidecar last read or written
        self._epoch = 0              # current epoch
        self._offset = 0             # steps of the current epoch done before this fit call
        self._step_in_epoch = 0
        self._global_step = 0
        self._last_saved_step = -1
        self._batch_seen = -1
        self._synced = False         # model state and counters are this callback's (no restore)
        self._in_helper = False
        self._steps_per_epoch = None
        self._input = None           # fit's input position (input_position.InputTracker)
        self._resume_metrics = None  # metric values to put back at the resumed epoch's start
        self._saved_metrics = []     # the metric values of the backup last restored
        self._next_read = None       # the input position of the backup being written
        input_position.install(self)  # fit's epoch iterators tracked while this callback lives

    # --- position -------------------------------------------------------------------------

    @property
    def position(self) -> Position:
        """Where training stands: after the last step counted (during ``fit``), else where a
        restarted run resumes (the backup on disk; epoch 0, step 0 without one)."""
        return Position(*self._position())

    @property
    def restore_point(self) -> Position | None:
        """The position of the backup in ``backup_dir`` (what :meth:`restore` loads), or None."""
        meta = read_sidecar(self.backup_dir)
        if meta is None:
            return None
        return Position(meta["epoch"], meta["step_in_epoch"], meta["global_step"])

    def save_now(self, reason: str, batch: int | None = None, logs=None) -> bool:
        """Back up the current position now, unless a backup of this step exists already.

        Args:
          reason: who asks (named in the log line and in errors), e.g. ``"PreemptionCheckpoint"``.
          batch: the Keras batch index of the step that just ended, when called from another
            callback's ``on_train_batch_end``: checks that this backup counted that step (it
            must come first in ``callbacks``).
          logs: the step's logs (a non-finite loss is never backed up).

        Every worker must call it at the same step (only the chief writes). Returns whether
        this process wrote a backup.
        """
        if batch is not None and self._batch_seen != batch:
            raise TfdpError(
                f"{reason} runs before its BackupAndRestore. Received: callbacks in that order "
                f"(the backup has not counted batch {batch} yet). Place the backup first "
                "(backup.fit(..., callbacks=[...]) does).")
        if self._last_saved_step == self._global_step:
            return False
        log.info("tfdp BackupAndRestore: backup at global step %d (%s)", self._global_step,
                 reason)
        return self._save_step(logs)

    def _position(self):
        if not self._synced and self._meta is None:
            self._meta = read_sidecar(self.backup_dir)
        if self._synced or self._meta is None:
            return self._epoch, self._step_in_epoch, self._global_step
        return self._meta["epoch"], self._meta["step_in_epoch"], self._meta["global_step"]

    @property
    def initial_epoch(self) -> int:
        """The epoch to resume in (0 with no backup)."""
        return self._position()[0]

    @property
    def start_step(self) -> int:
        """Training steps of ``initial_epoch`` already done (skip them in the data)."""
        return self._position()[1]

    @property
    def global_step(self) -> int:
        """Training steps done in all epochs, across restarts."""
        return self._position()[2]

    def has_backup(self) -> bool:
        return read_sidecar(self.backup_dir) is not None

    # --- save / restore -------------------------------------------------------------------

    def _strategy(self):
        return getattr(self.model, "distribute_strategy", None)

    def _check_optimizer(self):
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and not opt.built:
            strategy = self._strategy()
            if strategy is not None:
                with strategy.scope():
                    opt.build(self.model.trainable_variables)
            else:
                opt.build(self.model.trainable_variables)

    def save(self, logs=None) -> bool:
        """Back up now (the chief writes; other workers only keep counters). Returns written."""
        loss = (logs or {}).get("loss")
        if loss is not None and not np.all(np.isfinite(np.asarray(loss, dtype=np.float64))):
            log.warning("tfdp BackupAndRestore: loss is %s at global step %d; backup skipped "
                        "(the last good one is kept)", loss, self._global_step)
            return False
        self._last_saved_step = self._global_step
        # Metric variables are summed over replicas when read (across workers: a collective),
        # so every worker reads them, in the same order, before only the chief goes on.
        metric_arrays = [np.asarray(v) for v in self._metric_variables()]
        next_read, self._next_read = self._next_read_now(), None
        if next_read is not None:  # which fit it belongs to: a fit of as many epochs
            next_read = dict(next_read, epochs=(self.params or {}).get("epochs"),
                             steps=(self.params or {}).get("steps"))
        if not _is_chief(self._strategy()):
            return False
        model_vars, opt_vars = _variables(self.model)
        arrays = [np.asarray(v) for v in model_vars + opt_vars]
        if not all(np.all(np.isfinite(a)) for a in arrays
                   if np.issubdtype(a.dtype, np.floating)):
            log.warning("tfdp BackupAndRestore: NaN/Inf in the variables at global step %d; "
                        "backup skipped (the last good one is kept)", self._global_step)
            return False
        previous = read_sidecar(self.backup_dir)  # before creating anything
        fp = fingerprint(self.model)
        if previous is not None and previous["fingerprint"] != fp:
            raise self._foreign_error(previous, fp)
        state = f"state-{self._global_step}.npz"
        payload = {f"v{i:05d}": a for i, a in enumerate(arrays)}
        payload.update({f"m{i:05d}": a for i, a in enumerate(metric_arrays)})
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "tfdp_version": __version__,
                "epoch": self._epoch, "step_in_epoch": self._step_in_epoch,
                "global_step": self._global_step, "fingerprint": fp, "state": state,
                "num_model_variables": len(model_vars),
                "num_optimizer_variables": len(opt_vars),
                "num_metric_variables": len(metric_arrays),
                "replicas": backup_resume.replicas(self.model),
                "input": next_read}
        try:
            os.makedirs(self.backup_dir, exist_ok=True)
            _atomic_write(os.path.join(self.backup_dir, state),
                          lambda f: np.savez(f, **payload))
            _atomic_write(os.path.join(self.backup_dir, SIDECAR),
                          lambda f: f.write(json.dumps(meta, indent=1).encode()))
        except OSError as e:
            raise BackupError(
                f"Cannot write the backup ({type(e).__name__}: {e.strerror or e}). Received: "
                f"backup_dir={self.backup_dir!r}. Check that it is writable by this user and "
                "that the disk has space, or pass another directory; the previous backup (if "
                "any) is intact.") from None
        self._meta = meta
        self.saves_written += 1
        for name in os.listdir(self.backup_dir):  # older states (never the one just named)
            if _STATE_RE.match(name) and name != state:
                try:
                    os.unlink(os.path.join(self.backup_dir, name))
                except OSError:
                    pass
        return True

    def _metric_variables(self):
        return list(getattr(self.model, "metrics_variables", None) or [])

    def _next_read_now(self):
        """fit's input position for the backup being written (None: not tracked)."""
        if self._input is None or self._in_helper:
            return None
        if self._next_read is not None:
            return self._next_read
        return self._input.next_read(epoch_done=False)

    def _save_step(self, logs=None) -> bool:
        """Back up after a training step; the epoch's last step is backed up as the start of
        the next epoch."""
        fit_steps = (self.params or {}).get("steps")
        if ((self._steps_per_epoch and self._step_in_epoch >= self._steps_per_epoch)
                or (not self._in_helper and fit_steps and self._step_in_epoch >= fit_steps)):
            epoch, step = self._epoch, self._step_in_epoch  # the epoch's last step: next epoch
            self._epoch, self._step_in_epoch = epoch + 1, 0
            if self._input is not None:
                self._next_read = self._input.next_read(epoch_done=True)
            try:
                return self.save(logs)
            finally:
                self._epoch, self._step_in_epoch = epoch, step
                self._next_read = None
        return self.save(logs)

    def _foreign_error(self, meta, fp):
        return BackupError(
            f"The backup in {self.backup_dir!r} belongs to another model or optimizer. Received: "
            f"fingerprint {meta['fingerprint']} ({meta.get('num_model_variables')} model + "
            f"{meta.get('num_optimizer_variables')} optimizer variables, tfdp "
            f"{meta.get('tfdp_version')}) but this model has {fp}. Pass the backup_dir of this "
            "model's run, or a new directory.")

    def restore(self, meta=None) -> dict:
        """Load the backup's model and optimizer variables (and, unless already training, the
        data position). Returns the sidecar."""
        meta = meta or read_sidecar(self.backup_dir)
        if meta is None:
            raise BackupError(f"There is no backup to restore. Received: backup_dir="
                              f"{self.backup_dir!r} without {SIDECAR}. Train with the callback "
                              "first (or check the path).")
        self._check_optimizer()
        fp = fingerprint(self.model)
        if meta["fingerprint"] != fp:
            raise self._foreign_error(meta, fp)
        model_vars, opt_vars = _variables(self.model)
        variables = model_vars + opt_vars
        path = os.path.join(self.backup_dir, meta["state"])
        try:
            with np.load(path, allow_pickle=False) as f:
                keys = sorted(k for k in f.files if k.startswith("v"))
                if keys != [f"v{i:05d}" for i in range(len(variables))]:
                    raise ValueError(f"{len(keys)} arrays for {len(variables)} variables")
                values = [f[k] for k in keys]
                metric_keys = sorted(k for k in f.files if k.startswith("m"))
                if len(metric_keys) + len(keys) != len(f.files):
                    raise ValueError(f"unexpected arrays {sorted(f.files)[:8]}")
                metric_values = [f[k] for k in metric_keys]
        except Exception as e:  # noqa: BLE001 - OSError, BadZipFile, ValueError: unreadable
            if isinstance(e, ValueError) and "pickle" in str(e).lower():
                # numpy's own message suggests loading it unsafely: never repeat that advice.
                raise BackupError(
                    f"The backup's state file holds pickled Python objects, which tfdp never "
                    f"writes and never loads (unpickling can run arbitrary code). Received: "
                    f"{path!r}. Refused (loaded with allow_pickle=False): do not load it "
                    "yourself; restore the directory from a trusted copy, or delete it to "
                    "start from scratch.") from None
            raise BackupError(
                f"The backup's state file is unreadable. Received: {path!r} ({type(e).__name__}: "
                f"{e}). Restore the directory from a copy, or delete it to start from "
                "scratch.") from None
        for v, value in zip(variables, values):
            if tuple(v.shape) != value.shape:
                raise self._foreign_error(meta, fp)
            v.assign(value)
        self._meta = meta
        self._saved_metrics = metric_values
        self.restored = True
        return meta

    def _load_position(self, meta):
        self._epoch, self._step_in_epoch = meta["epoch"], meta["step_in_epoch"]
        self._global_step = self._last_saved_step = meta["global_step"]

    # --- Keras hooks ----------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        if not self._in_helper:
            self._input = input_position.claim(self.model)  # this fit's input position
        if not self._synced:
            meta = read_sidecar(self.backup_dir)
            if meta is not None:
                self.restore(meta)
                self._load_position(meta)
                backup_resume.say_if_resized(self.model, meta)
                if not self._in_helper:
                    self.model._initial_epoch = meta["epoch"]
                    self._offset = meta["step_in_epoch"]
                    self._position_input(meta)
            else:
                self._epoch = self._step_in_epoch = self._global_step = 0
                self._check_optimizer()
                self.save()  # a first good state: NaNGuard can always roll back
            self._synced = True

    def _position_input(self, meta):
        """Drop-in resume: put fit's input (and the epoch's running metrics) where the backup
        was taken (``tfdp.callbacks.backup_resume``)."""
        backup_resume.position_input(self, meta)

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._epoch:
            self._offset = 0
        self._epoch = epoch
        self._batch_seen = -1
        if self._resume_metrics is not None:
            # fit reset the metrics just before; the resumed epoch goes on from the backup's
            values, self._resume_metrics = self._resume_metrics, None
            for v, value in zip(self._metric_variables(), values):
                v.assign(value)

    def on_train_batch_end(self, batch, logs=None):
        steps = batch - self._batch_seen
        self._global_step += steps
        self._batch_seen = batch
        self._step_in_epoch = self._offset + batch + 1
        if self._input is not None:
            self._input.count_steps(steps)
        if (self.save_freq == "epoch"
                or self._global_step // self.save_freq <= self._last_saved_step // self.save_freq):
            return
        self._save_step(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._step_in_epoch, self._offset = epoch + 1, 0, 0
        if self.save_freq == "epoch":
            if self._input is not None and not self._in_helper:
                self._next_read = self._input.next_read(epoch_done=True, after_loop=True)
            try:
                self.save(logs)
            finally:
                self._next_read = None

    def on_train_end(self, logs=None):
        self.model._initial_epoch = None
        self._input = None
        self._resume_metrics = None
        if not self._in_helper:
            self._finish()

    def _finish(self):
        self._synced = False
        if self.delete_checkpoint and not self.failed and _is_chief(self._strategy()):
            self.delete()

    def delete(self):
        """Remove this backup's files (the directory too when it is left empty)."""
        if not os.path.isdir(self.backup_dir):
            return
        for name in os.listdir(self.backup_dir):
            if name == SIDECAR or _STATE_RE.match(name) or name.startswith(_TMP_PREFIX):
                try:
                    os.unlink(os.path.join(self.backup_dir, name))
                except OSError:
                    pass
        try:
            os.rmdir(self.backup_dir)
        except OSError:
            pass
        self._meta = None

    # --- exact-resume helper ----------------------------------------------------------------

    def fit(self, model, make_dataset, epochs: int, steps_per_epoch: int, callbacks=(),
            **fit_kwargs) -> dict:
        """``model.fit`` that resumes at the exact step.

        Args:
          model: the compiled model (built under the strategy).
          make_dataset: ``(epoch, start_step) -> dataset`` of that epoch's data from step
            ``start_step`` on (e.g. ``tfdp.data.distribute(strategy, ds, global_batch_size=B,
            shuffle_seed=7, epoch=epoch, start_step=start_step)``).
          epochs: total epochs (as ``model.fit``).
          steps_per_epoch: training steps in one whole epoch (``tfdp.data.steps_per_epoch``).
          callbacks, fit_kwargs: passed to every ``model.fit`` call (one per epoch).

        Returns the merged ``History.history`` of the epochs run here.
        """
        return backup_resume.fit(self, model, make_dataset, epochs, steps_per_epoch,
                                 callbacks, **fit_kwargs)

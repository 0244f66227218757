"""Exact, multi-worker-aware backup and restore for Keras ``fit``.

``BackupAndRestore(backup_dir, save_freq="epoch" | n)`` is a drop-in for Keras's callback with
three differences:

* **Exact resume.** It records the data position (epoch, step in that epoch, global step) with
  the model's and the optimizer's variables (slots, ``iterations``, the learning rate), so a
  restarted job continues at the exact step. Keras 3's callback replays the interrupted epoch.
  The data position is yours to honour: :meth:`BackupAndRestore.fit` does it (a partial first
  epoch from ``make_dataset(epoch, start_step)``, then whole epochs), or read
  ``backup.initial_epoch`` / ``backup.start_step`` and pass them to ``model.fit(initial_epoch=)``
  and ``tfdp.data.distribute(..., epoch=, start_step=)`` yourself.
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

Layout of ``backup_dir``::

    backup.json            sidecar: format, tfdp version, epoch, step_in_epoch, global_step,
                           fingerprint, state file name (replaced atomically, last)
    state-<step>.npz       variables in order: model.variables, then optimizer.variables
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import uuid

import numpy as np

import keras

from tfdp._version import __version__
from tfdp.errors import TfdpError, invalid_argument

log = logging.getLogger("tfdp")

SIDECAR = "backup.json"
FORMAT = "tfdp-backup"
FORMAT_VERSION = 1
_STATE_RE = re.compile(r"^state-\d+\.npz$")
_TMP_PREFIX = ".tmp-"


class BackupError(TfdpError):
    """The backup directory cannot be used (unreadable, corrupt or another model's)."""


def _check_save_freq(save_freq):
    if save_freq == "epoch":
        return save_freq
    if isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1:
        raise invalid_argument("save_freq", save_freq,
                               fix='Pass "epoch" or a positive int (a number of training steps).')
    return save_freq


def _is_chief(strategy) -> bool:
    """True for the worker that writes: rank 0 of a tfdp cluster, else ``should_checkpoint``."""
    cluster = getattr(strategy, "cluster", None)
    if cluster is not None and hasattr(cluster, "is_chief"):
        return bool(cluster.is_chief)
    extended = getattr(strategy, "extended", None)
    return bool(getattr(extended, "should_checkpoint", True))


def _kind(path: str) -> str:
    """The variable's own name without its layer's (``dense_3/kernel`` -> ``kernel``)."""
    return path.rsplit("/", 1)[-1]


def _variables(model):
    optimizer = getattr(model, "optimizer", None)
    opt_vars = list(optimizer.variables) if optimizer is not None else []
    return list(model.variables), opt_vars


def fingerprint(model) -> str:
    """A short hash of the shapes, dtypes and kinds of the model's and optimizer's variables.

    Layer names are left out (Keras numbers them per process: ``dense`` vs ``dense_4``), so the
    same architecture built twice has the same fingerprint, another architecture another one.
    """
    model_vars, opt_vars = _variables(model)
    desc = {
        "model": [[_kind(v.path), list(v.shape), str(v.dtype)] for v in model_vars],
        "optimizer": [type(model.optimizer).__name__ if opt_vars else None]
        + [[list(v.shape), str(v.dtype)] for v in opt_vars],
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def _atomic_write(path: str, write) -> None:
    """``write(file)`` into a private temporary file next to ``path``, then ``os.replace``."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-",
                               dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _not_a_directory(backup_dir: str) -> BackupError:
    """The error for a ``backup_dir`` that is a file, or lies under one."""
    path = os.path.abspath(backup_dir)
    if os.path.lexists(path):
        where = "it is a file" if os.path.exists(path) else "it is a broken symbolic link"
    else:
        blocker = os.path.dirname(path)
        while not os.path.lexists(blocker) and os.path.dirname(blocker) != blocker:
            blocker = os.path.dirname(blocker)
        where = f"{blocker!r} on its path is not a directory"
    return BackupError(f"The backup directory is not a directory ({where}). Received: "
                       f"backup_dir={backup_dir!r}. Pass the path of a directory (new or "
                       "empty, or a tfdp backup); the file is left untouched.")


def _unreadable(backup_dir: str, e: OSError) -> BackupError:
    return BackupError(
        f"The backup directory cannot be read ({type(e).__name__}: {e.strerror or e}). "
        f"Received: backup_dir={backup_dir!r}. Give this user read, write and search "
        f"permission (e.g. chmod u+rwx {backup_dir!r}), or pass another directory.")


def check_backup_dir(backup_dir: str) -> None:
    """Cheap construction-time check: ``backup_dir`` is not a file and does not lie under one."""
    if os.path.lexists(backup_dir):
        if not os.path.isdir(backup_dir):
            raise _not_a_directory(backup_dir)
        return
    parent = os.path.dirname(os.path.abspath(backup_dir))
    while not os.path.lexists(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise _not_a_directory(backup_dir)


def read_sidecar(backup_dir: str) -> dict | None:
    """The validated sidecar of ``backup_dir``, or None when there is no backup yet.

    Raises:
      BackupError: the directory holds something that is not a readable tfdp backup, is not a
        directory, or cannot be read.
    """
    path = os.path.join(backup_dir, SIDECAR)
    try:
        os.stat(path)
        has_sidecar = True
    except (FileNotFoundError, NotADirectoryError):
        has_sidecar = False
    except OSError as e:  # PermissionError: the directory cannot be searched
        raise _unreadable(backup_dir, e) from None
    if not has_sidecar:
        if not os.path.lexists(backup_dir):
            check_backup_dir(backup_dir)  # under a file: say so now, not at the first save
            return None
        if not os.path.isdir(backup_dir):
            raise _not_a_directory(backup_dir)
        try:
            names = os.listdir(backup_dir)
        except OSError as e:
            raise _unreadable(backup_dir, e) from None
        foreign = sorted(n for n in names
                         if not n.startswith(_TMP_PREFIX) and not _STATE_RE.match(n))
        if foreign:
            raise BackupError(
                f"The backup directory is not a tfdp backup. Received: backup_dir="
                f"{backup_dir!r} holding {foreign[:5]} but no {SIDECAR}. Nothing was changed "
                "in it. Pass an empty or new directory, or one written by "
                "tfdp.callbacks.BackupAndRestore (a Keras BackupAndRestore directory cannot be "
                "resumed exactly).")
        return None
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise BackupError(
            f"The backup's sidecar is unreadable. Received: {path!r} ({type(e).__name__}: {e}). "
            "The backup cannot be trusted: restore the directory from a copy, or delete it to "
            "start training from scratch.") from None
    required = {"format": str, "format_version": int, "epoch": int, "step_in_epoch": int,
                "global_step": int, "fingerprint": str, "state": str}
    bad = [k for k, t in required.items()
           if not isinstance(meta, dict) or not isinstance(meta.get(k), t)]
    if isinstance(meta, dict) and meta.get("format") not in (None, FORMAT):
        bad = ["format"]
    if bad or not _STATE_RE.match(meta["state"]) or meta["format_version"] > FORMAT_VERSION:
        raise BackupError(
            f"The backup's sidecar is not a valid tfdp backup. Received: {path!r} with missing "
            f"or invalid {bad or ['state/format_version']} "
            f"(content: {json.dumps(meta)[:200]}). Restore the directory from a copy, or delete "
            "it to start training from scratch.")
    return meta


class BackupAndRestore(keras.callbacks.Callback):
    """Back up model + optimizer + data position; resume at the exact step (multi-worker aware).

    Args:
      backup_dir: the directory of the backup (created; only the chief writes it).
      save_freq: ``"epoch"`` (at every epoch end) or an int: every that many training steps
        (global steps, counted across epochs and restarts).
      delete_checkpoint: delete the backup when training finishes successfully (as Keras). A
        failed run (an exception, :class:`NaNGuard` giving up) never deletes it.

    Use in ``model.fit(callbacks=[backup])`` restores the model and optimizer at
    ``on_train_begin`` and skips to ``backup.initial_epoch``; when a step-level backup was taken
    mid-epoch, the data must start at ``backup.start_step`` too: use :meth:`fit`, or
    ``tfdp.data.distribute(..., epoch=backup.initial_epoch, start_step=backup.start_step)``.

    Attributes (after a restore, or read from ``backup_dir`` before any): ``initial_epoch``,
    ``start_step`` (training steps already done in that epoch), ``global_step``.
    """

    def __init__(self, backup_dir, save_freq="epoch", delete_checkpoint: bool = True):
        super().__init__()
        if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
            raise invalid_argument("backup_dir", backup_dir, fix="Pass a directory path.")
        self.backup_dir = os.fspath(backup_dir)
        check_backup_dir(self.backup_dir)
        self.save_freq = _check_save_freq(save_freq)
        self.delete_checkpoint = bool(delete_checkpoint)
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

    # --- position -------------------------------------------------------------------------

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
        meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "tfdp_version": __version__,
                "epoch": self._epoch, "step_in_epoch": self._step_in_epoch,
                "global_step": self._global_step, "fingerprint": fp, "state": state,
                "num_model_variables": len(model_vars),
                "num_optimizer_variables": len(opt_vars)}
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
                keys = sorted(f.files)
                if keys != [f"v{i:05d}" for i in range(len(variables))]:
                    raise ValueError(f"{len(keys)} arrays for {len(variables)} variables")
                values = [f[k] for k in keys]
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
        self.restored = True
        return meta

    def _load_position(self, meta):
        self._epoch, self._step_in_epoch = meta["epoch"], meta["step_in_epoch"]
        self._global_step = self._last_saved_step = meta["global_step"]

    # --- Keras hooks ----------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        if not self._synced:
            meta = read_sidecar(self.backup_dir)
            if meta is not None:
                self.restore(meta)
                self._load_position(meta)
                if not self._in_helper:
                    self.model._initial_epoch = meta["epoch"]
                    self._offset = meta["step_in_epoch"]
                    if meta["step_in_epoch"]:
                        log.warning(
                            "tfdp BackupAndRestore: resumed at epoch %d step %d; model.fit "
                            "starts the epoch's data from its beginning unless the dataset "
                            "skips %d steps (use backup.fit or tfdp.data.distribute(..., "
                            "start_step=backup.start_step))", meta["epoch"],
                            meta["step_in_epoch"], meta["step_in_epoch"])
            else:
                self._epoch = self._step_in_epoch = self._global_step = 0
                self._check_optimizer()
                self.save()  # a first good state: NaNGuard can always roll back
            self._synced = True

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._epoch:
            self._offset = 0
        self._epoch = epoch
        self._batch_seen = -1

    def on_train_batch_end(self, batch, logs=None):
        self._global_step += batch - self._batch_seen
        self._batch_seen = batch
        self._step_in_epoch = self._offset + batch + 1
        if (self.save_freq == "epoch"
                or self._global_step // self.save_freq <= self._last_saved_step // self.save_freq):
            return
        fit_steps = (self.params or {}).get("steps")
        if ((self._steps_per_epoch and self._step_in_epoch >= self._steps_per_epoch)
                or (not self._in_helper and fit_steps and batch + 1 >= fit_steps)):
            epoch, step = self._epoch, self._step_in_epoch  # the epoch's last step: next epoch
            self._epoch, self._step_in_epoch = epoch + 1, 0
            self.save(logs)
            self._epoch, self._step_in_epoch = epoch, step
        else:
            self.save(logs)

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._step_in_epoch, self._offset = epoch + 1, 0, 0
        if self.save_freq == "epoch":
            self.save(logs)

    def on_train_end(self, logs=None):
        self.model._initial_epoch = None
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
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) \
                or steps_per_epoch < 1:
            raise invalid_argument("steps_per_epoch", steps_per_epoch, fix="Pass a positive int.")
        self.set_model(model)
        self._steps_per_epoch = steps_per_epoch
        self._in_helper = True
        history: dict = {}
        try:
            self._synced = False
            meta = read_sidecar(self.backup_dir)
            self._meta = meta
            epoch, step = (meta["epoch"], meta["step_in_epoch"]) if meta else (0, 0)
            if step >= steps_per_epoch:
                epoch, step = epoch + 1, 0
            fit_kwargs.setdefault("verbose", 0)
            while epoch < epochs:
                self._offset = step
                if self._synced:
                    self._epoch, self._step_in_epoch = epoch, step
                h = model.fit(make_dataset(epoch, step), initial_epoch=epoch, epochs=epoch + 1,
                              steps_per_epoch=steps_per_epoch - step,
                              callbacks=[self, *callbacks], **fit_kwargs)
                for k, v in h.history.items():
                    history.setdefault(k, []).extend(v)
                if model.stop_training:
                    break
                epoch, step = epoch + 1, 0
        finally:
            self._in_helper = False
            self._steps_per_epoch = None
        self._finish()
        return history

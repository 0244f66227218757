"""Keras's own file-writing callbacks across workers: only the chief writes the shared files.

TF's multi-worker Keras tutorial passes ``keras.callbacks.BackupAndRestore(backup_dir)`` and
``keras.callbacks.ModelCheckpoint(filepath)`` with one directory for all workers (a shared file
system). Keras 3's callbacks know nothing of workers: every worker writes the same files at the
same moment, and the run dies with ``BlockingIOError: unable to lock file`` (h5py) or
``FileExistsError``, and at the end every worker deletes the backup directory (the same happens
under ``tf.distribute.MultiWorkerMirroredStrategy``).

``install(strategy)`` (called by every multi-worker tfdp strategy when it is created; nothing
happens with one worker) wraps where those callbacks write, for as long as that strategy lives
(the adapter's ``shared_files`` set, ``tfdp.keras.adapter``; ``tfdp/compat/`` lists the Keras
internals):

* ``BackupAndRestore`` and ``ModelCheckpoint``: a worker that is not the chief still runs the
  whole save (the same code on every worker keeps any collective a save may run in step), but
  into a private temporary directory that is removed right after; the chief writes the shared
  files. Reading is untouched: at ``on_train_begin`` every worker restores from the shared
  backup, so a restarted job resumes as Keras documents it (the interrupted epoch starts again
  from the last backup). Only the chief deletes the backup directory at the end of training.
* ``CSVLogger``: a worker that is not the chief logs to ``os.devnull``.

Which worker is the chief comes from ``tfdp.strategy.worker_role`` of the callback's model's
strategy at the moment it writes (``MultiWorkerMirroredStrategy`` included, while a multi-worker
tfdp strategy lives in the process). Single-worker runs are never affected.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from tfdp import compat
from tfdp.keras import adapter
from tfdp.strategy.role import worker_role

def _role(callback):
    model = getattr(callback, "model", None)
    return worker_role(getattr(model, "distribute_strategy", None))


def _private_dir(role) -> str:
    return tempfile.mkdtemp(prefix=f"tfdp-worker{role.index}-keras-")


def _save_privately_off_chief(writing_to):
    """A ``_save_model`` wrapper: the chief saves as Keras does; another worker runs the same
    save into a private temporary directory (``writing_to(callback, dir)``), removed at once."""
    def make(original):
        def _save_model(self, *args, **kwargs):
            role = _role(self)
            if role.count == 1 or role.is_chief:
                return original(self, *args, **kwargs)
            tmp = _private_dir(role)
            try:
                with writing_to(self, tmp):
                    return original(self, *args, **kwargs)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return _save_model
    return make


def _backup_save(original):
    return _save_privately_off_chief(compat.keras_backup_and_restore_writing_to)(original)


def _backup_train_end(original):
    def on_train_end(self, logs=None):
        role = _role(self)
        if role.count == 1 or role.is_chief:
            return original(self, logs)
        return None  # the chief deletes the shared backup directory
    return on_train_end


def _checkpoint_save(original):
    return _save_privately_off_chief(compat.keras_model_checkpoint_writing_to)(original)


def _csv_train_begin(original):
    def on_train_begin(self, logs=None):
        role = _role(self)
        if role.count == 1 or role.is_chief:
            return original(self, logs)
        filename = self.filename
        self.filename = os.devnull
        try:
            return original(self, logs)
        finally:
            self.filename = filename
    return on_train_begin


HOOKS = {"backup_save": _backup_save, "backup_train_end": _backup_train_end,
         "checkpoint_save": _checkpoint_save, "csv_train_begin": _csv_train_begin}
adapter.provide("shared_files", HOOKS)


def install(strategy) -> None:
    """Make Keras's file-writing callbacks safe for as long as ``strategy`` lives (only when
    ``strategy`` has several workers)."""
    if worker_role(strategy).count >= 2:
        adapter.use(strategy, "shared_files")


def installed() -> bool:
    """Whether the hooks are in Keras now."""
    return adapter.users("shared_files") > 0


__all__ = ["HOOKS", "install", "installed"]

"""tfdp's exact-resume backup as Ray Train checkpoints.

``tfdp.ray.BackupAndRestore(save_freq=...)`` is ``tfdp.callbacks.BackupAndRestore`` for a Ray
Train worker:

* every worker keeps its copy of the backup in a local directory (a new temporary one by
  default): Ray workers need not share a file system, Ray's storage (``RunConfig.storage_path``)
  is what they share;
* each backup (every ``save_freq`` steps, or every epoch) is reported with ``ray.train.report``
  on every worker (Ray needs all workers to report together); the chief attaches the backup
  directory as the checkpoint, which Ray copies to its storage before training goes on;
* when Ray restarts the worker group (``FailureConfig(max_failures=n)``) or a run is resumed,
  each new worker copies ``ray.train.get_checkpoint()`` into its local directory and the backup
  restores model, optimizer, metrics and data position at the exact step it was taken.

So a run that loses a worker and is restarted by Ray ends with the same weights as an
uninterrupted run (bitwise, measured), as with tfdp's own ``tfdp launch --max-restarts``.
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import tempfile

import numpy as np

from tfdp.callbacks import backup as backup_lib
from tfdp.callbacks.backup_files import read_sidecar
from tfdp.errors import TfdpError, invalid_argument
from tfdp.ray._require import in_train_worker

log = logging.getLogger("tfdp")


def _metric_value(value):
    """A float for Ray's metrics, or None for what is not a scalar number."""
    try:
        array = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return float(array) if array.ndim == 0 else None


class BackupAndRestore(backup_lib.BackupAndRestore):
    """``tfdp.callbacks.BackupAndRestore`` that reports each backup as a Ray Train checkpoint
    and restores from Ray's latest checkpoint. Create it inside ``train_loop_per_worker``.

    Args:
      save_freq: ``"epoch"`` or a number of training steps (as tfdp's BackupAndRestore). Each
        backup is one ``ray.train.report`` on every worker, with the chief's checkpoint.
      local_dir: where this worker keeps its copy of the backup; None (default) makes a new
        temporary directory. It must not hold a tfdp backup already: Ray's checkpoint is the
        one to resume from.
      delete_checkpoint: delete the local copy when training ends well (Ray's copies stay, as
        ``CheckpointConfig`` keeps them).
      position_input: as for tfdp's BackupAndRestore (fit's input resumes at the exact step).

    Use::

        backup = tfdp.ray.BackupAndRestore(save_freq=20)
        model.fit(x, y, batch_size=64, epochs=5, callbacks=[backup])

    Attributes (besides tfdp's): ``ray_checkpoint`` (the checkpoint restored from, or None),
    ``reports`` (backups reported by this worker).
    """

    def __init__(self, save_freq="epoch", local_dir=None, delete_checkpoint: bool = True,
                 position_input: bool = True):
        train = in_train_worker("tfdp.ray.BackupAndRestore",
                                "outside Ray use tfdp.callbacks.BackupAndRestore.")
        backup_lib._check_save_freq(save_freq)
        self._owns_dir = local_dir is None
        if local_dir is None:
            local_dir = tempfile.mkdtemp(prefix="tfdp-ray-backup-")
        elif not isinstance(local_dir, (str, os.PathLike)) or not os.fspath(local_dir):
            raise invalid_argument("local_dir", local_dir,
                                   fix="Pass a directory path, or None for a temporary one.")
        local_dir = os.fspath(local_dir)
        if read_sidecar(local_dir) is not None:
            raise TfdpError(
                f"local_dir already holds a tfdp backup. Received: local_dir={local_dir!r}. "
                "Under Ray the run resumes from Ray's checkpoint (ray.train.get_checkpoint()), "
                "copied there: pass an empty directory, or None for a temporary one.")
        checkpoint = train.get_checkpoint()
        if checkpoint is not None:
            os.makedirs(local_dir, exist_ok=True)
            checkpoint.to_directory(local_dir)
            if read_sidecar(local_dir) is None:
                raise TfdpError(
                    f"Ray's checkpoint holds no tfdp backup. Received: {checkpoint!r} (copied "
                    f"to {local_dir!r}). Resume from a run that used tfdp.ray.BackupAndRestore, "
                    "or start a new run (another RunConfig name or storage_path).")
        super().__init__(local_dir, save_freq=save_freq, delete_checkpoint=delete_checkpoint,
                         position_input=position_input)
        self._train = train
        self.ray_checkpoint = checkpoint
        self.reports = 0
        if checkpoint is not None:
            position = self.restore_point
            log.info("tfdp.ray: resuming from Ray's checkpoint %s at epoch %d step %d "
                     "(global step %d)", checkpoint.path, position.epoch,
                     position.step_in_epoch, position.global_step)

    def save(self, logs=None) -> bool:
        """Back up (the chief writes) and report the backup to Ray (every worker)."""
        before = self._last_saved_step
        wrote = super().save(logs)
        # Every worker passes here at the same steps (the backup's counters agree); the first
        # good state of a fresh run (global step 0) is not worth a checkpoint.
        if self._last_saved_step != before and self._global_step > 0:
            self._report(wrote, logs)
        return wrote

    def _report(self, wrote: bool, logs):
        metrics = {"epoch": self._epoch, "step_in_epoch": self._step_in_epoch,
                   "global_step": self._global_step}
        for key, value in (logs or {}).items():
            number = _metric_value(value)
            if number is not None and key not in metrics:
                metrics[key] = number
        checkpoint = self._train.Checkpoint.from_directory(self.backup_dir) if wrote else None
        kwargs = {}
        if "delete_local_checkpoint_after_upload" in _report_parameters(self._train.report):
            kwargs["delete_local_checkpoint_after_upload"] = False  # the live backup directory
        self._train.report(metrics, checkpoint=checkpoint, **kwargs)
        self.reports += 1

    def _finish(self):
        super()._finish()
        if self._owns_dir and self.delete_checkpoint and not self.failed:
            shutil.rmtree(self.backup_dir, ignore_errors=True)


def _report_parameters(report) -> set:
    try:
        return set(inspect.signature(report).parameters)
    except (TypeError, ValueError):
        return set()


__all__ = ["BackupAndRestore"]

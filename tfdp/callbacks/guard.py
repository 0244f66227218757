"""NaNGuard: roll back to the last good backup when the loss (or a weight) goes NaN/Inf.

``NaNGuard(backup, max_rollbacks=3, lr_factor=0.5)`` watches every training step's loss
(``logs["loss"]``; with ``check_weights=True`` also every trainable variable). A non-finite
value means the step diverged (a NaN/Inf gradient shows up in the next step's loss, or at once
with ``check_weights``). The guard then restores the model and optimizer from the
:class:`~tfdp.callbacks.BackupAndRestore` ``backup`` (its last good state: a backup of NaN/Inf
values is never written), multiplies the learning rate by ``lr_factor`` (when it is a plain
value, not a schedule), resets the epoch's running metrics, and training continues with the next
batch (the batch that diverged is not replayed). After ``max_rollbacks`` rollbacks the next
divergence stops training with :class:`DivergenceError`; the backup is marked failed and is never
deleted, so the run can be inspected or resumed.

Put the guard after the backup in ``callbacks=[backup, guard]`` (or let ``backup.fit`` run it):
the backup skips saving a non-finite state anyway. Every worker runs the same check on the same
global loss, so all roll back together.
"""

from __future__ import annotations

import logging
import math

import numpy as np

import keras

from tfdp.errors import invalid_argument, message

log = logging.getLogger("tfdp")


class DivergenceError(RuntimeError):
    """Training diverged (NaN/Inf) more often than ``NaNGuard(max_rollbacks=...)`` allows."""


class NaNGuard(keras.callbacks.Callback):
    """Detect NaN/Inf, restore the last good backup, lower the learning rate, give up after K.

    Args:
      backup: the run's :class:`tfdp.callbacks.BackupAndRestore` (also in ``callbacks``).
      max_rollbacks: rollbacks allowed; the next divergence raises :class:`DivergenceError`.
      lr_factor: multiply the learning rate by this after each rollback (None: keep it).
      check_weights: also check every trainable variable after each step (one small reduction
        per variable; catches a NaN gradient in the step that made it).

    Attributes: ``rollbacks`` (count), ``events`` (one dict per rollback: epoch, step,
    global_step, value, learning_rate).
    """

    def __init__(self, backup, max_rollbacks: int = 3, lr_factor: float | None = 0.5,
                 check_weights: bool = False):
        super().__init__()
        from tfdp.callbacks.backup import BackupAndRestore
        if not isinstance(backup, BackupAndRestore):
            raise invalid_argument("backup", backup,
                                   fix="Pass the run's tfdp.callbacks.BackupAndRestore.")
        if isinstance(max_rollbacks, bool) or not isinstance(max_rollbacks, int) \
                or max_rollbacks < 0:
            raise invalid_argument("max_rollbacks", max_rollbacks, fix="Pass an int >= 0.")
        if lr_factor is not None and (isinstance(lr_factor, bool)
                                      or not isinstance(lr_factor, (int, float))
                                      or not 0 < lr_factor <= 1):
            raise invalid_argument("lr_factor", lr_factor,
                                   fix="Pass a number in (0, 1], or None to keep the rate.")
        self.backup = backup
        self.max_rollbacks = max_rollbacks
        self.lr_factor = lr_factor
        self.check_weights = bool(check_weights)
        self.rollbacks = 0
        self.events: list[dict] = []

    def _bad_value(self, logs):
        loss = (logs or {}).get("loss")
        if loss is not None:
            value = float(np.asarray(loss, dtype=np.float64))
            if not math.isfinite(value):
                return f"loss={value}"
        if self.check_weights:
            import tensorflow as tf
            for v in self.model.trainable_variables:
                if not bool(tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(v)))):
                    return f"non-finite values in {v.path}"
        return None

    def on_train_batch_end(self, batch, logs=None):
        bad = self._bad_value(logs)
        if bad is None:
            return
        b = self.backup
        pos = b.position
        where = f"epoch {pos.epoch}, step {pos.step_in_epoch} (global step {pos.global_step})"
        point = b.restore_point
        last_good = None if point is None else point.global_step
        if self.rollbacks >= self.max_rollbacks:
            b.failed = True
            raise DivergenceError(message(
                f"Training diverged at {where} after {self.rollbacks} rollback(s)",
                f"{bad}, max_rollbacks={self.max_rollbacks}",
                f"The last good backup (global step {last_good}) is kept in "
                f"{b.backup_dir!r}. Lower the learning rate (lr_factor={self.lr_factor}), check "
                "the data for NaN/Inf, or raise max_rollbacks; then resume from the backup."))
        b.restore()
        self.rollbacks += 1
        lr = self._lower_lr()
        self.model.reset_metrics()  # the epoch's running loss holds the NaN
        self.events.append({"epoch": pos.epoch, "step": pos.step_in_epoch,
                            "global_step": pos.global_step, "value": bad, "learning_rate": lr})
        log.warning("tfdp NaNGuard: %s at %s; rolled back to global step %s (rollback %d of %d)%s",
                    bad, where, last_good, self.rollbacks, self.max_rollbacks,
                    "" if lr is None else f"; learning rate now {lr:g}")

    def _lower_lr(self):
        opt = self.model.optimizer
        lr_var = getattr(opt, "_learning_rate", None)
        if not isinstance(lr_var, keras.Variable):
            if self.lr_factor is not None:
                log.warning("tfdp NaNGuard: the learning rate is a schedule; left unchanged")
            return None
        if self.lr_factor is not None and self.lr_factor != 1:
            opt.learning_rate = float(np.asarray(lr_var)) * self.lr_factor
        return float(np.asarray(opt._learning_rate))

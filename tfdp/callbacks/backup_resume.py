"""Resuming a ``tfdp.callbacks.BackupAndRestore`` backup at the exact step: fit's input put back
at restore (drop-in ``model.fit(data, callbacks=[backup])``, with
``tfdp.callbacks.input_position``), and ``BackupAndRestore.fit``, the helper whose dataset
factory positions the data itself (a partial first epoch, then whole epochs, one ``model.fit``
call each).
"""

from __future__ import annotations

import logging

from tfdp.callbacks import input_position
from tfdp.callbacks.backup_files import read_sidecar
from tfdp.errors import invalid_argument
from tfdp.strategy.role import worker_role

log = logging.getLogger("tfdp")


def replicas(model) -> list[int]:
    """``[workers, replicas in sync]`` of the strategy ``model`` trains under."""
    strategy = model.distribute_strategy
    return [worker_role(strategy).count, int(strategy.num_replicas_in_sync)]


def say_if_resized(model, meta) -> None:
    """One line on the chief when the backup was written on another number of replicas (an
    elastic job that lost or gained a node): the same global batches, a new split."""
    saved = meta.get("replicas")
    now = replicas(model)
    if not saved or list(saved) == now or not worker_role(model.distribute_strategy).is_chief:
        return
    from tfdp.strategy import announce
    (w0, r0), (w1, r1) = saved, now

    def count(n, what):
        return f"{n} {what}{'s' if n != 1 else ''}"
    announce.show(
        f"tfdp BackupAndRestore: resuming at epoch {meta['epoch']} step "
        f"{meta['step_in_epoch']} (global step {meta['global_step']}) on {count(w1, 'worker')} "
        f"= {count(r1, 'replica')}; the backup was written on {count(w0, 'worker')} = "
        f"{count(r0, 'replica')}: fit's global batches are unchanged, split over "
        f"{'fewer' if r1 < r0 else 'more'} replicas{_micro(model)}")


def _micro(model) -> str:
    k = getattr(model.distribute_strategy.extended, "tfdp_micro_batches", 1)
    return f", each replica's share in {k} micro-batches" if k > 1 else ""


def position_input(callback, meta) -> None:
    """Drop-in resume: put fit's input (and the epoch's running metrics) where the backup in
    ``meta`` was taken, and say once if that cannot be exact (``callback``: the
    BackupAndRestore restoring at ``on_train_begin``)."""
    epoch, step = meta["epoch"], meta["step_in_epoch"]
    where = f"epoch {epoch} step {step} (global step {meta['global_step']})"
    saved_input = meta.get("input")
    tracker = callback._input
    if not callback.position_input:
        return  # the caller's pipeline starts at the backed-up step
    params = callback.params or {}
    if saved_input is not None and (saved_input.get("epochs"), saved_input.get("steps")) \
            != (params.get("epochs"), params.get("steps")):
        # written by another fit call (e.g. one fit per epoch on data the caller positions
        # itself): its input position says nothing about this fit's data
        if step:
            log.warning("tfdp BackupAndRestore: resumed at %s, but the backup was written "
                        "by a fit of %s epochs x %s steps and this fit has %s x %s: fit's "
                        "input is not positioned (pass data that starts at step %d, or use "
                        "backup.fit)", where, saved_input.get("epochs"),
                        saved_input.get("steps"), params.get("epochs"), params.get("steps"),
                        step)
        return
    if tracker is None or saved_input is None or not input_position.positionable(tracker):
        why = []
        if tracker is not None:
            why = input_position.not_exact_reasons(tracker)
        if step or why:
            log.warning(
                "tfdp BackupAndRestore: resumed at %s, but fit's input is not positioned "
                "(%s): the epoch's data starts from its beginning. Pass the callback to "
                "model.fit in the run that writes the backup, or use backup.fit / "
                "tfdp.data.distribute(..., start_step=backup.start_step)", where,
                "; ".join(why) if why else
                "the backup holds no input position" if saved_input is None else
                "this fit's input is not tracked")
        return
    tracker.pending = (saved_input["iterator"], saved_input["consumed"], step)
    if step:
        n = len(callback._metric_variables())
        if len(callback._saved_metrics) == n:
            callback._resume_metrics = callback._saved_metrics
        else:
            log.warning("tfdp BackupAndRestore: the backup holds %d metric variables but "
                        "the model has %d; the resumed epoch's metrics restart at %s",
                        len(callback._saved_metrics), n, where)
    reasons = input_position.not_exact_reasons(tracker)
    if reasons:
        log.warning("tfdp BackupAndRestore: resumed at %s; the input is replayed to that "
                    "step, but the resumed run will not be exact: %s", where,
                    "; ".join(reasons))
    else:
        log.info("tfdp BackupAndRestore: resumed at %s (input replayed: %d iterator(s), "
                 "%d batch(es))", where, saved_input["iterator"], saved_input["consumed"])


def fit(callback, model, make_dataset, epochs, steps_per_epoch, callbacks=(),
        **fit_kwargs) -> dict:
    """``BackupAndRestore.fit`` (see there): ``model.fit`` per epoch from the backed-up step."""
    if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) \
            or steps_per_epoch < 1:
        raise invalid_argument("steps_per_epoch", steps_per_epoch, fix="Pass a positive int.")
    callback.set_model(model)
    callback._steps_per_epoch = steps_per_epoch
    callback._in_helper = True
    history: dict = {}
    try:
        callback._synced = False
        meta = read_sidecar(callback.backup_dir)
        callback._meta = meta
        epoch, step = (meta["epoch"], meta["step_in_epoch"]) if meta else (0, 0)
        if step >= steps_per_epoch:
            epoch, step = epoch + 1, 0
        fit_kwargs.setdefault("verbose", 0)
        fit_kwargs.setdefault("shuffle", False)   # the input's order is the position; Keras warns
        while epoch < epochs:
            callback._offset = step
            if callback._synced:
                callback._epoch, callback._step_in_epoch = epoch, step
            h = model.fit(make_dataset(epoch, step), initial_epoch=epoch, epochs=epoch + 1,
                          steps_per_epoch=steps_per_epoch - step,
                          callbacks=[callback, *callbacks], **fit_kwargs)
            for k, v in h.history.items():
                history.setdefault(k, []).extend(v)
            if model.stop_training:
                break
            epoch, step = epoch + 1, 0
    finally:
        callback._in_helper = False
        callback._steps_per_epoch = None
    callback._finish()
    return history


__all__ = ["fit", "position_input"]

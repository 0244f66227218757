"""Learning-rate scaling with gradual warm-up (Goyal et al. 2017, "Accurate, Large Minibatch SGD").

Linear scaling rule: when the global batch grows k-fold, multiply the learning rate by k::

    lr = learning_rate * global_batch_size / base_batch_size

Gradual warm-up: start at ``learning_rate`` and rise linearly to the scaled rate over
``warmup_steps``, then keep it (``"constant"``) or cosine-decay it to 0 at ``total_steps``.
:func:`plan` drops a warm-up that changes nothing (scaled rate == base rate) and caps one that
would take more than half of the run's steps (the schedule after it needs steps too).
:func:`learning_rate_at` is the plain-Python formula; ``tfdp.train.schedule.WarmupSchedule`` is
the same as a Keras schedule.
"""

from __future__ import annotations

import math

from tfdp.errors import invalid_argument


def linear_scaled_lr(learning_rate: float, global_batch_size: int, base_batch_size: int) -> float:
    """``learning_rate * global_batch_size / base_batch_size`` (the linear scaling rule)."""
    for name, v in (("global_batch_size", global_batch_size), ("base_batch_size", base_batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise invalid_argument(name, v, fix="Pass a positive int.")
    return float(learning_rate) * global_batch_size / base_batch_size


def learning_rate_at(step: float, *, base_lr: float, peak_lr: float, warmup_steps: int = 0,
                     total_steps: int | None = None, schedule: str = "constant") -> float:
    """The rate at optimizer step ``step`` (0-based): warm-up, then constant or cosine decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr + (peak_lr - base_lr) * step / warmup_steps
    if schedule == "cosine" and total_steps and total_steps > warmup_steps:
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak_lr


def plan(train_cfg: dict, global_batch_size: int, steps_per_epoch: int) -> dict:
    """The learning-rate plan of a ``[train]`` config section (plain numbers, for the summary).

    Returns ``{"base_lr", "peak_lr", "warmup_steps", "total_steps", "schedule", "text"}``.
    """
    base = train_cfg["learning_rate"]
    if train_cfg["lr_scaling"] == "linear":
        peak = linear_scaled_lr(base, global_batch_size, train_cfg["base_batch_size"])
        text = (f"linear scaling: {base:g} x {global_batch_size}/{train_cfg['base_batch_size']}"
                f" = {peak:g}")
    else:
        peak = base
        text = f"{base:g} (no scaling)"
    total = train_cfg["epochs"] * steps_per_epoch
    asked = int(round(train_cfg["warmup_epochs"] * steps_per_epoch))
    # A warm-up from the base rate to the same rate changes nothing: none (and not printed).
    # One that would fill the whole run (e.g. warmup_epochs = 1 with epochs = 1) would leave no
    # step for the schedule after it: a cosine run would end at the peak rate instead of 0. It is
    # capped at half the run, and the line says so.
    warmup = asked if peak != base else 0
    cap = total // 2
    if warmup > cap:
        warmup = cap
    if warmup:
        text += (f", warm-up {train_cfg['warmup_epochs']:g} epoch(s) = {asked} steps from "
                 f"{base:g}" if warmup == asked else
                 f", warm-up {warmup} steps from {base:g} (warmup_epochs = "
                 f"{train_cfg['warmup_epochs']:g} is {asked} of the run's {total} steps: capped "
                 "at half the run)")
    if train_cfg["schedule"] == "cosine":
        text += f", cosine decay to 0 at step {total}"
    return {"base_lr": base if warmup else peak, "peak_lr": peak, "warmup_steps": warmup,
            "total_steps": total, "schedule": train_cfg["schedule"], "text": text}

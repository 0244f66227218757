"""``WarmupSchedule``: ``tfdp.train.lr.learning_rate_at`` as a Keras learning-rate schedule."""

from __future__ import annotations

import math

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tfdp")
class WarmupSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """Keras schedule of :func:`learning_rate_at` (serialisable with the model)."""

    def __init__(self, base_lr, peak_lr, warmup_steps=0, total_steps=None, schedule="constant"):
        self.base_lr = float(base_lr)
        self.peak_lr = float(peak_lr)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.schedule = schedule

    def __call__(self, step):
        step = ops.cast(step, "float32")
        after = ops.cast(self.peak_lr, "float32")
        if self.schedule == "cosine" and self.total_steps and self.total_steps > self.warmup_steps:
            progress = ops.minimum(
                1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
            after = after * 0.5 * (1.0 + ops.cos(math.pi * progress))
        if self.warmup_steps <= 0:
            return after
        warm = self.base_lr + (self.peak_lr - self.base_lr) * step / self.warmup_steps
        return ops.where(step < self.warmup_steps, warm, after)

    def get_config(self):
        return {"base_lr": self.base_lr, "peak_lr": self.peak_lr,
                "warmup_steps": self.warmup_steps, "total_steps": self.total_steps,
                "schedule": self.schedule}

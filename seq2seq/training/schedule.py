"""Learning-rate schedules as pure functions of the update step (1 = the first update)."""

from __future__ import annotations

import math

from seq2seq.config import TrainConfig


def learning_rate(step: int, config: TrainConfig, *, d_model: int) -> float:
    """The learning rate for update `step`. For 'noam', train.lr is the paper's scale factor."""
    lr, warmup, total = config.lr, config.warmup_steps, config.max_steps
    if step <= 0:
        return 0.0
    if config.schedule == "noam":
        return lr * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    if step < warmup:
        return lr * step / warmup
    if config.schedule == "inverse_sqrt":
        return lr * math.sqrt(max(warmup, 1) / step)
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if config.schedule == "linear":
        return lr * (1.0 - progress)
    if config.schedule == "cosine":
        return lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr  # constant

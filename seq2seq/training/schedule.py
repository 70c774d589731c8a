"""Learning-rate schedules, as pure functions of the update step and of how much of the run's budget
is spent.

A run's budget is whichever of `max_steps`, `max_time` and `max_epochs` ends it first. The `linear`
and `cosine` schedules decay from the peak to `min_lr` exactly when the budget is spent, so a run
given half an hour anneals within that half hour on any machine (budgeted training, Li et al. 2020:
a linear decay to zero at the budget is robust and strong, above all for small budgets). `wsd`
(warmup-stable-decay) holds the peak and cools down only over the last `cooldown_fraction` of the
budget, to the floor, linearly or as 1 - sqrt (Hägele et al. 2024: a short cooldown matches a
cosine run of the same length, and 1 - sqrt cools better than linear); the cooldown is placed by
the same budget share, so it works for `max_time` too. `inverse_sqrt` and `noam` never anneal:
they suit runs stopped by patience, not by a budget.
"""

from __future__ import annotations

import math

from seq2seq.checkpoint import Progress
from seq2seq.config import TrainConfig


def budget_spent(progress: Progress, config: TrainConfig, *, batches_per_epoch: int) -> float:
    """The share of the budget spent once the current update is done, in [0, 1]: the largest of
    updates / max_steps, training seconds / max_time and epochs / max_epochs, since the run stops
    when the first of them reaches 1 (trainer.Trainer._stop_reason).

    Training seconds are projected to the end of the current update from the mean update so far, so
    that the last update before the deadline runs at the floor. Distributed ranks keep rank 0's clock
    in their progress (the trainer shares it after every update), so every rank computes the same
    share. A resumed run counts the time spent before it stopped (the progress that checkpoints keep)."""
    spent = progress.step / config.max_steps
    seconds_per_update = progress.train_seconds / (progress.step - 1) if progress.step > 1 else 0.0
    if config.max_time:
        spent = max(spent, seconds_per_update * progress.step / config.max_time)
    if config.max_epochs:
        epochs = progress.epoch - 1 + progress.next_batch / max(batches_per_epoch, 1)
        spent = max(spent, epochs / config.max_epochs)
    return min(spent, 1.0)


def warmup_outlasting_the_run(config: TrainConfig) -> str | None:
    """What a run cut short for a quick try, its warmup left as it was, should be told: its learning
    rate never reaches its peak (every schedule, noam's too, rises linearly until warmup_steps). None
    where the warmup ends within max_steps."""
    if config.warmup_fraction or config.warmup_steps <= config.max_steps:
        return None
    return (
        f"train.warmup_steps ({config.warmup_steps}) outlasts train.max_steps ({config.max_steps}): the learning "
        f"rate rises to {config.max_steps / config.warmup_steps:.0%} of its peak and the run ends before it "
        "gets there; fewer warmup_steps (or warmup_fraction) reach it"
    )


def learning_rate(
    step: int, config: TrainConfig, *, d_model: int, spent: float = 0.0, decay_start: float = 0.0
) -> float:
    """The learning rate for update `step` once `spent` of the budget is (budget_spent). Warmup is
    linear, over `warmup_steps` updates or, with `warmup_fraction`, over that share of the budget; the
    decay of `linear` and `cosine` runs from `decay_start` (the share spent when warmup ended, which
    the trainer records; with warmup_fraction, that fraction) to the end of the budget.
    For 'noam', train.lr is the paper's scale factor."""
    lr, warmup = config.lr, config.warmup_steps
    if step <= 0:
        return 0.0
    if config.schedule == "noam":
        return lr * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    if config.warmup_fraction:
        if spent < config.warmup_fraction:
            return lr * spent / config.warmup_fraction
        decay_start = config.warmup_fraction
    elif step < warmup:
        return lr * step / warmup
    if config.schedule == "inverse_sqrt":
        return lr * math.sqrt(max(warmup, 1) / step)
    floor = config.min_lr
    if config.schedule == "wsd":
        start = 1.0 - config.cooldown_fraction
        if spent <= start:
            return lr
        through = min(1.0, (spent - start) / config.cooldown_fraction)
        left = 1.0 - (math.sqrt(through) if config.cooldown_shape == "sqrt" else through)
        return floor + (lr - floor) * left
    progress = 1.0 if decay_start >= 1.0 else min(1.0, max(0.0, (spent - decay_start) / (1.0 - decay_start)))
    if config.schedule == "linear":
        return floor + (lr - floor) * (1.0 - progress)
    if config.schedule == "cosine":
        return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return lr  # constant

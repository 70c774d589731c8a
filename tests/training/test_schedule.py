"""LR schedules against their formulas at step 0, mid-warmup, the peak and during decay, and the
budget they decay over (steps, time or epochs), measured as the trainer measures it."""

from __future__ import annotations

import math

import pytest

from seq2seq.checkpoint import Progress
from seq2seq.config import TrainConfig
from seq2seq.schema import section_problems
from seq2seq.training.schedule import budget_spent, learning_rate


def lr(schedule: str, step: int, **overrides) -> float:
    """The rate of a step budget of 1,100 updates with 100 of warmup, as the trainer computes it."""
    config = TrainConfig(**{"schedule": schedule, "lr": 1e-3, "warmup_steps": 100, "max_steps": 1100, **overrides})
    spent = budget_spent(Progress(step=step), config, batches_per_epoch=1)
    return learning_rate(step, config, d_model=512, spent=spent, decay_start=100 / 1100)


@pytest.mark.parametrize("schedule", ["inverse_sqrt", "linear", "cosine", "constant", "noam", "wsd"])
def test_every_schedule_starts_at_zero(schedule):
    assert lr(schedule, 0) == 0.0


@pytest.mark.parametrize("schedule", ["inverse_sqrt", "linear", "cosine", "constant", "wsd"])
def test_linear_warmup_to_the_peak(schedule):
    assert lr(schedule, 50) == pytest.approx(5e-4)
    assert lr(schedule, 100) == pytest.approx(1e-3)


def test_inverse_sqrt_decay():
    assert lr("inverse_sqrt", 400) == pytest.approx(1e-3 * math.sqrt(100 / 400))


def test_linear_decay_reaches_zero_at_max_steps():
    assert lr("linear", 600) == pytest.approx(5e-4)
    assert lr("linear", 1100) == pytest.approx(0.0)


def test_cosine_decay():
    assert lr("cosine", 600) == pytest.approx(5e-4)
    assert lr("cosine", 1100) == pytest.approx(0.0, abs=1e-12)


def test_decay_ends_at_the_floor():
    assert lr("linear", 600, min_lr=1e-4) == pytest.approx(5.5e-4)
    assert lr("linear", 1100, min_lr=1e-4) == pytest.approx(1e-4)
    assert lr("cosine", 1100, min_lr=1e-4) == pytest.approx(1e-4)


def test_constant_after_warmup():
    assert lr("constant", 1000) == pytest.approx(1e-3)


def test_wsd_holds_the_peak_then_cools_down_over_the_last_share_of_the_budget():
    """1,100 updates, cooldown over the last 20% (from update 880): the peak until then, and at the
    middle of the cooldown 1 - sqrt(0.5) of it (linear: a half); the floor at the end."""
    assert lr("wsd", 500) == lr("wsd", 880) == pytest.approx(1e-3)
    assert lr("wsd", 990) == pytest.approx(1e-3 * (1 - math.sqrt(0.5)))
    assert lr("wsd", 990, cooldown_shape="linear") == pytest.approx(5e-4)
    assert lr("wsd", 1100) == pytest.approx(0.0, abs=1e-12)
    assert lr("wsd", 1100, min_lr=1e-4) == pytest.approx(1e-4)
    timed = TrainConfig(lr=1e-3, schedule="wsd", warmup_fraction=0.1, cooldown_fraction=0.1, max_time=100.0)
    assert learning_rate(50, timed, d_model=512, spent=0.85) == pytest.approx(1e-3)
    assert learning_rate(80, timed, d_model=512, spent=0.95) == pytest.approx(1e-3 * (1 - math.sqrt(0.5)))


def test_noam_is_the_papers_formula():
    for step in (1, 50, 100, 400):
        expected = 2.0 * 512**-0.5 * min(step**-0.5, step * 100**-1.5)
        assert lr("noam", step, lr=2.0) == pytest.approx(expected)
    assert lr("noam", 100, lr=1.0) > lr("noam", 99, lr=1.0)
    assert lr("noam", 100, lr=1.0) > lr("noam", 101, lr=1.0)


def test_a_time_budget_is_spent_by_the_projected_end_of_the_update():
    """60 s of training over 5 updates (12 s each): the 6th will end at 72 s, 72/120 of the budget;
    the update that will end at the deadline is the last, at the floor."""
    config = TrainConfig(max_steps=100_000, max_time=120.0, schedule="linear", warmup_steps=0)
    assert budget_spent(Progress(step=6, train_seconds=60.0), config, batches_per_epoch=1) == pytest.approx(0.6)
    last = Progress(step=10, train_seconds=108.0)  # ends at 120 s
    assert budget_spent(last, config, batches_per_epoch=1) == pytest.approx(1.0)
    assert learning_rate(10, config, d_model=512, spent=1.0) == 0.0
    assert budget_spent(Progress(step=1), config, batches_per_epoch=1) == pytest.approx(1e-5)  # no time known yet


def test_the_budget_that_ends_first_sets_the_pace():
    config = TrainConfig(max_steps=1000, max_time=3600.0, max_epochs=2)
    mid_second_epoch = Progress(step=300, epoch=2, next_batch=50, train_seconds=299.0)
    assert budget_spent(mid_second_epoch, config, batches_per_epoch=100) == pytest.approx(0.75)  # 1.5 of 2 epochs
    slow = Progress(step=300, epoch=1, next_batch=50, train_seconds=2990.0)  # 10 s an update
    assert budget_spent(slow, config, batches_per_epoch=100) == pytest.approx(3000 / 3600)
    assert budget_spent(Progress(step=990), config, batches_per_epoch=100) == pytest.approx(0.99)


def test_warmup_over_a_share_of_the_budget():
    config = TrainConfig(lr=1e-3, schedule="linear", warmup_fraction=0.1, max_time=1000.0, min_lr=1e-4)
    assert learning_rate(7, config, d_model=512, spent=0.05) == pytest.approx(5e-4)
    assert learning_rate(9, config, d_model=512, spent=0.1) == pytest.approx(1e-3)
    assert learning_rate(30, config, d_model=512, spent=0.55) == pytest.approx(5.5e-4)
    assert learning_rate(60, config, d_model=512, spent=1.0) == pytest.approx(1e-4)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"warmup_fraction": 1.0}, "warmup_fraction"),
        ({"warmup_fraction": 0.1, "schedule": "inverse_sqrt"}, "warmup_fraction"),
        ({"min_lr": 0.01, "lr": 0.001}, "min_lr"),
        ({"schedule": "wsd", "warmup_fraction": 0.5, "cooldown_fraction": 0.6}, "cooldown_fraction"),
        ({"cooldown_fraction": 0.0}, "cooldown_fraction"),
    ],  # fmt: skip
)
def test_schedule_settings_that_cannot_work_are_named(overrides, key):
    assert key in [found for found, _ in section_problems(TrainConfig(**overrides))]

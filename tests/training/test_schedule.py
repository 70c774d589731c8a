"""LR schedules against their formulas at step 0, mid-warmup, the peak and during decay."""

from __future__ import annotations

import math

import pytest

from seq2seq.config import TrainConfig
from seq2seq.training.schedule import learning_rate


def lr(schedule: str, step: int, **overrides) -> float:
    config = TrainConfig(**{"schedule": schedule, "lr": 1e-3, "warmup_steps": 100, "max_steps": 1100, **overrides})
    return learning_rate(step, config, d_model=512)


@pytest.mark.parametrize("schedule", ["inverse_sqrt", "linear", "cosine", "constant", "noam"])
def test_every_schedule_starts_at_zero(schedule):
    assert lr(schedule, 0) == 0.0


@pytest.mark.parametrize("schedule", ["inverse_sqrt", "linear", "cosine", "constant"])
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


def test_constant_after_warmup():
    assert lr("constant", 1000) == pytest.approx(1e-3)


def test_noam_is_the_papers_formula():
    for step in (1, 50, 100, 400):
        expected = 2.0 * 512**-0.5 * min(step**-0.5, step * 100**-1.5)
        assert lr("noam", step, lr=2.0) == pytest.approx(expected)
    assert lr("noam", 100, lr=1.0) > lr("noam", 99, lr=1.0)
    assert lr("noam", 100, lr=1.0) > lr("noam", 101, lr=1.0)

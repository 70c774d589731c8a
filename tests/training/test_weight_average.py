"""The weight average against its formula by hand, and in training: resumed exactly, validated next to
the trained weights, and written to best.pt when it validates better."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from seq2seq.checkpoint import Checkpoint
from seq2seq.schema import section_problems
from seq2seq.training.weight_average import ExponentialAverage

from ..conftest import make_trainer


class Tied(nn.Module):
    """Two names for one weight, as share_embeddings gives the model."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(3, 2)
        self.out = nn.Linear(2, 3, bias=False)
        self.out.weight = self.embed.weight


def test_the_average_follows_its_formula_with_warm_up():
    model = Tied()
    start = model.embed.weight.detach().clone()
    average = ExponentialAverage(model, decay=0.9)
    with torch.no_grad():
        model.embed.weight.fill_(1.0)
    average.update(step=1)  # d = min(0.9, 2 / 11)
    expected = 2 / 11 * start + 9 / 11 * torch.ones(3, 2)
    torch.testing.assert_close(average.state_dict()["embed.weight"], expected)
    with torch.no_grad():
        model.embed.weight.fill_(2.0)
    average.update(step=100)  # d = 0.9: the warm-up is over
    expected = 0.9 * expected + 0.1 * torch.full((3, 2), 2.0)
    torch.testing.assert_close(average.state_dict()["embed.weight"], expected)
    state = average.model_state(model)
    torch.testing.assert_close(state["out.weight"], expected)  # the tied name holds the average too
    with average.swapped_in():
        torch.testing.assert_close(model.out.weight.detach(), expected)
    assert torch.equal(model.embed.weight.detach(), torch.full((3, 2), 2.0))  # the trained weights are back


def test_validation_scores_the_average_and_best_holds_the_better_weights(tmp_path, tiny_data):
    trainer = make_trainer(tmp_path, tiny_data, max_steps=60, valid_every=30, save_every=30, ema_decay=0.95)
    trainer.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in valid] == [30, 60] and all("ema_bleu" in r for r in valid)
    assert any(r["ema_bleu"] != r["bleu"] for r in valid)  # the average is not the trained weights
    best_record = max(valid, key=lambda r: max(r["bleu"], r["ema_bleu"]))
    best = Checkpoint.load(tmp_path / "run" / "checkpoints" / "best.pt")
    at_that_step = Checkpoint.load(tmp_path / "run" / "checkpoints" / f"step_{best_record['step']:08d}.pt")
    from_average = best_record["ema_bleu"] > best_record["bleu"]
    assert best.weights == ("ema" if from_average else "trained")
    expected = at_that_step.model
    if from_average:  # the numbered checkpoint's average, tied names included
        model = at_that_step.build_model()
        average = ExponentialAverage(model, decay=0.95)
        average.load_state_dict(at_that_step.ema)
        expected = average.model_state(model)
    assert set(best.model) == set(expected)
    for name, tensor in best.model.items():
        torch.testing.assert_close(tensor, expected[name], msg=name)


@pytest.mark.parametrize("decay", [0.0, 1.5])
def test_an_impossible_decay_is_named(decay, tmp_path, tiny_data):
    from seq2seq.config import TrainConfig

    problems = dict(section_problems(TrainConfig(ema_decay=decay)))
    assert ("ema_decay" in problems) == (decay >= 1.0)


@pytest.mark.parametrize("average_wins", [False, True])
def test_a_run_averages_its_last_saves_when_it_stops(tmp_path, tiny_data, monkeypatch, average_wins):
    """average_last 3: averaged.pt holds the mean of steps 20, 30 and 40 (not of the 10 before them),
    its validation is logged, and best.pt becomes the average exactly where it validates better."""
    from seq2seq.training.trainer import Trainer

    real = Trainer.evaluate_valid
    calls = []

    def evaluate(self, *between_batches):
        result = real(self, *between_batches)
        calls.append(result.scores.bleu)
        if len(calls) == 2:  # the second look at step 40, the average's: a stand-in BLEU, above or below
            bleu = dataclasses.replace(result.scores.get("bleu"), score=99.0 if average_wins else -1.0)
            others = [m for m in result.scores.metrics if m.name != "BLEU"]
            result = dataclasses.replace(result, scores=dataclasses.replace(result.scores, metrics=(bleu, *others)))
        return result

    monkeypatch.setattr(Trainer, "evaluate_valid", evaluate)
    trainer = make_trainer(tmp_path, tiny_data, max_steps=40, valid_every=40, save_every=10, average_last=3)
    trainer.run()
    folder = tmp_path / "run" / "checkpoints"
    saves = [Checkpoint.load(folder / f"step_{step:08d}.pt").model for step in (20, 30, 40)]
    averaged = Checkpoint.load(folder / "averaged.pt")
    for name, tensor in averaged.model.items():
        torch.testing.assert_close(tensor, torch.stack([save[name] for save in saves]).mean(0), msg=name)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "average"] == [40]
    best = Checkpoint.load(folder / "best.pt")
    assert best.weights == ("average" if average_wins else "trained")
    reference = averaged.model if average_wins else saves[-1]
    assert all(torch.equal(best.model[name], reference[name]) for name in reference)


def test_average_last_needs_the_saves_it_averages():
    from seq2seq.config import TrainConfig

    problems = dict(section_problems(TrainConfig(average_last=6, keep_last=5)))
    assert "expected 0 (off) or an integer in [2, keep_last (5)]" in problems["average_last"]

"""Validation during training: teacher-forced loss on the whole split and BLEU/chrF on a bounded sample."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch

from seq2seq.checkpoint import AVERAGED, BEST, Checkpoint, Progress, average_checkpoints, numbered_checkpoints
from seq2seq.config import TrainConfig
from seq2seq.data.batching import epoch_batches, make_batch
from seq2seq.data.prepare import TrainingData
from seq2seq.data.tokenizer import Tokenizer
from seq2seq.decoding import DecodeConfig
from seq2seq.evaluation.evaluate import translate_and_score
from seq2seq.evaluation.scoring import Scores
from seq2seq.inference.translator import Translator
from seq2seq.training.loss import output_layer_loss
from seq2seq.training.run_log import MetricsLog

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidationResult:
    loss: float  # NLL per target token (no smoothing)
    scores: Scores
    hypotheses: list[str]

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 50.0))


@torch.no_grad()
def validate(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    data: TrainingData,
    *,
    train: TrainConfig,
    decode: DecodeConfig,
    autocast: AbstractContextManager,
    between_batches: Callable[[], None] = lambda: None,
) -> ValidationResult:
    """Validation NLL per target token, and BLEU/chrF of at most train.valid_max_sentences translations
    (beam train.valid_beam, never sampled, the other decode settings as given). `between_batches` is
    called before each batch: an exception from it drops the validation (a stop request)."""
    device = next(model.parameters()).device
    model.eval()
    nll, tokens = 0.0, 0
    with autocast:  # the validation batches are the same every time: their shapes repeat
        for indices in epoch_batches(data.valid, max_tokens=train.max_tokens, seed=0, epoch=0):
            between_batches()
            batch = make_batch(data.valid, indices).to(device)
            rows = model(batch.src, batch.tgt_in, batch.target_positions, output_layer=False)
            nll += output_layer_loss(rows, model.output_proj.weight, batch.targets, 0.0).item()
            tokens += batch.num_tokens
    # Translated in fp32, as `seq2seq translate` does, so the BLEU printed is the one users will get
    # (and search's ever-changing row counts stay out of oneDNN's per-shape bf16 kernel cache).
    count = min(train.valid_max_sentences, len(data.valid_text))
    searched = dataclasses.replace(decode, beam=train.valid_beam, sample=False)
    translator = Translator.from_model(model, tokenizer, searched)
    evaluation = translate_and_score(
        translator, data.valid_text.src[:count], data.valid_text.tgt[:count], on_batch=lambda done: between_batches()
    )
    return ValidationResult(nll / max(tokens, 1), evaluation.scores, evaluation.hypotheses)


def metric_score(result: ValidationResult, metric: str) -> float:
    """A validation's train.best_metric, higher is better: BLEU or chrF, or the loss negated."""
    return -result.loss if metric == "loss" else getattr(result.scores, metric)


def best_so_far(progress: Progress, metric: str) -> float:
    """The score best.pt holds (metric_score), which a validation must beat to replace it."""
    if progress.best_score is not None:
        return progress.best_score
    return progress.best_bleu if metric == "bleu" else -math.inf  # a checkpoint from before best_metric


def record_best(progress: Progress, result: ValidationResult, metric: str) -> bool:
    """Whether `result` beats best.pt by `metric`; if so, `progress` records it as the new best."""
    if metric_score(result, metric) <= best_so_far(progress, metric):
        return False
    progress.best_score, progress.best_bleu = metric_score(result, metric), result.scores.bleu
    return True


def score_of_saved(path: Path, model: torch.nn.Module, evaluate: Callable[[], ValidationResult], metric: str) -> float:
    """The metric_score of the weights saved at `path`, validated in `model` (by `evaluate`), whose own
    weights are put back after."""
    trained = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    model.load_state_dict(Checkpoint.load(path).model)
    try:
        return metric_score(evaluate(), metric)
    finally:
        model.load_state_dict(trained)


def report_validation(
    metrics: MetricsLog,
    step: int,
    result: ValidationResult,
    averaged: ValidationResult | None,
    samples: list[tuple[str, str, str]],
) -> None:
    """A validation's log lines (its weights', the weight average's where one is kept, and a few
    sources, references and hypotheses) and its metrics record."""
    log.info(
        "step %d: valid loss %.3f, ppl %.2f, BLEU %.2f, chrF %.2f",
        step,
        result.loss,
        result.perplexity,
        result.scores.bleu,
        result.scores.chrf,
    )
    extra = {}
    if averaged is not None:
        log.info(
            "  weight average (ema): valid loss %.3f, BLEU %.2f, chrF %.2f",
            averaged.loss,
            averaged.scores.bleu,
            averaged.scores.chrf,
        )
        extra = {"ema_loss": averaged.loss, "ema_bleu": averaged.scores.bleu, "ema_chrf": averaged.scores.chrf}
    for src, ref, hyp in samples:
        log.info("  src: %s\n  ref: %s\n  hyp: %s", src, ref, hyp)
    metrics.write(
        "valid",
        step=step,
        loss=result.loss,
        ppl=result.perplexity,
        bleu=result.scores.bleu,
        chrf=result.scores.chrf,
        **extra,
    )


def average_last_saves(
    folder: Path,
    count: int,
    model: torch.nn.Module,
    evaluate: Callable[[], ValidationResult],
    progress: Progress,
    metrics: MetricsLog,
    metric: str,
) -> None:
    """Average the last `count` numbered checkpoints in `folder` into averaged.pt, validate it (the
    model takes its weights), and make it best.pt where it beats best.pt by `metric` (Vaswani et al.
    averaged the last 5; Popel & Bojar 2018 found it pays most after a decay)."""
    saves = numbered_checkpoints(folder)[-count:]
    if len(saves) < 2:
        log.info("average_last: %d checkpoint(s) saved; nothing to average", len(saves))
        return
    average_checkpoints(saves, folder / AVERAGED)
    averaged = Checkpoint.load(folder / AVERAGED)
    model.load_state_dict(averaged.model)
    result = evaluate()
    scores = result.scores
    log.info(
        "average of the last %d saves (%s): valid loss %.3f, BLEU %.2f, chrF %.2f",
        len(saves),
        ", ".join(path.name for path in saves),
        result.loss,
        scores.bleu,
        scores.chrf,
    )
    metrics.write("average", step=progress.step, loss=result.loss, bleu=scores.bleu, chrf=scores.chrf)
    if record_best(progress, result, metric):
        log.info("the average validates better by %s: it becomes best.pt", metric)
        best = dataclasses.replace(averaged, progress=dataclasses.replace(progress))
        best.save(folder / BEST)

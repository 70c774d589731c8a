"""Validation during training: teacher-forced loss on the whole split and BLEU/chrF on a bounded sample."""

from __future__ import annotations

import dataclasses
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from seq2seq.config import TrainConfig
from seq2seq.data.batching import epoch_batches, make_batch
from seq2seq.data.prepare import TrainingData
from seq2seq.data.tokenizer import Tokenizer
from seq2seq.decoding import DecodeConfig
from seq2seq.evaluation.evaluate import translate_and_score
from seq2seq.evaluation.scoring import Scores
from seq2seq.inference.translator import Translator
from seq2seq.training.loss import output_layer_loss


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
) -> ValidationResult:
    """Validation NLL per target token, and BLEU/chrF of at most train.valid_max_sentences translations
    (beam train.valid_beam, never sampled, the other decode settings as given)."""
    device = next(model.parameters()).device
    model.eval()
    nll, tokens = 0.0, 0
    with autocast:  # the validation batches are the same every time: their shapes repeat
        for indices in epoch_batches(data.valid, max_tokens=train.max_tokens, seed=0, epoch=0):
            batch = make_batch(data.valid, indices).to(device)
            rows = model(batch.src, batch.tgt_in, batch.target_positions, output_layer=False)
            nll += output_layer_loss(rows, model.output_proj.weight, batch.targets, 0.0).item()
            tokens += batch.num_tokens
    # Translated in fp32, as `seq2seq translate` does, so the BLEU printed is the one users will get
    # (and search's ever-changing row counts stay out of oneDNN's per-shape bf16 kernel cache).
    count = min(train.valid_max_sentences, len(data.valid_text))
    searched = dataclasses.replace(decode, beam=train.valid_beam, sample=False)
    translator = Translator.from_model(model, tokenizer, searched)
    evaluation = translate_and_score(translator, data.valid_text.src[:count], data.valid_text.tgt[:count])
    return ValidationResult(nll / max(tokens, 1), evaluation.scores, evaluation.hypotheses)

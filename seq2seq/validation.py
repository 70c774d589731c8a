"""Validation during training: teacher-forced loss on the whole split and BLEU/chrF on a bounded sample."""

from __future__ import annotations

import dataclasses
import math
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from seq2seq.config import Config
from seq2seq.data.batching import epoch_batches, make_batch
from seq2seq.data.prepare import TrainingData
from seq2seq.evaluate import Scores, score
from seq2seq.loss import label_smoothed_cross_entropy
from seq2seq.tokenizer import Tokenizer
from seq2seq.translate import translate_lines


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
    config: Config,
    autocast: AbstractContextManager,
) -> ValidationResult:
    """Validation NLL per target token, and BLEU/chrF of at most valid_max_sentences translations."""
    tc = config.train
    device = next(model.parameters()).device
    model.eval()
    nll, tokens = 0.0, 0
    with autocast:
        for indices in epoch_batches(data.valid, max_tokens=tc.max_tokens, seed=0, epoch=0):
            batch = make_batch(data.valid, indices).to(device)
            logits = model(batch.src, batch.tgt_in, batch.target_positions)
            nll += label_smoothed_cross_entropy(logits, batch.targets, 0.0).item()
            tokens += batch.num_tokens
        count = min(tc.valid_max_sentences, len(data.valid_text))
        decode = dataclasses.replace(config.decode, beam=tc.valid_beam, nbest=1)
        translations = translate_lines(model, tokenizer, data.valid_text.src[:count], decode)
    hypotheses = [t.text for t in translations]
    return ValidationResult(nll / max(tokens, 1), score(hypotheses, data.valid_text.tgt[:count]), hypotheses)

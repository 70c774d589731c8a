"""What every search shares: the contract it drives a model through (`Decoder`, `SearchCache`), a
finished `Hypothesis`, the next-token log-probabilities with their bans and forced tokens, the
length limits and the deadline.

search needs `encode`, `decode` and `new_cache` from the model, and `reorder` and `select` from its
cache; `Seq2SeqTransformer` with its `DecoderCache` is one implementation, `PrefixCache` serves
decoders that keep no keys/values (scripted test models, recomputing reference decoders).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from seq2seq.data.special_tokens import EOS_ID, NEVER_EMITTED, PAD_ID
from seq2seq.decoding import DecodeConfig
from seq2seq.inference.engine import DeadlinePassed


class SearchCache(Protocol):
    """What a decoder keeps between steps, one row per hypothesis (rows grouped by sentence)."""

    def reorder(self, rows: Tensor) -> None:
        """Keep (and repeat) the given hypothesis rows, in this order: the beams that survived a step."""

    def select(self, rows: Tensor, sentences: Tensor) -> None:
        """Keep the given hypothesis rows and source sentences: finished sentences leave the batch."""


class Decoder(Protocol):
    """The two-method model interface search drives (plus a fresh cache per batch)."""

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        """src (B, S) ids, src_mask (B, 1, 1, S) -> memory (B, S, d)."""

    def new_cache(self) -> SearchCache:
        """An empty cache for one batch of sentences."""

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor, cache: SearchCache) -> Tensor:
        """The new target positions tgt (N, 1), N = B * beams -> logits (N, 1, V); earlier ones come from `cache`."""


@dataclass(frozen=True)
class Hypothesis:
    tokens: list[int]  # without BOS/EOS
    score: float  # length-normalised log-probability
    log_prob: float  # plain sum of token log-probabilities (EOS included when emitted)


class PrefixCache:
    """A cache for decoders without keys/values to keep (scripted test models, recomputing reference
    decoders): it holds each row's prefix and is reordered like the real DecoderCache."""

    def __init__(self) -> None:
        self.prefixes: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.prefixes is None else self.prefixes.size(1)

    def append(self, tokens: Tensor) -> Tensor:
        """Add the new positions (N, T) and return the whole prefix."""
        self.prefixes = tokens if self.prefixes is None else torch.cat([self.prefixes, tokens], dim=1)
        return self.prefixes

    def reorder(self, rows: Tensor) -> None:
        self.prefixes = self.prefixes.index_select(0, rows)

    def select(self, rows: Tensor, sentences: Tensor) -> None:
        self.reorder(rows)


def check_deadline(deadline: float | None) -> None:
    """Stop a search whose caller has stopped waiting (a server request past its timeout): checked
    once per step, so the worker is free within one decoder step."""
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlinePassed


def max_output_lengths(src: Tensor, config: DecodeConfig) -> Tensor:
    """(B,) the most tokens each sentence may produce: a * source_length + b (DecodeConfig.output_limit)."""
    src_lengths = (src != PAD_ID).sum(1)
    return (config.max_len_a * src_lengths.float() + config.max_len_b).floor().long().clamp(min=1)


def length_normalized(log_prob: float, length: int, config: DecodeConfig) -> float:
    """`length` counts the output tokens with their EOS (without, for an output cut at the length
    limit: no EOS was emitted). The formula lives in DecodeConfig, which the CTranslate2 engine
    shares without importing torch."""
    return config.normalized_score(log_prob, length)


def next_log_probs(
    logits: Tensor,
    step: int,
    max_lengths: Tensor,
    config: DecodeConfig,
    prefixes: Tensor,
    *,
    shortest_limit: int,
    forced: Tensor | None = None,
    prefix_ends: Tensor | None = None,
) -> Tensor:
    """(N, V) logits -> log-probs with NEVER_EMITTED banned, EOS banned before min_len and forced at max
    length, (with no_repeat_ngram) tokens banned that would repeat an n-gram of the output, and
    (with `forced`, (N,) ids or -1) a target prefix's token the only one allowed, at log-probability 0.

    With `prefix_ends` (N,), each row's prefix length (beam search), EOS right after a prefix is
    kept only where it is the row's best token: CTranslate2's rule against outputs that stop where
    the prefix does (its issue #277), so that both engines run one search.

    `shortest_limit` is the smallest length limit of the batch, known on the host: before it no row
    can be at its limit, so the step asks the device nothing (a GPU is never waited for here)."""
    log_probs = logits.float().log_softmax(-1)
    for token in NEVER_EMITTED:  # one at a time: an index list would be a host tensor copied each step
        log_probs[:, token] = -math.inf
    if config.no_repeat_ngram:
        _ban_repeated_ngrams(log_probs, prefixes[:, 1:], config.no_repeat_ngram)
    if step < config.min_len:
        log_probs[:, EOS_ID] = -math.inf
    if prefix_ends is not None:
        right_after = (prefix_ends == step) & (prefix_ends > 0)
        log_probs[:, EOS_ID].masked_fill_(right_after & (log_probs[:, EOS_ID] < log_probs.max(-1).values), -math.inf)
    if step >= shortest_limit:
        at_limit = max_lengths <= step  # (N,)
        log_probs.masked_fill_(at_limit.unsqueeze(1), -math.inf)
        log_probs[:, EOS_ID].masked_fill_(at_limit, 0.0)
    if forced is not None:  # without reading the device: rows with no prefix token keep their values
        pinned = torch.full_like(log_probs, -math.inf).scatter_(1, forced.clamp(min=0).unsqueeze(1), 0.0)
        log_probs = torch.where((forced >= 0).unsqueeze(1), pinned, log_probs)
    return log_probs


def _ban_repeated_ngrams(log_probs: Tensor, output: Tensor, n: int) -> None:
    """Forbid, per row, every token that would complete an n-gram already in that row's output (N, L)."""
    if output.size(1) < n:
        return
    grams = output.unfold(1, n, 1)  # (N, L - n + 1, n): every n-gram so far
    context = output[:, output.size(1) - (n - 1) :]  # the last n - 1 tokens
    matches = (grams[:, :, :-1] == context[:, None, :]).all(-1)  # n-grams that the next token would repeat
    rows, starts = matches.nonzero(as_tuple=True)
    log_probs[rows, grams[rows, starts, -1]] = -math.inf

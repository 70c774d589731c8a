"""Sampling: the distribution a token is drawn from (temperature, top-k, top-p, epsilon), the
uniform numbers each line draws with, and the draw itself. search.py's sample_search runs it.

A line's draws come from a generator of its own, keyed by (seed, line number, draw), so its
samples never depend on the lines batched with it (docs/commands.md, the sampling contract).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from seq2seq.decoding import DecodeConfig


def sampling_candidates(log_probs: Tensor, config: DecodeConfig) -> tuple[Tensor, Tensor | None]:
    """(N, V) next-token log-probs -> the distribution samples are drawn from, as (N, C) probabilities
    of C candidate tokens and their (N, C) ids (None: the candidates are the whole vocabulary, C = V).

    Logits are divided by the temperature, then only the top_k most likely tokens stay, then of those
    (renormalised) the most likely whose probabilities sum to top_p, then those above epsilon; the
    most likely token always stays. The order of fairseq and HF; CTranslate2 applies top-k and top-p
    the same way. Truncation keeps only the few tokens it can keep, most likely first, so that drawing
    from them costs a fraction of a draw over the whole vocabulary (a top-p nucleus without top-k is
    looked for among the 64 most likely tokens, then 4x as many, until it fits: on a GPU that check
    reads the device once per step)."""
    # shifted so that the most likely token is at 0 before the division: a low temperature sends the
    # others to -inf, never the best one to NaN
    scaled = (
        log_probs if config.temperature == 1.0 else (log_probs - log_probs.amax(-1, keepdim=True)) / config.temperature
    )
    whole = scaled.logsumexp(-1, keepdim=True) if config.epsilon or not config.top_k else None  # log of the sum
    if config.top_k:
        values, ids = scaled.topk(min(config.top_k, scaled.size(-1)), dim=-1)  # most likely first
    elif config.top_p < 1.0:
        values, ids = _nucleus_candidates(scaled, whole, config.top_p)
    else:
        values, ids = scaled, None
    weights = (values - (values[:, :1] if whole is None else whole)).exp()  # banned tokens weigh 0
    if config.top_p == 1.0 and not config.epsilon:
        return weights / weights.sum(-1, keepdim=True), ids
    keep = torch.ones_like(weights, dtype=torch.bool)
    if config.top_p < 1.0:  # of the top-k tokens (renormalised), or of the whole vocabulary
        share = weights / weights.sum(-1, keepdim=True) if whole is None else weights
        keep &= share.cumsum(-1) - share < config.top_p  # the mass of the more likely tokens
    if config.epsilon:  # of the whole vocabulary
        keep &= (values - whole).exp() > config.epsilon
    keep.scatter_(-1, weights.argmax(-1, keepdim=True), True)  # column 0 once sorted
    kept = weights * keep
    return kept / kept.sum(-1, keepdim=True), ids


def _nucleus_candidates(scaled: Tensor, whole: Tensor, top_p: float) -> tuple[Tensor, Tensor]:
    """The m most likely tokens (values, ids; most likely first) for the smallest m tried that
    holds every row's top-p nucleus: it lies within them once their probabilities sum to top_p."""
    count = min(64, scaled.size(-1))
    values, ids = scaled.topk(count, dim=-1)
    while count < scaled.size(-1) and not bool(((values - whole).exp().sum(-1) >= top_p).all()):
        count = min(4 * count, scaled.size(-1))
        values, ids = scaled.topk(count, dim=-1)
    return values, ids


def sample_uniforms(seed: int, draws: list[tuple[int, int]], steps: int) -> Tensor:
    """(N, steps) uniform numbers in [0, 1), one row per (line number, draw) key: row r comes from a
    generator of its own, seeded from (seed, line, draw) by NumPy's SeedSequence (which makes the
    streams of nearby keys independent). A line's samples thus depend on the seed, its index in its
    file or request and the settings alone: never on the lines batched with it."""
    table = torch.empty(len(draws), steps)
    generator = torch.Generator()
    for row, (line, draw) in enumerate(draws):
        high, low = np.random.SeedSequence([seed, line, draw]).generate_state(2, np.uint32).tolist()
        generator.manual_seed(high << 32 | low)
        torch.rand(steps, generator=generator, out=table[row])
    return table


def draw_tokens(log_probs: Tensor, config: DecodeConfig, uniforms: Tensor) -> Tensor:
    """One token id per row (N,) drawn from sampling_candidates by inverting the cumulative
    distribution at the row's uniform point (N,) in [0, 1) (a fraction of torch.multinomial's cost
    on a CPU). A point that rounds to the end of the distribution takes its last token of non-zero
    probability."""
    probs, ids = sampling_candidates(log_probs, config)
    cumulative = probs.cumsum(-1)
    point = uniforms.unsqueeze(1).to(cumulative.dtype) * cumulative[:, -1:]
    last = cumulative.argmax(-1, keepdim=True)  # the first column that reaches the total
    column = torch.minimum(torch.searchsorted(cumulative, point, right=True), last)
    return (column if ids is None else ids.gather(1, column)).squeeze(1)

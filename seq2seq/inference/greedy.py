"""Greedy search, and sampling through the same loop (the draw itself: sampling.py): one hypothesis
per row, batched over sentences, finished rows leaving the batch so that later steps cost less."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seq2seq.data.special_tokens import BOS_ID, EOS_ID, padding_mask
from seq2seq.decoding import DecodeConfig
from seq2seq.inference.guidance import Guidance, forced_tokens
from seq2seq.inference.sampling import draw_tokens, sample_uniforms
from seq2seq.inference.search_steps import (
    Decoder,
    Hypothesis,
    check_deadline,
    length_normalized,
    max_output_lengths,
    next_log_probs,
)


@dataclass
class _Rows:
    """What greedy search keeps for each row still decoding; finished rows leave all of it together."""

    active: list[int]  # the original index of each row
    prefixes: Tensor  # (N, T) BOS and the tokens chosen so far
    totals: Tensor  # (N,) their log-probabilities
    max_lengths: Tensor  # (N,) length limits
    memory: Tensor
    src_mask: Tensor
    prefix_table: Tensor | None
    uniforms: Tensor | None  # (N, steps) each row's uniform numbers, when sampling

    def keep(self, rows: Tensor) -> None:
        self.active = [self.active[row] for row in rows.tolist()]
        self.prefixes, self.totals, self.max_lengths = self.prefixes[rows], self.totals[rows], self.max_lengths[rows]
        self.memory, self.src_mask = self.memory.index_select(0, rows), self.src_mask.index_select(0, rows)
        self.prefix_table = None if self.prefix_table is None else self.prefix_table[rows]
        self.uniforms = None if self.uniforms is None else self.uniforms[rows]


@torch.no_grad()
def greedy_search(
    model: Decoder,
    src: Tensor,
    config: DecodeConfig,
    *,
    draws: list[tuple[int, int]] | None = None,
    guidance: Guidance | None = None,
    deadline: float | None = None,
) -> list[list[Hypothesis]]:
    """The most likely next token at every step, for a batch of source sentences (B, S); with
    `draws`, each row's (line number, draw) key (sample_uniforms), a token drawn from
    sampling_candidates instead (sample_search).

    The host reads from the device once per step (which rows ended), and twice more on a step
    where some did (their tokens and totals): on a GPU each read waits for the queued work."""
    src_mask = padding_mask(src)
    cache = model.new_cache()
    guidance = guidance or Guidance.none(src.size(0))
    max_lengths = guidance.limits(max_output_lengths(src, config))
    limits = max_lengths.tolist()  # per original sentence, on the host
    shortest_limit = min(limits)
    uniforms = None if draws is None else sample_uniforms(config.seed, draws, max(limits) + 1).to(src.device)  # + EOS
    prefixes = torch.full((src.size(0), 1), BOS_ID, dtype=torch.long, device=src.device)
    rows = _Rows(
        list(range(src.size(0))),
        prefixes,
        torch.zeros(src.size(0), device=src.device),
        max_lengths,
        model.encode(src, src_mask),
        src_mask,
        guidance.prefix_table(src.device),
        uniforms,
    )
    results: list[list[Hypothesis]] = [[] for _ in range(src.size(0))]
    step = 0
    while rows.active:
        check_deadline(deadline)
        logits = model.decode(rows.prefixes[:, -1:], rows.memory, rows.src_mask, cache)[:, -1]
        log_probs = next_log_probs(
            logits,
            step,
            rows.max_lengths,
            config,
            rows.prefixes,
            shortest_limit=shortest_limit,
            forced=forced_tokens(rows.prefix_table, step),
        )
        best, best_log_prob = _choose(log_probs, config, rows, step, shortest_limit)
        rows.totals += best_log_prob
        done = best == EOS_ID
        done_rows = done.nonzero().squeeze(1)
        step += 1
        if done_rows.numel():
            _record(results, rows, done_rows, limits, config)
            keep = (~done).nonzero().squeeze(1)
            rows.keep(keep)
            cache.select(keep, keep)
            best = best[keep]
        rows.prefixes = torch.cat([rows.prefixes, best.unsqueeze(1)], dim=1)
    return results


def _record(
    results: list[list[Hypothesis]], rows: _Rows, done_rows: Tensor, limits: list[int], config: DecodeConfig
) -> None:
    """The hypotheses of the rows that ended with this step's token."""
    outputs = rows.prefixes.index_select(0, done_rows)[:, 1:].tolist()
    for row, tokens, total in zip(done_rows.tolist(), outputs, rows.totals[done_rows].tolist()):
        index = rows.active[row]
        length = len(tokens) + (len(tokens) < limits[index])  # no EOS counted when cut at the limit
        results[index] = [Hypothesis(tokens, length_normalized(total, length, config), total)]


def _choose(
    log_probs: Tensor, config: DecodeConfig, rows: _Rows, step: int, shortest_limit: int
) -> tuple[Tensor, Tensor]:
    """Each row's next token (N,) and its log-probability: the most likely one, or a drawn one when
    sampling (a row at its limit ends whatever it drew, as argmax ends it)."""
    if rows.uniforms is None:
        best_log_prob, best = log_probs.max(-1)
        return best, best_log_prob
    best = draw_tokens(log_probs, config, rows.uniforms[:, step])
    if step >= shortest_limit:
        best = best.masked_fill(rows.max_lengths <= step, EOS_ID)
    return best, log_probs.gather(1, best.unsqueeze(1)).squeeze(1)


def sample_search(
    model: Decoder,
    src: Tensor,
    config: DecodeConfig,
    *,
    lines: list[int] | None = None,
    guidance: Guidance | None = None,
    deadline: float | None = None,
) -> list[list[Hypothesis]]:
    """`nbest` outputs per source sentence, each drawn token by token from sampling_candidates
    (back-translation, diverse n-best lists); ranked like any n-best list by their normalised
    log-probability under the model (not under the filtered distribution). `lines`: each sentence's
    number in its file or request (default: its row), from which with the seed its draws come."""
    lines = list(range(src.size(0))) if lines is None else lines
    repeated = guidance.repeated(config.nbest) if guidance is not None else None
    keys = [(line, draw) for line in lines for draw in range(config.nbest)]
    draws = greedy_search(
        model, src.repeat_interleave(config.nbest, dim=0), config, draws=keys, guidance=repeated, deadline=deadline
    )
    grouped = [sum(draws[i : i + config.nbest], []) for i in range(0, len(draws), config.nbest)]
    return [sorted(hypotheses, key=lambda h: h.score, reverse=True) for hypotheses in grouped]

"""Beam search, batched over sentences. The beam update is the pure function `beam_step`; the loop
around it only calls the model, keeps finished hypotheses and drops finished sentences from the
batch; sentences with terminology constraints take their candidates from constraints.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from seq2seq.data.special_tokens import BOS_ID, EOS_ID, padding_mask
from seq2seq.decoding import DecodeConfig
from seq2seq.inference.constraints import ConstrainedBeams, Constraints, padded
from seq2seq.inference.guidance import Guidance, forced_tokens, prefix_ends
from seq2seq.inference.search_steps import (
    Decoder,
    Hypothesis,
    check_deadline,
    length_normalized,
    max_output_lengths,
    next_log_probs,
)


def beam_step(log_probs: Tensor, scores: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Pick the `width` best continuations of every sentence's beams.

    log_probs (B, K, V) for the next token of each beam, scores (B, K) of the beams so far.
    Returns (scores, tokens, beam_ids), each (B, width), best first.
    """
    batch, beams, vocab = log_probs.shape
    totals = (scores.unsqueeze(-1) + log_probs).view(batch, beams * vocab)
    best, flat = totals.topk(width, dim=-1)
    return best, flat % vocab, flat // vocab


@dataclass
class _Beams:
    """What beam search keeps for each sentence still decoding (`beam` rows each); finished
    sentences leave all of it together."""

    active: list[int]  # the original index of each sentence
    scores: Tensor  # (B, beam) of the hypotheses so far
    prefixes: Tensor  # (B * beam, T) BOS and their tokens
    max_lengths: Tensor  # (B,)
    memory: Tensor  # (B, S, d): one row per sentence, shared by its beams
    src_mask: Tensor
    prefix_table: Tensor | None

    @classmethod
    def start(cls, model: Decoder, src: Tensor, config: DecodeConfig, guidance: Guidance) -> _Beams:
        """Every sentence of `src` (B, S), encoded, with `beam` copies of BOS of which only the first may expand."""
        batch, beam, src_mask = src.size(0), config.beam, padding_mask(src)
        scores = torch.full((batch, beam), -math.inf, device=src.device)
        scores[:, 0] = 0.0  # all beams start identical: only the first may expand
        prefixes = torch.full((batch * beam, 1), BOS_ID, dtype=torch.long, device=src.device)
        max_lengths = guidance.limits(max_output_lengths(src, config))
        return cls(
            list(range(batch)),
            scores,
            prefixes,
            max_lengths,
            model.encode(src, src_mask),
            src_mask,
            guidance.prefix_table(src.device),
        )

    def keep(self, kept: list[int], beam: int) -> tuple[Tensor, Tensor]:
        """Keep the sentences at `kept`; their sentence and hypothesis rows, for the cache."""
        keep = torch.tensor(kept, dtype=torch.long, device=self.scores.device)
        keep_rows = (keep.unsqueeze(1) * beam + torch.arange(beam, device=keep.device)).view(-1)
        self.active = [self.active[row] for row in kept]
        self.scores, self.max_lengths = self.scores[keep], self.max_lengths[keep]
        self.prefixes = self.prefixes.index_select(0, keep_rows)
        self.memory, self.src_mask = self.memory.index_select(0, keep), self.src_mask.index_select(0, keep)
        self.prefix_table = None if self.prefix_table is None else self.prefix_table[keep]
        return keep, keep_rows


@torch.no_grad()
def beam_search(
    model: Decoder,
    src: Tensor,
    config: DecodeConfig,
    *,
    guidance: Guidance | None = None,
    deadline: float | None = None,
) -> list[list[Hypothesis]]:
    """Batched beam search; each sentence keeps its `nbest` best finished hypotheses, best first.

    Which sentences are done is decided on the host from counts it keeps; the device is read once
    per step for the hypotheses that ended (their rows, tokens and scores, in three reads), and for
    the candidates of sentences with constraints."""
    beam, batch, device = config.beam, src.size(0), src.device
    cache, guidance = model.new_cache(), guidance or Guidance.none(batch)
    state = _Beams.start(model, src, config, guidance)
    limits = state.max_lengths.tolist()  # per original sentence, on the host
    shortest_limit = min(limits)
    constrained = {
        index: ConstrainedBeams(Constraints(phrases, guidance.continuations), beam)
        for index, phrases in enumerate(guidance.constraints)
        if any(phrases)
    }
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    step = 0
    while state.active:
        check_deadline(deadline)
        logits = model.decode(state.prefixes[:, -1:], state.memory, state.src_mask, cache)[:, -1]
        log_probs = next_log_probs(
            logits,
            step,
            state.max_lengths.repeat_interleave(beam),
            config,
            state.prefixes,
            shortest_limit=shortest_limit,
            forced=forced_tokens(state.prefix_table, step, beam),
            prefix_ends=prefix_ends(state.prefix_table, step, beam),
        )
        log_probs = log_probs.view(len(state.active), beam, -1)
        cand_scores, cand_tokens, cand_beams = beam_step(log_probs, state.scores, 2 * beam)
        guided = [row for row, index in enumerate(state.active) if index in constrained]
        ends = _ends(cand_scores, cand_tokens, beam, step + 1 >= shortest_limit, state.active, limits, step, guided)
        _finish(finished, state.active, state.prefixes, cand_scores, cand_tokens, cand_beams, ends, config)
        # The best `beam` non-EOS candidates continue.
        open_scores = cand_scores.masked_fill(cand_tokens == EOS_ID, -math.inf)
        previous, (state.scores, pick) = state.scores, open_scores.topk(beam, dim=-1)
        tokens, beams = cand_tokens.gather(1, pick), cand_beams.gather(1, pick)
        for row in guided:  # their hypotheses end, and continue, by the constraints' rule
            continuing = _constrained_step(constrained, finished, state, row, log_probs, previous, limits, step, config)
            state.scores[row], tokens[row], beams[row] = padded(continuing, beam, device)
        rows = (torch.arange(len(state.active), device=device).unsqueeze(1) * beam + beams).view(-1)
        cache.reorder(rows)
        state.prefixes = torch.cat([state.prefixes.index_select(0, rows), tokens.view(-1, 1)], dim=1)
        step += 1
        done = [len(finished[i]) >= config.finished_per_sentence or limits[i] <= step for i in state.active]
        if any(done):
            keep, keep_rows = state.keep([row for row, ended in enumerate(done) if not ended], beam)
            cache.select(keep_rows, keep)
    return [sorted(hyps, key=lambda h: h.score, reverse=True)[: config.nbest] for hyps in finished]


def _constrained_step(
    constrained: dict[int, ConstrainedBeams],
    finished: list[list[Hypothesis]],
    state: _Beams,
    row: int,
    log_probs: Tensor,
    previous: Tensor,
    limits: list[int],
    step: int,
    config: DecodeConfig,
) -> list:
    """One constrained sentence's step (the sentence at `row`): its ended candidates become finished
    hypotheses; those that continue are returned (constraints.Candidate)."""
    index = state.active[row]
    ended, continuing = constrained[index].step(
        log_probs[row], previous[row], at_limit=limits[index] <= step + 1, none_finished=not finished[index]
    )
    _finish_constrained(finished[index], state.prefixes[row * config.beam : (row + 1) * config.beam], ended, config)
    return continuing


def _ends(
    cand_scores: Tensor,
    cand_tokens: Tensor,
    beam: int,
    near_limit: bool,
    active: list[int],
    limits: list[int],
    step: int,
    guided: list[int],
) -> Tensor:
    """(B, beam) which of the best `beam` candidates end a hypothesis: an EOS among them (fairseq's
    rule; keeps beam 1 == greedy), or every one at its sentence's last token. Constrained
    sentences end theirs by the constraints' rule instead."""
    ends = (cand_tokens[:, :beam] == EOS_ID) & (cand_scores[:, :beam] > -math.inf)
    if near_limit:  # some sentence may be at its last token
        at_limit = torch.tensor([limits[i] <= step + 1 for i in active], device=cand_scores.device)
        ends |= (cand_scores[:, :beam] > -math.inf) & at_limit.unsqueeze(1)
    if guided:
        ends[guided] = False
    return ends


def _finish(
    finished: list[list[Hypothesis]],
    active: list[int],
    prefixes: Tensor,
    cand_scores: Tensor,
    cand_tokens: Tensor,
    cand_beams: Tensor,
    ends: Tensor,
    config: DecodeConfig,
) -> None:
    """Keep the candidates marked in `ends` (B, width) as finished hypotheses: one ending in EOS, or
    one cut at its sentence's length limit (its last token kept; its length counts no EOS)."""
    rows, ranks = ends.nonzero(as_tuple=True)
    if not rows.numel():
        return
    beam = prefixes.size(0) // len(active)
    beam_rows = rows * beam + cand_beams[rows, ranks]
    outputs = prefixes.index_select(0, beam_rows)[:, 1:].tolist()
    for row, tokens, token, total in zip(
        rows.tolist(), outputs, cand_tokens[rows, ranks].tolist(), cand_scores[rows, ranks].tolist()
    ):
        length = len(tokens) + 1  # with its EOS, or with the token that reached the limit
        tokens = tokens if token == EOS_ID else [*tokens, token]
        finished[active[row]].append(Hypothesis(tokens, length_normalized(total, length, config), total))


def _finish_constrained(finished: list[Hypothesis], prefixes: Tensor, ended: list, config: DecodeConfig) -> None:
    """Keep a constrained sentence's ended candidates (constraints.Candidate) as finished hypotheses;
    `prefixes` holds its beams' outputs so far."""
    outputs = prefixes[:, 1:].tolist() if ended else []
    for candidate in ended:
        tokens = outputs[candidate.beam]
        length = len(tokens) + 1  # with its EOS, or with the token that reached the limit
        tokens = tokens if candidate.token == EOS_ID else [*tokens, candidate.token]
        finished.append(Hypothesis(tokens, length_normalized(candidate.score, length, config), candidate.score))

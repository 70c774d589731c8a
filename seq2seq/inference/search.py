"""Greedy and beam search, and sampling through the greedy loop (the draw itself: sampling.py),
batched over sentences, on any model that honours the `Decoder` contract.

The contract is written here, as Protocols: search needs `encode`, `decode` and `new_cache` from
the model, and `reorder` and `select` from its cache; `Seq2SeqTransformer` with its `DecoderCache`
is one implementation, `PrefixCache` serves decoders that keep no keys/values (scripted test
models, recomputing reference decoders). The beam update is the pure function `beam_step`; the
loops around it only call the model, keep finished hypotheses and drop finished sentences from
the batch so that later steps cost less.

Two kinds of guidance apply per sentence. A target prefix is forced token by token (only the
prefix's token is allowed, at log-probability 0: as CTranslate2 does, a score counts the tokens
the search chose, normalised by the whole output's length; beam search ends a hypothesis right
after its prefix only where EOS is the best token). Terminology constraints run through
constraints.py's dynamic beam allocation, for the sentences that have some. Every loop checks a
deadline before each decoder step, so a server request whose client has gone frees the worker.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from seq2seq.data.special_tokens import BOS_ID, EOS_ID, PAD_ID, padding_mask
from seq2seq.decoding import DecodeConfig, guidance_limit
from seq2seq.inference.constraints import ConstrainedBeams, Constraints, padded
from seq2seq.inference.engine import DeadlinePassed
from seq2seq.inference.sampling import draw_tokens, sample_uniforms


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


def _check(deadline: float | None) -> None:
    """Stop a search whose caller has stopped waiting (a server request past its timeout): checked
    once per step, so the worker is free within one decoder step."""
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlinePassed


def max_output_lengths(src: Tensor, config: DecodeConfig) -> Tensor:
    """(B,) the most tokens each sentence may produce: a * source_length + b (DecodeConfig.output_limit)."""
    src_lengths = (src != PAD_ID).sum(1)
    return (config.max_len_a * src_lengths.float() + config.max_len_b).floor().long().clamp(min=1)


@dataclass(frozen=True)
class Guidance:
    """Per sentence of a batch: a target prefix to force ([] for none) and target phrases that must
    appear ([] for none), as token ids; and the ids of the pieces that continue a word
    (constraints.Constraints says why)."""

    prefixes: list[list[int]]
    constraints: list[list[list[int]]]
    continuations: frozenset[int] = frozenset()

    @classmethod
    def none(cls, sentences: int) -> Guidance:
        return cls([[] for _ in range(sentences)], [[] for _ in range(sentences)])

    def limits(self, lengths: Tensor) -> Tensor:
        """The length limits (B,) with room for the guidance: a prefix raises a sentence's limit to
        its length + 1 (guidance_limit), the constraint tokens add to it."""
        prefixes = [len(prefix) for prefix in self.prefixes]
        extra = [sum(len(phrase) for phrase in phrases) for phrases in self.constraints]
        limits = [
            guidance_limit(limit, prefix) + added for limit, prefix, added in zip(lengths.tolist(), prefixes, extra)
        ]
        return torch.tensor(limits, dtype=torch.long, device=lengths.device)

    def prefix_table(self, device: torch.device) -> Tensor | None:
        """(B, longest prefix) of prefix token ids, -1 past each prefix's end; None without prefixes."""
        longest = max(map(len, self.prefixes), default=0)
        if not longest:
            return None
        rows = [prefix + [-1] * (longest - len(prefix)) for prefix in self.prefixes]
        return torch.tensor(rows, dtype=torch.long, device=device)

    def subset(self, sentences: list[int]) -> Guidance:
        return Guidance(
            [self.prefixes[i] for i in sentences], [self.constraints[i] for i in sentences], self.continuations
        )

    def repeated(self, times: int) -> Guidance:
        """Each sentence's guidance `times` times in a row (sampling draws a line several times)."""
        return Guidance(
            [p for p in self.prefixes for _ in range(times)],
            [c for c in self.constraints for _ in range(times)],
            self.continuations,
        )


def _forced(table: Tensor | None, step: int, beam: int = 1) -> Tensor | None:
    """(N,) this step's prefix token of each row (-1 where none), or None once every prefix is done."""
    if table is None or step >= table.size(1):
        return None
    column = table[:, step]
    return column.repeat_interleave(beam) if beam > 1 else column


def _prefix_ends(table: Tensor | None, step: int, beam: int) -> Tensor | None:
    """(N,) each row's prefix length (0 where none), or None once every prefix is done and followed."""
    if table is None or step > table.size(1):
        return None
    return (table >= 0).sum(1).repeat_interleave(beam)


def length_normalized(log_prob: float, length: int, config: DecodeConfig) -> float:
    """`length` counts the output tokens with their EOS (without, for an output cut at the length
    limit: no EOS was emitted). The formula lives in DecodeConfig, which the CTranslate2 engine
    shares without importing torch."""
    return config.normalized_score(log_prob, length)


def beam_step(log_probs: Tensor, scores: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Pick the `width` best continuations of every sentence's beams.

    log_probs (B, K, V) for the next token of each beam, scores (B, K) of the beams so far.
    Returns (scores, tokens, beam_ids), each (B, width), best first.
    """
    batch, beams, vocab = log_probs.shape
    totals = (scores.unsqueeze(-1) + log_probs).view(batch, beams * vocab)
    best, flat = totals.topk(width, dim=-1)
    return best, flat % vocab, flat // vocab


def _next_log_probs(
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
    """(N, V) logits -> log-probs with PAD/BOS banned, EOS banned before min_len and forced at max
    length, (with no_repeat_ngram) tokens banned that would repeat an n-gram of the output, and
    (with `forced`, (N,) ids or -1) a target prefix's token the only one allowed, at log-probability 0.

    With `prefix_ends` (N,), each row's prefix length (beam search), EOS right after a prefix is
    kept only where it is the row's best token: CTranslate2's rule against outputs that stop where
    the prefix does (its issue #277), so that both engines run one search.

    `shortest_limit` is the smallest length limit of the batch, known on the host: before it no row
    can be at its limit, so the step asks the device nothing (a GPU is never waited for here)."""
    log_probs = logits.float().log_softmax(-1)
    log_probs[:, PAD_ID] = -math.inf
    log_probs[:, BOS_ID] = -math.inf
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
    memory = model.encode(src, src_mask)
    cache = model.new_cache()
    guidance = guidance or Guidance.none(src.size(0))
    max_lengths = guidance.limits(max_output_lengths(src, config))
    limits = max_lengths.tolist()  # per original sentence, on the host
    shortest_limit = min(limits)
    uniforms = None if draws is None else sample_uniforms(config.seed, draws, max(limits) + 1).to(src.device)  # + EOS
    prefix_table = guidance.prefix_table(src.device)
    active = list(range(src.size(0)))  # original index of each row still decoding
    prefixes = torch.full((src.size(0), 1), BOS_ID, dtype=torch.long, device=src.device)
    totals = torch.zeros(src.size(0), device=src.device)
    results: list[list[Hypothesis]] = [[] for _ in range(src.size(0))]
    step = 0
    while active:
        _check(deadline)
        logits = model.decode(prefixes[:, -1:], memory, src_mask, cache)[:, -1]
        log_probs = _next_log_probs(
            logits,
            step,
            max_lengths,
            config,
            prefixes,
            shortest_limit=shortest_limit,
            forced=_forced(prefix_table, step),
        )
        if uniforms is None:
            best_log_prob, best = log_probs.max(-1)
        else:
            best = draw_tokens(log_probs, config, uniforms[:, step])
            if step >= shortest_limit:  # a row at its limit ends, whatever the draw (as argmax ends it)
                best = best.masked_fill(max_lengths <= step, EOS_ID)
            best_log_prob = log_probs.gather(1, best.unsqueeze(1)).squeeze(1)
        totals += best_log_prob
        done = best == EOS_ID
        done_rows = done.nonzero().squeeze(1)
        step += 1
        if done_rows.numel():
            outputs, done_totals = prefixes.index_select(0, done_rows)[:, 1:].tolist(), totals[done_rows].tolist()
            for row, tokens, total in zip(done_rows.tolist(), outputs, done_totals):
                length = len(tokens) + (len(tokens) < limits[active[row]])  # no EOS counted when cut at the limit
                results[active[row]] = [Hypothesis(tokens, length_normalized(total, length, config), total)]
            keep = (~done).nonzero().squeeze(1)
            active = [active[row] for row in keep.tolist()]
            prefixes, totals, max_lengths = prefixes[keep], totals[keep], max_lengths[keep]
            memory, src_mask = memory.index_select(0, keep), src_mask.index_select(0, keep)
            prefix_table = None if prefix_table is None else prefix_table[keep]
            uniforms = None if uniforms is None else uniforms[keep]
            cache.select(keep, keep)
            best = best[keep]
        prefixes = torch.cat([prefixes, best.unsqueeze(1)], dim=1)
    return results


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
    beam, enough = config.beam, config.finished_per_sentence
    batch = src.size(0)
    src_mask = padding_mask(src)
    memory = model.encode(src, src_mask)  # (B, S, d): one row per sentence, shared by its beams
    cache = model.new_cache()
    guidance = guidance or Guidance.none(batch)
    max_lengths = guidance.limits(max_output_lengths(src, config))
    limits = max_lengths.tolist()  # per original sentence, on the host
    shortest_limit = min(limits)
    prefix_table = guidance.prefix_table(src.device)
    constrained = {
        index: ConstrainedBeams(Constraints(phrases, guidance.continuations), beam)
        for index, phrases in enumerate(guidance.constraints)
        if any(phrases)
    }
    active = list(range(batch))
    scores = torch.full((batch, beam), -math.inf, device=src.device)
    scores[:, 0] = 0.0  # all beams start identical: only the first may expand
    prefixes = torch.full((batch * beam, 1), BOS_ID, dtype=torch.long, device=src.device)
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    step = 0
    while active:
        _check(deadline)
        logits = model.decode(prefixes[:, -1:], memory, src_mask, cache)[:, -1]
        row_max = max_lengths.repeat_interleave(beam)
        log_probs = _next_log_probs(
            logits,
            step,
            row_max,
            config,
            prefixes,
            shortest_limit=shortest_limit,
            forced=_forced(prefix_table, step, beam),
            prefix_ends=_prefix_ends(prefix_table, step, beam),
        )
        log_probs = log_probs.view(len(active), beam, -1)
        cand_scores, cand_tokens, cand_beams = beam_step(log_probs, scores, 2 * beam)
        # An EOS among the top `beam` candidates ends a hypothesis (fairseq's rule; keeps beam 1 == greedy).
        ends = (cand_tokens[:, :beam] == EOS_ID) & (cand_scores[:, :beam] > -math.inf)
        if step + 1 >= shortest_limit:  # at a sentence's last token its best `beam` candidates all end
            at_limit = torch.tensor([limits[i] <= step + 1 for i in active], device=src.device)
            ends |= (cand_scores[:, :beam] > -math.inf) & at_limit.unsqueeze(1)
        guided = [row for row, index in enumerate(active) if index in constrained]
        if guided:  # their hypotheses end by the constraints' rule below
            ends[guided] = False
        _finish(finished, active, prefixes, cand_scores, cand_tokens, cand_beams, ends, config)
        # The best `beam` non-EOS candidates continue.
        open_scores = cand_scores.masked_fill(cand_tokens == EOS_ID, -math.inf)
        previous, (scores, pick) = scores, open_scores.topk(beam, dim=-1)
        tokens, beams = cand_tokens.gather(1, pick), cand_beams.gather(1, pick)
        for row in guided:
            index = active[row]
            last = limits[index] <= step + 1
            ended, continuing = constrained[index].step(
                log_probs[row], previous[row], at_limit=last, none_finished=not finished[index]
            )
            _finish_constrained(finished[index], prefixes[row * beam : (row + 1) * beam], ended, config)
            scores[row], tokens[row], beams[row] = padded(continuing, beam, src.device)
        rows = (torch.arange(len(active), device=src.device).unsqueeze(1) * beam + beams).view(-1)
        cache.reorder(rows)
        prefixes = torch.cat([prefixes.index_select(0, rows), tokens.view(-1, 1)], dim=1)
        step += 1
        done = [len(finished[i]) >= enough or limits[i] <= step for i in active]
        if any(done):
            kept = [row for row, ended in enumerate(done) if not ended]
            keep = torch.tensor(kept, dtype=torch.long, device=src.device)
            keep_rows = (keep.unsqueeze(1) * beam + torch.arange(beam, device=src.device)).view(-1)
            active = [active[row] for row in kept]
            scores, max_lengths = scores[keep], max_lengths[keep]
            prefixes = prefixes.index_select(0, keep_rows)
            memory, src_mask = memory.index_select(0, keep), src_mask.index_select(0, keep)
            prefix_table = None if prefix_table is None else prefix_table[keep]
            cache.select(keep_rows, keep)
    return [sorted(hyps, key=lambda h: h.score, reverse=True)[: config.nbest] for hyps in finished]


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


def search(
    model: Decoder,
    src: Tensor,
    config: DecodeConfig,
    *,
    lines: list[int] | None = None,
    guidance: Guidance | None = None,
    deadline: float | None = None,
) -> list[list[Hypothesis]]:
    """Sampling when asked for (`lines`: sample_search's keys), else greedy when beam is 1 and no
    sentence has constraints, else beam search (constraints need its candidates, even at beam 1).
    Past `deadline` (a time.monotonic()), DeadlinePassed."""
    constrained = guidance is not None and any(map(any, guidance.constraints))
    if config.sample:
        if constrained:
            raise ValueError("terminology constraints cannot be sampled")
        return sample_search(model, src, config, lines=lines, guidance=guidance, deadline=deadline)
    if config.beam == 1 and not constrained:
        return greedy_search(model, src, config, guidance=guidance, deadline=deadline)
    return beam_search(model, src, config, guidance=guidance, deadline=deadline)

"""Terminology constraints in beam search: target phrases that must appear in a line's output.

The method follows dynamic beam allocation (Post & Vilar 2018, "Fast Lexically Constrained
Decoding with Dynamic Beam Allocation"). Each step, a constrained sentence's candidates are its
best continuations overall, each hypothesis's own best next token, and every token that would
advance one of its unmet phrases; a candidate's bank is the number of constraint tokens it has met.
Post & Vilar share the beam equally among the banks; here the beam takes the best candidates by
score, and one slot is reserved for the best candidate of the most advanced bank when none of them
is in it. That reserved slot is what the guarantee needs (the most advanced hypothesis can always
take its next constraint token, so some hypothesis meets every phrase within their total length,
and the length limit grows by that much), while the rest of the beam searches as if unconstrained,
so a phrase lands where the model would put it (benchmark_decoding_features compares both
allocations). A hypothesis may end (EOS, among the best `beam` candidates as in ordinary search)
only once it meets every phrase, so every output of a constrained line contains every phrase.
Candidates are chosen on the host for constrained sentences only: an unconstrained sentence in the
same batch goes through the ordinary beam step unchanged. A phrase started and broken off loses its
progress; a phrase followed by a piece that continues the word is not met.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from seq2seq.data.special_tokens import EOS_ID, PAD_ID


@dataclass(frozen=True)
class ConstraintState:
    """Which phrases one hypothesis has met, and how far into another it is (phrase, tokens matched)."""

    met: tuple[bool, ...]
    progress: tuple[int, int] | None = None
    closing: int | None = None  # the phrase the last token completed: met only if the next token starts a word


@dataclass(frozen=True)
class Candidate:
    score: float  # the hypothesis's log-probability with this token
    beam: int  # the hypothesis it extends
    token: int
    state: ConstraintState  # after the token


class Constraints:
    """One sentence's phrases (target token ids) and how a hypothesis's state moves with each token.

    `continuations` are the ids of pieces that continue a word (SentencePiece pieces without the
    word-start mark): a phrase followed by one is not met (the phrase "plet" is not in "pletin")."""

    def __init__(self, phrases: list[list[int]], continuations: frozenset[int] = frozenset()) -> None:
        self.phrases = [list(phrase) for phrase in phrases if phrase]
        self.continuations = continuations
        self.initial = ConstraintState((False,) * len(self.phrases))

    def advance(self, state: ConstraintState, token: int) -> ConstraintState:
        met = state.met
        if state.closing is not None and token in self.continuations:  # "plet" went on into "pletin"
            met = met[: state.closing] + (False,) + met[state.closing + 1 :]
        if state.progress is not None:
            phrase, matched = state.progress
            if self.phrases[phrase][matched] == token:
                if matched + 1 == len(self.phrases[phrase]):
                    return ConstraintState(_with(met, phrase), closing=phrase)
                return ConstraintState(met, (phrase, matched + 1))
        for phrase, tokens in enumerate(self.phrases):  # a new phrase starts (the first unmet one that fits)
            if not met[phrase] and tokens[0] == token:
                if len(tokens) == 1:
                    return ConstraintState(_with(met, phrase), closing=phrase)
                return ConstraintState(met, (phrase, 1))
        return ConstraintState(met)

    def wanted(self, state: ConstraintState) -> set[int]:
        """The tokens that would advance the hypothesis: its phrase's next one, any unmet phrase's first."""
        tokens = {phrase[0] for phrase, done in zip(self.phrases, state.met) if not done}
        if state.progress is not None:
            phrase, matched = state.progress
            tokens.add(self.phrases[phrase][matched])
        return tokens

    def met_tokens(self, state: ConstraintState) -> int:
        """The bank of a hypothesis: constraint tokens met so far."""
        done = sum(len(phrase) for phrase, met in zip(self.phrases, state.met) if met)
        return done + (state.progress[1] if state.progress is not None else 0)

    @property
    def total_tokens(self) -> int:
        return sum(len(phrase) for phrase in self.phrases)

    def complete(self, state: ConstraintState) -> bool:
        return all(state.met)


def _with(met: tuple[bool, ...], phrase: int) -> tuple[bool, ...]:
    return met[:phrase] + (True,) + met[phrase + 1 :]


class ConstrainedBeams:
    """The constraint states of one sentence's beams, and its beam step (dynamic beam allocation)."""

    def __init__(self, constraints: Constraints, beam: int) -> None:
        self.constraints, self.beam = constraints, beam
        self.states = [constraints.initial] * beam
        self._continuations: Tensor | None = None  # (V,) mask of constraints.continuations, made on first use

    def step(
        self, log_probs: Tensor, scores: Tensor, *, at_limit: bool, none_finished: bool
    ) -> tuple[list[Candidate], list[Candidate]]:
        """log_probs (K, V) of the next token of each beam, scores (K,) of the beams so far ->
        (the candidates that end a hypothesis, the `beam` candidates that continue, best first; fewer
        when fewer are alive). The beams' states move to the continuing candidates'. At the length
        limit the best complete candidates end; incomplete ones only if the sentence has no output
        yet (a phrase that cannot be produced: banned by no_repeat_ngram or a prefix)."""
        ranked = sorted(self._candidates(log_probs, scores), key=_by_score)
        if at_limit:
            complete = [c for c in ranked if self.constraints.complete(c.state)]
            return (complete or (ranked if none_finished else []))[: self.beam], []
        ended = [c for c in ranked[: self.beam] if c.token == EOS_ID]  # EOS among the best, as in any search
        reserved = self._most_advanced(ranked)
        if reserved is not None and reserved.token == EOS_ID and reserved not in ended:
            ended.append(reserved)  # the reserved slot's hypothesis ends where the model ends it
        continuing = self._allocate([c for c in ranked if c.token != EOS_ID])
        self.states = [c.state for c in continuing] + [self.constraints.initial] * (self.beam - len(continuing))
        return ended, continuing

    def _candidates(self, log_probs: Tensor, scores: Tensor) -> list[Candidate]:
        totals = scores.unsqueeze(1) + log_probs  # (K, V)
        unfinished = [k for k, state in enumerate(self.states) if not self.constraints.complete(state)]
        if unfinished:  # no EOS before every phrase is in (EOS candidates would crowd the top ones)
            totals[unfinished, EOS_ID] = -math.inf
        vocab = totals.size(1)
        pairs = {divmod(flat, vocab) for flat in totals.view(-1).topk(2 * self.beam).indices.tolist()}
        pairs.update(enumerate(totals.argmax(-1).tolist()))
        closing = [k for k, state in enumerate(self.states) if state.closing is not None]
        if closing and self.constraints.continuations:  # the best way to keep a just-met phrase a whole word
            words = totals[closing].masked_fill(self._continuation_mask(vocab, totals.device), -math.inf)
            pairs.update(zip(closing, words.argmax(-1).tolist()))
        pairs.update((k, token) for k, state in enumerate(self.states) for token in self.constraints.wanted(state))
        ordered = sorted(pairs)
        values = totals[[k for k, _ in ordered], [token for _, token in ordered]].tolist()
        return [
            Candidate(value, k, token, self._after(k, token))
            for (k, token), value in zip(ordered, values)
            if value > -math.inf
        ]

    def _continuation_mask(self, vocab: int, device: torch.device) -> Tensor:
        if self._continuations is None:
            self._continuations = torch.zeros(vocab, dtype=torch.bool, device=device)
            self._continuations[list(self.constraints.continuations)] = True
        return self._continuations

    def _after(self, beam: int, token: int) -> ConstraintState:
        state = self.states[beam]
        return state if token == EOS_ID else self.constraints.advance(state, token)

    def _allocate(self, ranked: list[Candidate]) -> list[Candidate]:
        """The best `beam` of the `ranked` candidates, one of them from the most advanced bank; best first."""
        chosen = ranked[: self.beam]
        reserved = self._most_advanced(ranked)
        if reserved is not None and reserved not in chosen:
            chosen = [*chosen[: self.beam - 1], reserved]
        return chosen

    def _most_advanced(self, ranked: list[Candidate]) -> Candidate | None:
        """The best of the `ranked` candidates that have met the most constraint tokens."""
        if not ranked:
            return None
        met = [self.constraints.met_tokens(c.state) for c in ranked]
        return ranked[met.index(max(met))]


def _by_score(candidate: Candidate) -> float:
    return -candidate.score


def padded(continuing: list[Candidate], beam: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(scores, tokens, beams), each (beam,), of the continuing candidates; missing slots are dead beams."""
    missing = beam - len(continuing)
    scores = [c.score for c in continuing] + [-math.inf] * missing
    tokens = [c.token for c in continuing] + [PAD_ID] * missing
    beams = [c.beam for c in continuing] + [0] * missing
    return (
        torch.tensor(scores, device=device),
        torch.tensor(tokens, device=device),
        torch.tensor(beams, device=device),
    )

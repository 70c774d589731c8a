"""Guided search against brute force on scripted models: forced target prefixes and terminology
constraints (dynamic beam allocation), alone and in batches mixed with unguided lines."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from seq2seq.data.special_tokens import EOS_ID
from seq2seq.inference.beam import beam_search
from seq2seq.inference.constraints import ConstrainedBeams, Constraints
from seq2seq.inference.greedy import greedy_search, sample_search
from seq2seq.inference.guidance import Guidance
from seq2seq.inference.search import search
from tests.inference.test_search import EMITTABLE, ScriptedModel, TableModel, no_norm, sentences


def brute_force(model: ScriptedModel, sentence: int, limit: int, *, prefix=(), keep=lambda tokens: True):
    """(tokens, log-probability) of the best output up to `limit` tokens that starts with `prefix` and
    passes `keep`; the prefix's own tokens count nothing (they are given), an output of `limit`
    tokens is cut there (no EOS)."""
    best, best_total = None, -math.inf
    for length in range(len(prefix), limit + 1):
        for rest in itertools.product(EMITTABLE, repeat=length - len(prefix)):
            tokens = (*prefix, *rest)
            if not keep(tokens):
                continue
            total = sum(model.log_probs(sentence, tokens[:t])[tokens[t]].item() for t in range(len(prefix), length))
            if length < limit:
                total += model.log_probs(sentence, tokens)[EOS_ID].item()
            if total > best_total:
                best, best_total = list(tokens), total
    return best, best_total


def contains(tokens, phrase) -> bool:
    return any(list(tokens[i : i + len(phrase)]) == list(phrase) for i in range(len(tokens) - len(phrase) + 1))


@pytest.mark.parametrize("prefix", [[5], [6, 1], [4, 4, 4]])
def test_a_wide_beam_with_a_prefix_finds_the_best_continuation(prefix):
    model = ScriptedModel(seed=7)
    guidance = Guidance([prefix], [[]])
    ((best, *_),) = beam_search(model, sentences(30), no_norm(beam=1500), guidance=guidance)
    expected, total = brute_force(model, 30, max(4, len(prefix) + 1), prefix=tuple(prefix))
    assert best.tokens == expected
    assert best.log_prob == pytest.approx(total, abs=1e-4)


def test_a_prefix_longer_than_the_limit_is_kept_and_may_end():
    model = ScriptedModel(seed=7)
    prefix = [4, 5, 6, 4, 5, 6]  # the limit is 4: it rises to the prefix and one token more
    for run in (greedy_search, beam_search):
        ((best, *_),) = run(model, sentences(31), no_norm(beam=3), guidance=Guidance([prefix], [[]]))
        assert best.tokens[: len(prefix)] == prefix and len(best.tokens) <= len(prefix) + 1


@pytest.mark.parametrize("run", [greedy_search, beam_search])
def test_prefixes_are_kept_verbatim_and_unguided_lines_in_the_batch_are_unchanged(run):
    model = ScriptedModel(seed=3)
    config = no_norm(beam=3, nbest=3, max_len_b=6)
    prefixes = [[5, 5], [], [6], []]
    guided = run(model, sentences(40, 41, 42, 43), config, guidance=Guidance(prefixes, [[]] * 4))
    plain = run(model, sentences(40, 41, 42, 43), config)
    for prefix, hyps, free in zip(prefixes, guided, plain):
        assert all(h.tokens[: len(prefix)] == prefix for h in hyps)
        if not prefix:
            assert hyps == free
    alone = run(model, sentences(40), config, guidance=Guidance([prefixes[0]], [[]]))[0]
    assert guided[0] == alone  # batched equals alone


@pytest.mark.parametrize("eos_after_prefix, expected", [(0.45, [4, 5, 6]), (0.6, [4])])
def test_beam_search_ends_right_after_a_prefix_only_where_eos_is_the_best_token(eos_after_prefix, expected):
    """CTranslate2's rule (its issue #277), which the export's parity needs: prefix [4] then EOS
    scores best either way (log 0.45 > log 0.55 x 0.7), but is found only where EOS leads."""
    table = {(): {4: 1.0}, (4,): {EOS_ID: eos_after_prefix, 5: 1 - eos_after_prefix}, (4, 5): {6: 0.7, EOS_ID: 0.3}}
    ((best, *_),) = beam_search(TableModel(table), sentences(0), no_norm(beam=3), guidance=Guidance([[4]], [[]]))
    assert best.tokens == expected


def test_greedy_with_a_prefix_equals_beam_one():
    model = ScriptedModel(seed=4)
    guidance = Guidance([[4], [1, 6], []], [[], [], []])
    greedy = greedy_search(model, sentences(1, 2, 3), no_norm(beam=1), guidance=guidance)
    beam = beam_search(model, sentences(1, 2, 3), no_norm(beam=1), guidance=guidance)
    assert [g[0].tokens for g in greedy] == [b[0].tokens for b in beam]
    assert [g[0].log_prob for g in greedy] == pytest.approx([b[0].log_prob for b in beam])


def test_samples_keep_the_prefix():
    model = ScriptedModel(seed=6)
    config = no_norm(sample=True, nbest=20, max_len_b=5)
    draws = sample_search(model, sentences(9, 8), config, guidance=Guidance([[6, 6], []], [[], []]))
    assert all(h.tokens[:2] == [6, 6] for h in draws[0])
    assert any(h.tokens[:2] != [6, 6] for h in draws[1])


@pytest.mark.parametrize("phrases", [[[6]], [[5, 1]], [[1], [6, 6]]])
def test_a_wide_constrained_beam_finds_the_best_output_that_meets_the_constraints(phrases):
    model = ScriptedModel(seed=11)
    config = no_norm(beam=1500, max_len_b=3)
    ((best, *_),) = beam_search(model, sentences(12), config, guidance=Guidance([[]], [phrases]))
    limit = 3 + sum(map(len, phrases))  # the constraint tokens add to the limit

    def meets(tokens):  # each phrase at its own place (two equal phrases need two occurrences)
        return all(contains(tokens, phrase) for phrase in phrases)

    expected, total = brute_force(model, 12, limit, keep=meets)
    assert best.tokens == expected
    assert best.log_prob == pytest.approx(total, abs=1e-4)


@pytest.mark.parametrize("beam", [1, 2, 5])
def test_every_output_meets_its_constraints_and_unconstrained_lines_are_unchanged(beam):
    model = ScriptedModel(seed=13)
    config = no_norm(beam=beam, nbest=beam, max_len_b=5, length_norm="power", length_penalty=1.0)
    ids = list(range(60, 68))
    constraints = [[[6, 6]], [], [[1], [5, 4]], [], [[4, 6, 1]], [], [[1], [1]], []]
    guided = beam_search(model, sentences(*ids), config, guidance=Guidance([[]] * 8, constraints))
    plain = search(model, sentences(*ids), config)
    for phrases, hyps, free in zip(constraints, guided, plain):
        assert 1 <= len(hyps) <= beam  # only outputs that meet every phrase are kept: a list may be short
        if phrases:
            for h in hyps:
                assert all(contains(h.tokens, phrase) for phrase in phrases), (phrases, h.tokens)
            if phrases == [[1], [1]]:  # a phrase asked for twice appears twice
                assert all(h.tokens.count(1) >= 2 for h in hyps)
        else:
            assert hyps == free


def test_constraints_with_a_prefix_keep_both():
    model = ScriptedModel(seed=2)
    ((best, *_),) = beam_search(model, sentences(5), no_norm(beam=4, max_len_b=4),
                                guidance=Guidance([[4, 4]], [[[6, 5]]]))  # fmt: skip
    assert best.tokens[:2] == [4, 4] and contains(best.tokens, [6, 5])


def test_phrase_progress_is_lost_when_broken_and_met_phrases_stay_met():
    constraints = Constraints([[5, 6], [4]])
    state = constraints.initial
    state = constraints.advance(state, 5)
    assert constraints.met_tokens(state) == 1 and constraints.wanted(state) == {6, 5, 4}
    state = constraints.advance(state, 1)  # broken off
    assert constraints.met_tokens(state) == 0
    for token in (4, 5, 6):
        state = constraints.advance(state, token)
    assert constraints.complete(state) and constraints.met_tokens(state) == 3
    assert constraints.complete(constraints.advance(state, 1))


def test_the_most_advanced_bank_always_keeps_a_slot():
    beams = ConstrainedBeams(Constraints([[4, 5]]), beam=3)
    log_probs = torch.full((3, 7), -math.inf)
    log_probs[0, [1, 6, 4]] = torch.tensor([0.5, 0.3, 0.2]).log()  # 4 starts the phrase, yet is least likely
    scores = torch.tensor([0.0, -math.inf, -math.inf])
    ended, continuing = beams.step(log_probs, scores, at_limit=False, none_finished=True)
    assert ended == [] and [c.token for c in continuing] == [1, 6, 4]  # all three fit: best first
    beams = ConstrainedBeams(Constraints([[4, 5]]), beam=2)
    ended, continuing = beams.step(log_probs[:2], scores[:2], at_limit=False, none_finished=True)
    assert sorted(c.token for c in continuing) == [1, 4]  # bank 1 (token 4) takes the slot of token 6
    assert dataclasses.asdict(beams.states[[c.token for c in continuing].index(4)])["progress"] == (0, 1)


def test_a_phrase_followed_by_a_word_continuation_is_not_met():
    constraints = Constraints([[5]], continuations=frozenset({6}))
    met = constraints.advance(constraints.initial, 5)
    assert constraints.complete(met)
    assert constraints.complete(constraints.advance(met, 4))  # a new word follows
    assert not constraints.complete(constraints.advance(met, 6))  # "5" went on into "56"


def test_constrained_outputs_hold_each_phrase_as_a_whole_word():
    model = ScriptedModel(seed=17)
    continuation = 6
    guidance = Guidance([[]] * 6, [[[5]]] * 6, continuations=frozenset({continuation}))
    for hyps in beam_search(model, sentences(*range(90, 96)), no_norm(beam=3, nbest=3, max_len_b=6), guidance=guidance):
        for h in hyps:
            ends = [i for i, token in enumerate(h.tokens) if token == 5]
            assert any(i + 1 == len(h.tokens) or h.tokens[i + 1] != continuation for i in ends), h.tokens


def test_an_early_forced_phrase_does_not_end_the_search_before_the_natural_one():
    """The reserved slot forces the phrase in at once (6, then EOS); that output is poor, so its EOS
    is not among the best candidates and it must not end the sentence's search (it did when any
    complete hypothesis's EOS counted) before 4 4 6 arrives, where the model puts the phrase."""
    table = {(): {4: 0.9, 5: 0.09, 6: 1e-3}, (4,): {4: 0.9, 5: 0.05, 6: 0.05}, (4, 4): {6: 0.9, 5: 0.1}}
    model = TableModel(table)
    config = no_norm(beam=2, patience=1.0, max_len_b=4)
    ((best, *_),) = beam_search(model, sentences(0), config, guidance=Guidance([[]], [[[6]]]))
    assert best.tokens == [4, 4, 6]


class ReluctantModel(ScriptedModel):
    """Wants 4 5 4 then EOS, and finds 6 nearly impossible (log-probability about -15)."""

    def log_probs(self, sentence: int, prefix: tuple[int, ...]) -> torch.Tensor:
        scores = torch.full((7,), -8.0)
        scores[6] = -15.0
        scores[EOS_ID if len(prefix) >= 3 else (4 if len(prefix) % 2 == 0 else 5)] = 0.0
        return scores.log_softmax(-1)


@pytest.mark.parametrize("beam", [1, 2, 4])
def test_a_phrase_the_model_will_not_say_is_still_in_every_output(beam):
    """The phrase only enters through the reserved slot: its hypothesis must survive to the end (and
    end there), and no phrase-less output cut at the length limit may take its place."""
    config = no_norm(beam=beam, nbest=beam, max_len_b=4, length_norm="power", length_penalty=1.0)
    for hyps in beam_search(ReluctantModel(), sentences(1, 2), config, guidance=Guidance([[]] * 2, [[[6, 6, 6]]] * 2)):
        assert hyps and all(contains(h.tokens, [6, 6, 6]) for h in hyps), [h.tokens for h in hyps]

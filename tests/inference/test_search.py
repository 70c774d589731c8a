"""Search: the pure beam step by hand, a scripted fake decoder, brute force, beam 1 == greedy, batching."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from seq2seq.config import DecodeConfig, ModelConfig
from seq2seq.data.special_tokens import BOS_ID, EOS_ID, PAD_ID
from seq2seq.inference.beam import beam_search, beam_step
from seq2seq.inference.greedy import greedy_search, sample_search
from seq2seq.inference.sampling import sampling_candidates
from seq2seq.inference.search_steps import PrefixCache, length_normalized
from seq2seq.model.transformer import Seq2SeqTransformer

VOCAB = 7  # ids 0-3 are pad/unk/bos/eos; the search may emit unk (1), eos (3) and 4, 5, 6
EMITTABLE = [1, 4, 5, 6]


class ScriptedModel:
    """Next-token log-probs are a fixed pseudo-random function of (sentence id, prefix).

    The sentence id travels in the memory tensor, so batching, beams and dropped rows must all keep
    rows and caches aligned for the results to match.
    """

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        return src[:, :1].float().unsqueeze(-1)  # (B, 1, 1): the first source id names the sentence

    def new_cache(self) -> PrefixCache:
        return PrefixCache()

    def log_probs(self, sentence: int, prefix: tuple[int, ...]) -> torch.Tensor:
        generator = torch.Generator().manual_seed(hash((self.seed, sentence, prefix)) % 2**31)
        return (torch.randn(VOCAB, generator=generator) * 2).log_softmax(-1)

    def decode(self, tgt, memory, src_mask, cache: PrefixCache) -> torch.Tensor:
        prefix = cache.append(tgt)
        beams = tgt.size(0) // memory.size(0)  # the rows of one sentence sit next to each other
        rows = [
            self.log_probs(int(memory[row // beams, 0, 0]), tuple(prefix[row, 1:].tolist()))
            for row in range(tgt.size(0))
        ]
        return torch.stack(rows).unsqueeze(1)  # (N, 1, V): log-probs are valid logits


def sentences(*ids: int, length: int = 3) -> torch.Tensor:
    """Source batch whose rows start with the given sentence ids (the rest is filler)."""
    return torch.tensor([[i] + [4] * (length - 1) for i in ids])


def no_norm(**overrides) -> DecodeConfig:
    return DecodeConfig(**{"length_norm": "none", "max_len_a": 0.0, "max_len_b": 4, "min_len": 0, **overrides})


def brute_force_best(model: ScriptedModel, sentence: int, max_len: int) -> tuple[list[int], float]:
    """Score every output up to max_len tokens (EOS forced at max_len, as the search does)."""
    best_tokens, best_score = [], -math.inf
    for length in range(max_len + 1):
        for tokens in itertools.product(EMITTABLE, repeat=length):
            total = sum(model.log_probs(sentence, tokens[:t])[tokens[t]].item() for t in range(length))
            if length < max_len:
                total += model.log_probs(sentence, tokens)[EOS_ID].item()
            if total > best_score:
                best_tokens, best_score = list(tokens), total
    return best_tokens, best_score


def test_beam_step_picks_the_best_continuations_by_hand():
    log_probs = torch.log(torch.tensor([[[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]]]))  # (B=1, K=2, V=3)
    scores = torch.log(torch.tensor([[0.5, 0.5]]))
    best, tokens, beams = beam_step(log_probs, scores, 3)
    # Totals: beam 0 -> .05 .30 .15 ; beam 1 -> .25 .125 .125  => best three: (0,1) (1,0) (0,2)
    assert tokens.tolist() == [[1, 0, 2]]
    assert beams.tolist() == [[0, 1, 0]]
    torch.testing.assert_close(best.exp(), torch.tensor([[0.30, 0.25, 0.15]]))


def test_length_normalisations():
    assert length_normalized(-6.0, 3, DecodeConfig(length_norm="none")) == -6.0
    assert length_normalized(-6.0, 3, DecodeConfig(length_norm="average")) == -2.0
    gnmt = length_normalized(-6.0, 3, DecodeConfig(length_norm="gnmt", length_penalty=1.0))
    assert gnmt == pytest.approx(-6.0 / (8 / 6))
    power = length_normalized(-6.0, 4, DecodeConfig(length_norm="power", length_penalty=0.5))
    assert power == pytest.approx(-3.0)


class TableModel(ScriptedModel):
    """Next-token probabilities read from a table of prefixes; tokens the table leaves out share 1e-6."""

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]]) -> None:
        self.table = table

    def log_probs(self, sentence: int, prefix: tuple[int, ...]) -> torch.Tensor:
        probs = torch.full((VOCAB,), 1e-6, dtype=torch.float64)
        for token, p in self.table.get(prefix, {EOS_ID: 1.0}).items():
            probs[token] = p
        return (probs / probs.sum()).log().float()


def exhaustive_best(model: ScriptedModel, config: DecodeConfig, max_len: int) -> list[int]:
    """The output with the best length-normalised score among all outputs up to max_len tokens that end in EOS."""
    best, best_score = [], -math.inf
    for length in range(max_len):
        for tokens in itertools.product(EMITTABLE, repeat=length):
            total = sum(model.log_probs(0, tokens[:t])[tokens[t]].item() for t in range(length))
            score = config.normalized_score(total + model.log_probs(0, tokens)[EOS_ID].item(), length + 1)
            if score > best_score:
                best, best_score = list(tokens), score
    return best


def test_the_search_goes_on_past_the_first_beam_finished_hypotheses():
    """Two short outputs end first and fill a beam of 2, while a longer one, still open, scores better
    per token: stopping at `beam` finished outputs (patience 1) returns a short one, the default
    patience finds the exhaustive optimum (the gap CTranslate2's float32 export once showed)."""
    table = {
        (): {4: 0.5, 5: 0.5},
        (4,): {EOS_ID: 0.6, 4: 0.4},  # 4 EOS: 0.30 over 2 tokens
        (5,): {EOS_ID: 0.6, 5: 0.4},
        (4, 4): {EOS_ID: 0.99},  # 4 4 EOS: 0.198 over 3 tokens, better on average
        (5, 5): {EOS_ID: 0.9},
    }
    model, settings = TableModel(table), no_norm(beam=2, length_norm="average", max_len_b=4)
    optimum = exhaustive_best(model, settings, max_len=4)
    assert optimum == [4, 4]
    ((stopped_early, *_),) = beam_search(model, sentences(0), dataclasses.replace(settings, patience=1.0))
    assert stopped_early.tokens in ([4], [5])
    ((best, *_),) = beam_search(model, sentences(0), settings)
    assert best.tokens == optimum


@pytest.mark.parametrize("sentence", [10, 11, 12])
def test_wide_beam_finds_the_brute_force_optimum(sentence):
    model = ScriptedModel()
    expected_tokens, expected_score = brute_force_best(model, sentence, max_len=4)
    ((best, *_),) = beam_search(model, sentences(sentence), no_norm(beam=1500))
    assert best.tokens == expected_tokens
    assert best.log_prob == pytest.approx(expected_score, abs=1e-4)


def test_beam_one_equals_greedy_on_the_scripted_model():
    model = ScriptedModel(seed=5)
    src = sentences(*range(20, 40))
    greedy = greedy_search(model, src, no_norm(beam=1))
    beam = beam_search(model, src, no_norm(beam=1))
    assert [g[0].tokens for g in greedy] == [b[0].tokens for b in beam]
    assert [g[0].log_prob for g in greedy] == pytest.approx([b[0].log_prob for b in beam])


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_batched_search_equals_one_sentence_at_a_time(search):
    model = ScriptedModel(seed=2)
    config = no_norm(beam=3, nbest=3)
    batched = search(model, sentences(50, 51, 52, 53), config)
    alone = [search(model, sentences(i), config)[0] for i in (50, 51, 52, 53)]
    assert batched == alone


def test_nbest_is_sorted_and_min_len_is_respected():
    model = ScriptedModel(seed=9)
    hyps = beam_search(model, sentences(60), no_norm(beam=4, nbest=4, min_len=2))[0]
    assert len(hyps) == 4
    assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
    assert all(len(h.tokens) >= 2 for h in hyps)


def test_outputs_stop_at_max_len_a_times_source_plus_b():
    model = ScriptedModel(seed=1)
    config = DecodeConfig(beam=3, max_len_a=0.5, max_len_b=1, min_len=10, length_norm="none")
    for search in (greedy_search, beam_search):
        hyps = search(model, sentences(70, length=4), config)[0]  # at most 0.5 * 4 + 1 = 3 tokens
        assert all(len(h.tokens) == 3 for h in hyps)
        assert all(t not in (PAD_ID, BOS_ID, EOS_ID) for h in hyps for t in h.tokens)


def tiny_real_model() -> Seq2SeqTransformer:
    config = ModelConfig(d_model=32, heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=64, dropout=0.0)
    return Seq2SeqTransformer(config, src_vocab_size=40, tgt_vocab_size=40).eval()


def test_beam_one_equals_greedy_on_a_real_model():
    torch.manual_seed(3)
    model = tiny_real_model()
    src = torch.randint(4, 40, (6, 8))
    src[2, 5:] = PAD_ID
    config = DecodeConfig(beam=1, max_len_a=1.0, max_len_b=5)
    greedy = [h[0].tokens for h in greedy_search(model, src, config)]
    beam = [h[0].tokens for h in beam_search(model, src, config)]
    assert greedy == beam
    assert any(len(tokens) > 1 for tokens in greedy)


def test_real_model_beam_batched_equals_alone():
    torch.manual_seed(4)
    model = tiny_real_model()
    src = torch.randint(4, 40, (4, 7))
    src[1, 4:] = PAD_ID
    config = DecodeConfig(beam=4, max_len_a=1.0, max_len_b=3)
    batched = [h[0].tokens for h in beam_search(model, src, config)]
    alone = [beam_search(model, src[i : i + 1, : int((src[i] != PAD_ID).sum())], config)[0][0].tokens for i in range(4)]
    assert batched == alone


class RepetitiveModel(ScriptedModel):
    """Prefers to continue the cycle 4 5 4 5 ... and never ends before the length limit."""

    def log_probs(self, sentence: int, prefix: tuple[int, ...]) -> torch.Tensor:
        scores = torch.full((VOCAB,), -5.0)
        scores[4 if not prefix or prefix[-1] == 5 else 5] = 0.0
        scores[6], scores[1] = -1.0, -2.0
        scores[EOS_ID] = -20.0
        return scores.log_softmax(-1)


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_no_repeat_ngram_forbids_repeated_ngrams(search):
    config = DecodeConfig(beam=3, max_len_a=0.0, max_len_b=8, length_norm="none")
    free = search(RepetitiveModel(), sentences(80), config)[0][0].tokens
    assert free[:4] == [4, 5, 4, 5]  # without the option the model repeats itself
    for n in (2, 3):
        tokens = search(RepetitiveModel(), sentences(80), dataclasses.replace(config, no_repeat_ngram=n))[0][0].tokens
        grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
        assert len(grams) == len(set(grams)), tokens


def sampling_distribution(log_probs: torch.Tensor, config: DecodeConfig) -> torch.Tensor:
    """sampling_candidates spread over the whole vocabulary (zero for every token cut)."""
    probs, ids = sampling_candidates(log_probs, config)
    return probs if ids is None else torch.zeros_like(log_probs).scatter_(1, ids, probs)


def test_the_sampling_distribution_by_hand():
    log_probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    base = DecodeConfig(sample=True)
    torch.testing.assert_close(sampling_distribution(log_probs, base), log_probs.exp())
    top_k = sampling_distribution(log_probs, dataclasses.replace(base, top_k=2))
    torch.testing.assert_close(top_k, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    top_p = sampling_distribution(log_probs, dataclasses.replace(base, top_p=0.7))  # 0.5 + 0.3 reach 0.7
    torch.testing.assert_close(top_p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    epsilon = sampling_distribution(log_probs, dataclasses.replace(base, epsilon=0.1))
    torch.testing.assert_close(epsilon, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)
    hot = sampling_distribution(log_probs, dataclasses.replace(base, temperature=2.0))
    torch.testing.assert_close(hot, log_probs.exp().sqrt() / log_probs.exp().sqrt().sum())
    only_best = sampling_distribution(log_probs, dataclasses.replace(base, top_p=0.1, epsilon=0.9))
    torch.testing.assert_close(only_best, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    both = sampling_distribution(log_probs, dataclasses.replace(base, top_k=3, top_p=0.9))  # of 0.5, 0.3, 0.15
    torch.testing.assert_close(both, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_a_wide_nucleus_is_found_beyond_the_first_candidates():
    """A flat distribution over 1,000 tokens: top-p 0.9 keeps the 900 most likely, in every row
    (more than the first 64 or 256 candidates looked at), whatever the order of the vocabulary."""
    flat = torch.stack([torch.randperm(1000, generator=torch.Generator().manual_seed(row)) for row in range(3)])
    log_probs = (1 + flat * 1e-5).log().log_softmax(-1)  # nearly equal, no ties
    nucleus = sampling_distribution(log_probs, DecodeConfig(sample=True, top_p=0.9))
    assert (nucleus > 0).sum(-1).tolist() == [900, 900, 900]
    assert ((nucleus > 0) == (flat >= 100)).all()  # the 900 most likely tokens of each row
    torch.testing.assert_close(nucleus.sum(-1), torch.ones(3))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 2, 1.0), (1.0, 0, 0.6)]
)
def test_samples_follow_the_models_distribution(temperature, top_k, top_p):
    """Outputs of a table model drawn many times: each output's frequency matches its probability
    under the temperature, top-k and top-p (within 5 standard deviations), and a seed repeats the draws."""
    table = {(): {4: 0.5, 5: 0.3, 6: 0.2}, (4,): {EOS_ID: 0.7, 5: 0.3}}  # outputs: 4 | 4 5 | 5 | 6
    model = TableModel(table)
    settings = no_norm(sample=True, nbest=250, temperature=temperature, top_k=top_k, top_p=top_p)
    first = torch.tensor([0.5, 0.3, 0.2]) ** (1 / temperature)
    if top_k or top_p < 1.0:  # top-p 0.6: 0.5 + 0.3 reach it
        first[top_k or 2 :] = 0
    first /= first.sum()
    second = torch.tensor([0.7, 0.3]) ** (1 / temperature)
    if top_p < 1.0:  # 0.7 alone reaches 0.6
        second[1:] = 0
    second /= second.sum()
    expected = {(4,): first[0] * second[0], (4, 5): first[0] * second[1], (5,): first[1], (6,): first[2]}
    draws = [tuple(h.tokens) for hyps in sample_search(model, sentences(0, 0, 0, 0), settings) for h in hyps]
    assert len(draws) == 1000 and set(draws) <= set(expected)
    for output, p in expected.items():
        spread = 5 * math.sqrt(1000 * p * (1 - p)) + 1
        assert abs(draws.count(output) - 1000 * p) <= spread, (output, draws.count(output), 1000 * float(p))
    again = [tuple(h.tokens) for hyps in sample_search(model, sentences(0, 0, 0, 0), settings) for h in hyps]
    assert again == draws


def test_scoring_a_search_output_gives_the_searchs_own_score(trained_checkpoint):
    """Force-decoding (Translator.score, teacher forcing in batches) and the cached greedy search
    compute the same log-probabilities. An output that ended with EOS scores what search said; one
    cut at the length limit has no EOS, so its pieces without the EOS that scoring appends do. A
    short limit cuts most outputs and a long one lets some end, on any machine's arithmetic. An
    output with a stray space (a lone "▁" piece) is left out: its text encodes to other pieces."""
    from seq2seq.inference.translator import Translator

    path, data = trained_checkpoint
    translator = Translator.load(path, device="cpu")
    lines = (data / "test.en").read_text(encoding="utf-8").splitlines()[:30]
    checked = {"ended": 0, "cut": 0}
    for max_len_b in (4, 60):
        settings = {"beam": 1, "max_len_a": 3.0 * (max_len_b > 4), "max_len_b": max_len_b}
        decode = translator.settings(**settings)
        outputs = [t.nbest[0] for t in translator.translate_nbest(lines, **settings)]
        scored = translator.score(lines, [text for text, _ in outputs])  # a score reads no search setting
        limits = [decode.output_limit(len(ids)) for ids in translator.bundle.tokenizer.encode_src(lines)]
        for pair, (text, score), limit in zip(scored, outputs, limits):
            if text != " ".join(text.split()):
                continue
            if len(pair.pieces) <= limit:
                assert pair.score == pytest.approx(score, abs=1e-4)
                checked["ended"] += 1
            else:
                tokens = len(pair.pieces) - 1
                assert decode.normalized_score(sum(pair.log_probs[:-1]), tokens) == pytest.approx(score, abs=1e-4)
                checked["cut"] += 1
    assert min(checked.values()) >= 5, checked


class CountingModel(ScriptedModel):
    """A ScriptedModel on a fake clock: every decoder step takes one 'second'."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__(seed=3)
        self.clock, self.steps = clock, 0

    def decode(self, tgt, memory, src_mask, cache):
        self.steps += 1
        self.clock[0] += 1.0
        return super().decode(tgt, memory, src_mask, cache)


@pytest.mark.parametrize("settings", [{"beam": 1}, {"beam": 3}, {"sample": True, "nbest": 2}])
def test_a_search_past_its_deadline_stops_within_one_step(monkeypatch, settings):
    """A server request whose client has left must free the worker: the search checks its deadline
    before every decoder step and stops there."""
    import types

    from seq2seq.inference import search as search_module
    from seq2seq.inference import search_steps
    from seq2seq.inference.engine import DeadlinePassed

    clock = [0.0]
    monkeypatch.setattr(search_steps, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    model = CountingModel(clock)
    config = no_norm(max_len_b=40, min_len=40, **settings)  # 40 steps unless stopped
    with pytest.raises(DeadlinePassed):
        search_module.search(model, sentences(1, 2), config, deadline=3.5)
    assert model.steps == 4  # steps at 0, 1, 2 and 3 'seconds'; the one at 4 is never taken
    finished = CountingModel(clock := [0.0])
    monkeypatch.setattr(search_steps, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    assert len(search_module.search(finished, sentences(1, 2), config, deadline=100.0)) == 2  # in time: whole


def test_a_lines_samples_do_not_depend_on_its_batch():
    """Each row draws from a generator of its own, keyed by (seed, line number, draw): the same line
    and number give the same samples alone, in another batch, or beside other lines."""
    model = ScriptedModel(seed=4)
    config = no_norm(sample=True, nbest=6, max_len_b=6)

    def draws(ids, lines):
        return [[h.tokens for h in hyps] for hyps in sample_search(model, sentences(*ids), config, lines=lines)]

    alone = draws([7], [12])[0]
    assert draws([5, 7, 9], [0, 12, 3])[1] == alone
    assert draws([7, 7], [12, 13])[0] == alone and draws([7, 7], [12, 13])[1] != alone  # another number, other draws
    reseeded = [[h.tokens for h in hyps] for hyps in sample_search(model, sentences(7), no_norm(
        sample=True, nbest=6, max_len_b=6, seed=2), lines=[12])][0]  # fmt: skip
    assert reseeded != alone


def test_a_sampled_output_ends_at_its_length_limit_whatever_the_draw(monkeypatch):
    """The draw never picks EOS here (as a broken distribution, NaN at a vanishing temperature, once
    did): each output still stops at its limit, instead of the search running on."""
    from seq2seq.inference import greedy

    monkeypatch.setattr(greedy, "draw_tokens", lambda log_probs, config, uniforms: torch.full_like(
        uniforms, 4, dtype=torch.long))  # fmt: skip
    config = no_norm(sample=True, nbest=2, max_len_b=5)
    outputs = sample_search(ScriptedModel(seed=2), sentences(1, 2), config)
    assert [[h.tokens for h in hyps] for hyps in outputs] == [[[4] * 5] * 2] * 2

"""Ensembles: of one model equal to that model, of two equal to a brute-force average of their
log-probabilities (renormalised, recomputed without caches) in search; pair scoring agrees with the
ensemble's own search; mismatched vocabularies refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from seq2seq.config import DecodeConfig, ModelConfig
from seq2seq.data.special_tokens import BOS_ID, EOS_ID, PAD_ID
from seq2seq.errors import UserInputError
from seq2seq.inference.beam import beam_search
from seq2seq.inference.ensemble import Ensemble
from seq2seq.inference.greedy import greedy_search
from seq2seq.inference.search_steps import PrefixCache
from seq2seq.model.transformer import Seq2SeqTransformer


def tiny_model(seed: int, d_model: int = 32) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    config = ModelConfig(d_model=d_model, heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=64, dropout=0.0)
    return Seq2SeqTransformer(config, src_vocab_size=40, tgt_vocab_size=40).eval()


class BruteForceAverage:
    """The two models' average log-probabilities, renormalised, recomputed over the whole prefix at
    every step (no cache, no shared memory tensor)."""

    def __init__(self, models) -> None:
        self.models = models

    def encode(self, src, src_mask):
        self.memories = [model.encode(src, src_mask) for model in self.models]
        self.src_mask = src_mask
        return self.memories[0]

    def new_cache(self) -> PrefixCache:
        return SentenceTrackingCache()

    def decode(self, tgt, memory, src_mask, cache):
        prefix = cache.append(tgt)
        rows = cache.sentences(prefix.size(0), memory.size(0))
        log_probs = [model.decode(prefix, full[rows], self.src_mask[rows])[:, -1:].float().log_softmax(-1)
                     for model, full in zip(self.models, self.memories)]  # fmt: skip
        return torch.stack(log_probs).mean(0).log_softmax(-1)


class SentenceTrackingCache(PrefixCache):
    """A PrefixCache that also tracks which original sentence each row decodes (for the full memories)."""

    def __init__(self) -> None:
        super().__init__()
        self.origin: torch.Tensor | None = None

    def sentences(self, rows: int, sentences: int) -> torch.Tensor:
        if self.origin is None:
            self.origin = torch.arange(sentences).repeat_interleave(rows // sentences)
        return self.origin

    def reorder(self, rows):
        super().reorder(rows)
        self.origin = self.origin.index_select(0, rows)

    def select(self, rows, sentences):
        self.reorder(rows)


@pytest.fixture
def source() -> torch.Tensor:
    torch.manual_seed(8)
    src = torch.randint(4, 40, (5, 7))
    src[3, 4:] = PAD_ID
    return src


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_an_ensemble_of_one_model_is_that_model(search, source):
    model = tiny_model(1)
    config = DecodeConfig(beam=4, nbest=2, max_len_a=1.0, max_len_b=4)
    alone, ensemble = search(model, source, config), search(Ensemble([model]), source, config)
    assert [[h.tokens for h in hyps] for hyps in ensemble] == [[h.tokens for h in hyps] for hyps in alone]
    for a, b in zip(alone, ensemble):
        assert [h.score for h in b] == pytest.approx([h.score for h in a], abs=1e-5)


@pytest.mark.parametrize("search", [greedy_search, beam_search])
def test_an_ensemble_of_two_searches_their_average(search, source):
    models = [tiny_model(1), tiny_model(2, d_model=16)]  # widths may differ
    config = DecodeConfig(beam=4, nbest=3, max_len_a=1.0, max_len_b=4)
    ensemble, reference = search(Ensemble(models), source, config), search(BruteForceAverage(models), source, config)
    assert [[h.tokens for h in hyps] for hyps in ensemble] == [[h.tokens for h in hyps] for hyps in reference]
    for a, b in zip(reference, ensemble):
        assert [h.score for h in b] == pytest.approx([h.score for h in a], abs=1e-4)
    singles = [[hyps[0].tokens for hyps in search(model, source, config)] for model in models]
    assert singles[0] != singles[1]  # the members disagree: the average is a third answer to check


def test_an_ensemble_scores_its_own_outputs_as_its_search_did(source):
    """Pair scoring (teacher forcing, __call__) and search (the cached decoder) are two paths through
    the ensemble: force-decoding the outputs its greedy search found gives the log-probabilities the
    search summed for them; an ensemble of a model with itself scores as that model."""
    models = [tiny_model(3), tiny_model(4)]
    ensemble = Ensemble(models)
    found = [hyps[0] for hyps in greedy_search(ensemble, source, DecodeConfig(beam=1, max_len_a=1.0, max_len_b=4))]
    limits = ((source != PAD_ID).sum(1) + 4).tolist()  # a * source length + b: an output this long has no EOS
    for row, (hypothesis, limit) in enumerate(zip(found, limits)):
        emitted = hypothesis.tokens + ([EOS_ID] if len(hypothesis.tokens) < limit else [])
        tgt_in, gold = torch.tensor([[BOS_ID, *emitted[:-1]]]), torch.tensor([emitted])
        src = source[row : row + 1]
        with torch.no_grad():
            log_prob = float(ensemble(src, tgt_in).gather(-1, gold.unsqueeze(-1)).sum())
            members = [float(m(src, tgt_in).log_softmax(-1).gather(-1, gold.unsqueeze(-1)).sum()) for m in models]
        assert log_prob == pytest.approx(hypothesis.log_prob, abs=1e-4)
        assert all(abs(member - log_prob) > 1e-3 for member in members)  # neither member alone
    tgt_in = torch.randint(4, 40, (5, 6))
    torch.testing.assert_close(
        Ensemble([models[0], models[0]])(source, tgt_in), models[0](source, tgt_in).log_softmax(-1)
    )


def test_checkpoints_with_different_vocabularies_are_refused(trained_checkpoint, tmp_path):
    from seq2seq.checkpoint import Checkpoint
    from seq2seq.data.tokenizer import train_tokenizer
    from seq2seq.inference.translator import Translator

    path, _ = trained_checkpoint
    checkpoint = Checkpoint.load(path)
    pairs = [("a b c d", "e f g h"), ("b c d e", "f g h i")] * 50
    checkpoint.tokenizer = train_tokenizer(dataclasses.replace(checkpoint.config.tokenizer, vocab_size=20), pairs)
    checkpoint.save(tmp_path / "other.pt")
    with pytest.raises(UserInputError, match="vocabulary differs .* share the source and target SentencePiece"):
        Translator.load([path, tmp_path / "other.pt"])
    assert len(Translator.load([path, path]).translate(["a tall tree"])) == 1

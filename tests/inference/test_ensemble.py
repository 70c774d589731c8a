"""Ensembles: of one model equal to that model, of two equal to the brute-force average of their
log-probabilities (renormalised), in search and in pair scoring; mismatched vocabularies refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from seq2seq.config import DecodeConfig, ModelConfig
from seq2seq.data.special_tokens import PAD_ID
from seq2seq.errors import UserInputError
from seq2seq.inference.ensemble import Ensemble
from seq2seq.inference.search import PrefixCache, beam_search, greedy_search
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


def test_an_ensemble_scores_pairs_by_the_average(source):
    models = [tiny_model(3), tiny_model(4)]
    tgt_in = torch.randint(4, 40, (5, 6))
    expected = torch.stack([m(source, tgt_in).log_softmax(-1) for m in models]).mean(0).log_softmax(-1)
    torch.testing.assert_close(Ensemble(models)(source, tgt_in), expected)


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

"""An ensemble of models decoding as one: a search.Decoder whose next-token distribution is the
average of the members' log-probabilities, renormalised.

Averaging log-probabilities is the rule of Marian and of the WMT systems that report ensemble
gains (a product of experts: a token wins only if every member finds it likely). Renormalising
keeps it a distribution, so beam search, sampling and pair scoring all work on it unchanged; search
applies the log-softmax. The members share the source and target vocabularies (translator.py's
Translator.load checks that) and may differ in everything else: their encoder outputs, of widths
d_model each, travel side by side in one memory tensor, so search batches, reorders and drops
sentences for all of them at once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seq2seq.inference.graphed_decoder import GraphedDecoder, graphs_apply


class EnsembleCache:
    """One search cache per member, reordered together."""

    def __init__(self, caches: list) -> None:
        self.caches = caches

    def reorder(self, rows: Tensor) -> None:
        for cache in self.caches:
            cache.reorder(rows)

    def select(self, rows: Tensor, sentences: Tensor) -> None:
        for cache in self.caches:
            cache.select(rows, sentences)


class Ensemble:
    """Models with one vocabulary, decoding together (search.Decoder), and scoring pairs together (__call__)."""

    def __init__(self, models: list[torch.nn.Module]) -> None:
        self.models = models
        self.widths = [model.config.d_model for model in models]
        self._decoders = [GraphedDecoder(model) if graphs_apply(model) else model for model in models]

    def parameters(self):
        return self.models[0].parameters()

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        """(B, S, sum of the members' d_model): each member's encoder output, side by side."""
        return torch.cat([decoder.encode(src, src_mask) for decoder in self._decoders], dim=-1)

    def new_cache(self) -> EnsembleCache:
        return EnsembleCache([decoder.new_cache() for decoder in self._decoders])

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor, cache: EnsembleCache) -> Tensor:
        """(N, 1, V): the members' average log-probabilities (search renormalises them)."""
        members = zip(self._decoders, memory.split(self.widths, dim=-1), cache.caches)
        return _average([decoder.decode(tgt, part, src_mask, part_cache) for decoder, part, part_cache in members])

    def __call__(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher forcing, as the models' forward: (B, T, V) log-probabilities of the ensemble."""
        return _average([model(src, tgt_in) for model in self.models]).log_softmax(-1)


def _average(logits: list[Tensor]) -> Tensor:
    return torch.stack([member.float().log_softmax(-1) for member in logits]).mean(0)

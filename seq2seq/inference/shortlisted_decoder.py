"""Search over a shortlist: a search.Decoder whose next-token scores cover, for each line, only the
target pieces its own shortlist allows (shortlist.py); every other piece scores -inf.

The output layer multiplies by the rows of the batch's union of lists alone, which is where the
time goes; each line is then held to its own list, so a line translates the same alone or in any
batch (CTranslate2 decodes over the union of the batch's lists instead: its output can depend on
the lines beside it). The scores go back into a full-vocabulary row, so search, guidance and
sampling run unchanged over target ids.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from seq2seq.data.special_tokens import PAD_ID
from seq2seq.inference.search_steps import Decoder, SearchCache
from seq2seq.inference.shortlist import TargetLists


class ShortlistCache:
    """The model's cache, and the sentences still decoding, for the decoder that made it."""

    def __init__(self, inner: SearchCache, owner: ShortlistedDecoder) -> None:
        self.inner, self.owner = inner, owner

    def reorder(self, rows: Tensor) -> None:
        self.inner.reorder(rows)

    def select(self, rows: Tensor, sentences: Tensor) -> None:
        self.inner.select(rows, sentences)
        self.owner.blocked = self.owner.blocked.index_select(0, sentences)


class ShortlistedDecoder:
    """search.Decoder over `model` for one batch of sentences: `extra` gives each sentence's
    prefix and constraint ids, which its list must hold (search may repeat each sentence in a row:
    sampling's draws)."""

    def __init__(self, model: Decoder, lists: TargetLists, extra: list[list[int]], vocabulary_size: int) -> None:
        self.model, self.lists, self.extra, self.vocabulary_size = model, lists, extra, vocabulary_size
        self.union: Tensor | None = None  # (U,) the target ids any sentence of the batch may produce
        self.blocked: Tensor | None = None  # (B, U) True where a sentence's own list lacks the id
        self.weight: Tensor | None = None  # (U, d) the output layer's rows for the union, when the model has one

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        """The model's encoding; decides each sentence's list from its source ids."""
        repeats = src.size(0) // max(1, len(self.extra))
        extra = [ids for ids in self.extra for _ in range(repeats)] or [[] for _ in range(src.size(0))]
        sentences = src.tolist()
        allowed = [self.lists.allowed([i for i in ids if i != PAD_ID], guide) for ids, guide in zip(sentences, extra)]
        union = np.unique(np.concatenate(allowed))
        blocked = np.stack([~np.isin(union, own, assume_unique=True) for own in allowed])
        self.union = torch.from_numpy(union).to(src.device)
        self.blocked = torch.from_numpy(blocked).to(src.device)
        projection = getattr(self.model, "output_proj", None)
        self.weight = None if projection is None else projection.weight.index_select(0, self.union)
        return self.model.encode(src, src_mask)

    def new_cache(self) -> ShortlistCache:
        return ShortlistCache(self.model.new_cache(), self)

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor, cache: ShortlistCache) -> Tensor:
        """(N, 1) new positions -> (N, 1, V) scores, -inf outside each sentence's list."""
        if self.weight is not None:  # our Transformer: the output layer over the union's rows alone
            scores = self.model.decode_hidden(tgt, memory, src_mask, cache.inner) @ self.weight.t()
        else:  # an ensemble or a graphed decoder: its full scores, cut to the union
            scores = self.model.decode(tgt, memory, src_mask, cache.inner).index_select(-1, self.union)
        blocked = self.blocked.repeat_interleave(tgt.size(0) // self.blocked.size(0), dim=0)
        scores = scores.masked_fill(blocked.unsqueeze(1), -math.inf)
        full = scores.new_full((*scores.shape[:-1], self.vocabulary_size), -math.inf)
        return full.index_copy_(-1, self.union, scores)

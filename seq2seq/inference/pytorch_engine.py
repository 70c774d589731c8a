"""The PyTorch engine: our model and search translate lines of text (encode, sort into token-budgeted
batches, search, detokenize, restore order). translator.py puts the engine-independent API on top."""

from __future__ import annotations

import time

import numpy as np
import torch

from seq2seq.data.batching import pad, token_batches
from seq2seq.data.sources import normalize
from seq2seq.data.special_tokens import BOS_ID, EOS_ID
from seq2seq.data.tokenizer import Tokenizer
from seq2seq.decoding import DecodeConfig
from seq2seq.inference.engine import DeadlinePassed, LinesDone, PairScore, Translation
from seq2seq.inference.graphed_decoder import GraphedDecoder, graphs_apply
from seq2seq.inference.guidance import Guidance
from seq2seq.inference.search import search
from seq2seq.inference.shortlist import TargetLists
from seq2seq.inference.shortlisted_decoder import ShortlistedDecoder


class PyTorchEngine:
    """engine.Engine over a model in memory (a loaded checkpoint, or the model being trained)."""

    name, title, instead = "pytorch", "our PyTorch search", ""  # it does everything a request may ask
    constrained_search = True
    max_positions = None  # sinusoidal positions: a line of any length is translated in full

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, *, shortlist: TargetLists | None = None) -> None:
        self.model, self.tokenizer, self.shortlist = model, tokenizer, shortlist
        self.shortlisted = shortlist is not None
        self.source_model, self.target_model = tokenizer.src_model, tokenizer.tgt_model

    @property
    def computes_in(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def translate(
        self,
        lines: list[str],
        decode: DecodeConfig,
        *,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        line_numbers: list[int] | None = None,
        deadline: float | None = None,
        progress: LinesDone | None = None,
    ) -> list[Translation]:
        return translate_lines(
            self.model,
            self.tokenizer,
            lines,
            decode,
            progress=progress,
            prefixes=prefixes,
            constraints=constraints,
            line_numbers=line_numbers,
            deadline=deadline,
            shortlist=self.shortlist,
        )

    @torch.no_grad()
    def score(
        self,
        sources: list[str],
        targets: list[str],
        decode: DecodeConfig,
        *,
        deadline: float | None = None,
        progress: LinesDone | None = None,
    ) -> list[PairScore]:
        """Teacher forcing in token-budgeted batches: the log-probability of each target piece and of
        the EOS after them, as search computes them for its own outputs."""
        device = next(self.model.parameters()).device
        src_ids = self.tokenizer.encode_src([normalize(line) for line in sources])
        tgt_ids = self.tokenizer.encode_tgt([normalize(line) for line in targets])
        lengths = np.array([len(s) + len(t) + 1 for s, t in zip(src_ids, tgt_ids)], dtype=np.int64)
        scores: list[PairScore] = [PairScore([], [], 0.0)] * len(sources)
        for indices in token_batches(lengths, max_tokens=decode.batch_tokens):
            if deadline is not None and time.monotonic() > deadline:
                raise DeadlinePassed
            src = pad([src_ids[i] for i in indices]).to(device)
            tgt_in = pad([[BOS_ID, *tgt_ids[i]] for i in indices]).to(device)
            gold = pad([[*tgt_ids[i], EOS_ID] for i in indices]).to(device)
            log_probs = self.model(src, tgt_in).float().log_softmax(-1).gather(-1, gold.unsqueeze(-1)).squeeze(-1)
            for row, index in enumerate(indices.tolist()):
                values = log_probs[row, : len(tgt_ids[index]) + 1].tolist()
                pieces = [*self.tokenizer.tgt_pieces(tgt_ids[index]), "</s>"]
                scores[index] = PairScore(pieces, values, decode.normalized_score(sum(values), len(values)))
            if progress is not None:
                progress(len(indices))
        return scores


def translate_lines(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    lines: list[str],
    config: DecodeConfig,
    *,
    progress: LinesDone | None = None,
    prefixes: list[str] | None = None,
    constraints: list[list[str]] | None = None,
    line_numbers: list[int] | None = None,
    deadline: float | None = None,
    shortlist: TargetLists | None = None,
) -> list[Translation]:
    """Translate many lines at once; output order equals input order. `prefixes` and `constraints`
    guide the lines that have them; `line_numbers`, `deadline` and `progress` as engine.Engine.translate; with
    a `shortlist`, each line's output is made of its shortlist's pieces (shortlisted_decoder.py).

    On a CUDA GPU our model decodes through CUDA graphs (graphed_decoder.py says why); the outputs
    are the same."""
    device = next(model.parameters()).device
    decoder = GraphedDecoder(model) if graphs_apply(model) else model
    texts = [normalize(line) for line in lines]
    non_empty = np.array([i for i, text in enumerate(texts) if text], dtype=np.int64)
    encoded = tokenizer.encode_src([texts[i] for i in non_empty])
    guidance = _encoded_guidance(tokenizer, non_empty.tolist(), prefixes, constraints)
    lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
    results: list[Translation] = [Translation([]) for _ in lines]  # an empty line stays empty
    batches = token_batches(lengths, max_tokens=config.batch_tokens)
    numbers = np.asarray(range(len(lines)) if line_numbers is None else line_numbers, dtype=np.int64)[non_empty]
    done = progress or (lambda _count: None)
    done(len(lines) - len(non_empty))
    for indices in batches:
        src = pad([encoded[i] for i in indices]).to(device)
        guides = guidance.subset(indices.tolist())
        found = search(
            decoder if shortlist is None else _shortlisted(decoder, shortlist, guides, tokenizer.tgt_vocab_size),
            src,
            config,
            lines=numbers[indices].tolist(),
            deadline=deadline,
            guidance=guides,
        )
        for index, hyps in zip(non_empty[indices].tolist(), found):
            results[index] = Translation([(tokenizer.decode_tgt(h.tokens), h.score) for h in hyps])
        done(len(indices))
    return results


def _shortlisted(decoder, shortlist: TargetLists, guides: Guidance, vocabulary_size: int) -> ShortlistedDecoder:
    """The decoder held to each sentence's shortlist, which holds its prefix and constraint pieces too."""
    extra = [
        [*prefix, *(i for phrase in phrases for i in phrase)]
        for prefix, phrases in zip(guides.prefixes, guides.constraints)
    ]
    return ShortlistedDecoder(decoder, shortlist, extra, vocabulary_size)


def _encoded_guidance(
    tokenizer: Tokenizer, rows: list[int], prefixes: list[str] | None, constraints: list[list[str]] | None
) -> Guidance:
    """The guidance of the lines at `rows`, as target ids: phrases that encode to nothing are dropped."""
    prefix_ids = tokenizer.encode_tgt([normalize(prefixes[row]) for row in rows]) if prefixes else [[] for _ in rows]
    phrases = [[normalize(phrase) for phrase in constraints[row]] if constraints else [] for row in rows]
    flat = tokenizer.encode_tgt([phrase for line in phrases for phrase in line])
    grouped, start = [], 0
    for line in phrases:
        grouped.append([ids for ids in flat[start : start + len(line)] if ids])
        start += len(line)
    return Guidance(prefix_ids, grouped, tokenizer.tgt_word_continuations if flat else frozenset())

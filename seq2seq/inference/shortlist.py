"""A lexical shortlist: for each source piece, the target pieces most associated with it in the
training data, plus the most frequent target pieces; decoding a line then scores only the pieces
its own source can lead to (Marian's `--shortlist`, CTranslate2's vocabulary map).

The output layer is the largest matrix product of a small model's decoder step, and a line needs
a few hundred of its thousands of rows. The association is Dice's coefficient over sentence pairs,
2 c(s, t) / (c(s) + c(t)), counted on the pieces present in each pair: unlike p(t | s) it does not
hand every source piece the frequent target pieces, which the frequent list covers once for all.

The file is CTranslate2's vocabulary map, so an export carries it unchanged (export.py):
    <TAB>frequent target pieces          (the line with no source: always allowed)
    source piece<TAB>target pieces
CTranslate2 always adds the unknown piece, BOS and EOS and a target prefix's pieces; so does
`TargetLists`, with a line's constraint pieces.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seq2seq.data.sources import normalize
from seq2seq.data.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from seq2seq.errors import UserInputError
from seq2seq.files import write_text_atomic

ALWAYS_ALLOWED = (UNK_ID, BOS_ID, EOS_ID)  # as CTranslate2's VocabularyMap adds them
PAIRS_PER_CHUNK = 2_000  # sentence pairs counted at a time: keeps the (source, target) keys in memory small


@dataclass(frozen=True)
class Shortlist:
    """Target pieces by source piece, and the pieces every line may produce, as piece strings
    (what the file holds, independent of ids)."""

    frequent: tuple[str, ...]
    candidates: dict[str, tuple[str, ...]]

    def write(self, path: str | Path) -> None:
        lines = ["\t" + " ".join(self.frequent)]
        lines += [f"{source}\t{' '.join(targets)}" for source, targets in self.candidates.items()]
        write_text_atomic(path, "\n".join(lines) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Shortlist:
        """The file `write` writes (a CTranslate2 vocabulary map of single pieces); a malformed line
        is named by number."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise UserInputError(f"{path}: unreadable shortlist ({error})") from None
        frequent: tuple[str, ...] = ()
        candidates: dict[str, tuple[str, ...]] = {}
        for number, line in enumerate(text.splitlines(), start=1):
            source, tab, targets = line.partition("\t")
            if not tab or " " in source:
                raise UserInputError(
                    f"{path}:{number}: expected 'source piece<TAB>target pieces' (one source piece, or none)"
                )
            if source:
                candidates[source] = tuple(targets.split())
            else:
                frequent = tuple(targets.split())
        if not frequent and not candidates:
            raise UserInputError(f"{path}: an empty shortlist; expected lines 'source piece<TAB>target pieces'")
        return cls(frequent, candidates)

    def target_lists(self, source_model, target_model) -> TargetLists:
        """The shortlist as ids of these SentencePiece models; a piece either does not know is
        refused (the shortlist was built for another vocabulary)."""
        frequent = _ids(target_model, self.frequent, "target")
        table: dict[int, np.ndarray] = {}
        for source, targets in self.candidates.items():
            table[_ids(source_model, (source,), "source")[0]] = np.asarray(_ids(target_model, targets, "target"))
        return TargetLists(np.asarray(sorted({*frequent, *ALWAYS_ALLOWED}), dtype=np.int64), table)


def _ids(model, pieces: Iterable[str], side: str) -> list[int]:
    ids = [model.piece_to_id(piece) for piece in pieces]
    unknown = [piece for piece, index in zip(pieces, ids) if index == UNK_ID and piece != model.id_to_piece(UNK_ID)]
    if unknown:
        raise UserInputError(
            f"shortlist: {side} piece {unknown[0]!r} is not in the model's vocabulary; "
            "expected a shortlist built for this model (seq2seq shortlist)"
        )
    return ids


@dataclass(frozen=True)
class TargetLists:
    """The shortlist as ids: the target ids any line may produce, and each source id's own."""

    always: np.ndarray  # sorted target ids
    by_source: dict[int, np.ndarray]

    def allowed(self, source_ids: Iterable[int], extra: Iterable[int] = ()) -> np.ndarray:
        """The sorted target ids a line of these source ids may produce; `extra`: its prefix and
        constraint pieces, which its output must be able to hold."""
        parts = [self.always, np.fromiter(extra, dtype=np.int64)]
        parts += [self.by_source[source] for source in set(source_ids) if source in self.by_source]
        return np.unique(np.concatenate(parts))


def build_shortlist(
    src_ids: list[list[int]],
    tgt_ids: list[list[int]],
    source_model,
    target_model,
    *,
    per_source: int,
    frequent: int,
) -> Shortlist:
    """The `per_source` target pieces of highest Dice association with each source piece, and the
    `frequent` most frequent target pieces, from tokenized sentence pairs (ids, specials ignored)."""
    source_size, target_size = source_model.get_piece_size(), target_model.get_piece_size()
    special = np.asarray([PAD_ID, *ALWAYS_ALLOWED])
    src_sets = [np.setdiff1d(np.asarray(ids, dtype=np.int64), special) for ids in src_ids]
    tgt_sets = [np.setdiff1d(np.asarray(ids, dtype=np.int64), special) for ids in tgt_ids]
    source_counts = np.bincount(np.concatenate([[], *src_sets]).astype(np.int64), minlength=source_size)
    target_counts = np.bincount(np.concatenate([[], *tgt_sets]).astype(np.int64), minlength=target_size)
    tokens = np.bincount(np.concatenate([[], *map(np.asarray, tgt_ids)]).astype(np.int64), minlength=target_size)
    tokens[[PAD_ID, *ALWAYS_ALLOWED]] = 0
    common = [int(i) for i in np.argsort(-tokens, kind="stable")[:frequent] if tokens[i] > 0]

    keys, counts = _pair_counts(src_sets, tgt_sets, target_size)
    sources, targets = keys // target_size, keys % target_size
    dice = 2.0 * counts / (source_counts[sources] + target_counts[targets])
    order = np.lexsort((targets, -dice, sources))  # by source, best association first, ties by id
    sources, targets = sources[order], targets[order]
    starts = np.flatnonzero(np.r_[True, sources[1:] != sources[:-1]])
    ends = np.r_[starts[1:], len(sources)]
    candidates = {
        source_model.id_to_piece(int(sources[start])): tuple(
            target_model.id_to_piece(int(t)) for t in targets[start : min(end, start + per_source)]
        )
        for start, end in zip(starts, ends)
    }
    return Shortlist(tuple(target_model.id_to_piece(i) for i in common), candidates)


def _pair_counts(src_sets: list[np.ndarray], tgt_sets: list[np.ndarray], target_size: int):
    """In how many sentence pairs each (source piece, target piece) occurs together: sorted keys
    source * target_size + target, and their counts."""
    keys, counts = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    for start in range(0, len(src_sets), PAIRS_PER_CHUNK):
        chunk = [
            (s[:, None] * target_size + t[None, :]).ravel()
            for s, t in zip(src_sets[start : start + PAIRS_PER_CHUNK], tgt_sets[start : start + PAIRS_PER_CHUNK])
        ]
        found, found_counts = np.unique(np.concatenate([np.zeros(0, dtype=np.int64), *chunk]), return_counts=True)
        merged = np.concatenate([keys, found])
        keys, inverse = np.unique(merged, return_inverse=True)
        counts = np.bincount(inverse, weights=np.concatenate([counts, found_counts]), minlength=len(keys))
        counts = counts.astype(np.int64)
    return keys, counts


def shortlist_from_corpus(
    tokenizer, sources: Iterable[str], targets: Iterable[str], *, per_source: int, frequent: int
) -> Shortlist:
    """The shortlist of a tokenizer's pieces over sentence pairs of text (`seq2seq shortlist`)."""
    sources, targets = list(sources), list(targets)
    if len(sources) != len(targets) or not sources:
        raise UserInputError(f"shortlist: {len(sources)} sources and {len(targets)} targets; expected equal, non-zero")
    return build_shortlist(
        tokenizer.encode_src([normalize(line) for line in sources]),
        tokenizer.encode_tgt([normalize(line) for line in targets]),
        tokenizer.src_model,
        tokenizer.tgt_model,
        per_source=per_source,
        frequent=frequent,
    )

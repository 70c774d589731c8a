"""Token ids of a whole corpus held as flat numpy arrays plus offsets (no per-sentence Python lists).

On disk (the encoding cache) each side is `{side}_ids.bin`, the raw little-endian int32 ids one
sentence after another, and `{side}_offsets.npy`; the raw file can be appended to chunk by chunk,
so a corpus of any size is written without ever being whole in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seq2seq.data.sources import chunked
from seq2seq.data.special_tokens import PAD_ID
from seq2seq.data.tokenizer import SubwordSampling, Tokenizer

ENCODE_CHUNK = 50_000  # sentences per tokenizer call: bounds the temporary Python lists
ID_DTYPE = np.dtype("<i4")
SIDES = ("src", "tgt")


@dataclass(frozen=True)
class RaggedIds:
    """Sentence i is ids[offsets[i]:offsets[i + 1]]."""

    ids: np.ndarray  # int32
    offsets: np.ndarray  # int64, length n + 1

    @classmethod
    def from_lists(cls, sequences: list[list[int]]) -> RaggedIds:
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter((i for s in sequences for i in s), dtype=np.int32, count=int(offsets[-1]))
        return cls(ids, offsets)

    @classmethod
    def concatenate(cls, parts: list[RaggedIds]) -> RaggedIds:
        ids = np.concatenate([p.ids for p in parts]) if parts else np.zeros(0, np.int32)
        offsets, start = [np.zeros(1, np.int64)], 0
        for part in parts:
            offsets.append(part.offsets[1:] + start)
            start += int(part.offsets[-1])
        return cls(ids, np.concatenate(offsets))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.ids[self.offsets[index] : self.offsets[index + 1]]

    def lengths(self, indices: np.ndarray | None = None) -> np.ndarray:
        """The length of every sentence, or of the sentences `indices` alone: a batch's lengths
        without a pass over the whole corpus, which took milliseconds a batch at millions of pairs."""
        if indices is None:
            return np.diff(self.offsets)
        return self.offsets[indices + 1] - self.offsets[indices]

    def padded(self, indices: np.ndarray, *, first: int | None = None, last: int | None = None) -> np.ndarray:
        """Sentences `indices` as rows of a (len(indices), longest) int64 matrix, right-padded with
        PAD; `first` / `last`, where given, an id placed before / after each sentence's ids.

        One gather for the whole batch: a Python loop over its sentences took milliseconds of host
        time per batch at GPU batch sizes, time in which the GPU waited for its next step."""
        lengths = self.lengths(indices)
        shift = int(first is not None)
        width = int(lengths.max(initial=0)) + shift + int(last is not None)
        columns = np.arange(width)
        inside = (columns >= shift) & (columns < lengths[:, None] + shift)
        out = np.full((len(indices), width), PAD_ID, dtype=np.int64)
        out[inside] = self.ids[(self.offsets[indices][:, None] + columns - shift)[inside]]
        if first is not None:
            out[:, 0] = first
        if last is not None:
            out[np.arange(len(indices)), lengths + shift] = last
        return out

    def subset(self, keep: np.ndarray) -> RaggedIds:
        """The sentences where the boolean mask `keep` is true, gathered without a Python loop."""
        lengths = self.lengths()[keep]
        starts = self.offsets[:-1][keep]
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
        return RaggedIds(np.ascontiguousarray(self.ids[positions]), offsets)


@dataclass(frozen=True)
class EncodedCorpus:
    src: RaggedIds  # source ids, ending with EOS
    tgt: RaggedIds  # target ids, without BOS/EOS

    def __len__(self) -> int:
        return len(self.src)

    @classmethod
    def concatenate(cls, parts: list[EncodedCorpus]) -> EncodedCorpus:
        return cls(RaggedIds.concatenate([p.src for p in parts]), RaggedIds.concatenate([p.tgt for p in parts]))

    def subset(self, keep: np.ndarray) -> EncodedCorpus:
        return self if keep.all() else EncodedCorpus(self.src.subset(keep), self.tgt.subset(keep))

    @classmethod
    def load(cls, directory: Path) -> EncodedCorpus:
        """Memory-mapped: the ids stay on disk and are paged in as batches touch them."""
        return cls(
            *(
                RaggedIds(_map_ids(directory / f"{side}_ids.bin"), np.load(directory / f"{side}_offsets.npy"))
                for side in SIDES
            )
        )


def write_corpus(directory: Path, chunks: Iterable[EncodedCorpus]) -> None:
    """Append the chunks to `directory` in the on-disk layout; only their lengths stay in memory."""
    lengths: dict[str, list[np.ndarray]] = {side: [] for side in SIDES}
    with open(directory / "src_ids.bin", "wb") as src_file, open(directory / "tgt_ids.bin", "wb") as tgt_file:
        for chunk in chunks:
            for side, file in (("src", src_file), ("tgt", tgt_file)):
                ragged = getattr(chunk, side)
                file.write(np.ascontiguousarray(ragged.ids, dtype=ID_DTYPE).tobytes())
                lengths[side].append(ragged.lengths())
    for side in SIDES:
        offsets = np.zeros(sum(len(part) for part in lengths[side]) + 1, dtype=np.int64)
        if lengths[side]:
            np.cumsum(np.concatenate(lengths[side]), out=offsets[1:])
        np.save(directory / f"{side}_offsets.npy", offsets)


def _map_ids(path: Path) -> np.ndarray:
    if path.stat().st_size == 0:  # mmap cannot map an empty file
        return np.zeros(0, ID_DTYPE)
    return np.memmap(path, dtype=ID_DTYPE, mode="r")


@dataclass(frozen=True)
class FilterReport:
    kept: int
    too_long: int
    bad_ratio: int

    def describe(self) -> str:
        return f"kept {self.kept} pairs; removed {self.too_long} too long, {self.bad_ratio} with a bad length ratio"

    def __add__(self, other: FilterReport) -> FilterReport:
        return FilterReport(self.kept + other.kept, self.too_long + other.too_long, self.bad_ratio + other.bad_ratio)


def encode_chunks(
    tokenizer: Tokenizer, pairs: Iterable[tuple[str, str]], sampling: SubwordSampling | None = None
) -> Iterator[EncodedCorpus]:
    """Encode a stream of pairs chunk by chunk with all cores (SentencePiece threads; one, when the
    segmentation is sampled, so that its seed repeats it); only one chunk of text is held in memory."""
    for chunk in chunked(pairs, ENCODE_CHUNK):
        src, tgt = zip(*chunk)
        yield EncodedCorpus(
            RaggedIds.from_lists(tokenizer.encode_src(list(src), sampling)),
            RaggedIds.from_lists(tokenizer.encode_tgt(list(tgt), sampling)),
        )


def encode_pairs(tokenizer: Tokenizer, pairs: Iterable[tuple[str, str]]) -> EncodedCorpus:
    """A small corpus (validation, tests), encoded into memory."""
    return EncodedCorpus.concatenate(list(encode_chunks(tokenizer, pairs)))


def length_filter(corpus: EncodedCorpus, *, max_length: int, max_ratio: float) -> tuple[np.ndarray, FilterReport]:
    """Which pairs to keep: none longer than max_length tokens on either side or with a length ratio
    over max_ratio (0 = no ratio limit); and how many each rule removed."""
    src_len, tgt_len = corpus.src.lengths(), corpus.tgt.lengths() + 1  # +1: the EOS added in batches
    too_long = (src_len > max_length) | (tgt_len > max_length)
    ratio = np.maximum(src_len, tgt_len) / np.maximum(np.minimum(src_len, tgt_len), 1)
    bad_ratio = ~too_long & (ratio > max_ratio) if max_ratio > 0 else np.zeros_like(too_long)
    keep = ~(too_long | bad_ratio)
    return keep, FilterReport(int(keep.sum()), int(too_long.sum()), int(bad_ratio.sum()))

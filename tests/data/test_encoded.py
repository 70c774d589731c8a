"""Encoded corpora: ragged id arrays, length filters, chunked writing and memory-mapped reading."""

from __future__ import annotations

import numpy as np

from seq2seq.data.encoded import EncodedCorpus, RaggedIds, length_filter, write_corpus
from seq2seq.data.special_tokens import EOS_ID


def test_ragged_ids_round_trip_and_filter():
    src = RaggedIds.from_lists([[5, 6, EOS_ID], [7, EOS_ID], list(range(4, 20)) + [EOS_ID]])
    tgt = RaggedIds.from_lists([[8, 9], [10], [11]])
    assert src[1].tolist() == [7, EOS_ID]
    assert src.lengths().tolist() == [3, 2, 17]
    keep, report = length_filter(EncodedCorpus(src, tgt), max_length=10, max_ratio=0)
    assert keep.tolist() == [True, True, False] and report.too_long == 1 and report.kept == 2
    keep, report = length_filter(EncodedCorpus(src, tgt), max_length=100, max_ratio=2.0)
    assert keep.tolist() == [True, True, False] and report.bad_ratio == 1  # 17 source tokens vs 2 target tokens


def test_corpus_written_in_chunks_reads_back_memory_mapped(tmp_path):
    rng = np.random.default_rng(0)

    def random_ragged(count):
        return RaggedIds.from_lists([list(rng.integers(4, 99, size=rng.integers(1, 9))) for _ in range(count)])

    chunks = [EncodedCorpus(random_ragged(n), random_ragged(n)) for n in (5, 0, 7)]
    write_corpus(tmp_path, iter(chunks))
    loaded, whole = EncodedCorpus.load(tmp_path), EncodedCorpus.concatenate(chunks)
    assert isinstance(loaded.src.ids, np.memmap) and len(loaded) == 12
    for side in ("src", "tgt"):
        assert np.array_equal(getattr(loaded, side).ids, getattr(whole, side).ids)
        assert np.array_equal(getattr(loaded, side).offsets, getattr(whole, side).offsets)


def test_vectorised_subset_equals_a_python_loop():
    rng = np.random.default_rng(0)
    ragged = RaggedIds.from_lists([list(rng.integers(0, 99, size=rng.integers(0, 9))) for _ in range(200)])
    keep = rng.random(200) < 0.5
    subset = ragged.subset(keep)
    assert [subset[i].tolist() for i in range(len(subset))] == [ragged[i].tolist() for i in np.flatnonzero(keep)]

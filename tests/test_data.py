"""Data sources in every format, their one-line errors, and token-budgeted batches."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from seq2seq.config import CorpusConfig
from seq2seq.data.batching import collate, epoch_batches, padding_fraction, token_batches
from seq2seq.data.encoded import EncodedCorpus, RaggedIds, length_filter, write_corpus
from seq2seq.data.sources import PairCounts, iter_pairs, read_corpus
from seq2seq.errors import UserInputError
from seq2seq.tokenizer import BOS_ID, EOS_ID, PAD_ID


def read(corpus: CorpusConfig):
    return read_corpus(corpus, src_lang="de", tgt_lang="en", key="data.train")


def error_of(corpus: CorpusConfig) -> str:
    with pytest.raises(UserInputError) as info:
        read(corpus)
    return str(info.value)


def test_plain_text_with_gzip_crlf_bom_and_nfd(tmp_path):
    (tmp_path / "a.de").write_bytes("\ufeffGrüße\r\nzwei\r\n".encode())
    with gzip.open(tmp_path / "a.en.gz", "wt", encoding="utf-8") as handle:
        handle.write("gree\u0301tings\ntwo\n")  # NFD accent
    text = read(CorpusConfig(src=str(tmp_path / "a.de"), tgt=str(tmp_path / "a.en.gz")))
    assert text.src == ["Grüße", "zwei"]
    assert text.tgt == ["greétings", "two"]  # NFC-composed


def test_line_count_mismatch_names_both_counts(tmp_path):
    (tmp_path / "a.de").write_text("a\nb\nc\n")
    (tmp_path / "a.en").write_text("a\nb\n")
    message = error_of(CorpusConfig(src=str(tmp_path / "a.de"), tgt=str(tmp_path / "a.en")))
    assert f"{tmp_path / 'a.de'} has 3 lines but {tmp_path / 'a.en'} has 2" in message


def test_invalid_utf8_names_the_line(tmp_path):
    (tmp_path / "a.de").write_bytes(b"fine\nbad \xff byte\n")
    (tmp_path / "a.en").write_text("fine\nok\n")
    message = error_of(CorpusConfig(src=str(tmp_path / "a.de"), tgt=str(tmp_path / "a.en")))
    assert message == f"{tmp_path / 'a.de'}:2: not valid UTF-8 (bad byte at column 5)"


def test_empty_pairs_are_dropped_and_counted(tmp_path):
    (tmp_path / "a.de").write_text("a\n\nc\n")
    (tmp_path / "a.en").write_text("A\nB\n  \n")
    counts = PairCounts()
    corpus = CorpusConfig(src=str(tmp_path / "a.de"), tgt=str(tmp_path / "a.en"))
    pairs = list(iter_pairs(corpus, src_lang="de", tgt_lang="en", key="data.train", counts=counts))
    assert (pairs, counts.kept, counts.dropped_empty) == ([("a", "A")], 1, 2)


def test_tsv_and_its_missing_tab(tmp_path):
    path = tmp_path / "a.tsv"
    path.write_text("hallo\thello\nwelt\tworld\n")
    text = read(CorpusConfig(format="tsv", path=str(path)))
    assert (text.src, text.tgt) == (["hallo", "welt"], ["hello", "world"])
    path.write_text("hallo\thello\nno tab here\n")
    assert error_of(CorpusConfig(format="tsv", path=str(path))) == f"{path}:2: expected source<TAB>target, found no tab"


def test_jsonl_fields_and_errors(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"de": "hallo", "en": "hello"}) + "\n")
    text = read(CorpusConfig(format="jsonl", path=str(path), src_field="de", tgt_field="en"))
    assert (text.src, text.tgt) == (["hallo"], ["hello"])
    path.write_text('{"de": "a", "en": "b"}\n{not json}\n')
    assert error_of(CorpusConfig(format="jsonl", path=str(path), src_field="de", tgt_field="en")).startswith(
        f"{path}:2: not valid JSON"
    )
    path.write_text('{"de": "a"}\n')
    message = error_of(CorpusConfig(format="jsonl", path=str(path), src_field="de", tgt_field="en"))
    assert message == f"{path}:1: missing string field 'en'"


def test_huggingface_local_translation_and_flat_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    nested = datasets.Dataset.from_dict({"translation": [{"de": "hallo", "en": "hello"}, {"de": "ja", "en": "yes"}]})
    nested.save_to_disk(str(tmp_path / "nested"))
    text = read(CorpusConfig(format="hf", path=str(tmp_path / "nested")))
    assert (text.src, text.tgt) == (["hallo", "ja"], ["hello", "yes"])
    flat = datasets.Dataset.from_dict({"source": ["eins"], "target": ["one"]})
    flat.to_parquet(str(tmp_path / "flat.parquet"))
    text = read(CorpusConfig(format="hf", path=str(tmp_path / "flat.parquet"), src_field="source", tgt_field="target"))
    assert (text.src, text.tgt) == (["eins"], ["one"])
    message = error_of(CorpusConfig(format="hf", path=str(tmp_path / "flat.parquet")))
    assert "the dataset has columns ['source', 'target']; expected 'translation' or 'src' and 'tgt'" in message
    with pytest.raises(UserInputError, match=r"languages \['de', 'en'\], not \['fr'\]"):
        read_corpus(CorpusConfig(format="hf", path=str(tmp_path / "nested")), src_lang="fr", tgt_lang="en", key="k")


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


def test_collate_builds_the_teacher_forcing_shift():
    batch = collate([np.array([5, EOS_ID]), np.array([6, 7, EOS_ID])], [np.array([8, 9]), np.array([10])])
    assert batch.src.tolist() == [[5, EOS_ID, PAD_ID], [6, 7, EOS_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 8, 9], [BOS_ID, 10, PAD_ID]]
    assert batch.tgt_out.tolist() == [[8, 9, EOS_ID], [10, EOS_ID, PAD_ID]]
    assert batch.num_tokens == 5


def test_token_batches_respect_the_budget_and_cover_every_sentence():
    lengths = np.random.default_rng(0).integers(1, 40, size=500)
    batches = token_batches(lengths, max_tokens=200)
    assert sorted(np.concatenate(batches).tolist()) == list(range(500))
    assert all(len(b) * lengths[b].max() <= 200 for b in batches)


def test_epoch_batches_are_deterministic_per_seed_and_epoch_and_low_padding(demo_pairs):
    rng = np.random.default_rng(1)
    seqs = [list(rng.integers(4, 50, size=rng.integers(1, 30))) for _ in range(400)]
    corpus = EncodedCorpus(RaggedIds.from_lists(seqs), RaggedIds.from_lists(seqs))
    first = epoch_batches(corpus, max_tokens=300, seed=1, epoch=1)
    again = epoch_batches(corpus, max_tokens=300, seed=1, epoch=1)
    other = epoch_batches(corpus, max_tokens=300, seed=1, epoch=2)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(len(a) == len(b) and np.array_equal(a, b) for a, b in zip(first, other))
    assert 0.0 < padding_fraction(corpus, first) < 0.1
    one_batch_per_sentence = [np.array([i]) for i in range(len(corpus))]
    assert padding_fraction(corpus, one_batch_per_sentence) == 0.0
    random_batches = np.array_split(np.random.default_rng(2).permutation(len(corpus)), 40)
    assert padding_fraction(corpus, random_batches) > 0.3

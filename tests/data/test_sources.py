"""Data sources in every format and their one-line errors."""

from __future__ import annotations

import gzip
import json

import pytest

from seq2seq.config import CorpusConfig
from seq2seq.data.sources import PairCounts, iter_pairs, read_corpus
from seq2seq.errors import UserInputError


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
    assert text.tgt == ["gree\u0301tings", "two"]  # as given: validation scores against it


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
    path.write_text("hallo\thello\nnur quelle\t\n\tonly target\n  welt \t world \n")  # empty sides: dropped, counted
    counts = PairCounts()
    kept = list(iter_pairs(CorpusConfig(format="tsv", path=str(path)), src_lang="de", tgt_lang="en", key="k",
                           counts=counts))  # fmt: skip
    assert kept == [("hallo", "hello"), ("welt", "world")] and counts.dropped_empty == 2
    path.write_text("hallo\thello\nno tab here\n")
    assert (
        error_of(CorpusConfig(format="tsv", path=str(path)))
        == f"{path}:2: expected source<TAB>target (one tab), found no tabs"
    )


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


def test_a_missing_split_is_named_with_the_splits_the_dataset_has(tmp_path):
    datasets = pytest.importorskip("datasets")
    one = datasets.Dataset.from_dict({"translation": [{"de": "hallo", "en": "hello"}]})
    datasets.DatasetDict({"train": one, "test": one}).save_to_disk(str(tmp_path / "splits"))
    corpus = CorpusConfig(format="hf", path=str(tmp_path / "splits"), split="validation")
    with pytest.raises(UserInputError) as info:
        read_corpus(corpus, src_lang="de", tgt_lang="en", key="data.valid")
    assert (
        str(info.value)
        == f"data.valid.split: 'validation' is not a split of {tmp_path / 'splits'}; it has 'train', 'test'"
    )
    corpus = CorpusConfig(format="hf", path=str(tmp_path / "splits"), split="test")
    assert read_corpus(corpus, src_lang="de", tgt_lang="en", key="data.valid").src == ["hallo"]


def test_a_training_corpus_reads_the_train_split_unless_told_and_valid_must_name_its_own(tmp_path):
    """data.train and each of data.extra_train default to a dataset's 'train' split; a validation or
    test corpus that named none would silently read the training pairs, and is refused."""
    datasets = pytest.importorskip("datasets")
    train = datasets.Dataset.from_dict({"translation": [{"de": "hallo", "en": "hello"}]})
    test = datasets.Dataset.from_dict({"translation": [{"de": "welt", "en": "world"}]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "splits"))
    corpus = CorpusConfig(format="hf", path=str(tmp_path / "splits"))
    for key in ("data.train", "data.extra_train[2]"):
        assert read_corpus(corpus, src_lang="de", tgt_lang="en", key=key).src == ["hallo"]
    with pytest.raises(UserInputError, match=r"^data.valid.split: not set"):
        read_corpus(corpus, src_lang="de", tgt_lang="en", key="data.valid")

"""Preparing training data: streamed encoding, the on-disk cache and its keys, per-filter counts."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

import seq2seq.data.prepare as prepare
from seq2seq.config_files import config_from_dict
from seq2seq.data.encoded import EncodedCorpus
from seq2seq.data.tokenizer import load_or_train_tokenizer
from seq2seq.errors import UserInputError

from ..conftest import tiny_config_dict


def make(tiny_data, **data_overrides):
    raw = tiny_config_dict(tiny_data)
    raw["data"].update(data_overrides)
    config = config_from_dict(raw, origin="test")
    pairs = prepare.stream_split(config.data, "train")
    tokenizer = load_or_train_tokenizer(tiny_data.parent / "tok", config.tokenizer, pairs, seed=1)
    return config.data, tokenizer


def test_second_preparation_comes_memory_mapped_from_the_cache(tiny_data, monkeypatch, caplog):
    config, tokenizer = make(tiny_data)
    first = prepare.encode_training_split(config, tokenizer)
    monkeypatch.setattr(prepare, "encode_chunks", lambda *a: pytest.fail("encoded again despite the cache"))
    with caplog.at_level(logging.INFO, logger="seq2seq"):
        second = prepare.encode_training_split(config, tokenizer)
    assert isinstance(second.src.ids, np.memmap)
    assert np.array_equal(first.src.ids, second.src.ids) and np.array_equal(first.tgt.offsets, second.tgt.offsets)
    assert "from the cache" in caplog.text and "3000 pairs read" in caplog.text


def test_a_changed_file_or_filter_misses_the_cache(tiny_data):
    config, tokenizer = make(tiny_data)
    prepare.encode_training_split(config, tokenizer)
    entries = lambda: {p.name for p in (tiny_data.parent / "cache").iterdir() if p.is_dir()}  # noqa: E731
    before = entries()
    shorter, _ = make(tiny_data, max_length=12)
    assert len(prepare.encode_training_split(shorter, tokenizer)) < 3000
    with open(tiny_data / "train.en", "a") as handle, open(tiny_data / "train.xx", "a") as other:
        handle.write("the cat sleeps\n")
        other.write("il gat dormar\n")
    assert len(prepare.encode_training_split(config, tokenizer)) == 3001
    assert len(entries()) == len(before) + 2


def test_the_same_text_moved_copied_or_converted_is_not_encoded_again(tiny_data, tmp_path, monkeypatch, caplog):
    """The files' identity (path, size, time) misses after a move, a copy that does not keep times, or a
    conversion to TSV; the text is read once (no encoding) and the entry encoded from it is taken."""
    import os
    import shutil

    config, tokenizer = make(tiny_data)
    first = prepare.encode_training_split(config, tokenizer)
    moved = tmp_path / "elsewhere"
    shutil.copytree(tiny_data, moved)  # another path
    lines = [(tiny_data / f"train.{lang}").read_text().splitlines() for lang in ("en", "xx")]
    (moved / "train.tsv").write_text("".join(f"{src}\t{tgt}\n" for src, tgt in zip(*lines)))
    os.utime(tiny_data / "train.en", ns=(0, 0))  # the same path, another time
    elsewhere = dataclasses.replace(
        config, train=dataclasses.replace(config.train, src=str(moved / "train.en"), tgt=str(moved / "train.xx"))
    )
    converted = dataclasses.replace(
        config, train=dataclasses.replace(config.train, format="tsv", path=str(moved / "train.tsv"), src=None, tgt=None)
    )
    monkeypatch.setattr(prepare, "encode_chunks", lambda *a: pytest.fail("encoded again: the same text"))
    for data in (config, elsewhere, converted):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="seq2seq"):
            again = prepare.encode_training_split(data, tokenizer)
        assert np.array_equal(first.src.ids, again.src.ids) and np.array_equal(first.tgt.offsets, again.tgt.offsets)
        assert "the same text, encoded before from other files or another format" in caplog.text
    assert len([p for p in (tiny_data.parent / "cache").iterdir() if p.is_dir()]) == 1


def test_cache_can_be_disabled_and_filters_are_counted(tiny_data, caplog):
    config, tokenizer = make(tiny_data, cache_dir="", max_length=10, max_length_ratio=1.5)
    with caplog.at_level(logging.INFO, logger="seq2seq"):
        corpus = prepare.encode_training_split(config, tokenizer)
    assert not isinstance(corpus.src.ids, np.memmap)
    assert not (tiny_data.parent / "cache").exists()
    line = next(r.message for r in caplog.records if "pairs read" in r.message)
    too_long, bad_ratio = (int(line.split(", ")[i].split()[0]) for i in (1, 2))
    assert too_long > 0 and bad_ratio > 0 and f"kept {len(corpus)}" in line


def test_filters_that_remove_everything_name_the_split_and_leave_no_cache_entry(tiny_data):
    config, tokenizer = make(tiny_data, max_length=1)
    with pytest.raises(UserInputError, match=r"data.train: no sentence pairs left after filtering \(kept 0 pairs"):
        prepare.encode_training_split(config, tokenizer)
    assert not any((tiny_data.parent / "cache").iterdir())  # the half-written entry was removed


def test_ids_are_never_whole_in_memory_while_the_cache_is_written(tiny_data, monkeypatch):
    """Chunks go to disk as they are encoded: nothing concatenates the split's ids in memory."""
    monkeypatch.setattr("seq2seq.data.encoded.ENCODE_CHUNK", 500)
    monkeypatch.setattr(EncodedCorpus, "concatenate", lambda *a: pytest.fail("the whole split was concatenated"))
    config, tokenizer = make(tiny_data)
    corpus = prepare.encode_training_split(config, tokenizer)
    assert len(corpus) == 3000 and isinstance(corpus.tgt.ids, np.memmap)


def test_sampled_segmentations_are_seeded_cached_and_taken_in_turn_by_epochs(tiny_data, monkeypatch):
    """Subword sampling: each variant is a different segmentation of the same text (it decodes back
    to it), a seed repeats it (from a fresh encode, cache off), a second preparation reads every
    variant from the cache, and epochs take the variants in turn."""
    config, tokenizer = make(tiny_data, subword_alpha=0.2, subword_variants=3)
    data = prepare.prepare_training_data(config, tokenizer, seed=5)
    assert len(data.variants) == 3 and data.train is data.variants[0]
    assert [data.train_for_epoch(epoch) is data.variants[(epoch - 1) % 3] for epoch in range(1, 8)] == [True] * 7
    plain = prepare.encode_training_split(dataclasses.replace(config, subword_alpha=0.0), tokenizer)
    texts = [tokenizer.decode_tgt(plain.tgt[i].tolist()) for i in range(50)]
    for variant in data.variants:
        assert [tokenizer.decode_tgt(variant.tgt[i].tolist()) for i in range(50)] == texts
    differing = [sum(not np.array_equal(a.tgt[i], b.tgt[i]) for i in range(200))
                 for a, b in [(plain, data.variants[0]), (data.variants[0], data.variants[1])]]  # fmt: skip
    # sampled: many segmentations differ from the plain one and each other (18 to 33 of 200 lines at
    # alpha 0.2, by sentencepiece version; an unsampled variant differs in none)
    assert min(differing) > 10, differing
    again = prepare.encode_training_split(dataclasses.replace(config, cache_dir=""), tokenizer, sampled_seed=5001)
    assert np.array_equal(again.src.ids, data.variants[1].src.ids)  # seed 1000 * 5 + 1, encoded anew
    assert np.array_equal(again.tgt.ids, data.variants[1].tgt.ids)
    monkeypatch.setattr(prepare, "encode_chunks", lambda *a: pytest.fail("encoded again despite the cache"))
    cached = prepare.prepare_training_data(config, tokenizer, seed=5)
    assert all(np.array_equal(a.tgt.ids, b.tgt.ids) for a, b in zip(cached.variants, data.variants))


def test_the_text_digest_names_the_text_not_its_file_format_segmentation_or_cache(tiny_data):
    """What a checkpoint records of its training data (TrainingData.text_digest): the same for the
    same pairs from a TSV file, sampled into pieces or read back from the cache; another for one pair
    changed."""
    config, tokenizer = make(tiny_data)
    plain = prepare.prepare_training_data(config, tokenizer).text_digest
    assert len(plain) == 64 and prepare.prepare_training_data(config, tokenizer).text_digest == plain  # cached
    sampled = dataclasses.replace(config, subword_alpha=0.2, subword_variants=2)
    assert prepare.prepare_training_data(sampled, tokenizer, seed=5).text_digest == plain
    lines = [(tiny_data / f"train.{lang}").read_text().splitlines() for lang in ("en", "xx")]
    tsv = tiny_data / "train.tsv"
    tsv.write_text("".join(f"{src}\t{tgt}\n" for src, tgt in zip(*lines)))
    as_tsv = dataclasses.replace(config, train=dataclasses.replace(config.train, format="tsv", path=str(tsv)))
    assert prepare.prepare_training_data(as_tsv, tokenizer).text_digest == plain
    tsv.write_text("".join(f"{src}\t{tgt}\n" for src, tgt in zip(lines[0], ["changed", *lines[1][1:]])))
    assert prepare.prepare_training_data(as_tsv, tokenizer).text_digest != plain


def test_text_the_tokenizer_does_not_cover_is_a_warning_with_its_share(tiny_data, caplog):
    """Pieces a tokenizer maps to <unk> cannot be learned: a tokenizer trained on other text (a
    fine-tuning run's, train.init_from) says how much of the training text it misses; its own text, none."""
    config, tokenizer = make(tiny_data)
    with caplog.at_level(logging.INFO, logger="seq2seq"):
        prepare.encode_training_split(config, tokenizer)
    assert "unknown to the tokenizer" not in caplog.text
    lines = (tiny_data / "train.xx").read_text().splitlines()
    (tiny_data / "other.xx").write_text("".join(f"{line} \u0436\u0436\u0436\n" for line in lines))  # Cyrillic
    other = dataclasses.replace(config, train=dataclasses.replace(config.train, tgt=str(tiny_data / "other.xx")))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="seq2seq"):
        prepare.encode_training_split(other, tokenizer)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "of the target pieces are unknown to the tokenizer" in warnings[0], warnings
    assert "source pieces" not in warnings[0]


@pytest.mark.parametrize(("key", "value"), [("subword_alpha", 1.5), ("subword_nbest", 0), ("subword_variants", 0)])
def test_impossible_subword_settings_are_named(tiny_data, key, value):
    raw = tiny_config_dict(tiny_data)
    raw["data"][key] = value
    with pytest.raises(UserInputError, match=f"data.{key}"):
        config_from_dict(raw, origin="test")


def test_a_cache_this_process_may_only_read_still_serves_its_entries(tiny_data, monkeypatch):
    """Naming an entry by its text writes beside it; a shared cache that is read-only here keeps
    serving its entries (a hit wrote nothing before text names)."""
    config, tokenizer = make(tiny_data)
    first = prepare.encode_training_split(config, tokenizer)
    for name in (tiny_data.parent / "cache").glob("text-*"):
        name.unlink()  # an entry made before entries were named by text

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(args[0]))

    monkeypatch.setattr("seq2seq.data.cache.write_text_atomic", read_only)
    again = prepare.encode_training_split(config, tokenizer)
    assert np.array_equal(first.src.ids, again.src.ids)


def split_train(tiny_data, at: int = 2000) -> None:
    """train.* cut into head.* (its first `at` pairs) and tail.* (the rest)."""
    for lang in ("en", "xx"):
        lines = (tiny_data / f"train.{lang}").read_text().splitlines(keepends=True)
        (tiny_data / f"head.{lang}").write_text("".join(lines[:at]))
        (tiny_data / f"tail.{lang}").write_text("".join(lines[at:]))


def corpus(tiny_data, name: str, **keys) -> dict:
    return {"src": str(tiny_data / f"{name}.en"), "tgt": str(tiny_data / f"{name}.xx"), **keys}


def test_extra_corpora_are_encoded_after_data_train_tagged_and_weighted(tiny_data, monkeypatch, caplog):
    """Each corpus's pairs in turn, a tagged corpus's sources starting with its tag as one piece (the rest
    segmented as without it), its size known, so that an epoch shows it by its weight; cached as one."""
    split_train(tiny_data)
    raw = tiny_config_dict(tiny_data)
    raw["data"].update(train=corpus(tiny_data, "head"), extra_train=[corpus(tiny_data, "tail", tag="<bt>", weight=0.5)])
    raw["tokenizer"]["user_defined_symbols"] = ["<bt>"]
    config = config_from_dict(raw, origin="test")
    tokenizer = load_or_train_tokenizer(
        tiny_data.parent / "tok", config.tokenizer, prepare.stream_split(config.data, "train"), seed=1
    )
    with caplog.at_level(logging.INFO, logger="seq2seq"):
        data = prepare.prepare_training_data(config.data, tokenizer)
    assert data.corpus_sizes == ((2000, 1000),) and data.weights == (1.0, 0.5)
    assert "data.train 2000 pairs x 1, data.extra_train[0] 1000 pairs x 0.5 (tagged <bt>); an epoch shows 2500" in (
        caplog.text
    )
    sources = (tiny_data / "train.en").read_text().splitlines()
    plain = tokenizer.encode_src(sources)
    for row in (0, 1999, 2000, 2999):
        ids = data.train.src[row].tolist()
        if row < 2000:
            assert ids == plain[row]
        else:
            assert tokenizer.tgt_pieces(ids[:2]) == ["▁", "<bt>"] and ids[2:] == plain[row]
    rows = data.rows_for_epoch(3, seed=1)
    shown = np.bincount(rows, minlength=3000)
    assert (shown[:2000] == 1).all() and shown[2000:].sum() == 500 and shown.max() == 1
    monkeypatch.setattr(prepare, "encode_chunks", lambda *a: pytest.fail("encoded again despite the cache"))
    again = prepare.prepare_training_data(config.data, tokenizer)
    assert np.array_equal(again.train.src.ids, data.train.src.ids) and again.corpus_sizes == data.corpus_sizes


def test_extra_corpora_at_weight_one_untagged_are_their_files_concatenated(tiny_data):
    split_train(tiny_data)
    config, tokenizer = make(tiny_data)
    whole = prepare.prepare_training_data(config, tokenizer)
    mixed, _ = make(tiny_data, train=corpus(tiny_data, "head"), extra_train=[corpus(tiny_data, "tail")])
    parts = prepare.prepare_training_data(mixed, tokenizer)
    assert np.array_equal(whole.train.src.ids, parts.train.src.ids) and np.array_equal(
        whole.train.tgt.offsets, parts.train.tgt.offsets
    )
    assert parts.rows_for_epoch(1, seed=1) is None  # every pair once: the batches of the concatenated file
    # the same pairs, but counted in another corpus: a run trained on one is not resumed on the other
    assert parts.text_digest != whole.text_digest


def test_an_extra_corpus_that_is_empty_or_filtered_away_is_named(tiny_data):
    (tiny_data / "empty.en").write_text("\n\n")
    (tiny_data / "empty.xx").write_text("\n\n")
    long_line = " ".join(["word"] * 300) + "\n"
    (tiny_data / "long.en").write_text(long_line * 3)
    (tiny_data / "long.xx").write_text(long_line * 3)
    for name, expected in [("empty", "no sentence pairs found"), ("long", "no sentence pairs left after filtering")]:
        config, tokenizer = make(tiny_data, extra_train=[corpus(tiny_data, "train"), corpus(tiny_data, name)])
        with pytest.raises(UserInputError, match=rf"^data.extra_train\[1\]: {expected}"):
            prepare.prepare_training_data(config, tokenizer)


def test_each_sampled_segmentation_weighs_the_corpora_it_kept(tiny_data):
    """With subword sampling, the length filters may keep other pairs in each variant: an epoch weighs
    the corpora of the variant it trains on, by that variant's own sizes."""
    config, tokenizer = make(
        tiny_data,
        extra_train=[corpus(tiny_data, "train", weight=0.5)],
        subword_alpha=0.5,
        subword_variants=3,
        max_length=30,
    )
    data = prepare.prepare_training_data(config, tokenizer, seed=2)
    assert len(data.corpus_sizes) == 3 and len(set(data.corpus_sizes)) > 1, data.corpus_sizes  # the filters differ
    for epoch in range(1, 7):
        sizes = data.corpus_sizes[(epoch - 1) % 3]
        assert sum(sizes) == len(data.train_for_epoch(epoch))
        shown = np.bincount(data.rows_for_epoch(epoch, seed=2), minlength=sum(sizes))
        assert len(shown) == sum(sizes) and (shown[: sizes[0]] == 1).all()
        assert shown[sizes[0] :].sum() == round(sizes[1] / 2) and shown.max() == 1

"""The embedded task: deterministic, 3-30 words, and not solvable by copying or a word-by-word table."""

from __future__ import annotations

from collections import defaultdict

from seq2seq.data.demo_data import make_demo_corpus, write_demo_corpus

SIZES = {"train": 3000, "valid": 200, "test": 200}


def test_same_seed_same_corpus_other_seed_other_corpus():
    assert make_demo_corpus(seed=5, sizes=SIZES) == make_demo_corpus(seed=5, sizes=SIZES)
    assert make_demo_corpus(seed=5, sizes=SIZES) != make_demo_corpus(seed=6, sizes=SIZES)


def test_lengths_and_held_out_splits():
    corpus = make_demo_corpus(seed=1, sizes=SIZES)
    lengths = [len(src.split()) for pairs in corpus.values() for src, _ in pairs]
    assert min(lengths) == 3 and max(lengths) == 30
    train = {src for src, _ in corpus["train"]}
    assert not train & {src for src, _ in corpus["test"]}


def test_not_solvable_by_copying_or_a_word_table():
    corpus = make_demo_corpus(seed=1, sizes=SIZES)["train"]
    shared = sum(len(set(s.split()) & set(t.split())) for s, t in corpus)
    assert shared == 0  # the vocabularies are disjoint: copying gets nothing right
    # A source word maps to several target words depending on context (agreement)...
    renderings = defaultdict(set)
    for src, tgt in corpus:
        s, t = src.split(), tgt.split()
        if len(s) == 3 and len(t) == 3:  # "the big cat" patterns are not clauses; use det noun verb
            renderings[s[0]].add(t[0])
    assert len(renderings["the"]) >= 4  # il/la/ei/le: gender and number of the target noun
    # ...and the order differs: the target clause ends with its verb (SOV), the source one rarely does.
    single_clauses = [(s.split(), t.split()) for s, t in corpus if " and " not in s and " but " not in s]
    assert all(t[-1].endswith(("ar", "aron", "ut", "uton")) for _, t in single_clauses)
    source_verb_last = sum(
        s[-1].endswith(("s", "ed", "saw", "found", "slept")) and len(s) <= 4 for s, _ in single_clauses
    )
    assert source_verb_last < len(single_clauses) / 2


def test_write_demo_corpus_is_idempotent(tmp_path):
    first = write_demo_corpus(tmp_path / "a")
    second = write_demo_corpus(tmp_path / "b")
    for name in ("train.en", "train.xx", "valid.en", "test.xx"):
        assert (first / name).read_bytes() == (second / name).read_bytes()
    assert len((first / "train.en").read_text().splitlines()) == 30_000

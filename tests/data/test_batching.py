"""The Batch type's teacher-forcing shift and token-budgeted, seeded batches."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from seq2seq.data.batching import (
    POSITION_MULTIPLE,
    collate,
    epoch_batches,
    make_batch,
    padding_fraction,
    token_batches,
    weighted_rows,
)
from seq2seq.data.encoded import EncodedCorpus, RaggedIds
from seq2seq.data.special_tokens import BOS_ID, EOS_ID, PAD_ID


def test_collate_builds_the_teacher_forcing_shift():
    batch = collate([np.array([5, EOS_ID]), np.array([6, 7, EOS_ID])], [np.array([8, 9]), np.array([10])])
    assert batch.src.tolist() == [[5, EOS_ID, PAD_ID], [6, 7, EOS_ID]]
    assert batch.tgt_in.tolist() == [[BOS_ID, 8, 9], [BOS_ID, 10, PAD_ID]]
    assert batch.tgt_out.tolist() == [[8, 9, EOS_ID], [10, EOS_ID, PAD_ID]]
    assert batch.num_tokens == 5


sentences = st.lists(st.integers(4, 99), max_size=12)  # real ids: never PAD, BOS or EOS


@given(st.lists(st.tuples(sentences, sentences), min_size=1, max_size=16), st.data())
def test_a_batch_of_any_pairs_of_a_corpus_is_each_pair_shifted_and_padded(pairs, data):
    """make_batch gathers a whole batch at once from the corpus's flat ids: each row must be the
    sentence it names, as a per-sentence loop would lay it out, in the order the indices give."""
    src = [s + [EOS_ID] for s, _ in pairs]
    tgt = [t for _, t in pairs]
    corpus = EncodedCorpus(RaggedIds.from_lists(src), RaggedIds.from_lists(tgt))
    order = data.draw(st.permutations(range(len(pairs))))
    indices = np.array(order[: data.draw(st.integers(1, len(pairs)))])
    batch = make_batch(corpus, indices)

    def padded(rows: list[list[int]]) -> list[list[int]]:
        width = max(len(row) for row in rows)
        return [row + [PAD_ID] * (width - len(row)) for row in rows]

    assert batch.src.tolist() == padded([src[i] for i in indices])
    assert batch.tgt_in.tolist() == padded([[BOS_ID, *tgt[i]] for i in indices])
    assert batch.tgt_out.tolist() == padded([[*tgt[i], EOS_ID] for i in indices])
    assert batch.targets.tolist() == [token for i in indices for token in [*tgt[i], EOS_ID]]
    assert batch.num_tokens == sum(len(tgt[i]) + 1 for i in indices)
    assert corpus.tgt.lengths(indices).tolist() == [len(tgt[i]) for i in indices]  # a batch's, not the corpus's


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


def test_batches_round_the_output_rows_up_and_keep_the_real_targets():
    batch = collate([np.array([5, EOS_ID])] * 3, [np.array([6, 7, 8])] * 3)
    assert batch.num_tokens == len(batch.targets) == 12  # 3 x (3 + EOS)
    assert len(batch.target_positions) == POSITION_MULTIPLE
    assert batch.target_positions[:12].tolist() == list(range(12)) and batch.targets.tolist() == [6, 7, 8, 3] * 3


def test_weighted_rows_show_each_corpus_its_weight_times_and_draw_a_fraction_afresh_each_epoch():
    sizes, weights = (10, 8, 5), (2.0, 0.5, 1.0)
    assert weighted_rows(sizes, (1.0, 1.0, 1.0), seed=1, epoch=1) is None  # every pair once, as without corpora
    draws = [weighted_rows(sizes, weights, seed=1, epoch=epoch) for epoch in range(1, 201)]
    assert np.array_equal(draws[0], weighted_rows(sizes, weights, seed=1, epoch=1))  # a resumed epoch draws alike
    for rows in draws:
        counts = np.bincount(rows, minlength=23)
        assert (counts[:10] == 2).all() and (counts[18:] == 1).all()
        assert sorted(counts[10:18].tolist()) == [0] * 4 + [1] * 4  # half of the second corpus, none twice
    halves = {tuple(rows[(rows >= 10) & (rows < 18)]) for rows in draws}
    assert len(halves) > 50  # another half nearly every epoch
    shown = np.mean([np.bincount(rows, minlength=23)[10:18] for rows in draws], axis=0)
    assert np.all(np.abs(shown - 0.5) < 0.15)  # every pair of it in about half the epochs: the draw is fair


def test_epoch_batches_over_weighted_rows_cover_exactly_those_rows():
    rng = np.random.default_rng(1)
    seqs = [list(rng.integers(4, 50, size=rng.integers(1, 30))) for _ in range(300)]
    corpus = EncodedCorpus(RaggedIds.from_lists(seqs), RaggedIds.from_lists(seqs))
    rows = weighted_rows((200, 100), (1.5, 3.0), seed=4, epoch=2)
    batches = epoch_batches(corpus, max_tokens=300, seed=4, epoch=2, rows=rows)
    assert sorted(np.concatenate(batches).tolist()) == sorted(rows.tolist())
    lengths = corpus.src.lengths() + 1
    assert all(len(batch) * lengths[batch].max() <= 300 for batch in batches)

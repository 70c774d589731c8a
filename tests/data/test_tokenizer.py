"""SentencePiece training, fixed special ids, round trips, joint and per-language vocabularies."""

from __future__ import annotations

import logging
import unicodedata

import pytest

from seq2seq.config import TokenizerConfig
from seq2seq.data.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from seq2seq.data.tokenizer import Tokenizer, load_or_train_tokenizer, train_tokenizer
from seq2seq.errors import UserInputError
from seq2seq.schema import section_problems


def test_joint_tokenizer_round_trip_and_special_ids(demo_pairs, tmp_path):
    src, tgt = zip(*demo_pairs["train"])
    tokenizer = train_tokenizer(TokenizerConfig(vocab_size=300), demo_pairs["train"])
    assert tokenizer.joint
    model = tokenizer.src_model
    assert (model.pad_id(), model.unk_id(), model.bos_id(), model.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    ids = tokenizer.encode_src([src[0]])[0]
    assert ids[-1] == EOS_ID and PAD_ID not in ids
    assert tokenizer.decode_tgt(tokenizer.encode_tgt([tgt[0]])[0]) == tgt[0]
    tokenizer.save(tmp_path / "tok")
    again = Tokenizer.load(tmp_path / "tok")
    assert again.encode_tgt(list(tgt[:20])) == tokenizer.encode_tgt(list(tgt[:20]))


def test_separate_vocabularies_and_sampling(demo_pairs):
    src, tgt = zip(*demo_pairs["train"])
    config = TokenizerConfig(vocab_size=200, joint=False, model_type="bpe", sample_sentences=500)
    tokenizer = train_tokenizer(config, demo_pairs["train"])
    assert not tokenizer.joint
    assert set(tokenizer.protos()) == {"src", "tgt"}
    assert tokenizer.decode_tgt(tokenizer.encode_tgt([tgt[5]])[0]) == tgt[5]
    restored = Tokenizer.from_protos(tokenizer.protos())
    assert restored.encode_src([src[3]]) == tokenizer.encode_src([src[3]])


def test_decomposed_and_composed_text_get_the_same_ids():
    """Data is read as given (no NFC in the readers): SentencePiece's NFKC rule makes the ids equal."""
    pairs = [("café crème brûlée", "señor niño año")] * 50 + [("el café", "año nuevo")] * 50
    config = TokenizerConfig(vocab_size=40, model_type="bpe")  # one the config schema accepts
    assert section_problems(config) == []
    tokenizer = train_tokenizer(config, pairs)
    composed = ["café crème brûlée", "señor niño"]
    decomposed = [unicodedata.normalize("NFD", line) for line in composed]
    assert decomposed != composed
    assert tokenizer.encode_src(decomposed) == tokenizer.encode_src(composed)
    assert tokenizer.encode_tgt(decomposed) == tokenizer.encode_tgt(composed)


def test_an_unknown_output_token_reads_the_same_in_both_engines(demo_pairs):
    """PyTorch's search returns ids (decode_tgt); CTranslate2 returns pieces, which its engine turns
    into text with SentencePiece: an unknown token must not vanish in one and show in the other."""
    tokenizer = train_tokenizer(TokenizerConfig(vocab_size=300), demo_pairs["train"])
    ids = tokenizer.encode_tgt(["ed la par"])[0]
    with_unknown = [*ids[:1], UNK_ID, *ids[1:], EOS_ID]
    ours = tokenizer.decode_tgt(with_unknown)
    ctranslate2_way = tokenizer.tgt_model.decode(tokenizer.tgt_pieces(with_unknown[:-1]))  # its output stops before EOS
    assert "⁇" in ours and ours == ctranslate2_way


def test_a_vocabulary_smaller_than_asked_is_said(demo_pairs, tmp_path, caplog):
    """SentencePiece gives a small corpus only the pieces it supports: the log says so, rather than
    leave a user believing the model has the vocabulary the config asked for."""
    pairs = demo_pairs["train"][:300]
    with caplog.at_level(logging.INFO, logger="seq2seq"):
        small = load_or_train_tokenizer(tmp_path / "asked-too-many", TokenizerConfig(vocab_size=50_000), pairs, seed=1)
        load_or_train_tokenizer(tmp_path / "within", TokenizerConfig(vocab_size=100), pairs, seed=1)
    lines = [record.getMessage() for record in caplog.records if "trained tokenizer" in record.getMessage()]
    assert small.src_vocab_size < 50_000
    assert lines == [
        f"trained tokenizer: {small.src_vocab_size} source / {small.tgt_vocab_size} target pieces "
        "(tokenizer.vocab_size 50000: the training text supports no more)",
        "trained tokenizer: 100 source / 100 target pieces",
    ]


def test_a_saved_tokenizer_is_reused_or_refused_but_never_replaced(demo_pairs, tmp_path):
    """A run directory's tokenizer may be what `seq2seq tokenizer train` made, on purpose and at length:
    a config that would train another one is refused, naming what differs, and the saved one stays."""
    pairs, folder = demo_pairs["train"][:300], tmp_path / "tokenizer"
    saved = load_or_train_tokenizer(folder, TokenizerConfig(vocab_size=100), pairs, seed=1)
    made = {path.name: path.read_bytes() for path in folder.iterdir()}
    unused = iter(())  # reusing it reads no data
    assert load_or_train_tokenizer(folder, TokenizerConfig(vocab_size=100), unused, seed=1).protos() == saved.protos()
    differences = r"\(tokenizer.vocab_size 100 there, 80 here; train.seed 1 there, 2 here\)"
    with pytest.raises(UserInputError, match=rf"trained on other settings {differences}.* delete .*to train it again"):
        load_or_train_tokenizer(folder, TokenizerConfig(vocab_size=80), pairs, seed=2)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == made

"""SentencePiece models the user brings (tokenizer.model_files): their special pieces moved to
seq2seq's ids, every text segmented as the original model segments it, and a run that uses them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import sentencepiece as spm
import yaml

from seq2seq.config_files import config_from_dict
from seq2seq.data.sentencepiece_files import with_our_special_ids
from seq2seq.data.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from seq2seq.data.tokenizer import TRAINED_ON, Tokenizer, load_or_train_tokenizer
from seq2seq.errors import UserInputError

from ..conftest import tiny_config_dict

# spm_train's own defaults (no pad piece), a run's own, and fairseq's layout (a BPE model, with a tag)
LAYOUTS = {
    "spm defaults": {"model_type": "unigram"},
    "seq2seq ids": {"model_type": "unigram", "pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3},
    "fairseq ids": {"model_type": "bpe", "bos_id": 0, "pad_id": 1, "eos_id": 2, "unk_id": 3,
                    "user_defined_symbols": ["<bt>"]},
}  # fmt: skip


def own_model(tiny_data: Path, folder: Path, layout: str) -> Path:
    prefix = folder / layout.replace(" ", "_")
    inputs = f"{tiny_data / 'train.en'},{tiny_data / 'train.xx'}"
    spm.SentencePieceTrainer.train(input=inputs, model_prefix=str(prefix), vocab_size=300, minloglevel=2,
                                   **LAYOUTS[layout])  # fmt: skip
    return prefix.with_suffix(".model")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_special_pieces_move_to_our_ids_and_every_text_is_segmented_as_before(tiny_data, tmp_path, layout):
    path = own_model(tiny_data, tmp_path, layout)
    original = spm.SentencePieceProcessor(model_file=str(path))
    ours = spm.SentencePieceProcessor(model_proto=with_our_special_ids(path.read_bytes(), str(path)))
    assert (ours.pad_id(), ours.unk_id(), ours.bos_id(), ours.eos_id()) == (PAD_ID, UNK_ID, BOS_ID, EOS_ID)
    assert ours.get_piece_size() == original.get_piece_size() + (original.pad_id() < 0)
    lines = (tiny_data / "test.en").read_text().splitlines() + (tiny_data / "test.xx").read_text().splitlines()
    lines += ["<bt> unseen wörds ✓ 42", ""]
    assert ours.encode(lines, out_type=str) == original.encode(lines, out_type=str)
    assert ours.decode(ours.encode(lines)) == original.decode(original.encode(lines))
    specials = ("bos", "eos", "unk")
    assert [ours.id_to_piece(getattr(ours, f"{name}_id")()) for name in specials] == [
        original.id_to_piece(getattr(original, f"{name}_id")()) for name in specials
    ]


def test_a_run_takes_the_given_model_and_records_it_by_content(tiny_data, tmp_path):
    path = own_model(tiny_data, tmp_path, "spm defaults")
    raw = tiny_config_dict(tiny_data)
    raw["tokenizer"] = {"model_files": [str(path)], "vocab_size": 8000}  # vocab_size: the file's own, not read
    config = config_from_dict(raw, origin="test").tokenizer
    never_read = iter(pytest.fail, None)  # the corpus is not read when nothing is trained
    tokenizer = load_or_train_tokenizer(tmp_path / "tok", config, never_read, seed=1)
    original = spm.SentencePieceProcessor(model_file=str(path))
    assert tokenizer.joint and tokenizer.src_vocab_size == original.get_piece_size() + 1
    assert tokenizer.src_pieces("the cat") == [*original.encode("the cat", out_type=str), "</s>"]
    assert Tokenizer.load(tmp_path / "tok").protos() == tokenizer.protos()
    recorded = json.loads((tmp_path / "tok" / TRAINED_ON).read_text())
    assert set(recorded) == {"settings", "files"}
    load_or_train_tokenizer(tmp_path / "tok", config, never_read, seed=2)  # seed and data do not matter
    unread = dataclasses.replace(config, vocab_size=16000, model_type="bpe", sample_sentences=10)
    load_or_train_tokenizer(tmp_path / "tok", unread, never_read, seed=1)  # nor settings the file makes its own
    moved = path.rename(tmp_path / "moved.model")
    load_or_train_tokenizer(
        tmp_path / "tok", dataclasses.replace(config, model_files=(str(moved),)), never_read, seed=1
    )
    path = moved.rename(path)
    (tmp_path / "other").mkdir()
    path.write_bytes(own_model(tiny_data, tmp_path / "other", "fairseq ids").read_bytes())  # the same path, changed
    with pytest.raises(UserInputError, match="other contents of tokenizer.model_files"):
        load_or_train_tokenizer(tmp_path / "tok", config, never_read, seed=1)


def test_model_files_mistakes_are_one_line_each(tiny_data, tmp_path):
    path = own_model(tiny_data, tmp_path, "spm defaults")
    cases = [
        ({"model_files": [str(path)] * 2}, "tokenizer.model_files: two files are a source and a target vocabulary; "
                                           "expected joint: false"),
        ({"model_files": [str(path)], "joint": False}, "tokenizer.model_files: one file is a joint vocabulary"),
        ({"model_files": [str(path)] * 3, "joint": False}, "expected one file (joint) or two (source, target), got 3"),
    ]  # fmt: skip
    for tokenizer, message in cases:
        raw = tiny_config_dict(tiny_data)
        raw["tokenizer"] = tokenizer
        with pytest.raises(UserInputError, match=message.replace("(", r"\(").replace(")", r"\)")):
            config_from_dict(raw, origin="test")
    text = tmp_path / "notes.model"
    text.write_text("not a model\n")
    with pytest.raises(UserInputError, match=rf"{text}: not a SentencePiece model"):
        with_our_special_ids(text.read_bytes(), str(text))
    from sentencepiece import sentencepiece_model_pb2

    no_unknown = sentencepiece_model_pb2.ModelProto()
    no_unknown.pieces.add(piece="a", score=0.0, type=no_unknown.SentencePiece.Type.NORMAL)  # parses; does not load
    with pytest.raises(UserInputError, match="x.model: not a SentencePiece model that loads"):
        with_our_special_ids(no_unknown.SerializeToString(), "x.model")
    raw = tiny_config_dict(tiny_data)
    raw["tokenizer"] = {"model_files": [str(path)], "user_defined_symbols": ["<bt>"]}
    config = config_from_dict(raw, origin="test").tokenizer
    with pytest.raises(UserInputError, match="'<bt>' is not a user-defined piece of .*--user_defined_symbols=<bt>"):
        load_or_train_tokenizer(tmp_path / "tok", config, [], seed=1)
    assert not (tmp_path / "tok").exists()


def test_a_model_file_that_is_missing_is_named_before_any_work(tiny_data, tmp_path):
    from seq2seq.config_files import load_config

    config = tmp_path / "c.yaml"
    raw = tiny_config_dict(tiny_data)
    raw["tokenizer"] = {"model_files": [str(tmp_path / "spm.model")]}
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(UserInputError) as caught:
        load_config(config)
    assert str(caught.value) == f"{config}: tokenizer.model_files[0]: file not found: {tmp_path / 'spm.model'}"


def test_a_run_trains_and_translates_with_a_model_file_of_fairseqs_layout(tiny_data, tmp_path):
    from typer.testing import CliRunner

    from seq2seq.cli.main import app

    path = own_model(tiny_data, tmp_path, "fairseq ids")
    raw = tiny_config_dict(tiny_data, max_steps=4, valid_every=4, save_every=4)
    raw["tokenizer"] = {"model_files": [str(path)], "user_defined_symbols": ["<bt>"]}
    config = tmp_path / "own.yaml"
    config.write_text(yaml.safe_dump(raw))
    runner = CliRunner()
    trained = runner.invoke(app, ["train", str(config), "--run-dir", str(tmp_path / "run")])
    assert trained.exit_code == 0, trained.output
    translated = runner.invoke(app, ["translate", "-c", str(tmp_path / "run")], input="the cat\n<bt> a dog\n")
    assert translated.exit_code == 0 and len(translated.stdout.splitlines()) == 2, translated.output
    described = json.loads(runner.invoke(app, ["info", str(tmp_path / "run"), "--json"]).stdout)
    assert described["vocabulary"]["from_files"] == [str(path)]


def test_a_run_resumes_with_its_model_file_moved_but_not_with_another(tiny_data, tmp_path):
    """A checkpoint carries its vocabulary: the files may move, as a corpus may, and the settings the
    files make their own may change, but a config that names another vocabulary is refused (the run
    would go on with its own and the config would lie)."""
    from typer.testing import CliRunner

    from seq2seq.cli.main import app

    path = own_model(tiny_data, tmp_path, "spm defaults")
    raw = tiny_config_dict(tiny_data, max_steps=2, valid_every=100, save_every=2)
    raw["tokenizer"] = {"model_files": [str(path)]}
    config = tmp_path / "own.yaml"
    config.write_text(yaml.safe_dump(raw))
    runner, run = CliRunner(), str(tmp_path / "run")
    assert runner.invoke(app, ["train", str(config), "--run-dir", run]).exit_code == 0
    moved = path.rename(tmp_path / "moved.model")
    raw["tokenizer"].update(model_files=[str(moved)], vocab_size=123)  # vocab_size: the file's own, unread
    raw["train"]["max_steps"] = 4
    config.write_text(yaml.safe_dump(raw))
    resumed = runner.invoke(app, ["train", str(config), "--resume", run])
    assert resumed.exit_code == 0, resumed.output
    other = own_model(tiny_data, tmp_path, "seq2seq ids")
    raw["tokenizer"]["model_files"] = [str(other)]
    raw["train"]["max_steps"] = 6
    config.write_text(yaml.safe_dump(raw))
    refused = runner.invoke(app, ["train", str(config), "--resume", run])
    assert refused.exit_code == 2 and "hold another vocabulary than the checkpoint's" in refused.stderr, refused.output

"""Config loading: every kind of mistake is named with its file and dotted key; overrides are validated too."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from seq2seq.config import Config, DecodeConfig
from seq2seq.config_files import config_from_dict, decode_config_with, load_config
from seq2seq.errors import UserInputError

from .conftest import tiny_config_dict


def write(tmp_path: Path, raw) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw) if not isinstance(raw, str) else raw)
    return path


def error_of(path: Path, overrides=()) -> str:
    with pytest.raises(UserInputError) as info:
        load_config(path, list(overrides))
    return str(info.value)


def test_valid_config_loads_with_types(tmp_path, tiny_data):
    config = load_config(write(tmp_path, tiny_config_dict(tiny_data)))
    assert isinstance(config, Config)
    assert config.model.d_model == 96
    assert config.train.betas == (0.9, 0.98)
    assert config.decode.beam == 2


def test_unknown_key_suggests_the_closest(tmp_path, tiny_data):
    raw = tiny_config_dict(tiny_data)
    raw["train"]["lrr"] = 0.1
    message = error_of(write(tmp_path, raw))
    assert message == f"{tmp_path / 'c.yaml'}: train.lrr: unknown key; did you mean 'train.lr'?"


def test_unknown_section_lists_the_valid_ones(tmp_path, tiny_data):
    raw = tiny_config_dict(tiny_data)
    raw["optimiser"] = {}
    assert "optimiser: unknown key" in error_of(write(tmp_path, raw))


@pytest.mark.parametrize(
    ("section", "key", "value", "expected"),
    [
        ("model", "d_model", "big", "model.d_model: expected an integer, got 'big'"),
        ("model", "d_model", 102, "model.d_model: expected a multiple of heads (4), got 102"),
        ("model", "norm", "middle", "model.norm: expected one of post, pre; got 'middle'"),
        ("train", "warmup_steps", -1, "train.warmup_steps: expected an integer >= 0, got -1"),
        ("train", "lr", "fast", "train.lr: expected a finite number, got 'fast'"),
        ("train", "lr", float("nan"), "train.lr: expected a finite number, got nan"),
        ("train", "clip_norm", float("inf"), "train.clip_norm: expected a finite number, got inf"),
        ("train", "betas", [0.9], "train.betas: expected a list of 2 items, got a list"),
        ("train", "precision", "fp8", "train.precision: expected one of auto, fp32, bf16, fp16; got 'fp8'"),
        ("decode", "nbest", 9, "decode.nbest: expected at most beam (2), got 9"),
        ("tokenizer", "joint", "yes", "tokenizer.joint: expected true or false, got 'yes'"),
        (
            "data",
            "tgt_lang",
            False,  # `tgt_lang: no` (Norwegian), as YAML reads it
            "data.tgt_lang: expected a string, got False (YAML reads an unquoted yes, no, on, off, true or false "
            "as a boolean: quote the value, 'no')",
        ),
    ],
)
def test_bad_values_name_file_key_and_expectation(tmp_path, tiny_data, section, key, value, expected):
    raw = tiny_config_dict(tiny_data)
    raw[section][key] = value
    path = write(tmp_path, raw)
    assert error_of(path) == f"{path}: {expected}"


def test_all_problems_are_reported_together(tmp_path, tiny_data):
    raw = tiny_config_dict(tiny_data)
    raw["model"]["heads"] = "four"
    raw["train"]["max_steps"] = 0.5
    raw["decode"]["bem"] = 3
    lines = error_of(write(tmp_path, raw)).splitlines()
    assert len(lines) == 3
    assert {line.split(": ")[1] for line in lines} == {"model.heads", "train.max_steps", "decode.bem"}


def test_missing_data_file_is_named(tmp_path, tiny_data):
    raw = tiny_config_dict(tiny_data)
    raw["data"]["valid"]["tgt"] = str(tmp_path / "nope.xx")
    path = write(tmp_path, raw)
    assert error_of(path) == f"{path}: data.valid.tgt: file not found: {tmp_path / 'nope.xx'}"


def test_a_missing_relative_path_says_where_it_was_looked_for(tmp_path, tiny_data, monkeypatch):
    """Relative paths are read from where the command runs: a config run from another folder than
    the one its paths start from misses its files, and the line says which folder was searched."""
    raw = tiny_config_dict(tiny_data)
    raw["data"]["valid"]["tgt"] = "corpus/valid.xx"
    (tmp_path / "project" / "corpus").mkdir(parents=True)
    (tmp_path / "project" / "corpus" / "valid.xx").write_text("found from the project folder\n")
    path = write(tmp_path, raw)
    monkeypatch.chdir(tmp_path / "project")
    load_config(path)  # run from the folder the path starts from, it is found
    monkeypatch.chdir(tmp_path)
    assert error_of(path) == (
        f"{path}: data.valid.tgt: file not found: corpus/valid.xx (relative to {tmp_path}, where the command runs)"
    )


def test_a_missing_file_given_by_set_names_the_flag_not_the_config(tmp_path, tiny_data):
    path = write(tmp_path, tiny_config_dict(tiny_data))
    with pytest.raises(UserInputError) as caught:
        load_config(path, [f"data.valid.tgt={tmp_path / 'nope.xx'}"])
    assert str(caught.value) == f"--set data.valid.tgt: file not found: {tmp_path / 'nope.xx'}"


def test_paths_that_start_with_a_tilde_are_in_the_home_folder(tmp_path, tiny_data, monkeypatch):
    """As a shell expands ~ at the start of a word: a YAML file's paths, and a --set value (whose ~
    the shell leaves, not being at the start of the word), name files under $HOME."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus").mkdir()
    for side in ("en", "xx"):
        (tmp_path / "corpus" / f"valid.{side}").write_bytes((tiny_data / f"valid.{side}").read_bytes())
    raw = tiny_config_dict(tiny_data)
    raw["data"]["valid"] = {"format": "text", "src": "~/corpus/valid.en", "tgt": str(tiny_data / "valid.xx")}
    config = load_config(write(tmp_path, raw), ["data.valid.tgt=~/corpus/valid.xx", "train.init_from=~/runs/a"])
    assert config.data.valid.src == str(tmp_path / "corpus" / "valid.en")
    assert config.data.valid.tgt == str(tmp_path / "corpus" / "valid.xx")
    assert config.train.init_from == str(tmp_path / "runs" / "a")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_pipe_as_training_data_is_refused_before_it_is_read(tmp_path, tiny_data):
    """Training reads its data more than once (the tokenizer, the encoding): a pipe's second read hung
    the run after its tokenizer was trained. Refused when the config is read; nothing opens the pipe."""
    os.mkfifo(tmp_path / "pipe.en")
    raw = tiny_config_dict(tiny_data)
    raw["data"]["train"]["src"] = str(tmp_path / "pipe.en")
    path = write(tmp_path, raw)
    assert error_of(path) == (
        f"{path}: data.train.src: is a pipe or device, which can be read only once; expected a regular file: "
        f"{tmp_path / 'pipe.en'}"
    )


def test_missing_required_section(tmp_path):
    path = write(tmp_path, {"model": {"d_model": 64}})
    assert error_of(path) == f"{path}: data: required key is missing"


def test_format_specific_requirements(tmp_path, tiny_data):
    raw = tiny_config_dict(tiny_data)
    raw["data"]["train"] = {"format": "tsv"}
    assert "data.train.path: format 'tsv' needs 'path'" in error_of(write(tmp_path, raw))


def test_shared_embeddings_need_a_joint_vocabulary(tmp_path, tiny_data):
    raw = tiny_config_dict(tiny_data)
    raw["tokenizer"]["joint"] = False
    assert "model.share_embeddings: needs tokenizer.joint: true" in error_of(write(tmp_path, raw))


def test_a_rule_between_keys_names_the_flag_that_set_the_other_side(tmp_path, tiny_data):
    """A rule's problem names one key: where a --set changed the other, the line names that flag with
    the file, not the file alone (which never asked for 5 heads)."""
    path = write(tmp_path, tiny_config_dict(tiny_data))
    assert error_of(path, ["model.heads=5"]) == (
        f"{path} and --set model.heads: model.d_model: expected a multiple of heads (5), got 96"
    )
    raw = tiny_config_dict(tiny_data)
    raw["model"]["share_embeddings"] = True
    path = write(tmp_path, raw)
    assert error_of(path, ["tokenizer.joint=false", "train.lr=0.002"]) == (
        f"{path} and --set tokenizer.joint: model.share_embeddings: needs tokenizer.joint: true (one vocabulary)"
    )


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path, "data:\n  train: [unclosed\nmodel: {}\n")
    assert error_of(path).startswith(f"{path}:")
    assert "not valid YAML" in error_of(path)


def test_a_key_given_twice_is_named_with_both_lines(tmp_path, tiny_data):
    """PyYAML keeps the last of two equal keys without a word: a second `lr` won unseen, and a second
    list entry's repeated key (data.extra_train[0].src) dropped the first. A merge key may repeat
    what it merges: that is YAML's way to override."""
    text = yaml.safe_dump(tiny_config_dict(tiny_data))
    twice = text.replace("\ntrain:\n", "\ntrain:\n  lr: 0.5\n  lr: 0.1\n", 1)
    line = twice.splitlines().index("  lr: 0.1") + 1
    assert error_of(write(tmp_path, twice)) == (
        f"{tmp_path / 'c.yaml'}:{line}: train.lr: given twice (first on line {line - 1}); expected each key "
        "once (YAML would keep the last one and drop the first without a word)"
    )
    listed = "data:\n  extra_train:\n  - {src: a.en, src: b.en}\n"
    assert error_of(write(tmp_path, listed)).startswith(
        f"{tmp_path / 'c.yaml'}:3: data.extra_train[0].src: given twice"
    )
    given = error_of(write(tmp_path, text), ["data.extra_train=[{src: a.en, src: b.en}]"])
    assert given.startswith("--set data.extra_train: data.extra_train[0].src: given twice; expected each key once")
    merged = text.replace("\ntrain:\n", "\ndefaults: &d {lr: 0.5}\ntrain:\n  <<: *d\n", 1)
    merge_error = error_of(write(tmp_path, merged))  # refused for its unknown section alone
    assert "defaults: unknown key" in merge_error and "given twice" not in merge_error


def test_missing_config_file(tmp_path):
    assert error_of(tmp_path / "absent.yaml") == f"{tmp_path / 'absent.yaml'}: config file not found"


def test_overrides_apply_with_the_same_validation(tmp_path, tiny_data):
    path = write(tmp_path, tiny_config_dict(tiny_data))
    config = load_config(path, ["train.lr=0.01", "model.norm=post", "train.betas=[0.8, 0.9]", "train.lr=1e-3"])
    assert config.train.lr == 0.001
    assert config.model.norm == "post"
    assert config.train.betas == (0.8, 0.9)
    assert error_of(path, ["train.lr=abc"]) == "--set train.lr: expected a finite number, got 'abc'"
    assert error_of(path, ["train.lrr=1"]) == "--set train.lrr: unknown key; did you mean 'train.lr'?"
    assert "expected KEY=VALUE" in error_of(path, ["train.lr"])


def test_resolved_config_round_trips(tmp_path, tiny_data):
    config = load_config(write(tmp_path, tiny_config_dict(tiny_data)))
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(config.to_dict())), origin="saved")
    assert again == config


def test_decode_overrides_build_the_decode_section_alone():
    stored = DecodeConfig(beam=4, nbest=2)
    changed = decode_config_with(stored, ["decode.beam=6", "decode.length_penalty=1.0"])
    assert changed == DecodeConfig(beam=6, nbest=2, length_penalty=1.0)
    with pytest.raises(UserInputError, match=r"--set train.lr=1: only decode.\* keys"):
        decode_config_with(stored, ["train.lr=1"])
    with pytest.raises(UserInputError, match="--set decode.nbest: expected at most beam"):
        decode_config_with(stored, ["decode.nbest=9"])
    with pytest.raises(UserInputError, match="--set decode.bem: unknown key; did you mean 'decode.beam'"):
        decode_config_with(stored, ["decode.bem=3"])


def test_a_set_value_that_is_not_yaml_and_a_directory_as_config_are_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tmp_path)))
    with pytest.raises(UserInputError, match=r"--set train.lr=\[0.1: the value is not valid YAML"):
        load_config(path, ["train.lr=[0.1"])
    with pytest.raises(UserInputError, match="is a directory; expected a YAML config file"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("beam", 5000, "decode.beam: expected an integer in [1, 256], got 5000"),
        ("patience", 0.5, "decode.patience: expected a number in [1, 8], got 0.5"),
        ("max_len_b", 10**6, "decode.max_len_b: expected an integer in [0, 4096]"),
        ("no_repeat_ngram", 100, "decode.no_repeat_ngram: expected an integer in [0, 32]"),
        ("seed", 2**32, "decode.seed: expected an integer in [0, 4294967296), got 4294967296"),
        ("temperature", 0.0, "decode.temperature: expected a number in [0.001, 100], got 0.0"),
        ("min_len", 30, "decode.min_len: expected at most the length limit of a one-token input, "
                        "max_len_a x 2 + max_len_b = 12, got 30"),
    ],
)  # fmt: skip
def test_every_front_door_bounds_the_decode_numbers_alike(tmp_path, tiny_data, key, value, expected):
    """A config file, --set and the Python API's keyword options refuse the same values with the same line."""
    from seq2seq.config_files import decode_config_from

    stored = DecodeConfig(max_len_a=1.0, max_len_b=10)
    raw = tiny_config_dict(tiny_data)
    raw["decode"] = {"max_len_a": 1.0, "max_len_b": 10, key: value}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    for door in (lambda: load_config(path), lambda: decode_config_with(stored, [f"decode.{key}={value}"]),
                 lambda: decode_config_from(stored, {key: value}, origin="options")):  # fmt: skip
        with pytest.raises(UserInputError, match=re.escape(expected)):
            door()


def test_the_python_api_takes_numbers_not_strings_that_parse_as_numbers():
    from seq2seq.config_files import decode_config_from

    with pytest.raises(UserInputError, match="decode.beam: expected an integer, got '0x10'"):
        decode_config_from(DecodeConfig(), {"beam": "0x10"}, origin="options")
    with pytest.raises(UserInputError, match="decode.length_penalty: expected a number, got '1.0'"):
        decode_config_from(DecodeConfig(), {"length_penalty": "1.0"}, origin="options")
    assert decode_config_from(DecodeConfig(), {"beam": 3, "length_penalty": 1}, origin="options").beam == 3


def test_extra_training_corpora_are_checked_each_by_its_index(tmp_path, tiny_data):
    """A list of corpus sections: each problem names its corpus by index, a tag must be one token the
    tokenizer keeps whole, and weights and tags belong to training corpora alone."""
    raw = tiny_config_dict(tiny_data)
    good = {"src": raw["data"]["train"]["src"], "tgt": raw["data"]["train"]["tgt"]}
    raw["data"]["extra_train"] = [good, {"format": "tsv", "weight": 0}, {**good, "tag": "<bt>"}, {**good, "tag": "a b"}]
    raw["data"]["valid"]["weight"] = 2
    lines = error_of(write(tmp_path, raw)).splitlines()
    assert [line.split(": ", 2)[1] for line in lines] == [
        "data.extra_train[2].tag",
        "data.valid.weight",
        "data.extra_train[1].weight",
        "data.extra_train[3].tag",
    ], lines
    assert lines[2].endswith("data.extra_train[1].weight: expected a number > 0, got 0.0")
    assert lines[3].endswith("data.extra_train[3].tag: expected one token without spaces, got 'a b'")
    raw["data"]["extra_train"] = [good, {**good, "wieght": 2}]
    assert error_of(write(tmp_path, raw)).endswith(
        "data.extra_train[1].wieght: unknown key; did you mean 'data.extra_train[1].weight'?"
    )
    raw["data"]["extra_train"] = [{"format": "tsv"}]
    del raw["data"]["valid"]["weight"]
    assert error_of(write(tmp_path, raw)).endswith("data.extra_train[0].path: format 'tsv' needs 'path'")
    raw["data"]["extra_train"] = [{**good, "tag": "<bt>"}]
    assert error_of(write(tmp_path, raw)).endswith(
        "data.extra_train[0].tag: '<bt>' is not in tokenizer.user_defined_symbols, so the tokenizer would cut it "
        "into pieces; add it there"
    )
    raw["tokenizer"]["user_defined_symbols"] = ["<bt>"]
    raw["data"]["extra_train"] = [{"src": str(tmp_path / "bt.en"), "tgt": good["tgt"], "tag": "<bt>"}]
    path = write(tmp_path, raw)
    assert error_of(path) == f"{path}: data.extra_train[0].src: file not found: {tmp_path / 'bt.en'}"
    config = load_config(path, [f"data.extra_train=[{{src: {good['src']}, tgt: {good['tgt']}, weight: 0.5}}]"])
    assert config.data.extra_train[0].weight == 0.5 and config.data.extra_train[0].tag == ""


def test_a_set_names_a_section_of_a_list_by_its_index(tmp_path, tiny_data):
    """--set reaches a corpus of data.extra_train as problems name it (data.extra_train[1].weight); an
    index past the list, a list named without one, or an index on a section are one line each."""
    raw = tiny_config_dict(tiny_data)
    good = {"src": raw["data"]["train"]["src"], "tgt": raw["data"]["train"]["tgt"]}
    raw["data"]["extra_train"] = [good, dict(good)]
    path = write(tmp_path, raw)
    assert [corpus.weight for corpus in load_config(path, ["data.extra_train[1].weight=0.25"]).data.extra_train] == [
        1.0,
        0.25,
    ]
    assert error_of(path, ["data.extra_train[0].weight=-1"]) == (
        "--set data.extra_train[0].weight: expected a number > 0, got -1.0"
    )
    assert error_of(path, ["data.extra_train[2].weight=2"]) == (
        "--set data.extra_train[2].weight=2: 'extra_train' has 2 sections; no [2]"
    )
    assert error_of(path, ["data.extra_train.0.weight=2"]).endswith(
        "'extra_train' is a list of sections; name one by its index: extra_train[0]"
    )
    assert error_of(path, ["data.train[0].weight=2"]).endswith("'train' is not a list of sections")


def test_a_problem_inside_a_section_set_whole_names_the_set_flag(tmp_path, tiny_data):
    """--set data.extra_train=[...] gives the whole list: a problem inside it is the flag's, named with
    the key inside (the file never said it); a key the flag did not reach stays the file's, with the
    flag named beside it where the flag set the other side of the rule (the format that needs a path)."""
    path = write(tmp_path, tiny_config_dict(tiny_data))
    assert error_of(path, ["data.extra_train=[foo]"]) == (
        "--set data.extra_train: data.extra_train[0]: expected a mapping, got 'foo'"
    )
    needs_path = "data.train.path: format 'tsv' needs 'path'"
    assert error_of(path, ["data.train={format: tsv}"]) == f"--set data.train: {needs_path}"
    assert error_of(path, ["data.train.format=tsv"]) == f"{path} and --set data.train.format: {needs_path}"


def test_a_problem_with_a_section_a_set_made_names_the_set_flag(tmp_path, tiny_data):
    """A --set into a section the file lacks makes that section: an unknown one, or a key it then lacks,
    is the flag's problem (the file never had it), named with the key."""
    raw = tiny_config_dict(tiny_data)
    del raw["data"]["test"]
    path = write(tmp_path, raw)
    assert error_of(path, ["nokey.x=1"]) == (
        "--set nokey.x: nokey: unknown key; valid keys: data, tokenizer, model, train, decode, distill"
    )
    assert error_of(path, ["data.test.format=tsv"]) == (
        "--set data.test.format: data.test.path: format 'tsv' needs 'path'"
    )

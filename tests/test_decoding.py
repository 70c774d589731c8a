"""Each decode option is declared once (decoding.py) and every door takes it from there: a config
file, --set, the Python API's keywords and a server request accept the same values and refuse the
same ones with the same words; the server's tighter maxima and its own options are the only
differences, and they come from the declarations too."""

from __future__ import annotations

import pytest
import yaml

from seq2seq.config_files import decode_config_from, decode_config_with, load_config
from seq2seq.decoding import DecodeConfig, declarations
from seq2seq.errors import UserInputError

from .conftest import tiny_config_dict

OPTIONS = declarations()


def a_valid_value(option):
    """A value other than the default that every door must take (and the server too, where it may)."""
    if option.kind is bool:
        return not option.default
    if option.choices:
        return next(choice for choice in option.choices if choice != option.default)
    low, high = option.bound.low, option.served_max or option.bound.high
    if not option.bound.low_open and low != option.default:
        return low
    return low + 1 if option.kind is int else (low + (high or low + 2)) / 2


def an_invalid_value(option):
    """A value of the right type that the declaration refuses, or a value of the wrong type."""
    if option.kind is bool or option.choices:
        return "maybe"
    bound = option.bound
    return option.kind(bound.low if bound.low_open else bound.low - 1)


class Vocabulary:
    def encode(self, texts, add_eos=False, out_type=int):
        ids = [[4] * len(text.split()) + [3] * add_eos for text in ([texts] if isinstance(texts, str) else texts)]
        return ids[0] if isinstance(texts, str) else ids

    def unk_id(self):
        return 1


class Engine:
    name, title, instead, constrained_search, max_positions = "pytorch", "ours", "", True, None
    source_model = target_model = Vocabulary()


def doors(tmp_path, tiny_data, name, value):
    """Each door's decode settings for {name: value}, or its UserInputError / RequestError text."""
    from seq2seq.deploy.requests import Limits, RequestError, parse_request
    from seq2seq.inference.translator import Translator

    raw = tiny_config_dict(tiny_data)
    raw["decode"] = {name: value}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    translator = Translator(DecodeConfig(), Engine())

    def server():
        return parse_request({"lines": ["a b"], name: value}, translator, Limits()).decode

    found = {}
    for door, open_it in (("config", lambda: load_config(path).decode),
                          ("--set", lambda: decode_config_with(DecodeConfig(), [f"decode.{name}={value}"])),
                          ("api", lambda: decode_config_from(DecodeConfig(), {name: value}, origin="options")),
                          ("server", server)):  # fmt: skip
        try:
            found[door] = open_it()
        except (UserInputError, RequestError) as error:
            found[door] = str(error)
    return found


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.served], ids=lambda o: o.name)
def test_every_door_takes_a_valid_value_and_refuses_an_invalid_one_alike(tmp_path, tiny_data, option):
    value = a_valid_value(option)
    taken = doors(tmp_path, tiny_data, option.name, value)
    assert all(isinstance(settings, DecodeConfig) for settings in taken.values()), taken
    assert {getattr(settings, option.name) for settings in taken.values()} == {value}
    refused = doors(tmp_path, tiny_data, option.name, an_invalid_value(option))
    assert all(isinstance(message, str) for message in refused.values()), refused
    assert all(option.name in message for message in refused.values()), refused
    if option.bound is not None:  # the range's words, the same at every door
        words = {message.rsplit(f"{option.name}: ", 1)[1] for door, message in refused.items() if door != "server"}
        assert len(words) == 1 and next(iter(words)) in refused["server"], refused


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.served_max is not None], ids=lambda o: o.name)
def test_the_server_takes_only_its_own_tighter_maxima(tmp_path, tiny_data, option):
    over = option.served_max + (1 if option.kind is int else 0.5)
    found = doors(tmp_path, tiny_data, option.name, over)
    if option.name == "nbest":  # nbest is also held to the beam, which the other doors check first
        found = doors(tmp_path, tiny_data, "sample", True) | {"server": found["server"]}
    assert found["server"] == f"{option.name}: at most {option.served_max} on this server, got {over}"


@pytest.mark.parametrize("option", [o for o in OPTIONS if not o.served], ids=lambda o: o.name)
def test_an_option_the_server_keeps_is_an_unknown_field_there(tmp_path, tiny_data, option):
    found = doors(tmp_path, tiny_data, option.name, a_valid_value(option))
    assert isinstance(found["api"], DecodeConfig) and f"unknown field(s) {option.name}" in found["server"]


def test_every_option_is_declared_whole():
    """Help for the reference, a range for every number, and a reason for every engine left out."""
    for option in OPTIONS:
        assert option.help, option.name
        assert option.kind not in (int, float) or option.bound is not None, option.name
        assert option.engines == {"pytorch", "ctranslate2"} or (option.lacking and option.used), option.name

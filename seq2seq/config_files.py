"""Reading a configuration: a YAML file (yaml.safe_load's loader, each key once), `--set
section.key=value` overrides (values parsed as YAML), the Python API's and the server's typed
decode options. Every problem is collected and reported together, one line each, naming the file
(or the --set flag) and the dotted key, so the user fixes everything in one edit; a config's local
data files must exist.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from seq2seq.config import Config
from seq2seq.decoding import DecodeConfig
from seq2seq.errors import UserInputError
from seq2seq.files import read_once
from seq2seq.schema import build_dataclass, collect_problems


def load_config(path: str | Path, overrides: list[str] = ()) -> Config:
    """Read, override and validate a YAML config; local data files must exist."""
    path = Path(path)
    try:
        raw = _load_each_key_once(path.read_text(encoding="utf-8"), str(path))
    except FileNotFoundError:
        raise UserInputError(f"{path}: config file not found") from None
    except IsADirectoryError:
        raise UserInputError(f"{path}: is a directory; expected a YAML config file") from None
    except OSError as error:
        raise UserInputError(f"{path}: cannot read the config ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise UserInputError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise UserInputError(f"{path}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(raw, dict):
        raise UserInputError(f"{path}: expected a mapping of sections (data, model, ...) at the top")
    overridden = apply_overrides(raw, overrides)
    config = _build_checked(raw, origin=str(path), overridden=overridden)
    corpora = [*config.data.training_corpora(), ("data.valid", config.data.valid), ("data.test", config.data.test)]
    missing = [
        (f"{where}.{key}", problem)
        for where, corpus in corpora
        if corpus is not None
        for key, file in corpus.files().items()
        if (problem := _data_path_problem(Path(file), folder_allowed=corpus.format == "hf"))
    ]
    missing += [
        (f"tokenizer.model_files[{index}]", problem)
        for index, file in enumerate(config.tokenizer.model_files)
        if (problem := _data_path_problem(Path(file), folder_allowed=False))
    ]
    _raise_problems(missing, origin=str(path), overridden=overridden)  # a file given by --set names its flag
    return config


def _load_each_key_once(text: str, where: str, *, prefix: str = "", in_a_file: bool = True) -> Any:
    """yaml.safe_load, refusing a key given twice in one mapping: PyYAML keeps the last one without a
    word, so a second `train:` section dropped the whole first one, and a second `lr:` won unseen.
    `where` names the text in the refusal: a file (`in_a_file`, named with the lines) or a --set
    flag, whose value sits at `prefix`."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        repeated = _repeated_key(node, prefix)
        if repeated is not None:
            key, line, first = repeated
            lines = (f":{line}", f" (first on line {first})") if in_a_file else ("", "")
            raise UserInputError(
                f"{where}{lines[0]}: {key}: given twice{lines[1]}; expected each key once (YAML would keep "
                "the last one and drop the first without a word)"
            )
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _repeated_key(node: yaml.Node, prefix: str) -> tuple[str, int, int] | None:
    """The first key a mapping of the parsed document repeats (a merge key, `<<`, may repeat what it
    merges), as its dotted key, its line and the line it was first given on."""
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            if found := _repeated_key(item, f"{prefix.removesuffix('.')}[{index}]."):
                return found
    if not isinstance(node, yaml.MappingNode):
        return None
    first_line: dict[str, int] = {}
    for key, value in node.value:
        if key.tag == "tag:yaml.org,2002:merge" or not isinstance(key, yaml.ScalarNode):
            continue
        line = key.start_mark.line + 1
        if key.value in first_line:
            return f"{prefix}{key.value}", line, first_line[key.value]
        first_line[key.value] = line
        if found := _repeated_key(value, f"{prefix}{key.value}."):
            return found
    return None


def _data_path_problem(path: Path, *, folder_allowed: bool) -> str:
    """What is wrong with a data file the config names, with its path ("" if nothing). A relative
    path is read from where the command runs, not from the config's folder: a missing one says where
    it was looked for, since a config run from another folder misses all its files at once."""
    if not path.exists():
        where = "" if path.is_absolute() else f" (relative to {Path.cwd()}, where the command runs)"
        return f"file not found: {path}{where}"
    if path.is_dir() and not folder_allowed:
        return f"is a directory; expected a text file: {path}"
    if read_once(path):  # training reads its data more than once: a pipe read again is empty, or waits forever
        return f"is a pipe or device, which can be read only once; expected a regular file: {path}"
    return ""


def config_from_dict(raw: dict[str, Any], origin: str) -> Config:
    """Validate an already-parsed config (e.g. from a checkpoint); files are not checked."""
    return _build_checked(raw, origin=origin, overridden=Overridden())


class FlagOverride(str):
    """A `decode.KEY=VALUE` item that a flag of its own stands for (`--beam 5` for decode.beam=5): a
    problem with its value names that flag, which the user typed, rather than a --set they did not."""

    flag: str

    def __new__(cls, item: str, flag: str) -> FlagOverride:
        override = super().__new__(cls, item)
        override.flag = flag
        return override


@dataclasses.dataclass
class Overridden:
    """What the overrides wrote, with the flag that wrote it, so that a problem there names that flag
    (`--set KEY` or a FlagOverride's flag) rather than the file: each key set, and each section an
    override made because the file lacked it (--set data.test.src=... where the file has no data.test)."""

    keys: dict[str, str] = dataclasses.field(default_factory=dict)
    sections: dict[str, str] = dataclasses.field(default_factory=dict)


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> Overridden:
    """Apply `section.key=value` strings (values parsed as YAML) in place; return what they wrote."""
    overridden = Overridden()
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise UserInputError(f"--set {item}: expected KEY=VALUE with a dotted key, e.g. train.lr=0.001")
        flag = getattr(item, "flag", f"--set {key}")
        node = raw
        *parents, leaf = key.split(".")
        for depth, part in enumerate(parents, 1):
            if part not in node and not _INDEXED.match(part):
                overridden.sections.setdefault(".".join(parents[:depth]), flag)
            node = _section(node, part, item)
        try:
            node[leaf] = _load_each_key_once(text, flag, prefix=f"{key}.", in_a_file=False)
        except yaml.YAMLError as error:
            problem = getattr(error, "problem", None) or "not valid YAML"
            raise UserInputError(f"--set {item}: the value is not valid YAML ({problem})") from None
        overridden.keys[key] = flag
    return overridden


_INDEXED = re.compile(r"^(.+)\[(\d+)\]$")


def _section(node: dict, part: str, item: str) -> dict:
    """The section `part` of `node` for --set `item`: a named one (made if missing), or one of a list of
    sections by its index, as problems name it (data.extra_train[1])."""
    indexed = _INDEXED.match(part)
    name = indexed.group(1) if indexed else part
    found = node.setdefault(name, [] if indexed else {})
    if isinstance(found, list) and not indexed:
        raise UserInputError(f"--set {item}: '{part}' is a list of sections; name one by its index: {part}[0]")
    if indexed:
        index = int(indexed.group(2))
        if not isinstance(found, list):
            raise UserInputError(f"--set {item}: '{name}' is not a list of sections")
        if index >= len(found):
            count = len(found)
            raise UserInputError(f"--set {item}: '{name}' has {count} section{'s' * (count != 1)}; no [{index}]")
        found = found[index]
    if not isinstance(found, dict):
        raise UserInputError(f"--set {item}: '{part}' is not a section")
    return found


def decode_config_with(stored: DecodeConfig, overrides: list[str]) -> DecodeConfig:
    """A checkpoint's decode section with `decode.KEY=VALUE` overrides applied and validated."""
    for item in overrides:
        if not item.startswith("decode."):
            raise UserInputError(f"--set {item}: only decode.* keys can be changed at translation time")
    raw = {"decode": dataclasses.asdict(stored)}
    overridden = apply_overrides(raw, overrides)
    errors: list[tuple[str, str]] = []
    decode = build_dataclass(DecodeConfig, raw["decode"], "decode.", errors)
    if not errors:
        collect_problems(decode, "decode.", errors)
    _raise_problems(errors, origin="command line", overridden=overridden)
    return decode


def decode_config_from(stored: DecodeConfig, values: dict[str, Any], *, origin: str) -> DecodeConfig:
    """`stored` with typed values (the Python API's keyword options, a server request's JSON fields)
    checked as a config file's decode section is. Unlike a --set string, a value is never parsed: a
    number given as a string is refused."""
    errors: list[tuple[str, str]] = []
    hints = typing.get_type_hints(DecodeConfig)
    for key, value in values.items():
        if isinstance(value, str) and hints.get(key) in (int, float):
            kind = "an integer" if hints[key] is int else "a number"
            errors.append((f"decode.{key}", f"expected {kind}, got {value!r}"))
    decode = None
    if not errors:
        decode = build_dataclass(DecodeConfig, {**dataclasses.asdict(stored), **values}, "decode.", errors)
    if not errors:
        collect_problems(decode, "decode.", errors)
    _raise_problems(errors, origin=origin, overridden=Overridden())
    return decode


def _build_checked(raw: dict[str, Any], *, origin: str, overridden: Overridden) -> Config:
    errors: list[tuple[str, str]] = []
    config = build_dataclass(Config, raw, "", errors)
    if not errors:
        collect_problems(config, "", errors)
    _raise_problems(errors, origin=origin, overridden=overridden)
    return config


def _raise_problems(errors: list[tuple[str, str]], *, origin: str, overridden: Overridden) -> None:
    """One line per problem, naming the flag that caused it (the key it set, a section it set whole, such
    as --set data.extra_train=[...], or a section it made) or else the file."""
    if errors:
        raise UserInputError("\n".join(_problem_line(key, msg, origin, overridden) for key, msg in errors))


def _problem_line(key: str, message: str, origin: str, overridden: Overridden) -> str:
    if key in overridden.keys:
        return f"{overridden.keys[key]}: {message}"
    owners = {given: flag for given, flag in overridden.keys.items() if key.startswith((given + ".", given + "["))}
    made = overridden.sections.items()
    owners.update({section: flag for section, flag in made if key == section or key.startswith(section + ".")})
    if owners:
        return f"{owners[max(owners, key=len)]}: {key}: {message}"
    partners = _partner_flags(key, message, overridden)
    return f"{origin}{''.join(f' and {flag}' for flag in partners)}: {key}: {message}"


def _partner_flags(key: str, message: str, overridden: Overridden) -> list[str]:
    """The flags that set the other side of a rule between keys (`--set model.heads=3` against the
    file's d_model): a rule's problem names one key, and its message the other, by its name in the
    same section (`a multiple of heads`) or by its dotted name (`needs tokenizer.joint`)."""
    section = key.rpartition(".")[0]
    return [
        flag
        for given, flag in overridden.keys.items()
        if given in message
        or given.rpartition(".")[0] == section
        and re.search(rf"\b{re.escape(given.rpartition('.')[2])}\b", message)
    ]

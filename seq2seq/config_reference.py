"""The configuration reference (docs/configuration.md), written from the schema itself: every key of
every section with its type, default, range and one line of help, as the dataclasses of config.py
and decoding.py declare them. A test fails when the page and the schema disagree.

    python -m seq2seq.config_reference docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from seq2seq.config import Config, CorpusConfig
from seq2seq.files import write_text_atomic
from seq2seq.schema import Bound

INTRO = """# Configuration reference

A config is a YAML file with the sections below (`configs/` holds runnable examples); `--set
section.key=value` overrides one key from the command line with the same checks (values are YAML:
`--set train.betas=[0.9,0.98]`; a corpus of `data.extra_train` by its index:
`--set data.extra_train[0].weight=0.5`). Every problem is reported at once, one line each, naming
the file (or the `--set` flag) and the dotted key; a key given twice in one section is refused
(YAML itself would keep the last). This page is written from the schema by `python -m
seq2seq.config_reference docs/configuration.md`; a test checks that it is current.
"""


def reference() -> str:
    """The whole page."""
    parts, hints = [INTRO], typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        parts.append(f"## `{section.name}`: {section.metadata['help']}\n")
        cls = next((arg for arg in typing.get_args(hints[section.name]) if arg is not type(None)), hints[section.name])
        parts.append(_table(cls, decode=section.name == "decode"))  # an optional section: its dataclass
        if section.name == "data":
            parts.append("### A corpus (`data.train`, each of `data.extra_train`, `data.valid`, `data.test`)\n")
            parts.append(_table(CorpusConfig))
    return "\n".join(parts)


def _table(cls: type, *, decode: bool = False) -> str:
    hints = typing.get_type_hints(cls)
    header = "| key | type | default | range | meaning |" + (" server |" if decode else "")
    rows = [header, "|" + "---|" * (6 if decode else 5)]
    for item in dataclasses.fields(cls):
        default = _value(item.default) if item.default is not dataclasses.MISSING else _factory_default(item)
        cells = [
            f"`{item.name}`",
            _type(hints[item.name]),
            default,
            _range(item.metadata.get("bound")),
            item.metadata.get("help", ""),
        ]
        if decode:
            cells.append(_served(item.metadata))
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _factory_default(item: dataclasses.Field) -> str:
    if item.default_factory is dataclasses.MISSING:
        return "required"
    return "a section" if dataclasses.is_dataclass(item.default_factory) else _value(item.default_factory())


def _value(value: Any) -> str:
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return f"`{value}`" if isinstance(value, str) else _number(value)


def _type(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return " / ".join(f"`{arg}`" for arg in args)
    if origin is tuple:
        if dataclasses.is_dataclass(args[0]):
            return "list of corpora"
        return "list of " + ("strings" if args[0] is str else f"{len(args)} numbers")
    if type(None) in args:
        return _type(next(arg for arg in args if arg is not type(None))) + " or none"
    if dataclasses.is_dataclass(hint):
        return "a corpus"
    return {int: "integer", float: "number", bool: "true / false", str: "string"}.get(hint, str(hint))


def _range(bound: Bound | None) -> str:
    if bound is None:
        return ""
    low = _number(bound.low)
    if bound.high is None:
        return f"{'>' if bound.low_open else '≥'} {low}"
    return f"{'(' if bound.low_open else '['}{low}, {_number(bound.high)}{')' if bound.high_open else ']'}"


def _number(value: float) -> str:
    """An integer in full (a seed's 2^32 as 4,294,967,296, not 4.29497e+09), any other number short."""
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _served(metadata: Any) -> str:
    if not metadata.get("served", True):
        return "the server's own"
    parts = [f"at most {metadata['served_max']:g}"] if metadata.get("served_max") is not None else []
    if metadata.get("engines") and metadata["engines"] != {"pytorch", "ctranslate2"}:
        parts.append("checkpoints only")
    return "; ".join(parts) or "yes"


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m seq2seq.config_reference OUTPUT.md", file=sys.stderr)
        return 2
    write_text_atomic(Path(sys.argv[1]), reference())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

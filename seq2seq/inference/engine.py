"""What every inference engine shares: the `Engine` contract `Translator` depends on, the
`Translation` it returns, and the metadata file that marks an exported model.

An engine turns lines into n-best lists under given decode settings; it knows nothing of
`Translator`, so adding one (a new runtime, a remote service) touches no other engine. Today's two:
pytorch_engine.py (a checkpoint, our search) and ctranslate2_engine.py (an exported directory).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from seq2seq.config import DecodeConfig
from seq2seq.errors import UserInputError

EXPORT_METADATA = "seq2seq_export.json"  # marks a directory written by `seq2seq export`


@dataclass(frozen=True)
class Translation:
    """The n best outputs of one input line, best first, as (text, score) pairs."""

    nbest: list[tuple[str, float]]

    @property
    def text(self) -> str:
        return self.nbest[0][0] if self.nbest else ""


class Engine(Protocol):
    """Translates lines with complete decode settings; one Translation per line, in input order (an
    empty line gets an empty one)."""

    name: str  # "pytorch", "ctranslate2": reports and /health say which engine answered

    def translate(self, lines: list[str], decode: DecodeConfig, progress: bool) -> list[Translation]: ...


def read_export_metadata(directory: Path) -> dict:
    try:
        return json.loads((directory / EXPORT_METADATA).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserInputError(f"{directory / EXPORT_METADATA}: unreadable export metadata ({exc})") from None

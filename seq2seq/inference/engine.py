"""What every inference engine shares: the `Engine` contract `Translator` depends on, the
`Translation` it returns, and the metadata file that marks an exported model.

An engine turns lines into n-best lists under given decode settings, and scores given pairs; it knows nothing of
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


@dataclass(frozen=True)
class PairScore:
    """How likely the model finds a given target for a given source (force-decoding)."""

    pieces: list[str]  # the target's pieces, then the end of sentence
    log_probs: list[float]  # of each piece given the source and the pieces before it
    score: float  # their sum, length-normalised as search ranks its outputs

    @property
    def log_prob(self) -> float:
        return sum(self.log_probs)


class Engine(Protocol):
    """Translates lines with complete decode settings; one Translation per line, in input order (an
    empty line gets an empty one)."""

    name: str  # "pytorch", "ctranslate2": reports and /health say which engine answered

    def translate(
        self,
        lines: list[str],
        decode: DecodeConfig,
        progress: bool,
        *,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
    ) -> list[Translation]:
        """`prefixes`: per line, target text the output must start with ("" for none); `constraints`:
        per line, target phrases the output must contain (engines without constrained search refuse them)."""

    def score(self, sources: list[str], targets: list[str], decode: DecodeConfig) -> list[PairScore]:
        """Each target's log-probabilities given its source (length normalisation from `decode`)."""


def read_export_metadata(directory: Path) -> dict:
    try:
        return json.loads((directory / EXPORT_METADATA).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserInputError(f"{directory / EXPORT_METADATA}: unreadable export metadata ({exc})") from None

"""What every inference engine shares: the `Engine` contract `Translator` depends on, the
`Translation` it returns, the features an engine may lack, and the metadata file that marks an
exported model.

An engine turns lines into n-best lists under given decode settings, and scores given pairs; it knows nothing of
`Translator`, so adding one (a new runtime, a remote service) touches no other engine. Today's two:
pytorch_engine.py (a checkpoint, our search) and ctranslate2_engine.py (an exported directory).
An engine declares whether it runs constrained search and how long a line its model can place
(`max_positions`); which decode options it honours is declared with each option (decoding.py).
The Translator and the server refuse what an engine cannot do from those declarations before any
work (admission.py), never inside the engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from seq2seq.decoding import DecodeConfig
from seq2seq.errors import UserInputError

if TYPE_CHECKING:
    from sentencepiece import SentencePieceProcessor

LinesDone = Callable[[int], object]  # called with a number of lines just translated, e.g. tqdm's update

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


class DeadlinePassed(Exception):
    """The work was stopped at its deadline (the client stopped waiting): nothing was returned."""


class Engine(Protocol):
    """Translates lines with complete decode settings; one Translation per line, in input order (an
    empty line gets an empty one)."""

    name: str  # "pytorch", "ctranslate2": reports and /health say which engine answered; decoding.py's engines
    title: str  # how messages name it: "CTranslate2"
    instead: str  # what a user can do when it lacks something: "translate with the checkpoint ..."
    constrained_search: bool  # terminology constraints
    shortlisted: bool  # outputs held to a lexical shortlist (shortlist.py)
    max_positions: int | None  # the longest source (EOS included) and output its model places; None: any
    computes_in: str  # the number format of its weights' products: "float32", CTranslate2's "int8_float32"
    source_model: SentencePieceProcessor
    target_model: SentencePieceProcessor

    def translate(
        self,
        lines: list[str],
        decode: DecodeConfig,
        *,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        line_numbers: list[int] | None = None,
        deadline: float | None = None,
        progress: LinesDone | None = None,
    ) -> list[Translation]:
        """`prefixes`: per line, target text the output must start with ("" for none); `constraints`:
        per line, target phrases the output must contain; `line_numbers`: each line's index in its
        file or request (default: its place in `lines`), from which, with the seed, its samples are
        drawn; `deadline`: a time.monotonic() after which the work stops (DeadlinePassed);
        `progress`: told how many lines are done as each batch of them is (a progress bar's update),
        so that a bar moves while a long call runs."""

    def score(
        self,
        sources: list[str],
        targets: list[str],
        decode: DecodeConfig,
        *,
        deadline: float | None = None,
        progress: LinesDone | None = None,
    ) -> list[PairScore]:
        """Each target's log-probabilities given its source (length normalisation from `decode`);
        `deadline` and `progress` (pairs done) as for translate."""


def read_export_metadata(directory: Path) -> dict:
    try:
        return json.loads((directory / EXPORT_METADATA).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserInputError(f"{directory / EXPORT_METADATA}: unreadable export metadata ({exc})") from None

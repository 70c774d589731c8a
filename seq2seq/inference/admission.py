"""What a translation asks of an engine, known before any work: each line's pieces, the length its
output may reach and the hypotheses its search keeps, and the lines the engine must refuse.

A line is refused, alone and in one line naming it, when its source or the output it may produce
does not fit the model's positions (an exported model has a fixed table; our PyTorch model has
none), or when a target prefix or constraint holds characters the target vocabulary cannot spell
(it would be "met" by the unknown piece ⁇ and the output would degrade). Nothing is ever cut short
silently. The same plans give the server its measure of work, source pieces x hypotheses x length
limit, which bounds a request as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from seq2seq.data.sources import normalize
from seq2seq.decoding import DecodeConfig
from seq2seq.errors import UserInputError

if TYPE_CHECKING:
    from sentencepiece import SentencePieceProcessor

SHOWN = 5  # problems named after the first, in a report that would otherwise run to thousands


class Capacity(Protocol):
    """What admission needs to know of a model: its SentencePiece models and its positions (None:
    any length). Every engine.Engine has them; ModelCapacity gives them for a model not yet loaded."""

    source_model: SentencePieceProcessor
    target_model: SentencePieceProcessor
    max_positions: int | None


@dataclass(frozen=True)
class ModelCapacity:
    source_model: SentencePieceProcessor
    target_model: SentencePieceProcessor
    max_positions: int | None


@dataclass(frozen=True)
class LinePlan:
    """One line's translation as the engine will run it."""

    source: int  # source pieces with the EOS the encoder reads (0: an empty line, never translated)
    limit: int  # the most output tokens its search may produce (DecodeConfig.output_limit)
    rows: int  # hypotheses searched side by side: the beam, or the draws when sampling

    @property
    def work(self) -> int:
        """Source pieces x hypotheses x length limit: what attending to the source costs over the search."""
        return self.source * self.rows * self.limit


@dataclass(frozen=True)
class Names:
    """How a problem names a line and its guidance: by index in a request (lines[3]) or by line in a
    file ("in.txt:4"). Formats take {index} (from 0) and {number} (from 1), both counted from `first`."""

    line: str = "lines[{index}]"
    prefix: str = "prefixes[{index}]"
    constraint: str = "constraints[{index}]"
    first: int = 0

    def of(self, kind: str, index: int) -> str:
        position = self.first + index
        return getattr(self, kind).format(index=position, number=position + 1)


def plan_translation(
    capacity: Capacity,
    lines: list[str],
    decode: DecodeConfig,
    *,
    prefixes: list[str] | None = None,
    constraints: list[list[str]] | None = None,
    names: Names = Names(),
) -> list[LinePlan]:
    """Each line's plan, or UserInputError naming the lines the engine must refuse."""
    texts = [normalize(line) for line in lines]
    rows = [index for index, text in enumerate(texts) if text]
    problems: list[str] = []
    sources = dict(zip(rows, capacity.source_model.encode([texts[i] for i in rows], add_eos=True)))
    own_prefixes = {i: [prefixes[i]] for i in rows} if prefixes else {}
    own_constraints = {i: constraints[i] for i in rows} if constraints else {}
    prefix_ids = _target_ids(capacity, own_prefixes, "prefix", names, problems)
    constraint_ids = _target_ids(capacity, own_constraints, "constraint", names, problems)
    draws = decode.nbest if decode.sample else decode.beam
    plans = []
    for index in range(len(lines)):
        source = len(sources.get(index, ()))
        prefix = sum(map(len, prefix_ids.get(index, [])))
        constraint_tokens = sum(map(len, constraint_ids.get(index, [])))
        limit = decode.output_limit(source, prefix=prefix, constraint_tokens=constraint_tokens)
        plans.append(LinePlan(source, limit if source else 0, draws if source else 0))
        if source and (problem := _beyond_positions(capacity, source, limit)):
            problems.append(f"{names.of('line', index)}: {problem}")
    _raise(problems)
    return plans


def plan_scoring(
    capacity: Capacity, sources: list[str], targets: list[str], *, names: Names = Names()
) -> list[LinePlan]:
    """Each pair's plan (force-decoding: one row, the target and its EOS), or UserInputError naming
    the pairs whose source or target does not fit the model's positions."""
    source_ids = capacity.source_model.encode([normalize(line) for line in sources], add_eos=True)
    target_ids = capacity.target_model.encode([normalize(line) for line in targets], add_eos=True)
    pairs = enumerate(zip(source_ids, target_ids))
    problems = [
        f"{names.of('line', index)}: {problem}"
        for index, (source, target) in pairs
        if (problem := _beyond_positions(capacity, len(source), len(target)))
    ]
    _raise(problems)
    return [LinePlan(len(source), len(target), 1) for source, target in zip(source_ids, target_ids)]


def _beyond_positions(capacity: Capacity, source: int, output: int) -> str:
    """Why a line does not fit the engine's position table ("" when it does)."""
    most = capacity.max_positions
    if most is None or max(source, output) <= most:
        return ""
    advice = "translate it with the checkpoint (.pt), or export again with a larger --max-positions"
    if source > most:
        return f"{source:,} source pieces with its end of sentence; the model's positions hold {most:,}: {advice}"
    return (
        f"its output may reach {output:,} tokens (decode.max_len_a x {source:,} source pieces + max_len_b, "
        f"with its guidance); the model's positions hold {most:,}: lower decode.max_len_a / max_len_b, or "
        f"{advice}"
    )


def unspellable(capacity: Capacity, phrase: str, ids: list[int] | None = None) -> str:
    """Why the target vocabulary cannot spell `phrase` (its target ids `ids`, if known), or "": a
    phrase whose pieces hold the unknown piece would be "met" by ⁇."""
    model = capacity.target_model
    unknown = model.unk_id()
    if unknown not in (model.encode(normalize(phrase)) if ids is None else ids):
        return ""
    missing = "".join(sorted({char for char in phrase if unknown in model.encode(char)}))
    return (
        f"{_short(phrase)} has characters the target vocabulary cannot spell ({missing!r}); it would be met by "
        "the unknown piece: write it in the target's script or leave it out"
    )


def _target_ids(
    capacity: Capacity, phrases: dict[int, list[str]], kind: str, names: Names, problems: list[str]
) -> dict[int, list[list[int]]]:
    """Each line's phrases as target ids (those that encode to nothing dropped); a phrase the target
    vocabulary cannot spell adds a problem naming it."""
    flat = [(index, normalize(phrase)) for index, line in phrases.items() for phrase in line]
    encoded = capacity.target_model.encode([phrase for _, phrase in flat])
    found: dict[int, list[list[int]]] = {}
    for (index, phrase), ids in zip(flat, encoded):
        if problem := unspellable(capacity, phrase, ids):
            problems.append(f"{names.of(kind, index)}: {problem}")
        if ids:
            found.setdefault(index, []).append(ids)
    return found


def _short(text: str) -> str:
    return repr(text if len(text) <= 40 else text[:37] + "...")


def _raise(problems: list[str]) -> None:
    """One line: the first problem, and where the others are."""
    if not problems:
        return
    first, rest = problems[0], [problem.split(": ", 1)[0] for problem in problems[1:]]
    more = f" ({len(rest)} more: {', '.join(rest[:SHOWN])}{', ...' if len(rest) > SHOWN else ''})" if rest else ""
    raise UserInputError(first + more)

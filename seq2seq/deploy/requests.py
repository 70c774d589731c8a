"""What a request to `seq2seq serve` may ask, checked before any work: its fields by JSON type, the
numbers that set the amount of work by the server's `Limits`, its lines by their pieces after
SentencePiece, and its work as a whole (source pieces x hypotheses x length limit, admission.py),
since each field may be within its cap while their product is not. A request that passes becomes
a `Job` for the batching worker; one that does not, a RequestError (413 or 422) saying why.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field

from seq2seq.decoding import Declared, DecodeConfig, declarations
from seq2seq.errors import UserInputError
from seq2seq.inference.admission import LinePlan, Names
from seq2seq.inference.translator import Translator

SERVED = {option.name: option for option in declarations() if option.served}  # the decode options a request may set
SERVED_FOR_SCORING = {name: option for name, option in SERVED.items() if option.scoring}  # those /score reads
_NAMED = 5  # unknown fields an error names


def _served_maxima() -> dict[str, float]:
    return {option.name: option.served_max for option in SERVED.values() if option.served_max is not None}


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how much the server takes on. The decode options that set
    the amount of work take the server's maxima declared with them (decoding.py), tighter than the
    config's, which guard files; `decode_maxima` may tighten them further."""

    max_lines: int = 64  # lines per request
    max_chars: int = 2000  # characters per line (checked first: SentencePiece never sees more)
    max_tokens_per_line: int = 256  # SentencePiece pieces per line, its end included
    max_work: int = 2_000_000  # source pieces x hypotheses x length limit, summed over the request's lines
    max_body_bytes: int = 1_000_000
    batch_wait: float = 0.005  # seconds the worker waits for more requests to batch with
    max_queue: int = 256  # requests waiting or in translation; more are answered 503
    request_timeout: float = 60.0  # seconds a request may take, waiting and translating
    max_constraints: int = 8  # terminology constraints per line (each one widens that line's search)
    decode_maxima: Mapping[str, float] = field(default_factory=_served_maxima)

    def maximum(self, name: str) -> float | None:
        """A decode option's largest value on this server (None: the config's bound alone)."""
        return self.decode_maxima.get(name)


def request_schema(limits: Limits, kind: str) -> dict:
    """The JSON Schema of a /translate or /score body under these limits (the OpenAPI document
    carries it; the server's own checks are the code below, which this describes)."""
    text = {"type": "string", "maxLength": limits.max_chars}
    texts = {"type": "array", "items": text, "maxItems": limits.max_lines}
    json_types = {int: "integer", float: "number", str: "string", bool: "boolean"}
    decode = {}
    for name, option in (SERVED_FOR_SCORING if kind == "score" else SERVED).items():
        decode[name] = {"type": json_types[option.kind], "description": option.help}
        if option.choices:
            decode[name]["enum"] = list(option.choices)
        if option.bound is not None:
            decode[name].update(option.bound.json_schema())
        if limits.maximum(name) is not None:  # the server's own, tighter
            decode[name].pop("exclusiveMaximum", None)
            decode[name]["maximum"] = limits.maximum(name)
    if kind == "score":
        properties, required = {"sources": texts, "targets": texts}, ["sources", "targets"]
    else:
        terms = {"type": "array", "items": text, "maxItems": limits.max_constraints}
        constraints = {"type": "array", "items": terms, "maxItems": limits.max_lines}
        properties, required = {"lines": texts, "prefixes": texts, "constraints": constraints}, ["lines"]
    return {
        "type": "object",
        "properties": {**properties, **decode},
        "required": required,
        "additionalProperties": False,
    }


@dataclass
class Job:
    """One request's work: lines to translate (with their guidance), or pairs to score (`targets`)."""

    lines: list[str]
    decode: DecodeConfig
    plans: list[LinePlan]
    prefixes: list[str] | None = None
    constraints: list[list[str]] | None = None
    targets: list[str] | None = None
    deadline: float = math.inf  # time.monotonic() past which its client no longer waits
    future: Future = field(default_factory=Future)

    @property
    def kind(self) -> str:
        return "score" if self.targets is not None else "translate"

    @property
    def tokens(self) -> int:
        return sum(plan.source for plan in self.plans)


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_request(body: object, translator: Translator, limits: Limits) -> Job:
    """The work a /translate body asks for, or a RequestError (413 or 422) saying what is wrong."""
    lines = [_one_line(line) for line in _texts(body, "lines", limits, extra={"prefixes", "constraints", *SERVED})]
    prefixes = body.get("prefixes")
    if prefixes is not None:
        prefixes = [_one_line(prefix) for prefix in _texts(body, "prefixes", limits, count=len(lines))]
    constraints = body.get("constraints")
    if constraints is not None:
        constraints = _constraints(constraints, len(lines), limits)
    decode = _decode(body, translator, limits)
    try:
        translator.check_supported(decode, constrained=constraints is not None and any(constraints))
        plans = translator.plan(lines, decode, prefixes=prefixes, constraints=constraints)
    except UserInputError as error:  # a line the model cannot place, guidance it cannot spell, an engine's refusal
        raise RequestError(422, str(error)) from None
    _check_work(plans, limits, "lines")
    return Job(lines, decode, plans, prefixes=prefixes, constraints=constraints)


def parse_score_request(body: object, translator: Translator, limits: Limits) -> Job:
    """The pairs a /score body asks to score, or a RequestError."""
    fields = {"targets", *SERVED_FOR_SCORING}  # a beam or a temperature would change no score: unknown here
    sources = [_one_line(line) for line in _texts(body, "sources", limits, extra=fields)]
    targets = [_one_line(line) for line in _texts(body, "targets", limits, count=len(sources))]
    decode = _decode(body, translator, limits, SERVED_FOR_SCORING)
    try:
        plans = translator.plan_scoring(sources, targets, names=Names(line="pair {index}"))
    except UserInputError as error:
        raise RequestError(422, str(error)) from None
    _check_pieces([plan.limit for plan in plans], limits, "targets")
    _check_work(plans, limits, "sources")
    return Job(sources, decode, plans, targets=targets)


def _check_pieces(counts: list[int], limits: Limits, key: str) -> None:
    """Each line of `key` within the server's pieces per line, counted with its end (413)."""
    for index, count in enumerate(counts):
        if count > limits.max_tokens_per_line:
            raise RequestError(
                413,
                f"{key}[{index}]: {count} pieces with its end; at most "
                f"{limits.max_tokens_per_line} per line on this server",
            )


def _check_work(plans: list[LinePlan], limits: Limits, key: str) -> None:
    """Each line's pieces, then the request's work as a whole, within the server's limits (413)."""
    _check_pieces([plan.source for plan in plans], limits, key)
    work = sum(plan.work for plan in plans)
    if work > limits.max_work:
        raise RequestError(
            413,
            f"the request's work, {work:,} (source pieces x beam or samples x length limit, over "
            f"its lines), is over this server's {limits.max_work:,}; send fewer or shorter lines, "
            "a smaller beam or a lower length limit",
        )


def _one_line(text: str) -> str:
    return text.replace("\n", " ")


def _texts(
    body: object, key: str, limits: Limits, *, extra: Collection[str] = (), count: int | None = None
) -> list[str]:
    """body[key], checked: a JSON object with no field but `key` and `extra`, a list of strings within
    the size limits (and `count` long, for a list that goes with another)."""
    if not isinstance(body, dict):
        raise RequestError(422, f'expected a JSON object such as {{"{key}": ["..."]}}')
    if count is None:
        known = {key, *extra}
        unknown = sorted(set(body) - known)
        if unknown:  # named cut short, and at most _NAMED of them: the answer never echoes a large body
            named = ", ".join(map(shortened_name, unknown[:_NAMED]))
            more = f" and {len(unknown) - _NAMED:,} more" if len(unknown) > _NAMED else ""
            raise RequestError(422, f"unknown field(s) {named}{more}; expected {', '.join(sorted(known))}")
    texts = body.get(key)
    if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
        raise RequestError(422, f"{key}: expected a list of strings")
    if count is not None and len(texts) != count:
        raise RequestError(422, f"{key}: {len(texts)} given; expected one per line ({count})")
    if len(texts) > limits.max_lines:
        raise RequestError(413, f"{key}: {len(texts)} lines; at most {limits.max_lines} per request")
    for index, text in enumerate(texts):
        if len(text) > limits.max_chars:
            raise RequestError(413, f"{key}[{index}]: {len(text)} characters; at most {limits.max_chars} per line")
    return texts


def _constraints(value: object, count: int, limits: Limits) -> list[list[str]]:
    if not isinstance(value, list) or not all(
        isinstance(line, list) and all(isinstance(term, str) for term in line) for line in value
    ):
        raise RequestError(422, "constraints: expected a list (one per line) of lists of strings")
    if len(value) != count:
        raise RequestError(422, f"constraints: {len(value)} given; expected one list per line ({count})")
    for index, terms in enumerate(value):
        if len(terms) > limits.max_constraints:
            raise RequestError(413, f"constraints[{index}]: {len(terms)} terms; at most {limits.max_constraints}")
        if sum(map(len, terms)) > limits.max_chars:
            raise RequestError(413, f"constraints[{index}]: over {limits.max_chars} characters in all")
    return [[_one_line(term) for term in terms] for terms in value]


def _decode(
    body: dict, translator: Translator, limits: Limits, served: Mapping[str, Declared] = SERVED
) -> DecodeConfig:
    """The request's decode fields among `served`, typed and bounded, on the model's defaults; what
    the engine does not do (an explicit seed on CTranslate2) is refused here too."""
    options = {key: body[key] for key in served if key in body}
    for key, value in options.items():
        kind = served[key].kind
        if not _has_json_type(value, kind):
            expected = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[kind]
            raise RequestError(422, f"{key}: expected {expected}, got {shortened(value)}")
        most = limits.maximum(key)
        if most is not None and value > most:
            raise RequestError(422, f"{key}: at most {most} on this server, got {shortened(value)}")
        if kind is int and not -(2**63) <= value < 2**63:  # the config's checks would name it digit by digit
            raise RequestError(422, f"{key}: expected a 64-bit integer, got {shortened(value)}")
    try:
        return translator.settings(**options)
    except UserInputError as error:  # lines like "options: decode.nbest: expected ...": name the request's field
        problems = [line.split(": ", 1)[-1].removeprefix("decode.") for line in str(error).splitlines()]
        raise RequestError(422, "; ".join(problems)) from None


def _has_json_type(value: object, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind) and not isinstance(value, bool)


def shortened_name(name: str) -> str:
    """A field's name as the client sent it, cut short like `shortened`."""
    return name if len(name) <= 40 else name[:37] + "..."


def shortened(value: object) -> str:
    """A value as the client sent it, cut short: an error names it without echoing a large body."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."

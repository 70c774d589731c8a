"""`seq2seq serve`: an HTTP JSON translation service (FastAPI on uvicorn) over a checkpoint or exported model.

    POST /translate  {"lines": ["..."], "beam": 5, "nbest": 1, ...}  ->  {"translations": ["..."]}
                     optional per line: "prefixes": ["..."], "constraints": [["term", ...]]
    POST /score      {"sources": ["..."], "targets": ["..."]}  ->  {"scores": [{"score", "log_prob", "pieces"}]}
    GET  /health     ->  {"status": "ok", "engine": "ctranslate2", "model": "...", ...}

Requests that arrive together are translated together: one worker thread takes the first waiting
request, then gathers more with the same decode settings for up to `batch_wait` seconds or until a
token budget is full, and translates them as one batch, so throughput grows with concurrency.

Every request is bounded before any work (`Limits`): its lines, characters and, once SentencePiece
has split them, pieces per line, and its work as a whole, source pieces x hypotheses x length limit
summed over its lines (admission.py), since each field may be within its cap while their product is
not. What an engine cannot do (epsilon sampling or a seed on an exported model, constraints there)
and lines its model cannot place are refused when the request is parsed. A request past its timeout
stops within one decoding step and frees the worker; a request waiting in the queue holds its place
until the worker has let it go, so the queue bound holds.

Answers: 401 without the API key (when one is set), 415 for a body that is not JSON, 400 for
malformed JSON, 413 for a request over a size or work limit (the body is counted while it is read),
422 for a wrong field or value, 503 with Retry-After for a full queue or a request past its time,
each with {"error": "..."}; a failure inside translation answers 500 without its details (they go to
the server's log) and the server goes on. uvicorn stops cleanly on SIGTERM or Ctrl-C, after the
requests in flight.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import queue
import sys
import threading
import time
import traceback
import typing
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from seq2seq.config import DECODE_BOUNDS, DecodeConfig
from seq2seq.errors import UserInputError
from seq2seq.inference.admission import LinePlan, Names
from seq2seq.inference.engine import DeadlinePassed, Translation
from seq2seq.inference.translator import Translator
from seq2seq.training.host_memory import release_free_heap

log = logging.getLogger(__name__)

SERVER_OWN = ("batch_tokens",)  # decode settings the server keeps to itself: how it batches is its business
API_KEY_VARIABLE = "SEQ2SEQ_API_KEY"


def decode_fields() -> dict[str, type]:
    """The decode settings a request may set, and the JSON type each must have (a number is a number,
    never a string that parses as one): every DecodeConfig field but the server's own."""
    kinds = {}
    for name, hint in typing.get_type_hints(DecodeConfig).items():
        if name not in SERVER_OWN:
            kinds[name] = str if typing.get_origin(hint) is typing.Literal else hint
    return kinds


DECODE_FIELDS = decode_fields()


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, and how much the server takes on: every number that sets the
    amount of work is bounded here (the decode maxima of config.py are looser: they guard files)."""

    max_lines: int = 64  # lines per request
    max_chars: int = 2000  # characters per line (checked first: SentencePiece never sees more)
    max_tokens_per_line: int = 256  # SentencePiece pieces per line, its end included
    max_work: int = 2_000_000  # source pieces x hypotheses x length limit, summed over the request's lines
    max_body_bytes: int = 1_000_000
    batch_wait: float = 0.005  # seconds the worker waits for more requests to batch with
    max_queue: int = 256  # requests waiting or in translation; more are answered 503
    request_timeout: float = 60.0  # seconds a request may take, waiting and translating
    max_beam: int = 16
    max_patience: float = 4.0
    max_len_a: float = 4.0
    max_len_b: int = 256
    max_no_repeat_ngram: int = 8
    max_constraints: int = 8  # terminology constraints per line (each one widens that line's search)

    def bounds(self) -> dict[str, float]:
        """Each bounded decode field and its largest allowed value (nbest is bounded by beam)."""
        return {"beam": self.max_beam, "nbest": self.max_beam, "patience": self.max_patience,
                "max_len_a": self.max_len_a, "max_len_b": self.max_len_b,
                "no_repeat_ngram": self.max_no_repeat_ngram}  # fmt: skip


def request_schema(limits: Limits, kind: str) -> dict:
    """The JSON Schema of a /translate or /score body under these limits (the OpenAPI document
    carries it; the server's own checks are the code below, which this describes)."""
    text = {"type": "string", "maxLength": limits.max_chars}
    texts = {"type": "array", "items": text, "maxItems": limits.max_lines}
    json_types = {int: "integer", float: "number", str: "string", bool: "boolean"}
    hints, decode = typing.get_type_hints(DecodeConfig), {}
    for name, kind_of in DECODE_FIELDS.items():
        decode[name] = {"type": json_types[kind_of]}
        if typing.get_origin(hints[name]) is typing.Literal:
            decode[name]["enum"] = list(typing.get_args(hints[name]))
        if name in DECODE_BOUNDS:
            decode[name].update(DECODE_BOUNDS[name].json_schema())
        if name in limits.bounds():  # the server's own, tighter
            decode[name]["maximum"] = limits.bounds()[name]
    if kind == "score":
        properties, required = {"sources": texts, "targets": texts}, ["sources", "targets"]
    else:
        terms = {"type": "array", "items": text, "maxItems": limits.max_constraints}
        constraints = {"type": "array", "items": terms, "maxItems": limits.max_lines}
        properties, required = {"lines": texts, "prefixes": texts, "constraints": constraints}, ["lines"]
    return {"type": "object", "properties": {**properties, **decode}, "required": required,
            "additionalProperties": False}  # fmt: skip


@dataclass
class _Job:
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


class BatchingWorker:
    """One thread that translates queued jobs in batches of jobs with equal decode settings."""

    def __init__(self, translator: Translator, batch_wait: float, max_queue: int) -> None:
        self.translator, self.batch_wait, self.max_queue = translator, batch_wait, max_queue
        self._open = threading.Semaphore(max_queue)  # one per request queued or in translation
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._held: collections.deque[_Job] = collections.deque()  # other settings: next batch
        self.requests = self.batches = 0  # /health reports them: batches < requests shows batching at work
        self._thread = threading.Thread(target=self._run, name="translate-batches", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests queued, not yet taken into a batch."""
        return self._queue.qsize() + len(self._held)

    def submit(self, job: _Job) -> Future:
        """Queue a job, or refuse it (RequestError 503) when max_queue requests are already open. Its
        place is given back when the worker lets the job go (done, or skipped after its client left),
        never while it still sits in the queue."""
        if not self._open.acquire(blocking=False):
            raise RequestError(503, f"the server is busy ({self.max_queue} requests open); retry shortly")
        self._queue.put(job)
        return job.future

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            first = self._held.popleft() if self._held else self._queue.get()
            if first is None:
                return
            batch, stopping = self._gather(first)
            try:
                self._translate(batch)
            finally:
                for _ in batch:
                    self._open.release()
            if stopping:
                return

    def _gather(self, first: _Job) -> tuple[list[_Job], bool]:
        batch, tokens = [first], first.tokens
        deadline = time.monotonic() + self.batch_wait
        while tokens < first.decode.batch_tokens and (remaining := deadline - time.monotonic()) > 0:
            try:
                job = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if job is None:
                return batch, True
            if job.decode != first.decode or job.kind != first.kind:
                self._held.append(job)
                continue
            batch.append(job)
            tokens += job.tokens
        return batch, False

    def _translate(self, batch: list[_Job]) -> None:
        batch = [job for job in batch if job.future.set_running_or_notify_cancel()]  # timed out: skipped
        if not batch:
            return
        self.requests, self.batches = self.requests + len(batch), self.batches + 1
        lines = [line for job in batch for line in job.lines]
        deadline = max(job.deadline for job in batch)  # stop once no client of the batch still waits
        try:
            if batch[0].kind == "score":
                targets = [target for job in batch for target in job.targets]
                results = self.translator.score_with(lines, targets, batch[0].decode, deadline=deadline)
            else:
                prefixes = [p for job in batch for p in (job.prefixes or [""] * len(job.lines))]
                constraints = [c for job in batch for c in (job.constraints or [[]] * len(job.lines))]
                numbers = [number for job in batch for number in range(len(job.lines))]  # a line's index in its request
                results = self.translator.translate_with(lines, batch[0].decode, prefixes=prefixes,
                                                         constraints=constraints, line_numbers=numbers,
                                                         deadline=deadline)  # fmt: skip
        except Exception as error:  # DeadlinePassed: the clients have left; anything else answers 500
            if not isinstance(error, DeadlinePassed):  # the details go to the server's log, never to the client
                traceback.print_exc(file=sys.stderr)
            # without its traceback, whose frames hold the search's tensors for as long as the future lives
            error = error.with_traceback(None)
            for job in batch:
                job.future.set_exception(error)
            release_free_heap()  # a search stopped part-way left its caches' holes in the heap
            return
        start = 0
        for job in batch:
            job.future.set_result(results[start : start + len(job.lines)])
            start += len(job.lines)


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_request(body: object, translator: Translator, limits: Limits) -> _Job:
    """The work a /translate body asks for, or a RequestError (413 or 422) saying what is wrong."""
    lines = [_one_line(line) for line in _texts(body, "lines", limits, extra=("prefixes", "constraints"))]
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
    return _Job(lines, decode, plans, prefixes=prefixes, constraints=constraints)


def parse_score_request(body: object, translator: Translator, limits: Limits) -> _Job:
    """The pairs a /score body asks to score, or a RequestError."""
    sources = [_one_line(line) for line in _texts(body, "sources", limits, extra=("targets",))]
    targets = [_one_line(line) for line in _texts(body, "targets", limits, count=len(sources))]
    decode = _decode(body, translator, limits)
    try:
        plans = translator.plan_scoring(sources, targets, names=Names(line="pair {index}"))
    except UserInputError as error:
        raise RequestError(422, str(error)) from None
    for index, plan in enumerate(plans):
        if plan.limit > limits.max_tokens_per_line:
            raise RequestError(413, f"targets[{index}]: {plan.limit} pieces with its end; at most "
                                    f"{limits.max_tokens_per_line} per line on this server")  # fmt: skip
    _check_work(plans, limits, "sources")
    return _Job(sources, decode, plans, targets=targets)


def _check_work(plans: list[LinePlan], limits: Limits, key: str) -> None:
    """Each line's pieces, then the request's work as a whole, within the server's limits (413)."""
    for index, plan in enumerate(plans):
        if plan.source > limits.max_tokens_per_line:
            raise RequestError(413, f"{key}[{index}]: {plan.source} pieces with its end; at most "
                                    f"{limits.max_tokens_per_line} per line on this server")  # fmt: skip
    work = sum(plan.work for plan in plans)
    if work > limits.max_work:
        raise RequestError(413, f"the request's work, {work:,} (source pieces x beam or samples x length limit, over "
                                f"its lines), is over this server's {limits.max_work:,}; send fewer or shorter lines, "
                                "a smaller beam or a lower length limit")  # fmt: skip


def _one_line(text: str) -> str:
    return text.replace("\n", " ")


def _texts(
    body: object, key: str, limits: Limits, *, extra: tuple[str, ...] = (), count: int | None = None
) -> list[str]:
    """body[key], checked: a JSON object whose fields are known, a list of strings within the size
    limits (and `count` long, for a list that goes with another)."""
    if not isinstance(body, dict):
        raise RequestError(422, f'expected a JSON object such as {{"{key}": ["..."]}}')
    if count is None:
        known = {key, *extra, *DECODE_FIELDS}
        unknown = sorted(set(body) - known)
        if unknown:
            named = ", ".join(name if len(name) <= 40 else name[:37] + "..." for name in unknown)
            raise RequestError(422, f"unknown field(s) {named}; expected {', '.join(sorted(known))}")
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


def _decode(body: dict, translator: Translator, limits: Limits) -> DecodeConfig:
    """The request's decode fields, typed and bounded, on the model's defaults; what the engine does
    not do (an explicit seed on CTranslate2) is refused here too."""
    options = {key: body[key] for key in DECODE_FIELDS if key in body}
    for key, value in options.items():
        if not _has_json_type(value, DECODE_FIELDS[key]):
            kinds = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
            expected = kinds[DECODE_FIELDS[key]]
            raise RequestError(422, f"{key}: expected {expected}, got {_short(value)}")
        most = limits.bounds().get(key)
        if most is not None and value > most:
            raise RequestError(422, f"{key}: at most {most} on this server, got {value}")
    try:
        return translator.settings(**options)
    except UserInputError as error:  # lines like "options: decode.nbest: expected ...": keep the key once
        problems = [line.split(": ", 1)[-1] for line in str(error).splitlines()]
        raise RequestError(422, "; ".join(problems)) from None


def create_app(
    translator: Translator, *, model_name: str, limits: Limits = Limits(), api_key: str | None = None
) -> FastAPI:
    """The service; with `api_key`, every request must carry `Authorization: Bearer <api_key>` (a
    request without it learns only that the server is up, from /health)."""
    worker: BatchingWorker | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal worker
        worker = BatchingWorker(translator, limits.batch_wait, limits.max_queue)
        yield
        worker.stop()

    app = FastAPI(title="seq2seq", lifespan=lifespan)

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    @app.get("/health")
    async def health(request: Request) -> dict:
        if not authorized(request):
            return {"status": "ok"}
        return {"status": "ok", "engine": translator.engine, "model": model_name, "requests": worker.requests,
                "batches": worker.batches, "waiting": worker.waiting}  # fmt: skip

    async def run(request: Request, parse) -> tuple[_Job, list] | JSONResponse:
        """Check, read and queue a request, and wait for its results (or the error response)."""
        try:
            _check_headers(request, authorized(request))
            job = parse(_json(await _read_body(request, limits.max_body_bytes)), translator, limits)
            job.deadline = time.monotonic() + limits.request_timeout
            future = worker.submit(job)
        except RequestError as error:
            return _error(error.status, str(error), retry=error.status == 503)
        late = _error(503, f"the request took over {limits.request_timeout:g} s; try fewer or shorter lines",
                      retry=True)  # fmt: skip
        try:
            return job, await asyncio.wait_for(asyncio.wrap_future(future), limits.request_timeout)
        except (asyncio.TimeoutError, DeadlinePassed):  # the worker skips it, or stops it within a step
            return late
        except Exception:  # the worker logged the details; they never go to the client
            work = {"translate": "translation", "score": "scoring"}[job.kind]
            return _error(500, f"{work} failed; the server's log has the details")

    @app.post("/translate", openapi_extra=_body_schema(request_schema(limits, "translate")))
    async def translate(request: Request) -> JSONResponse:
        outcome = await run(request, parse_request)
        if isinstance(outcome, JSONResponse):
            return outcome
        job, results = outcome
        translations: list[Translation] = results
        answer: dict = {"translations": [t.text for t in translations]}
        if job.decode.nbest > 1:
            answer["nbest"] = [[{"text": text, "score": score} for text, score in t.nbest] for t in translations]
        return JSONResponse(answer)

    @app.post("/score", openapi_extra=_body_schema(request_schema(limits, "score")))
    async def score(request: Request) -> JSONResponse:
        outcome = await run(request, parse_score_request)
        if isinstance(outcome, JSONResponse):
            return outcome
        _, results = outcome
        return JSONResponse({"scores": [{"score": pair.score, "log_prob": pair.log_prob, "pieces": len(pair.pieces)}
                                        for pair in results]})  # fmt: skip

    return app


def _body_schema(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _check_headers(request: Request, authorized: bool) -> None:
    """The API key (401), then a JSON body (415): a browser page may POST text/plain to a local server
    without asking the user, never application/json."""
    if not authorized:
        raise RequestError(401, "expected the header Authorization: Bearer <the server's API key>")
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise RequestError(415, f"content-type {_short(media_type or 'missing')}; expected application/json")


def _has_json_type(value: object, kind: type) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind) and not isinstance(value, bool)


def _short(value: object) -> str:
    """A value as the client sent it, cut short: an error names it without echoing a large body."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, read chunk by chunk and refused as soon as it passes `limit` (whatever Content-Length says)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise RequestError(413, f"request body of {size} bytes; at most {limit}")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise RequestError(413, f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except RecursionError:
        raise RequestError(400, "malformed JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(400, f"malformed JSON: {error}") from None


def _error(status: int, message: str, *, retry: bool = False) -> JSONResponse:
    headers = {"Retry-After": "1"} if retry else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def serve(
    model: Path | list[Path], *, host: str, port: int, limits: Limits = Limits(), api_key: str | None = None
) -> None:
    """Load the model (several checkpoints: an ensemble), then serve until SIGTERM or Ctrl-C."""
    import socket

    import uvicorn

    with socket.socket() as probe:  # a taken port is the user's to fix: one line, before loading anything
        try:
            probe.bind((host, port))
        except OSError as error:
            raise UserInputError(f"--host {host} --port {port}: cannot listen there ({error.strerror})") from None
    if api_key is None and not is_loopback(host):
        log.warning("serving on %s without an API key: anyone who reaches this address can use the model; set "
                    "--api-key or %s", host, API_KEY_VARIABLE)  # fmt: skip
    translator = Translator.load(model)
    name = " + ".join(map(str, model)) if isinstance(model, list) else str(model)
    app = create_app(translator, model_name=name, limits=limits, api_key=api_key)
    # a request admitted before SIGTERM may take up to request_timeout: shutdown waits as long for it
    uvicorn.run(app, host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=max(1, math.ceil(limits.request_timeout)))  # fmt: skip

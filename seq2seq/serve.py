"""`seq2seq serve`: an HTTP JSON translation service (FastAPI on uvicorn) over a checkpoint or exported model.

    POST /translate  {"lines": ["..."], "beam": 5, "nbest": 1, ...}  ->  {"translations": ["..."]}
    GET  /health     ->  {"status": "ok", "engine": "ctranslate2", "model": "..."}

Requests that arrive together are translated together: one worker thread takes the first waiting
request, then gathers more with the same decode settings for up to `batch_wait` seconds or until a
token budget is full, and translates them as one batch, so throughput grows with concurrency. Every
field is checked: a body that is not JSON answers 400, a request over the size limits 413, a wrong
field or value 422, each with {"error": "..."}; a failure inside translation answers 500 and the
server goes on. uvicorn stops cleanly on SIGTERM or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from seq2seq.config import DecodeConfig
from seq2seq.errors import UserInputError
from seq2seq.translator import Translation, Translator

DECODE_OPTIONS = ("beam", "nbest", "length_penalty", "length_norm", "max_len_a", "max_len_b", "min_len",
                  "no_repeat_ngram")  # fmt: skip


@dataclass(frozen=True)
class Limits:
    max_lines: int = 64  # lines per request
    max_chars: int = 2000  # characters per line
    max_body_bytes: int = 1_000_000
    batch_wait: float = 0.005  # seconds the worker waits for more requests to batch with
    max_beam: int = 16


@dataclass
class _Job:
    lines: list[str]
    decode: DecodeConfig
    future: Future = field(default_factory=Future)

    @property
    def tokens(self) -> int:
        return sum(len(line) // 4 + 2 for line in self.lines)  # a cheap estimate: ~4 characters a piece


class BatchingWorker:
    """One thread that translates queued jobs in batches of jobs with equal decode settings."""

    def __init__(self, translator: Translator, batch_wait: float) -> None:
        self.translator, self.batch_wait = translator, batch_wait
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._held: collections.deque[_Job] = collections.deque()  # other settings: next batch
        self.requests = self.batches = 0  # /health reports them: batches < requests shows batching at work
        self._thread = threading.Thread(target=self._run, name="translate-batches", daemon=True)
        self._thread.start()

    def submit(self, lines: list[str], decode: DecodeConfig) -> Future:
        job = _Job(lines, decode)
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
            self._translate(batch)
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
            if job.decode != first.decode:
                self._held.append(job)
                continue
            batch.append(job)
            tokens += job.tokens
        return batch, False

    def _translate(self, batch: list[_Job]) -> None:
        self.requests, self.batches = self.requests + len(batch), self.batches + 1
        lines = [line for job in batch for line in job.lines]
        try:
            results = self.translator.translate_with(lines, batch[0].decode)
        except Exception as error:  # the server answers 500 and goes on
            for job in batch:
                job.future.set_exception(error)
            return
        start = 0
        for job in batch:
            job.future.set_result(results[start : start + len(job.lines)])
            start += len(job.lines)


class RequestError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_request(body: object, translator: Translator, limits: Limits) -> tuple[list[str], DecodeConfig]:
    """The lines and decode settings of a /translate body, or a RequestError (413 or 422) saying what is wrong."""
    if not isinstance(body, dict):
        raise RequestError(422, 'expected a JSON object such as {"lines": ["..."]}')
    unknown = sorted(set(body) - {"lines", *DECODE_OPTIONS})
    if unknown:
        raise RequestError(422, f"unknown field(s) {', '.join(unknown)}; expected lines, {', '.join(DECODE_OPTIONS)}")
    lines = body.get("lines")
    if not isinstance(lines, list) or not all(isinstance(line, str) for line in lines):
        raise RequestError(422, "lines: expected a list of strings")
    if len(lines) > limits.max_lines:
        raise RequestError(413, f"lines: {len(lines)} lines; at most {limits.max_lines} per request")
    for index, line in enumerate(lines):
        if len(line) > limits.max_chars:
            raise RequestError(413, f"lines[{index}]: {len(line)} characters; at most {limits.max_chars} per line")
    options = {key: body[key] for key in DECODE_OPTIONS if key in body}
    for key, value in options.items():
        if isinstance(value, (dict, list)) or value is None:
            raise RequestError(422, f"{key}: expected a number or a word, got {value!r}")
    if isinstance(options.get("beam"), int) and options["beam"] > limits.max_beam:
        raise RequestError(422, f"beam: at most {limits.max_beam}")
    try:
        decode = translator.settings(**options)
    except UserInputError as error:  # lines like "--set decode.beam: decode.beam: expected ...": keep the key once
        problems = [line.split(": ", 1)[-1] for line in str(error).splitlines()]
        raise RequestError(422, "; ".join(problems)) from None
    return [line.replace("\n", " ") for line in lines], decode


def create_app(translator: Translator, *, model_name: str, limits: Limits = Limits()) -> FastAPI:
    worker: BatchingWorker | None = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal worker
        worker = BatchingWorker(translator, limits.batch_wait)
        yield
        worker.stop()

    app = FastAPI(title="seq2seq", lifespan=lifespan)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "engine": translator.engine, "model": model_name, "requests": worker.requests,
                "batches": worker.batches}  # fmt: skip

    @app.post("/translate")
    async def translate(request: Request) -> JSONResponse:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limits.max_body_bytes:
            return _error(413, f"request body of {size} bytes; at most {limits.max_body_bytes}")
        raw = await request.body()
        if len(raw) > limits.max_body_bytes:
            return _error(413, f"request body of {len(raw)} bytes; at most {limits.max_body_bytes}")
        try:
            body = _json(raw)
            lines, decode = parse_request(body, translator, limits)
        except RequestError as error:
            return _error(error.status, str(error))
        try:
            results: list[Translation] = await asyncio.wrap_future(worker.submit(lines, decode))
        except Exception as error:
            return _error(500, f"translation failed: {type(error).__name__}: {error}")
        answer: dict = {"translations": [t.text for t in results]}
        if decode.nbest > 1:
            answer["nbest"] = [[{"text": text, "score": score} for text, score in t.nbest] for t in results]
        return JSONResponse(answer)

    return app


def _json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(400, f"malformed JSON: {error}") from None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def serve(model: Path, *, host: str, port: int, limits: Limits = Limits()) -> None:
    """Load the model, then serve until SIGTERM or Ctrl-C."""
    import socket

    import uvicorn

    with socket.socket() as probe:  # a taken port is the user's to fix: one line, before loading anything
        try:
            probe.bind((host, port))
        except OSError as error:
            raise UserInputError(f"--host {host} --port {port}: cannot listen there ({error.strerror})") from None
    translator = Translator.load(model)
    app = create_app(translator, model_name=str(model), limits=limits)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=10)

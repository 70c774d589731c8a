"""`seq2seq serve`: an HTTP JSON translation service (FastAPI on uvicorn) over a checkpoint or exported model.

    POST /translate  {"lines": ["..."], "beam": 5, "nbest": 1, ...}  ->  {"translations": ["..."]}
                     optional per line: "prefixes": ["..."], "constraints": [["term", ...]]
    POST /score      {"sources": ["..."], "targets": ["..."]}  ->  {"scores": [{"score", "log_prob", "pieces"}]}
    GET  /health     ->  {"status": "ok", "engine": "ctranslate2", "model": "...", ...}

Requests that arrive together are translated together, so throughput grows with concurrency
(batching.py: one worker thread gathers requests with the same decode settings into a batch).

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
404 and 405 for a path or method without a route, each with {"error": "..."}; a failure inside
translation answers 500 without its details (they go to the server's log) and the server goes on.
uvicorn stops cleanly on SIGTERM or Ctrl-C, after the requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import ipaddress
import json
import logging
import math
import signal
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from seq2seq.deploy.batching import BatchingWorker
from seq2seq.deploy.requests import (
    Job,
    Limits,
    RequestError,
    parse_request,
    parse_score_request,
    request_schema,
    shortened,
    shortened_name,
)
from seq2seq.errors import UserInputError
from seq2seq.inference.engine import DeadlinePassed, PairScore, Translation
from seq2seq.inference.translator import Translator

log = logging.getLogger(__name__)

API_KEY_VARIABLE = "SEQ2SEQ_API_KEY"


class Service:
    """What the routes share: the translator, the limits, the key and the batching worker (started
    with the app)."""

    def __init__(self, translator: Translator, model_name: str, limits: Limits, api_key: str | None) -> None:
        self.translator, self.model_name, self.limits, self.api_key = translator, model_name, limits, api_key
        self.worker: BatchingWorker | None = None

    def authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    def health(self, request: Request) -> dict:
        if not self.authorized(request):
            return {"status": "ok"}
        worker = self.worker
        return {
            "status": "ok",
            "engine": self.translator.engine,
            "model": self.model_name,
            "requests": worker.requests,
            "batches": worker.batches,
            "waiting": worker.waiting,
        }

    async def run(self, request: Request, parse) -> tuple[Job, list] | JSONResponse:
        """Check, read and queue a request, and wait for its results (or the error response)."""
        limits = self.limits
        try:
            _check_headers(request, self.authorized(request))
            job = parse(_json(await _read_body(request, limits.max_body_bytes)), self.translator, limits)
            job.deadline = time.monotonic() + limits.request_timeout
            future = self.worker.submit(job)
        except RequestError as error:
            return _error(error.status, str(error), retry=error.status == 503)
        try:
            return job, await asyncio.wait_for(asyncio.wrap_future(future), limits.request_timeout)
        except (asyncio.TimeoutError, DeadlinePassed):  # the worker skips it, or stops it within a step
            message = f"the request took over {limits.request_timeout:g} s; try fewer or shorter lines"
            return _error(503, message, retry=True)
        except Exception:  # the worker logged the details; they never go to the client
            work = "translation" if job.kind == "translate" else "scoring"
            return _error(500, f"{work} failed; the server's log has the details")


def create_app(
    translator: Translator, *, model_name: str, limits: Limits = Limits(), api_key: str | None = None
) -> FastAPI:
    """The service; with `api_key`, every request must carry `Authorization: Bearer <api_key>` (a
    request without it learns only that the server is up, from /health)."""
    service = Service(translator, model_name, limits, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.worker = BatchingWorker(translator, limits.batch_wait, limits.max_queue)
        yield
        service.worker.stop()

    app = FastAPI(title="seq2seq", version=importlib.metadata.version("seq2seq"), lifespan=lifespan)
    app.add_exception_handler(StarletteHTTPException, _routing_error)

    @app.get("/health")
    async def health(request: Request) -> dict:
        return service.health(request)

    @app.post("/translate", openapi_extra=_body_schema(request_schema(limits, "translate")))
    async def translate(request: Request) -> JSONResponse:
        outcome = await service.run(request, parse_request)
        return outcome if isinstance(outcome, JSONResponse) else JSONResponse(_translations(*outcome))

    @app.post("/score", openapi_extra=_body_schema(request_schema(limits, "score")))
    async def score(request: Request) -> JSONResponse:
        outcome = await service.run(request, parse_score_request)
        return outcome if isinstance(outcome, JSONResponse) else JSONResponse(_scores(outcome[1]))

    return app


def _translations(job: Job, results: list[Translation]) -> dict:
    answer: dict = {"translations": [t.text for t in results]}
    if job.decode.nbest > 1:
        answer["nbest"] = [[{"text": text, "score": score} for text, score in t.nbest] for t in results]
    return answer


def _scores(results: list[PairScore]) -> dict:
    return {
        "scores": [{"score": pair.score, "log_prob": pair.log_prob, "pieces": len(pair.pieces)} for pair in results]
    }


def _body_schema(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _check_headers(request: Request, authorized: bool) -> None:
    """The API key (401), then a JSON body (415): a browser page may POST text/plain to a local server
    without asking the user, never application/json."""
    if not authorized:
        raise RequestError(401, "expected the header Authorization: Bearer <the server's API key>")
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise RequestError(415, f"content-type {shortened(media_type or 'missing')}; expected application/json")
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":  # read as it stands, a gzip body was "not UTF-8", and a plain one served as if
        raise RequestError(415, f"content-encoding {shortened(encoding)}; expected an uncompressed body")


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
    """The body parsed, or a 400 that says what in it is not JSON, in the client's terms (never
    Python's advice, such as its digit limit's sys.set_int_max_str_digits). JSON's escapes can spell
    a lone surrogate (\\ud800), a string that UTF-8 cannot carry: SentencePiece, and an answer that
    names it, would fail on it; writing the body out again in UTF-8 finds one in any value or key."""
    try:
        body = json.loads(raw.decode("utf-8"), object_pairs_hook=_once_each, parse_constant=_not_a_json_number)
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except RecursionError:
        raise RequestError(400, "malformed JSON: nested too deeply") from None
    except UnicodeEncodeError:
        raise RequestError(
            400,
            "malformed JSON: a string holds a lone surrogate (such as \\ud800); expected Unicode text, "
            "surrogates only in pairs",
        ) from None
    except UnicodeDecodeError as error:
        raise RequestError(400, f"malformed JSON: byte {error.start} is not UTF-8; expected UTF-8 text") from None
    except json.JSONDecodeError as error:  # its message names what it expected, and where
        raise RequestError(400, f"malformed JSON: {error}") from None
    except ValueError:  # Python's limit on an integer's digits
        raise RequestError(400, "malformed JSON: a number with too many digits to read") from None
    return body


def _not_a_json_number(constant: str) -> float:
    """Python's parser reads NaN, Infinity and -Infinity, which JSON has no place for."""
    raise RequestError(400, f"malformed JSON: {constant} is not a JSON number")


def _once_each(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object whose keys are all different: with `"beam": 5, "beam": 1` the parser would keep
    the last without a word, and the client would not get what it asked for."""
    fields: dict[str, object] = {}
    for key, value in pairs:
        if key in fields:
            raise RequestError(422, f"{shortened_name(key)}: given twice; expected each field once")
        fields[key] = value
    return fields


ROUTES = "POST /translate, POST /score or GET /health"


async def _routing_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """A path or method the server has no route for, answered as every other error ({"error": ...},
    where FastAPI says {"detail": ...}), naming the routes there are."""
    asked = f"{request.method} {shortened(request.url.path)}"
    if error.status_code == 404:
        message = f"no route for {asked}; expected {ROUTES}"
    elif error.status_code == 405:
        allowed = {name.lower(): value for name, value in (error.headers or {}).items()}.get("allow", "another")
        message = f"{asked}: method not allowed; expected {allowed}"
    else:
        message = f"{asked}: {error.detail}"
    return JSONResponse({"error": message}, status_code=error.status_code, headers=error.headers)


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
    model: Path | list[Path],
    *,
    host: str,
    port: int,
    limits: Limits = Limits(),
    api_key: str | None = None,
    shortlist: Path | None = None,
    device: str | None = None,
) -> None:
    """Load the model (several checkpoints: an ensemble; `shortlist` and `device`: Translator.load's),
    then serve until SIGTERM or Ctrl-C."""
    import socket

    import uvicorn

    with socket.socket() as probe:  # a taken port is the user's to fix: one line, before loading anything
        try:
            probe.bind((host, port))
        except OSError as error:
            raise UserInputError(f"--host {host} --port {port}: cannot listen there ({error.strerror})") from None
    if api_key is None and not is_loopback(host):
        log.warning(
            "serving on %s without an API key: anyone who reaches this address can use the model; set --api-key or %s",
            host,
            API_KEY_VARIABLE,
        )
    translator = Translator.load(model, shortlist=shortlist, device=device)
    name = " + ".join(map(str, model)) if isinstance(model, list) else str(model)
    app = create_app(translator, model_name=name, limits=limits, api_key=api_key)
    # uvicorn catches SIGTERM for its graceful shutdown and raises it again when done: with the default
    # action the process then ends as a stopped server, not as an interrupted command (cli.boundary)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # a request admitted before SIGTERM may take up to request_timeout: shutdown waits as long for it
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=max(1, math.ceil(limits.request_timeout)),
    )

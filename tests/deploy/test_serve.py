"""The HTTP server, started for real on 127.0.0.1 and called with a real client: translations equal the
Python API's, concurrent requests are batched, bad requests get JSON errors, SIGTERM stops it cleanly."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx", reason="optional extra: pip install -e '.[serve]' (included in [dev])")
pytest.importorskip("fastapi", reason="optional extra: pip install -e '.[serve]' (included in [dev])")

from seq2seq.inference.engine import Translation  # noqa: E402
from seq2seq.inference.translator import Translator  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def server(trained_checkpoint):
    path, data = trained_checkpoint
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "seq2seq",
            "serve",
            str(path),
            "--port",
            str(port),
            "--max-lines",
            "8",
            "--max-chars",
            "300",
            "--batch-wait-ms",
            "50",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while True:
        assert process.poll() is None, process.stderr.read().decode()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server did not come up"
        time.sleep(0.2)
    yield url, process, path, data
    if process.poll() is None:
        process.kill()


def test_translations_equal_the_python_api(server):
    url, _, path, data = server
    lines = (data / "test.en").read_text().splitlines()[:6]
    response = httpx.post(f"{url}/translate", json={"lines": lines, "beam": 2}, timeout=60)
    assert response.status_code == 200
    assert response.json()["translations"] == Translator.load(path, device="cpu").translate(lines, beam=2)
    nbest = httpx.post(f"{url}/translate", json={"lines": lines[:2], "beam": 3, "nbest": 2}, timeout=60).json()
    assert [len(options) for options in nbest["nbest"]] == [2, 2]
    sampled = {"lines": lines[:2], "sample": True, "nbest": 3, "temperature": 0.8, "seed": 5}
    answer = httpx.post(f"{url}/translate", json=sampled, timeout=60).json()
    expected = Translator.load(path, device="cpu").translate_nbest(lines[:2], sample=True, nbest=3, temperature=0.8,
                                                                    seed=5)  # fmt: skip
    assert [[option["text"] for option in options] for options in answer["nbest"]] == [
        [text for text, _ in t.nbest] for t in expected
    ]  # the same seed, lines and settings: the same samples (scores equal up to float rounding)


def test_prefixes_constraints_and_scores_equal_the_python_api(server):
    url, _, path, data = server
    lines = (data / "test.en").read_text().splitlines()[:4]
    references = (data / "test.xx").read_text().splitlines()[:4]
    translator = Translator.load(path, device="cpu")
    prefixes, constraints = ["la", "", "il", ""], [["mofosa"], [], [], ["nugati", "zucatar"]]
    body = {"lines": lines, "beam": 3, "prefixes": prefixes, "constraints": constraints}
    answer = httpx.post(f"{url}/translate", json=body, timeout=60).json()
    assert answer["translations"] == translator.translate(lines, beam=3, prefixes=prefixes, constraints=constraints)
    assert all(term in text.split() for text, terms in zip(answer["translations"], constraints) for term in terms)
    scores = httpx.post(f"{url}/score", json={"sources": lines, "targets": references}, timeout=60).json()["scores"]
    expected = translator.score(lines, references)
    assert [s["log_prob"] for s in scores] == [pytest.approx(e.log_prob, abs=1e-4) for e in expected]
    assert [s["pieces"] for s in scores] == [len(e.pieces) for e in expected]
    short = httpx.post(f"{url}/score", json={"sources": lines, "targets": references[:3]}, timeout=60)
    assert short.status_code == 422 and "targets: 3 given; expected one per line (4)" in short.json()["error"]
    unknown = httpx.post(f"{url}/score", json={"sources": lines, "targets": references, "lines": []}, timeout=60)
    assert unknown.status_code == 422 and "unknown field(s) lines" in unknown.json()["error"]
    unread = httpx.post(f"{url}/score", json={"sources": lines, "targets": references, "temperature": 0.5}, timeout=60)
    assert unread.status_code == 422  # a temperature changes no score: answering it as if it did would mislead
    assert unread.json()["error"].startswith("unknown field(s) temperature; expected length_norm, length_penalty")
    raw = httpx.post(f"{url}/score", json={"sources": lines, "targets": references, "length_norm": "none"}, timeout=60)
    assert [s["score"] for s in raw.json()["scores"]] == [s["log_prob"] for s in scores]
    long = httpx.post(f"{url}/score", json={"sources": lines[:1], "targets": ["\ufdfa" * 300]}, timeout=60)
    assert long.status_code == 413 and "targets[0]: " in long.json()["error"]
    assert "pieces with its end; at most 256 per line" in long.json()["error"]


class Gate:
    """An engine whose first call waits, once inside, until the test opens the gate: requests sent
    meanwhile queue up behind it, so a test knows what the worker will batch (events, not sleeps)."""

    def __init__(self, engine) -> None:
        self.engine, self.entered, self.opened, self.calls = engine, threading.Event(), threading.Event(), []
        for name in ("name", "title", "instead", "constrained_search", "max_positions", "source_model", "target_model"):
            setattr(self, name, getattr(engine, name))

    def translate(self, lines, *args, **kwargs):
        self.calls.append(list(lines))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.opened.wait(timeout=60)
        return self.engine.translate(lines, *args, **kwargs)

    def score(self, *args, **kwargs):
        return self.engine.score(*args, **kwargs)


def wait_until_waiting(client, count: int) -> None:
    """Until `count` requests sit in the server's queue (its /health says so)."""
    deadline = time.monotonic() + 60
    while client.get("/health").json()["waiting"] < count:
        assert time.monotonic() < deadline, "the requests never reached the queue"
        time.sleep(0.01)


def gated_client(translator: Translator, **limits):
    from fastapi.testclient import TestClient

    from seq2seq.deploy.requests import Limits
    from seq2seq.deploy.serve import create_app

    gate = Gate(translator._engine)
    gated = Translator(translator.decode, gate)
    return gate, TestClient(create_app(gated, model_name="gated", limits=Limits(**{"batch_wait": 1.0, **limits})))


def test_requests_that_wait_together_are_batched_and_each_gets_its_own_answer(trained_checkpoint):
    """While a first request holds the worker, 11 more queue up; the worker then takes them as one
    batch, and each client gets its own line's translation, as the Python API gives it."""
    path, data = trained_checkpoint
    translator = Translator.load(path, device="cpu")
    lines = (data / "test.en").read_text().splitlines()[:12]
    gate, client = gated_client(translator)
    with client, ThreadPoolExecutor(max_workers=12) as pool:
        first = pool.submit(client.post, "/translate", json={"lines": [lines[0]], "beam": 1})
        assert gate.entered.wait(timeout=60)
        rest = [pool.submit(client.post, "/translate", json={"lines": [line], "beam": 1}) for line in lines[1:]]
        wait_until_waiting(client, 11)
        gate.opened.set()
        answers = [future.result(timeout=60).json()["translations"][0] for future in [first, *rest]]
        health = client.get("/health").json()
    assert answers == translator.translate(lines, beam=1)
    assert sorted(map(len, gate.calls)) == [1, 11] and (health["requests"], health["batches"]) == (12, 2)


def test_a_lines_samples_are_the_same_alone_or_batched_with_another_clients(trained_checkpoint):
    """The sampling contract at the server: a line draws by the seed and its index in its request,
    so another client's request in the same batch changes nothing."""
    path, data = trained_checkpoint
    translator = Translator.load(path, device="cpu")
    lines = (data / "test.en").read_text().splitlines()[:3]
    sampled = {"sample": True, "nbest": 4, "seed": 11}
    gate, client = gated_client(translator)
    with client, ThreadPoolExecutor(max_workers=3) as pool:
        blocker = pool.submit(client.post, "/translate", json={"lines": ["the dog"], "beam": 1})
        assert gate.entered.wait(timeout=60)
        mine = pool.submit(client.post, "/translate", json={"lines": lines[:1], **sampled})
        theirs = pool.submit(client.post, "/translate", json={"lines": lines[1:], **sampled})
        wait_until_waiting(client, 2)
        gate.opened.set()
        answers = [future.result(timeout=60).json() for future in (blocker, mine, theirs)]
    assert sorted(gate.calls[1]) == sorted(lines)  # both clients' lines in one batch
    for answer, own in zip(answers[1:], (lines[:1], lines[1:])):
        alone = translator.translate_nbest(own, **sampled)  # each request's lines by themselves
        assert [[option["text"] for option in options] for options in answer["nbest"]] == [
            [text for text, _ in t.nbest] for t in alone
        ]


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b'{"lines": ["a"', 400, "malformed JSON"),
        (b"\xff\xfe", 400, "malformed JSON: byte 0 is not UTF-8; expected UTF-8 text"),
        # Python's parser reads NaN and Infinity, and refuses an integer of over 4,300 digits with advice
        # on its own settings; a client is told what in its body is not JSON
        (b'{"lines": ["a"], "length_penalty": NaN}', 400, "malformed JSON: NaN is not a JSON number"),
        (b'{"lines": ["a"], "max_len_a": -Infinity}', 400, "malformed JSON: -Infinity is not a JSON number"),
        (b'{"lines": ["a"], "beam": 1' + b"0" * 5000 + b"}", 400, "malformed JSON: a number with too many digits"),
        # JSON escapes lone surrogates (\ud800) into strings that UTF-8 cannot carry, in a value or a key
        (b'{"lines": ["the \\ud800 cat"]}', 400, "malformed JSON: a string holds a lone surrogate"),
        (b'{"lines": ["a"], "\\udc80": 1}', 400, "malformed JSON: a string holds a lone surrogate"),
        (json.dumps({"lines": ["a"] * 9}).encode(), 413, "9 lines; at most 8 per request"),
        (json.dumps({"lines": ["a" * 301]}).encode(), 413, "lines[0]: 301 characters; at most 300"),
        (json.dumps({"lines": "a"}).encode(), 422, "lines: expected a list of strings"),
        (json.dumps(["a"]).encode(), 422, "expected a JSON object"),
        (json.dumps({"lines": ["a"], "beem": 2}).encode(), 422, "unknown field(s) beem"),
        # JSON parsers keep the last of a repeated key: the client would get beam 1, not what it meant
        (b'{"lines": ["a"], "beam": 5, "beam": 1}', 422, "beam: given twice; expected each field once"),
        (
            json.dumps({"lines": ["a"], **{f"k{i}": 1 for i in range(10_000)}}).encode(),
            422,
            "k100, k1000 and 9,995 more;",
        ),
        (json.dumps({"lines": ["a"], "beam": "wide"}).encode(), 422, "beam: expected an integer"),
        (json.dumps({"lines": ["a"], "beam": 1000}).encode(), 422, "beam: at most 16"),
        (b'{"lines": ["a"], "beam": 1' + b"0" * 4000 + b"}", 422, "on this server, got 1" + "0" * 36 + "..."),
        (b'{"lines": ["a"], "seed": -1' + b"0" * 4000 + b"}", 422, "a 64-bit integer, got -1" + "0" * 35 + "..."),
        # a number is a JSON number: strings that YAML would have parsed (1000, 0x10) are refused
        (json.dumps({"lines": ["a"], "beam": "1000"}).encode(), 422, 'beam: expected an integer, got "1000"'),
        (json.dumps({"lines": ["a"], "beam": "0x10"}).encode(), 422, 'beam: expected an integer, got "0x10"'),
        (json.dumps({"lines": ["a"], "beam": True}).encode(), 422, "beam: expected an integer, got true"),
        (json.dumps({"lines": ["a"], "length_penalty": "0.5"}).encode(), 422, "length_penalty: expected a number"),
        (json.dumps({"lines": ["a"], "max_len_a": 1e6}).encode(), 422, "max_len_a: at most 4.0 on this server"),
        (json.dumps({"lines": ["a"], "max_len_b": 100000}).encode(), 422, "max_len_b: at most 256 on this server"),
        (json.dumps({"lines": ["a"], "no_repeat_ngram": 50}).encode(), 422, "no_repeat_ngram: at most 8"),
        (json.dumps({"lines": ["a"], "patience": 100}).encode(), 422, "patience: at most 4.0 on this server"),
        (json.dumps({"lines": ["a"], "beam": 2, "nbest": 3}).encode(), 422, "nbest: expected at most beam (2)"),
        (json.dumps({"lines": ["a"], "min_len": 200}).encode(), 422, "min_len: expected at most the length limit"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "malformed JSON: nested too deeply"),
        (json.dumps({"lines": ["a"], "sample": "yes"}).encode(), 422, "sample: expected true or false"),
        (json.dumps({"lines": ["a"], "sample": True, "nbest": 17}).encode(), 422, "nbest: at most 16 on this server"),
        (json.dumps({"lines": ["a"], "sample": True, "top_p": 0}).encode(), 422, "top_p: expected a number in (0, 1]"),
        (json.dumps({"lines": ["a", "b"], "prefixes": ["x"]}).encode(), 422, "prefixes: 1 given; expected one per"),
        (json.dumps({"lines": ["a"], "prefixes": [3]}).encode(), 422, "prefixes: expected a list of strings"),
        (json.dumps({"lines": ["a"], "prefixes": ["x" * 301]}).encode(), 413, "prefixes[0]: 301 characters"),
        (json.dumps({"lines": ["a"], "constraints": ["x"]}).encode(), 422, "constraints: expected a list (one per"),
        (json.dumps({"lines": ["a"], "constraints": [["t"] * 9]}).encode(), 413, "constraints[0]: 9 terms; at most 8"),
        (json.dumps({"lines": ["a"], "constraints": [["x" * 200, "y" * 200]]}).encode(), 413, "over 300 characters"),
        (json.dumps({"lines": ["a"], "constraints": [["t"]], "sample": True}).encode(), 422, "need beam search"),
        # sampling seeds are 32-bit everywhere (NumPy's and CTranslate2's generators take no more)
        (json.dumps({"lines": ["a"], "sample": True, "seed": -1}).encode(), 422, "seed: expected an integer in [0, "),
        (json.dumps({"lines": ["a"], "seed": 2**32}).encode(), 422, "seed: expected an integer in [0, 4294967296)"),
        # pieces are counted after SentencePiece: 300 characters may be 1,800 pieces
        (json.dumps({"lines": ["\ufdfa" * 300]}).encode(), 413, "pieces with its end; at most 256 per line"),
        # each field within its cap, their product not: 8 lines x beam 16 x a limit of 4 x source + 256
        (
            json.dumps(
                {"lines": ["the cat sleeps on the mat " * 10] * 8, "beam": 16, "max_len_a": 4.0, "max_len_b": 256}
            ).encode(),
            413,
            "the request's work, ",
        ),  # fmt: skip
        (
            json.dumps({"lines": ["a", "b"], "prefixes": ["", "la \ua66e"]}).encode(),
            422,
            "prefixes[1]: 'la ꙮ' has characters the target vocabulary cannot spell",
        ),  # fmt: skip
        (json.dumps({"lines": ["a"], "constraints": [["\ua66e"]]}).encode(), 422, "constraints[0]: 'ꙮ' has characters"),
    ],
)
def test_bad_requests_get_a_json_error_and_the_server_lives_on(server, body, status, fragment):
    url, process, _, _ = server
    response = httpx.post(f"{url}/translate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status and fragment in response.json()["error"]
    assert process.poll() is None and httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"beam": 0}, "beam: expected an integer in [1, 256], got 0"),
        ({"beam": 2, "nbest": 3}, "nbest: expected at most beam (2), got 3"),
    ],
)
def test_a_value_the_model_refuses_is_named_by_its_request_field(server, fields, error):
    """A client sends `beam`, not the config's `decode.beam`: the error names what it sent."""
    url, _, _, _ = server
    response = httpx.post(f"{url}/translate", json={"lines": ["a"], **fields})
    assert response.status_code == 422 and response.json()["error"] == error


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server):
    """Without Content-Length (chunked transfer) the body is counted while it is read."""
    url, process, _, _ = server

    def chunks():
        yield b'{"lines": ["'
        for _ in range(1100):
            yield b"a" * 1000
        yield b'"]}'

    response = httpx.post(f"{url}/translate", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413 and "request body over 1000000 bytes" in response.json()["error"]
    assert process.poll() is None and httpx.get(f"{url}/health").status_code == 200


GATED_SERVE = """
import pathlib, sys, time
from seq2seq.inference import pytorch_engine
real, gate = pytorch_engine.PyTorchEngine.translate, pathlib.Path(sys.argv[1])
def gated(self, *args, **kwargs):  # tell the test the request is in translation, then wait for its word
    (gate / "entered").touch()
    while not (gate / "open").exists():
        time.sleep(0.01)
    return real(self, *args, **kwargs)
pytorch_engine.PyTorchEngine.translate = gated
from seq2seq.cli.main import main
sys.argv = ["seq2seq", "serve", *sys.argv[2:]]
main()
"""


def wait_for_file(path, process) -> None:
    deadline = time.monotonic() + 90
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()
        time.sleep(0.01)


def test_sigterm_stops_the_server_cleanly_after_the_request_in_flight(trained_checkpoint, tmp_path):
    """The server's translation is held until SIGTERM has been sent (files as events between the
    processes): the request in flight is still answered, then the server exits cleanly."""
    path, data = trained_checkpoint
    port = free_port()
    process = subprocess.Popen([sys.executable, "-c", GATED_SERVE, str(tmp_path), str(path), "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read().decode()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.1)
        lines = (data / "test.en").read_text().splitlines()[:4]
        with ThreadPoolExecutor(max_workers=1) as pool:
            in_flight = pool.submit(httpx.post, f"{url}/translate", json={"lines": lines, "beam": 2}, timeout=90)
            wait_for_file(tmp_path / "entered", process)
            process.send_signal(signal.SIGTERM)
            (tmp_path / "open").touch()  # only now may the translation go on
            response = in_flight.result()
        assert response.status_code == 200
        assert response.json()["translations"] == Translator.load(path, device="cpu").translate(lines, beam=2)
        # uvicorn re-raises the signal once shut down, so the exit status says "ended by SIGTERM"
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Traceback" not in process.stderr.read().decode()
    finally:
        if process.poll() is None:
            process.kill()


class WordPieces:
    """A stand-in for a SentencePiece model: one piece per word, the unknown piece for a word with a digit."""

    def encode(self, texts, add_eos: bool = False, out_type=int):
        def ids(text):
            return [1 if any(c.isdigit() for c in word) else 4 for word in text.split()] + [3] * add_eos

        return ids(texts) if isinstance(texts, str) else [ids(text) for text in texts]

    def unk_id(self) -> int:
        return 1


class StalledEngine:
    """An engine that waits for `release` (a request in flight as long as a test wants) or fails."""

    name, title, instead, constrained_search, max_positions = "stalled", "a stalled engine", "", True, None
    source_model = target_model = WordPieces()

    def __init__(self, *, fail: bool = False) -> None:
        self.release, self.entered, self.fail, self.calls = threading.Event(), threading.Event(), fail, 0

    def translate(self, lines, decode, **guidance):
        self.calls += 1
        self.entered.set()
        if self.fail:
            raise RuntimeError("/secret/internal/path.py line 7: tensor shape mismatch")
        self.release.wait(timeout=30)
        return [Translation([(line.upper(), 0.0)]) for line in lines]


def app_client(engine, *, api_key: str | None = None, **limits):
    from fastapi.testclient import TestClient

    from seq2seq.config import DecodeConfig
    from seq2seq.deploy.requests import Limits
    from seq2seq.deploy.serve import create_app

    translator = Translator(DecodeConfig(beam=2), engine)
    return TestClient(create_app(translator, model_name="stalled", limits=Limits(**limits), api_key=api_key))


def test_a_full_queue_answers_503_and_a_request_that_timed_out_keeps_its_place_until_let_go():
    """max_queue counts requests until the worker has let them go: a request whose client timed out
    while it waited in the queue still holds its place, so the bound holds while the worker is stuck."""
    engine = StalledEngine()
    with (
        app_client(engine, max_queue=2, request_timeout=0.5, batch_wait=0.0) as client,
        ThreadPoolExecutor(max_workers=2) as pool,
    ):
        first = pool.submit(client.post, "/translate", json={"lines": ["a"]})
        assert engine.entered.wait(timeout=30)  # the first request is being translated, the worker is stuck
        queued = pool.submit(client.post, "/translate", json={"lines": ["b"], "beam": 1})
        for late in (first.result(timeout=30), queued.result(timeout=30)):
            assert late.status_code == 503 and "took over 0.5 s" in late.json()["error"]
        busy = client.post("/translate", json={"lines": ["c"]})
        assert busy.status_code == 503 and "busy (2 requests open)" in busy.json()["error"]
        assert busy.headers["retry-after"] == "1"
        engine.release.set()
        deadline = time.monotonic() + 30  # the stalled job ends, the timed-out one is dropped: both places free
        while (answer := client.post("/translate", json={"lines": ["c"]})).status_code == 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert answer.status_code == 200 and answer.json()["translations"] == ["C"]
        assert engine.calls == 2  # "a", then "c": "b" was never translated


class SteppingModel:
    """Our model on a fake clock: each decoder step takes one 'second'."""

    def __init__(self, model, clock: list[float]) -> None:
        self.model, self.clock, self.steps = model, clock, 0

    def parameters(self):
        return self.model.parameters()

    def encode(self, src, src_mask):
        return self.model.encode(src, src_mask)

    def new_cache(self):
        return self.model.new_cache()

    def decode(self, tgt, memory, src_mask, cache):
        self.steps += 1
        self.clock[0] += 1.0
        return self.model.decode(tgt, memory, src_mask, cache)


def test_a_request_past_its_timeout_stops_within_one_step_and_frees_the_worker(trained_checkpoint, monkeypatch):
    """--timeout 5 on a clock where each decoder step takes a second: the search stops at its sixth
    step (the one after the deadline is never taken), the client gets 503, and the worker takes the
    next request at once."""
    from seq2seq.checkpoint import load_for_inference
    from seq2seq.deploy import serve as serve_module
    from seq2seq.inference import search_steps

    clock = [0.0]
    fake_time = types.SimpleNamespace(monotonic=lambda: clock[0])
    monkeypatch.setattr(serve_module, "time", fake_time)
    monkeypatch.setattr(search_steps, "time", fake_time)
    bundle = load_for_inference(trained_checkpoint[0], "cpu")
    model = SteppingModel(bundle.model, clock)
    translator = Translator.from_model(model, bundle.tokenizer, bundle.config.decode)
    long_search = {"lines": ["the cat sleeps"], "beam": 4, "min_len": 50, "max_len_a": 0.0, "max_len_b": 60}
    with app_client(translator._engine, request_timeout=5.0) as client:
        late = client.post("/translate", json=long_search)
        assert late.status_code == 503 and "took over 5 s" in late.json()["error"]
        assert model.steps == 6  # at 0, 1, ..., 5 'seconds'; not at 6, past the deadline
        short = client.post("/translate", json={"lines": ["the cat sleeps"], "beam": 1, "max_len_a": 0.0,
                                                "max_len_b": 3})  # fmt: skip
        assert short.status_code == 200 and short.json()["translations"][0]


def test_a_failure_inside_translation_is_a_500_that_echoes_nothing_internal(capfd):
    with app_client(StalledEngine(fail=True)) as client:
        response = client.post("/translate", json={"lines": ["a"]})
        assert response.status_code == 500
        assert response.json() == {"error": "translation failed; the server's log has the details"}
        assert client.get("/health").status_code == 200
    assert "/secret/internal/path.py" in capfd.readouterr().err  # the server's log has it


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_a_json_body_is_accepted(content_type):
    """A web page may POST text/plain or a form to a local server without asking the user (no CORS
    preflight); a JSON body it cannot send that way."""
    engine = StalledEngine()
    engine.release.set()
    with app_client(engine) as client:
        headers = {"content-type": content_type} if content_type else {}
        response = client.post("/translate", content=b'{"lines": ["a"]}', headers=headers)
        assert response.status_code == 415 and "expected application/json" in response.json()["error"]
        assert engine.calls == 0
        assert client.post("/translate", json={"lines": ["a"]}).status_code == 200
        charset = client.post("/translate", content=b'{"lines": ["a"]}',
                              headers={"content-type": "application/json; charset=utf-8"})  # fmt: skip
        assert charset.status_code == 200


def test_a_compressed_body_is_refused_by_its_content_encoding():
    """The server reads bodies as they stand: a gzip body was called malformed JSON ("not UTF-8"), and a
    plain body under a gzip header was served as if the header were not there."""
    engine = StalledEngine()
    engine.release.set()
    body = b'{"lines": ["a"]}'
    with app_client(engine) as client:
        for content in (gzip.compress(body), body):
            headers = {"content-type": "application/json", "content-encoding": "gzip"}
            response = client.post("/translate", content=content, headers=headers)
            assert response.status_code == 415
            assert response.json()["error"] == 'content-encoding "gzip"; expected an uncompressed body'
        assert engine.calls == 0
        identity = {"content-type": "application/json", "content-encoding": "identity"}
        assert client.post("/translate", content=body, headers=identity).status_code == 200


def test_a_path_or_method_without_a_route_is_an_error_like_every_other():
    """A client reads {"error": ...} from every answer that is not a 200: FastAPI's own 404 and 405
    said {"detail": "Not Found"}, in another field and without naming the routes there are."""
    from importlib.metadata import version

    with app_client(StalledEngine()) as client:
        missing = client.post("/translation", json={"lines": ["a"]})
        assert missing.status_code == 404
        assert missing.json() == {"error": "no route for POST \"/translation\"; expected POST /translate, POST /score "
                                           "or GET /health"}  # fmt: skip
        wrong_method = client.get("/translate")
        assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
        assert wrong_method.json() == {"error": 'GET "/translate": method not allowed; expected POST'}
        assert client.get("/openapi.json").json()["info"]["version"] == version("seq2seq")


def test_an_api_key_is_required_when_set_and_health_tells_strangers_nothing():
    engine = StalledEngine()
    engine.release.set()
    with app_client(engine, api_key="s3cret") as client:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            response = client.post("/translate", json={"lines": ["a"]}, headers=headers)
            assert response.status_code == 401 and "Authorization: Bearer" in response.json()["error"]
            assert "s3cret" not in response.text
        assert engine.calls == 0 and client.get("/health").json() == {"status": "ok"}
        key = {"authorization": "Bearer s3cret"}
        assert client.post("/translate", json={"lines": ["a"]}, headers=key).json() == {"translations": ["A"]}
        assert client.get("/health", headers=key).json()["engine"] == "stalled"


def test_serving_beyond_loopback_without_a_key_warns(monkeypatch, caplog, trained_checkpoint):
    import uvicorn

    from seq2seq.deploy import serve as serve_module

    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: served.append(options["host"]))
    with caplog.at_level(logging.WARNING, logger="seq2seq.deploy.serve"):
        serve_module.serve(trained_checkpoint[0], host="127.0.0.1", port=free_port())
        assert not caplog.records
        serve_module.serve(trained_checkpoint[0], host="0.0.0.0", port=free_port(), api_key="s3cret")
        assert not caplog.records
        serve_module.serve(trained_checkpoint[0], host="0.0.0.0", port=free_port())
    assert served == ["127.0.0.1", "0.0.0.0", "0.0.0.0"]
    assert [r.getMessage() for r in caplog.records] == [
        "serving on 0.0.0.0 without an API key: anyone who reaches this address can use the model; set --api-key "
        "or SEQ2SEQ_API_KEY"
    ]

"""The HTTP server, started for real on 127.0.0.1 and called with a real client: translations equal the
Python API's, concurrent requests are batched, bad requests get JSON errors, SIGTERM stops it cleanly."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
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


def test_concurrent_requests_are_batched_and_each_gets_its_own_answer(server):
    url, _, path, data = server
    lines = (data / "test.en").read_text().splitlines()[:24]
    expected = Translator.load(path, device="cpu").translate(lines, beam=1)
    before = httpx.get(f"{url}/health").json()

    def one(index: int) -> list[str]:
        response = httpx.post(f"{url}/translate", json={"lines": [lines[index]], "beam": 1}, timeout=60)
        return response.json()["translations"]

    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(one, range(len(lines))))
    assert [answer[0] for answer in answers] == expected
    after = httpx.get(f"{url}/health").json()
    requests, batches = after["requests"] - before["requests"], after["batches"] - before["batches"]
    assert requests == len(lines) and batches < requests  # several requests shared a batch


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b'{"lines": ["a"', 400, "malformed JSON"),
        (b"\xff\xfe", 400, "malformed JSON"),
        (json.dumps({"lines": ["a"] * 9}).encode(), 413, "9 lines; at most 8 per request"),
        (json.dumps({"lines": ["a" * 301]}).encode(), 413, "lines[0]: 301 characters; at most 300"),
        (json.dumps({"lines": "a"}).encode(), 422, "lines: expected a list of strings"),
        (json.dumps(["a"]).encode(), 422, "expected a JSON object"),
        (json.dumps({"lines": ["a"], "beem": 2}).encode(), 422, "unknown field(s) beem"),
        (json.dumps({"lines": ["a"], "beam": "wide"}).encode(), 422, "beam: expected an integer"),
        (json.dumps({"lines": ["a"], "beam": 1000}).encode(), 422, "beam: at most 16"),
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
    ],
)
def test_bad_requests_get_a_json_error_and_the_server_lives_on(server, body, status, fragment):
    url, process, _, _ = server
    response = httpx.post(f"{url}/translate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status and fragment in response.json()["error"]
    assert process.poll() is None and httpx.get(f"{url}/health").status_code == 200


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


def test_sigterm_stops_the_server_cleanly_after_the_request_in_flight(server):
    url, process, _, data = server
    lines = (data / "test.en").read_text().splitlines()[:8]
    heavy = {"lines": lines, "beam": 16, "max_len_a": 4.0, "max_len_b": 256}  # seconds of work
    before = httpx.get(f"{url}/health").json()["requests"]
    with ThreadPoolExecutor(max_workers=1) as pool:
        in_flight = pool.submit(lambda: (httpx.post(f"{url}/translate", json=heavy, timeout=60), time.monotonic()))
        deadline = time.time() + 30
        while httpx.get(f"{url}/health").json()["requests"] == before:  # its translation has begun
            assert time.time() < deadline and not in_flight.done()
            time.sleep(0.01)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        response, answered = in_flight.result()
        assert response.status_code == 200 and answered > signalled  # in flight at SIGTERM, answered after
    # uvicorn re-raises the signal once shut down, so the exit status says "ended by SIGTERM"
    assert process.wait(timeout=20) in (0, -signal.SIGTERM)
    assert "Traceback" not in process.stderr.read().decode()


class StalledEngine:
    """An engine that waits for `release` (a request in flight as long as a test wants) or fails."""

    name = "stalled"

    def __init__(self, *, fail: bool = False) -> None:
        self.release, self.fail, self.calls = threading.Event(), fail, 0

    def translate(self, lines, decode, progress, **guidance):
        self.calls += 1
        if self.fail:
            raise RuntimeError("/secret/internal/path.py line 7: tensor shape mismatch")
        self.release.wait(timeout=30)
        return [Translation([(line.upper(), 0.0)]) for line in lines]


def app_client(engine: StalledEngine, **limits):
    from fastapi.testclient import TestClient

    from seq2seq.config import DecodeConfig
    from seq2seq.deploy.serve import Limits, create_app

    translator = Translator(DecodeConfig(beam=2), engine)
    return TestClient(create_app(translator, model_name="stalled", limits=Limits(**limits)))


def test_a_full_queue_answers_503_and_a_slow_request_times_out():
    engine = StalledEngine()
    with app_client(engine, max_queue=1, request_timeout=1.0, batch_wait=0.0) as client:
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(client.post, "/translate", json={"lines": ["a"]})
            deadline = time.time() + 10
            while engine.calls == 0 and time.time() < deadline:  # the first request is being translated
                time.sleep(0.01)
            busy = client.post("/translate", json={"lines": ["b"]})
            assert busy.status_code == 503 and "busy (1 requests open)" in busy.json()["error"]
            assert busy.headers["retry-after"] == "1"
            late = first.result(timeout=20)
        assert late.status_code == 503 and "took over 1 s" in late.json()["error"]
        engine.release.set()
        deadline = time.time() + 10  # the stalled job ends and frees its place in the queue
        while (answer := client.post("/translate", json={"lines": ["c"]})).status_code == 503:
            assert time.time() < deadline
            time.sleep(0.05)
        assert answer.status_code == 200 and answer.json()["translations"] == ["C"]


def test_a_failure_inside_translation_is_a_500_that_echoes_nothing_internal(capfd):
    with app_client(StalledEngine(fail=True)) as client:
        response = client.post("/translate", json={"lines": ["a"]})
        assert response.status_code == 500
        assert response.json() == {"error": "translation failed; the server's log has the details"}
        assert client.get("/health").status_code == 200
    assert "/secret/internal/path.py" in capfd.readouterr().err  # the server's log has it

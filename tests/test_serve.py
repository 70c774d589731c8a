"""The HTTP server, started for real on 127.0.0.1 and called with a real client: translations equal the
Python API's, concurrent requests are batched, bad requests get JSON errors, SIGTERM stops it cleanly."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx", reason="optional extra: pip install -e '.[serve]' (included in [dev])")
pytest.importorskip("fastapi", reason="optional extra: pip install -e '.[serve]' (included in [dev])")

from seq2seq.translator import Translator  # noqa: E402


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
        (json.dumps({"lines": ["a"], "beam": "wide"}).encode(), 422, "decode.beam: expected an integer"),
        (json.dumps({"lines": ["a"], "beam": 1000}).encode(), 422, "beam: at most 16"),
    ],
)
def test_bad_requests_get_a_json_error_and_the_server_lives_on(server, body, status, fragment):
    url, process, _, _ = server
    response = httpx.post(f"{url}/translate", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status and fragment in response.json()["error"]
    assert process.poll() is None and httpx.get(f"{url}/health").status_code == 200


def test_sigterm_stops_the_server_cleanly_after_the_request_in_flight(server):
    url, process, _, data = server
    lines = (data / "test.en").read_text().splitlines()[:8]
    with ThreadPoolExecutor(max_workers=1) as pool:
        in_flight = pool.submit(httpx.post, f"{url}/translate", json={"lines": lines, "beam": 4}, timeout=60)
        time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        assert in_flight.result().status_code == 200  # answered before the server went down
    # uvicorn re-raises the signal once shut down, so the exit status says "ended by SIGTERM"
    assert process.wait(timeout=20) in (0, -signal.SIGTERM)
    assert "Traceback" not in process.stderr.read().decode()

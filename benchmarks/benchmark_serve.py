#!/usr/bin/env python3
"""Load on `seq2seq serve` over loopback: requests/s and p50/p95 latency at 1, 8 and 32 concurrent clients.

Starts the real server on 127.0.0.1 with the given model, then for each concurrency level sends
one-sentence requests (sentences of --input, in turn) from that many client threads, bounded by a
request count and a time limit, and stops the server with SIGTERM at the end.

With --hostile N, every N-th request of each client is a hostile one instead (cycling through
HOSTILE: numbers as strings, out-of-range settings, deep nesting, oversized and chunked bodies, bad
JSON): the table then also counts hostile requests refused (4xx) and anything else, and the
server's RSS before and after shows whether memory stayed bounded.

With --heavy N, N more clients send, all the while, the heaviest request the server allows (its
longest lines, as many as its work budget takes, beam and length limits at the server's maxima,
min_len at its most so that any model decodes long)
beside the short one-line requests: every short request must be answered 200 or 503 within the
server's --timeout (the worker is freed within a decoding step of a heavy request's deadline), and
none with a 500.

    python benchmarks/benchmark_serve.py --model models/bible-int8 --input data/bible/test.en
    python benchmarks/benchmark_serve.py --model models/demo-int8 --input data/demo/test.en --hostile 3
    python benchmarks/benchmark_serve.py --model runs/demo/checkpoints/best.pt --input data/demo/test.en --heavy 2
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from seq2seq.data.sources import read_lines


def start_server(model: Path, batch_wait_ms: float, timeout: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "seq2seq", "serve", str(model), "--port", str(port),
               "--batch-wait-ms", str(batch_wait_ms), "--timeout", str(timeout)]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("error: the server did not come up within 120 s")


def _chunked_body(size: int):
    """A body sent without Content-Length (chunked), `size` bytes of one long line."""
    yield b'{"lines": ["'
    for _ in range(size // 65536):
        yield b"a" * 65536
    yield b'"]}'


HOSTILE = [  # (what, a function giving the body): each must be refused with a 4xx, the server unharmed
    ("beam as a string", lambda: json.dumps({"lines": ["a"], "beam": "1000"}).encode()),
    ("beam 1000", lambda: json.dumps({"lines": ["a"], "beam": 1000}).encode()),
    ("max_len_b 10^6", lambda: json.dumps({"lines": ["a"], "max_len_b": 10**6}).encode()),
    ("min_len 10^6", lambda: json.dumps({"lines": ["a"], "min_len": 10**6}).encode()),
    ("JSON nested 100,000 deep", lambda: b"[" * 100_000 + b"]" * 100_000),
    ("a 2 MB body", lambda: json.dumps({"lines": ["a" * 2_000_000]}).encode()),
    ("a 4 MB chunked body", lambda: _chunked_body(4_000_000)),
    ("not JSON", lambda: b'{"lines": '),
]


def heaviest_request(url: str, lines: list[str]) -> dict:
    """The heaviest /translate body the server takes: the beam and length maxima of its defaults, lines
    as long as its --max-chars and --max-tokens-per-line allow, as many as its --max-lines and work
    budget admit (each 413 says which limit the body passed; the first body taken is the answer)."""
    long = ""
    for line in itertools.cycle(lines):
        if len(long) + len(line) + 1 > 2000:
            break
        long = f"{long} {line}".strip()
    # min_len at its most (the length limit of a one-piece source) forces long outputs from any model
    body = {"lines": [long] * 64, "beam": 16, "max_len_a": 4.0, "max_len_b": 256, "min_len": 2 * 4 + 256}
    while (response := httpx.post(f"{url}/translate", json=body, timeout=600)).status_code in (413, 422):
        error = response.json()["error"]  # 422: a line past an exported model's positions
        if ("work" in error or "lines;" in error) and len(body["lines"]) > 1:
            body["lines"] = body["lines"][: len(body["lines"]) // 2]
        else:  # too many characters or pieces in a line, or one line's work alone is too much
            body["lines"] = [line[: len(line) * 3 // 4] for line in body["lines"]]
    return body


def load(url: str, lines: list[str], *, clients: int, requests: int, seconds: float, beam: int,
         hostile_every: int = 0, heavy: dict | None = None, heavy_clients: int = 0) -> dict:  # fmt: skip
    """`requests` one-line requests from `clients` threads, stopping early after `seconds`; with
    hostile_every N, every N-th request of a client is one of HOSTILE; with `heavy_clients`, as many
    more threads send the `heavy` body until the one-line requests are done."""
    sentences, lock, latencies = itertools.cycle(lines), threading.Lock(), []
    counts = {"good failed": 0, "good 503": 0, "good 500": 0, "hostile refused": 0, "hostile not refused": 0,
              "heavy 200": 0, "heavy 503": 0, "heavy other": 0, "slowest": 0.0}  # fmt: skip
    hostile = itertools.cycle(HOSTILE)
    deadline = time.perf_counter() + seconds
    done = threading.Event()

    def heavy_client() -> None:
        with httpx.Client(timeout=600) as http:
            while not done.is_set():
                status = http.post(f"{url}/translate", json=heavy).status_code
                with lock:
                    counts[f"heavy {status}" if status in (200, 503) else "heavy other"] += 1

    def client(count: int) -> None:
        with httpx.Client(timeout=60) as http:
            for index in range(count):
                if time.perf_counter() > deadline:
                    return
                if hostile_every and index % hostile_every == hostile_every - 1:
                    with lock:
                        _, body = next(hostile)
                    response = http.post(f"{url}/translate", content=body(),
                                         headers={"content-type": "application/json"})  # fmt: skip
                    refused = 400 <= response.status_code < 500 and "error" in response.json()
                    with lock:
                        counts["hostile refused" if refused else "hostile not refused"] += 1
                    continue
                with lock:
                    line = next(sentences)
                start = time.perf_counter()
                response = http.post(f"{url}/translate", json={"lines": [line], "beam": beam})
                took = time.perf_counter() - start
                with lock:
                    counts["slowest"] = max(counts["slowest"], took)
                    if response.status_code == 200:
                        latencies.append(took)
                    else:
                        counts["good failed"] += 1
                        counts["good 503" if response.status_code == 503 else "good 500"] += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients + heavy_clients) as pool:
        heavies = [pool.submit(heavy_client) for _ in range(heavy_clients)]
        list(pool.map(client, [requests // clients] * clients))
        done.set()
        for future in heavies:
            future.result()
    elapsed = time.perf_counter() - start
    latencies.sort() if latencies else latencies.append(float("nan"))
    return {"requests": len(latencies), "rate": len(latencies) / elapsed, **counts,
            "p50": statistics.median(latencies), "p95": latencies[int(0.95 * (len(latencies) - 1))]}  # fmt: skip


def rss_mb(pid: int) -> float:
    """The server process's resident memory now (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint or an exported directory")
    parser.add_argument("--input", type=Path, required=True, help="sentences to send, one per line")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=256, help="requests per concurrency level")
    parser.add_argument("--seconds", type=float, default=60.0, help="time limit per concurrency level")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    parser.add_argument("--hostile", type=int, default=0, metavar="N", help="every N-th request is hostile")
    parser.add_argument("--heavy", type=int, default=0, metavar="N", help="N clients sending the heaviest requests")
    parser.add_argument("--timeout", type=float, default=60.0, help="the server's --timeout (seconds)")
    args = parser.parse_args()
    lines = [line for line in read_lines(args.input) if line][:1000]
    process, url = start_server(args.model, args.batch_wait_ms, args.timeout)
    try:
        load(url, lines, clients=1, requests=4, seconds=30, beam=args.beam)  # warm-up
        heavy = heaviest_request(url, lines) if args.heavy else None
        rss_before = rss_mb(process.pid)
        hostile = f", one request in {args.hostile} hostile" if args.hostile else ""
        if heavy:
            hostile += (f", {args.heavy} clients sending {len(heavy['lines'])} lines of {len(heavy['lines'][0])} "
                        "characters at beam 16, max_len 4 x source + 256, min_len 264 "
                        f"(server --timeout {args.timeout:g} s)")  # fmt: skip
        print(f"model {args.model}, beam {args.beam}, one sentence per request, loopback{hostile}\n")
        print("| clients | good answered | requests/s | p50 latency | p95 latency | slowest | good 503 | good 500 "
              "| hostile refused | hostile not refused | heavy 200 / 503 / other |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
        for clients in args.clients:
            row = load(url, lines, clients=clients, requests=args.requests, seconds=args.seconds, beam=args.beam,
                       hostile_every=args.hostile, heavy=heavy, heavy_clients=args.heavy)  # fmt: skip
            print(f"| {clients} | {row['requests']} | {row['rate']:.1f} | {row['p50'] * 1000:.0f} ms "
                  f"| {row['p95'] * 1000:.0f} ms | {row['slowest']:.1f} s | {row['good 503']} | {row['good 500']} "
                  f"| {row['hostile refused']} | {row['hostile not refused']} "
                  f"| {row['heavy 200']} / {row['heavy 503']} / {row['heavy other']} |", flush=True)  # fmt: skip
        health = httpx.get(f"{url}/health").json()
        print(f"\nserver: {health['requests']} requests in {health['batches']} batches; "
              f"RSS {rss_before:.0f} MiB after the warm-up, {rss_mb(process.pid):.0f} MiB at the end")  # fmt: skip
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

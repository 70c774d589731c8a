#!/usr/bin/env python3
"""Load on `seq2seq serve` over loopback: requests/s and p50/p95 latency at 1, 8 and 32 concurrent clients.

Starts the real server on 127.0.0.1 with the given model, then for each concurrency level sends
one-sentence requests (sentences of --input, in turn) from that many client threads, bounded by a
request count and a time limit, and stops the server with SIGTERM at the end.

With --hostile N, every N-th request of each client is a hostile one instead (cycling through
HOSTILE: numbers as strings, out-of-range settings, deep nesting, oversized and chunked bodies, bad
JSON): the table then also counts hostile requests refused (4xx) and anything else, and the
server's RSS before and after shows whether memory stayed bounded.

    python scripts/benchmark_serve.py --model models/bible-int8 --input data/bible/test.en
    python scripts/benchmark_serve.py --model models/demo-int8 --input data/demo/test.en --hostile 3
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


def start_server(model: Path, batch_wait_ms: float) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "seq2seq", "serve", str(model), "--port", str(port),
               "--batch-wait-ms", str(batch_wait_ms)]  # fmt: skip
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


def load(url: str, lines: list[str], *, clients: int, requests: int, seconds: float, beam: int,
         hostile_every: int = 0) -> dict:  # fmt: skip
    """`requests` one-line requests from `clients` threads, stopping early after `seconds`; with
    hostile_every N, every N-th request of a client is one of HOSTILE."""
    sentences, lock, latencies = itertools.cycle(lines), threading.Lock(), []
    counts = {"good failed": 0, "hostile refused": 0, "hostile not refused": 0}
    hostile = itertools.cycle(HOSTILE)
    deadline = time.perf_counter() + seconds

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
                with lock:
                    if response.status_code == 200:
                        latencies.append(time.perf_counter() - start)
                    else:
                        counts["good failed"] += 1

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(client, [requests // clients] * clients))
    elapsed = time.perf_counter() - start
    latencies.sort()
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
    args = parser.parse_args()
    lines = [line for line in read_lines(args.input) if line][:1000]
    process, url = start_server(args.model, args.batch_wait_ms)
    try:
        load(url, lines, clients=1, requests=4, seconds=30, beam=args.beam)  # warm-up
        rss_before = rss_mb(process.pid)
        hostile = f", one request in {args.hostile} hostile" if args.hostile else ""
        print(f"model {args.model}, beam {args.beam}, one sentence per request, loopback{hostile}\n")
        print("| clients | good answered | requests/s | p50 latency | p95 latency | good failed | hostile refused "
              "| hostile not refused |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
        for clients in args.clients:
            row = load(url, lines, clients=clients, requests=args.requests, seconds=args.seconds, beam=args.beam,
                       hostile_every=args.hostile)  # fmt: skip
            print(f"| {clients} | {row['requests']} | {row['rate']:.1f} | {row['p50'] * 1000:.0f} ms "
                  f"| {row['p95'] * 1000:.0f} ms | {row['good failed']} | {row['hostile refused']} "
                  f"| {row['hostile not refused']} |", flush=True)  # fmt: skip
        health = httpx.get(f"{url}/health").json()
        print(f"\nserver: {health['requests']} requests in {health['batches']} batches; "
              f"RSS {rss_before:.0f} MiB after the warm-up, {rss_mb(process.pid):.0f} MiB at the end")  # fmt: skip
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

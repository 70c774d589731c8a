#!/usr/bin/env python3
"""Load on `seq2seq serve` over loopback: requests/s and p50/p95 latency at 1, 8 and 32 concurrent clients.

Starts the real server on 127.0.0.1 with the given model, then for each concurrency level sends
one-sentence requests (sentences of --input, in turn) from that many client threads, bounded by a
request count and a time limit, and stops the server with SIGTERM at the end.

    python scripts/benchmark_serve.py --model models/bible-int8 --input data/bible/test.en
"""

from __future__ import annotations

import argparse
import itertools
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


def load(url: str, lines: list[str], *, clients: int, requests: int, seconds: float, beam: int) -> dict:
    """`requests` one-line requests from `clients` threads, stopping early after `seconds`."""
    sentences, lock, latencies = itertools.cycle(lines), threading.Lock(), []
    deadline = time.perf_counter() + seconds

    def client(count: int) -> None:
        with httpx.Client(timeout=60) as http:
            for _ in range(count):
                if time.perf_counter() > deadline:
                    return
                with lock:
                    line = next(sentences)
                start = time.perf_counter()
                response = http.post(f"{url}/translate", json={"lines": [line], "beam": beam})
                response.raise_for_status()
                with lock:
                    latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(client, [requests // clients] * clients))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {"requests": len(latencies), "rate": len(latencies) / elapsed,
            "p50": statistics.median(latencies), "p95": latencies[int(0.95 * (len(latencies) - 1))]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint or an exported directory")
    parser.add_argument("--input", type=Path, required=True, help="sentences to send, one per line")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests", type=int, default=256, help="requests per concurrency level")
    parser.add_argument("--seconds", type=float, default=60.0, help="time limit per concurrency level")
    parser.add_argument("--beam", type=int, default=5)
    parser.add_argument("--batch-wait-ms", type=float, default=5.0)
    args = parser.parse_args()
    lines = [line for line in read_lines(args.input) if line][:1000]
    process, url = start_server(args.model, args.batch_wait_ms)
    try:
        load(url, lines, clients=1, requests=4, seconds=30, beam=args.beam)  # warm-up
        print(f"model {args.model}, beam {args.beam}, one sentence per request, loopback\n")
        print("| clients | requests | requests/s | p50 latency | p95 latency |\n|---|---|---|---|---|")
        for clients in args.clients:
            row = load(url, lines, clients=clients, requests=args.requests, seconds=args.seconds, beam=args.beam)
            print(f"| {clients} | {row['requests']} | {row['rate']:.1f} | {row['p50'] * 1000:.0f} ms "
                  f"| {row['p95'] * 1000:.0f} ms |", flush=True)  # fmt: skip
        health = httpx.get(f"{url}/health").json()
        print(f"\nserver: {health['requests']} requests in {health['batches']} batches")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Memory of `seq2seq translate` on a long file: RSS sampled over the whole run of the real command.

Writes a file of --lines lines (the sentences of --input, repeated), translates it with
`seq2seq translate -c MODEL -i FILE -o OUT` in a child process, samples that process's RSS twice a
second, and prints RSS once the first chunk is under way, at the end and at its peak; --plot writes
the samples as a PNG.

    python benchmarks/benchmark_translate_memory.py --model runs/demo/checkpoints/best.pt --input data/demo/test.en
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from seq2seq.data.sources import read_lines


def rss_mb(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a checkpoint or an exported directory")
    parser.add_argument("--input", type=Path, required=True, help="sentences, repeated to --lines lines")
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--beam", type=int, default=0, help="0: the model's decode.beam")
    parser.add_argument("--plot", type=Path, help="write RSS over time as this PNG")
    args = parser.parse_args()
    sentences = [line for line in read_lines(args.input) if line]
    with tempfile.TemporaryDirectory() as work:
        source, output = Path(work) / "long.txt", Path(work) / "out.txt"
        source.write_text("".join(f"{line}\n" for line in itertools.islice(itertools.cycle(sentences), args.lines)))
        command = [sys.executable, "-m", "seq2seq", "translate", "-c", str(args.model), "-i", str(source),
                   "-o", str(output), *(["--beam", str(args.beam)] if args.beam else [])]  # fmt: skip
        start = time.perf_counter()
        process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
        samples: list[tuple[float, float]] = []
        while process.poll() is None:
            if (rss := rss_mb(process.pid)) is not None:
                samples.append((time.perf_counter() - start, rss))
            time.sleep(0.5)
        seconds = time.perf_counter() - start
        written = sum(1 for _ in output.open(encoding="utf-8")) if output.exists() else 0
    if process.returncode != 0 or not samples:
        print(f"error: seq2seq translate exited {process.returncode}", file=sys.stderr)
        return 1
    early = next((s for s in samples if s[0] >= 0.1 * seconds), samples[0])
    peak = max(rss for _, rss in samples)
    print(f"{args.model}: {args.lines:,} lines in {seconds:.0f} s ({written:,} written, {args.lines / seconds:,.0f} "
          f"lines/s), beam {args.beam or 'as configured'}")  # fmt: skip
    print(f"RSS at {early[0]:.0f} s (10% of the run): {early[1]:,.0f} MiB; at the end: {samples[-1][1]:,.0f} MiB "
          f"({samples[-1][1] / early[1] - 1:+.1%}); peak {peak:,.0f} MiB")  # fmt: skip
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(*zip(*samples))
        ax.set_xlabel("seconds")
        ax.set_ylabel("RSS (MiB)")
        ax.set_ylim(bottom=0)
        ax.set_title(f"seq2seq translate, {args.lines:,} lines")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"RSS over time: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

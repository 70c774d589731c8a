#!/usr/bin/env python3
"""Data preparation at scale: a synthetic corpus of 1M pairs, prepared in a fresh process.

Prints tokenizer training time, encoding time and throughput (pairs/s) on a cache miss, the time
of a cache hit, the peak RSS of each of the two steps, and the training loader's time per batch at
each --loader-tokens budget (a GPU's batches are 16k-64k tokens, and the host builds each one while
the GPU waits).

    python benchmarks/benchmark_data.py [--pairs 1000000] [--loader-tokens 4000 16000 64000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import yaml


def write_corpus(directory: Path, pairs: int) -> None:
    from seq2seq.data.demo_data import make_demo_corpus

    corpus = make_demo_corpus(seed=11, sizes={"train": pairs, "valid": 500})
    for split, rows in corpus.items():
        for lang, side in (("en", 0), ("xx", 1)):
            with open(directory / f"{split}.{lang}", "w", encoding="utf-8") as handle:
                handle.writelines(row[side] + "\n" for row in rows)


def prepare_and_measure(config_path: str, loader_tokens: list[int], queue) -> None:
    """Runs in its own process so that its peak RSS is the preparation's alone."""
    from seq2seq.config_files import load_config
    from seq2seq.data.batching import epoch_batches, make_batch
    from seq2seq.data.prepare import encode_training_split, stream_split
    from seq2seq.data.tokenizer import load_or_train_tokenizer
    from seq2seq.training.run_log import high_water_rss_mb, reset_high_water_rss

    config = load_config(config_path)
    work = Path(config_path).parent
    start = time.perf_counter()
    pairs = stream_split(config.data, "train")
    tokenizer = load_or_train_tokenizer(work / "tokenizer", config.tokenizer, pairs, seed=config.train.seed)
    tokenizer_seconds = time.perf_counter() - start
    tokenizer_rss = high_water_rss_mb()
    reset_high_water_rss()
    start = time.perf_counter()
    corpus = encode_training_split(config.data, tokenizer)
    encode_seconds = time.perf_counter() - start
    encode_rss = high_water_rss_mb()
    start = time.perf_counter()
    encode_training_split(config.data, tokenizer)
    cache_seconds = time.perf_counter() - start
    start = time.perf_counter()
    batches = epoch_batches(corpus, max_tokens=config.train.max_tokens, seed=1, epoch=1)
    plan_seconds = time.perf_counter() - start
    loader_ms = {}
    for tokens in loader_tokens:
        planned = epoch_batches(corpus, max_tokens=tokens, seed=1, epoch=1)[:2000]
        start = time.perf_counter()
        for indices in planned:
            make_batch(corpus, indices)
        loader_ms[tokens] = (time.perf_counter() - start) / len(planned) * 1e3
    queue.put(
        {
            "pairs": len(corpus),
            "tokenizer_s": tokenizer_seconds,
            "encode_s": encode_seconds,
            "cache_hit_s": cache_seconds,
            "tokenizer_rss_mb": tokenizer_rss,
            "encode_rss_mb": encode_rss,
            "batches": len(batches),
            "plan_s": plan_seconds,
            "loader_ms": loader_ms,
        }
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=1_000_000)
    parser.add_argument("--sample-sentences", type=int, default=200_000, help="tokenizer training sample")
    parser.add_argument("--loader-tokens", type=int, nargs="+", default=[4000, 16000, 64000],
                        help="token budgets of the batches the loader times")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        start = time.perf_counter()
        write_corpus(work, args.pairs)
        size_mb = sum(f.stat().st_size for f in work.glob("train.*")) / 2**20
        print(
            f"synthetic corpus: {args.pairs:,} pairs, {size_mb:,.0f} MiB of text ({time.perf_counter() - start:.0f}s)"
        )
        config = yaml.safe_load(Path("configs/demo.yaml").read_text())
        for split in ("train", "valid"):
            config["data"][split] = {
                "format": "text",
                "src": str(work / f"{split}.en"),
                "tgt": str(work / f"{split}.xx"),
            }
        config["data"].pop("test")
        config["data"]["cache_dir"] = str(work / "cache")
        config["tokenizer"]["sample_sentences"] = args.sample_sentences
        (work / "config.yaml").write_text(yaml.safe_dump(config))
        queue = multiprocessing.get_context("spawn").Queue()
        process = multiprocessing.get_context("spawn").Process(
            target=prepare_and_measure, args=(str(work / "config.yaml"), args.loader_tokens, queue)
        )
        process.start()
        result = queue.get()
        process.join()
    rows = [
        (f"tokenizer training ({args.sample_sentences:,}-pair sample)", f"{result['tokenizer_s']:.1f} s"),
        ("read + encode + filter + cache write", f"{result['encode_s']:.1f} s"),
        ("encoding throughput", f"{result['pairs'] / result['encode_s']:,.0f} pairs/s"),
        ("second run (cache hit, memory-mapped)", f"{result['cache_hit_s']:.2f} s"),
        ("peak RSS while training the tokenizer", f"{result['tokenizer_rss_mb']:,.0f} MiB"),
        ("peak RSS while encoding and caching", f"{result['encode_rss_mb']:,.0f} MiB"),
        (f"batch plan for one epoch ({result['batches']:,} batches)", f"{result['plan_s']:.1f} s"),
    ]
    rows += [(f"loader (make_batch), {tokens:,}-token batches", f"{ms:.2f} ms a batch")
             for tokens, ms in result["loader_ms"].items()]  # fmt: skip
    print("\n| step | figure |\n|---|---|")
    for step, figure in rows:
        print(f"| {step} | {figure} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

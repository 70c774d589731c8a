#!/usr/bin/env python3
"""Training throughput of our trainer against a hand-written torch.nn.Transformer loop, side by side.

Both sides train the same model size (default: d 256, 4 heads, FFN 1024, 3+3 layers, tied
embeddings) on the same encoded data with the same tokens per batch. The reference is what a user
writes by hand: nn.Transformer, sentences in random order cut into batches of a fixed sentence
count, padding and causal masks, label-smoothed cross entropy, Adam, clipping. Each side runs in
its own process (so peak RSS is its own); target tokens/s count real (non-pad) target tokens.

    python scripts/benchmark_train.py [--config configs/demo.yaml] [--steps 30] [--precision fp32]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from seq2seq.config import load_config
from seq2seq.data.batching import collate, epoch_batches, make_batch, padding_fraction
from seq2seq.model import sinusoidal_positions
from seq2seq.tokenizer import PAD_ID
from seq2seq.train import Trainer

MODEL = ["model.d_model=256", "model.heads=4", "model.ffn_dim=1024", "model.encoder_layers=3",
         "model.decoder_layers=3", "model.norm=post", "model.dropout=0.1"]  # fmt: skip


class ReferenceModel(nn.Module):
    """torch.nn.Transformer with tied embeddings and sinusoidal positions, as commonly hand-written."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab, d_model, padding_idx=PAD_ID)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, ffn, dropout, batch_first=True)
        self.out = nn.Linear(d_model, vocab, bias=False)
        self.out.weight = self.embed.weight

    def embed_positions(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = sinusoidal_positions(torch.arange(tokens.size(1)), self.d_model)
        return self.embed(tokens) * math.sqrt(self.d_model) + positions

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        causal = torch.ones(tgt.size(1), tgt.size(1), dtype=torch.bool).triu(1)  # True = may not attend
        hidden = self.transformer(
            self.embed_positions(src), self.embed_positions(tgt), tgt_mask=causal,
            src_key_padding_mask=src == PAD_ID, tgt_key_padding_mask=tgt == PAD_ID,
            memory_key_padding_mask=src == PAD_ID,
        )  # fmt: skip
        return self.out(hidden)


def prepare(args) -> Trainer:
    overrides = [*MODEL, f"train.max_tokens={args.max_tokens}", f"train.precision={args.precision}",
                 f"train.threads={args.threads}", *args.set]  # fmt: skip
    config = load_config(args.config, overrides)
    return Trainer(config, Path(args.work) / "run", show_progress=False)


def run_ours(args, queue) -> None:
    trainer = prepare(args)
    batches = epoch_batches(trainer.data.train, max_tokens=args.max_tokens, seed=1, epoch=1)
    tokens, seconds = 0, 0.0
    for step in range(args.warmup + args.steps):
        batch = make_batch(trainer.data.train, batches[step % len(batches)])
        start = time.perf_counter()
        trainer._update([batch], batch.num_tokens)
        if step >= args.warmup:
            seconds += time.perf_counter() - start
            tokens += batch.num_tokens
    used = [batches[i % len(batches)] for i in range(args.warmup + args.steps)]
    queue.put(("ours", tokens / seconds, padding_fraction(trainer.data.train, used), _peak_rss_mb()))


def run_reference(args, queue) -> None:
    trainer = prepare(args)  # reuses the tokenizer and encoded data of the run directory
    corpus, cfg = trainer.data.train, trainer.config.model
    torch.manual_seed(1)
    model = ReferenceModel(trainer.tokenizer.tgt_vocab_size, cfg.d_model, cfg.heads, cfg.encoder_layers,
                           cfg.ffn_dim, cfg.dropout)  # fmt: skip
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD_ID, label_smoothing=0.1)
    lengths = np.maximum(corpus.src.lengths(), corpus.tgt.lengths() + 1)
    per_batch = max(1, int(args.max_tokens / lengths.mean() / 1.6))  # fixed count; padding eats the rest
    order = np.random.default_rng(1).permutation(len(corpus))
    batches = [order[i : i + per_batch] for i in range(0, len(order), per_batch)]
    tokens, seconds = 0, 0.0
    model.train()
    for step in range(args.warmup + args.steps):
        indices = batches[step % len(batches)]
        batch = collate([corpus.src[i] for i in indices], [corpus.tgt[i] for i in indices])
        start = time.perf_counter()
        logits = model(batch.src, batch.tgt_in)
        loss = loss_fn(logits.reshape(-1, logits.size(-1)), batch.tgt_out.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step >= args.warmup:
            seconds += time.perf_counter() - start
            tokens += batch.num_tokens
    used = [batches[i % len(batches)] for i in range(args.warmup + args.steps)]
    queue.put(("reference", tokens / seconds, padding_fraction(corpus, used), _peak_rss_mb()))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    parser.add_argument("--set", action="append", default=[], help="extra config override (repeatable)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.config == Path("configs/demo.yaml") and not Path("data/demo/train.en").exists():
        from seq2seq.demo_data import write_demo_corpus

        write_demo_corpus("data/demo")
    context = multiprocessing.get_context("spawn")
    results = {}
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        prepare(args)  # train the tokenizer once, before timing anything
        for target in (run_ours, run_reference):
            queue = context.Queue()
            process = context.Process(target=target, args=(args, queue))
            process.start()
            name, rate, padding, rss = queue.get()
            process.join()
            results[name] = (rate, padding, rss)
    print(f"config {args.config} + {' '.join(MODEL)} | {args.max_tokens} tokens/batch | {args.precision} | "
          f"{args.threads} threads | {args.steps} timed steps")  # fmt: skip
    print("\n| trainer | target tokens/s | padding | peak RSS |\n|---|---|---|---|")
    for name, (rate, padding, rss) in results.items():
        print(f"| {name} | {rate:,.0f} | {padding:.1%} | {rss:,.0f} MiB |")
    ratio = results["ours"][0] / results["reference"][0]
    print(f"\nours / reference: {ratio:.2f}x (target >= 1.2x at fp32 on CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Training throughput of our trainer against a hand-written torch.nn.Transformer loop, side by side.

All sides train the same model (default: d 256, 4 heads, FFN 1024, 3+3 layers, tied embeddings) on
the same encoded data and the very same token-bucketed batches, each in its own process (so peak
RSS is its own). The reference is what a careful user writes by hand: nn.Transformer with
embeddings, sinusoidal positions, padding and causal masks, label-smoothed nn.CrossEntropyLoss,
Adam and clipping, in fp32. Tokens/s count real (non-pad) target tokens; MFU divides the model's
matmul FLOPs per second by this CPU's matmul rate, measured here for each precision.

    python scripts/benchmark_train.py [--config configs/bible_en_es.yaml] [--steps 20]
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

import torch
from torch import nn

from seq2seq.config import load_config
from seq2seq.data.batching import epoch_batches, make_batch, padding_fraction
from seq2seq.errors import UserInputError
from seq2seq.model import sinusoidal_positions
from seq2seq.tokenizer import PAD_ID
from seq2seq.train import Trainer

MODEL = ["model.d_model=256", "model.heads=4", "model.ffn_dim=1024", "model.encoder_layers=3",
         "model.decoder_layers=3", "model.norm=post", "model.dropout=0.1", "model.share_embeddings=true"]  # fmt: skip


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


def step_flops(batch, d: int, ffn: int, layers: int, vocab: int) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3x forward) on the batch's real tokens."""
    src_len = (batch.src != PAD_ID).sum(1).double()
    tgt_len = (batch.tgt_out != PAD_ID).sum(1).double()
    linear_enc = src_len * (4 * d * d + 2 * d * ffn)  # q, k, v, o projections and the FFN, per source token
    linear_dec = tgt_len * (6 * d * d + 2 * d * ffn) + src_len * 2 * d * d  # + cross k, v on the source
    attention = src_len**2 * 2 * d + tgt_len**2 * 2 * d + tgt_len * src_len * 2 * d  # scores and mixing
    forward = 2 * (layers * (linear_enc + linear_dec + attention).sum() + tgt_len.sum() * d * vocab)
    return 3 * float(forward)


def matmul_rate(dtype: torch.dtype, seconds: float = 2.0) -> float:
    """FLOP/s of a large matmul on this machine, in the given precision."""
    a, b = torch.randn(2048, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return count * 2 * 2048 * 1024 * 1024 / (time.perf_counter() - start)


def prepare(args, precision: str = "fp32") -> Trainer:
    overrides = [*MODEL, f"train.max_tokens={args.max_tokens}", f"train.precision={precision}",
                 f"train.threads={args.threads}", f"data.cache_dir={args.work}/cache", *args.set]  # fmt: skip
    return Trainer(load_config(args.config, overrides), Path(args.work) / "run", show_progress=False)


def timed_steps(args, train_step, batches, flops_of) -> tuple[float, float]:
    """(target tokens/s, model FLOP/s) over args.steps steps after args.warmup untimed ones."""
    tokens, flops, seconds = 0, 0.0, 0.0
    for step in range(args.warmup + args.steps):
        batch = batches[step % len(batches)]
        start = time.perf_counter()
        train_step(batch)
        if step >= args.warmup:
            seconds += time.perf_counter() - start
            tokens += batch.num_tokens
            flops += flops_of(batch)
    return tokens / seconds, flops / seconds


def run_side(args, side: str, queue) -> None:
    trainer = prepare(args, "bf16" if side == "ours bf16" else "fp32")
    corpus, cfg = trainer.data.train, trainer.config.model
    vocab = trainer.tokenizer.tgt_vocab_size
    order = epoch_batches(corpus, max_tokens=args.max_tokens, seed=1, epoch=1)[: args.warmup + args.steps]
    batches = [make_batch(corpus, indices) for indices in order]

    def flops_of(batch):
        return step_flops(batch, cfg.d_model, cfg.ffn_dim, cfg.encoder_layers, vocab)

    if side.startswith("ours"):
        rate, flops = timed_steps(args, lambda b: trainer._update([b], b.num_tokens), batches, flops_of)
    else:
        torch.manual_seed(1)
        model = ReferenceModel(vocab, cfg.d_model, cfg.heads, cfg.encoder_layers, cfg.ffn_dim, cfg.dropout)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
        loss_fn = nn.CrossEntropyLoss(ignore_index=PAD_ID, label_smoothing=0.1)
        model.train()

        def reference_step(batch):
            logits = model(batch.src, batch.tgt_in)
            loss = loss_fn(logits.reshape(-1, logits.size(-1)), batch.tgt_out.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

        rate, flops = timed_steps(args, reference_step, batches, flops_of)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put((side, rate, flops, padding_fraction(corpus, order), peak_rss))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/bible_en_es.yaml"))
    parser.add_argument("--set", action="append", default=[], help="extra config override (repeatable)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    try:
        load_config(args.config)
    except UserInputError as error:
        print(f"error: {error}\n(configs/bible_en_es.yaml needs scripts/prepare_bible.py first; "
              "configs/demo.yaml needs `make demo`)", file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(args.threads)
    rates = {"fp32": matmul_rate(torch.float32), "bf16": matmul_rate(torch.bfloat16)}
    context = multiprocessing.get_context("spawn")
    results = {}
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        prepare(args)  # tokenizer and encoding cache, once, before anything is timed
        for side in ("reference fp32", "ours fp32", "ours bf16"):
            queue = context.Queue()
            process = context.Process(target=run_side, args=(args, side, queue))
            process.start()
            results[side] = queue.get()[1:]
            process.join()
    print(f"config {args.config} + {' '.join(MODEL)}")
    print(f"{args.max_tokens} tokens/batch (the same batches for every side), {args.threads} threads, "
          f"{args.steps} timed steps; matmul rate here: fp32 {rates['fp32'] / 1e9:,.0f} GFLOP/s, "
          f"bf16 {rates['bf16'] / 1e9:,.0f} GFLOP/s")  # fmt: skip
    print("\n| trainer | target tokens/s | MFU | padding | peak RSS |\n|---|---|---|---|---|")
    for side, (rate, flops, padding, rss) in results.items():
        mfu = flops / rates["bf16" if "bf16" in side else "fp32"]
        print(f"| {side} | {rate:,.0f} | {mfu:.0%} | {padding:.1%} | {rss:,.0f} MiB |")
    reference = results["reference fp32"][0]
    print(f"\nours fp32 / reference: {results['ours fp32'][0] / reference:.2f}x (target >= 1.2x)")
    print(f"ours bf16 / reference: {results['ours bf16'][0] / reference:.2f}x (target >= 1.5x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Training throughput of our trainer against a hand-written torch.nn.Transformer loop, side by side.

All sides train the same model on the same encoded data and the very same token-bucketed batches,
each in its own process (so peak memory is its own). The reference is what a careful user writes
by hand: nn.Transformer with embeddings, sinusoidal positions, padding and causal masks,
label-smoothed nn.CrossEntropyLoss, Adam and clipping, in fp32. Tokens/s count real (non-pad)
target tokens; MFU divides the model's matmul FLOPs per second by the device's matmul rate,
measured here for each precision. Runs on the GPU when there is one (peak memory is then the
GPU's), else on the CPU (peak RSS).

    python scripts/benchmark_train.py [--config configs/bible_en_es.yaml] [--steps 20]
    python scripts/benchmark_train.py --model base --max-tokens 16000 --sides "ours bf16"   # on a GPU
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from seq2seq.config import Config, load_config
from seq2seq.data.batching import epoch_batches, make_batch, padding_fraction
from seq2seq.data.encoded import EncodedCorpus
from seq2seq.data.prepare import encode_training_split, stream_split
from seq2seq.errors import UserInputError
from seq2seq.model import build_model, sinusoidal_positions
from seq2seq.run_log import peak_memory_mb
from seq2seq.special_tokens import PAD_ID
from seq2seq.tokenizer import Tokenizer, load_or_train_tokenizer
from seq2seq.train_step import build_optimizer, build_scaler, train_step

COMMON = ["model.norm=post", "model.dropout=0.1", "model.share_embeddings=true"]
MODELS = {  # the CPU model, and Transformer-base of "Attention Is All You Need"
    "small": ["model.d_model=256", "model.heads=4", "model.ffn_dim=1024", "model.encoder_layers=3",
              "model.decoder_layers=3", *COMMON],
    "base": ["model.d_model=512", "model.heads=8", "model.ffn_dim=2048", "model.encoder_layers=6",
             "model.decoder_layers=6", *COMMON],
}  # fmt: skip
SIDES = ("reference fp32", "ours fp32", "ours bf16")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    """Wait for queued GPU work, so wall-clock time measures it (a no-op on CPU)."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


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
        positions = sinusoidal_positions(torch.arange(tokens.size(1), device=tokens.device), self.d_model)
        return self.embed(tokens) * math.sqrt(self.d_model) + positions

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        length = tgt.size(1)
        causal = torch.ones(length, length, dtype=torch.bool, device=tgt.device).triu(1)  # True = may not attend
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
    """FLOP/s of a large matmul on this device, in the given precision."""
    n, k = (8192, 8192) if DEVICE.type == "cuda" else (2048, 1024)
    a, b = torch.randn(n, k, dtype=dtype, device=DEVICE), torch.randn(k, k, dtype=dtype, device=DEVICE)
    a @ b
    synchronize()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(10):
            a @ b
        synchronize()
        count += 10
    return count * 2 * n * k * k / (time.perf_counter() - start)


def prepare(args, precision: str = "fp32") -> tuple[Config, Tokenizer, EncodedCorpus]:
    """The config with this run's overrides, the tokenizer (trained once into the work folder) and the
    encoded training split (from the encoding cache after the first call)."""
    overrides = [*MODELS[args.model], f"train.max_tokens={args.max_tokens}", f"train.precision={precision}",
                 f"train.threads={args.threads}", f"train.compile={args.compile}", f"data.cache_dir={args.work}/cache",
                 *args.set]  # fmt: skip
    config = load_config(args.config, overrides)
    pairs = stream_split(config.data, "train")
    tokenizer = load_or_train_tokenizer(Path(args.work) / "tokenizer", config.tokenizer, pairs, seed=config.train.seed)
    return config, tokenizer, encode_training_split(config.data, tokenizer)


def timed_steps(args, step, batches, flops_of) -> tuple[float, float]:
    """(target tokens/s, model FLOP/s) over args.steps steps after args.warmup untimed ones."""
    for batch in batches[: args.warmup]:
        step(batch)
    timed = batches[args.warmup : args.warmup + args.steps]
    tokens, flops = sum(batch.num_tokens for batch in timed), sum(flops_of(batch) for batch in timed)
    synchronize()
    start = time.perf_counter()
    for batch in timed:
        step(batch)
    synchronize()
    seconds = time.perf_counter() - start
    return tokens / seconds, flops / seconds


def run_side(args, side: str, queue) -> None:
    torch.set_num_threads(args.threads)
    config, tokenizer, corpus = prepare(args, "bf16" if side == "ours bf16" else "fp32")
    cfg, vocab = config.model, tokenizer.tgt_vocab_size
    order = epoch_batches(corpus, max_tokens=args.max_tokens, seed=1, epoch=1)[: args.warmup + args.steps]
    batches = [make_batch(corpus, indices) for indices in order]  # built before timing, for every side alike

    def flops_of(batch):
        return step_flops(batch, cfg.d_model, cfg.ffn_dim, cfg.encoder_layers, vocab)

    if side.startswith("ours"):
        torch.manual_seed(config.train.seed)
        model = build_model(cfg, tokenizer).to(DEVICE)
        forward = torch.compile(model) if args.compile else model
        optimizer, scaler = build_optimizer(model, config.train), build_scaler(DEVICE, config.train.precision)

        def our_step(batch):
            train_step(model, optimizer, scaler, [batch], update_tokens=batch.num_tokens, lr=1e-4,
                       config=config.train, forward=forward)  # fmt: skip

        rate, flops = timed_steps(args, our_step, batches, flops_of)
    else:
        torch.manual_seed(1)
        model = ReferenceModel(vocab, cfg.d_model, cfg.heads, cfg.encoder_layers, cfg.ffn_dim, cfg.dropout)
        model.to(DEVICE).train()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
        loss_fn = nn.CrossEntropyLoss(ignore_index=PAD_ID, label_smoothing=0.1)

        def reference_step(batch):
            batch = batch.to(DEVICE)
            logits = model(batch.src, batch.tgt_in)
            loss = loss_fn(logits.reshape(-1, logits.size(-1)), batch.tgt_out.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

        rate, flops = timed_steps(args, reference_step, batches, flops_of)
    queue.put((side, rate, flops, padding_fraction(corpus, order), peak_memory_mb(DEVICE)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/bible_en_es.yaml"))
    parser.add_argument("--model", choices=sorted(MODELS), default="small", help="small: d 256, 3+3; base: d 512, 6+6")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--compile", action="store_true", help="our sides under torch.compile")
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
        for side in args.sides:
            queue = context.Queue()
            process = context.Process(target=run_side, args=(args, side, queue))
            process.start()
            results[side] = queue.get()[1:]
            process.join()
    device = torch.cuda.get_device_name() if DEVICE.type == "cuda" else f"CPU, {args.threads} threads"
    print(f"config {args.config} + {' '.join(MODELS[args.model])}{' (compiled)' if args.compile else ''}")
    print(f"{device}; {args.max_tokens} tokens/batch (the same batches for every side), {args.steps} timed steps")
    print(f"matmul rate here: fp32 {rates['fp32'] / 1e9:,.0f} GFLOP/s, bf16 {rates['bf16'] / 1e9:,.0f} GFLOP/s")
    memory = "peak GPU memory" if DEVICE.type == "cuda" else "peak RSS"
    print(f"\n| trainer | target tokens/s | MFU | padding | {memory} |\n|---|---|---|---|---|")
    for side, (rate, flops, padding, peak) in results.items():
        mfu = flops / rates["bf16" if "bf16" in side else "fp32"]
        print(f"| {side} | {rate:,.0f} | {mfu:.0%} | {padding:.1%} | {peak:,.0f} MiB |")
    if "reference fp32" in results:
        reference = results["reference fp32"][0]
        for side, target in (("ours fp32", 1.2), ("ours bf16", 1.5)):
            if side in results:
                print(f"{side} / reference: {results[side][0] / reference:.2f}x (target >= {target}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

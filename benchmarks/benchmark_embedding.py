#!/usr/bin/env python3
"""A stack's input rows, forward + backward: the fused embedding (model/embedding.py) against the
PyTorch path it replaces in training (embedding, scaling, sinusoids, dropout, the gather into flat
rows), side by side.

The batch is a token-bucketed one of --tokens tokens of the d 256 Bible model (sentences of 20 to
40 tokens padded to the longest, an 8k vocabulary, dropout 0.1). Each round times every side in
turn (best of --rounds, so a slow spell of a shared machine falls on all sides alike), in fp32 and
bf16: neither side multiplies matrices, so bf16 is no emulation here, on any CPU.

    python benchmarks/benchmark_embedding.py [--tokens 4000] [--rounds 5] [--repeats 20]
"""

from __future__ import annotations

import argparse

import torch
from ledger import describe_machine
from timing import seconds_per_call

from seq2seq.config import ModelConfig
from seq2seq.data.special_tokens import PAD_ID
from seq2seq.model.rows import Rows, row_multiple
from seq2seq.model.transformer import Seq2SeqTransformer

REFERENCE = "PyTorch's ops"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20, help="calls per side per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lengths = torch.randint(20, 41, (args.tokens // 30,))
    tokens = torch.randint(4, args.vocab, (lengths.numel(), int(lengths.max())))
    tokens[torch.arange(tokens.size(1)) >= lengths[:, None]] = PAD_ID
    rows = Rows.of(tokens != PAD_ID, row_multiple(torch.device("cpu"), torch.bfloat16))
    print(f"{describe_machine()}, {args.threads} threads")
    print(f"{int(lengths.sum()):,} tokens in {tokens.size(0)} sentences of up to {tokens.size(1)} ({rows.padded:,} "
          f"rows) x d {args.width}, vocabulary {args.vocab:,}; forward + backward; best of {args.rounds} rounds of "
          f"{args.repeats} calls per side")  # fmt: skip
    print("\n| precision | side | ms per call | speed vs PyTorch's ops |")
    print("|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        config = ModelConfig(d_model=args.width, heads=4, encoder_layers=1, decoder_layers=1, dropout=0.1)
        model = Seq2SeqTransformer(config, src_vocab_size=args.vocab, tgt_vocab_size=args.vocab).to(dtype).train()
        sides = {
            REFERENCE: lambda model=model: rows.flatten(model.embed(model.src_embed, tokens, 0)),
            "fused": lambda model=model: model.embed_rows(model.src_embed, tokens, rows, 0),
        }
        grad = torch.randn(rows.padded, args.width).to(dtype)
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(args.rounds):
            for name, rows_of in sides.items():
                best[name] = min(best[name], _seconds_per_call(rows_of, grad, model, args.repeats))
        precision = "fp32" if dtype == torch.float32 else "bf16"
        for name in sides:
            print(f"| {precision} | {name} | {best[name] * 1e3:.2f} | {best[REFERENCE] / best[name]:.2f}x |")


def _seconds_per_call(rows_of, grad, model, repeats: int) -> float:
    def call():
        model.src_embed.weight.grad = None
        rows_of().backward(grad)

    return seconds_per_call(call, repeats)


if __name__ == "__main__":
    main()

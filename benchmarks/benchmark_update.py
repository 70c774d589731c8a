#!/usr/bin/env python3
"""The end of a bf16 update on a CPU: the fused pass (training/optimizer.py, `WorkingCopy.update`)
against the passes it replaces (the gradients gathered, widened and clipped into fp32, PyTorch's
fused Adam, the working copy cast again from the masters), side by side.

The weights are those of the d 256 Bible model (3+3 layers, FFN 1024, tied 8k embeddings: about 7.5M
weights), Adam as `train` builds it, each gradient random bf16. Each round times both sides in turn
(best of --rounds, so a slow spell of a shared machine falls on both alike). Neither side multiplies
matrices: the figures are memory traffic, so bf16 is no emulation here, on any CPU.

    python benchmarks/benchmark_update.py [--rounds 5] [--repeats 20]
"""

from __future__ import annotations

import argparse

import torch
from ledger import describe_machine
from timing import seconds_per_call

from seq2seq.config import ModelConfig, TrainConfig
from seq2seq.model.cpu_kernels import cpu_kernels
from seq2seq.model.transformer import Seq2SeqTransformer
from seq2seq.training.optimizer import build_optimizer, step_on_flag
from seq2seq.training.working_copy import WorkingCopy

REFERENCE = "gather, widen, Adam, cast"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20, help="calls per side per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if cpu_kernels() is None:
        raise SystemExit("the fused CPU kernels are not built on this machine: nothing to compare")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(d_model=256, heads=4, encoder_layers=3, decoder_layers=3, ffn_dim=1024)
    model = Seq2SeqTransformer(config, src_vocab_size=args.vocab, tgt_vocab_size=args.vocab)
    working = WorkingCopy(model)
    optimizer = build_optimizer(model, TrainConfig(precision="bf16"))
    for group in optimizer.param_groups:
        group["lr"] = 1e-4
    copies = list(working.model.parameters())
    gradients = [torch.randn_like(copy) * 1e-3 for copy in copies]

    def with_gradients(end_update):
        def call():
            for copy, gradient in zip(copies, gradients, strict=True):
                copy.grad = gradient  # neither side writes into a gradient
            end_update()
            optimizer.zero_grad(set_to_none=True)

        return call

    def passes() -> None:
        step_on_flag(optimizer, ~torch.isfinite(working.hand_over(1.0)))
        working.refresh()

    sides = {REFERENCE: with_gradients(passes), "fused": with_gradients(lambda: working.update(optimizer, 1.0))}
    sides[REFERENCE]()  # the optimizer's first step creates its state
    weights = sum(copy.numel() for copy in copies)
    print(f"{describe_machine()}, {args.threads} threads")
    print(f"{weights:,} weights in {len(copies)} tensors; best of {args.rounds} rounds of {args.repeats} calls a side")
    print(f"\n| side | ms per update | speed vs {REFERENCE} |")
    print("|---|---|---|")
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(args.rounds):
        for name, call in sides.items():
            best[name] = min(best[name], seconds_per_call(call, args.repeats))
    for name in sides:
        print(f"| {name} | {best[name] * 1e3:.2f} | {best[REFERENCE] / best[name]:.2f}x |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Our fused label-smoothed cross entropy against F.cross_entropy, forward + backward, side by side.

The logits are those of one 4,000-token training batch of the d 256 Bible model (rows x an 8k
vocabulary), in fp32 and in bf16 (F.cross_entropy then runs under autocast, as a user's loop would).

    python scripts/benchmark_loss.py [--rows 3500] [--vocab 8000] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from seq2seq.training.loss import label_smoothed_cross_entropy

SMOOTHING = 0.1


def seconds_per_call(loss_of, logits: torch.Tensor, repeats: int) -> float:
    def call():
        logits.grad = None
        loss_of(logits).backward()

    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3500)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = torch.randint(4, args.vocab, (args.rows,))

    def pytorch(logits):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=logits.dtype == torch.bfloat16):
            return F.cross_entropy(logits, target, label_smoothing=SMOOTHING, reduction="sum")

    def ours(logits):
        return label_smoothed_cross_entropy(logits, target, SMOOTHING)

    print(f"{args.rows} rows x {args.vocab} classes, forward + backward, {args.threads} threads")
    for dtype in (torch.float32, torch.bfloat16):
        logits = (2 * torch.randn(args.rows, args.vocab)).to(dtype).requires_grad_()
        reference, fused = (seconds_per_call(loss, logits, args.repeats) for loss in (pytorch, ours))
        print(f"{str(dtype).removeprefix('torch.')}: F.cross_entropy {reference * 1e3:.1f} ms, ours "
              f"{fused * 1e3:.1f} ms: {reference / fused:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()

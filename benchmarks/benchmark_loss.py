#!/usr/bin/env python3
"""Our fused output layer + loss against F.linear + F.cross_entropy, forward + backward, side by side.

The decoder rows and output weight are those of one 4,000-token training batch of the d 256 Bible
model (rows x d 256, an 8k vocabulary). Each round times every side in turn (best of --rounds, so a
slow spell of a shared machine falls on all sides alike), in fp32 and, where this machine runs
bf16 natively (training/precision.py), under bf16 autocast, as a user's loop would run it. The
largest single allocation of each side is printed too: PyTorch's holds the whole logits. With
--chunk-rows, ours runs once per CPU chunk size given, side by side (training/loss.py sizes them by
CPU_CHUNK_ELEMENTS).

    python benchmarks/benchmark_loss.py [--rows 3500] [--vocab 8000] [--rounds 5] [--repeats 5]
    python benchmarks/benchmark_loss.py --chunk-rows 256 512 1024
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F
from ledger import describe_machine
from timing import seconds_per_call
from torch.profiler import ProfilerActivity, profile

from seq2seq.training import loss as loss_module
from seq2seq.training.loss import output_layer_loss
from seq2seq.training.precision import cpu_has_native_bf16

SMOOTHING = 0.1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=3500)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="calls per side per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--chunk-rows", type=int, nargs="+", default=[],
                        help="rows per loss chunk on a CPU, one side of ours each (default: as shipped)")  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    hidden = torch.randn(args.rows, args.width, requires_grad=True)
    weight = (torch.randn(args.vocab, args.width) * args.width**-0.5).requires_grad_()
    target = torch.randint(4, args.vocab, (args.rows,))
    sides = {
        "F.linear + F.cross_entropy": lambda: F.cross_entropy(
            F.linear(hidden, weight), target, label_smoothing=SMOOTHING, reduction="sum"
        ),
    }
    shipped = loss_module.CPU_CHUNK_ELEMENTS
    for rows in args.chunk_rows or [None]:
        name = "ours (fused)" if rows is None else f"ours (fused), {rows}-row chunks"
        elements = shipped if rows is None else rows * args.vocab
        sides[name] = functools.partial(_ours_in_chunks, elements, hidden, weight, target)
    precisions = {"fp32": None} | ({"bf16": torch.bfloat16} if cpu_has_native_bf16() else {})
    print(f"{describe_machine()}, {args.threads} threads")
    no_bf16 = "" if "bf16" in precisions else "; no bf16 side: this CPU emulates it"
    print(f"{args.rows} rows x d {args.width} -> {args.vocab} classes, forward + backward; "
          f"best of {args.rounds} rounds of {args.repeats} calls per side{no_bf16}")  # fmt: skip
    print("\n| precision | side | ms per call | largest allocation MiB | speed vs F.cross_entropy |")
    print("|---|---|---|---|---|")
    for precision, dtype in precisions.items():
        autocast = functools.partial(torch.autocast, "cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)
        best = {name: float("inf") for name in sides}
        for _ in range(args.rounds):
            for name, loss_of in sides.items():
                best[name] = min(best[name], _seconds_per_call(loss_of, autocast, hidden, weight, args.repeats))
        reference = best["F.linear + F.cross_entropy"]
        for name, loss_of in sides.items():
            largest = _largest_allocation(loss_of, autocast) / 2**20
            print(f"| {precision} | {name} | {best[name] * 1e3:.1f} | {largest:,.0f} | {reference / best[name]:.2f}x |")


def _ours_in_chunks(elements: int, hidden, weight, target):
    """Our fused loss with chunks of `elements` logits on a CPU."""
    loss_module.CPU_CHUNK_ELEMENTS = elements
    return output_layer_loss(hidden, weight, target, SMOOTHING)


def _seconds_per_call(loss_of, autocast, hidden, weight, repeats: int) -> float:
    def call():
        hidden.grad = weight.grad = None
        with autocast():
            loss = loss_of()
        loss.backward()

    return seconds_per_call(call, repeats)


def _largest_allocation(loss_of, autocast) -> int:
    """Bytes of the largest single CPU allocation of one forward + backward."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as trace:
        with autocast():
            loss = loss_of()
        loss.backward()
    return max(event.cpu_memory_usage for event in trace.events())


if __name__ == "__main__":
    main()

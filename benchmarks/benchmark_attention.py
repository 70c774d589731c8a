#!/usr/bin/env python3
"""Attention forward + backward on translation-length sentences, by kernel, side by side in one run.

A 64,000-token batch of ~40-token sentences is ~1,600 sequences: the flash and memory-efficient
kernels work in 64-128 position tiles, so each short sequence fills a fraction of its tile, while
the plain (math) path runs two batched matrix products and a softmax over small score tensors.
This measures which is faster at the shapes training meets, for the decoder's causal
self-attention and for the padding-masked encoder/cross attention.

    python benchmarks/benchmark_attention.py [--tokens 64000] [--lengths 24 40 64 128] [--dtype bf16]

Without a GPU it answers the CPU's question instead: bf16 q, k, v through PyTorch's fused kernel in
bf16, against our path (`seq2seq.model.execution.attention`: the same kernel in fp32, q, k, v cast in
and the output cast back), which costs training its attention casts, and against the kernel a CPU
training step takes where the fused kernels are built (`seq2seq.model.cpu_attention.flat_attention`:
the same sentences as a stack's flat rows, q | k | v side by side, without the padding positions).

    python benchmarks/benchmark_attention.py --tokens 4000 --heads 4   # on a CPU, the small model's batch
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from seq2seq.model.cpu_attention import flat_attention
from seq2seq.model.cpu_kernels import cpu_kernels
from seq2seq.model.execution import attention

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}  # fmt: skip


def time_ms(function, repeats: int = 20) -> float:
    """Median milliseconds of `function` on the device, timed with CUDA events after warm-up."""
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64000, help="tokens per batch (sequences = tokens / length)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[24, 40, 64, 128])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per cell (CPU): the median is printed")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        return cpu_bf16(args)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    print(f"{torch.cuda.get_device_name()}; {args.tokens} tokens, {args.heads} heads x {args.head_dim}, {args.dtype}; "
          "forward + backward, median ms")  # fmt: skip
    print("| length | attention | " + " | ".join(BACKENDS) + " | fastest |")
    print("|---|---|" + "---|" * (len(BACKENDS) + 1))
    for length in args.lengths:
        batch = args.tokens // length
        shape = (batch, args.heads, length, args.head_dim)
        q, k, v = (torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape, device="cuda", dtype=dtype)
        lengths = torch.randint(length // 2, length + 1, (batch,), device="cuda")
        padding = (torch.arange(length, device="cuda") < lengths[:, None]).view(batch, 1, 1, length)
        for kind, options in (("causal", {"is_causal": True}), ("padding mask", {"attn_mask": padding})):
            row = {}
            for name, backend in BACKENDS.items():

                def run(backend=backend, options=options, inputs=(q, k, v), grad=grad):
                    with sdpa_kernel([backend]):
                        out = F.scaled_dot_product_attention(*inputs, dropout_p=0.1, **options)
                    out.backward(grad)

                try:
                    row[name] = time_ms(run)
                except RuntimeError:  # this kernel does not take these inputs (e.g. flash with a mask)
                    row[name] = None
            cells = [f"{ms:.2f}" if ms is not None else "-" for ms in row.values()]
            fastest = min((ms, name) for name, ms in row.items() if ms is not None)[1]
            print(f"| {length} | {kind} | " + " | ".join(cells) + f" | {fastest} |")
    return 0


def cpu_bf16(args) -> int:
    """bf16 attention on a CPU: the fused kernel in bf16 against ours (fp32 inside) and against the
    kernel from the flat rows, forward + backward."""
    threads = torch.get_num_threads()
    flat = cpu_kernels() is not None
    print(f"CPU, {threads} threads; {args.tokens} tokens, {args.heads} heads x {args.head_dim}, bf16 q, k, v; "
          "forward + backward, median ms")  # fmt: skip
    if not flat:
        print("(the fused CPU kernels are not built here: no column for the kernel from the flat rows)")
    print("| length | attention | fused kernel in bf16 | ours (fp32 inside, cast in and out) | bf16 / ours "
          "| from the flat rows | bf16 / flat rows |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for length in args.lengths:
        batch = args.tokens // length
        shape = (batch, args.heads, length, args.head_dim)
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn(shape, dtype=torch.bfloat16)
        lengths = torch.randint(length // 2, length + 1, (batch,))
        padding = (torch.arange(length) < lengths[:, None]).view(batch, 1, 1, length)
        for kind, mask, causal in (("causal", None, True), ("padding mask", padding, False)):

            def fused_bf16(mask=mask, causal=causal, inputs=(q, k, v), grad=grad):
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
                    F.scaled_dot_product_attention(*inputs, attn_mask=mask, is_causal=causal).backward(grad)

            def ours(mask=mask, causal=causal, inputs=(q, k, v), grad=grad):
                attention(*inputs, mask=mask, is_causal=causal, dropout_p=0.0).backward(grad)

            bf16, fp32_inside = cpu_time_ms(fused_bf16, args.repeats), cpu_time_ms(ours, args.repeats)
            flat_ms = cpu_time_ms(flat_rows_attention(lengths if mask is not None else None, batch, length, args,
                                                      causal=causal), args.repeats) if flat else None  # fmt: skip
            flat_cells = f"{flat_ms:.2f} | {bf16 / flat_ms:.2f}x" if flat else "- | -"
            print(f"| {length} | {kind} | {bf16:.2f} | {fp32_inside:.2f} | {bf16 / fp32_inside:.2f}x | {flat_cells} |")
    return 0


def flat_rows_attention(lengths: torch.Tensor | None, batch: int, length: int, args, *, causal: bool):
    """forward + backward of flat_attention on the batch's sentences as a stack's flat rows: each of
    `lengths` tokens (None: all `length`), q | k | v side by side as the stacked projection writes them."""
    counts = torch.full((batch,), length) if lengths is None else lengths
    spans = torch.stack([counts.cumsum(0) - counts, counts], 1)
    width = args.heads * args.head_dim
    rows = torch.randn(int(counts.sum()), 3 * width, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(rows.size(0), width, dtype=torch.bfloat16)

    def run() -> None:
        flat_attention(rows, None, spans, spans, args.heads, causal=causal).backward(grad)

    return run


def cpu_time_ms(function, repeats: int) -> float:
    """Median wall milliseconds of `function` after warm-up."""
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    sys.exit(main())

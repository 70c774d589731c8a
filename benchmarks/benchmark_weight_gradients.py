#!/usr/bin/env python3
"""A linear layer's weight gradient as the train step computes it, against oneDNN's own primitive for it.

model/cpu_linear.py computes a bf16 layer's weight gradient as `mm(grad.t(), x)`: a product that reads
the output's gradient transposed, which oneDNN ran at about half the rate of the forward product of
the same shapes on AMX (docs/performance.md, tried and not taken: four other layouts of it). oneDNN
has a primitive made for this product, the inner product's backward-weights pass, which PyTorch
exposes as `aten.mkldnn_linear_backward_weights` for tensors in oneDNN's own format: reaching it costs
a copy of the gradient and of the input (`to_mkldnn`), since PyTorch does not export oneDNN's
functions to call it on our tensors in place. This prints, for each distinct linear layer of the
Bible model (d 256, FFN 1024) at --rows rows, side by side in each round:
- the forward product (the rate the backward products could reach);
- `mm(grad.t(), x)`, as shipped;
- the primitive with its two copies, and the copies alone: what the primitive itself takes is the
  difference, what a build that calls it in place would pay.
In bf16 where oneDNN runs it natively, else in fp32 (where the transposed product is not slower).

    python benchmarks/benchmark_weight_gradients.py [--rows 4000] [--rounds 5] [--repeats 5]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from ledger import describe_machine
from timing import seconds_per_call

from seq2seq.model.cpu_linear import onednn_runs_bf16

# (inputs, outputs) of the Bible model's linear layers: q, k, v projected together; an attention's
# output (and the cross-attention's query); the cross-attention's keys and values; the feed-forward pair
LAYERS = ((256, 768), (256, 256), (256, 512), (256, 1024), (1024, 256))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4000, help="tokens in a batch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5, help="calls per side per round")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if onednn_runs_bf16() else torch.float32
    print(f"{describe_machine()}, {args.threads} threads")
    precision = "bf16" if dtype == torch.bfloat16 else "fp32 (oneDNN has no bf16 kernels on this CPU)"
    print(f"{args.rows} rows, {precision}; best of {args.rounds} rounds of {args.repeats} calls per side")
    print("\n| layer | side | ms per call | GFLOP/s | vs the forward product | largest difference from mm |")
    print("|---|---|---|---|---|---|")
    for inputs, outputs in LAYERS:
        x = torch.randn(args.rows, inputs).to(dtype)
        grad = torch.randn(args.rows, outputs).to(dtype)
        weight = (torch.randn(outputs, inputs) * inputs**-0.5).to(dtype)
        bias = torch.zeros(outputs, dtype=dtype)
        sides = _sides(x, grad, weight, bias)
        best = {name: float("inf") for name in sides}
        for _ in range(args.rounds):
            for name, call in sides.items():
                best[name] = min(best[name], seconds_per_call(call, args.repeats))
        shipped = sides["mm(grad.t(), x), as shipped"]().float()
        flops = 2 * args.rows * inputs * outputs
        forward = best["forward product"]
        for name, call in sides.items():
            copies = name.startswith("the two copies")  # not a product: no rate, no ratio, no result
            difference = "-" if copies or name == "forward product" else f"{_largest_difference(call(), shipped):.3g}"
            rate = "-" if copies else f"{flops / best[name] / 1e9:,.0f}"
            ratio = "-" if copies else f"{forward / best[name]:.2f}x"
            print(f"| {inputs}->{outputs} | {name} | {best[name] * 1e3:.2f} | {rate} | {ratio} | {difference} |")


def _sides(x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> dict[str, Callable]:
    if x.dtype == torch.bfloat16:  # as cpu_linear.py runs a bf16 layer's forward pass

        def forward():
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    else:

        def forward():
            return torch.nn.functional.linear(x, weight, bias)

    # the primitive takes the weight only for its shape and wants it dense fp32 whatever the inputs' dtype
    # ("weight needs to be a dense tensor" otherwise); it returns the gradient in fp32
    dense_weight = weight.float()

    def primitive():
        weight_grad, _ = torch.ops.aten.mkldnn_linear_backward_weights(
            grad.to_mkldnn(), x.to_mkldnn(), dense_weight, False
        )
        return weight_grad

    return {
        "forward product": forward,
        "mm(grad.t(), x), as shipped": lambda: torch.mm(grad.t(), x),
        "oneDNN backward weights + copies": primitive,
        "the two copies alone": lambda: (grad.to_mkldnn(), x.to_mkldnn()),
    }


def _largest_difference(weight_grad: torch.Tensor, shipped: torch.Tensor) -> float:
    return (weight_grad.float() - shipped).abs().max().item()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Where a training step's time goes: wall time, device busy time, kernel launches and the top ops.

benchmark_train.py says how fast; this says why. It runs our train step on the same token-bucketed
batches, times --steps steps after --warmup untimed ones (a compiled model compiles in the warm-up:
three times on Transformer-base, README, GPU), then profiles --profile-steps more with
torch.profiler. A step whose wall time is well over its device busy time is bound by the host
(Python and kernel launches), one close to it by the device's kernels; the table of ops by device
time says which. The op census (op_census.py) adds what does not depend on the machine: dtype
conversions per step and the bytes moved by ops that are not matrix products, in all and by op.
Runs on the GPU when there is one, else on the CPU (no device time there).

    python benchmarks/profile_train.py --model base --max-tokens 16000 --precision bf16          # on a GPU
    python benchmarks/profile_train.py --model base --max-tokens 16000 --precision bf16 --compile --warmup 60
    python benchmarks/profile_train.py --precision bf16 --autocast   # bf16 without the working copy (working_copy.py)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchmark_train import DEVICE, MODELS, prepare, step_flops, synchronize, training_order
from op_census import take_census
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from seq2seq.data.batching import make_batch
from seq2seq.model.transformer import build_model
from seq2seq.training.optimizer import build_optimizer
from seq2seq.training.train_step import build_scaler, compile_for_training, train_step
from seq2seq.training.working_copy import working_copy_for

LAUNCH_CALLS = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
# What a kernel does, read off its name (first match wins): the device time of a step by kind of work.
KERNEL_KINDS = [
    ("attention", ("flash", "fmha", "attention", "mem_eff")),
    ("matrix products", ("gemm", "nvjet", "xmma", "cutlass", "sm90_", "sm80_", "ampere_", "wgmma")),
    ("loss (softmax)", ("softmax",)),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("layer norm", ("layer_norm", "layernorm")),
    ("dropout", ("dropout", "philox", "bernoulli")),
    ("compiled (triton)", ("triton",)),
    ("reductions", ("reduce",)),
    ("gather/scatter/index", ("index", "gather", "scatter", "embedding")),
    ("copies/casts", ("copy", "cast", "memcpy", "memset", "cat")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
]


def profile_size(args) -> list[str]:
    """Time and profile our train step at args.max_tokens; print the tables, return the summary row."""
    config, tokenizer, corpus = prepare(args, args.precision)
    total = args.warmup + args.steps + args.profile_steps
    batches = [make_batch(corpus, indices) for indices in training_order(corpus, args.max_tokens, total)]
    torch.manual_seed(config.train.seed)
    model = build_model(config.model, tokenizer).to(DEVICE)
    working = None if args.autocast else working_copy_for(model, args.precision)
    trained = model if working is None else working.model
    forward = compile_for_training(trained) if args.compile else trained
    optimizer, scaler = build_optimizer(model, config.train), build_scaler(DEVICE, args.precision)

    def step(batch) -> None:
        train_step(model, optimizer, scaler, [batch], update_tokens=batch.num_tokens, lr=1e-4,
                   config=config.train, forward=forward, working=working)  # fmt: skip

    profile_from = args.warmup + args.steps
    warmup, timed, profiled = batches[: args.warmup], batches[args.warmup : profile_from], batches[profile_from:]
    for batch in warmup:
        step(batch)
    synchronize()
    start = time.perf_counter()
    for batch in timed:
        step(batch)
    synchronize()
    wall = (time.perf_counter() - start) / len(timed)
    cfg = config.model
    flops = sum(step_flops(b, cfg.d_model, cfg.ffn_dim, cfg.encoder_layers, tokenizer.tgt_vocab_size) for b in timed)
    tokens = sum(b.num_tokens for b in timed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE.type == "cuda" else [])
    with profile(activities=activities) as trace:
        for batch in profiled:
            step(batch)
        synchronize()
    events = trace.key_averages()
    per_step = len(profiled)
    counted = take_census(lambda: [step(batch) for batch in profiled])
    census = counted.per_step(per_step)
    # the device's kernels, summed as torch.profiler's table sums them
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    busy = sum(e.self_device_time_total for e in kernels) / per_step / 1e3
    launches = sum(e.count for e in events if e.key in LAUNCH_CALLS) / per_step
    sort_by = "self_device_time_total" if DEVICE.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=70))
    title = (f"{args.model} {args.precision}{' compiled' if args.compile else ''} on {DEVICE.type}, "
             f"{args.max_tokens} tokens/batch, {len(timed)} timed steps after {len(warmup)}")  # fmt: skip
    print(f"{title}:")
    print(f"  {wall * 1e3:.1f} ms/step, {tokens / len(timed) / wall:,.0f} target tokens/s, "
          f"{flops / len(timed) / wall / 1e12:.1f} model TFLOP/s")  # fmt: skip
    print("  per step, whatever the machine (op census): " + ", ".join(f"{v:,.1f} {k}" for k, v in census.items()))
    print("  MB moved by other ops, per step, the largest:")
    for name, moved in counted.by_op.most_common(args.rows):
        print(f"    {name:<34} {moved / per_step / 1e6:8.1f} MB {moved / max(counted.other_bytes, 1):6.1%}")
    print("  dtype conversions, per step, by op:")
    for name, count in counted.conversions_by_op.most_common(args.rows):
        print(f"    {name:<34} {count / per_step:8.1f}")
    if DEVICE.type == "cuda":
        print(f"  device busy {busy:.1f} ms/step ({busy / (wall * 1e3):.0%} of the wall time), "
              f"{launches:,.0f} kernel launches/step (profiled steps)")  # fmt: skip
        print("  device time by kind of kernel (ms/step, launches/step):")
        for kind, (ms, count) in kernel_kinds(kernels, per_step).items():
            print(f"    {kind:<22} {ms:6.2f} ms {ms / busy:5.0%} {count:7,.0f}")
    return [f"{args.max_tokens:,}", f"{wall * 1e3:.1f}", f"{tokens / len(timed) / wall:,.0f}",
            f"{flops / len(timed) / wall / 1e12:.1f}", f"{busy:.1f}" if DEVICE.type == "cuda" else "-",
            f"{launches:,.0f}" if DEVICE.type == "cuda" else "-", f"{census['dtype conversions']:,.0f}",
            f"{census['other MB moved']:,.0f}"]  # fmt: skip


def kernel_kinds(kernels, per_step: int) -> dict[str, tuple[float, float]]:
    """Device ms and launches per step, summed by KERNEL_KINDS (unmatched names: "other")."""
    totals: dict[str, list[float]] = {}
    for event in kernels:
        name = event.key.lower()
        kind = next((kind for kind, words in KERNEL_KINDS if any(w in name for w in words)), "other")
        entry = totals.setdefault(kind, [0.0, 0.0])
        entry[0] += event.self_device_time_total / per_step / 1e3
        entry[1] += event.count / per_step
    return dict(sorted(((k, (v[0], v[1])) for k, v in totals.items()), key=lambda item: -item[1][0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/bible_en_es.yaml"))
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[4000], help="one or more batch sizes")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model, as train.compile does")
    parser.add_argument("--autocast", action="store_true", help="bf16 by autocast alone, without the working copy")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=15, help="rows of each table of ops")
    parser.add_argument("--set", action="append", default=[], help="extra config override (repeatable)")
    args = parser.parse_args()
    if args.steps < 1 or args.profile_steps < 1:
        parser.error("--steps and --profile-steps: expected at least 1 (the census counts the profiled steps)")
    torch.set_num_threads(args.threads)
    sizes = args.max_tokens
    summary = []
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        for max_tokens in sizes:
            args.max_tokens = max_tokens
            # each size compiles afresh, as in a run of its own: dynamo's recompile limit counts per code
            # object, not per model, so a second size ran eagerly past the first's compiles (ledger, H100)
            torch.compiler.reset()
            summary.append(profile_size(args))
    print(
        "\n| tokens/batch | ms/step | target tokens/s | model TFLOP/s | device busy ms/step | launches/step "
        "| dtype conversions/step | MB moved by other ops/step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in summary:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

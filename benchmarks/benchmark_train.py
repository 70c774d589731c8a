#!/usr/bin/env python3
"""Training throughput of our trainer against a hand-written torch.nn.Transformer loop, side by side.

All sides train the same model on the same encoded data and the very same token-bucketed batches,
each in its own process (so peak memory is its own). The reference is what a careful user writes
by hand: nn.Transformer with embeddings, sinusoidal positions, padding and causal masks,
label-smoothed nn.CrossEntropyLoss, Adam and clipping, in fp32. Tokens/s count real (non-pad)
target tokens; MFU divides the model's matmul FLOPs per second by the device's matmul rate,
measured here for each precision (its best over short windows, before and after the sides). Runs
on the GPU when there is one (memory is then the GPU caching allocator's), else on the CPU (RSS).

Batches are built inside the timed loop, as in a real run, epoch after epoch for as many steps as
asked: with --steps 2000 it is a long run that shows steady state. Every --memory-every steps the
script records memory now and at its highest since the last record (the window peak: on CPU our
sides return the heap's free pages to the kernel every HEAP_TRIM_EVERY steps, as the trainer does
(seq2seq/training/host_memory.py), so memory now is a sawtooth and the window's top, read from the kernel's
high-water mark, is what shows growth). It prints the records and how much the window peak grew after the first tenth of
the run, and --plot writes them as a PNG. The side "ours bf16 untrimmed" leaves the heap release
out, to measure what it costs and saves (each side's page faults and kernel CPU time a step say what
its re-faulted memory costs); "ours bf16 autocast" trains without the bf16 working copy
(seq2seq/training/working_copy.py), casting each weight at each use, to measure what that saves;
"ours fp32 unfused" and "ours bf16 unfused" train without the fused CPU kernels
(seq2seq/model/cpu_kernels.py), PyTorch's operations alone.

    python benchmarks/benchmark_train.py [--config configs/bible_en_es.yaml] [--steps 20]
    python benchmarks/benchmark_train.py --steps 2000 --plot memory.png   # a long run
    python benchmarks/benchmark_train.py --steps 600 --sides "ours bf16" "ours bf16 untrimmed"  # the heap release
    python benchmarks/benchmark_train.py --steps 200 --sides "reference fp32" "ours bf16 autocast" "ours bf16"
    python benchmarks/benchmark_train.py --steps 200 --sides "reference fp32" "ours bf16 unfused" "ours bf16"
    python benchmarks/benchmark_train.py --model base --max-tokens 16000 --sides "ours bf16"   # on a GPU
    python benchmarks/benchmark_train.py --sides "ours bf16" --warmup 30 --steps 200 --compile --gpu-code-path
"""

from __future__ import annotations

import argparse
import itertools
import math
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from ledger import describe_machine
from torch import nn

import seq2seq.model.dropout as dropout_module
from seq2seq.config import Config
from seq2seq.config_files import load_config
from seq2seq.data.batching import epoch_batches, make_batch, padding_fraction
from seq2seq.data.encoded import EncodedCorpus
from seq2seq.data.prepare import encode_training_split, stream_split
from seq2seq.data.special_tokens import PAD_ID
from seq2seq.data.tokenizer import Tokenizer, load_or_train_tokenizer
from seq2seq.errors import UserInputError
from seq2seq.model.cpu_kernels import SWITCH as CPU_KERNELS_SWITCH
from seq2seq.model.cpu_linear import mm
from seq2seq.model.embedding import sinusoidal_positions
from seq2seq.model.rows import Rows
from seq2seq.model.transformer import build_model
from seq2seq.training.host_memory import HEAP_TRIM_EVERY, release_free_heap
from seq2seq.training.optimizer import build_optimizer
from seq2seq.training.precision import cpu_has_native_bf16
from seq2seq.training.run_log import PeakRss, current_rss_mb, peak_memory_mb
from seq2seq.training.train_step import build_scaler, compile_for_training, train_step
from seq2seq.training.working_copy import working_copy_for

COMMON = ["model.norm=post", "model.dropout=0.1", "model.share_embeddings=true"]
MODELS = {  # the CPU model, and Transformer-base of "Attention Is All You Need"
    "small": ["model.d_model=256", "model.heads=4", "model.ffn_dim=1024", "model.encoder_layers=3",
              "model.decoder_layers=3", *COMMON],
    "base": ["model.d_model=512", "model.heads=8", "model.ffn_dim=2048", "model.encoder_layers=6",
             "model.decoder_layers=6", *COMMON],
}  # fmt: skip
# untrimmed: without host_memory; fp16 (loss-scaled) is meant for CUDA: our trainer refuses it on a CPU
SIDES = (
    "reference fp32",
    "ours fp32",
    "ours bf16",
    "ours bf16 untrimmed",
    "ours bf16 autocast",
    "ours fp16",
    "ours fp32 unfused",
    "ours bf16 unfused",
)
TARGET_SPEEDUP = {"fp32": 1.8, "bf16": 2.2, "fp16": 2.2}  # over the reference, equal windows (issue "Start here")
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


def matmul_rate(dtype: torch.dtype, windows: int = 10, seconds: float = 0.2) -> float:
    """FLOP/s of a large matmul on this device, in the given precision: the best of `windows` short
    windows, the rate the device reaches. An average over one long window took in whatever else the
    (shared, virtual) machine was doing then, and so varied from run to run with it, and the MFU
    divided by it with it. Through cpu_linear.mm, as the model's bf16 products run: in fp32 on a CPU
    without bf16 kernels."""
    n, k = (8192, 8192) if DEVICE.type == "cuda" else (2048, 1024)
    a, b = torch.randn(n, k, dtype=dtype, device=DEVICE), torch.randn(k, k, dtype=dtype, device=DEVICE)
    mm(a, b)
    synchronize()
    best = 0.0
    for _ in range(windows):
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            mm(a, b)
            synchronize()
            count += 1
        best = max(best, count * 2 * n * k * k / (time.perf_counter() - start))
    return best


def matmul_rates() -> dict[str, float]:
    """matmul_rate in fp32 and in bf16."""
    return {"fp32": matmul_rate(torch.float32), "bf16": matmul_rate(torch.bfloat16)}


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


@dataclass(frozen=True)
class MemorySample:
    """MiB at a step: RSS on CPU, reserved by the caching allocator on a GPU; now and at its highest
    since the previous sample."""

    step: int
    now: float
    window_peak: float


@dataclass(frozen=True)
class Timing:
    tokens_per_second: float
    flops_per_second: float
    memory: list[MemorySample]
    peak_memory: float  # MiB, the whole process: RSS on CPU, allocated on a GPU
    # the process's minor page faults and kernel CPU ms a step over the timed steps: memory handed back
    # to the kernel (host_memory.py's heap trim, glibc's own trims and unmaps) is faulted in afresh
    page_faults_per_step: float
    system_ms_per_step: float


class MemoryWindow:
    """The memory this benchmark reports, in MiB: on CPU the RSS, with its peak since the previous
    sample (run_log.PeakRss); on a GPU the caching allocator's reserved memory, which only grows
    unless emptied, so that its value now is also its peak."""

    def __init__(self) -> None:
        self._rss = PeakRss() if DEVICE.type == "cpu" else None

    def take(self, step: int) -> MemorySample:
        if self._rss is None:
            reserved = torch.cuda.memory_reserved() / 2**20
            return MemorySample(step, reserved, reserved)
        peak, now = self._rss.take(), current_rss_mb()
        return MemorySample(step, now, now if peak is None else peak)

    def process_peak(self) -> float:
        """Peak RSS of the process on CPU (up to the last take), peak allocated on a GPU."""
        return self._rss.process_peak if self._rss is not None else peak_memory_mb(DEVICE)


def training_order(corpus: EncodedCorpus, max_tokens: int, count: int) -> list[np.ndarray]:
    """The first `count` batches (index arrays) of a run: epoch 1's seeded order, then epoch 2's, ..."""
    order: list[np.ndarray] = []
    for epoch in itertools.count(1):
        order += epoch_batches(corpus, max_tokens=max_tokens, seed=1, epoch=epoch)
        if len(order) >= count:
            return order[:count]


def timed_steps(args, steps: int, step, corpus: EncodedCorpus, flops_of, *, release_heap: bool = False) -> Timing:
    """Tokens/s and model FLOP/s over `steps` steps after args.warmup untimed ones, with memory samples.

    With `release_heap`, the heap's free pages go back to the kernel every HEAP_TRIM_EVERY steps,
    after memory was read, as the trainer does.
    """
    order = training_order(corpus, args.max_tokens, args.warmup + steps)
    for indices in order[: args.warmup]:
        step(make_batch(corpus, indices))
    tokens, flops, memory, window = 0, 0.0, [], MemoryWindow()  # its first window: from the end of the warmup
    synchronize()
    usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for number, indices in enumerate(order[args.warmup :], start=1):
        batch = make_batch(corpus, indices)
        tokens, flops = tokens + batch.num_tokens, flops + flops_of(batch)
        step(batch)
        if number % args.memory_every == 0 or number == steps:
            memory.append(window.take(number))
        if release_heap and number % HEAP_TRIM_EVERY == 0:
            release_free_heap()
    synchronize()
    seconds, used = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    faults, system_ms = (used.ru_minflt - usage.ru_minflt) / steps, (used.ru_stime - usage.ru_stime) * 1e3 / steps
    return Timing(tokens / seconds, flops / seconds, memory, window.process_peak(), faults, system_ms)


def side_precision(side: str) -> str:
    """The training precision a side names ("ours bf16 untrimmed" -> bf16)."""
    return side.split()[1]


def run_the_gpu_code_path() -> None:
    """Our model as a GPU runs it, in this process: every position computed (PAD ones too) and
    PyTorch's dropout, the two CPU-only choices at which torch.compile breaks its graph on a CPU."""
    Rows.of = classmethod(lambda cls, keep, multiple: cls(keep.size(0), keep.size(1), multiple))
    dropout_module.dropout = lambda x, p, *, training: F.dropout(x, p, training=training)
    os.environ[CPU_KERNELS_SWITCH] = "0"  # the residual's dropout_add too


def run_side(args, side: str, queue) -> None:
    torch.set_num_threads(args.threads)
    if side.endswith("unfused"):  # this process never builds or loads the fused CPU kernels
        os.environ[CPU_KERNELS_SWITCH] = "0"
    if args.gpu_code_path:
        run_the_gpu_code_path()
    config, tokenizer, corpus = prepare(args, side_precision(side))
    cfg, vocab = config.model, tokenizer.tgt_vocab_size
    steps = args.steps  # every side: the same window of the same batches, so the ratios compare like with like

    def flops_of(batch):
        return step_flops(batch, cfg.d_model, cfg.ffn_dim, cfg.encoder_layers, vocab)

    if side.startswith("ours"):
        torch.manual_seed(config.train.seed)
        model = build_model(cfg, tokenizer).to(DEVICE)
        autocast_only = side.endswith("autocast")  # the bf16 path before working copies, for comparison
        working = None if autocast_only else working_copy_for(model, config.train.precision)
        trained = model if working is None else working.model
        forward = compile_for_training(trained) if args.compile else trained
        optimizer, scaler = build_optimizer(model, config.train), build_scaler(DEVICE, config.train.precision)

        def our_step(batch):
            train_step(model, optimizer, scaler, [batch], update_tokens=batch.num_tokens, lr=1e-4,
                       config=config.train, forward=forward, working=working)  # fmt: skip

        release_heap = DEVICE.type == "cpu" and not side.endswith("untrimmed")
        timing = timed_steps(args, steps, our_step, corpus, flops_of, release_heap=release_heap)
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

        timing = timed_steps(args, steps, reference_step, corpus, flops_of)
    padding = padding_fraction(corpus, training_order(corpus, args.max_tokens, args.warmup + steps))
    queue.put((side, steps, timing, padding))


def multiplies_in_half_precision() -> bool:
    """Whether this device multiplies in bf16 natively (a GPU, AVX-512-bf16 or AMX): where the bf16 side
    is worth running by default and its target applies."""
    return DEVICE.type == "cuda" or cpu_has_native_bf16()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("configs/bible_en_es.yaml"))
    parser.add_argument("--model", choices=sorted(MODELS), default="small", help="small: d 256, 3+3; base: d 512, 6+6")
    parser.add_argument("--sides", nargs="+", choices=SIDES, help="default: the reference, ours fp32, and ours bf16 "
                        "where this machine runs bf16 natively (precision.py)")  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="our sides under torch.compile")
    parser.add_argument(
        "--gpu-code-path",
        action="store_true",
        help="our sides run the model's GPU code path on a CPU (what compiles as one graph)",
    )
    parser.add_argument("--set", action="append", default=[], help="extra config override (repeatable)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-every", type=int, default=100, help="steps between memory samples")
    parser.add_argument("--plot", type=Path, help="write memory over steps, per side, as this PNG")
    args = parser.parse_args()
    try:
        load_config(args.config)
    except UserInputError as error:
        print(f"error: {error}\n(configs/bible_en_es.yaml needs scripts/prepare_bible.py first; "
              "configs/demo.yaml needs `make demo`)", file=sys.stderr)  # fmt: skip
        return 2
    torch.set_num_threads(args.threads)
    if args.sides is None:
        args.sides = list(SIDES[:3]) if multiplies_in_half_precision() else list(SIDES[:2])
    rates = matmul_rates()
    context = multiprocessing.get_context("spawn")
    results = {}
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        prepare(args)  # tokenizer and encoding cache, once, before anything is timed
        preparation_peak = peak_memory_mb(torch.device("cpu"))
        for side in args.sides:
            queue = context.Queue()
            process = context.Process(target=run_side, args=(args, side, queue))
            process.start()
            results[side] = queue.get()[1:]
            process.join()
    after = matmul_rates()  # the machine's best, before or after the sides
    rates = {precision: max(rate, after[precision]) for precision, rate in rates.items()}
    report(args, rates, results, preparation_peak)
    return 0


def report(args, rates: dict[str, float], results: dict, preparation_peak: float) -> None:
    device = describe_machine() + ("" if DEVICE.type == "cuda" else f", {args.threads} threads")
    print(
        f"config {args.config} + {' '.join(MODELS[args.model])}{' (compiled)' if args.compile else ''}"
        f"{' (the GPU code path)' if args.gpu_code_path else ''}"
    )
    print(f"{device}; {args.max_tokens} tokens/batch (the same batches for every side, epoch after epoch)")
    print(f"matmul rate here: fp32 {rates['fp32'] / 1e9:,.0f} GFLOP/s, bf16 {rates['bf16'] / 1e9:,.0f} GFLOP/s")
    print(f"tokenizer training and encoding (before the sides, in the main process): peak RSS "
          f"{preparation_peak:,.0f} MiB")  # fmt: skip
    memory = "GPU reserved" if DEVICE.type == "cuda" else "RSS"
    peak = "GPU allocated" if DEVICE.type == "cuda" else "RSS"  # MemoryWindow.process_peak
    print(f"\n| trainer | steps | target tokens/s (whole run) | MFU | padding | peak {peak} | window peak {memory} "
          "at 10% of the run -> end | page faults/step | system CPU ms/step |\n" + "|---" * 9 + "|")  # fmt: skip
    for side, (steps, timing, padding) in results.items():
        mfu = timing.flops_per_second / rates["fp32" if side_precision(side) == "fp32" else "bf16"]
        early, last = early_sample(timing.memory, steps), timing.memory[-1]
        growth = (f"{early.window_peak:,.0f} (step {early.step}) -> {last.window_peak:,.0f} MiB "
                  f"({last.window_peak / early.window_peak - 1:+.1%})")  # fmt: skip
        print(f"| {side} | {steps} | {timing.tokens_per_second:,.0f} | {mfu:.0%} | {padding:.1%} "
              f"| {timing.peak_memory:,.0f} MiB | {growth} | {timing.page_faults_per_step:,.0f} "
              f"| {timing.system_ms_per_step:,.1f} |")  # fmt: skip
    print(f"\n{memory} MiB at steps, now / highest since the previous sample:")
    for side, (_, timing, _) in results.items():
        print(f"{side}: " + ", ".join(f"{s.step}: {s.now:,.0f}/{s.window_peak:,.0f}" for s in timing.memory))
    if "reference fp32" in results:
        reference = results["reference fp32"][1].tokens_per_second
        for side in results:
            if side.startswith("ours"):
                ratio = results[side][1].tokens_per_second / reference
                precision = side_precision(side)
                if precision == "fp32" or multiplies_in_half_precision():
                    print(f"{side} / reference: {ratio:.2f}x (target >= {TARGET_SPEEDUP[precision]}x)")
                else:  # the half-precision targets are for hardware that multiplies in it
                    print(f"{side} / reference: {ratio:.2f}x (no target: no native {precision} here)")
    if args.plot:
        plot_memory(args.plot, results, memory)
        print(f"memory over steps: {args.plot}")


def early_sample(samples: list[MemorySample], steps: int) -> MemorySample:
    """The first sample at or after a tenth of the run (the issue's step 200 of 2,000)."""
    return next(sample for sample in samples if sample.step >= steps // 10)


def plot_memory(path: Path, results: dict, memory: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for side, (_, timing, _) in results.items():
        steps = [sample.step for sample in timing.memory]
        peaks = [sample.window_peak for sample in timing.memory]
        (line,) = ax.plot(steps, peaks, marker=".", label=f"{side}: window peak")
        now = [sample.now for sample in timing.memory]
        ax.plot(steps, now, color=line.get_color(), alpha=0.4, label=f"{side}: now")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{memory} (MiB)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())

"""Which training precision the hardware runs natively: the rule behind `train.precision: auto`.

bf16 halves the bytes of every activation and, where the hardware has bf16 arithmetic, doubles the
matrix rate. Where it has none, bf16 is emulated and no faster than fp32: on an AVX2-only CPU the
model computes its bf16 products in fp32 and rounds them (model/cpu_linear.py), and elsewhere
oneDNN's emulation can be slower than fp32 (docs/performance.md). The rule:

* a CUDA GPU: bf16 where the GPU has bf16 arithmetic (compute capability 8.0, Ampere, and newer;
  `torch.cuda.is_bf16_supported()` also says yes where bf16 is only emulated, on a V100 or a T4),
  else fp16 with loss scaling;
* a CPU: bf16 where oneDNN runs bf16 matmuls (`torch.ops.mkldnn._is_mkldnn_bf16_supported()`:
  AVX-512 or AMX on x86, bf16 instructions on Arm) *and* a short measured probe finds a bf16 matmul
  clearly faster than an fp32 one (by BF16_MARGIN: AVX-512 without bf16 instructions passes the
  first test but emulates bf16, and a near tie is noise that could flip between two starts); fp32
  otherwise. The probe runs only where the first test passed, so an AVX2 CPU pays nothing for it.

A run decides once, when it starts: a resumed run keeps the precision it recorded (the probe is
noisy, and a precision that changed midway would change the run). An explicit bf16 on a CPU that
would emulate it is kept (the user asked for it) with one warning that says how it is emulated.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass

import torch

from seq2seq.model.cpu_linear import onednn_runs_bf16

log = logging.getLogger(__name__)

PROBE_SHAPE = (256, 512, 512)  # (rows, inner, columns): a linear layer of a small translation model
PROBE_SECONDS = 0.05  # per precision; at 1 GFLOP/s one product alone takes ~0.13 s, which ends the probe
BF16_MARGIN = 1.2  # auto takes bf16 on a CPU only where its matmul is at least this much faster than fp32
CUDA_BF16_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores


@dataclass(frozen=True)
class MatmulRates:
    """GFLOP/s of one matmul shape on this CPU, in fp32 and in bf16."""

    fp32: float
    bf16: float


@dataclass(frozen=True)
class Choice:
    """The precision a run uses and the one-line reason the log gives for it."""

    precision: str
    reason: str


def _rate(dtype: torch.dtype) -> float:
    rows, inner, columns = PROBE_SHAPE
    a, b = torch.randn(rows, inner).to(dtype), torch.randn(inner, columns).to(dtype)
    a @ b  # first call: kernel creation
    count, start = 0, time.perf_counter()
    while count == 0 or time.perf_counter() - start < PROBE_SECONDS:
        a @ b
        count += 1
    return count * 2 * rows * inner * columns / (time.perf_counter() - start) / 1e9


@functools.cache
def cpu_matmul_rates() -> MatmulRates:
    """Measured once per process."""
    return MatmulRates(fp32=_rate(torch.float32), bf16=_rate(torch.bfloat16))


def cpu_has_native_bf16() -> bool:
    """oneDNN runs bf16 here and a measured bf16 matmul is faster than fp32 by BF16_MARGIN."""
    if not onednn_runs_bf16():
        return False
    rates = cpu_matmul_rates()
    return rates.bf16 >= BF16_MARGIN * rates.fp32


def cuda_has_native_bf16(device: torch.device) -> bool:
    """The GPU does bf16 arithmetic in hardware (compute capability 8.0 or more)."""
    return torch.cuda.get_device_capability(device) >= CUDA_BF16_CAPABILITY


def choose_precision(requested: str, device: torch.device, *, recorded: str | None = None) -> Choice:
    """The precision to train with on `device` for the configured `requested` (auto, fp32, bf16, fp16).
    `recorded`: what a resumed run resolved when it started, which auto keeps."""
    runnable = ("fp32", "bf16", "fp16") if device.type == "cuda" else ("fp32", "bf16")
    if requested == "auto" and recorded in runnable:
        return Choice(recorded, "auto: kept from the run's start; set train.precision to change it")
    if requested != "auto":
        if requested == "bf16" and device.type == "cpu" and not onednn_runs_bf16():
            log.warning(
                "bf16 on this CPU is emulated: its matrix products run in fp32 and are rounded to bf16 "
                "(model/cpu_linear.py), no faster than fp32; use train.precision auto or fp32"
            )
        elif requested == "bf16" and device.type == "cpu" and not cpu_has_native_bf16():
            rates = cpu_matmul_rates()
            log.warning(
                "bf16 on this CPU is emulated: matmul %.0f GFLOP/s vs %.0f in fp32; use train.precision auto or fp32",
                rates.bf16,
                rates.fp32,
            )
        return Choice(requested, "as configured")
    if device.type == "cuda":
        if cuda_has_native_bf16(device):
            return Choice("bf16", f"auto: {torch.cuda.get_device_name(device)} runs bf16 natively")
        return Choice(
            "fp16", f"auto: {torch.cuda.get_device_name(device)} has no bf16 arithmetic; fp16 with loss scaling"
        )
    if cpu_has_native_bf16():
        rates = cpu_matmul_rates()
        return Choice(
            "bf16", f"auto: this CPU runs bf16 natively (matmul {rates.bf16:.0f} GFLOP/s, fp32 {rates.fp32:.0f})"
        )
    if onednn_runs_bf16():
        rates = cpu_matmul_rates()
        return Choice(
            "fp32",
            f"auto: bf16 is not {BF16_MARGIN:g}x fp32 on this CPU (matmul {rates.bf16:.0f} vs "
            f"{rates.fp32:.0f} GFLOP/s)",
        )
    return Choice("fp32", "auto: this CPU has no bf16 arithmetic (oneDNN has no bf16 kernels for it)")

"""Dropout whose mask is cheap to draw on CPU.

PyTorch's CPU dropout draws one Bernoulli sample per element through its serial generator, 17 times
per training step of the d 256, 3+3 model: a visible share of a bf16 step on a CPU (profile_train
in the ledger). Here each element gets 16 random bits, drawn 64 at a time from the same seeded
generator (so runs stay reproducible and resume exactly), and is dropped when they fall under
p x 65,536, in a fraction of bernoulli_'s time. The drop probability
is p rounded to a multiple of 1/65,536 (0.1 becomes 0.100006) and kept elements are scaled by
1 / (1 - that probability), so the expected output is still the input. On GPUs PyTorch's fused
kernel is fast already and is used as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_LEVELS = 1 << 16  # 16 random bits per element


def dropout(x: Tensor, p: float, *, training: bool) -> Tensor:
    """F.dropout(x, p, training), with the cheap mask on CPU."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or round(p * _LEVELS) >= _LEVELS:
        return F.dropout(x, p, training=True)
    return _MaskedScale.apply(x, p)


class Dropout(nn.Module):
    """nn.Dropout with the cheap CPU mask."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, training=self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def drop_mask(shape: torch.Size, p: float) -> tuple[Tensor, float]:
    """A bool mask of `shape`, True where an element is dropped, and the scale for the kept ones."""
    return _draw(shape, p, kept_as=None), _scale(p)


def _kept_mask(shape: torch.Size, p: float, dtype: torch.dtype) -> tuple[Tensor, float]:
    """drop_mask's complement as 1s and 0s of `dtype`, from the same draws: in bf16, multiplying by it
    takes a fraction of the time masked_fill takes (benchmarks/profile_train.py), at 2 bytes an element."""
    return _draw(shape, p, kept_as=dtype), _scale(p)


def _draw(shape: torch.Size, p: float, *, kept_as: torch.dtype | None) -> Tensor:
    """16 uniform random bits per element of `shape`, compared with the level under which an element
    is dropped: True where dropped, or (kept_as a dtype) 1 where kept and 0 where dropped. The bits are
    a dtype view of int64 draws, so they never leave this function (torch.compile fails on such a
    view passed between functions)."""
    count = shape.numel()
    words = torch.empty((count + 3) // 4, dtype=torch.int64).random_(-(2**63), None)  # 64 uniform bits each
    bits = words.view(torch.int16)[:count].view(shape)  # uniform over [-32768, 32767]
    threshold = round(p * _LEVELS) - _LEVELS // 2
    if kept_as is None:
        return bits < threshold
    return torch.ge(bits, threshold, out=torch.empty(shape, dtype=kept_as))


def _scale(p: float) -> float:
    return _LEVELS / (_LEVELS - round(p * _LEVELS))


class _MaskedScale(torch.autograd.Function):
    """x with the dropped elements zeroed and the kept ones scaled; the gradient masked alike. A
    half-precision x is multiplied by a mask of 1s and 0s in its dtype; an fp32 one is masked_fill'ed
    through a bool mask, a quarter of the memory kept for the backward pass."""

    @staticmethod
    def forward(ctx, x: Tensor, p: float) -> Tensor:
        half = x.element_size() <= 2
        mask, scale = _kept_mask(x.shape, p, x.dtype) if half else drop_mask(x.shape, p)
        ctx.save_for_backward(mask)
        ctx.scale = scale
        return _apply(x, mask, scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (mask,) = ctx.saved_tensors
        return _apply(grad, mask, ctx.scale), None


def _apply(x: Tensor, mask: Tensor, scale: float) -> Tensor:
    """x * scale where kept, 0 where dropped: `mask` is drop_mask's bools or _kept_mask's 1s and 0s."""
    if mask.dtype == torch.bool:
        return x.masked_fill(mask, 0).mul_(scale)
    return (x * mask).mul_(scale)

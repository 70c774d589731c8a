"""Dropout whose mask is cheap to draw on CPU.

PyTorch's CPU dropout draws one Bernoulli sample per element through its serial generator, 17 times
per training step of the d 256, 3+3 model: a visible share of a bf16 step on a CPU (profile_train
in the ledger). Here each element gets 16 random bits, drawn 64 at a time from the same seeded
generator (so runs stay reproducible and resume exactly), and is dropped when they fall under
p x 65,536, in a fraction of bernoulli_'s time. The drop probability
is p rounded to a multiple of 1/65,536 (0.1 becomes 0.100006) and kept elements are scaled by
1 / (1 - that probability), so the expected output is still the input. On GPUs PyTorch's fused
kernel is fast already and is used as is; so is it under torch.compile, which fuses the draws into
its own kernels and cannot trace the bits' dtype view (a graph break in every layer).

Where the fused CPU kernels are built (cpu_kernels.py), drawing the bits, masking and scaling (and
the residual connection's addition, `dropout_add`) are one pass over memory, where they were four
or five: the bits come from a counter-based generator keyed by one draw from PyTorch's generator per
call, so the backward pass draws the same mask again from the key instead of keeping it. The masks
differ from those of the PyTorch path; each path is reproducible from the seed. The LayerNorm that
reads the residual addition's sum joins that pass too: a post-norm block's own
(`dropout_add_norm_for_two`), or in a pre-norm stack the next block's (`dropout_add_then_norm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.model.cpu_kernels import cpu_kernels

_LEVELS = 1 << 16  # 16 random bits per element


def dropout(x: Tensor, p: float, *, training: bool) -> Tensor:
    """F.dropout(x, p, training), with the cheap mask on CPU."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or torch.compiler.is_compiling() or not cheap_mask_fits(p):
        return F.dropout(x, p, training=True)
    if _fused(x):
        return _FusedDropout.apply(x, None, p)
    return _MaskedScale.apply(x, p)


def dropout_add(residual: Tensor, x: Tensor, p: float, *, training: bool) -> Tensor:
    """residual + dropout(x, p, training=training), in one pass on a CPU where the fused kernels are built."""
    alike = residual.shape == x.shape and residual.dtype == x.dtype
    if training and p > 0.0 and cheap_mask_fits(p) and alike and _fused(x) and _fused(residual):
        return _FusedDropout.apply(x, residual, p)
    return residual + dropout(x, p, training=training)


def dropout_add_norm_for_two(
    residual: Tensor, x: Tensor, norm: nn.LayerNorm, p: float, *, training: bool
) -> tuple[Tensor, Tensor]:
    """norm(residual + dropout(x, p)), post-norm's residual connection, twice: for its two uses in the
    next block (its residual and its sublayer's input). In one pass each way on a CPU where the fused
    kernels are built (cpu_residual_norm.cpp), with dropout_add's mask; there the two are views of one
    tensor, whose gradients reach the backward kernel apart and are added as it reads them: used as
    one tensor, autograd would add them first, a pass over the rows of its own."""
    if _norm_fuses(residual, x, norm, p, training):
        return _FusedDropoutAddNorm.apply(residual, x, norm.weight, norm.bias, p, norm.eps, False)
    out = norm(dropout_add(residual, x, p, training=training))
    return out, out


def dropout_add_then_norm(
    residual: Tensor, x: Tensor, norm: nn.LayerNorm, p: float, *, training: bool
) -> tuple[Tensor, Tensor]:
    """(residual + dropout(x, p), norm of that sum): a pre-norm block's output and the input of the
    sublayer after it, whose LayerNorm (the next block's, or the stack's last) reads the sum. In one
    pass each way on a CPU where the fused kernels are built (cpu_residual_norm.cpp), with
    dropout_add's mask; there the sum's two gradients, its own and the one through the LayerNorm, are
    added as the kernel reads them, where autograd would add them in a pass of their own."""
    if _norm_fuses(residual, x, norm, p, training):
        return _FusedDropoutAddNorm.apply(residual, x, norm.weight, norm.bias, p, norm.eps, True)
    out = dropout_add(residual, x, p, training=training)
    return out, norm(out)


def _norm_fuses(residual: Tensor, x: Tensor, norm: nn.LayerNorm, p: float, training: bool) -> bool:
    """Whether residual + dropout(x, p) and its LayerNorm take cpu_residual_norm.cpp's kernel."""
    alike = residual.shape == x.shape and residual.dtype == x.dtype == norm.weight.dtype
    return training and p > 0.0 and cheap_mask_fits(p) and alike and _fused(x) and _fused(residual)


def _fused(x: Tensor) -> bool:
    """Whether x takes the fused CPU kernel (not while torch.compile traces: it has no graph for it)."""
    if torch.compiler.is_compiling() or x.device.type != "cpu":
        return False
    return x.dtype in (torch.float32, torch.bfloat16) and cpu_kernels() is not None


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


def cheap_mask_fits(p: float) -> bool:
    """Whether the cheap mask's 16-bit draws can drop at rate p (not at p = 1, or so close to it that
    every element would be dropped)."""
    return round(p * _LEVELS) < _LEVELS


def kernel_mask(p: float) -> tuple[Tensor, int, float]:
    """What a fused kernel draws dropout's mask from: a key (one draw from the seeded generator, which
    keys the kernel's counter-based stream; none at p = 0, where nothing is dropped), the level under
    which an element's 16 bits drop it, and the kept elements' scale."""
    if p == 0.0:
        return torch.zeros((), dtype=torch.int64), 0, 1.0
    return torch.empty((), dtype=torch.int64).random_(-(2**63), None), round(p * _LEVELS), _scale(p)


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


class _FusedDropout(torch.autograd.Function):
    """dropout(x), plus residual where one is given, through cpu_kernels.cpp: the mask is redrawn from
    its key in the backward pass, so nothing of it is kept."""

    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor | None, p: float) -> Tensor:
        ctx.key, ctx.dropped_below, ctx.scale = kernel_mask(p)
        ctx.has_residual = residual is not None
        addend = None if residual is None else residual.contiguous()
        return cpu_kernels().dropout(x.contiguous(), addend, ctx.key, ctx.dropped_below, ctx.scale)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None, None]:
        grad_x = cpu_kernels().dropout(grad.contiguous(), None, ctx.key, ctx.dropped_below, ctx.scale)
        return grad_x, grad if ctx.has_residual else None, None


class _FusedDropoutAddNorm(torch.autograd.Function):
    """The sum residual + dropout(x) and its LayerNorm through cpu_residual_norm.cpp: with `pre_norm`
    the two (dropout_add_then_norm), else the LayerNorm as two views of one tensor
    (dropout_add_norm_for_two). Keeps the sum (which the PyTorch path keeps too, as LayerNorm's input)
    and each row's mean and 1 / std."""

    @staticmethod
    def forward(
        ctx, residual: Tensor, x: Tensor, weight: Tensor, bias: Tensor, p: float, eps: float, pre_norm: bool
    ) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a tensor of zeros
        ctx.key, ctx.dropped_below, ctx.scale = kernel_mask(p)
        ctx.pre_norm = pre_norm
        out, total, stats = cpu_kernels().dropout_add_norm(
            residual.contiguous(), x.contiguous(), ctx.key, ctx.dropped_below, ctx.scale, weight.contiguous(),
            bias.contiguous(), eps,
        )  # fmt: skip
        ctx.save_for_backward(total, stats, weight)
        return (total, out) if pre_norm else (out, out.view_as(out))

    @staticmethod
    def backward(ctx, first: Tensor | None, second: Tensor | None) -> tuple[Tensor | None, ...]:
        # the normalised output's gradient (two, post-norm's two uses) and the sum's own (pre-norm's)
        grad, more, direct = (second, None, first) if ctx.pre_norm else (first, second, None)
        if grad is None:
            grad, more = more, None
        if grad is None:
            if direct is None:
                return (None,) * 7
            grad_x = cpu_kernels().dropout(direct.contiguous(), None, ctx.key, ctx.dropped_below, ctx.scale)
            return direct, grad_x, None, None, None, None, None
        total, stats, weight = ctx.saved_tensors
        grad_residual, grad_x, grad_weight, grad_bias = cpu_kernels().dropout_add_norm_backward(
            grad.contiguous(), None if more is None else more.contiguous(),
            None if direct is None else direct.contiguous(), total, stats, weight.contiguous(), ctx.key,
            ctx.dropped_below, ctx.scale,
        )  # fmt: skip
        return grad_residual, grad_x, grad_weight, grad_bias, None, None, None

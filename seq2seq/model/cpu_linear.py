"""Linear layers in bf16 on a CPU through oneDNN's inner product, with the bias (and a ReLU) fused in.

Why: PyTorch's bf16 `addmm` on a CPU first copies the bias into every row of its output and then adds
the matrix product to it, a pass over the output before the product; a ReLU after it is another
pass, and its backward a third, at AMX speeds each about as long as the product itself. oneDNN's
inner product, which PyTorch exposes as `mkldnn._linear_pointwise` (its compiler's CPU fusions call
it), adds the bias and applies the ReLU while it writes each block of the product: a linear layer
then costs its matrix product. The output is F.linear's, bit for bit (tests). The backward pass
computes the weight's gradient as (out, in) directly, where PyTorch's produces its transpose and
the gradient's accumulation copies it into the weight's layout; a ReLU's gradient and the bias's
take one pass over the gradient (cpu_linear.cpp, where the fused kernels are built) where PyTorch's
mask and column sums took two.

Taken for 2-D bf16 rows on a CPU, outside torch.compile (which has its own fusions); fp32 keeps
F.linear, whose product takes so much longer that the extra pass hardly shows.

Where oneDNN has no bf16 kernels (AVX2-only x86), PyTorch's bf16 products are scalar loops, orders of
magnitude slower than fp32's: a bf16 run there took minutes where fp32 took seconds. There `mm` and
the layer widen the bf16 operands to fp32 (exactly: every bf16 value is an fp32 one), multiply at
the fp32 rate and round the result to bf16 once, which is what a bf16 unit that accumulates in fp32
computes (oneDNN's AVX-512 and AMX kernels, and PyTorch's emulation itself); only the order of the
additions may differ. The op census counts products as a CPU with bf16 kernels runs them
(`bf16_products_unwidened`), so that its figures stay the same on every machine: the layer is then
one op there too, PyTorch's emulated product with the bias and ReLU inside it, as oneDNN's holds them.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.model.cpu_kernels import cpu_kernels


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, *, relu: bool = False) -> Tensor:
    """F.linear(x, weight, bias), then ReLU where `relu`: fused on a CPU in bf16."""
    if _fused(x, weight, bias):
        return _FusedLinear.apply(x, weight, bias, relu)
    out = F.linear(x, weight, bias)
    return F.relu(out, inplace=True) if relu else out  # in place: the output is fresh


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint keys) whose forward is `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def _fused(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype == weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and not torch.compiler.is_compiling()
    )


@functools.cache
def onednn_runs_bf16() -> bool:
    """Whether oneDNN has bf16 kernels for this CPU, its inner product among them (False on AVX2-only
    x86; asked once: it does not change)."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


_widening = contextvars.ContextVar("bf16 products widened to fp32 where the CPU emulates bf16", default=True)


def widened(x: Tensor) -> bool:
    """Whether products of bf16 `x` are computed in fp32 here: on a CPU without bf16 kernels."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and not torch.compiler.is_compiling()  # first: the compiler need not trace the cached ask below
        and _widening.get()
        and not onednn_runs_bf16()
    )


@contextlib.contextmanager
def bf16_products_unwidened() -> Iterator[None]:
    """PyTorch's own bf16 products, emulated or not: the ops a CPU with bf16 kernels runs, for the op census."""
    token = _widening.set(False)
    try:
        yield
    finally:
        _widening.reset(token)


def mm(a: Tensor, b: Tensor, *, out: Tensor | None = None) -> Tensor:
    """torch.mm(a, b, out=out), through fp32 for bf16 on a CPU without bf16 kernels (module docstring)."""
    if not widened(a):
        return torch.mm(a, b, out=out)
    product = torch.mm(a.float(), b.float())
    return product.to(a.dtype) if out is None else out.copy_(product)


class _FusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
        if onednn_runs_bf16():
            out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "relu" if relu else "none", [], "")
        elif _widening.get():  # module docstring
            out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            out = (F.relu(out, inplace=True) if relu else out).to(x.dtype)
        else:  # the op census here: one op where oneDNN's would be
            out = emulated_linear_pointwise(x, weight, bias, relu)
        ctx.save_for_backward(x, weight, out if relu else None)
        ctx.relu = relu
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None, None]:
        x, weight, out = ctx.saved_tensors
        wants_x, wants_weight, wants_bias, _ = ctx.needs_input_grad
        grad, grad_bias = _relu_and_bias_gradients(grad, out if ctx.relu else None, wants_bias)
        grad_x = mm(grad, weight) if wants_x else None
        grad_weight = mm(grad.t(), x) if wants_weight else None
        return grad_x, grad_weight, grad_bias, None


@torch.library.custom_op("seq2seq::emulated_linear_pointwise", mutates_args=())
def emulated_linear_pointwise(x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool) -> Tensor:
    """oneDNN's `_linear_pointwise` computed by PyTorch's own (on AVX2, emulated) bf16 product: one
    dispatched op, so that the op census sees this layer as a CPU with bf16 kernels runs it."""
    out = F.linear(x, weight, bias)
    return out.relu_() if relu else out


def _relu_and_bias_gradients(grad: Tensor, relu_out: Tensor | None, wants_bias: bool) -> tuple[Tensor, Tensor | None]:
    """The gradient of the product's output (through the ReLU whose output is relu_out, if any) and
    the bias's, its column sums: in one pass where the fused kernels are built (cpu_linear.cpp)."""
    kernels = cpu_kernels() if wants_bias else None
    if kernels is not None:
        grad = grad.contiguous()
        if relu_out is None:
            return grad, kernels.bias_backward(grad)
        return kernels.relu_bias_backward(grad, relu_out)
    if relu_out is not None:  # the ReLU's gradient: zero where its output is
        grad = torch.ops.aten.threshold_backward(grad, relu_out, 0)
    return grad, grad.sum(0) if wants_bias else None

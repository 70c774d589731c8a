"""Linear layers through oneDNN's fused inner product (model/cpu_linear.py): F.linear's output and
gradients, with and without the ReLU, in bf16 on a CPU; elsewhere F.linear itself. The ReLU's and
the bias's gradients in one pass (cpu_linear.cpp): PyTorch's mask, the column sums, any thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from seq2seq.model import cpu_linear
from seq2seq.model.cpu_linear import linear, onednn_runs_bf16

ROWS, IN, OUT = 203, 48, 80

needs_onednn = pytest.mark.skipif(
    not onednn_runs_bf16(),
    reason="oneDNN has no bf16 inner product on this CPU (AVX2-only x86) or PyTorch was built without it",
)


def _inputs(bias: bool):
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(ROWS, IN, generator=generator), torch.randn(OUT, IN, generator=generator) / 7
    b = torch.randn(OUT, generator=generator) if bias else None
    grad = torch.randn(ROWS, OUT, generator=generator).bfloat16()
    leaves = [t.bfloat16().requires_grad_() if t is not None else None for t in (x, weight, b)]
    return leaves, grad


def _run(fused: bool, bias: bool, relu: bool):
    (x, weight, b), grad = _inputs(bias)
    if fused:
        out = linear(x, weight, b, relu=relu)
    else:
        out = F.linear(x, weight, b)
        out = F.relu(out) if relu else out
    out.backward(grad)
    return out, [t.grad for t in (x, weight, b) if t is not None]


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("relu", [True, False])
def test_the_fused_linear_is_f_linear_forward_and_backward(bias, relu):
    out, grads = _run(True, bias, relu)
    expected_out, expected_grads = _run(False, bias, relu)
    assert out.grad_fn.name() == "_FusedLinearBackward"  # the fused path ran
    assert torch.equal(out, expected_out)
    if relu:
        assert (out == 0).any() and (out > 0).any()  # the ReLU cut some outputs and kept others
    for grad, expected in zip(grads[:2], expected_grads[:2], strict=True):
        assert grad.shape == expected.shape and grad.is_contiguous()
        assert torch.equal(grad, expected)  # the same products: the same bits
    if bias:  # a sum of the same values, perhaps in another order: within one bf16 rounding
        torch.testing.assert_close(grads[2], expected_grads[2], rtol=8e-3, atol=1e-2)


@pytest.fixture
def without_bf16_kernels(monkeypatch):
    """The layer as on a CPU whose oneDNN has no bf16 kernels (AVX2-only x86), on any CPU."""
    monkeypatch.setattr(cpu_linear, "onednn_runs_bf16", lambda: False)


def _exactly_rounded(x, weight, bias, relu: bool):
    out = F.linear(x.double(), weight.double(), bias.double())
    return (F.relu(out) if relu else out).bfloat16()


def _within_one_rounding(ours, exact):
    """Every element the exactly rounded value or its neighbour (an fp32 sum lands on the other
    side of a bf16 rounding boundary now and then), and nearly all the exactly rounded value."""
    ulp = exact.float().abs().clamp(min=2**-126) * 2**-7
    assert bool(((ours.float() - exact.float()).abs() <= ulp).all())
    assert (ours == exact).float().mean() >= 0.995


@pytest.mark.parametrize("relu", [True, False])
def test_without_bf16_kernels_products_run_in_fp32_and_round_once(without_bf16_kernels, relu):
    """Where PyTorch's bf16 products are scalar loops, the layer widens to fp32: the output and the
    gradients are the exact results rounded to bf16 once, as a bf16 unit accumulating in fp32 gives."""
    (x, weight, b), grad = _inputs(True)
    out = linear(x, weight, b, relu=relu)
    assert out.grad_fn.name() == "_FusedLinearBackward" and out.dtype == torch.bfloat16
    out.backward(grad)
    _within_one_rounding(out, _exactly_rounded(x, weight, b, relu))
    if relu:
        assert (out == 0).any() and (out > 0).any()
    passed = grad.double() * (out > 0) if relu else grad.double()
    _within_one_rounding(x.grad, (passed @ weight.double()).bfloat16())
    _within_one_rounding(weight.grad, (passed.t() @ x.double()).bfloat16())
    torch.testing.assert_close(b.grad, passed.sum(0).bfloat16(), rtol=8e-3, atol=1e-2)  # PyTorch's own column sums


@pytest.mark.parametrize("relu", [True, False])
def test_without_bf16_kernels_the_census_sees_pytorchs_products(without_bf16_kernels, relu):
    """bf16_products_unwidened (the op census): PyTorch's bf16 products, no conversion, and the layer
    one op with its bias and ReLU inside, as oneDNN's is where the CPU has bf16 kernels."""
    (x, weight, b), _ = _inputs(True)
    with cpu_linear.bf16_products_unwidened(), DispatchedOps() as dispatched:
        out = linear(x, weight, b, relu=relu)
        product = cpu_linear.mm(x, weight.t())
    assert dispatched.names == ["emulated_linear_pointwise", "mm"]
    assert out.grad_fn.name() == "_FusedLinearBackward"
    expected = F.linear(x, weight, b)
    assert torch.equal(out, F.relu(expected) if relu else expected)
    assert torch.equal(product, torch.mm(x, weight.t()))


class DispatchedOps(TorchDispatchMode):
    """The names of the ATen (and custom) ops dispatched while it is on, views left out."""

    def __init__(self) -> None:
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_fp32_takes_f_linear():
    (x, weight, b), _ = _inputs(True)
    x, weight, b = (t.detach().float().requires_grad_() for t in (x, weight, b))
    out = linear(x, weight, b, relu=True)
    assert out.grad_fn.name() != "_FusedLinearBackward"
    assert torch.equal(out, F.relu(F.linear(x, weight, b)))


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_and_bias_gradients_in_one_pass(fused_kernels, dtype, relu):
    generator = torch.Generator().manual_seed(1)
    out = torch.randn(ROWS, OUT, generator=generator).relu().to(dtype)
    out[0, 0] = float("nan")  # threshold_backward lets a NaN output's gradient through
    grad = torch.randn(ROWS, OUT, generator=generator).to(dtype)

    def gradients():
        if relu:
            return fused_kernels.relu_bias_backward(grad, out)
        return grad, fused_kernels.bias_backward(grad)

    masked, bias_grad = gradients()
    expected = torch.ops.aten.threshold_backward(grad, out, 0) if relu else grad
    assert torch.equal(masked, expected)
    sums = expected.double().sum(0)
    torch.testing.assert_close(bias_grad.double(), sums, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(gradients()[1], bias_grad)
    finally:
        torch.set_num_threads(threads)

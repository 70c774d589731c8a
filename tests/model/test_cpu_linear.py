"""Linear layers through oneDNN's fused inner product (model/cpu_linear.py): F.linear's output and
gradients, with and without the ReLU, in bf16 on a CPU; elsewhere F.linear itself. The ReLU's and
the bias's gradients in one pass (cpu_linear.cpp): PyTorch's mask, the column sums, any thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seq2seq.model.cpu_linear import _onednn_bf16, linear

ROWS, IN, OUT = 203, 48, 80

needs_onednn = pytest.mark.skipif(
    not _onednn_bf16(),
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


@pytest.mark.skipif(_onednn_bf16(), reason="oneDNN runs bf16 on this CPU")
@pytest.mark.parametrize("relu", [True, False])
def test_bf16_where_onednn_has_no_bf16_kernels_takes_f_linear(relu):
    """On AVX2-only x86 oneDNN's inner product refuses bf16: the layer is F.linear's, not an error."""
    out, grads = _run(True, True, relu)
    expected_out, expected_grads = _run(False, True, relu)
    assert torch.equal(out, expected_out)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, rtol=8e-3, atol=1e-2)


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

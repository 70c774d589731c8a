"""Post-norm's residual connection fused (dropout.dropout_add_norm_for_two, cpu_residual_norm.cpp): equal to
LayerNorm over dropout_add with the same mask, forward and backward (the gradients of both inputs,
the weight and the bias), in fp32 and bf16, its output used once or as two
tensors whose gradients the kernel adds, and the same bits for any thread count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from seq2seq.model.dropout import dropout_add, dropout_add_norm_for_two

ROWS, WIDTH = 203, 48  # rows not a multiple of the kernel's 32 per task, nor the width of 4 draws


def _inputs(dtype):
    torch.manual_seed(0)
    norm = nn.LayerNorm(WIDTH).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    residual, x = (torch.randn(ROWS, WIDTH).to(dtype).requires_grad_() for _ in range(2))
    return norm, residual, x


def _run(fused: bool, dtype, uses: int = 1):
    """Output and gradients of norm(residual + dropout(x)) on fixed inputs, the mask from seed 7. With
    two uses, the fused path's output comes twice (dropout_add_norm_for_two), each use with a gradient
    of its own; the unfused output gets their sum."""
    norm, residual, x = _inputs(dtype)
    torch.manual_seed(7)
    grads = [torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(seed)).to(dtype) for seed in (3, 4)]
    if fused and uses == 2:
        outs = dropout_add_norm_for_two(residual, x, norm, 0.3, training=True)
        torch.autograd.backward(outs, grads)
        out = outs[0]
    else:
        if fused:
            out = dropout_add_norm_for_two(residual, x, norm, 0.3, training=True)[0]
        else:
            out = norm(dropout_add(residual, x, 0.3, training=True))
        out.backward(grads[0] if uses == 1 else grads[0] + grads[1])
    return [out, residual.grad, x.grad, norm.weight.grad, norm.bias.grad]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("uses", [1, 2])
def test_equals_layer_norm_over_dropout_add_forward_and_backward(fused_kernels, dtype, tolerance, uses):
    ours, theirs = _run(True, dtype, uses), _run(False, dtype, uses)
    assert (ours[2] == 0).float().mean().item() == pytest.approx(0.3, abs=0.03)  # x's gradient carries the mask
    for name, mine, reference in zip(["out", "residual", "x", "weight", "bias"], ours, theirs):
        assert mine.dtype == dtype, name
        # bf16 weight sums add hundreds of rounded terms: compare them relative to their size
        scale = reference.float().abs().max().item() if name in ("weight", "bias") else 1.0
        torch.testing.assert_close(mine.float(), reference.float(), atol=tolerance * scale, rtol=tolerance, msg=name)


def test_any_thread_count_gives_the_same_bits(fused_kernels):
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(_run(True, torch.bfloat16))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_outside_training_it_is_layer_norm_of_the_sum(cpu_path):
    norm, residual, x = _inputs(torch.float32)
    out = dropout_add_norm_for_two(residual, x, norm, 0.3, training=False)[0]
    torch.testing.assert_close(out, norm(residual + x))

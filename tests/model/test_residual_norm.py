"""A residual connection and the LayerNorm of its sum fused (cpu_residual_norm.cpp): post-norm's
(dropout.dropout_add_norm_for_two) and a pre-norm block's with the next LayerNorm
(dropout.dropout_add_then_norm) equal to LayerNorm over dropout_add with the same mask, forward and
backward (the gradients of both inputs, the weight and the bias), in fp32 and bf16: post-norm's
output used once or as two tensors whose gradients the kernel adds, pre-norm's two outputs each with
a gradient or one alone; and the same bits for any thread count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from seq2seq.config import ModelConfig
from seq2seq.model import dropout
from seq2seq.model.dropout import dropout_add, dropout_add_norm_for_two, dropout_add_then_norm
from seq2seq.model.transformer import Seq2SeqTransformer

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


def _run_pre_norm(fused: bool, dtype, used: tuple[int, ...]):
    """The sum residual + dropout(x) and norm of it, on _run's inputs and mask, and the gradients when
    the outputs `used` (0: the sum, 1: the norm) get one each (the other none)."""
    norm, residual, x = _inputs(dtype)
    torch.manual_seed(7)
    if fused:
        outs = dropout_add_then_norm(residual, x, norm, 0.3, training=True)
    else:
        total = dropout_add(residual, x, 0.3, training=True)
        outs = total, norm(total)
    grads = [torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(seed)).to(dtype) for seed in (3, 4)]
    torch.autograd.backward([outs[i] for i in used], [grads[i] for i in used])
    return [*outs, residual.grad, x.grad, norm.weight.grad, norm.bias.grad]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("used", [(0, 1), (1,), (0,)], ids=["both", "the norm", "the sum"])
def test_pre_norm_equals_dropout_add_then_layer_norm_forward_and_backward(fused_kernels, dtype, tolerance, used):
    ours, theirs = _run_pre_norm(True, dtype, used), _run_pre_norm(False, dtype, used)
    assert (ours[3] == 0).float().mean().item() == pytest.approx(0.3, abs=0.03)  # x's gradient carries the mask
    for name, mine, reference in zip(["sum", "norm", "residual", "x", "weight", "bias"], ours, theirs):
        if reference is None:  # the norm's weight and bias when only the sum is used
            assert mine is None, name
            continue
        assert mine.dtype == dtype, name
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
    total, normed = dropout_add_then_norm(residual, x, norm, 0.3, training=False)
    torch.testing.assert_close(total, residual + x)
    torch.testing.assert_close(normed, norm(residual + x))


def test_a_pre_norm_model_trains_as_with_its_passes_apart(fused_kernels, monkeypatch):
    """A pre-norm model's training pass, dropout on: its loss and every gradient as when each block's
    residual addition and the next LayerNorm run apart (dropout_add, then the norm; the same masks),
    in fp32; and the fused path did run, once per block (5 in 1 + 1 layers)."""
    config = ModelConfig(d_model=32, heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=64, dropout=0.3, norm="pre")
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 6))
    fused_calls = []
    apply = dropout._FusedDropoutAddNorm.apply
    monkeypatch.setattr(dropout._FusedDropoutAddNorm, "apply", lambda *args: fused_calls.append(1) or apply(*args))
    results = []
    for apart in (False, True):
        if apart:
            monkeypatch.setattr(dropout, "_norm_fuses", lambda *args: False)
        torch.manual_seed(0)
        model = Seq2SeqTransformer(config, src_vocab_size=50, tgt_vocab_size=50).train()
        torch.manual_seed(1)
        loss = F.cross_entropy(model(src, tgt).flatten(0, 1), tgt.roll(-1, 1).flatten())
        loss.backward()
        results.append([loss, *(param.grad for param in model.parameters())])
    assert len(fused_calls) == 5
    for ours, theirs in zip(*results, strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)

"""The fused label-smoothed cross entropy equals PyTorch's, in value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seq2seq.training import loss as loss_module
from seq2seq.training.loss import label_smoothed_cross_entropy


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_matches_torch_cross_entropy_across_chunks(smoothing, monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ROWS", 7)  # several chunks and a ragged last one
    logits = (torch.randn(30, 11, dtype=torch.float64) * 3).requires_grad_()
    target = torch.randint(0, 11, (30,))
    ours = label_smoothed_cross_entropy(logits, target, smoothing)
    (grad_ours,) = torch.autograd.grad(ours * 2.5, logits)
    reference = F.cross_entropy(logits, target, label_smoothing=smoothing, reduction="sum")
    (grad_reference,) = torch.autograd.grad(reference * 2.5, logits)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad_ours, grad_reference)


def test_gradcheck_and_bf16_logits():
    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 6, (5,))
    assert torch.autograd.gradcheck(lambda x: label_smoothed_cross_entropy(x, target, 0.2), (logits,))
    half = logits.detach().to(torch.bfloat16).requires_grad_()
    value = label_smoothed_cross_entropy(half, target, 0.1)
    assert value.dtype == torch.float32  # computed in fp32 from bf16 logits
    value.backward()
    assert half.grad.dtype == torch.bfloat16
    expected = F.cross_entropy(half.detach().float(), target, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-4)


def test_bf16_logits_across_chunks_match_the_fp32_computation(monkeypatch):
    """bf16 chunks are cast through one reused fp32 buffer; a ragged last chunk must not see stale rows."""
    monkeypatch.setattr(loss_module, "CHUNK_ROWS", 7)
    logits = (torch.randn(30, 11) * 3).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 11, (30,))
    ours = label_smoothed_cross_entropy(logits, target, 0.1)
    (grad_ours,) = torch.autograd.grad(ours, logits)
    exact = logits.detach().float().requires_grad_()
    reference = F.cross_entropy(exact, target, label_smoothing=0.1, reduction="sum")
    (grad_reference,) = torch.autograd.grad(reference, exact)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad_ours, grad_reference.to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_logit_rows_past_the_targets_are_padding(monkeypatch, dtype):
    """Batches round the output layer's rows up (batching.POSITION_MULTIPLE): the extra rows add nothing."""
    monkeypatch.setattr(loss_module, "CHUNK_ROWS", 7)
    logits = (torch.randn(32, 11) * 3).to(dtype).requires_grad_()
    target = torch.randint(0, 11, (23,))
    ours = label_smoothed_cross_entropy(logits, target, 0.1)
    (grad,) = torch.autograd.grad(ours, logits)
    real = logits.detach()[:23].to(torch.float64).requires_grad_()
    reference = F.cross_entropy(real, target, label_smoothing=0.1, reduction="sum")
    (grad_reference,) = torch.autograd.grad(reference, real)
    torch.testing.assert_close(ours.double(), reference, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad[:23], grad_reference.to(dtype), rtol=1e-2, atol=1e-3)
    assert torch.count_nonzero(grad[23:]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_chunks_of_bf16_logits_match_the_fp32_computation(monkeypatch):
    """On a GPU the chunks are sized by GPU_CHUNK_ELEMENTS, not CHUNK_ROWS: ragged ones must be exact too."""
    monkeypatch.setattr(loss_module, "GPU_CHUNK_ELEMENTS", 7 * 11)  # 7 rows of 11 classes per chunk
    logits = (torch.randn(32, 11, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
    target = torch.randint(0, 11, (30,), device="cuda")
    ours = label_smoothed_cross_entropy(logits, target, 0.1)
    (grad,) = torch.autograd.grad(ours, logits)
    exact = logits.detach()[:30].float().requires_grad_()
    reference = F.cross_entropy(exact, target, label_smoothing=0.1, reduction="sum")
    (grad_reference,) = torch.autograd.grad(reference, exact)
    torch.testing.assert_close(ours, reference)
    torch.testing.assert_close(grad[:30], grad_reference.to(torch.bfloat16))
    assert torch.count_nonzero(grad[30:]) == 0

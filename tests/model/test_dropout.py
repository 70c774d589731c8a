"""The cheap CPU dropout: drops at rate p in every position, scales the kept, masks the gradient alike,
is reproducible from the seed, and is the identity when not training."""

from __future__ import annotations

import pytest
import torch

from seq2seq.model.dropout import Dropout, drop_mask, dropout

COUNT = 1_000_000


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_every_position_is_dropped_at_rate_p(p):
    """Each int64 draw feeds four neighbouring elements: all four lanes must be uniform (a draw
    with a fixed top bit would leave every fourth element nearly never dropped)."""
    torch.manual_seed(0)
    dropped, scale = drop_mask(torch.Size([COUNT]), p)
    tolerance = 5 * (p * (1 - p) / (COUNT / 4)) ** 0.5  # 5 standard deviations of one lane's rate
    for lane in range(4):
        assert dropped[lane::4].float().mean().item() == pytest.approx(p, abs=tolerance)
    assert scale == pytest.approx(1 / (1 - p), rel=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_elements_are_scaled_and_the_gradient_is_masked_alike(dtype):
    x = torch.randn(64, 33, 16).to(dtype).requires_grad_()
    torch.manual_seed(1)
    out = dropout(x, 0.25, training=True)
    torch.manual_seed(1)
    dropped, scale = drop_mask(x.shape, 0.25)
    assert out.dtype == dtype
    assert torch.equal(out, torch.where(dropped, 0.0, x.detach() * scale).to(dtype))
    upstream = torch.randn_like(x)
    out.backward(upstream)
    assert torch.equal(x.grad, torch.where(dropped, 0.0, upstream * scale).to(dtype))


def test_the_expected_output_is_the_input():
    torch.manual_seed(2)
    x = torch.full((COUNT,), 3.0)
    assert dropout(x, 0.1, training=True).mean().item() == pytest.approx(3.0, rel=2e-3)


def test_the_same_seed_gives_the_same_mask_and_the_stream_moves_on():
    x = torch.ones(1000)
    torch.manual_seed(3)
    first, second = dropout(x, 0.5, training=True), dropout(x, 0.5, training=True)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.5, training=True), first)
    assert not torch.equal(first, second)


def test_identity_when_not_training_or_p_is_zero():
    x = torch.randn(100)
    module = Dropout(0.3).eval()
    assert module(x) is x
    assert dropout(x, 0.0, training=True) is x
    assert torch.equal(dropout(x, 1.0, training=True), torch.zeros_like(x))

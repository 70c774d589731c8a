"""The cheap CPU dropout, through the fused kernel and through PyTorch's operations: drops at rate p in
every position, independently from call to call, scales the kept, masks the gradient alike, is
reproducible from the seed, and is the identity when not training."""

from __future__ import annotations

import pytest
import torch

from seq2seq.model.dropout import Dropout, dropout, dropout_add

COUNT = 1_000_000


def _dropped(out: torch.Tensor) -> torch.Tensor:
    """Where dropout zeroed an input that had no zeros."""
    return out == 0


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_every_position_is_dropped_at_rate_p(p, cpu_path):
    """Each 64 random bits feed four neighbouring elements: all four lanes must be uniform (a draw
    with a fixed top bit would leave every fourth element nearly never dropped), and so must the
    two halves of the tensor (which different threads compute)."""
    torch.manual_seed(0)
    out = dropout(torch.ones(COUNT), p, training=True)
    dropped = _dropped(out)
    tolerance = 5 * (p * (1 - p) / (COUNT / 4)) ** 0.5  # 5 standard deviations of one lane's rate
    for lane in range(4):
        assert dropped[lane::4].float().mean().item() == pytest.approx(p, abs=tolerance)
    for half in dropped.chunk(2):
        assert half.float().mean().item() == pytest.approx(p, abs=tolerance)
    assert out[~dropped].unique().tolist() == [pytest.approx(1 / (1 - p), rel=1e-4)]


def test_two_calls_drop_independently(cpu_path):
    """Each call draws its own mask: two masks overlap as often as chance says (p^2), not more."""
    torch.manual_seed(5)
    first, second = (_dropped(dropout(torch.ones(COUNT), 0.5, training=True)) for _ in range(2))
    both = (first & second).float().mean().item()
    assert both == pytest.approx(0.25, abs=5 * (0.25 * 0.75 / COUNT) ** 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_elements_are_scaled_and_the_gradient_is_masked_alike(dtype, cpu_path):
    x = torch.randn(64, 33, 16).to(dtype).requires_grad_()
    torch.manual_seed(1)
    out = dropout(x, 0.25, training=True)
    dropped, scale = _dropped(out), 65536 / (65536 - 16384)
    assert out.dtype == dtype and 0.2 < dropped.float().mean().item() < 0.3
    assert torch.equal(out, torch.where(dropped, 0.0, x.detach() * scale).to(dtype))
    upstream = torch.randn_like(x)
    out.backward(upstream)
    assert torch.equal(x.grad, torch.where(dropped, 0.0, upstream * scale).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_add_is_the_residual_plus_dropout(dtype, cpu_path):
    """The residual connection's fused form: the same mask from the same seed, the same sum (bf16:
    rounded once instead of twice), the residual's gradient the upstream one."""
    residual, x = (torch.randn(40, 24).to(dtype).requires_grad_() for _ in range(2))
    torch.manual_seed(6)
    fused = dropout_add(residual, x, 0.3, training=True)
    torch.manual_seed(6)
    dropped = _dropped(dropout(x.detach(), 0.3, training=True))
    expected = residual.detach() + torch.where(dropped, 0.0, x.detach() * (65536 / (65536 - 19661))).to(dtype)
    if dtype == torch.float32:
        assert torch.equal(fused, expected)
    else:
        torch.testing.assert_close(fused, expected, rtol=1e-2, atol=1e-2)
    upstream = torch.randn_like(fused)
    fused.backward(upstream)
    assert torch.equal(residual.grad, upstream)
    assert torch.equal(x.grad == 0, dropped)


def test_the_same_seed_gives_the_same_mask_and_the_stream_moves_on(cpu_path):
    x = torch.ones(1000)
    torch.manual_seed(3)
    first, second = dropout(x, 0.5, training=True), dropout(x, 0.5, training=True)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, 0.5, training=True), first)
    assert not torch.equal(first, second)


def test_the_fused_mask_is_the_same_on_any_number_of_threads(fused_kernels):
    """A resumed run on another thread count draws the same masks: every bit depends on the key and
    its position alone, also where a thread's share starts inside a block."""
    x, key = torch.randn(100_003), torch.tensor(12345)
    threads = torch.get_num_threads()
    try:
        masks = []
        for count in (1, 3):
            torch.set_num_threads(count)
            masks.append(fused_kernels.dropout(x, None, key, 6554, 1.1))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(masks[0], masks[1])


def test_identity_when_not_training_or_p_is_zero(cpu_path):
    x = torch.randn(100)
    module = Dropout(0.3).eval()
    assert module(x) is x
    assert dropout(x, 0.0, training=True) is x
    assert torch.equal(dropout(x, 1.0, training=True), torch.zeros_like(x))
    assert dropout_add(x, x, 0.3, training=False).equal(2 * x)

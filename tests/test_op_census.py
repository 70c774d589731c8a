"""The op census counts what a step dispatches: conversions where autocast casts and where an op
mixes dtypes, matrix products with their FLOPs, and the bytes of everything else."""

from __future__ import annotations

import pytest
import torch

from benchmarks.op_census import take_census
from seq2seq.model.dropout import dropout_add_norm_for_two


def linear_step(layer: torch.nn.Linear, x: torch.Tensor, dtype: torch.dtype | None):
    def step():
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = layer(x).float().sum()
        loss.backward()

    return step


def test_conversions_appear_under_autocast_and_not_in_fp32():
    layer, x = torch.nn.Linear(64, 32), torch.randn(16, 64)
    fp32 = take_census(linear_step(layer, x, None))
    bf16 = take_census(linear_step(layer, x, torch.bfloat16))
    assert fp32.conversions == 0
    # forward: x, weight, bias and the output cast; backward: the weight's and the bias's gradients
    assert bf16.conversions >= 5
    assert fp32.matmuls == bf16.matmuls == 2  # the forward product and the weight's gradient
    assert fp32.matmul_flops == 2 * (2 * 16 * 64 * 32)


def test_an_op_that_mixes_dtypes_counts_its_implicit_cast():
    total, part = torch.zeros(8, 4), torch.ones(8, 4, dtype=torch.bfloat16)
    mixed = take_census(lambda: total.add_(part))  # part is cast to fp32 inside add_
    same = take_census(lambda: total.add_(part.float()))  # the cast made by hand
    made = take_census(lambda: torch.zeros_like(part, dtype=torch.float32))  # reads nothing: no cast
    assert mixed.conversions == same.conversions == 1 and made.conversions == 0
    assert mixed.conversion_bytes == same.conversion_bytes == 8 * 4 * (2 + 4)


def test_a_fused_kernel_reading_two_dtypes_casts_nothing(fused_kernels):
    """Our kernels read each input in its own dtype in their one pass: post-norm's fused residual
    connection keeps fp32 row statistics beside its bf16 rows, and its backward pass reads both."""
    norm = torch.nn.LayerNorm(32).to(torch.bfloat16)
    residual, x = (torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))

    def step():
        dropout_add_norm_for_two(residual, x, norm, 0.1, training=True)[0].float().sum().backward()

    counted = take_census(step)
    assert counted.conversions_by_op == {"_to_copy": 2}  # .float() on the output, and its gradient back to bf16
    assert {"dropout_add_norm", "dropout_add_norm_backward"} <= set(counted.by_op)


def test_onednns_linear_layer_counts_as_a_matrix_product():
    """model/cpu_linear.py's bf16 linear layer (oneDNN's op) counts as F.linear does: two products
    (forward, the weight's gradient) of the same FLOPs, not as an elementwise op's bytes."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("PyTorch built without oneDNN")
    from seq2seq.model.cpu_linear import Linear

    layer, x = Linear(64, 32).bfloat16(), torch.randn(16, 64, dtype=torch.bfloat16)
    census = take_census(linear_step(layer, x, None))
    assert census.matmuls == 2
    assert census.matmul_flops == 2 * (2 * 16 * 64 * 32)


def test_bf16_products_count_unwidened_where_the_cpu_has_no_bf16_kernels(monkeypatch):
    """Without bf16 kernels (AVX2-only x86) the layer computes bf16 products in fp32 (model/cpu_linear.py),
    two casts each; the census counts what a CPU with bf16 kernels runs, so its figures do not depend on
    the machine: the step's own two casts (to fp32 for the loss, and back in the backward), two products."""
    from seq2seq.model import cpu_linear

    monkeypatch.setattr(cpu_linear, "onednn_runs_bf16", lambda: False)
    layer, x = cpu_linear.Linear(64, 32).bfloat16(), torch.randn(16, 64, dtype=torch.bfloat16)
    assert layer(x).grad_fn.name() == "_FusedLinearBackward"  # outside the census: widened
    census = take_census(linear_step(layer, x, None))
    assert census.conversions == 2 and census.matmuls == 2


def test_a_product_added_in_place_counts_as_a_matrix_product():
    """out.addmm_(a, b), as the output layer's loss adds up its weight gradient chunk by chunk, is a
    product of a's and b's FLOPs, not an elementwise op's bytes."""
    out, a, b = torch.zeros(32, 8), torch.randn(32, 16), torch.randn(16, 8)
    in_place = take_census(lambda: out.addmm_(a, b))
    fresh = take_census(lambda: torch.addmm(out, a, b))
    assert in_place.matmuls == fresh.matmuls == 1
    assert in_place.matmul_flops == fresh.matmul_flops == 2 * 32 * 16 * 8
    assert in_place.other_bytes == fresh.other_bytes == 0


def test_a_product_written_into_out_counts_its_operands_flops():
    """torch.mm(a, b, out=logits), as the loss writes each chunk's logits: the FLOPs of a and b, not
    of b and the output."""
    a, b, out = torch.randn(64, 32), torch.randn(32, 100), torch.empty(64, 100)
    census = take_census(lambda: torch.mm(a, b, out=out))
    assert census.matmuls == 1 and census.matmul_flops == 2 * 64 * 32 * 100


def test_memory_allocated_and_not_yet_written_moves_no_bytes():
    """empty_like and new_empty reserve memory; the op that fills it is the one that moves its bytes."""
    x = torch.randn(64, 32)
    allocated = take_census(lambda: (torch.empty_like(x), x.new_empty(64, 32), torch.empty(64, 32)))
    zeroed = take_census(lambda: torch.zeros_like(x))  # zeros_like writes every byte
    assert allocated.other_bytes == 0
    assert zeroed.other_bytes == 64 * 32 * 4

"""The fused output layer and loss equal PyTorch's Linear + cross_entropy, in value and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from seq2seq.model import cpu_linear
from seq2seq.model.cpu_kernels import SWITCH
from seq2seq.training import loss as loss_module
from seq2seq.training.loss import output_layer_loss


def _inputs(rows: int, width: int, vocab: int, dtype=torch.float64):
    hidden = torch.randn(rows, width, dtype=dtype).requires_grad_()
    weight = (torch.randn(vocab, width, dtype=dtype) / width**0.5 * 3).requires_grad_()
    return hidden, weight


def _reference(hidden, weight, target, smoothing, scale=1.0):
    """PyTorch's own: the loss on the real rows, and the gradients of scale x loss."""
    loss = F.cross_entropy(F.linear(hidden[: target.size(0)], weight), target, label_smoothing=smoothing,
                           reduction="sum")  # fmt: skip
    return (loss, *torch.autograd.grad(loss * scale, (hidden, weight)))


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_matches_linear_and_cross_entropy_across_chunks_and_padding_rows(smoothing, monkeypatch):
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", 7 * 11)  # 7 rows: chunks, a ragged one, padding rows
    hidden, weight = _inputs(32, 5, 11)
    target = torch.randint(0, 11, (30,))
    ours = output_layer_loss(hidden, weight, target, smoothing)
    grad_hidden, grad_weight = torch.autograd.grad(ours * 2.5, (hidden, weight))
    expected, expected_hidden, expected_weight = _reference(hidden, weight, target, smoothing, scale=2.5)
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(grad_hidden, expected_hidden)  # padding rows: zero in both
    torch.testing.assert_close(grad_weight, expected_weight)
    assert torch.count_nonzero(grad_hidden[30:]) == 0


@pytest.mark.parametrize("targets", [0, 3])
def test_rows_no_chunk_reaches_get_a_zero_gradient(targets, monkeypatch):
    """Padding rows past the last chunk, and a batch without targets: no loss, zero gradients (the
    gradients start unfilled, written by the chunks)."""
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", 2 * 11)  # 2 rows a chunk: the 3 targets end in 2 chunks
    hidden, weight = _inputs(12, 5, 11)
    target = torch.randint(0, 11, (targets,))
    ours = output_layer_loss(hidden, weight, target, 0.1)
    grad_hidden, grad_weight = torch.autograd.grad(ours, (hidden, weight))
    expected, expected_hidden, expected_weight = _reference(hidden, weight, target, 0.1)
    torch.testing.assert_close(ours, expected)
    assert torch.equal(grad_hidden[targets + 1 :], torch.zeros_like(grad_hidden[targets + 1 :]))
    torch.testing.assert_close(grad_hidden, expected_hidden)
    torch.testing.assert_close(grad_weight, expected_weight)


def test_gradcheck_and_one_input_without_gradient(monkeypatch):
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", 2 * 6)
    hidden, weight = _inputs(5, 3, 6)
    target = torch.randint(0, 6, (4,))
    assert torch.autograd.gradcheck(lambda h, w: output_layer_loss(h, w, target, 0.2), (hidden, weight))
    frozen = weight.detach()  # a frozen output layer: the rows' gradient alone, still exact
    (grad_hidden,) = torch.autograd.grad(output_layer_loss(hidden, frozen, target, 0.2), hidden)
    _, expected_hidden, _ = _reference(hidden, weight, target, 0.2)
    torch.testing.assert_close(grad_hidden, expected_hidden)


def test_without_gradients_the_loss_is_the_same(monkeypatch):
    """Validation calls it under no_grad: the forward alone, the same value."""
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", 7 * 11)
    hidden, weight = _inputs(32, 5, 11)
    target = torch.randint(0, 11, (30,))
    with torch.no_grad():
        value = output_layer_loss(hidden, weight, target, 0.0)
    assert not value.requires_grad
    torch.testing.assert_close(value, _reference(hidden, weight, target, 0.0)[0])


def test_logits_far_apart_keep_an_exact_loss_and_gradient(cpu_path, monkeypatch):
    """Logits hundreds apart in fp32: most probabilities underflow to zero, targets' among them, and
    the loss (a log-sum-exp less each target's logit) must still be that of float64."""
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", 7 * 11)
    hidden, weight = _inputs(32, 5, 11, dtype=torch.float32)
    weight = (weight.detach() * 100).requires_grad_()  # logits of ~±1,000
    target = torch.randint(0, 11, (30,))
    ours = output_layer_loss(hidden, weight, target, 0.1)
    grads = torch.autograd.grad(ours, (hidden, weight))
    expected, *expected_grads = _reference(hidden.double(), weight.double(), target, 0.1)
    assert ours.isfinite() and expected > 1e3  # most targets are far below the best logit
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=0)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), expected_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                             reason="needs a CUDA device")])],
)  # fmt: skip
def test_under_bf16_autocast_it_computes_what_the_autocast_linear_did(device, monkeypatch):
    """The matmuls in bf16 as the output layer's Linear ran them under autocast, the loss in fp32;
    bf16 chunks go through reused buffers, so a ragged last chunk must not see stale rows. A GPU
    sizes its chunks by GPU_CHUNK_ELEMENTS, a CPU by CPU_CHUNK_ELEMENTS: 7 rows either way."""
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", 7 * 11)
    monkeypatch.setattr(loss_module, "GPU_CHUNK_ELEMENTS", 7 * 11)  # 7 rows of 11 classes
    hidden, weight = (tensor.detach().to(device).requires_grad_() for tensor in _inputs(32, 8, 11, torch.float32))
    target = torch.randint(0, 11, (30,), device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        ours = output_layer_loss(hidden, weight, target, 0.1)
        grads = torch.autograd.grad(ours, (hidden, weight))
        logits = F.linear(hidden[:30], weight)
    assert logits.dtype == torch.bfloat16 and ours.dtype == torch.float32
    expected = F.cross_entropy(logits.float(), target, label_smoothing=0.1, reduction="sum")
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    torch.testing.assert_close(ours, expected)
    for grad, expected_grad in zip(grads, expected_grads):  # bf16 operands: within 1% of the whole gradient
        assert grad.dtype == torch.float32  # (element by element a GPU's bf16 backward rounds up to 4% apart)
        assert torch.linalg.vector_norm(grad - expected_grad) <= 1e-2 * torch.linalg.vector_norm(expected_grad)
    assert torch.count_nonzero(grads[0][30:]) == 0


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_every_matmul_sees_a_padded_row_count(autocast, monkeypatch):
    """bf16 matmuls on CPU build one oneDNN kernel per row count (test_long_run_memory): the loss's
    products, its gradient's included, run on the padded rows (a multiple of the chunk here), never on
    the ragged count of real targets."""
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", 100 * 50)  # 100 rows, cut to 64
    hidden, weight = _inputs(128, 16, 50, dtype=torch.float32)
    target = torch.randint(0, 50, (100,))
    bf16 = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as trace, bf16:
        output_layer_loss(hidden, weight, target, 0.1).backward()
    row_counts = set()
    for event in trace.events():
        if event.name in ("aten::mm", "aten::addmm_"):
            first, second = event.input_shapes[-2:] if event.name == "aten::mm" else event.input_shapes[1:3]
            row_counts |= {size for size in (*first, *second) if size not in (16, 50)}
    assert row_counts == {64}, row_counts


def test_the_logits_never_exist_whole(monkeypatch):
    """The point of fusing: no allocation of forward + backward is as large as the (R, V) logits."""
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", 256 * 2000)  # 256-row chunks of the 1,024 rows
    hidden, weight = _inputs(1024, 16, 2000, dtype=torch.float32)
    target = torch.randint(0, 2000, (1000,))
    logits_bytes = 1024 * 2000 * 4

    def largest_allocation(loss_of) -> int:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as trace:
            loss_of().backward()
        return max(event.cpu_memory_usage for event in trace.events())

    fused = largest_allocation(lambda: output_layer_loss(hidden, weight, target, 0.1))
    unfused = largest_allocation(lambda: F.cross_entropy(F.linear(hidden, weight)[:1000], target, reduction="sum"))
    assert unfused >= logits_bytes  # the check sees a whole-logits allocation where there is one
    assert fused < logits_bytes / 2, f"{fused:,} bytes in one allocation"


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize(("autocast", "widened"), [(False, False), (True, False), (True, True)],
                         ids=["fp32", "bf16", "bf16-widened"])  # fmt: skip
def test_both_cpu_paths_give_pytorchs_loss_and_gradients(cpu_path, autocast, widened, smoothing, monkeypatch):
    """fp32 and bf16 logits, chunks with a ragged one and padding rows, targets at both ends of the
    vocabulary: the loss of F.cross_entropy over the same logits, and its gradients. Widened: bf16
    products as on a CPU without bf16 kernels, through fp32 (model/cpu_linear.py), on any CPU."""
    if widened:
        monkeypatch.setattr(cpu_linear, "onednn_runs_bf16", lambda: False)
    monkeypatch.setattr(loss_module, "CPU_CHUNK_ELEMENTS", 16 * 301)  # 16-row chunks
    hidden, weight = _inputs(72, 24, 301, dtype=torch.float32)
    target = torch.randint(0, 301, (60,))
    target[:2] = torch.tensor([0, 300])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ours = output_layer_loss(hidden, weight, target, smoothing)
        grads = torch.autograd.grad(ours * 3.0, (hidden, weight))
        logits = F.linear(hidden[:60], weight)
    expected = F.cross_entropy(logits.float(), target, label_smoothing=smoothing, reduction="sum")
    expected_grads = torch.autograd.grad(expected * 3.0, (hidden, weight))
    torch.testing.assert_close(ours, expected)
    tolerance = 1e-2 if autocast else 1e-5  # bf16: the gradient of the logits is rounded to bf16
    for grad, expected_grad in zip(grads, expected_grads):
        assert torch.linalg.vector_norm(grad - expected_grad) <= tolerance * torch.linalg.vector_norm(expected_grad)
    assert torch.count_nonzero(grads[0][60:]) == 0


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_the_fused_kernel_computes_what_the_pytorch_path_does(autocast, fused_kernels, monkeypatch):
    """Held to each other on one input: the losses to fp32's rounding, the gradients as a whole to
    the rounding of their dtype (the kernel's exp is a polynomial, PyTorch's another, and each CPU's
    kernels sum in their own order: an element near zero or a bf16 rounding boundary may differ more)."""
    hidden, weight = _inputs(200, 32, 1000, dtype=torch.float32)
    target = torch.randint(0, 1000, (190,))

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = output_layer_loss(hidden, weight, target, 0.1)
            return loss, *torch.autograd.grad(loss, (hidden, weight))

    fused = run()
    monkeypatch.setenv(SWITCH, "0")
    reference = run()
    torch.testing.assert_close(fused[0], reference[0], rtol=1e-6, atol=0)
    tolerance = 4e-3 if autocast else 1e-5
    for ours, theirs in zip(fused[1:], reference[1:]):
        assert torch.linalg.vector_norm(ours - theirs) <= tolerance * torch.linalg.vector_norm(theirs)


def test_the_fused_kernel_gives_the_same_bits_on_any_number_of_threads(fused_kernels):
    """A resumed run on another thread count computes the same steps: each row is one thread's work."""
    logits = torch.randn(96, 500).bfloat16()
    target = torch.randint(0, 500, (90,))
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            grad = logits.clone()
            results.append((fused_kernels.label_smoothed_loss_(grad, target, 0.1), grad))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_the_fused_kernel_refuses_a_target_outside_the_vocabulary(fused_kernels):
    with pytest.raises(RuntimeError, match="target id out of range"):
        fused_kernels.label_smoothed_loss_(torch.zeros(4, 10), torch.tensor([1, 10]), 0.1)

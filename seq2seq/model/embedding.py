"""A stack's input: token embeddings scaled by sqrt(d), sinusoidal positions added, dropout, as the
stack's flat rows (rows.Rows).

Why a kernel of its own: PyTorch computes it as the embedding's gather, the scaling, the positions'
addition (after computing their sinusoids), dropout and the gather of the kept positions into flat
rows, and backward as as many passes again, the last two scattering the rows' gradient into a
zeroed (batch, length) tensor and then into a zeroed weight-shaped one. In training on a CPU where
the fused kernels are built, cpu_embedding.cpp does it in one pass each way: it writes the flat rows
straight from the weight's rows and a table of the sinusoids, and sums each token's gradient rows
into the weight's gradient, in fp32, once. It draws the PyTorch path's dropout mask, and its results
are that path's (the same ops and roundings, bit for bit in fp32; tests), except that the weight's
gradient is summed in fp32 where PyTorch's embedding sums bf16 rows in bf16.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor, nn

from seq2seq.model.cpu_kernels import cpu_kernels
from seq2seq.model.dropout import cheap_mask_fits, kernel_mask
from seq2seq.model.rows import Rows


def sinusoidal_positions(positions: Tensor, d_model: int) -> Tensor:
    """(T,) integer positions -> (T, d_model): sin on even dimensions, cos on odd ones, any length."""
    frequencies = torch.exp(
        torch.arange(0, d_model, 2, device=positions.device, dtype=torch.float32) * (-math.log(10000.0) / d_model)
    )
    angles = positions.float()[:, None] * frequencies[None, :]  # (T, d/2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # interleave: (T, d)


def fuses(embedding: nn.Embedding, p: float, start: int | Tensor, *, training: bool) -> bool:
    """Whether `embedded_rows` runs cpu_embedding.cpp's kernels for this embedding: in training (where
    the passes it saves are paid twice, forward and backward), on a CPU, outside torch.compile."""
    weight = embedding.weight
    return (
        training
        and isinstance(start, int)
        and weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and cheap_mask_fits(p)
        and not torch.compiler.is_compiling()
        and cpu_kernels() is not None
    )


def embedded_rows(
    embedding: nn.Embedding, tokens: Tensor, rows: Rows, start: int, scale: float, words_kept: Tensor | None, p: float
) -> Tensor:
    """rows.flatten(dropout(embedding(tokens) x scale x words_kept + sinusoids of start, start + 1, ...)),
    in one pass (where `fuses`), with the PyTorch path's dropout mask."""
    flat_tokens, flat_kept = tokens.reshape(-1), None if words_kept is None else words_kept.reshape(-1)
    table = position_table(rows.length + start, embedding.embedding_dim, embedding.weight.dtype)
    padding = -1 if embedding.padding_idx is None else embedding.padding_idx
    return _FusedEmbedding.apply(
        embedding.weight, flat_tokens.contiguous(), rows, start, flat_kept, table, scale, p, padding
    )


def position_table(length: int, d_model: int, dtype: torch.dtype) -> Tensor:
    """The sinusoids of positions 0 .. at least length - 1, in dtype, as the PyTorch path adds them."""
    return _position_table(1 << max(length - 1, 1).bit_length(), d_model, dtype)  # few sizes: powers of two


@functools.lru_cache(maxsize=8)
def _position_table(rows: int, d_model: int, dtype: torch.dtype) -> Tensor:
    return sinusoidal_positions(torch.arange(rows), d_model).to(dtype)


class _FusedEmbedding(torch.autograd.Function):
    """cpu_embedding.cpp's rows; the gradient reaches the weight alone. Keeps the tokens, the word
    mask and dropout's key, from which the backward pass draws the mask again."""

    @staticmethod
    def forward(
        ctx, weight: Tensor, tokens: Tensor, rows: Rows, start: int, words_kept: Tensor | None, table: Tensor,
        scale: float, p: float, padding_idx: int,
    ) -> Tensor:  # fmt: skip
        ctx.key, ctx.dropped_below, ctx.dropout_scale = kernel_mask(p)
        ctx.rows, ctx.vocab, ctx.scale, ctx.padding_idx = rows, weight.size(0), scale, padding_idx
        ctx.save_for_backward(tokens, words_kept)
        return cpu_kernels().embed_rows(
            weight.contiguous(), tokens, rows.tokens, rows.length, start, words_kept, table, scale, rows.padded,
            ctx.key, ctx.dropped_below, ctx.dropout_scale,
        )  # fmt: skip

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        tokens, words_kept = ctx.saved_tensors
        grad_weight = cpu_kernels().embed_rows_backward(
            grad.contiguous(), tokens, ctx.rows.tokens, ctx.rows.length, words_kept, ctx.vocab, ctx.padding_idx,
            ctx.scale, ctx.key, ctx.dropped_below, ctx.dropout_scale,
        )  # fmt: skip
        return grad_weight, None, None, None, None, None, None, None, None

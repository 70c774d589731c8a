"""How the Transformer's stacks run fast, behind one seam that layers.py calls: the decoder's
key/value caches, the heads split from side-by-side projections, and `attention`, which picks the
kernel by device and precision (the fused CUDA kernels by length, the CPU bf16 path in fp32). The
flat row layout the stacks run on is rows.py's. None of it changes what is computed: layers.py
reads as the paper, and these modules decide how its tensors are laid out and which kernel
multiplies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from seq2seq.model.dropout import dropout


def split_heads(fused: Tensor, parts: int, heads: int, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
    """(B, T, parts x d) side-by-side projections -> `parts` tensors (B, heads, T, d / heads) in `dtype`
    (default: fused's), views of fused or of its one cast.

    Through autograd's own ops (to, view, permute, unbind), the backward pass would stack the gradients
    of the parts into a new tensor, copy that again to undo the permutation and cast the result back;
    here it writes them into their places, in fused's dtype, in one pass."""
    return _SplitHeads.apply(fused, parts, heads, dtype or fused.dtype)


class _SplitHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fused: Tensor, parts: int, heads: int, dtype: torch.dtype) -> tuple[Tensor, ...]:
        batch, length, width = fused.shape
        ctx.split_shape = (batch, length, parts, heads, width // parts // heads)
        ctx.fused_dtype = fused.dtype
        return fused.to(dtype).view(ctx.split_shape).permute(2, 0, 3, 1, 4).unbind(0)

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor, None, None, None]:
        known = next(grad for grad in grads if grad is not None)
        fused = known.new_empty(ctx.split_shape, dtype=ctx.fused_dtype)
        for part, grad in enumerate(grads):
            if grad is None:
                fused[:, :, part].zero_()
            else:
                fused[:, :, part].copy_(grad.transpose(1, 2))
        return fused.flatten(2), None, None, None


@dataclass
class LayerCache:
    """One decoder layer's cached keys/values, each (B, heads, T, head_dim), grown by one step at a time."""

    self_k: Tensor | None = None
    self_v: Tensor | None = None
    cross_k: Tensor | None = None
    cross_v: Tensor | None = None

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Append the new positions' k, v (B, h, T_new, hd); return all keys, values and the causal mask
        (T_new, T_all) that the new positions attend with (None for a single new position)."""
        past = 0 if self.self_k is None else self.self_k.size(2)
        if past:
            k, v = torch.cat([self.self_k, k], dim=2), torch.cat([self.self_v, v], dim=2)
        self.self_k, self.self_v = k, v
        return k, v, _causal_mask(k.size(2) - past, past, k.device)


class DecoderCache:
    """Per-layer caches for incremental decoding (search.SearchCache); `length` is how many target
    positions are cached, so the model knows the position of the next one."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]

    @property
    def length(self) -> int:
        first = self.layers[0].self_k
        return 0 if first is None else first.size(2)

    def reorder(self, rows: Tensor) -> None:
        """Keep (and repeat) only the given rows of the self-attention cache, e.g. surviving beams.

        The cross-attention cache is left alone: beams of one sentence share the same encoder output.
        """
        for layer in self.layers:
            layer.self_k = layer.self_k.index_select(0, rows)
            layer.self_v = layer.self_v.index_select(0, rows)

    def select(self, rows: Tensor, sentences: Tensor) -> None:
        """Keep only the given target rows and source sentences (finished sentences leave the batch)."""
        self.reorder(rows)
        for layer in self.layers:
            layer.cross_k = layer.cross_k.index_select(0, sentences)
            layer.cross_v = layer.cross_v.index_select(0, sentences)


# Every fused attention kernel but cuDNN's. PyTorch picks cuDNN's first on Hopper GPUs in bf16/fp16, and
# it builds a cuDNN graph for each new (batch, heads, lengths) shape, milliseconds of host time per call.
# Token-bucketed batches have a new shape at almost every step, so bf16 training of Transformer-base ran
# slower than fp32 (profile_train on an H100, in the ledger). Flash and memory-efficient attention take
# any shape at no host cost; the math path backs them up.
FUSED_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# The same kernels, memory-efficient first, for sequences of at most SHORT_ATTENTION positions on a GPU.
# Flash attention works in tiles of 128 positions, so a ~40-token sentence leaves most of each tile idle;
# the memory-efficient kernel is faster there, flash on longer ones (benchmark_attention measures both by
# length; the crossover is in the ledger).
SHORT_ATTENTION = 96
SHORT_ATTENTION_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def _gpu_attention_backends(query_length: int, key_length: int) -> list[SDPBackend]:
    """The fused attention kernels to try on a GPU, in order of preference for these lengths."""
    if max(query_length, key_length) <= SHORT_ATTENTION:
        return SHORT_ATTENTION_BACKENDS
    return FUSED_ATTENTION_BACKENDS


def attention_dtype(projected: Tensor) -> torch.dtype:
    """The dtype attention computes in, given projected queries, keys or values: a bf16 model on a
    CPU attends in fp32 (_cpu_bf16_attention), so split_heads casts its projections once, for q, k and
    v projected together, rather than attention one by one."""
    if projected.device.type == "cpu" and projected.dtype == torch.bfloat16:
        return torch.float32
    return projected.dtype


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None,
    is_causal: bool,
    dropout_p: float,
    out_dtype: torch.dtype | None = None,
) -> Tensor:
    """softmax(q k^T / sqrt(head_dim)) v for q (B, h, Tq, hd) and k, v (B, h, Tk, hd), with the kernel
    this device and precision run best; mask broadcasts to (B, h, Tq, Tk), True = may attend.
    out_dtype: the model's dtype, where split_heads cast q, k, v to another (default: q's)."""
    out_dtype = out_dtype or q.dtype
    if q.device.type == "cpu" and torch.bfloat16 in (out_dtype, autocast_dtype(q.device)):
        return _cpu_bf16_attention(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p).to(out_dtype)
    backends = _gpu_attention_backends(q.size(-2), k.size(-2)) if q.device.type == "cuda" else FUSED_ATTENTION_BACKENDS
    with sdpa_kernel(backends, set_priority=q.device.type == "cuda"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs matrix products in on this device now (None: autocast is off)."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _cpu_bf16_attention(
    q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, is_causal: bool, dropout_p: float
) -> Tensor:
    """Attention of a bf16 model (or bf16 autocast) on a CPU, computed and returned in fp32.

    In fp32 because PyTorch's fused CPU kernel is slower in bf16, and a bf16 batched matmul makes
    oneDNN compile and keep a kernel for every (batch, length, length) shape it meets, which change
    with every batch (docs/performance.md, memory in long runs). Through the fused kernel because
    the explicit softmax(q k^T) v allocates the (B, h, Tq, Tk) scores, probabilities and their
    gradients, in sizes that change with every batch too, and glibc's heap kept holes of them: the
    fused path peaked lower and stepped faster than the explicit one (benchmark_train's memory
    columns). PyTorch's fused CPU kernels have
    no attention dropout; with it, the explicit path, which uses our cheap dropout mask.
    """
    with torch.autocast(q.device.type, enabled=False):
        if dropout_p == 0.0:
            with sdpa_kernel(FUSED_ATTENTION_BACKENDS):
                out = F.scaled_dot_product_attention(
                    q.float(), k.float(), v.float(), attn_mask=mask, is_causal=is_causal
                )
        else:
            out = dropout(probabilities(q, k, mask, is_causal), dropout_p, training=True) @ v.float()
    return out


def probabilities(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """softmax(q k^T / sqrt(head_dim)) over keys, (B, h, Tq, Tk), in fp32; masked keys get probability 0.

    Scores rounded to bf16 (8-bit mantissa) cost the demo BLEU on average (compare_precision in the
    ledger); fused kernels keep them in fp32 too.
    """
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.float() @ k.float().transpose(-2, -1)) * q.size(-1) ** -0.5
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


def _causal_mask(new: int, past: int, device: torch.device) -> Tensor | None:
    """(new, past + new) bool mask letting position past+i see positions <= past+i; None when new == 1."""
    if new == 1:
        return None
    return torch.ones(new, past + new, dtype=torch.bool, device=device).tril(diagonal=past)

"""Transformer building blocks: multi-head attention with a KV cache, feed-forward, encoder and decoder layers.

Weights use the standard layout (separate q/k/v/out projections, fc1/fc2, one LayerNorm per
sub-layer) so they map one-to-one onto fairseq/Marian/CTranslate2 Transformer checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.config import ModelConfig
from seq2seq.dropout import Dropout, dropout

ROW_MULTIPLE = 64


class RowRoundedLinear(nn.Linear):
    """nn.Linear whose matmuls see row counts rounded up to a multiple of ROW_MULTIPLE under CPU autocast.

    Why: oneDNN, which runs PyTorch's bf16 matmuls on CPU, compiles and caches a kernel (0.3-4 MiB)
    for every new row count, forward and backward. A batch's rows are its sentences x padded length,
    which each epoch's batches keep renewing, so the cache, and RSS, crept by ~80 MiB per 1,000 steps.
    The zero rows added here (at most 63 of a 4,000-token batch's rows) keep the set of row counts
    small, and are sliced off again: outputs and gradients are those of nn.Linear. fp32 runs on MKL,
    which caches nothing, and GPUs need no help, so they pass straight through.
    """

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
            return super().forward(x)
        rows = x.reshape(-1, x.shape[-1])
        padded = F.pad(rows, (0, 0, 0, -rows.shape[0] % ROW_MULTIPLE))
        return super().forward(padded)[: rows.shape[0]].view(*x.shape[:-1], self.out_features)


@dataclass
class LayerCache:
    """One decoder layer's cached keys/values, each (B, heads, T, head_dim)."""

    self_k: Tensor | None = None
    self_v: Tensor | None = None
    cross_k: Tensor | None = None
    cross_v: Tensor | None = None


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


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over `heads` subspaces, fused through F.scaled_dot_product_attention."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.q_proj = RowRoundedLinear(d_model, d_model)
        self.k_proj = RowRoundedLinear(d_model, d_model)
        self.v_proj = RowRoundedLinear(d_model, d_model)
        self.out_proj = RowRoundedLinear(d_model, d_model)

    def split_heads(self, x: Tensor) -> Tensor:
        batch, length, d_model = x.shape
        return x.view(batch, length, self.heads, d_model // self.heads).transpose(1, 2)  # (B, h, T, hd)

    def project_kv(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.split_heads(self.k_proj(x)), self.split_heads(self.v_proj(x))

    def attend(self, query: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, is_causal: bool = False) -> Tensor:
        """query (B, Tq, d) against k, v (B, h, Tk, hd); mask broadcasts to (B, h, Tq, Tk), True = may attend."""
        q = self.split_heads(self.q_proj(query))
        dropout_p = self.dropout if self.training else 0.0
        if q.device.type == "cpu" and q.dtype == torch.bfloat16:
            # PyTorch's fused CPU kernel is ~3x slower in bf16 than this explicit path (measured fwd+bwd
            # at 130 x 4 heads x 40 tokens); on GPU and in fp32 the fused kernel wins. Both products run
            # in fp32: a bf16 batched matmul makes oneDNN compile and keep a kernel (~1.5 MiB) for every
            # (batch, length, length) shape it meets, and these change with every batch (README,
            # Performance: memory); fp32 ones go to MKL, which keeps nothing, at no cost in step time.
            probs = dropout(_probabilities(q, k, mask, is_causal), dropout_p, training=self.training)
            with torch.autocast(q.device.type, enabled=False):
                out = (probs @ v.float()).to(v.dtype)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
        batch, heads, length, head_dim = out.shape
        return self.out_proj(out.transpose(1, 2).reshape(batch, length, heads * head_dim))  # (B, Tq, d)

    def weights(self, query: Tensor, k: Tensor, mask: Tensor | None) -> Tensor:
        """The attention probabilities (B, h, Tq, Tk), for plots; the fused kernel does not return them."""
        return _probabilities(self.split_heads(self.q_proj(query)), k, mask, is_causal=False)


def _probabilities(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """softmax(q k^T / sqrt(head_dim)) over keys, (B, h, Tq, Tk), in fp32; masked keys get probability 0.

    Scores rounded to bf16 (8-bit mantissa, ~0.4% relative error) cost the demo 0.6 BLEU on average
    (README, Performance); fused kernels keep them in fp32 too.
    """
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.float() @ k.float().transpose(-2, -1)) * q.size(-1) ** -0.5
    if is_causal:
        mask = torch.ones(q.size(-2), k.size(-2), dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1)


class FeedForward(nn.Module):
    """Position-wise fc2(dropout(act(fc1(x))))."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float, activation: str) -> None:
        super().__init__()
        self.fc1 = RowRoundedLinear(d_model, ffn_dim)
        self.fc2 = RowRoundedLinear(ffn_dim, d_model)
        self.dropout = Dropout(dropout)
        self.activation = F.gelu if activation == "gelu" else F.relu

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.dropout(self.activation(self.fc1(x))))


class _Residual(nn.Module):
    """x + dropout(sublayer(x)) with its LayerNorm before (pre-norm) or after (post-norm, the paper)."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.dropout(sublayer(self.norm(x)))
        return self.norm(x + self.dropout(sublayer(x)))


def _attention(config: ModelConfig) -> MultiHeadAttention:
    return MultiHeadAttention(config.d_model, config.heads, config.attention_dropout)


def _feed_forward(config: ModelConfig) -> FeedForward:
    return FeedForward(config.d_model, config.ffn_dim, config.activation_dropout, config.activation)


def _residual(config: ModelConfig) -> _Residual:
    return _Residual(config.d_model, config.dropout, pre_norm=config.norm == "pre")


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _attention(config)
        self.ffn = _feed_forward(config)
        self.self_attn_block = _residual(config)
        self.ffn_block = _residual(config)

    def forward(self, x: Tensor, src_mask: Tensor) -> Tensor:
        """x (B, S, d); src_mask (B, 1, 1, S), True on real tokens."""

        def self_attention(h: Tensor) -> Tensor:
            return self.self_attn.attend(h, *self.self_attn.project_kv(h), mask=src_mask)

        x = self.self_attn_block(x, self_attention)
        return self.ffn_block(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _attention(config)
        self.cross_attn = _attention(config)
        self.ffn = _feed_forward(config)
        self.self_attn_block = _residual(config)
        self.cross_attn_block = _residual(config)
        self.ffn_block = _residual(config)

    def forward(self, x: Tensor, memory: Tensor, src_mask: Tensor, cache: LayerCache | None) -> Tensor:
        """x (N, T, d) new target positions; memory (B, S, d) with N = B * beams rows grouped by sentence.

        With a cache, earlier positions come from it.
        """
        x = self.self_attn_block(x, lambda h: self._self_attention(h, cache))
        x = self.cross_attn_block(x, lambda h: self._cross_attention(h, memory, src_mask, cache))
        return self.ffn_block(x, self.ffn)

    def cross_attention_weights(self, x: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        """Cross-attention probabilities (B, h, T, S) of this layer, given its input x (B, T, d)."""
        h = self.self_attn_block(x, lambda y: self._self_attention(y, None))
        query = self.cross_attn_block.norm(h) if self.cross_attn_block.pre_norm else h
        k, _ = self.cross_attn.project_kv(memory)
        return self.cross_attn.weights(query, k, src_mask)

    def _self_attention(self, h: Tensor, cache: LayerCache | None) -> Tensor:
        k, v = self.self_attn.project_kv(h)
        if cache is None:  # teacher forcing: the whole prefix at once, the future masked
            return self.self_attn.attend(h, k, v, mask=None, is_causal=True)
        past = 0 if cache.self_k is None else cache.self_k.size(2)
        if past:
            k, v = torch.cat([cache.self_k, k], dim=2), torch.cat([cache.self_v, v], dim=2)
        cache.self_k, cache.self_v = k, v
        return self.self_attn.attend(h, k, v, mask=_causal_mask(h.size(1), past, h.device))

    def _cross_attention(self, h: Tensor, memory: Tensor, src_mask: Tensor, cache: LayerCache | None) -> Tensor:
        k, v = self._memory_kv(memory, cache)
        sentences, rows = k.size(0), h.size(0)
        if rows == sentences:
            return self.cross_attn.attend(h, k, v, mask=src_mask)
        # Beams of one sentence share its encoder output: fold them into the query length, so the
        # encoder keys/values are stored, reordered and attended once per sentence, not per beam.
        folded = h.reshape(sentences, (rows // sentences) * h.size(1), h.size(2))
        return self.cross_attn.attend(folded, k, v, mask=src_mask).reshape(h.shape)

    def _memory_kv(self, memory: Tensor, cache: LayerCache | None) -> tuple[Tensor, Tensor]:
        if cache is None:
            return self.cross_attn.project_kv(memory)
        if cache.cross_k is None:  # computed once per sentence, reused at every step
            cache.cross_k, cache.cross_v = self.cross_attn.project_kv(memory)
        return cache.cross_k, cache.cross_v


def _causal_mask(new: int, past: int, device: torch.device) -> Tensor | None:
    """(new, past + new) bool mask letting position past+i see positions <= past+i; None when new == 1."""
    if new == 1:
        return None
    return torch.ones(new, past + new, dtype=torch.bool, device=device).tril(diagonal=past)

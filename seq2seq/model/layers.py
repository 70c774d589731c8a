"""The Transformer's layers as the paper writes them: multi-head attention, the position-wise
feed-forward block, the residual connection with its LayerNorm, and the encoder and decoder layers.

How they run fast is rows.py's and execution.py's: a layer's activations are flat rows (`Rows` maps
them to (batch, length) where attention needs it), `attention` picks the kernel, and the caches
keep the decoder's keys and values. Weights use the standard layout (separate q/k/v/out projections,
fc1/fc2, one LayerNorm per sub-layer) so they map one-to-one onto fairseq/Marian/CTranslate2
Transformer checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.config import ModelConfig
from seq2seq.model.cpu_attention import FlatKeysValues, column_blocks, flat_attention, flat_attention_applies
from seq2seq.model.cpu_linear import Linear, linear
from seq2seq.model.dropout import Dropout, dropout_add, dropout_add_norm_for_two, dropout_add_then_norm
from seq2seq.model.execution import LayerCache, attention, attention_dtype, probabilities, split_heads
from seq2seq.model.rows import Memory, Rows


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over `heads` subspaces, fused through F.scaled_dot_product_attention."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.q_proj = Linear(d_model, d_model)
        self.k_proj = Linear(d_model, d_model)
        self.v_proj = Linear(d_model, d_model)
        self.out_proj = Linear(d_model, d_model)

    def self_attend(self, x: Tensor, rows: Rows, *, mask: Tensor | None, is_causal: bool = False) -> Tensor:
        """Self-attention of the flat rows x (rows.padded, d) -> (rows.padded, d); mask as in `attend`."""
        if flat_attention_applies(x, rows.spans, self._dropout_p()):
            fused = stacked_projection(x, (self.q_proj, self.k_proj, self.v_proj))
            return self.out_proj(flat_attention(fused, None, rows.spans, rows.spans, self.heads, causal=is_causal))
        return self.attend(rows, *self.project_qkv(x, rows), mask=mask, is_causal=is_causal)

    def cross_attend(self, query: Tensor, rows: Rows, memory_kv: FlatKeysValues) -> Tensor:
        """Attention of the flat rows query (rows.padded, d) to the memory's flat keys and values."""
        queries = self.q_proj(query)
        attended = flat_attention(queries, memory_kv.block, rows.spans, memory_kv.spans, self.heads, causal=False,
                                  keys_values_gradient_into=memory_kv.gradient_into)  # fmt: skip
        return self.out_proj(attended)

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def project_qkv(self, x: Tensor, rows: Rows) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's queries, keys and values (B, h, T, hd) of the flat rows x (rows.padded, d)."""
        return project_together(x, rows, (self.q_proj, self.k_proj, self.v_proj), self.heads)

    def project_q(self, query: Tensor, rows: Rows) -> Tensor:
        """Queries (B, h, T, hd) of the flat rows query (rows.padded, d)."""
        return project_together(query, rows, (self.q_proj,), self.heads)[0]

    def attend(
        self, rows: Rows, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, is_causal: bool = False
    ) -> Tensor:
        """q (B, h, Tq, hd) of flat (B, Tq) positions against k, v (B, h, Tk, hd) -> (rows.padded, d).

        mask broadcasts to (B, h, Tq, Tk), True = may attend.
        """
        out = attention(q, k, v, mask=mask, is_causal=is_causal, dropout_p=self._dropout_p(),
                        out_dtype=self.out_proj.weight.dtype)  # fmt: skip
        return self.out_proj(rows.flatten(out.transpose(1, 2)))

    def weights(self, query: Tensor, rows: Rows, k: Tensor, mask: Tensor | None) -> Tensor:
        """The attention probabilities (B, h, Tq, Tk), for plots; the fused kernel does not return them."""
        return probabilities(self.project_q(query, rows), k, mask, is_causal=False)


def project_together(x: Tensor, rows: Rows, projections: Sequence[nn.Linear], heads: int) -> tuple[Tensor, ...]:
    """The projections (B, heads, T, hd) of the flat rows x (rows.padded, d) side by side: one matrix
    product with their weights stacked, one move of its rows into (B, T) positions and one cast into
    attention's dtype, where one each per projection would take as many. The weights stay separate
    Linear layers: the checkpoint layout."""
    positions = rows.unflatten(stacked_projection(x, projections))
    return split_heads(positions, len(projections), heads, attention_dtype(positions))


def stacked_projection(x: Tensor, projections: Sequence[nn.Linear]) -> Tensor:
    """The projections of x side by side, (rows, len(projections) x d), in one matrix product."""
    if len(projections) == 1:
        return projections[0](x)
    weight = torch.cat([projection.weight for projection in projections])
    return linear(x, weight, torch.cat([projection.bias for projection in projections]))


def memory_keys_values(
    attentions: Sequence[MultiHeadAttention], memory: Memory, *, flat: bool = False
) -> list[tuple[Tensor, Tensor]] | list[FlatKeysValues]:
    """The keys and values (B, h, S, hd) of the encoder output for each of the decoder's cross-attentions,
    all in one matrix product: every layer reads the same memory, so their projections stack like a
    layer's own q, k and v (LightSeq and CTranslate2 do the same). flat: each layer's k | v columns of
    the memory's flat rows instead, for cpu_attention.flat_attention."""
    projections = [projection for attention in attentions for projection in (attention.k_proj, attention.v_proj)]
    if not projections:  # LayerDrop skipped every decoder layer
        return []
    if flat:
        blocks, gradients = column_blocks(stacked_projection(memory.flat, projections), len(attentions))
        return [FlatKeysValues(block, memory.rows.spans, gradients.into(index)) for index, block in enumerate(blocks)]
    parts = project_together(memory.flat, memory.rows, projections, attentions[0].heads)
    return list(zip(parts[0::2], parts[1::2]))


class FeedForward(nn.Module):
    """Position-wise fc2(dropout(act(fc1(x))))."""

    def __init__(self, d_model: int, ffn_dim: int, dropout: float, activation: str) -> None:
        super().__init__()
        self.fc1 = Linear(d_model, ffn_dim)
        self.fc2 = Linear(ffn_dim, d_model)
        self.dropout = Dropout(dropout)
        self.relu = activation != "gelu"

    def forward(self, x: Tensor) -> Tensor:
        fc1 = self.fc1
        hidden = linear(x, fc1.weight, fc1.bias, relu=True) if self.relu else F.gelu(fc1(x))
        return self.fc2(self.dropout(hidden))


class Residual(nn.Module):
    """x + dropout(sublayer(x)) with its LayerNorm before (pre-norm) or after (post-norm, the paper)."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        if self.pre_norm:
            return dropout_add(x, sublayer(self.norm(x)), self.dropout.p, training=self.training)
        return self.advance(x, x, sublayer, None)[0]

    def advance(self, x: Tensor, h: Tensor, sublayer, next_norm: nn.Module | None) -> tuple[Tensor, Tensor]:
        """forward's output and the next sublayer's input, given this block's two: its input x and its
        sublayer's h (pre-norm: self.norm(x), post-norm: x). Pre-norm's next input is next_norm of the
        output: the next block's LayerNorm, or its stack's last, computed in the pass that adds the
        residual (dropout.dropout_add_then_norm). Post-norm's is the output again, as a second tensor
        whose gradient the fused kernel adds as it reads the first's (dropout.dropout_add_norm_for_two)."""
        p, training = self.dropout.p, self.training  # dropout_add(x, y) is x + dropout(y), fused where it can be
        if self.pre_norm:
            return dropout_add_then_norm(x, sublayer(h), next_norm, p, training=training)
        return dropout_add_norm_for_two(x, sublayer(h), self.norm, p, training=training)


def _attention(config: ModelConfig) -> MultiHeadAttention:
    return MultiHeadAttention(config.d_model, config.heads, config.attention_dropout)


def _feed_forward(config: ModelConfig) -> FeedForward:
    return FeedForward(config.d_model, config.ffn_dim, config.activation_dropout, config.activation)


def _residual(config: ModelConfig) -> Residual:
    return Residual(config.d_model, config.dropout, pre_norm=config.norm == "pre")


def stack_input(
    x: Tensor, layers: Sequence[EncoderLayer | DecoderLayer], last_norm: nn.Module, *, pre_norm: bool
) -> tuple[tuple[Tensor, Tensor], list[nn.Module]]:
    """The (x, h) a stack's first layer takes, and the next_norm each of `layers` (those that run)
    hands its h through. Pre-norm: h is the first layer's first LayerNorm of x (last_norm where no
    layer runs), and each layer's next is the following layer's first LayerNorm, the last layer's the
    stack's own (last_norm); the last h is then the stack's output. Post-norm: h is x, and each
    layer's output is its h."""
    norms = [*(layer.first_norm for layer in layers), last_norm]
    return (x, norms[0](x) if pre_norm else x), norms[1:]


class EncoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _attention(config)
        self.ffn = _feed_forward(config)
        self.self_attn_block = _residual(config)
        self.ffn_block = _residual(config)

    @property
    def first_norm(self) -> nn.LayerNorm:
        return self.self_attn_block.norm

    def forward(
        self, x: Tensor, h: Tensor, rows: Rows, src_mask: Tensor, next_norm: nn.Module
    ) -> tuple[Tensor, Tensor]:
        """x (rows.padded, d), flat (B, S) positions, and h, its first sublayer's input (stack_input);
        src_mask (B, 1, 1, S), True on real tokens. -> the output and the next layer's h, by next_norm
        where the stack is pre-norm (stack_input)."""
        x, h = self.self_attn_block.advance(
            x, h, lambda h: self.self_attn.self_attend(h, rows, mask=src_mask), self.ffn_block.norm
        )
        return self.ffn_block.advance(x, h, self.ffn, next_norm)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = _attention(config)
        self.cross_attn = _attention(config)
        self.ffn = _feed_forward(config)
        self.self_attn_block = _residual(config)
        self.cross_attn_block = _residual(config)
        self.ffn_block = _residual(config)

    @property
    def first_norm(self) -> nn.LayerNorm:
        return self.self_attn_block.norm

    def forward(
        self,
        x: Tensor,
        h: Tensor,
        rows: Rows,
        memory_kv: tuple[Tensor, Tensor] | FlatKeysValues,
        src_mask: Tensor,
        cache: LayerCache | None,
        next_norm: nn.Module,
    ) -> tuple[Tensor, Tensor]:
        """x (rows.padded, d), flat (N, T) new target positions, N = B * beams rows grouped by sentence,
        and h, its first sublayer's input; -> the output and the next layer's h, as EncoderLayer's.
        memory_kv: this layer's keys and values of the encoder output (memory_keys_values), which the
        decoder computes for all its layers at once, flat where the decoder attends with flat_attention.

        With a cache, earlier positions come from it. The cache may be any object with LayerCache's
        self-attention fields and `extend`: graphed_decoder.StaticLayerCache keeps them in fixed buffers.
        """
        x, h = self.self_attn_block.advance(
            x, h, lambda h: self._self_attention(h, rows, cache), self.cross_attn_block.norm
        )
        x, h = self.cross_attn_block.advance(
            x, h, lambda h: self._cross_attention(h, rows, memory_kv, src_mask), self.ffn_block.norm
        )
        return self.ffn_block.advance(x, h, self.ffn, next_norm)

    def cross_attention_weights(self, x: Tensor, rows: Rows, memory_k: Tensor, src_mask: Tensor) -> Tensor:
        """Cross-attention probabilities (B, h, T, S) of this layer, given its input x (rows.padded, d)
        and its keys of the encoder output."""
        h = self.self_attn_block(x, lambda y: self._self_attention(y, rows, None))
        query = self.cross_attn_block.norm(h) if self.cross_attn_block.pre_norm else h
        return self.cross_attn.weights(query, rows, memory_k, src_mask)

    def _self_attention(self, h: Tensor, rows: Rows, cache: LayerCache | None) -> Tensor:
        if cache is None:  # teacher forcing: the whole prefix at once, the future masked
            return self.self_attn.self_attend(h, rows, mask=None, is_causal=True)
        q, k, v = self.self_attn.project_qkv(h, rows)
        k, v, mask = cache.extend(k, v)
        return self.self_attn.attend(rows, q, k, v, mask=mask)

    def _cross_attention(
        self, h: Tensor, rows: Rows, memory_kv: tuple[Tensor, Tensor] | FlatKeysValues, src_mask: Tensor
    ) -> Tensor:
        if isinstance(memory_kv, FlatKeysValues):
            return self.cross_attn.cross_attend(h, rows, memory_kv)
        k, v = memory_kv
        # beams of one sentence share its encoder output: they attend to it as one sentence
        sentence_rows = rows.per_sentence(k.size(0))
        q = self.cross_attn.project_q(h, sentence_rows)
        return self.cross_attn.attend(sentence_rows, q, k, v, mask=src_mask)

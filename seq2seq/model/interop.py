"""Our layers as torch.nn.Transformer: the weight mapping that proves parity and drives the reference benchmarks.

Each of our attention blocks has separate q/k/v projections; nn.MultiheadAttention packs them into
one in_proj matrix, in that order. Post-norm stacks have no final LayerNorm (as in the paper);
pre-norm stacks end with one, as nn.Transformer's do.
"""

from __future__ import annotations

import torch
from torch import nn

from seq2seq.model.layers import MultiHeadAttention
from seq2seq.model.transformer import Seq2SeqTransformer


@torch.no_grad()
def to_torch_transformer(model: Seq2SeqTransformer) -> nn.Transformer:
    """nn.Transformer (batch_first) computing what our encoder and decoder layers compute."""
    config = model.config
    pre = config.norm == "pre"
    kwargs = dict(
        dim_feedforward=config.ffn_dim, dropout=0.0, activation=config.activation, batch_first=True, norm_first=pre
    )
    encoder_layer = nn.TransformerEncoderLayer(config.d_model, config.heads, **kwargs)
    decoder_layer = nn.TransformerDecoderLayer(config.d_model, config.heads, **kwargs)
    reference = nn.Transformer(
        d_model=config.d_model,
        nhead=config.heads,
        batch_first=True,
        custom_encoder=nn.TransformerEncoder(
            encoder_layer,
            config.encoder_layers,
            norm=nn.LayerNorm(config.d_model) if pre else None,
            enable_nested_tensor=False,
        ),
        custom_decoder=nn.TransformerDecoder(
            decoder_layer, config.decoder_layers, norm=nn.LayerNorm(config.d_model) if pre else None
        ),
    )
    for ours, theirs in zip(model.encoder_layers, reference.encoder.layers):
        _copy_attention(ours.self_attn, theirs.self_attn)
        _copy_block(ours, theirs, [(ours.self_attn_block, theirs.norm1), (ours.ffn_block, theirs.norm2)])
    for ours, theirs in zip(model.decoder_layers, reference.decoder.layers):
        _copy_attention(ours.self_attn, theirs.self_attn)
        _copy_attention(ours.cross_attn, theirs.multihead_attn)
        norms = [
            (ours.self_attn_block, theirs.norm1),
            (ours.cross_attn_block, theirs.norm2),
            (ours.ffn_block, theirs.norm3),
        ]
        _copy_block(ours, theirs, norms)
    if pre:
        reference.encoder.norm.load_state_dict(model.encoder_norm.state_dict())
        reference.decoder.norm.load_state_dict(model.decoder_norm.state_dict())
    return reference.to(next(model.parameters()).device).eval()


def _copy_attention(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
    theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
    theirs.out_proj.load_state_dict(ours.out_proj.state_dict())


def _copy_block(ours, theirs, norms: list[tuple]) -> None:
    theirs.linear1.load_state_dict(ours.ffn.fc1.state_dict())
    theirs.linear2.load_state_dict(ours.ffn.fc2.state_dict())
    for our_block, their_norm in norms:
        their_norm.load_state_dict(our_block.norm.state_dict())

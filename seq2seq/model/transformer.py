"""The encoder-decoder Transformer of "Attention Is All You Need", with an incremental decoder.

Interface used by training and search alike:
    memory = model.encode(src, src_mask)
    logits = model.decode(tgt, memory, src_mask, cache=None)
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from seq2seq.config import ModelConfig
from seq2seq.data.special_tokens import PAD_ID, padding_mask
from seq2seq.model.cpu_attention import FlatKeysValues, flat_attention_applies
from seq2seq.model.dropout import Dropout
from seq2seq.model.embedding import embedded_rows, fuses, sinusoidal_positions
from seq2seq.model.execution import DecoderCache
from seq2seq.model.layers import DecoderLayer, EncoderLayer, Residual, memory_keys_values, stack_input
from seq2seq.model.rows import Memory, Rows, row_multiple


class Seq2SeqTransformer(nn.Module):
    def __init__(self, config: ModelConfig, *, src_vocab_size: int, tgt_vocab_size: int) -> None:
        super().__init__()
        self.config = config
        d_model = config.d_model
        self.src_embed = nn.Embedding(src_vocab_size, d_model, padding_idx=PAD_ID)
        self.tgt_embed = (
            self.src_embed if config.share_embeddings else nn.Embedding(tgt_vocab_size, d_model, padding_idx=PAD_ID)
        )
        self.encoder_layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.decoder_layers))
        # Pre-norm leaves the residual stream unnormalised, so each stack ends with a LayerNorm.
        self.encoder_norm = nn.LayerNorm(d_model) if config.norm == "pre" else nn.Identity()
        self.decoder_norm = nn.LayerNorm(d_model) if config.norm == "pre" else nn.Identity()
        self.output_proj = nn.Linear(d_model, tgt_vocab_size, bias=False)
        self.dropout = Dropout(config.dropout)
        self._init_weights()
        if config.share_embeddings or config.tie_output:  # the paper shares the pre-softmax weights too
            self.output_proj.weight = self.tgt_embed.weight

    def _init_weights(self) -> None:
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif "embed" in name:  # N(0, d^-1/2): unit variance after the sqrt(d) scaling
                nn.init.normal_(param, mean=0.0, std=self.config.d_model**-0.5)
            elif param.dim() == 2:
                nn.init.xavier_uniform_(param)
        for embedding in (self.src_embed, self.tgt_embed):
            nn.init.zeros_(embedding.weight[PAD_ID])

    def embed(self, embedding: nn.Embedding, tokens: Tensor, start: int | Tensor, word_dropout: float = 0.0) -> Tensor:
        """Scaled token embeddings plus sinusoidal positions start, start+1, ...: (B, T) -> (B, T, d).
        In training, `word_dropout` zeroes whole token embeddings (their positions stay): the word
        dropout of Sennrich et al. 2016, which Araabi & Monz 2020 found to pay on small data.

        `start` may be a (1,) device tensor, so that a captured CUDA graph reads it at each replay."""
        positions = torch.arange(tokens.size(1), device=tokens.device) + start
        x = embedding(tokens) * math.sqrt(self.config.d_model)
        if word_dropout and self.training:
            x = x * self._words_kept(tokens, word_dropout).unsqueeze(-1).to(x.dtype)
        return self.dropout(x + sinusoidal_positions(positions, self.config.d_model).to(x.dtype))

    def embed_rows(
        self, embedding: nn.Embedding, tokens: Tensor, rows: Rows, start: int | Tensor, word_dropout: float = 0.0
    ) -> Tensor:
        """`embed`'s output as the stack's flat rows: in training on a CPU, in one pass each way, with
        the same word and dropout masks (embedding.py)."""
        if not fuses(embedding, self.dropout.p, start, training=self.training):
            return rows.flatten(self.embed(embedding, tokens, start, word_dropout))
        words_kept = self._words_kept(tokens, word_dropout) if word_dropout else None
        return embedded_rows(embedding, tokens, rows, start, math.sqrt(self.config.d_model), words_kept, self.dropout.p)

    @staticmethod
    def _words_kept(tokens: Tensor, word_dropout: float) -> Tensor:
        return torch.rand(tokens.shape, device=tokens.device) >= word_dropout

    @property
    def pre_norm(self) -> bool:
        return self.config.norm == "pre"

    def _skipped(self, layerdrop: float) -> bool:
        """Whether training skips this layer now (LayerDrop, Fan et al. 2020; decided on the host)."""
        return self.training and layerdrop > 0 and float(torch.rand(())) < layerdrop

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        """src (B, S) ids, src_mask (B, 1, 1, S) -> memory (B, S, d); zeros where src_mask is False."""
        h, rows = self._encoded_rows(src, src_mask)
        return rows.unflatten(h)

    def _encoded_rows(self, src: Tensor, src_mask: Tensor) -> tuple[Tensor, Rows]:
        """The encoder's output as its flat rows (rows.padded, d), and where they lie."""
        multiple = row_multiple(src.device, self.src_embed.weight.dtype)
        rows = Rows.of(src_mask[:, 0, 0], multiple)  # rows.Rows: why the stack runs on flat rows
        x = self.embed_rows(self.src_embed, src, rows, 0)
        running = [layer for layer in self.encoder_layers if not self._skipped(self.config.encoder_layerdrop)]
        (x, h), next_norms = stack_input(x, running, self.encoder_norm, pre_norm=self.pre_norm)
        for layer, next_norm in zip(running, next_norms):
            x, h = layer(x, h, rows, src_mask, next_norm)
        return h, rows

    def decode_hidden(self, tgt: Tensor, memory: Tensor, src_mask: Tensor, cache: DecoderCache | None = None) -> Tensor:
        """tgt (B, T) ids -> decoder output (B, T, d); with a cache, tgt holds only the new positions.

        Without a cache, tgt's PAD positions must trail its tokens (right padding); their outputs are zeros."""
        h, rows = self._decoded_rows(tgt, memory, src_mask, cache)
        return rows.unflatten(h)

    def _decoded_rows(
        self, tgt: Tensor, memory: Tensor | Memory, src_mask: Tensor, cache: DecoderCache | None = None
    ) -> tuple[Tensor, Rows]:
        """The decoder's output as its flat rows (rows.padded, d), and where they lie."""
        x, rows, memory = self._decoder_input(tgt, memory, src_mask, cache)
        running = [index for index in range(len(self.decoder_layers))
                   if not self._skipped(self.config.decoder_layerdrop)]  # fmt: skip
        layers = [self.decoder_layers[index] for index in running]
        (x, h), next_norms = stack_input(x, layers, self.decoder_norm, pre_norm=self.pre_norm)
        memory_kvs = self._memory_keys_values(running, rows, memory, cache)
        for index, layer, memory_kv, next_norm in zip(running, layers, memory_kvs, next_norms):
            layer_cache = None if cache is None else cache.layers[index]
            x, h = layer(x, h, rows, memory_kv, src_mask, layer_cache, next_norm)
        return h, rows

    def _memory_keys_values(
        self, running: list[int], rows: Rows, memory: Memory, cache: DecoderCache | None
    ) -> list[tuple[Tensor, Tensor]] | list[FlatKeysValues]:
        """The cross-attention keys and values of the decoder layers `running`: from the cache where it
        holds them, else all in one matrix product (layers.memory_keys_values); a new cache keeps them.
        Without a cache, flat for cpu_attention where it runs."""
        if cache is None:
            p = self.config.attention_dropout if self.training else 0.0
            keys = memory.rows.spans  # one sentence of memory per target row (beams share theirs elsewhere)
            flat = flat_attention_applies(memory.flat, rows.spans, p) and keys is not None and len(keys) == rows.batch
            return memory_keys_values([self.decoder_layers[index].cross_attn for index in running], memory, flat=flat)
        if cache.layers[0].cross_k is None:  # computed once per sentence, reused at every step
            every = memory_keys_values([layer.cross_attn for layer in self.decoder_layers], memory)
            for layer_cache, (k, v) in zip(cache.layers, every):
                layer_cache.cross_k, layer_cache.cross_v = k, v
        return [(cache.layers[index].cross_k, cache.layers[index].cross_v) for index in running]

    def _decoder_input(
        self, tgt: Tensor, memory: Tensor | Memory, src_mask: Tensor, cache: DecoderCache | None
    ) -> tuple[Tensor, Rows, Memory]:
        """The embedded target as flat rows, and the memory as the decoder layers read it.

        A cached decoder computes every position, PAD included: its cache's rows line up with the batch's."""
        multiple = row_multiple(tgt.device, self.tgt_embed.weight.dtype)
        rows = Rows.of(tgt != PAD_ID, multiple) if cache is None else Rows(*tgt.shape, multiple)
        start = 0 if cache is None else cache.length
        x = self.embed_rows(self.tgt_embed, tgt, rows, start, self.config.target_word_dropout)
        return x, rows, memory if isinstance(memory, Memory) else Memory(memory, src_mask, multiple)

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor, cache: DecoderCache | None = None) -> Tensor:
        """tgt (B, T) ids -> logits (B, T, V)."""
        return self.output_proj(self.decode_hidden(tgt, memory, src_mask, cache))

    def forward(
        self, src: Tensor, tgt_in: Tensor, positions: Tensor | None = None, *, output_layer: bool = True
    ) -> Tensor:
        """Teacher forcing: logits (B, T, V) for every target position at once, or, given `positions`
        (N,) flat indices into B*T, logits (N, V) for those alone (training skips padded positions).
        Where `positions` lists every real target position in order and then padding entries
        (Batch.target_positions), the decoder's flat rows are returned as they stand (Rows.are): the
        padding entries' rows are then the stack's padding rows, or zeros past them.

        With output_layer=False, the rows the output layer would read instead, (B, T, d) or (N, d):
        training's loss applies that layer itself, a chunk at a time (training/loss.py). A flag on
        forward rather than a method of its own, because DDP synchronises gradients only of what
        runs through forward."""
        src_mask = padding_mask(src)
        hidden, rows = self._decoded_rows(tgt_in, Memory.of_rows(*self._encoded_rows(src, src_mask)), src_mask)
        if positions is None:
            hidden = rows.unflatten(hidden)
        elif not rows.are(positions):
            hidden = rows.unflatten(hidden).flatten(0, 1).index_select(0, positions)
        elif positions.numel() > rows.padded:  # the flat rows as they stand, and a zero row per entry past them
            hidden = F.pad(hidden, (0, 0, 0, positions.numel() - rows.padded))
        return self.output_proj(hidden) if output_layer else hidden

    def set_dropout(self, p: float) -> None:
        """model.dropout's rate (embeddings and residual branches) from now on: train.dropout_from_epoch
        turns it on part way through training. Attention, activation and word dropout keep theirs."""
        for module in [self, *(module for module in self.modules() if isinstance(module, Residual))]:
            module.dropout.p = p

    def new_cache(self) -> DecoderCache:
        return DecoderCache(len(self.decoder_layers))

    @torch.no_grad()
    def cross_attention(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        """Cross-attention probabilities (layers, B, heads, T, S) for a teacher-forced target, for plots."""
        src_mask = padding_mask(src)
        memory = self.encode(src, src_mask)
        x, rows, memory = self._decoder_input(tgt_in, memory, src_mask, None)
        maps = []
        layers = list(self.decoder_layers)
        every = memory_keys_values([layer.cross_attn for layer in layers], memory)
        (x, h), next_norms = stack_input(x, layers, self.decoder_norm, pre_norm=self.pre_norm)
        for layer, memory_kv, next_norm in zip(layers, every, next_norms):
            maps.append(layer.cross_attention_weights(x, rows, memory_kv[0], src_mask))
            x, h = layer(x, h, rows, memory_kv, src_mask, None, next_norm)
        return torch.stack(maps)


class VocabularySizes(Protocol):
    """What the model needs to know of a tokenizer (tokenizer.Tokenizer has it)."""

    @property
    def src_vocab_size(self) -> int: ...

    @property
    def tgt_vocab_size(self) -> int: ...


def build_model(config: ModelConfig, vocabulary: VocabularySizes) -> Seq2SeqTransformer:
    """A freshly initialised model of `config`'s shape for this vocabulary."""
    return Seq2SeqTransformer(
        config, src_vocab_size=vocabulary.src_vocab_size, tgt_vocab_size=vocabulary.tgt_vocab_size
    )

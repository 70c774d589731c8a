"""Decoding with a fixed-size KV cache whose decoder step is replayed as one CUDA graph.

On a GPU an incremental decoder step of a translation model is tiny work spread over ~20 kernels
per layer: the host spends longer launching them than the GPU spends running them, so search ran
slower than torch.nn.Transformer recomputing the whole prefix (docs/performance.md, GPU). A CUDA graph records
the step's kernels once and replays them with one launch, but it needs every tensor at a fixed
address and shape. So here the cache has fixed buffers: keys/values for `max_length` positions per
row, written at the step's position (a device tensor the graph reads) and attended with a mask
over the positions filled so far; the encoder's keys/values fill their buffers once per batch.

Search drops finished sentences from its batch and reorders beams. A graph cannot shrink, so the
buffers keep every row of the batch ("physical" rows): search sees only its active rows, mapped
to physical ones; dropping a sentence only changes the map, and a beam reorder becomes a gather
that the next replay performs. `GraphedDecoder` is a `search.Decoder`, so greedy and beam search
run unchanged on it; `graphs=False` runs the same fixed-buffer step eagerly (any device: the CPU
tests prove it equal to the growing cache).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import Tensor

from seq2seq.data.special_tokens import BOS_ID
from seq2seq.model.layers import memory_keys_values, stack_input
from seq2seq.model.rows import Memory, Rows
from seq2seq.model.transformer import Seq2SeqTransformer

LENGTH_STEP = 32  # buffers hold a multiple of this many positions; they double when a search outgrows them
KEPT_GRAPHS = 4  # captured step graphs kept for reuse by later batches of the same shape


class StaticLayerCache:
    """One decoder layer's keys/values in fixed buffers: self-attention (N, h, max_length, hd) for the
    N physical rows, cross-attention (B, h, S, hd) for the B sentences (execution.LayerCache's fields)."""

    def __init__(
        self,
        *,
        rows: int,
        sentences: int,
        source_length: int,
        max_length: int,
        heads: int,
        head_dim: int,
        position: Tensor,
        dtype: torch.dtype,
    ) -> None:
        device = position.device
        self.self_k = torch.zeros(rows, heads, max_length, head_dim, dtype=dtype, device=device)
        self.self_v = torch.zeros_like(self.self_k)
        self.cross_k = torch.zeros(sentences, heads, source_length, head_dim, dtype=dtype, device=device)
        self.cross_v = torch.zeros_like(self.cross_k)
        self.position = position  # (1,) the step's target position, shared by all layers
        self.key_positions = torch.arange(max_length, device=device)

    def extend(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Write the new position's k, v (N, h, 1, hd) at `position`; all buffers and the mask of the
        positions filled so far, (1, 1, 1, max_length). Unfilled positions hold zeros, never NaN."""
        self.self_k.index_copy_(2, self.position, k)
        self.self_v.index_copy_(2, self.position, v)
        return self.self_k, self.self_v, (self.key_positions <= self.position).view(1, 1, 1, -1)


class DecoderStep:
    """The fixed buffers of one batch shape and the decoder step over them, optionally as a CUDA graph."""

    def __init__(
        self, model: Seq2SeqTransformer, *, rows: int, sentences: int, source_length: int, max_length: int
    ) -> None:
        self.model = model
        self.rows, self.sentences, self.source_length, self.max_length = rows, sentences, source_length, max_length
        weight = model.output_proj.weight
        device = weight.device
        self.tokens = torch.full((rows, 1), BOS_ID, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.identity = torch.arange(rows, device=device)
        self.gather = self.identity.clone()  # physical row p takes the cached keys/values of row gather[p]
        self.src_mask = torch.ones(sentences, 1, 1, source_length, dtype=torch.bool, device=device)
        config = model.config
        self.layers = [
            StaticLayerCache(
                rows=rows,
                sentences=sentences,
                source_length=source_length,
                max_length=max_length,
                heads=config.heads,
                head_dim=config.d_model // config.heads,
                position=self.position,
                dtype=weight.dtype,
            )
            for _ in model.decoder_layers
        ]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: Tensor | None = None  # the graph's output buffer (rows, V)

    def forward(self) -> Tensor:
        """Reorder the cached rows by `gather`, then decode `tokens` at `position`: logits (rows, V)."""
        model = self.model
        for cache in self.layers:
            cache.self_k.copy_(cache.self_k.index_select(0, self.gather))
            cache.self_v.copy_(cache.self_v.index_select(0, self.gather))
        rows = Rows(self.rows, 1)
        x = rows.flatten(model.embed(model.tgt_embed, self.tokens, self.position))
        layers = list(model.decoder_layers)
        (x, h), next_norms = stack_input(x, layers, model.decoder_norm, pre_norm=model.pre_norm)
        for layer, cache, next_norm in zip(layers, self.layers, next_norms):
            x, h = layer(x, h, rows, (cache.cross_k, cache.cross_v), self.src_mask, cache, next_norm)
        return model.output_proj(h)

    def capture(self, pool) -> None:
        """Record `forward` as a CUDA graph (after warm-up runs on a side stream, as PyTorch requires)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = self.forward()

    def run(self) -> Tensor:
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.logits

    def load(self, memory: Tensor, src_mask: Tensor) -> None:
        """Start a batch: the encoder's keys/values and mask, empty self-attention buffers."""
        self.src_mask.copy_(src_mask)
        attentions = [layer.cross_attn for layer in self.model.decoder_layers]
        every = memory_keys_values(attentions, Memory(memory, src_mask, 1))
        for (k, v), cache in zip(every, self.layers):
            cache.cross_k.copy_(k)
            cache.cross_v.copy_(v)
            cache.self_k.zero_()
            cache.self_v.zero_()
        self.gather.copy_(self.identity)

    def take_over(self, old: DecoderStep) -> None:
        """Continue a batch that `old` (same rows, fewer positions) was decoding."""
        self.src_mask.copy_(old.src_mask)
        self.tokens.copy_(old.tokens)
        self.gather.copy_(old.gather)
        for new, cache in zip(self.layers, old.layers):
            new.cross_k.copy_(cache.cross_k)
            new.cross_v.copy_(cache.cross_v)
            new.self_k.zero_()
            new.self_v.zero_()
            new.self_k[:, :, : old.max_length] = cache.self_k
            new.self_v[:, :, : old.max_length] = cache.self_v


class StaticDecoderCache:
    """The search.SearchCache of GraphedDecoder: which physical row each active row is, and the step."""

    def __init__(self, decoder: GraphedDecoder) -> None:
        self.decoder = decoder
        self.step: DecoderStep | None = None
        self.physical: Tensor | None = None  # (active rows,) their physical rows
        self.length = 0  # target positions decoded so far

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor) -> Tensor:
        if self.step is None:  # the first step: the batch is whole, active rows are physical rows
            self.step = self.decoder.step_for(tgt.size(0), memory.size(0), memory.size(1), self.length + 1)
            self.step.load(memory, src_mask)
            self.physical = torch.arange(tgt.size(0), device=tgt.device)
        elif self.length >= self.step.max_length:
            old = self.step
            self.step = self.decoder.step_for(old.rows, old.sentences, old.source_length, 2 * old.max_length)
            self.step.take_over(old)
        step = self.step
        step.tokens.index_copy_(0, self.physical, tgt)
        step.position.fill_(self.length)
        logits = step.run()
        step.gather.copy_(step.identity)
        self.length += 1
        return logits.index_select(0, self.physical).unsqueeze(1)

    def reorder(self, rows: Tensor) -> None:
        """Active row i continues from active row rows[i]: a gather the next step performs."""
        self.step.gather.index_copy_(0, self.physical, self.step.gather.index_select(0, self.physical[rows]))

    def select(self, rows: Tensor, sentences: Tensor) -> None:
        """Only the given active rows stay active (search keeps whole sentences, in order): a new map,
        no data moved. Their sentences' keys/values stay where they are."""
        self.physical = self.physical.index_select(0, rows)


class GraphedDecoder:
    """A search.Decoder over our Transformer: fixed-buffer KV cache, each step one CUDA graph replay.

    Graphs are kept for reuse by shape (KEPT_GRAPHS, least recently used out) and share one memory
    pool: they replay one at a time, and each step's logits are copied out before the next replay.
    """

    def __init__(self, model: Seq2SeqTransformer, *, graphs: bool = True) -> None:
        self.model = model
        self.graphs = graphs
        self._steps: OrderedDict[tuple[int, int, int, int], DecoderStep] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if graphs else None

    def parameters(self):
        return self.model.parameters()

    def encode(self, src: Tensor, src_mask: Tensor) -> Tensor:
        return self.model.encode(src, src_mask)

    def new_cache(self) -> StaticDecoderCache:
        return StaticDecoderCache(self)

    def decode(self, tgt: Tensor, memory: Tensor, src_mask: Tensor, cache: StaticDecoderCache) -> Tensor:
        """tgt (n, 1) new tokens of the n active rows -> logits (n, 1, V)."""
        return cache.decode(tgt, memory, src_mask)

    def step_for(self, rows: int, sentences: int, source_length: int, positions: int) -> DecoderStep:
        """A step with room for at least `positions` target positions (and twice the source's)."""
        max_length = LENGTH_STEP * math.ceil(max(positions, 2 * source_length) / LENGTH_STEP)
        key = (rows, sentences, source_length, max_length)
        step = self._steps.pop(key, None)
        if step is None:
            step = DecoderStep(
                self.model, rows=rows, sentences=sentences, source_length=source_length, max_length=max_length
            )
            if self.graphs:
                step.capture(self._pool)
        self._steps[key] = step
        while len(self._steps) > KEPT_GRAPHS:
            self._steps.popitem(last=False)
        return step


def graphs_apply(model: torch.nn.Module) -> bool:
    """Whether translation should decode `model` through GraphedDecoder: our Transformer, in eval mode,
    on a CUDA device, outside autocast (graphs are captured without autocast's weight-cast cache)."""
    return (
        isinstance(model, Seq2SeqTransformer)
        and not model.training
        and model.output_proj.weight.device.type == "cuda"
        and not torch.is_autocast_enabled("cuda")
    )

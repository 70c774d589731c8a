"""How the Transformer's stacks run fast, behind one seam that layers.py calls: the flat row layout
(`Rows`, `Memory`: PAD positions skipped on CPU, rows padded to a fixed multiple in bf16), the
decoder's key/value caches, and `attention`, which picks the kernel by device and precision (the
fused CUDA kernels by length, the CPU bf16 path in fp32). None of it changes what is computed:
layers.py reads as the paper, and this module decides how its tensors are laid out and which
kernel multiplies them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from seq2seq.model.dropout import dropout

ROW_MULTIPLE = 64


def row_multiple(device: torch.device, dtype: torch.dtype) -> int:
    """The multiple that a stack of `dtype` weights pads its rows to: ROW_MULTIPLE for bf16 on CPU
    (bf16 weights, or autocast to bf16; see Rows), else 1."""
    bf16 = dtype == torch.bfloat16 or torch.is_autocast_enabled("cpu")
    return ROW_MULTIPLE if device.type == "cpu" and bf16 else 1


@dataclass(frozen=True)
class Rows:
    """Where a (batch, length) block of positions lies in a stack's flat (padded, d) activations.

    Why flat: every linear, LayerNorm and dropout works on rows, and only attention, which needs
    the (batch, length) structure, views them as such. That lets a stack skip what costs time and
    changes nothing:

    - PAD positions (`tokens`, on CPU). Token-bucketed batches still hold PAD positions, on both
      sides; their rows were computed and thrown away. With `tokens`, the flat rows are the token
      positions alone, and attention sees the PAD positions as zero rows: masked as keys (source
      padding mask; a target's PADs trail it, so causal masking hides them), and their queries'
      outputs are dropped. The matrix products of a step shrink by the PAD share (benchmark_train
      and profile_train in the ledger). On a GPU every position
      is kept: listing the token positions there (nonzero) would make the host wait for the device.
      So it is under torch.compile: a list of data-dependent length breaks the graph at every layer.
    - oneDNN's kernel cache. oneDNN, which runs PyTorch's bf16 matmuls on CPU, compiles and caches
      a kernel for every new row count of a linear layer, forward and backward. A batch's row count
      keeps changing, so that cache, and RSS, crept up for the whole run. A stack
      pads its rows once, with at most `multiple` - 1 zero rows, and keeps them; attention reads
      only the first `used` rows, so results and gradients are those of the unpadded model. Padding
      each linear's input and slicing its output instead cost more of a step in copies
      (docs/performance.md, memory in long runs).
    """

    batch: int
    length: int
    multiple: int = 1
    tokens: Tensor | None = None  # flat indices into batch x length of the rows kept; None: all of them
    # Where tokens is given: for each of the batch x length positions, the row it reads (any row for
    # a position not kept), and the positions not kept, the zeros of `unflatten`.
    sources: Tensor | None = None
    gaps: Tensor | None = None
    # (batch, 2) int64 on a CPU where each sentence's kept positions come first (right padding): the
    # first flat row and the number of rows of each sentence, which cpu_attention reads them by.
    spans: Tensor | None = None

    @classmethod
    def of(cls, keep: Tensor, multiple: int) -> Rows:
        """The rows of a (batch, length) block whose positions to compute are True in `keep`: only
        those on a CPU (when some are not, and not compiling), every one elsewhere."""
        if keep.device.type != "cpu" or torch.compiler.is_compiling():
            return cls(keep.size(0), keep.size(1), multiple)
        lengths = keep.sum(1)
        right_padded = bool(torch.equal(keep, torch.arange(keep.size(1)) < lengths[:, None]))
        spans = torch.stack([lengths.cumsum(0) - lengths, lengths], 1) if right_padded else None
        kept = keep.reshape(-1)
        tokens = kept.nonzero().squeeze(1)
        if tokens.numel() == kept.numel():
            return cls(keep.size(0), keep.size(1), multiple, spans=spans)
        sources = (kept.cumsum(0) - 1).clamp_(min=0)
        return cls(keep.size(0), keep.size(1), multiple, tokens, sources, (~kept).nonzero().squeeze(1), spans)

    @property
    def used(self) -> int:
        return self.batch * self.length if self.tokens is None else self.tokens.numel()

    @property
    def padded(self) -> int:
        return self.used + (-self.used % self.multiple)

    def flatten(self, x: Tensor) -> Tensor:
        """(batch, length, ...features) -> (padded, features): the kept positions, then zero rows."""
        flat = x.reshape(self.batch * self.length, -1)
        if self.tokens is not None:
            return _GatherRows.apply(flat, self)
        return flat if self.padded == self.used else F.pad(flat, (0, 0, 0, self.padded - self.used))

    def are(self, positions: Tensor) -> bool:
        """Whether these rows are the flat positions `positions` lists, in its order, and as many rows
        as it has: its real positions (ascending flat indices of the positions kept), then padding.
        Then the stack's output is what a gather of `positions` would give, but for padding rows, and
        needs neither `unflatten` nor that gather. Asked on a CPU and outside torch.compile only: a
        GPU's rows are every position, and asking would make the host wait."""
        if positions.device.type != "cpu" or torch.compiler.is_compiling() or positions.numel() != self.padded:
            return False
        listed = self.tokens if self.tokens is not None else torch.arange(self.used)
        return torch.equal(positions[: self.used], listed)

    def per_sentence(self, sentences: int) -> Rows:
        """These rows read as `sentences` rows of queries: beams of one sentence folded into its query
        length, so the encoder's keys/values are stored, reordered and attended once per sentence,
        not per beam. The flat rows, and the flat index of each, stay; only their reading changes."""
        if self.batch == sentences:
            return self
        return replace(self, batch=sentences, length=self.batch * self.length // sentences, spans=None)

    def unflatten(self, x: Tensor) -> Tensor:
        """(padded, features) -> (batch, length, features), zeros where a position was not kept."""
        if self.tokens is not None:
            kept = _ScatterRows.apply(x, self)
        else:  # slicing all the rows would still cost a backward pass that zeroes and copies them
            kept = x if self.padded == self.used else x[: self.used]
        return kept.view(self.batch, self.length, x.size(-1))


# Rows.flatten and Rows.unflatten run several times per layer, forward and backward, so each moves
# its rows as few times as it can, and both ways as a gather: flattening writes the kept rows and
# zeroes only the padding rows; unflattening reads a row for every position and zeroes the positions
# not kept (on a CPU, index_select and index_fill_ take less time in a bf16 step than index_copy_ into
# zeros did: profile_train's ops). Composed of PyTorch's ops they moved more: F.pad fills
# its whole output with zeros before copying the rows in, the backward of a slice zeroes the whole
# input's shape before copying the slice's gradient in, and index_select and index_copy each add a
# temporary.
class _GatherRows(torch.autograd.Function):
    """(positions, d) -> (padded, d): the rows at rows.tokens, then rows.padded - rows.used zero rows."""

    @staticmethod
    def forward(ctx, flat: Tensor, rows: Rows) -> Tensor:
        ctx.rows = rows
        return _rows_then_zeros(flat, rows)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _positions_then_zeros(grad, ctx.rows), None


class _ScatterRows(torch.autograd.Function):
    """(padded, d) -> (positions, d): row i of the first rows.used at position rows.tokens[i], zeros elsewhere."""

    @staticmethod
    def forward(ctx, x: Tensor, rows: Rows) -> Tensor:
        ctx.rows = rows
        return _positions_then_zeros(x, rows)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _rows_then_zeros(grad, ctx.rows), None


def _rows_then_zeros(source: Tensor, rows: Rows) -> Tensor:
    out = source.new_empty(rows.padded, source.size(1))
    torch.index_select(source, 0, rows.tokens, out=out[: rows.used])
    out[rows.used :].zero_()
    return out


def _positions_then_zeros(source: Tensor, rows: Rows) -> Tensor:
    return source.index_select(0, rows.sources).index_fill_(0, rows.gaps, 0)


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


class Memory:
    """The encoder output (B, S, d) as the decoder layers read it: flat rows of the source positions
    that src_mask (B, 1, 1, S) keeps, made on first use.

    With a filled cache the decoder reads the encoder's keys/values from it, so an incremental
    search step pays for neither flattening the memory nor listing its positions again. Made on
    first use by hand, not through functools.cached_property: before Python 3.12 that takes a lock,
    which torch.compile cannot trace, so a compiled decoder broke into pieces at every layer and
    fell back to running eagerly.
    """

    def __init__(self, memory: Tensor | None, src_mask: Tensor | None, multiple: int) -> None:
        self._memory, self._src_mask, self._multiple = memory, src_mask, multiple
        self._rows: Rows | None = None
        self._flat: Tensor | None = None

    @classmethod
    def of_rows(cls, flat: Tensor, rows: Rows) -> Memory:
        """The encoder's own flat output rows as the memory: training reads them as they are, where
        unflattening them and flattening them again took two gathers each way."""
        memory = cls(None, None, rows.multiple)
        memory._rows, memory._flat = rows, flat
        return memory

    @property
    def rows(self) -> Rows:
        if self._rows is None:
            self._rows = Rows.of(self._src_mask[:, 0, 0], self._multiple)
        return self._rows

    @property
    def flat(self) -> Tensor:
        """(rows.padded, d)"""
        if self._flat is None:
            self._flat = self.rows.flatten(self._memory)
        return self._flat


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

"""Where a (batch, length) block of positions lies in a stack's flat (rows, d) activations: `Rows`
(PAD positions skipped on CPU, rows padded to a fixed multiple in bf16) and the moves between the two
layouts, and `Memory`, the encoder output as the decoder's layers read it. None of it changes what is
computed: execution.py and layers.py run the stacks on these rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

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
        """Whether these rows are the first rows of the flat positions `positions` lists: its real
        positions in order (ascending flat indices of the positions kept), then padding entries, at
        least as many as these rows. Then the stack's output, and zero rows for the entries past it,
        is what a gather of `positions` would give, but for padding entries, without `unflatten` or
        that gather. Asked on a CPU and outside torch.compile only: a GPU's rows are every position,
        and asking would make the host wait."""
        if positions.device.type != "cpu" or torch.compiler.is_compiling() or positions.numel() < self.padded:
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

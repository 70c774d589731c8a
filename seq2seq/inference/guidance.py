"""Per-sentence guidance of a search: a target prefix to force and terminology constraints to meet,
as token ids, and the tensors the search loops read them from.

A target prefix is forced token by token (only the prefix's token is allowed, at log-probability
0: as CTranslate2 does, a score counts the tokens the search chose, normalised by the whole
output's length; beam search ends a hypothesis right after its prefix only where EOS is the best
token). Terminology constraints run through constraints.py's dynamic beam allocation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from seq2seq.decoding import guidance_limit


@dataclass(frozen=True)
class Guidance:
    """Per sentence of a batch: a target prefix to force ([] for none) and target phrases that must
    appear ([] for none), as token ids; and the ids of the pieces that continue a word
    (constraints.Constraints says why)."""

    prefixes: list[list[int]]
    constraints: list[list[list[int]]]
    continuations: frozenset[int] = frozenset()

    @classmethod
    def none(cls, sentences: int) -> Guidance:
        return cls([[] for _ in range(sentences)], [[] for _ in range(sentences)])

    def limits(self, lengths: Tensor) -> Tensor:
        """The length limits (B,) with room for the guidance: a prefix raises a sentence's limit to
        its length + 1 (guidance_limit), the constraint tokens add to it."""
        prefixes = [len(prefix) for prefix in self.prefixes]
        extra = [sum(len(phrase) for phrase in phrases) for phrases in self.constraints]
        limits = [
            guidance_limit(limit, prefix) + added for limit, prefix, added in zip(lengths.tolist(), prefixes, extra)
        ]
        return torch.tensor(limits, dtype=torch.long, device=lengths.device)

    def prefix_table(self, device: torch.device) -> Tensor | None:
        """(B, longest prefix) of prefix token ids, -1 past each prefix's end; None without prefixes."""
        longest = max(map(len, self.prefixes), default=0)
        if not longest:
            return None
        rows = [prefix + [-1] * (longest - len(prefix)) for prefix in self.prefixes]
        return torch.tensor(rows, dtype=torch.long, device=device)

    def subset(self, sentences: list[int]) -> Guidance:
        return Guidance(
            [self.prefixes[i] for i in sentences], [self.constraints[i] for i in sentences], self.continuations
        )

    def repeated(self, times: int) -> Guidance:
        """Each sentence's guidance `times` times in a row (sampling draws a line several times)."""
        return Guidance(
            [p for p in self.prefixes for _ in range(times)],
            [c for c in self.constraints for _ in range(times)],
            self.continuations,
        )


def forced_tokens(table: Tensor | None, step: int, beam: int = 1) -> Tensor | None:
    """(N,) this step's prefix token of each row (-1 where none), or None once every prefix is done."""
    if table is None or step >= table.size(1):
        return None
    column = table[:, step]
    return column.repeat_interleave(beam) if beam > 1 else column


def prefix_ends(table: Tensor | None, step: int, beam: int) -> Tensor | None:
    """(N,) each row's prefix length (0 where none), or None once every prefix is done and followed."""
    if table is None or step > table.size(1):
        return None
    return (table >= 0).sum(1).repeat_interleave(beam)

"""Terminology as translators keep it: a glossary file, and the per-line constraints it implies.

A glossary is a UTF-8 TSV file, one entry per line, `source term<TAB>target term`, as CAT tools
export term bases; empty lines and lines starting with # are skipped. An entry applies to a line
that contains its source term as whole words (case-sensitive: "Lord" is not "lord"); its target
term then becomes one of that line's constraints. Per-line constraints (a file of one line per
source line, target phrases separated by tabs) work the same way without the lookup.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from pathlib import Path

from seq2seq.data.sources import read_lines
from seq2seq.errors import UserInputError


@dataclass(frozen=True)
class Glossary:
    entries: list[tuple[str, str]]  # (source term, target term), in file order
    line_numbers: list[int] = field(default_factory=list)  # each entry's line in its file, for messages

    @classmethod
    def load(cls, path: str | Path) -> Glossary:
        if Path(path).is_dir():
            raise UserInputError(f"{path}: is a directory; expected a glossary file (source term<TAB>target term)")
        entries, numbers = [], []
        for number, line in enumerate(read_lines(path, keep_tabs=True), 1):
            if not line.strip() or line.startswith("#"):
                continue
            fields = [text.strip() for text in line.split("\t")]
            if len(fields) != 2 or not all(fields):
                raise UserInputError(f"{path}:{number}: expected 'source term<TAB>target term', got {line[:60]!r}")
            entries.append((fields[0], fields[1]))
            numbers.append(number)
        return cls(entries, numbers)

    def constraints(self, line: str) -> list[str]:
        """The target terms of the entries whose source term `line` contains as whole words."""
        return [target for source, target in self.entries if _whole_words(source).search(line)]


@functools.lru_cache(maxsize=4096)
def _whole_words(term: str) -> re.Pattern:
    return re.compile(rf"(?<!\w){re.escape(term)}(?!\w)")


def merged_constraints(
    lines: list[str], constraints: list[list[str]] | None, glossary: Glossary | None
) -> list[list[str]] | None:
    """Each line's own constraints, then its glossary terms (a term already asked for is not doubled)."""
    if glossary is None:
        return constraints
    merged = []
    for index, line in enumerate(lines):
        own = list(constraints[index]) if constraints else []
        merged.append(own + [term for term in glossary.constraints(line) if term not in own])
    return merged


def constraint_fields(line: str) -> list[str]:
    """A line of a per-line constraints file: its tab-separated target phrases (none for an empty line)."""
    return [phrase.strip() for phrase in line.split("\t") if phrase.strip()]

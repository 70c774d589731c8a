"""Terminology as translators keep it: a glossary file, and the per-line constraints it implies.

A glossary is a UTF-8 TSV file, one entry per line, `source term<TAB>target term`, as CAT tools
export term bases; empty lines and lines starting with # are skipped. An entry applies to a line
that contains its source term as whole words (case-sensitive: "Lord" is not "lord"); its target
term then becomes one of that line's constraints. Per-line constraints (a file of one line per
source line, target phrases separated by tabs) work the same way without the lookup.

A line is looked up word by word, not term by term: term bases run to tens of thousands of entries,
and a search for each term in each line (one regular expression per term) took longer than the
translation itself. A term that starts with a word character can only match where one of the line's
words equals the term's first word, so the terms are indexed by their first word and only those
sharing a word with the line are checked.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from seq2seq.data.sources import read_lines
from seq2seq.errors import UserInputError


@dataclass(frozen=True)
class Glossary:
    """The entries are kept as tuples: the index of them is built on first use and must not go stale."""

    entries: tuple[tuple[str, str], ...]  # (source term, target term), in file order
    line_numbers: tuple[int, ...] = ()  # each entry's line in its file, for messages

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(tuple(entry) for entry in self.entries))
        object.__setattr__(self, "line_numbers", tuple(self.line_numbers))

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
        """The target terms of the entries whose source term `line` contains as whole words, in file order:
        where the term occurs with no word character right before or after it (`(?<!\\w)term(?!\\w)`)."""
        by_first_word, others = self._index
        matched = {index for index, pattern in others if pattern.search(line)}
        for word in _WORD_RUN.finditer(line):
            start = word.start()
            for index in by_first_word.get(word.group(), ()):
                source = self.entries[index][0]
                if line.startswith(source, start) and not _WORD_CHARACTER.match(line, start + len(source)):
                    matched.add(index)
        return [self.entries[index][1] for index in sorted(matched)]

    @functools.cached_property
    def _index(self) -> tuple[dict[str, list[int]], list[tuple[int, re.Pattern]]]:
        """Entries by their source term's first word (its leading run of word characters, which a match
        must find as a whole word of the line), and the entries whose term starts with another character."""
        by_first_word: dict[str, list[int]] = defaultdict(list)
        others = []
        for index, (source, _) in enumerate(self.entries):
            first = _WORD_RUN.match(source)
            if first:
                by_first_word[first.group()].append(index)
            else:
                others.append((index, re.compile(rf"(?<!\w){re.escape(source)}(?!\w)")))
        return dict(by_first_word), others


_WORD_RUN = re.compile(r"\w+")
_WORD_CHARACTER = re.compile(r"\w")


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

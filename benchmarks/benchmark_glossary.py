#!/usr/bin/env python3
"""Looking up a glossary's terms in the lines to translate, by term base size, side by side in one run.

Side "a search per term": the definition (glossary.py), one whole-word regular expression per term
searched in each line, compiled once per term; side "ours": Glossary.constraints, the word index.
The terms are word n-grams (1 to 3 words, seeded) of the source file itself, so that many occur; both
sides must find the same constraints for every line. Terminology comes before translating a line, so
the lookup's lines/s is set beside what a translation takes (the ledger's decoding figures).

    python benchmarks/benchmark_glossary.py --src data/bible/test.en --terms 100 1000 10000
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

from ledger import describe_machine

from seq2seq.data.sources import read_lines
from seq2seq.inference.glossary import Glossary


def term_base(lines: list[str], size: int, seed: int) -> list[tuple[str, str]]:
    """`size` distinct word n-grams of `lines` as source terms, each with a made-up target term."""
    rng, terms = random.Random(seed), {}
    while len(terms) < size:
        words = re.findall(r"\w+", rng.choice(lines))
        if words:
            length = rng.choice((1, 1, 2, 3))
            start = rng.randrange(max(1, len(words) - length + 1))
            terms.setdefault(" ".join(words[start : start + length]), f"term{len(terms)}")
    return list(terms.items())


def search_per_term(entries: list[tuple[str, str]]):
    """The definition as a lookup: each term's whole-word expression, compiled once, searched in the line."""
    patterns = [(re.compile(rf"(?<!\w){re.escape(source)}(?!\w)"), target) for source, target in entries]
    return lambda line: [target for pattern, target in patterns if pattern.search(line)]


def lines_per_second(lookup, lines: list[str], repeats: int) -> tuple[float, list[list[str]]]:
    """The best lines/s of `lookup` over `repeats` passes over `lines`, and what it found."""
    best, found = 0.0, []
    for _ in range(repeats):
        start = time.perf_counter()
        found = [lookup(line) for line in lines]
        best = max(best, len(lines) / (time.perf_counter() - start))
    return best, found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, default=Path("data/bible/test.en"))
    parser.add_argument("--terms", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    lines = list(read_lines(args.src))
    print(f"{describe_machine()}; {min(args.lines, len(lines))} lines of {args.src}, best of {args.repeats} passes")
    print("\n| terms | a search per term (lines/s) | ours (lines/s) | ours / search | constraints found |")
    print("|---|---|---|---|---|")
    for size in args.terms:
        entries = term_base(lines, size, args.seed)
        glossary = Glossary(entries)
        shown = lines[: args.lines]
        searched, expected = lines_per_second(search_per_term(entries), shown, args.repeats)
        ours, found = lines_per_second(glossary.constraints, shown, args.repeats)
        if found != expected:
            raise SystemExit(f"{size} terms: the word index found other constraints than the search per term")
        print(f"| {size:,} | {searched:,.0f} | {ours:,.0f} | {ours / searched:,.0f}x | {sum(map(len, found)):,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Build an offline English->German corpus of software messages from the gettext catalogues installed
on this machine (/usr/share/locale/de/LC_MESSAGES/*.mo: apt, coreutils, bash, ...): a second real
language pair for recipe studies, of another domain and language than the Bible corpus.

Each catalogue's (msgid, msgstr) pairs are read with Python's gettext; plural forms and message
contexts are dropped, whitespace is folded, pairs whose translation equals the source (names, format
strings) or that hold no letter are left out, and a source is kept once. Valid and test are drawn at
random (seeded). The catalogues read, with their pair counts, go to SOURCES.txt: the corpus depends on
the packages installed, so a study names it by that list.

    python scripts/prepare_messages.py [--out data/messages] [--lang de] [--valid 1000] [--test 1000]
"""

from __future__ import annotations

import argparse
import gettext
import random
import re
import struct
import sys
from pathlib import Path

LETTER = re.compile(r"[^\W\d_]")
CONTEXT = "\x04"  # gettext joins a message context and its msgid with this byte


def clean(text: str) -> str:
    return " ".join(text.split())


def catalogue_pairs(path: Path) -> list[tuple[str, str]]:
    """The singular, context-free (source, translation) pairs of one .mo file."""
    with path.open("rb") as handle:
        try:
            catalogue = gettext.GNUTranslations(handle)._catalog
        except (OSError, UnicodeDecodeError, ValueError, struct.error):  # a damaged or foreign catalogue
            return []
    pairs = []
    for key, value in catalogue.items():
        if not isinstance(key, str) or not key or CONTEXT in key or not isinstance(value, str):
            continue
        source, target = clean(key), clean(value)
        if source and target and source != target and LETTER.search(source) and LETTER.search(target):
            pairs.append((source, target))
    return sorted(pairs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/messages"))
    parser.add_argument("--lang", default="de")
    parser.add_argument("--locale-dir", type=Path, default=Path("/usr/share/locale"))
    parser.add_argument("--valid", type=int, default=1000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    files = sorted((args.locale_dir / args.lang / "LC_MESSAGES").glob("*.mo"))
    if not files:
        print(f"error: {args.locale_dir / args.lang / 'LC_MESSAGES'}: no .mo catalogues; expected installed "
              "translations (a system without stripped locales)", file=sys.stderr)  # fmt: skip
        return 2
    seen, pairs, sources = set(), [], []
    for path in files:
        kept = 0
        for source, target in catalogue_pairs(path):
            if source not in seen:
                seen.add(source)
                pairs.append((source, target))
                kept += 1
        sources.append(f"{path.name}\t{kept}")
    if len(pairs) < args.valid + args.test + 1000:
        print(f"error: only {len(pairs)} pairs in {len(files)} catalogues; too few to split", file=sys.stderr)
        return 2
    random.Random(args.seed).shuffle(pairs)
    splits = {"valid": pairs[: args.valid], "test": pairs[args.valid : args.valid + args.test]}
    splits["train"] = pairs[args.valid + args.test :]
    args.out.mkdir(parents=True, exist_ok=True)
    for split, chosen in splits.items():
        for side, lang in ((0, "en"), (1, args.lang)):
            (args.out / f"{split}.{lang}").write_text("".join(pair[side] + "\n" for pair in chosen), encoding="utf-8")
        print(f"{split}: {len(chosen)} message pairs")
    (args.out / "SOURCES.txt").write_text("\n".join(sources) + "\n", encoding="utf-8")
    print(f"written to {args.out}/ (from {len(files)} catalogues, listed in SOURCES.txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

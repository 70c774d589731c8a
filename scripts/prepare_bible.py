#!/usr/bin/env python3
"""Build the offline English-Spanish Bible corpus (World English Bible x Reina-Valera 1909).

Needs Debian's SWORD tools and texts:  apt-get install diatheke sword-text-web sword-text-sparv
Writes data/bible/{train,valid,test}.{en,es}: verses aligned by reference, valid/test drawn at random
(seeded) so every book is represented.

    python scripts/prepare_bible.py [--out data/bible] [--valid 1000] [--test 1000]
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

VERSE = re.compile(r"^\s*(?P<ref>(?:[IV]+ )?[A-Z][A-Za-z ]+ \d+:\d+): ?(?P<text>.*)$")
MODULES = {"en": "engWEB2015eb", "es": "spaRV1909eb"}


def read_module(module: str) -> dict[str, str]:
    """Verse reference -> text, from `diatheke -f plain` (verses may continue on following lines)."""
    output = subprocess.run(
        ["diatheke", "-b", module, "-f", "plain", "-k", "Gen-Rev"], check=True, capture_output=True, text=True
    ).stdout
    verses: dict[str, str] = {}
    current = None
    for line in output.splitlines():
        if line.startswith(f"({module})"):
            continue
        match = VERSE.match(line)
        if match:
            current = match["ref"]
            verses[current] = match["text"]
        elif current and line.strip():
            verses[current] += " " + line.strip()
    return {ref: " ".join(text.split()) for ref, text in verses.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/bible"))
    parser.add_argument("--valid", type=int, default=1000)
    parser.add_argument("--test", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if shutil.which("diatheke") is None:
        print("error: diatheke not found; apt-get install diatheke sword-text-web sword-text-sparv", file=sys.stderr)
        return 2
    english, spanish = read_module(MODULES["en"]), read_module(MODULES["es"])
    refs = [ref for ref in english if english[ref] and spanish.get(ref)]
    random.Random(args.seed).shuffle(refs)
    splits = {"valid": refs[: args.valid], "test": refs[args.valid : args.valid + args.test]}
    splits["train"] = refs[args.valid + args.test :]
    args.out.mkdir(parents=True, exist_ok=True)
    for split, chosen in splits.items():
        for lang, verses in (("en", english), ("es", spanish)):
            (args.out / f"{split}.{lang}").write_text("".join(verses[r] + "\n" for r in chosen), encoding="utf-8")
        print(f"{split}: {len(chosen)} verse pairs")
    print(f"written to {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())

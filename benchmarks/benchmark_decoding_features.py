#!/usr/bin/env python3
"""The decoding features beyond beam search, measured side by side in one run on trained models.

  * speed: sampling (top-k 10; top-p 0.9) against greedy (beam 1) over the same lines, and scoring given pairs against
    translating the same lines with beam 5 (the pairs are the references), each side timed over the
    same lines, best of --repeats rounds (each round runs every side once, in turn);
  * constraints: one random reference word per line (seeded) as a terminology constraint: the
    share of lines whose output contains it, and BLEU against unconstrained beam search;
  * ensemble (with --ensemble): BLEU of the first checkpoint alone and of all given checkpoints as
    an ensemble.

    python benchmarks/benchmark_decoding_features.py --checkpoint runs/demo/checkpoints/best.pt \\
        --src data/demo/test.en --ref data/demo/test.xx --lines 500
    python benchmarks/benchmark_decoding_features.py --checkpoint runs/bible/checkpoints/best.pt \\
        --src data/bible/test.en --ref data/bible/test.es --ensemble runs/bible/checkpoints/step_*.pt --only ensemble
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from ledger import describe_machine

from seq2seq.data.sources import read_lines
from seq2seq.evaluation.scoring import ScoreOptions, score
from seq2seq.inference.translator import Translator

BLEU = ScoreOptions(metrics=("bleu",))


def best_times(sides: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The best wall time of each side over `repeats` rounds; every round runs each side once, in
    turn, so that a slow spell of a shared machine falls on all sides alike (the first round also
    warms caches)."""
    best = dict.fromkeys(sides, float("inf"))
    for _ in range(repeats):
        for name, run in sides.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def speed(translator: Translator, src: list[str], ref: list[str], repeats: int) -> None:
    times = best_times({"greedy": lambda: translator.translate(src, beam=1),
                        "sampled": lambda: translator.translate(src, sample=True, top_k=10, seed=1),
                        "nucleus": lambda: translator.translate(src, sample=True, top_p=0.9, seed=1),
                        "beam5": lambda: translator.translate(src, beam=5),
                        "scoring": lambda: translator.score(src, ref)}, repeats)  # fmt: skip
    greedy, beam5, scoring = times["greedy"], times["beam5"], times["scoring"]
    for side, label in (("sampled", "top-k 10"), ("nucleus", "top-p 0.9")):
        print(f"sampling ({label}): {len(src) / times[side]:,.1f} lines/s; greedy: {len(src) / greedy:,.1f} lines/s; "
              f"ratio {greedy / times[side]:.2f} (target >= 0.9)")  # fmt: skip
    print(f"scoring the reference pairs: {len(src) / scoring:,.1f} pairs/s; beam 5: {len(src) / beam5:,.1f} lines/s; "
          f"ratio {beam5 / scoring:.2f} (target >= 3)")  # fmt: skip


def constraints(translator: Translator, src: list[str], ref: list[str], seed: int) -> None:
    rng = random.Random(seed)
    words = [rng.choice(line.split()) for line in ref]
    free = translator.translate(src)
    start = time.perf_counter()
    guided = translator.translate(src, constraints=[[word] for word in words])
    seconds = time.perf_counter() - start
    met = [sum(word in output.split() for word, output in zip(words, outputs)) for outputs in (free, guided)]
    print(f"one random reference word per line as a constraint, {len(src)} lines (seed {seed}):")
    print(f"  unconstrained: contains the word {met[0] / len(src):.1%}, BLEU {score(free, [ref], BLEU).bleu:.2f}")
    print(f"  constrained:   contains the word {met[1] / len(src):.1%}, BLEU {score(guided, [ref], BLEU).bleu:.2f} "
          f"({len(src) / seconds:,.1f} lines/s)")  # fmt: skip


def ensemble(checkpoint: Path, members: list[Path], src: list[str], ref: list[str], device: str) -> None:
    alone = Translator.load(checkpoint, device=device).translate(src)
    together = Translator.load(members, device=device).translate(src)
    print(f"{checkpoint} alone: BLEU {score(alone, [ref], BLEU).bleu:.2f}")
    print(f"ensemble of {', '.join(map(str, members))}: BLEU {score(together, [ref], BLEU).bleu:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/demo/checkpoints/best.pt"))
    parser.add_argument("--src", type=Path, default=Path("data/demo/test.en"))
    parser.add_argument("--ref", type=Path, default=Path("data/demo/test.xx"))
    parser.add_argument("--lines", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--ensemble", type=Path, nargs="+", default=[])
    parser.add_argument("--only", choices=("speed", "constraints", "ensemble"), nargs="+",
                        default=["speed", "constraints", "ensemble"])  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    src = list(read_lines(args.src))[: args.lines]
    ref = list(read_lines(args.ref))[: args.lines]
    print(f"{describe_machine()}, {torch.get_num_threads()} threads; {args.checkpoint}, "
          f"{len(src)} lines of {args.src}")  # fmt: skip
    translator = Translator.load(args.checkpoint, device=args.device)
    if "speed" in args.only:
        speed(translator, src, ref, args.repeats)
    if "constraints" in args.only:
        constraints(translator, src, ref, args.seed)
    if "ensemble" in args.only and args.ensemble:
        ensemble(args.checkpoint, args.ensemble, src, ref, args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""A recipe study against a strong baseline: train one config under several sets of `--set` overrides,
each for the same budget (updates, or seconds of training), each at several peak learning rates
(the best peak moves with the schedule), beside a plain, tuned baseline that is always run and
reported first: inverse-sqrt with a short warmup, swept over its own peaks. The peak of each recipe
is chosen by validation BLEU, never by test; the chosen runs are then scored on the test split
(best.pt, beam search, sacrebleu) and, with --seeds, trained again with other seeds. A run
directory that already holds a finished run is scored again, not retrained, so an interrupted
study continues where it stopped.

    python benchmarks/recipe_study.py configs/small_data.yaml --out runs/study --steps 600 \\
        --variant shipped --variant "wsd: train.schedule=wsd train.warmup_fraction=0.1" \\
        --lrs 1e-3 2e-3 4e-3 --seeds 2
    python benchmarks/ledger.py run recipe_study.py configs/small_data.yaml ...   (the same, recorded in the ledger)

A variant is `NAME` (the config as it is) or `NAME: key=value key=value ...`. The baseline is
`--baseline` (default: inverse_sqrt, 400 warmup updates, the config's levers off) at each of --baseline-lrs. `--common`
overrides apply to every run, e.g. another corpus for the same recipe:

    python benchmarks/recipe_study.py configs/small_data.yaml --out runs/study-messages --steps 600 --variant shipped \
        --common "data.tgt_lang=de data.train.src=data/messages/train.en data.train.tgt=data/messages/train.de \
                  data.valid.src=data/messages/valid.en data.valid.tgt=data/messages/valid.de \
                  data.test.src=data/messages/test.en data.test.tgt=data/messages/test.de"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml
from ledger import describe_machine

# The plain baseline: besides its schedule, the levers small_data.yaml pulls are put back to plain
# values (an 8k vocabulary, dropout from the start, no weight average), so that it stays the same
# baseline whatever the config ships.
BASELINE = (
    "train.schedule=inverse_sqrt train.warmup_steps=400 train.warmup_fraction=0 "
    "tokenizer.vocab_size=8000 train.dropout_from_epoch=1 train.ema_decay=0"
)


@dataclass(frozen=True)
class Run:
    recipe: str
    overrides: tuple[str, ...]
    lr: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.recipe}-lr{self.lr:g}-seed{self.seed}"


@dataclass(frozen=True)
class Outcome:
    run: Run
    updates: int
    valid_bleu: float
    test_bleu: float | None = None
    test_chrf: float | None = None


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    name, _, overrides = text.partition(":")
    return name.strip(), tuple(overrides.split())


def train(config: Path, out: Path, run: Run, budget: list[str], threads: int) -> Outcome:
    """Train `run` unless its directory holds a finished one; its best validation BLEU (of the trained
    weights or, with train.ema_decay, their average: whichever best.pt holds)."""
    run_dir = out / run.name
    if not (run_dir / "checkpoints" / "best.pt").exists():
        settings = [*budget, f"train.threads={threads}", f"train.lr={run.lr}", f"train.seed={run.seed}", *run.overrides]
        command = [sys.executable, "-m", "seq2seq", "-q", "train", str(config), "--run-dir", str(run_dir), "--quiet"]
        subprocess.run(command + [arg for setting in settings for arg in ("--set", setting)], check=True)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    best = max(r.get(key, 0.0) for r in records if r["kind"] in ("valid", "average") for key in ("bleu", "ema_bleu"))
    return Outcome(run, max(r["step"] for r in records), best)


def score(config: Path, out: Path, outcome: Outcome, threads: int, common: list[str]) -> Outcome:
    """The run's best.pt on the test split (the config's, or --common's; the config's decode settings)."""
    run_dir, split = out / outcome.run.name, yaml.safe_load(config.read_text(encoding="utf-8"))["data"]["test"]
    split = {**split, **{key.rsplit(".", 1)[1]: value for key, _, value in (item.partition("=") for item in common)
                         if key in ("data.test.src", "data.test.tgt")}}  # fmt: skip
    report = run_dir / "test.json"
    if not report.exists():
        command = [sys.executable, "-m", "seq2seq", "-q", "eval", "-c", str(run_dir / "checkpoints" / "best.pt"),
                   "--src", split["src"], "--ref", split["tgt"], "--json", str(report)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
    scores = {metric["name"]: metric["score"] for metric in json.loads(report.read_text(encoding="utf-8"))["scores"]}
    return Outcome(outcome.run, outcome.updates, outcome.valid_bleu, scores["BLEU"], scores["chrF2"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="one run directory per run under it")
    parser.add_argument("--variant", action="append", default=[], help="NAME or 'NAME: key=value ...'")
    parser.add_argument("--lrs", type=float, nargs="+", help="peaks each variant is swept over [its config's]")
    parser.add_argument("--baseline", default=BASELINE, help=f"the baseline's overrides [{BASELINE}]")
    parser.add_argument("--baseline-lrs", type=float, nargs="+", default=[1e-3, 1.5e-3, 2e-3])
    parser.add_argument("--seeds", type=int, default=1, help="seeds for the chosen peak of each recipe (1 = no more)")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, help="updates per run")
    budget.add_argument("--seconds", type=float, help="seconds of training per run (train.max_time)")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (threads are shared out)")
    parser.add_argument("--common", default="", help="key=value overrides for every run (e.g. the corpus)")
    args = parser.parse_args()
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    common = args.common.split()
    if args.steps:
        limit = [f"train.max_steps={args.steps}", f"train.valid_every={args.steps}", f"train.save_every={args.steps}"]
    else:
        limit = ["train.max_steps=1000000", f"train.max_time={args.seconds}", "train.valid_every=1000000"]
    limit += common
    shipped_lr = yaml.safe_load(args.config.read_text(encoding="utf-8"))["train"]["lr"]
    recipes = [("baseline", tuple(args.baseline.split()), args.baseline_lrs)]
    recipes += [(*parse_variant(text), args.lrs or [shipped_lr]) for text in args.variant]
    machine = describe_machine()
    print(f"{machine}; {args.jobs} run(s) at a time, {threads} thread(s) each; budget: "
          f"{f'{args.steps} updates' if args.steps else f'{args.seconds:g} s of training'}", flush=True)  # fmt: skip

    def train_all(runs: list[Run]) -> list[Outcome]:
        with ThreadPoolExecutor(args.jobs) as pool:
            return list(pool.map(lambda run: train(args.config, args.out, run, limit, threads), runs))

    # A recipe with one peak has nothing to choose, so its other seeds train beside the sweep.
    first = train_all([Run(name, overrides, lr, seed) for name, overrides, lrs in recipes for lr in lrs
                       for seed in range(1, (args.seeds if len(lrs) == 1 else 1) + 1)])  # fmt: skip
    sweep = [outcome for outcome in first if outcome.run.seed == 1]
    chosen = {}  # recipe -> its peak with the best validation BLEU
    for outcome in sweep:
        best = chosen.get(outcome.run.recipe)
        if best is None or outcome.valid_bleu > best.valid_bleu:
            chosen[outcome.run.recipe] = outcome
    seeds = [outcome for outcome in first if outcome.run.seed > 1]
    seeded = {outcome.run.recipe for outcome in seeds}
    seeds += train_all([Run(o.run.recipe, o.run.overrides, o.run.lr, seed) for o in chosen.values()
                        if o.run.recipe not in seeded for seed in range(2, args.seeds + 1)])  # fmt: skip
    scored = [score(args.config, args.out, outcome, threads, common) for outcome in [*chosen.values(), *seeds]]
    rows = _table(sweep, scored)
    print("\n".join(rows))
    return 0


def _table(sweep: list[Outcome], scored: list[Outcome]) -> list[str]:
    """The sweep (valid BLEU by peak), then each recipe's chosen peak on the test split, baseline first,
    with its difference to the baseline (the mean over seeds)."""
    recipes = list(dict.fromkeys(o.run.recipe for o in sweep))
    rows = ["| recipe | peak lr | updates | valid BLEU |", "|---|---|---|---|"]
    rows += [f"| {o.run.recipe} | {o.run.lr:g} | {o.updates} | {o.valid_bleu:.2f} |" for o in sweep]
    rows += ["", "| recipe | overrides | chosen peak | seeds | test BLEU (each seed) | mean | vs baseline | chrF |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    means = {}
    for recipe in recipes:
        mine = [o for o in scored if o.run.recipe == recipe]
        means[recipe] = sum(o.test_bleu for o in mine) / len(mine)
        chrf = sum(o.test_chrf for o in mine) / len(mine)
        delta = means[recipe] - means["baseline"]
        rows.append(f"| {recipe} | `{' '.join(mine[0].run.overrides) or '(as shipped)'}` | {mine[0].run.lr:g} | "
                    f"{len(mine)} | {' / '.join(f'{o.test_bleu:.2f}' for o in mine)} | {means[recipe]:.2f} | "
                    f"{delta:+.2f} | {chrf:.2f} |")  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""A recipe study: train one config under several sets of `--set` overrides, each for the same budget
(a number of updates, or seconds of training), then score every run's best.pt on the test split with
beam search and sacrebleu, and print one table. Runs train side by side (--jobs, each with its share of
the CPU threads) or one after the other; a run directory that already holds a finished run is scored
again, not retrained, so an interrupted study continues where it stopped.

    python scripts/recipe_study.py configs/bible_en_es.yaml --out runs/study --steps 400 \\
        --variant shipped --variant "budget: train.schedule=linear train.warmup_fraction=0.1" --jobs 2
    python scripts/recipe_study.py configs/bible_en_es.yaml --out runs/study-time --seconds 1800 ...

A variant is `NAME` (the config as it is) or `NAME: key=value key=value ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml

from seq2seq.training.precision import describe_machine


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, overrides = text.partition(":")
    return name.strip(), overrides.split()


def run_variant(config: Path, out: Path, name: str, overrides: list[str], budget: list[str], threads: int) -> dict:
    """Train (unless a finished run is there) and score one variant; returns its row."""
    run_dir = out / name
    split = yaml.safe_load(config.read_text(encoding="utf-8"))["data"]["test"]
    if not (run_dir / "checkpoints" / "best.pt").exists():
        settings = [*budget, f"train.threads={threads}", *overrides]
        command = [sys.executable, "-m", "seq2seq", "train", str(config), "--run-dir", str(run_dir), "--quiet"]
        command += [arg for setting in settings for arg in ("--set", setting)]
        subprocess.run(command, check=True)
    report = run_dir / "test.json"
    command = [sys.executable, "-m", "seq2seq", "eval", "-c", str(run_dir / "checkpoints" / "best.pt"),
               "--src", split["src"], "--ref", split["tgt"], "--json", str(report)]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    scores = {metric["name"]: metric["score"] for metric in json.loads(report.read_text(encoding="utf-8"))["scores"]}
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in train if r["kind"] == "train"][-1]
    return {"name": name, "overrides": " ".join(overrides) or "(as shipped)", "steps": last["step"],
            "final_lr": last["lr"], "bleu": scores["BLEU"], "chrf": scores["chrF2"]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="one run directory per variant under it")
    parser.add_argument("--variant", action="append", required=True, help="NAME or 'NAME: key=value ...'")
    budget = parser.add_mutually_exclusive_group(required=True)
    budget.add_argument("--steps", type=int, help="updates per run")
    budget.add_argument("--seconds", type=float, help="seconds of training per run (train.max_time)")
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side (threads are shared out)")
    args = parser.parse_args()
    variants = [parse_variant(text) for text in args.variant]
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    if args.steps:
        limit = [f"train.max_steps={args.steps}", f"train.valid_every={args.steps}", f"train.save_every={args.steps}"]
    else:
        limit = ["train.max_steps=1000000", f"train.max_time={args.seconds}", "train.valid_every=1000000"]
    print(f"{describe_machine(torch.device('cpu'))}; {args.jobs} run(s) at a time, {threads} thread(s) each; budget: "
          f"{f'{args.steps} updates' if args.steps else f'{args.seconds:g} s of training'}")  # fmt: skip
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda v: run_variant(args.config, args.out, *v, limit, threads), variants))
    print("| variant | overrides | updates | final lr | test BLEU | chrF |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | `{row['overrides']}` | {row['steps']} | {row['final_lr']:.2e} | "
              f"{row['bleu']:.2f} | {row['chrf']:.2f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

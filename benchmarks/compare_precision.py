#!/usr/bin/env python3
"""Does bf16 cost quality? Train the same config for the same steps in fp32 and in bf16, then score both.

    python benchmarks/compare_precision.py configs/demo.yaml --seeds 1 2 3 4 5
    python benchmarks/compare_precision.py configs/bible_en_es.yaml --steps 1000 --seeds 1 2   # hours on a small CPU

One seed's BLEU moves by about a point between seeds on a short run (and a barely trained model
can fall into repetition loops on a few long sentences), so the verdict uses the mean over seeds
of the per-seed difference (both precisions see the same seed: same initial weights and batch
order). Prints, per run, the last validation loss (the steadier signal) and test BLEU/chrF (beam
from the config's decode section); runs go to runs/precision-<config>-<precision>[-seed<N>]/.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

from seq2seq.config import Config
from seq2seq.config_files import load_config
from seq2seq.data.prepare import read_split
from seq2seq.evaluation.evaluate import translate_and_score
from seq2seq.evaluation.scoring import Scores
from seq2seq.inference.translator import Translator
from seq2seq.training.trainer import Trainer

PRECISIONS = ("fp32", "bf16")


def train_and_score(config: Config, run_dir: Path) -> tuple[Scores, float, int, float]:
    """Train from scratch into run_dir; test-set scores of the last checkpoint, the last validation
    loss, steps and training seconds."""
    shutil.rmtree(run_dir, ignore_errors=True)
    start = time.perf_counter()
    trainer = Trainer(config, run_dir, show_progress=False)
    result = trainer.run()
    seconds = time.perf_counter() - start
    valid_loss = [record["loss"] for record in trainer.metrics.read() if record["kind"] == "valid"][-1]
    translator = Translator.load(result.last_checkpoint)
    test = read_split(config.data, "test")
    evaluation = translate_and_score(translator, test.src, test.tgt, config.decode)
    return evaluation.scores, valid_loss, result.progress.step, seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--steps", type=int, default=0, help="train.max_steps (0 = the config's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[], help="train.seed values (default: the config's)")
    parser.add_argument("--set", action="append", default=[], help="extra config override (repeatable)")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS),
                        help="train these only (rerun the one whose path a change touched)")  # fmt: skip
    args = parser.parse_args()
    extra = list(args.set)
    if args.steps:
        extra += [f"train.max_steps={args.steps}", f"train.valid_every={args.steps}"]
    print("| seed | precision | steps | training time | valid loss | BLEU | chrF |\n|---|---|---|---|---|---|---|",
          flush=True)  # fmt: skip
    differences, loss_ratios, signature = [], [], ""
    for seed in args.seeds or [None]:
        seed_overrides = [] if seed is None else [f"train.seed={seed}"]
        bleu, loss = {}, {}
        for precision in args.precisions:
            config = load_config(args.config, [f"train.precision={precision}", *seed_overrides, *extra])
            suffix = "" if seed is None else f"-seed{seed}"
            run_dir = Path("runs") / f"precision-{args.config.stem}-{precision}{suffix}"
            scores, valid_loss, steps, seconds = train_and_score(config, run_dir)
            bleu[precision], loss[precision], signature = scores.bleu, valid_loss, scores.get("bleu").signature
            print(f"| {config.train.seed} | {precision} | {steps} | {seconds:.0f} s | {valid_loss:.4f} | "
                  f"{scores.bleu:.2f} | {scores.chrf:.2f} |", flush=True)  # fmt: skip
        if len(bleu) == len(PRECISIONS):
            differences.append(bleu["bf16"] - bleu["fp32"])
            loss_ratios.append(loss["bf16"] / loss["fp32"])
    print(f"\n{args.config}, test set, beam {config.decode.beam}; {signature}")
    if not differences:
        return 0
    print("bf16 - fp32 BLEU per seed: " + ", ".join(f"{d:+.2f}" for d in differences))
    spread = f" (std over seeds {statistics.stdev(differences):.2f})" if len(differences) > 1 else ""
    print(f"mean bf16 - fp32 BLEU: {statistics.mean(differences):+.2f}{spread}, median "
          f"{statistics.median(differences):+.2f} (target: within 0.3)")  # fmt: skip
    print("valid loss bf16 / fp32 per seed: " + ", ".join(f"{r:.3f}" for r in loss_ratios)
          + f"; geometric mean {statistics.geometric_mean(loss_ratios):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Does bf16 cost quality? Train the same config for the same steps in fp32 and in bf16, then score both.

    python scripts/compare_precision.py configs/demo.yaml
    python scripts/compare_precision.py configs/bible_en_es.yaml --steps 1000 --set model.norm=post

Prints test BLEU/chrF of each (beam from the config's decode section) and their difference;
runs go to runs/precision-<config>-<precision>/.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from seq2seq.checkpoint import load_for_inference
from seq2seq.config import load_config
from seq2seq.data.sources import read_corpus
from seq2seq.evaluate import score
from seq2seq.train import Trainer
from seq2seq.translate import translate_lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--steps", type=int, default=0, help="train.max_steps (0 = the config's)")
    parser.add_argument("--set", action="append", default=[], help="extra config override (repeatable)")
    args = parser.parse_args()
    results = {}
    for precision in ("fp32", "bf16"):
        overrides = [f"train.precision={precision}", *args.set]
        if args.steps:
            overrides += [f"train.max_steps={args.steps}", f"train.valid_every={args.steps}"]
        config = load_config(args.config, overrides)
        run_dir = Path("runs") / f"precision-{args.config.stem}-{precision}"
        shutil.rmtree(run_dir, ignore_errors=True)
        start = time.perf_counter()
        result = Trainer(config, run_dir, show_progress=False).run()
        seconds = time.perf_counter() - start
        bundle = load_for_inference(result.last_checkpoint)
        test = read_corpus(config.data.test, src_lang=config.data.src_lang, tgt_lang=config.data.tgt_lang,
                           key="data.test")  # fmt: skip
        hypotheses = [t.text for t in translate_lines(bundle.model, bundle.tokenizer, test.src, config.decode)]
        results[precision] = (score(hypotheses, test.tgt), result.progress.step, seconds)
    print(f"\n{args.config}, test set, beam {config.decode.beam}:")
    print("| precision | steps | training time | BLEU | chrF |\n|---|---|---|---|---|")
    for precision, (scores, steps, seconds) in results.items():
        print(f"| {precision} | {steps} | {seconds:.0f} s | {scores.bleu:.2f} | {scores.chrf:.2f} |")
    difference = results["bf16"][0].bleu - results["fp32"][0].bleu
    print(f"bf16 - fp32 BLEU: {difference:+.2f} (target: within 0.5)")
    print(results["fp32"][0].bleu_signature)
    return 0


if __name__ == "__main__":
    sys.exit(main())

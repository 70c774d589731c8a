"""What a lexical shortlist buys: a checkpoint and its int8 export, each with and without the
shortlist, translating the same sentences, each side in a fresh process, in rounds whose order
alternates (ABCD, DCBA, ...) so that a machine's drift falls on every side alike.

    python benchmarks/benchmark_shortlist.py --checkpoint runs/student_tiny/student/checkpoints/best.pt \
        --input data/bible/test.en --references data/bible/test.es --shortlist runs/student_tiny/student.shortlist

Prints sentences/s and BLEU per side, the shortlisted side's speed-up and BLEU change against the
same engine without it (the target: int8 + shortlist >= 1.3x int8 at a BLEU change >= -0.2), and how
many target pieces a line's list and a batch's union hold against the vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from seq2seq.data.sources import read_lines
from seq2seq.inference.translator import Translator

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--references", type=Path, required=True)
    parser.add_argument("--shortlist", type=Path, required=True, help="a file from `seq2seq shortlist`")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--beam", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    lines = list(read_lines(args.input))[: args.lines]
    references = list(read_lines(args.references))[: len(lines)]
    print(f"model: {args.checkpoint} | shortlist: {args.shortlist} | {len(lines)} sentences from {args.input}")
    _describe_lists(args.checkpoint, args.shortlist, lines)
    from seq2seq.deploy.export import export_checkpoint

    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as work:
        plain, listed = Path(work) / "plain", Path(work) / "listed"
        for output, shortlist in ((plain, None), (listed, args.shortlist)):
            report = export_checkpoint(args.checkpoint, output, quantization=args.quantization,
                                       check_src=args.input, check_ref=args.references, check_lines=300,
                                       shortlist=shortlist)  # fmt: skip
            print(f"export{' + shortlist' if shortlist else ''}: {report.describe()}")
        sides = {
            "PyTorch": (args.checkpoint, None),
            "PyTorch + shortlist": (args.checkpoint, args.shortlist),
            f"CTranslate2 {args.quantization}": (plain, None),
            f"CTranslate2 {args.quantization} + shortlist": (listed, None),
        }
        timings: dict[str, list[dict]] = {name: [] for name in sides}
        order = list(sides)
        for round_number in range(args.rounds):
            for name in order if round_number % 2 == 0 else reversed(order):
                queue = context.Queue()
                process = context.Process(target=_side, args=(*sides[name], lines, references, args.beam, queue))
                process.start()
                timings[name].append(queue.get())
                process.join()
    print(f"\n{len(lines)} sentences, {args.rounds} rounds in alternating order, median sentences/s")
    print("| search | engine | sentences/s | vs without shortlist | BLEU | BLEU change |")
    print("|---|---|---|---|---|---|")
    summary = []
    for beam in args.beam:
        key = f"beam {beam}"
        for name in sides:
            speed = statistics.median(run[key][0] for run in timings[name])
            bleu = timings[name][0][key][1]
            base = name.removesuffix(" + shortlist")
            if name == base:
                print(f"| {key} | {name} | {speed:,.1f} | | {bleu:.2f} | |")
                continue
            base_speed = statistics.median(run[key][0] for run in timings[base])
            base_bleu = timings[base][0][key][1]
            ratio, change = speed / base_speed, bleu - base_bleu
            print(f"| {key} | {name} | {speed:,.1f} | {ratio:.2f}x | {bleu:.2f} | {change:+.2f} |")
            if base.startswith("CTranslate2"):
                summary.append(f"{key}: {ratio:.2f}x {base}, BLEU {change:+.2f}")
    print(f"shortlist on top of {args.quantization}: " + "; ".join(summary) + " (target >= 1.3x at >= -0.2 BLEU)")
    return 0


def _describe_lists(checkpoint: Path, shortlist: Path, lines: list[str]) -> None:
    """How much of the vocabulary a line's list and a batch's union hold."""
    from seq2seq.checkpoint import Checkpoint
    from seq2seq.inference.shortlist import Shortlist

    tokenizer = Checkpoint.load(checkpoint).tokenizer
    lists = Shortlist.read(shortlist).target_lists(tokenizer.src_model, tokenizer.tgt_model)
    own = [lists.allowed(ids) for ids in tokenizer.encode_src(lines)]
    unions = [len(np.unique(np.concatenate(own[i : i + 32]))) for i in range(0, len(own), 32)]
    size = tokenizer.tgt_vocab_size
    print(f"target vocabulary {size:,}; a line's list: median {statistics.median(map(len, own)):,.0f} pieces; "
          f"a 32-line batch's union: median {statistics.median(unions):,.0f}")  # fmt: skip


def _side(model: Path, shortlist: Path | None, lines: list[str], references: list[str], beams: list[int], queue):
    from seq2seq.evaluation.scoring import score

    translator = Translator.load(model, device="cpu", shortlist=shortlist)
    row = {}
    for beam in beams:
        settings = dataclasses.replace(translator.decode, beam=beam, nbest=1)
        translator.translate_with(lines[:50], settings)  # warm-up
        started = time.perf_counter()
        hypotheses = [result.text for result in translator.translate_with(lines, settings)]
        row[f"beam {beam}"] = (len(lines) / (time.perf_counter() - started), score(hypotheses, [references]).bleu)
    queue.put(row)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

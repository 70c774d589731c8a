"""A distilled student against its teacher and against the same student trained without one.

    python benchmarks/ledger.py run distill_study.py configs/student_tiny.yaml --run-dir runs/student_tiny \
        --set "distill.teacher=[runs/bible_en_es]" --originals runs/student-originals

runs (or finishes: every stage resumes) `seq2seq distill` and prints its report (teacher and shipped
student as users run them), then scores the distilled student's checkpoint and `--originals`, the
same config trained on the corpus's own targets for the same updates (`seq2seq train CONFIG
--run-dir runs/student-originals`), each with the student's decode settings, on the test split.
Targets (issue "Small and fast"): the shipped student >= 5x the teacher's lines/s at BLEU >= the
teacher's - 1.0; distillation >= +1 BLEU over the originals.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from seq2seq.config_files import load_config
from seq2seq.data.prepare import read_split
from seq2seq.distillation.report import ModelRun, compare, table
from seq2seq.evaluation.evaluate import translate_and_score
from seq2seq.inference.translator import Translator


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument(
        "--originals", type=Path, help="the same student trained on the originals, for the same updates"
    )
    parser.add_argument("--teacher-checkpoint", type=Path, help="also time the teacher as this checkpoint (when "
                        "distill.teacher is its export)")  # fmt: skip
    args = parser.parse_args()
    command = [sys.executable, "-m", "seq2seq", "--quiet", "distill", str(args.config), "--run-dir", str(args.run_dir)]
    for item in args.overrides:
        command += ["--set", item]
    report = subprocess.run(command, capture_output=True, text=True, check=False)
    if report.returncode != 0:
        print(report.stderr, file=sys.stderr)
        return report.returncode
    print("Teacher and shipped student, each run as users run it (`seq2seq translate` in its own process):\n")
    print(report.stdout)
    runs = [ModelRun(**run) for run in json.loads((args.run_dir / "report.json").read_text())["models"]]
    teacher, student = runs
    print(f"shipped student: {student.lines_per_second / teacher.lines_per_second:.2f}x the teacher's lines/s "
          f"(target >= 5x), BLEU {student.bleu - teacher.bleu:+.2f} (target >= -1.0)\n")  # fmt: skip
    config = load_config(args.config, args.overrides)
    if args.teacher_checkpoint:
        shipped = args.run_dir / f"student-{config.distill.quantization}"
        runs = compare(config, [args.teacher_checkpoint], shipped, args.run_dir / "report-checkpoint",
                       teacher_beam=config.distill.beam)  # fmt: skip
        print(f"The teacher as its checkpoint ({args.teacher_checkpoint}), beam {config.distill.beam}:\n")
        print(table(runs) + "\n")
    if args.originals:
        compare_with_originals(config, args.run_dir / "student", args.originals)
    return 0


def compare_with_originals(config, distilled: Path, originals: Path) -> None:
    """The distilled student's checkpoint against the same student trained on the corpus's own targets."""
    test = read_split(config.data, "test")
    print("The same student (checkpoint, its decode settings), trained for the same updates on:\n")
    print("| targets | test BLEU | chrF |")
    print("|---|---|---|")
    scores = {}
    for name, run in (("the teacher's translations", distilled), ("the originals", originals)):
        translator = Translator.load(run, device="cpu")
        scores[name] = translate_and_score(translator, test.src, test.tgt).scores
        print(f"| {name} | {scores[name].bleu:.2f} | {scores[name].chrf:.2f} |")
    gain = scores["the teacher's translations"].bleu - scores["the originals"].bleu
    print(f"\ndistillation: {gain:+.2f} BLEU over the originals (target >= +1)")


if __name__ == "__main__":
    sys.exit(main())

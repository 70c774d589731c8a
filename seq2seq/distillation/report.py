"""Stage 5 of `seq2seq distill`: teacher and shipped student side by side on the test split, each
run as a user runs it: `seq2seq translate` in a process of its own, timed whole (start-up, model
loading and translation), its output scored with sacrebleu; and each model's size on disk."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from seq2seq.config import Config
from seq2seq.data.prepare import read_split
from seq2seq.errors import UserInputError
from seq2seq.evaluation.scoring import ScoreOptions, score
from seq2seq.files import write_text_atomic


@dataclass(frozen=True)
class ModelRun:
    """One model translating the test split as a user would."""

    name: str
    command: str
    seconds: float  # the whole process
    lines_per_second: float
    bleu: float
    chrf: float
    megabytes: float  # on disk


def compare(config: Config, teacher: list[Path], student: Path, folder: Path, *, teacher_beam: int) -> list[ModelRun]:
    """The teacher (its checkpoints, beam `teacher_beam`) and the student (its export, its own decode
    settings) on data.test (data.valid when there is none); their outputs go into `folder`."""
    split = "test" if config.data.test is not None else "valid"
    pairs = read_split(config.data, split)
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"{split}.src"
    write_text_atomic(source, "".join(line + "\n" for line in pairs.src))
    teacher_options = [arg for path in teacher for arg in ("-c", str(path))] + ["--beam", str(teacher_beam)]
    return [
        _timed("teacher", teacher_options, source, folder / "teacher.out", pairs.tgt, _size(teacher)),
        _timed("student", ["-c", str(student)], source, folder / "student.out", pairs.tgt, _size([student])),
    ]


def _timed(name: str, options: list[str], source: Path, output: Path, refs: list[str], size: float) -> ModelRun:
    """`seq2seq translate` into a folder of its own, whose output then replaces `output`: the outputs of
    a report made before (of an earlier student, or one killed before its report.json) are this
    stage's own. The folder is emptied first: translate keeps the chunks of a stopped translation and
    continues from them, and a translation timed from its middle would report a speed it never had."""
    work = output.with_name(f".{output.name}.work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    partial = work / output.name
    command = [sys.executable, "-m", "seq2seq", "--quiet", "translate", *options, "-i", str(source), "-o", str(partial)]
    started = time.perf_counter()
    finished = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if finished.returncode != 0:
        shutil.rmtree(work, ignore_errors=True)
        last = (finished.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserInputError(f"distill report: the {name} could not translate the test split ({last})")
    os.replace(partial, output)
    shutil.rmtree(work, ignore_errors=True)
    hypotheses = output.read_text(encoding="utf-8").splitlines()
    scores = score(hypotheses, [refs], ScoreOptions(metrics=("bleu", "chrf")))
    shown = " ".join(["seq2seq translate", *options, "-i", source.name])
    return ModelRun(name, shown, seconds, len(refs) / seconds, scores.bleu, scores.get("chrf").score, size)


def _size(paths: list[Path]) -> float:
    """Megabytes on disk: files, or every file under a directory (an export)."""
    total = sum(
        item.stat().st_size
        for path in paths
        for item in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()])
    )
    return total / 1e6


def table(runs: list[ModelRun]) -> str:
    """The comparison as a Markdown table, the student's ratios to the teacher last."""
    rows = ["| model | run as | BLEU | chrF | lines/s (whole process) | MB on disk |", "|---|---|---|---|---|---|"]
    rows += [
        f"| {r.name} | `{r.command}` | {r.bleu:.2f} | {r.chrf:.2f} | {r.lines_per_second:.1f} | {r.megabytes:.1f} |"
        for r in runs
    ]
    teacher, student = runs
    rows.append(
        f"| student vs teacher | | {student.bleu - teacher.bleu:+.2f} | {student.chrf - teacher.chrf:+.2f} | "
        f"{student.lines_per_second / teacher.lines_per_second:.2f}x | "
        f"{student.megabytes / teacher.megabytes:.2f}x |"
    )
    return "\n".join(rows)


def write_report(path: Path, runs: list[ModelRun], stages: dict) -> None:
    write_text_atomic(path, json.dumps({"models": [asdict(run) for run in runs], **stages}, indent=2) + "\n")


def read_report(path: Path, inputs: dict) -> list[ModelRun] | None:
    """The runs of the report at `path` if it was made from these `inputs` (the student's digest, the
    teacher's targets); None where there is none, or it is of another student or teacher."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        if any(report.get(key) != value for key, value in inputs.items()):
            return None
        return [ModelRun(**run) for run in report["models"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None

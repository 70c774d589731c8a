"""`seq2seq distill`: from a trained teacher to a small, fast student shipped int8 with a shortlist,
in one command whose every stage resumes.

    RUN_DIR/teacher-<identity>/   1. the teacher's translations of the training sources, by chunk
    RUN_DIR/student/              2. the student's training run (it resumes from its last checkpoint)
    RUN_DIR/student.shortlist     3. the lexical shortlist, from the student's training pairs
    RUN_DIR/student-<quant>/      4. the student exported through the parity gate, with the shortlist
    RUN_DIR/report.json, report/  5. teacher and student on the test split, as users run them

A stage whose output exists is not run again; each writes atomically, so a run killed in any stage
and started again ends with what an uninterrupted run makes (tests/distillation).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from seq2seq.checkpoint import Checkpoint, run_checkpoint
from seq2seq.config import Config, CorpusConfig
from seq2seq.deploy.export import export_checkpoint
from seq2seq.distillation.report import ModelRun, compare, write_report
from seq2seq.distillation.teacher_targets import DistilledCorpus, distilled_corpora, teacher_paths
from seq2seq.errors import UserInputError
from seq2seq.inference.shortlist import shortlist_from_corpus
from seq2seq.training.run_dir import RunDir
from seq2seq.training.trainer import Trainer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Distilled:
    student: Path  # the student's checkpoint
    shipped: Path  # its export
    runs: list[ModelRun]
    report: Path


def distill(config: Config, run_dir: Path, *, progress: bool = True, echo: Callable[[str], None] = print) -> Distilled:
    """Run (or finish) every stage; `echo` says what each stage did, on stderr for the CLI."""
    if config.distill is None:
        raise UserInputError("distill: the config has no distill section; expected one naming the teacher")
    teachers = teacher_paths(config)  # a missing teacher is named before any work
    with RunDir(run_dir).held():  # a second distill there would write every stage over this one's
        return _stages(config, run_dir, teachers, progress=progress, echo=echo)


def _stages(
    config: Config, run_dir: Path, teachers: list[Path], *, progress: bool, echo: Callable[[str], None]
) -> Distilled:
    """Each stage that has not yet run, in order."""
    corpora = distilled_corpora(config, run_dir, progress=progress)
    pairs = sum(corpus.pairs for corpus in corpora)
    echo(f"1/5 teacher: {pairs} training pairs -> {', '.join(str(corpus.tgt) for corpus in corpora)}")
    student = _train_student(config, corpora, run_dir / "student", progress=progress)
    echo(f"2/5 student: {student}")
    shortlist = _shortlist(config, corpora, student, run_dir / "student.shortlist")
    echo(f"3/5 shortlist: {shortlist or 'off (distill.shortlist: false)'}")
    shipped = run_dir / f"student-{config.distill.quantization}"
    if not shipped.exists():
        report = export_checkpoint(
            student,
            shipped,
            quantization=config.distill.quantization,
            max_bleu_drop=config.distill.max_bleu_drop,
            shortlist=shortlist,
        )
        echo(f"4/5 export: {report.describe()}")
    else:
        echo(f"4/5 export: {shipped} (exported before)")
    runs = compare(config, teachers, shipped, run_dir / "report", teacher_beam=config.distill.beam)
    stages = {"distilled_pairs": pairs, "student": str(student), "shortlist": str(shortlist or ""),
              "shipped": str(shipped)}  # fmt: skip
    write_report(run_dir / "report.json", runs, stages)
    echo(f"5/5 report: {run_dir / 'report.json'}")
    return Distilled(student, shipped, runs, run_dir / "report.json")


def student_config(config: Config, corpora: list[DistilledCorpus]) -> Config:
    """The config the student trains under: data.train and each of data.extra_train are the teacher's
    translations of theirs, with their weights and tags."""
    train, *extra = [
        CorpusConfig(format="text", src=str(corpus.src), tgt=str(corpus.tgt), weight=given.weight, tag=given.tag)
        for corpus, (_, given) in zip(corpora, config.data.training_corpora(), strict=True)
    ]
    data = dataclasses.replace(config.data, train=train, extra_train=tuple(extra))
    return dataclasses.replace(config, data=data, distill=None)


def _train_student(config: Config, corpora: list[DistilledCorpus], folder: Path, *, progress: bool) -> Path:
    """Train the student, continuing its run when it has saved a checkpoint; the checkpoint to ship."""
    resume = RunDir(folder).checkpoints.is_dir() and any(RunDir(folder).checkpoints.glob("*.pt"))
    Trainer(student_config(config, corpora), folder, resume=resume, show_progress=progress).run()
    return run_checkpoint(folder)


def _shortlist(config: Config, corpora: list[DistilledCorpus], student: Path, path: Path) -> Path | None:
    """The student's shortlist, from its own training pairs (every corpus's) and vocabulary (built once)."""
    distill = config.distill
    if not distill.shortlist:
        return None
    if not path.is_file():
        tokenizer = Checkpoint.load(student).tokenizer
        sources = [line for corpus in corpora for line in corpus.src.read_text(encoding="utf-8").splitlines()]
        targets = [line for corpus in corpora for line in corpus.tgt.read_text(encoding="utf-8").splitlines()]
        built = shortlist_from_corpus(
            tokenizer, sources, targets, per_source=distill.shortlist_per_source, frequent=distill.shortlist_frequent
        )
        built.write(path)
    return path

"""`seq2seq distill`: from a trained teacher to a small, fast student shipped int8 with a shortlist,
in one command whose every stage resumes.

    RUN_DIR/teacher-<identity>/   1. the teacher's translations of the training sources, by chunk
    RUN_DIR/student/              2. the student's training run (it resumes from its last checkpoint)
    RUN_DIR/student.shortlist     3. the lexical shortlist, from the student's training pairs
    RUN_DIR/student-<quant>/      4. the student exported through the parity gate, with the shortlist
    RUN_DIR/report.json, report/  5. teacher and student on the test split, as users run them

A stage whose output exists is not run again; each writes atomically, so a run killed in any stage
and started again ends with what an uninterrupted run makes (tests/distillation). The export and the
report depend on the student, which a run started again with more updates trains on: each records
the digest of the student it was made of, and is made again for another.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from seq2seq.checkpoint import Checkpoint, run_checkpoint
from seq2seq.config import Config, CorpusConfig
from seq2seq.deploy.export import ParityReport, export_checkpoint
from seq2seq.distillation.report import ModelRun, compare, read_report, write_report
from seq2seq.distillation.teacher_targets import DistilledCorpus, distilled_corpora, teacher_paths
from seq2seq.errors import UserInputError
from seq2seq.files import content_digest
from seq2seq.inference.engine import EXPORT_METADATA
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
    student_sha256 = content_digest(student)
    exported_from = _exported_from(shipped)
    if exported_from == student_sha256:
        echo(f"4/5 export: {shipped} (exported before)")
    else:
        export = functools.partial(
            export_checkpoint,
            student,
            quantization=config.distill.quantization,
            max_bleu_drop=config.distill.max_bleu_drop,
            shortlist=shortlist,
        )
        again = " (again: the export there was of another student)" if exported_from is not None else ""
        echo(f"4/5 export{again}: {_replace_export(shipped, export).describe()}")
    report_path = run_dir / "report.json"
    inputs = {"student_sha256": student_sha256, "teacher_targets": [str(corpus.tgt) for corpus in corpora]}
    runs = read_report(report_path, inputs)
    if runs is None:
        runs = compare(config, teachers, shipped, run_dir / "report", teacher_beam=config.distill.beam)
        stages = {"distilled_pairs": pairs, "student": str(student), "shortlist": str(shortlist or ""),
                  "shipped": str(shipped)}  # fmt: skip
        write_report(report_path, runs, {**stages, **inputs})
        echo(f"5/5 report: {report_path}")
    else:
        echo(f"5/5 report: {report_path} (made before, of this student and teacher)")
    return Distilled(student, shipped, runs, report_path)


def _exported_from(shipped: Path) -> str | None:
    """The digest of the checkpoint `shipped` was exported from ("" for an export that does not say;
    None where there is no export)."""
    if not shipped.exists():
        return None
    try:
        return str(json.loads((shipped / EXPORT_METADATA).read_text(encoding="utf-8")).get("checkpoint_sha256", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def _replace_export(shipped: Path, export: Callable[[Path], ParityReport]) -> ParityReport:
    """Export to `shipped`; an export already there, of an earlier student of this run, is set aside
    first and removed once the new one has passed its gate, or put back if it does not (a run then
    started again tries once more: nothing of the run is lost)."""
    earlier = shipped.with_name(f".{shipped.name}.earlier")
    if shipped.exists():
        shutil.rmtree(earlier, ignore_errors=True)  # left by a run killed while replacing it
        os.replace(shipped, earlier)
    try:
        report = export(shipped)
    except BaseException:
        if earlier.exists() and not shipped.exists():
            os.replace(earlier, shipped)
        raise
    shutil.rmtree(earlier, ignore_errors=True)
    return report


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

"""`seq2seq distill` on the demo task with a tiny student: every stage runs and the report compares
teacher and student as users run them; the student learns from the teacher's outputs; a run killed
in any stage and started again ends with the same student and export; a bad section is one line."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

pytest.importorskip("ctranslate2", reason="optional extra: pip install -e '.[export]' (included in [dev])")

from seq2seq.checkpoint import Checkpoint  # noqa: E402
from seq2seq.cli.main import app  # noqa: E402
from seq2seq.config_files import load_config  # noqa: E402
from seq2seq.deploy import export as export_module  # noqa: E402
from seq2seq.distillation import pipeline, teacher_targets  # noqa: E402
from seq2seq.distillation import report as report_module  # noqa: E402
from seq2seq.files import content_digest  # noqa: E402
from seq2seq.inference.translator import Translator  # noqa: E402
from seq2seq.training import trainer as trainer_module  # noqa: E402

from ..conftest import tiny_config_dict, write_pairs  # noqa: E402

runner = CliRunner()
SOURCES = 120  # training sources the teacher translates: 3 chunks of 50, the last short


@pytest.fixture(scope="module")
def student_config(trained_checkpoint, demo_pairs, tmp_path_factory) -> Path:
    """A student half the teacher's width, one decoder layer, on the first SOURCES training sources."""
    teacher, _ = trained_checkpoint
    folder = tmp_path_factory.mktemp("distill")
    data = folder / "data"
    data.mkdir()
    for split, pairs in demo_pairs.items():
        write_pairs(data, split, pairs[:SOURCES] if split == "train" else pairs)
    raw = tiny_config_dict(data, max_steps=20, save_every=10, valid_every=10)
    raw["model"].update(d_model=48, heads=2, ffn_dim=96, decoder_layers=1)
    raw["decode"] = {"beam": 1, "max_len_a": 1.5, "max_len_b": 5}
    raw["distill"] = {"teacher": [str(teacher)], "beam": 2, "chunk_lines": 50, "shortlist_per_source": 20,
                      "shortlist_frequent": 20, "max_bleu_drop": 100.0}  # fmt: skip
    path = folder / "student.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def uninterrupted(student_config, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    result = runner.invoke(app, ["distill", str(student_config), "--run-dir", str(run_dir), "--quiet"])
    assert result.exit_code == 0, result.output
    return run_dir


def test_every_stage_runs_and_the_report_compares_teacher_and_student(uninterrupted, student_config):
    report = json.loads((uninterrupted / "report.json").read_text())
    teacher, student = report["models"]
    assert (teacher["name"], student["name"]) == ("teacher", "student")
    assert all(run["lines_per_second"] > 0 and run["megabytes"] > 0 for run in (teacher, student))
    assert student["megabytes"] < teacher["megabytes"]  # int8, half as wide
    shipped = uninterrupted / "student-int8"
    assert (shipped / "vmap.txt").is_file() and (uninterrupted / "student.shortlist").is_file()
    assert json.loads((shipped / "seq2seq_export.json").read_text())["quantization"] == "int8"
    outputs = (uninterrupted / "report" / "student.out").read_text().splitlines()
    assert outputs == Translator.load(shipped).translate(
        (uninterrupted / "report" / "test.src").read_text().splitlines()
    )


def test_the_student_learns_from_the_teachers_outputs(uninterrupted, student_config, trained_checkpoint):
    config = load_config(student_config)
    [work] = uninterrupted.glob("teacher-*")
    sources = (work / "train.src").read_text().splitlines()
    targets = (work / "train.tgt").read_text().splitlines()
    teacher = Translator.load(trained_checkpoint[0])
    assert targets[:10] == teacher.translate(sources[:10], beam=config.distill.beam)
    stored = yaml.safe_load((uninterrupted / "student" / "config.yaml").read_text())
    assert stored["data"]["train"]["tgt"] == str(work / "train.tgt")


def _weights(run_dir: Path) -> dict:
    return torch.load(run_dir / "student" / "checkpoints" / "last.pt", weights_only=True)["model"]


class Killed(BaseException):
    """Stands for the process being killed at a chosen point (nothing below catches it)."""


def test_a_run_killed_in_each_stage_ends_like_an_uninterrupted_one(
    uninterrupted, student_config, tmp_path, monkeypatch
):
    config, run_dir = load_config(student_config), tmp_path / "run"
    real_chunk, real_save, real_parity = (
        teacher_targets.write_text_atomic,
        trainer_module.Trainer._save,
        export_module.parity,
    )
    chunks = []  # every chunk the teacher translates, over all the starts

    def write_then_die_at_the_second_chunk(path, text):
        real_chunk(path, text)
        if Path(path).name.startswith("chunk-"):
            chunks.append(Path(path).name)
            if len(chunks) == 2:
                raise Killed

    monkeypatch.setattr(teacher_targets, "write_text_atomic", write_then_die_at_the_second_chunk)
    with pytest.raises(Killed):
        pipeline.distill(config, run_dir, progress=False, echo=lambda _: None)

    def save_then_die(self, *args, **kwargs):
        real_save(self, *args, **kwargs)
        raise Killed  # after the first checkpoint (step 10 of 20)

    monkeypatch.setattr(trainer_module.Trainer, "_save", save_then_die)
    with pytest.raises(Killed):
        pipeline.distill(config, run_dir, progress=False, echo=lambda _: None)
    monkeypatch.setattr(trainer_module.Trainer, "_save", real_save)

    def die_in_the_gate(*args, **kwargs):
        raise Killed

    monkeypatch.setattr(export_module, "parity", die_in_the_gate)
    with pytest.raises(Killed):
        pipeline.distill(config, run_dir, progress=False, echo=lambda _: None)
    monkeypatch.setattr(export_module, "parity", real_parity)
    assert not (run_dir / "student-int8").exists()

    real_timed = report_module._timed

    def die_once_the_teacher_has_translated(name, *args):
        run = real_timed(name, *args)
        if name == "teacher":
            raise Killed  # its output written, the student's not, no report.json
        return run

    monkeypatch.setattr(report_module, "_timed", die_once_the_teacher_has_translated)
    with pytest.raises(Killed):
        pipeline.distill(config, run_dir, progress=False, echo=lambda _: None)
    monkeypatch.setattr(report_module, "_timed", real_timed)
    assert (run_dir / "report" / "teacher.out").is_file() and not (run_dir / "report.json").exists()
    stopped = run_dir / "report" / ".teacher.out.work" / ".teacher.out.partial"  # as a translation stopped there leaves
    stopped.mkdir(parents=True)
    (stopped / "chunk-00000000.txt").write_text("not the teacher's\n")

    pipeline.distill(config, run_dir, progress=False, echo=lambda _: None)
    # the report's translations began afresh: one timed from a stopped one's middle would report a speed it never had
    assert sorted(p.name for p in (run_dir / "report").iterdir()) == sorted(
        p.name for p in (uninterrupted / "report").iterdir()
    )
    assert chunks == ["chunk-000000-of-50.json", "chunk-000001-of-50.json", "chunk-000002-of-50.json"]  # none twice
    resumed, whole = _weights(run_dir), _weights(uninterrupted)
    assert resumed.keys() == whole.keys() and all(torch.equal(resumed[k], whole[k]) for k in whole)
    assert (run_dir / "student.shortlist").read_text() == (uninterrupted / "student.shortlist").read_text()
    lines = (uninterrupted / "report" / "test.src").read_text().splitlines()
    assert Translator.load(run_dir / "student-int8").translate(lines) == Translator.load(
        uninterrupted / "student-int8"
    ).translate(lines)


def test_a_student_trained_on_is_exported_and_reported_again(uninterrupted, student_config, tmp_path):
    """The same command with more updates trains the student on: its export and report were of the
    earlier student, so both are made again (the export was kept as it stood, stale); run once more,
    nothing has changed and neither is."""
    shutil.copytree(uninterrupted, tmp_path / "run")
    config, run_dir = load_config(student_config), tmp_path / "run"
    student = run_dir / "student" / "checkpoints" / "best.pt"
    exported_before = content_digest(student)
    # best.pt by chrF, which rises from 3 to 12 here between steps 20 and 40: a student that changed
    longer = dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=40, best_metric="chrf"))
    said = []
    pipeline.distill(longer, run_dir, progress=False, echo=said.append)
    assert content_digest(student) != exported_before
    exported = json.loads((run_dir / "student-int8" / "seq2seq_export.json").read_text())
    assert (
        exported["checkpoint_sha256"] == content_digest(student)
        and exported["step"] == Checkpoint.load(student).progress.step
    )
    assert any(line.startswith("4/5 export (again: the export there was of another student)") for line in said)
    report = json.loads((run_dir / "report.json").read_text())
    assert report["student_sha256"] == exported["checkpoint_sha256"]
    lines = (run_dir / "report" / "test.src").read_text().splitlines()
    assert (run_dir / "report" / "student.out").read_text().splitlines() == Translator.load(
        run_dir / "student-int8"
    ).translate(lines)
    assert not list(run_dir.glob(".*")) and not list((run_dir / "report").glob(".*"))
    made = {path: path.stat().st_mtime_ns for path in [run_dir / "report.json", *(run_dir / "student-int8").iterdir()]}
    said.clear()
    pipeline.distill(longer, run_dir, progress=False, echo=said.append)
    assert said[-2] == f"4/5 export: {run_dir / 'student-int8'} (exported before)"
    assert said[-1] == f"5/5 report: {run_dir / 'report.json'} (made before, of this student and teacher)"
    assert {path: path.stat().st_mtime_ns for path in made} == made


@pytest.mark.parametrize(
    ("setting", "fragment"),
    [("distill.teacher=[]", "distill.teacher: expected a list of one or more checkpoints"),
     ("distill.teacher=[nowhere.pt]", "distill.teacher[0]: nowhere.pt: file not found"),
     ("distill.beam=0", "distill.beam: expected an integer >= 1"),
     ("distill.quantization=int4", "distill.quantization"),
     ("distill.shortlist_per_sourc=3", "distill.shortlist_per_sourc")],
)  # fmt: skip
def test_a_bad_distill_section_is_one_line_before_any_work(student_config, tmp_path, setting, fragment):
    run_dir = tmp_path / "run"
    result = runner.invoke(app, ["distill", str(student_config), "--set", setting, "--run-dir", str(run_dir)])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and fragment in errors[0], result.output
    assert not run_dir.exists()


def test_a_distill_run_directory_in_use_is_refused_to_a_second_distill(student_config, tmp_path):
    """Two distills in one folder would translate, train and export over each other: the second is
    refused before any stage runs."""
    from seq2seq.training.run_dir import RunDir

    run_dir = tmp_path / "run"
    with RunDir(run_dir).held():  # stands for the distill that still runs there
        result = runner.invoke(app, ["distill", str(student_config), "--run-dir", str(run_dir)])
    assert result.exit_code == 2, result.output
    assert f"{run_dir}: another seq2seq process" in result.output
    assert list(run_dir.iterdir()) == []


def test_an_exported_teacher_writes_the_targets_its_checkpoint_writes(uninterrupted, student_config, tmp_path):
    """CTranslate2 translates the corpus faster; the float32 export runs the checkpoint's search."""
    config = load_config(student_config)
    exported = tmp_path / "teacher-ct2"
    export_module.export_checkpoint(Path(config.distill.teacher[0]), exported)
    config = dataclasses.replace(config, distill=dataclasses.replace(config.distill, teacher=(str(exported),)))
    (corpus,) = teacher_targets.distilled_corpora(config, tmp_path / "run", progress=False)
    [work] = uninterrupted.glob("teacher-*")
    ours = (work / "train.tgt").read_text().splitlines()
    theirs = corpus.tgt.read_text().splitlines()
    assert corpus.tgt.parent.name != work.name  # another teacher: another folder
    assert len(theirs) == len(ours) and sum(a == b for a, b in zip(ours, theirs)) >= 0.97 * len(ours)


def test_a_source_longer_than_the_length_limit_is_not_translated(student_config, tmp_path):
    """The student would not train on it, and one runaway line can cost more than the corpus."""
    config = load_config(student_config, ["data.max_length=12"])
    (corpus,) = teacher_targets.distilled_corpora(config, tmp_path / "run", progress=False)
    teacher = Translator.load(config.distill.teacher[0])
    sources = corpus.src.read_text().splitlines()
    everything = (Path(config.data.train.src)).read_text().splitlines()
    assert 0 < len(sources) < len(everything)
    assert max(teacher.source_lengths(sources)) <= 13  # 12 pieces and the end of sentence
    longer = [line for line in everything if teacher.source_lengths([line])[0] > 13]
    assert longer and not set(longer) & set(sources)


def test_each_training_corpus_is_distilled_and_the_student_keeps_its_weight_and_tag(
    uninterrupted, student_config, trained_checkpoint, tmp_path
):
    """data.extra_train: the teacher translates each corpus's sources (a tagged corpus's without its
    tag, which only the student learns), and the student trains on each translation with the corpus's
    weight and tag."""
    from seq2seq.distillation.pipeline import student_config as config_of_student

    test = yaml.safe_load(student_config.read_text())["data"]["test"]
    extra = f"data.extra_train=[{{src: {test['src']}, tgt: {test['tgt']}, tag: '<bt>', weight: 0.5}}]"
    config = load_config(student_config, [extra, "tokenizer.user_defined_symbols=[<bt>]"])
    corpora = teacher_targets.distilled_corpora(config, tmp_path / "run", progress=False)
    [work] = uninterrupted.glob("teacher-*")
    assert corpora[0].tgt.read_text() == (work / "train.tgt").read_text()  # data.train's, as without extra
    sources = Path(test["src"]).read_text().splitlines()
    assert corpora[1].src.read_text().splitlines() == sources  # untagged: the tag is not the teacher's
    teacher = Translator.load(trained_checkpoint[0])
    assert corpora[1].tgt.read_text().splitlines() == teacher.translate(sources, beam=config.distill.beam)
    student = config_of_student(config, corpora)
    assert (student.data.train.src, student.data.train.weight, student.data.train.tag) == (str(corpora[0].src), 1, "")
    (bt,) = student.data.extra_train
    assert (bt.src, bt.tgt, bt.weight, bt.tag) == (str(corpora[1].src), str(corpora[1].tgt), 0.5, "<bt>")

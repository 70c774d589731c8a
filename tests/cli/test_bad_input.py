"""Every command against every kind of bad input it takes: one line naming the path, key or line and
what was expected, exit code 2, no traceback, found before the expensive work, and nothing lost."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.error import URLError

import pytest
import yaml
from typer.testing import CliRunner

from seq2seq.cli.boundary import LESS_AT_ONCE
from seq2seq.cli.main import app

from ..conftest import tiny_config_dict

runner = CliRunner()


@dataclass
class Paths:
    """A small world for the cases: a trained run, its data, a config and some bad files."""

    root: Path
    data: Path
    run: Path
    checkpoint: Path
    config: Path
    folder: Path  # an existing directory where a file is expected
    file: Path  # an existing file where a directory is expected
    junk: Path  # a file that is not what it claims to be
    latin1: Path  # not UTF-8 on line 2
    missing: Path  # does not exist
    nowhere: Path  # a file in a folder that does not exist
    empty: Path  # a file with no lines


@pytest.fixture(scope="module")
def world(tmp_path_factory, trained_checkpoint) -> Paths:
    checkpoint, data = trained_checkpoint
    root = tmp_path_factory.mktemp("bad")
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(data)))
    (root / "folder").mkdir()
    (root / "file.txt").write_text("a file\n")
    (root / "junk.pt").write_bytes(b"not a checkpoint")
    (root / "latin1.txt").write_bytes("first line\nsecond l\xe9ne\n".encode("latin-1"))
    (root / "empty.txt").write_text("")
    bad = {"folder": root / "folder", "file": root / "file.txt",
           "junk": root / "junk.pt", "latin1": root / "latin1.txt",
           "missing": root / "missing.txt", "nowhere": root / "no" / "such" / "out.txt",
           "empty": root / "empty.txt"}  # fmt: skip
    return Paths(root, data, checkpoint.parent.parent, checkpoint, config, **bad)


@dataclass
class Case:
    args: Callable[[Paths], list]
    fragments: Callable[[Paths], list[str]]
    input: str | None = None
    not_created: Callable[[Paths], list[Path]] = field(default=lambda w: [])  # outputs that must not appear


def _config_with(world: Paths, name: str, change: Callable[[dict], None]) -> Path:
    raw = tiny_config_dict(world.data)
    change(raw)
    path = world.root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _tsv_with_two_tabs(world: Paths) -> Path:
    path = world.root / "two_tabs.tsv"
    path.write_text("a\tb\nc\td\te\n")
    return _config_with(world, "tsv", lambda raw: raw["data"].update(train={"format": "tsv", "path": str(path)}))


def _config_with_a_second_train_section(world: Paths) -> Path:
    """The config with `train:` again at its end: PyYAML keeps the last, dropping the first whole."""
    path = world.root / "twice.yaml"
    text = world.config.read_text()
    path.write_text(text + "train:\n  max_steps: 5\n")
    return path


def _export_folder(world: Paths) -> Path:
    """A folder marked as written by `seq2seq export` (its metadata file is what marks it)."""
    folder = world.root / "marked-export"
    folder.mkdir(exist_ok=True)
    (folder / "seq2seq_export.json").write_text("{}")
    return folder


def _folder_with_plots(world: Paths) -> Path:
    """A folder holding what an earlier --attention-plot wrote for a second line."""
    folder = world.root / "plots"
    folder.mkdir(exist_ok=True)
    (folder / "attention_2.png").write_bytes(b"an earlier plot")
    return folder


def _eval_test(world: Paths, *options) -> list:
    """eval on the test split, with these options."""
    return ["eval", "-c", world.checkpoint, "--src", world.data / "test.en", "--ref", world.data / "test.xx", *options]


UNSPELLABLE = "\ua66e\ua66e"  # ꙮꙮ: a script the tiny model's target vocabulary never saw


def _guided(world: Paths, kind: str) -> list:
    """translate two lines whose second constraint (or glossary term, or prefix) the target
    vocabulary cannot spell; the output file must not appear."""
    source = world.root / "two.en"
    source.write_text("the cat sleeps\nthe dog runs\n")
    guide = world.root / f"{kind}.txt"
    if kind == "glossary":
        guide.write_text("# term base\ncat\tgato\ndog\t" + UNSPELLABLE + "\n")
    else:
        guide.write_text("\n" + UNSPELLABLE + "\n")
    return ["translate", "-c", world.checkpoint, "-i", source, f"--{kind}", guide, "-o", world.root / f"{kind}.out"]


def _hf_valid(world: Paths, split: str | None = None) -> Path:
    import datasets

    folder = world.root / "hf_dataset"
    if not folder.exists():
        rows = {"translation": [{"en": "a cat", "xx": "un gato"}, {"en": "a dog", "xx": "un perro"}]}
        datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows), "validation": datasets.Dataset.from_dict(rows)}
                             ).save_to_disk(str(folder))  # fmt: skip
    valid = {"format": "hf", "path": str(folder), **({"split": split} if split else {})}
    return _config_with(world, f"hf-{split}", lambda raw: raw["data"].update(valid=valid))


CASES = {
    # translate: paths, checkpoints, settings
    "translate -i is a directory": Case(lambda w: ["translate", "-c", w.checkpoint, "-i", w.folder],
                                        lambda w: [str(w.folder), "is a directory", "expected a text file"]),
    "translate -i missing": Case(lambda w: ["translate", "-c", w.checkpoint, "-i", w.missing],
                                 lambda w: [str(w.missing), "file not found"]),
    "translate -i not UTF-8": Case(lambda w: ["translate", "-c", w.checkpoint, "-i", w.latin1],
                                   lambda w: [f"{w.latin1}:2: not valid UTF-8"]),
    "translate -o in a missing folder": Case(lambda w: ["translate", "-c", w.checkpoint, "-o", w.nowhere],
                                             lambda w: [str(w.nowhere), "does not exist"], input="a cat\n"),
    "translate -o is a directory": Case(lambda w: ["translate", "-c", w.checkpoint, "-o", w.folder],
                                        lambda w: [str(w.folder), "is a directory"], input="a cat\n"),
    "translate -c missing": Case(lambda w: ["translate", "-c", w.missing], lambda w: [str(w.missing), "not found"],
                                 input="a cat\n"),
    "translate -c junk": Case(lambda w: ["translate", "-c", w.junk],
                              lambda w: [str(w.junk), "not a readable seq2seq checkpoint"], input="a cat\n"),
    "translate -c a plain directory": Case(lambda w: ["translate", "-c", w.folder],
                                           lambda w: [str(w.folder), "a directory without checkpoints/best.pt"],
                                           input="a cat\n"),
    "translate --beam 0": Case(lambda w: ["translate", "-c", w.checkpoint, "--beam", "0"],
                               lambda w: ["--beam: expected an integer in [1, 256], got 0"], input="a cat\n"),
    "translate --nbest 0": Case(lambda w: ["translate", "-c", w.checkpoint, "--nbest", "0"],
                                lambda w: ["--nbest: expected an integer in [1, 256], got 0"], input="a cat\n"),
    "translate --nbest past --beam": Case(lambda w: ["translate", "-c", w.checkpoint, "--beam", "2", "--nbest", "3"],
                                          lambda w: ["--nbest: expected at most beam (2), got 3"], input="a cat\n"),
    "eval --beam past its bound": Case(
        lambda w: ["eval", "-c", w.checkpoint, "--src", w.file, "--ref", w.file, "--beam", "100000"],
        lambda w: ["--beam: expected an integer in [1, 256], got 100000"]),
    "translate a non-finite setting": Case(
        lambda w: ["translate", "-c", w.checkpoint, "--set", "decode.length_penalty=.nan"],
        lambda w: ["decode.length_penalty", "expected a finite number"], input="a cat\n"),
    "translate a train key": Case(lambda w: ["translate", "-c", w.checkpoint, "--set", "train.lr=1"],
                                  lambda w: ["--set train.lr=1", "only decode.* keys"], input="a cat\n"),
    "translate --constraints the vocabulary cannot spell": Case(
        lambda w: _guided(w, "constraints"),
        lambda w: [f"{w.root / 'constraints.txt'}:2: 'ꙮꙮ' has characters the target vocabulary cannot spell"],
        not_created=lambda w: [w.root / "constraints.out"]),
    "translate --prefix the vocabulary cannot spell": Case(
        lambda w: _guided(w, "prefix"), lambda w: [f"{w.root / 'prefix.txt'}:2: 'ꙮꙮ' has characters"],
        not_created=lambda w: [w.root / "prefix.out"]),
    "translate --glossary term the vocabulary cannot spell": Case(
        lambda w: _guided(w, "glossary"), lambda w: [f"{w.root / 'glossary.txt'}:3: 'ꙮꙮ' has characters"],
        not_created=lambda w: [w.root / "glossary.out"]),
    "translate -o its own input": Case(lambda w: ["translate", "-c", w.checkpoint, "-i", w.file, "-o", w.file],
                                       lambda w: [str(w.file), "already exists", "expected a new output file"]),
    "translate --attention-plot over earlier plots": Case(
        lambda w: ["translate", "-c", w.checkpoint, "--attention-plot", _folder_with_plots(w)],
        lambda w: [str(w.root / "plots"), "attention_2.png already exists"], input="a cat\n"),
    "translate --attention-plot of an ensemble": Case(
        lambda w: ["translate", "-c", w.checkpoint, "-c", w.checkpoint, "--attention-plot", w.root / "maps"],
        lambda w: ["--attention-plot: an ensemble of 2 models; attention maps need one checkpoint (.pt)"],
        input="a cat\n"),
    "translate --attention-plot is a file": Case(
        lambda w: ["translate", "-c", w.checkpoint, "--attention-plot", w.file],
        lambda w: [str(w.file), "is a file", "expected a folder"], input="a cat\n"),
    # eval and score: references, reports, metrics
    "eval --ref count differs": Case(
        lambda w: ["eval", "-c", w.checkpoint, "--src", w.data / "test.en", "--ref", w.data / "train.xx"],
        lambda w: [str(w.data / "train.xx"), "has 3000 lines", "has 60", "expected equal counts"]),
    "eval --ref missing": Case(lambda w: ["eval", "-c", w.checkpoint, "--src", w.data / "test.en", "--ref", w.missing],
                               lambda w: [str(w.missing), "No such file", "expected an existing path"]),
    "eval --json in a missing folder": Case(
        lambda w: _eval_test(w, "--json", w.nowhere),
        lambda w: [str(w.nowhere), "does not exist"]),
    "eval --hyps is a directory": Case(
        lambda w: _eval_test(w, "--hyps", w.folder),
        lambda w: [str(w.folder), "is a directory"]),
    "eval --hyps an existing file": Case(
        lambda w: _eval_test(w, "--hyps", w.file),
        lambda w: [str(w.file), "already exists"]),
    "eval --json an existing file": Case(
        lambda w: _eval_test(w, "--json", w.file),
        lambda w: [str(w.file), "already exists"]),
    "eval --hyps and --json one file": Case(
        lambda w: _eval_test(w, "--hyps", w.root / "both", "--json", w.root / "both"),
        lambda w: ["--hyps and --json", str(w.root / "both"), "expected two files"],
        not_created=lambda w: [w.root / "both"]),
    "score --json an existing file": Case(
        lambda w: ["score", "--hyp", w.data / "test.xx", "--ref", w.data / "test.xx", "--json", w.file],
        lambda w: [str(w.file), "already exists"]),
    "score-pairs -o an existing file": Case(
        lambda w: ["score-pairs", "-c", w.checkpoint, "--src", w.data / "test.en", "--tgt", w.data / "test.xx", "-o",
                   w.file],
        lambda w: [str(w.file), "already exists"]),
    "eval on empty files": Case(lambda w: ["eval", "-c", w.checkpoint, "--src", w.empty, "--ref", w.empty],
                                lambda w: [str(w.empty), "no lines to translate"]),
    "score-pairs --set a decode key scoring does not read": Case(
        lambda w: ["score-pairs", "-c", w.checkpoint, "--src", w.data / "test.en", "--tgt", w.data / "test.xx",
                   "--set", "decode.temperature=0.5"],
        lambda w: ["decode.temperature: scoring given pairs does not use it", "scoring takes decode.length_penalty"]),
    "score-pairs with counts that differ": Case(
        lambda w: ["score-pairs", "-c", w.checkpoint, "--src", w.data / "test.en", "--tgt", w.data / "train.xx"],
        lambda w: [str(w.data / "train.xx"), "has 3000 lines", "has 60", "expected one target per source"]),
    "score an empty hypothesis file": Case(lambda w: ["score", "--hyp", w.empty, "--ref", w.empty],
                                           lambda w: [str(w.empty), "no lines to score"]),
    "tokenizer vocab_size below the character set": Case(
        lambda w: ["tokenizer", "train",
                   _config_with(w, "tiny_vocab", lambda raw: raw["tokenizer"].update(vocab_size=10))],
        lambda w: ["tokenizer.vocab_size: 10 is below the", "expected at least", "character_coverage"]),
    "score --metrics unknown": Case(
        lambda w: ["score", "--hyp", w.data / "test.xx", "--ref", w.data / "test.xx", "--metrics", "bleu,meteor"],
        lambda w: ["--metrics", "meteor", "expected some of bleu, chrf, chrf++, ter"]),
    "score --metrics repeated": Case(
        lambda w: ["score", "--hyp", w.data / "test.xx", "--ref", w.data / "test.xx", "--metrics", "bleu,chrf,BLEU"],
        lambda w: ["--metrics: bleu given twice"]),
    "score --tokenize unknown": Case(
        lambda w: ["score", "--hyp", w.data / "test.xx", "--ref", w.data / "test.xx", "--tokenize", "moses"],
        lambda w: ["--tokenize", "'moses'", "expected one of"]),
    "score --hyp is a directory": Case(lambda w: ["score", "--hyp", w.folder, "--ref", w.data / "test.xx"],
                                       lambda w: [str(w.folder), "expected a file, not a directory"]),
    "score --ref not UTF-8": Case(lambda w: ["score", "--hyp", w.latin1, "--ref", w.latin1],
                                  lambda w: [f"{w.latin1}:2: not valid UTF-8"]),
    # train: configs, data, run directories
    "train config is a directory": Case(lambda w: ["train", w.folder],
                                        lambda w: [str(w.folder), "is a directory", "expected a YAML config"]),
    "train --run-dir is a file": Case(lambda w: ["train", w.config, "--run-dir", w.file],
                                      lambda w: [str(w.file), "is a file", "expected a run directory"]),
    "train data file is a directory": Case(lambda w: ["train", w.config, "--set", f"data.train.src={w.folder}"],
                                           lambda w: ["data.train.src", "is a directory", str(w.folder)]),
    "train non-finite number": Case(lambda w: ["train", w.config, "--set", "train.lr=.inf"],
                                    lambda w: ["--set train.lr", "expected a finite number"]),
    "train config with a section twice": Case(
        lambda w: ["train", _config_with_a_second_train_section(w), "--run-dir", w.root / "r-twice"],
        lambda w: [f"{w.root / 'twice.yaml'}:", ": train: given twice (first on line", "expected each key once"],
        not_created=lambda w: [w.root / "r-twice"]),
    "train --set value not YAML": Case(lambda w: ["train", w.config, "--set", "train.lr=[1"],
                                       lambda w: ["--set train.lr=[1", "not valid YAML"]),
    "train tsv line with two tabs": Case(lambda w: ["train", _tsv_with_two_tabs(w), "--run-dir", w.root / "r-tsv"],
                                         lambda w: [f"{w.root / 'two_tabs.tsv'}:2", "one tab", "found 2 tabs"],
                                         not_created=lambda w: [w.root / "r-tsv"]),
    "train hf valid without split": Case(lambda w: ["train", _hf_valid(w), "--run-dir", w.root / "r-hf"],
                                         lambda w: ["data.valid.split", "not set", "validation"],
                                         not_created=lambda w: [w.root / "r-hf" / "tokenizer"]),
    "train hf valid with a split it lacks": Case(
        lambda w: ["train", _hf_valid(w, "dev"), "--run-dir", w.root / "r-hf-dev"],
        lambda w: ["data.valid.split: 'dev' is not a split of", "it has 'train', 'validation'"],
        not_created=lambda w: [w.root / "r-hf-dev" / "tokenizer"]),
    "train on empty training files": Case(
        lambda w: ["train", w.config, "--set", f"data.train.src={w.empty}", "--set", f"data.train.tgt={w.empty}",
                   "--run-dir", w.root / "r-empty"],
        lambda w: [f"data.train ({w.empty}, {w.empty}): no sentence pair with text on both sides"],
        not_created=lambda w: [w.root / "r-empty" / "checkpoints", w.root / "r-empty" / "config.yaml"]),
    "train with a negative seed": Case(lambda w: ["train", w.config, "--run-dir", w.root / "r-seed", "--set",
                                                  "train.seed=-5"],
                                       lambda w: ["--set train.seed: expected an integer in [0, 4294967296), got -5"],
                                       not_created=lambda w: [w.root / "r-seed"]),
    "train with a negative optimizer epsilon": Case(
        lambda w: ["train", w.config, "--run-dir", w.root / "r-eps", "--set", "train.eps=-1"],
        lambda w: ["--set train.eps: expected a number >= 0, got -1"], not_created=lambda w: [w.root / "r-eps"]),
    "train --resume with a changed model": Case(
        lambda w: ["train", w.config, "--resume", w.run, "--set", "model.d_model=64"],
        lambda w: [f"--resume {w.run}", "model.d_model", "96 in the run, 64 given"]),
    "train from a missing checkpoint": Case(
        lambda w: ["train", w.config, "--run-dir", w.root / "r-init", "--set", f"train.init_from={w.missing}"],
        lambda w: [f"train.init_from: {w.missing}: checkpoint not found"], not_created=lambda w: [w.root / "r-init"]),
    "train from an exported model": Case(
        lambda w: ["train", w.config, "--run-dir", w.root / "r-init3", "--set", f"train.init_from={_export_folder(w)}"],
        lambda w: [f"train.init_from {w.root / 'marked-export'}: an exported model (CTranslate2) cannot be trained on"],
        not_created=lambda w: [w.root / "r-init3"]),
    "train from a checkpoint of another shape": Case(
        lambda w: ["train", w.config, "--run-dir", w.root / "r-init2", "--set", f"train.init_from={w.run}", "--set",
                   "model.ffn_dim=64"],
        lambda w: [f"train.init_from {w.run}: model.ffn_dim: 192 in the checkpoint, 64 given"],
        not_created=lambda w: [w.root / "r-init2"]),
    "train --resume on other pairs": Case(
        lambda w: ["train", w.config, "--resume", w.run, "--set", f"data.train.tgt={w.data / 'train.en'}"],
        lambda w: [f"data.train ({w.data / 'train.en'}, {w.data / 'train.en'})",
                   "not the text this run trained on"]),
    "tokenizer train with a missing data file": Case(
        lambda w: ["tokenizer", "train", w.config, "--set", f"data.train.src={w.missing}", "--run-dir", w.root / "t"],
        lambda w: ["data.train.src", "file not found", str(w.missing)], not_created=lambda w: [w.root / "t"]),
    # average, plot, export, serve, demo
    "average -o in a missing folder": Case(lambda w: ["average", w.checkpoint, w.checkpoint, "-o", w.nowhere],
                                           lambda w: [str(w.nowhere), "does not exist"]),
    "average -o one of its checkpoints": Case(lambda w: ["average", w.checkpoint, w.checkpoint, "-o", w.checkpoint],
                                              lambda w: [str(w.checkpoint), "already exists",
                                                         "expected a new output checkpoint"]),
    "average a junk checkpoint": Case(lambda w: ["average", w.checkpoint, w.junk, "-o", w.root / "avg.pt"],
                                      lambda w: [str(w.junk), "not a readable seq2seq checkpoint"],
                                      not_created=lambda w: [w.root / "avg.pt"]),
    "average --last past a run's saves": Case(
        lambda w: ["average", w.run, "--last", "9", "-o", w.root / "avg9.pt"],
        lambda w: [f"{w.run}: ", "numbered checkpoint(s)", "--last 9 expected at least 9", "train.keep_last"],
        not_created=lambda w: [w.root / "avg9.pt"]),
    "average a folder without numbered checkpoints": Case(
        lambda w: ["average", w.folder, "-o", w.root / "avgf.pt"],
        lambda w: [str(w.folder), "a directory without numbered checkpoints"],
        not_created=lambda w: [w.root / "avgf.pt"]),
    "plot a folder without metrics": Case(lambda w: ["plot", w.folder],
                                          lambda w: [str(w.folder), "no metrics.jsonl; expected a run directory"]),
    "plot a run directory that does not exist": Case(lambda w: ["plot", w.nowhere.parent],
                                                     lambda w: [str(w.nowhere.parent), "not found",
                                                                "expected a run directory"]),
    "export to an existing path": Case(lambda w: ["export", w.checkpoint, "-o", w.folder],
                                       lambda w: [str(w.folder), "already exists"]),
    "export --max-positions past its bound": Case(
        lambda w: ["export", w.checkpoint, "-o", w.root / "e3", "--max-positions", "100000000"],
        lambda w: ["--max-positions 100000000: expected an integer in [1, 65,536]"],
        not_created=lambda w: [w.root / "e3"]),
    "export --quantization unknown": Case(lambda w: ["export", w.checkpoint, "-o", w.root / "e", "--quantization",
                                                     "int3"],
                                          lambda w: ["--quantization", "int3"], not_created=lambda w: [w.root / "e"]),
    "serve a missing model": Case(lambda w: ["serve", w.missing], lambda w: [str(w.missing), "no such checkpoint"]),
    "serve --timeout past its bound": Case(lambda w: ["serve", w.checkpoint, "--timeout", "1e400"],
                                           lambda w: ["--timeout", "less than or equal to 3600"]),
    "serve --batch-wait-ms past its bound": Case(lambda w: ["serve", w.checkpoint, "--batch-wait-ms", "1e12"],
                                                 lambda w: ["--batch-wait-ms", "less than or equal to 10000"]),
    "serve with a missing shortlist": Case(lambda w: ["serve", w.checkpoint, "--shortlist", w.missing],
                                           lambda w: [str(w.missing), "unreadable shortlist"]),
    "export with a shortlist of another vocabulary": Case(
        lambda w: ["export", w.checkpoint, "-o", w.root / "e2", "--shortlist", w.file],
        lambda w: [f"{w.file}:1: expected 'source piece<TAB>target pieces'"], not_created=lambda w: [w.root / "e2"]),
    "shortlist --src without --tgt": Case(
        lambda w: ["shortlist", w.checkpoint, "-o", w.root / "l", "--src", w.file],
        lambda w: ["--src and --tgt go together"], not_created=lambda w: [w.root / "l"]),
    "shortlist --tgt of another length": Case(
        lambda w: ["shortlist", w.checkpoint, "-o", w.root / "l", "--src", w.data / "test.en", "--tgt",
                   w.data / "train.xx"],
        lambda w: [f"{w.data / 'train.xx'}: 3000 lines, {w.data / 'test.en'}: 60; expected one translation per"],
        not_created=lambda w: [w.root / "l"]),
    "distill a config without a distill section": Case(
        lambda w: ["distill", w.config, "--run-dir", w.root / "dd"],
        lambda w: [str(w.config), "no distill section"], not_created=lambda w: [w.root / "dd"]),
    "train --resume and --run-dir apart": Case(
        lambda w: ["train", w.config, "--resume", w.run, "--run-dir", w.root / "elsewhere"],
        lambda w: [f"--resume {w.run} and --run-dir {w.root / 'elsewhere'}", "expected one of the two"],
        not_created=lambda w: [w.root / "elsewhere"]),
    "train --config, an argument given as an option": Case(
        lambda w: ["train", "--config", w.config, "--run-dir", w.root / "tc"],
        lambda w: ["No such option: --config", "CONFIG is an argument, given without a flag: ", " train CONFIG"],
        not_created=lambda w: [w.root / "tc"]),
    "translate -q, an option of seq2seq itself after the command": Case(
        lambda w: ["translate", "-c", w.checkpoint, "-q"],
        lambda w: ["No such option: -q", "itself, given before the command: ", " -q translate"]),
    "eval --log-level after the command": Case(
        lambda w: ["eval", "-c", w.checkpoint, "--log-level", "error"],
        lambda w: ["No such option: --log-level", " --log-level LOG_LEVEL eval"]),
    "demo --config missing": Case(lambda w: ["demo", "--config", w.missing, "--run-dir", w.root / "d"],
                                  lambda w: [str(w.missing), "config file not found"]),
}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_clear_line_and_exit_2(world: Paths, name: str):
    case = CASES[name]
    kept = {path: path.read_bytes() for path in (world.run / "config.yaml", world.checkpoint, world.file)}
    result = runner.invoke(app, [str(a) for a in case.args(world)], input=case.input)
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    for fragment in case.fragments(world):
        assert fragment in errors[0], (fragment, errors[0])
    for path in [world.nowhere.parent, *case.not_created(world)]:
        assert not path.exists(), f"{path} was created"
    for path, content in kept.items():  # the trained run and the files named as outputs are untouched
        assert path.read_bytes() == content, f"{path} was changed"
    leftovers = [p for p in world.root.rglob(".*tmp*")] + [p for p in world.run.rglob(".*tmp*")]
    assert not leftovers


def test_a_bug_is_one_line_with_exit_1_and_debug_shows_the_traceback(world: Paths, monkeypatch):
    import seq2seq.evaluation.scoring

    def broken(*args, **kwargs):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(seq2seq.evaluation.scoring, "score", broken)
    monkeypatch.setattr("seq2seq.evaluation.evaluate.score", broken)
    args = ["score", "--hyp", str(world.data / "test.xx"), "--ref", str(world.data / "test.xx")]
    monkeypatch.setenv("SEQ2SEQ_DEBUG", "0")  # --debug below sets it; the monkeypatch restores it after the test
    result = runner.invoke(app, args)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.splitlines()[0] == "error: internal error: ZeroDivisionError: boom"
    assert "--debug" in result.stderr
    debug = runner.invoke(app, ["--debug", *args])
    assert isinstance(debug.exception, ZeroDivisionError)  # re-raised: Python prints the traceback


def test_running_out_of_memory_is_one_line_saying_what_to_ask_less_of(world: Paths, monkeypatch):
    """Not "a bug in seq2seq": the machine's memory ran out (MemoryError is what a C++ std::bad_alloc
    becomes), and the line names the settings that hold less at once."""

    def too_much(*args, **kwargs):
        raise MemoryError("std::bad_alloc")

    monkeypatch.setattr("seq2seq.inference.pytorch_engine.translate_lines", too_much)
    monkeypatch.setenv("SEQ2SEQ_DEBUG", "0")
    result = runner.invoke(app, ["translate", "-c", str(world.checkpoint)], input="a line\n")
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: out of memory (std::bad_alloc); {LESS_AT_ONCE}"]
    assert "decode.batch_tokens" in LESS_AT_ONCE and "train.max_tokens" in LESS_AT_ONCE


@pytest.mark.parametrize(
    ("missing", "loaded", "command", "extra"),
    [("ctranslate2", "seq2seq.deploy.export", ["export", "{checkpoint}", "-o", "{root}/exported"], "export"),
     ("fastapi", "seq2seq.deploy.serve", ["serve", "{checkpoint}"], "serve")],
)  # fmt: skip
def test_a_missing_extra_is_one_line_naming_what_to_install(world: Paths, monkeypatch, missing, loaded, command, extra):
    """Installed without [export] or [serve], the commands that need them say what to install (exit 2)
    instead of reporting a bug in seq2seq."""
    import sys

    for name in [name for name in sys.modules if name.startswith(f"{missing}.")]:  # its submodules, cached
        monkeypatch.delitem(sys.modules, name)  # by earlier tests, would import without it
    monkeypatch.setitem(sys.modules, missing, None)  # `import ctranslate2` now raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, loaded, raising=False)  # so that the command imports it afresh
    args = [part.format(checkpoint=world.checkpoint, root=world.root) for part in command]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: {missing} is not installed; this command needs seq2seq's [{extra}] extra: "
        f"pip install 'seq2seq[{extra}]'"
    ]
    assert not (world.root / "exported").exists()


@pytest.mark.parametrize(
    ("tokenize", "failure", "reason"),
    [("ja-mecab", RuntimeError("\nJapanese tokenization needs more.\n\n    pip install sacrebleu[ja]\n"),
      "(Japanese tokenization needs more. pip install sacrebleu[ja])"),
     ("flores200", URLError("[Errno -2] Name or service not known"),
      "(what it downloads or reads for it failed: <urlopen error [Errno -2] Name or service not known>)")],
)  # fmt: skip
@pytest.mark.parametrize("command", ["eval", "score"])
def test_a_bleu_tokenizer_sacrebleu_cannot_set_up_is_one_line_before_any_translation(
    world: Paths, monkeypatch, command, tokenize, failure, reason
):
    """ja-mecab without its package, flores200 whose model sacrebleu downloads on first use (here with
    no network): sacrebleu raises as it makes the metric; eval says so before it translates a line."""
    from sacrebleu.metrics import bleu

    def unusable(name):
        def make():
            raise failure

        return make

    def translated(*args, **kwargs):
        raise AssertionError("the model was loaded before the scoring was checked")

    monkeypatch.setattr(bleu, "_get_tokenizer", unusable)
    monkeypatch.setattr("seq2seq.inference.translator.Translator.load", translated)
    model = ["-c", world.checkpoint, "--src", world.data / "test.en"] if command == "eval" else []
    hypotheses = [] if command == "eval" else ["--hyp", world.data / "test.xx"]
    args = [command, *model, *hypotheses, "--ref", world.data / "test.xx", "--tokenize", tokenize]
    result = runner.invoke(app, [str(arg) for arg in args])
    assert result.exit_code == 2, result.output
    [line] = result.stderr.splitlines()
    assert line.startswith(f"error: --tokenize {tokenize}: sacrebleu cannot use it here") and reason in line


def test_plot_replaces_its_own_plots_and_no_file_it_did_not_write(world: Paths, tmp_path):
    """`seq2seq plot` run again replaces the PNGs it wrote; a file under one of their names that it did
    not write (here a PNG that matplotlib wrote for someone) is one line, exit 2, before any plot is
    drawn, and stays as it was."""
    import matplotlib.pyplot as plt

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(world.run / "metrics.jsonl", run / "metrics.jsonl")
    for _ in range(2):
        result = runner.invoke(app, ["plot", str(run)])
        assert result.exit_code == 0, result.output
    figure = plt.figure()
    figure.savefig(run / "plots" / "lr.png")
    plt.close(figure)
    theirs = (run / "plots" / "lr.png").read_bytes()
    ours = {path: path.stat().st_mtime_ns for path in (run / "plots").glob("*.png")}
    result = runner.invoke(app, ["plot", str(run)])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        f"error: {run / 'plots' / 'lr.png'}: exists and is not a plot seq2seq wrote; `seq2seq plot` replaces only "
        "its own plots (move that file away, then run it again)"
    ]
    assert (run / "plots" / "lr.png").read_bytes() == theirs
    assert {path: path.stat().st_mtime_ns for path in (run / "plots").glob("*.png")} == ours


def test_version_and_completion():
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"seq2seq {version('seq2seq')}"
    assert "--install-completion" in runner.invoke(app, ["--help"]).stdout


def test_help_keeps_square_brackets():
    assert "[default: the model's decode.beam]" in " ".join(runner.invoke(app, ["translate", "--help"]).stdout.split())

"""The CLI as a user drives it: help, the whole path on a tiny run, and bad input -> one line, exit 2."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sacrebleu
import torch
import typer
import yaml
from typer.testing import CliRunner

from seq2seq.checkpoint import Checkpoint
from seq2seq.cli.main import app
from seq2seq.config_files import decode_config_with, load_config
from seq2seq.decoding import DecodeConfig
from seq2seq.errors import UserInputError

from ..conftest import tiny_config_dict

runner = CliRunner()


def invoke(*args: str, input: str | None = None):
    return runner.invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)


def assert_user_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_help_lists_every_command_with_examples():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("tokenizer", "train", "translate", "eval", "export", "serve", "demo", "average", "plot",
                    "shortlist", "distill"):  # fmt: skip
        assert command in result.output
    for command in (
        ["train"],
        ["translate"],
        ["eval"],
        ["tokenizer", "train"],
        ["average"],
        ["plot"],
        ["demo"],
        ["export"],
        ["serve"],
        ["shortlist"],
        ["distill"],
    ):
        sub = invoke(*command, "--help")
        assert sub.exit_code == 0 and "Example" in sub.output
        assert invoke(*command, "-h").output == sub.output  # -h, as sacrebleu, fairseq and Marian take it


def test_the_set_example_in_each_commands_help_is_one_that_command_accepts(tmp_path, tiny_data):
    """A command on a trained model takes decode.* keys alone: its help must not suggest train.lr."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(tiny_data)))
    on_a_model = {"translate", "eval", "score-pairs"}  # decode_config_with; the others build a config
    found = set()
    for name, command in typer.main.get_command(app).commands.items():
        for option in (param for param in command.params if "--set" in getattr(param, "opts", ())):
            example = re.search(r"--set (\S+=\S+?)\.? ", option.help + " ").group(1)
            if name in on_a_model:
                decode_config_with(DecodeConfig(), [example])
            else:
                load_config(config, [example])
            found.add(name)
    assert on_a_model | {"train", "demo"} <= found


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """tokenizer train + train on the tiny config, through the CLI."""
    from seq2seq.data.demo_data import make_demo_corpus

    from ..conftest import write_pairs

    root = tmp_path_factory.mktemp("cli")
    data = root / "data"
    data.mkdir()
    for split, pairs in make_demo_corpus(seed=3, sizes={"train": 2000, "valid": 30, "test": 30}).items():
        write_pairs(data, split, pairs)
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config_dict(data, max_steps=30, valid_every=15, save_every=15)))
    run_dir = root / "run"
    result = invoke("tokenizer", "train", config, "--run-dir", run_dir)
    assert result.exit_code == 0, result.output
    assert (run_dir / "tokenizer" / "joint.model").exists()
    result = invoke("train", config, "--run-dir", run_dir, "--quiet", "--set", "train.max_steps=30")
    assert result.exit_code == 0, result.output
    return root, config, run_dir, data


def test_train_writes_the_run_directory(trained_run):
    _, _, run_dir, _ = trained_run
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["max_steps"] == 30
    assert (run_dir / "checkpoints" / "last.pt").exists()
    assert (run_dir / "checkpoints" / "best.pt").exists()
    kinds = {json.loads(line)["kind"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    assert kinds == {"train", "valid"}


def test_info_describes_the_checkpoint_a_run_directory_stands_for(trained_run):
    """`seq2seq info RUN_DIR`: best.pt's step, best validation, size (a tied weight once), vocabulary and
    training corpora, in YAML on stdout, or the same in JSON; a path that is no model is one line."""
    from seq2seq.checkpoint import Checkpoint

    _, _, run_dir, data = trained_run
    result = invoke("info", run_dir)
    assert result.exit_code == 0, result.output
    described = yaml.safe_load(result.stdout)
    best = Checkpoint.load(run_dir / "checkpoints" / "best.pt")
    assert described["path"] == str(run_dir / "checkpoints" / "best.pt") and described["step"] == best.progress.step
    assert described["best_validation"] == {"metric": "bleu", "bleu": round(best.progress.best_bleu, 2)}
    model = best.build_model()
    assert described["model"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert described["model"]["parameters"] < sum(t.numel() for t in best.model.values())  # tied: counted once
    assert described["vocabulary"] == {"joint": True, "source": model.src_embed.num_embeddings,
                                       "target": model.tgt_embed.num_embeddings}  # fmt: skip
    (corpus,) = described["training"]["corpora"]
    assert corpus == {"key": "data.train", "files": [str(data / "train.en"), str(data / "train.xx")], "weight": 1.0}
    logged = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "valid"}  # fmt: skip
    assert [(save["file"], save["valid"]["bleu"]) for save in described["saves"]] == [
        (f"step_{step:08d}.pt", round(logged[step]["bleu"], 2)) for step in (15, 30)
    ]  # the run's saves, to pick from or average, with their validations
    alone = json.loads(invoke("info", run_dir / "checkpoints" / "best.pt", "--json").stdout)
    assert alone == {key: value for key, value in described.items() if key != "saves"}
    assert_user_error(invoke("info", data / "train.en"), "train.en", "not a readable seq2seq checkpoint")


def test_validation_is_logged_to_stderr_and_train_log_and_quiet_silences_stderr(trained_run, tmp_path):
    _, config, run_dir, _ = trained_run
    logged = (run_dir / "train.log").read_text()
    assert "step 15: valid loss" in logged and "  hyp: " in logged
    result = invoke("--quiet", "train", config, "--run-dir", tmp_path / "quiet", "--set", "train.max_steps=2",
                    "--set", "train.valid_every=1", "--set", "train.warmup_steps=2")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("stopped after 2 steps")  # the result, on stdout
    assert result.stderr == ""  # --quiet: only warnings and errors, and there were none
    assert '"kind": "valid"' in (tmp_path / "quiet" / "metrics.jsonl").read_text()
    assert "step 2: valid loss" in (tmp_path / "quiet" / "train.log").read_text()  # the run's log keeps them


def test_a_file_is_translated_chunk_by_chunk_in_order(trained_run, tmp_path, monkeypatch):
    from seq2seq.cli import file_translation

    _, _, run_dir, data = trained_run
    checkpoint = run_dir / "checkpoints" / "last.pt"
    whole = invoke("translate", "-c", checkpoint, "-i", data / "test.en", "--beam", "1").stdout
    monkeypatch.setattr(file_translation, "FILE_CHUNK_LINES", 7)  # 30 lines: 5 chunks, the last one short
    calls, real = [], file_translation.Translator.translate_with

    def counting(self, lines, *args, **kwargs):
        calls.append(len(lines))
        return real(self, lines, *args, **kwargs)

    monkeypatch.setattr(file_translation.Translator, "translate_with", counting)
    chunked = invoke("translate", "-c", checkpoint, "-i", data / "test.en", "--beam", "1").stdout
    assert calls == [7, 7, 7, 7, 2] and chunked == whole and len(whole.splitlines()) == 30


SCORE = re.compile(r"(-?\d+\.\d+)")


def assert_same_output(ours: str, reference: str) -> None:
    """The same lines, word for word, with each printed score within two units of its last digit of the
    reference's: batches of other sizes sum a score's floats in another order (matrix products of other
    shapes), which can move its fourth decimal, as in any toolkit."""
    ours_lines, reference_lines = ours.splitlines(), reference.splitlines()
    assert len(ours_lines) == len(reference_lines)
    for mine, theirs in zip(ours_lines, reference_lines):
        mine_parts, their_parts = SCORE.split(mine), SCORE.split(theirs)
        assert mine_parts[::2] == their_parts[::2], (mine, theirs)  # everything but the scores, exactly
        assert [float(x) for x in mine_parts[1::2]] == pytest.approx([float(x) for x in their_parts[1::2]], abs=2e-4)


RESUMABLE = {  # the command on the test set, the Translator method it does each chunk with, what it does
    "sampled": (["translate", "-i", "{src}", "--set", "decode.sample=true", "--set", "decode.top_k=5"],
                "translate_with", "lines translated"),
    "nbest": (["translate", "-i", "{src}", "--beam", "3", "--nbest", "2"], "translate_with", "lines translated"),
    "score-pairs": (["score-pairs", "--src", "{src}", "--tgt", "{tgt}", "--per-token"], "score_with", "pairs scored"),
}  # fmt: skip


@pytest.mark.parametrize("name", RESUMABLE)
def test_an_interrupted_run_over_a_file_is_continued_by_the_same_command_as_if_never_stopped(
    trained_run, tmp_path, monkeypatch, name
):
    """Ctrl-C after two chunks of a file: the chunks are kept beside the output, and the same command
    does only the rest and writes what an uninterrupted run writes (samples drawn by line number,
    n-best rows numbered over the whole file), in smaller batches too (there a score may move in its
    last printed digit); other settings begin again."""
    from seq2seq.cli import file_translation, output_chunks

    _, _, run_dir, data = trained_run
    options, method, done = RESUMABLE[name]
    subcommand, *options = (option.format(src=data / "test.en", tgt=data / "test.xx") for option in options)
    command = [subcommand, "-c", run_dir, *options]
    monkeypatch.setattr(file_translation, "FILE_CHUNK_LINES", 7)  # 30 lines: 5 chunks
    worked, real = [], getattr(file_translation.Translator, method)

    def counting(self, lines, *args, **kwargs):
        worked.append(len(lines))
        return real(self, lines, *args, **kwargs)

    monkeypatch.setattr(file_translation.Translator, method, counting)
    whole = invoke(*command, "-o", tmp_path / "whole.txt")
    assert whole.exit_code == 0, whole.output
    saves, real_save = [], output_chunks.OutputChunks.save

    def stopped_at_the_third(self, index, text):
        saves.append(index)
        if len(saves) == 3:
            raise KeyboardInterrupt
        real_save(self, index, text)

    monkeypatch.setattr(output_chunks.OutputChunks, "save", stopped_at_the_third)
    out, kept = tmp_path / "out.txt", tmp_path / ".out.txt.partial"
    stopped = invoke(*command, "-o", out)
    assert stopped.exit_code == 130 and not out.exists()
    assert (
        stopped.stderr.splitlines()[-1]
        == f"interrupted; the first 14 {done} are kept in {kept}: the same command continues"
    )
    monkeypatch.setattr(output_chunks.OutputChunks, "save", real_save)
    worked.clear()
    resumed = invoke(*command, "--set", "decode.batch_tokens=64", "-o", out)  # as after running out of memory
    assert resumed.exit_code == 0, resumed.output
    assert worked == [7, 7, 2] and f"kept the first 14 {done} before" in resumed.stderr
    assert_same_output(out.read_text(), (tmp_path / "whole.txt").read_text())
    assert not kept.exists()
    if name == "nbest":
        assert {int(row.split(" ||| ")[0]) for row in out.read_text().splitlines()} == set(range(30))

    monkeypatch.setattr(output_chunks.OutputChunks, "save", stopped_at_the_third)
    saves.clear()
    assert invoke(*command, "-o", tmp_path / "other.txt").exit_code == 130
    monkeypatch.setattr(output_chunks.OutputChunks, "save", real_save)
    worked.clear()
    again = invoke(*command, "--set", "decode.length_norm=none", "-o", tmp_path / "other.txt")  # other settings
    assert again.exit_code == 0 and worked == [7, 7, 7, 7, 2], again.output
    assert "of other models, input or settings; starting again" in again.stderr


def test_a_translation_refuses_a_partial_folder_it_did_not_make(trained_run, tmp_path):
    _, _, run_dir, data = trained_run
    theirs = tmp_path / ".out.txt.partial"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    result = invoke("translate", "-c", run_dir, "-i", data / "test.en", "-o", tmp_path / "out.txt")
    assert_user_error(result, f"{theirs}: exists and is not a partial output seq2seq made")
    assert (theirs / "notes.txt").read_text() == "mine" and not (tmp_path / "out.txt").exists()


def test_translate_from_stdin_and_files_with_nbest(trained_run, tmp_path):
    _, _, run_dir, data = trained_run
    checkpoint = run_dir / "checkpoints" / "last.pt"
    result = invoke("translate", "-c", checkpoint, input="the cat sleeps\n\nthe dogs see a tree\n")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 3 and lines[1] == ""  # order kept, empty line stays empty
    out = tmp_path / "out.txt"
    result = invoke("translate", "-c", checkpoint, "-i", data / "test.en", "-o", out, "--beam", "3", "--nbest", "2")
    assert result.exit_code == 0, result.output
    rows = [line.split(" ||| ") for line in out.read_text().splitlines()]
    assert len(rows) == 2 * 30 and {int(r[0]) for r in rows} == set(range(30))
    assert "30/30" in result.stderr  # a file's bar knows its end
    streamed = invoke("translate", "-c", checkpoint, "--stream", "--beam", "1", input="the cat sleeps\n")
    assert (
        streamed.stdout.splitlines()
        == invoke("translate", "-c", checkpoint, "--beam", "1", input="the cat sleeps\n").stdout.splitlines()
    )


def test_translate_with_prefixes_constraints_a_glossary_and_an_ensemble(trained_run, tmp_path):
    """What a user runs: per-line prefixes and constraints, a CAT-tool glossary (one term the model
    never says: a made-up word of single characters), and two checkpoints as an ensemble."""
    _, _, run_dir, data = trained_run
    checkpoint = run_dir / "checkpoints" / "last.pt"
    sources = (data / "test.en").read_text(encoding="utf-8").splitlines()[:8]
    (tmp_path / "in.en").write_text("".join(line + "\n" for line in sources), encoding="utf-8")
    prefixes = ["la par", "", "il", "", "", "", "", ""]
    (tmp_path / "prefixes.txt").write_text("".join(p + "\n" for p in prefixes), encoding="utf-8")
    constraints = ["mofosa\tnugati", "", "", "zucatar", "", "", "", ""]
    (tmp_path / "constraints.txt").write_text("".join(c + "\n" for c in constraints), encoding="utf-8")
    (tmp_path / "terms.tsv").write_text("# en\txx\nthe\tqzqzq\n", encoding="utf-8")
    result = invoke("translate", "-c", checkpoint, "-i", tmp_path / "in.en", "--prefix", tmp_path / "prefixes.txt",
                    "--constraints", tmp_path / "constraints.txt", "--glossary", tmp_path / "terms.tsv")  # fmt: skip
    assert result.exit_code == 0, result.output
    outputs = result.stdout.splitlines()
    assert len(outputs) == 8
    for source, output, prefix, phrases in zip(sources, outputs, prefixes, constraints):
        assert output.startswith(prefix)
        wanted = [*filter(None, phrases.split("\t")), *(["qzqzq"] if "the" in source.split() else [])]
        assert all(word in output.split() for word in wanted), (wanted, output)
    assert any("qzqzq" in output.split() for output in outputs)
    ensemble = invoke("translate", "-c", checkpoint, "-c", run_dir / "checkpoints" / "best.pt", "-i",
                      tmp_path / "in.en", "--beam", "2")  # fmt: skip
    assert ensemble.exit_code == 0 and len(ensemble.stdout.splitlines()) == 8
    (tmp_path / "short.txt").write_text("la\n", encoding="utf-8")
    short = invoke("translate", "-c", checkpoint, "-i", tmp_path / "in.en", "--prefix", tmp_path / "short.txt")
    assert_user_error(short, "short.txt: ends before line 2", "one guidance line per input line")
    (tmp_path / "bad.tsv").write_text("term only\n", encoding="utf-8")
    bad = invoke("translate", "-c", checkpoint, "-i", tmp_path / "in.en", "--glossary", tmp_path / "bad.tsv")
    assert_user_error(bad, "bad.tsv:1: expected 'source term<TAB>target term'")
    sampled = invoke("translate", "-c", checkpoint, "-i", tmp_path / "in.en", "--constraints",
                     tmp_path / "constraints.txt", "--set", "decode.sample=true")  # fmt: skip
    assert_user_error(sampled, "constraints need beam search")


@contextlib.contextmanager
def piped(path: Path, text: str) -> Iterator[Path]:
    """`path` as a named pipe that a writer fills with `text` once a reader opens it: what a command
    is handed for the shell's process substitution, `--src <(zcat corpus.gz)`."""
    os.mkfifo(path)

    def write() -> None:
        with open(path, "w", encoding="utf-8") as pipe:  # returns once the command opens it
            pipe.write(text)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield path
    finally:
        if writer.is_alive():  # the command never opened it, or the writer is finishing
            # a reader that never blocks: a blocking open waited forever for a writer that had already
            # written and let go of the pipe; the texts here fit in the pipe's buffer
            reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            writer.join()
            os.close(reader)
        writer.join()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_pipes_as_inputs_are_read_once_and_give_the_files_results(trained_run, tmp_path):
    """A pipe can be read once: translate and score-pairs read it as they read stdin, where they read
    a file twice (a check of every line, then the work). score-pairs printed nothing and exited 0 when
    its second read found the pipes empty; translate called a pipe "file not found"."""
    _, _, run_dir, data = trained_run
    checkpoint = run_dir / "checkpoints" / "last.pt"
    src, tgt = data / "test.en", data / "test.xx"
    with piped(tmp_path / "src", src.read_text(encoding="utf-8")) as source:
        translated = invoke("translate", "-c", checkpoint, "-i", source, "--beam", "2")
    assert translated.exit_code == 0, translated.output
    assert translated.stdout == invoke("translate", "-c", checkpoint, "-i", src, "--beam", "2").stdout
    scored_files = invoke("score-pairs", "-c", checkpoint, "--src", src, "--tgt", tgt)
    assert scored_files.exit_code == 0 and len(scored_files.stdout.splitlines()) == 30
    with (
        piped(tmp_path / "s", src.read_text(encoding="utf-8")) as source,
        piped(tmp_path / "t", tgt.read_text(encoding="utf-8")) as target,
    ):
        scored = invoke("score-pairs", "-c", checkpoint, "--src", source, "--tgt", target)
    assert scored.exit_code == 0 and scored.stdout == scored_files.stdout
    short = "".join(line + "\n" for line in tgt.read_text(encoding="utf-8").splitlines()[:29])
    with piped(tmp_path / "short", short) as target:
        refused = invoke("score-pairs", "-c", checkpoint, "--src", src, "--tgt", target)
    assert_user_error(refused, "short: ends before line 30 of", "expected one target per source")
    prefixes = "la\n" + "\n" * 29
    (tmp_path / "prefixes.txt").write_text(prefixes, encoding="utf-8")
    with piped(tmp_path / "prefixes", prefixes) as piped_prefixes:
        guided = invoke("translate", "-c", checkpoint, "-i", src, "--prefix", piped_prefixes)
    assert guided.exit_code == 0, guided.output
    assert (
        guided.stdout == invoke("translate", "-c", checkpoint, "-i", src, "--prefix", tmp_path / "prefixes.txt").stdout
    )


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_an_output_that_is_a_pipe_or_device_is_written_into_not_replaced(trained_run, tmp_path):
    """`-o /dev/null`, `-o >(gzip > out.gz)`, `-o /dev/stdout >> log.txt`: a stream takes the output as
    it comes. Outputs are written to a temporary file and renamed into place, which would replace the
    device or pipe with a regular file (it once replaced /dev/null), so streams were refused as
    "already exists", and so was the file a shell opened for the command's own stdout."""
    _, _, run_dir, data = trained_run
    checkpoint = run_dir / "checkpoints" / "last.pt"
    expected = invoke("translate", "-c", checkpoint, "-i", data / "test.en", "--beam", "1").stdout
    pipe, received = tmp_path / "out", []
    os.mkfifo(pipe)

    def read() -> None:
        with open(pipe, encoding="utf-8") as reader:  # returns once the command opens it to write
            received.append(reader.read())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        result = invoke("translate", "-c", checkpoint, "-i", data / "test.en", "--beam", "1", "-o", pipe)
    finally:
        if reader.is_alive() and not received:  # the command never opened it: a writer here lets the reader end
            with open(pipe, "w", encoding="utf-8"):
                pass
        reader.join()
    assert result.exit_code == 0, result.output
    assert received == [expected] and stat.S_ISFIFO(os.stat(pipe).st_mode)
    scored = invoke("score-pairs", "-c", checkpoint, "--src", data / "test.en", "--tgt", data / "test.xx",
                    "-o", os.devnull)  # fmt: skip
    assert scored.exit_code == 0, scored.output
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    log = tmp_path / "log.txt"  # `-o /dev/stdout >> log.txt`: a descriptor the shell opened on a file
    log.write_text("kept\n", encoding="utf-8")
    with open(log, "ab") as redirected:
        result = invoke("translate", "-c", checkpoint, "-i", data / "test.en", "--beam", "1", "-o",
                        f"/dev/fd/{redirected.fileno()}")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert log.read_text(encoding="utf-8") == "kept\n" + expected


def test_outputs_named_gz_are_gzip_files_that_the_commands_read_back(trained_run, tmp_path):
    """Every command reads a file named .gz as gzip; translate -o, score-pairs -o and eval --hyps
    wrote plain text under such a name, which `score --hyp out.gz` then refused as not gzip."""
    _, _, run_dir, data = trained_run
    checkpoint = run_dir / "checkpoints" / "last.pt"
    src, tgt = data / "test.en", data / "test.xx"
    expected = invoke("translate", "-c", checkpoint, "-i", src, "--beam", "1").stdout
    translated = invoke("translate", "-c", checkpoint, "-i", src, "--beam", "1", "-o", tmp_path / "out.gz")
    assert translated.exit_code == 0, translated.output
    assert gzip.decompress((tmp_path / "out.gz").read_bytes()).decode("utf-8") == expected
    (tmp_path / "out.txt").write_text(expected, encoding="utf-8")
    scored = [
        invoke("score", "--hyp", tmp_path / name, "--ref", tgt, "--metrics", "bleu") for name in ("out.gz", "out.txt")
    ]
    assert scored[0].exit_code == 0 and scored[0].stdout == scored[1].stdout
    evaluated = invoke("eval", "-c", checkpoint, "--src", src, "--ref", tgt, "--beam", "1", "--hyps", tmp_path / "h.gz")
    assert evaluated.exit_code == 0, evaluated.output
    assert gzip.decompress((tmp_path / "h.gz").read_bytes()).decode("utf-8") == expected
    pairs = invoke("score-pairs", "-c", checkpoint, "--src", src, "--tgt", tgt, "-o", tmp_path / "pairs.gz")
    assert pairs.exit_code == 0, pairs.output
    assert (
        gzip.decompress((tmp_path / "pairs.gz").read_bytes()).decode("utf-8")
        == invoke("score-pairs", "-c", checkpoint, "--src", src, "--tgt", tgt).stdout
    )


def test_eval_prints_signatures_and_writes_json(trained_run, tmp_path):
    _, _, run_dir, data = trained_run
    report = tmp_path / "report.json"
    result = invoke(
        "eval",
        "-c",
        run_dir / "checkpoints" / "best.pt",
        "--src",
        data / "test.en",
        "--ref",
        data / "test.xx",
        "--json",
        report,
        "--beam",
        "1",
        "--hyps",
        tmp_path / "hyps.txt",
    )
    assert result.exit_code == 0, result.output
    assert "BLEU = " in result.stdout and "nrefs:1|case:mixed" in result.stdout and "chrF2 = " in result.stdout
    parsed = json.loads(report.read_text())
    assert (
        parsed["sentences"] == 30 and parsed["beam"] == 1 and [s["name"] for s in parsed["scores"]] == ["BLEU", "chrF2"]
    )
    bleu = parsed["scores"][0]
    hypotheses = (tmp_path / "hyps.txt").read_text(encoding="utf-8").splitlines()
    references = (data / "test.xx").read_text(encoding="utf-8").splitlines()
    expected = sacrebleu.corpus_bleu(hypotheses, [references])  # the report is sacrebleu's figure, on its hypotheses
    assert bleu["score"] == pytest.approx(expected.score) and bleu["precisions"] == pytest.approx(
        expected.precisions, abs=1e-3
    )
    shorter = invoke("eval", "-c", run_dir / "checkpoints" / "best.pt", "--src", data / "test.en", "--ref",
                     data / "test.xx", "--beam", "1", "--set", "decode.max_len_a=0", "--set", "decode.max_len_b=2",
                     "--hyps", tmp_path / "short.txt", "--json", tmp_path / "short.json")  # fmt: skip
    assert shorter.exit_code == 0, shorter.output  # eval takes --set decode.KEY=VALUE, as translate does
    assert max(len(line.split()) for line in (tmp_path / "short.txt").read_text().splitlines()) <= 2
    settings = json.loads((tmp_path / "short.json").read_text())["decode"]  # the report says how it translated
    assert (settings["beam"], settings["max_len_a"], settings["max_len_b"]) == (1, 0.0, 2)
    assert bleu["signature"] in result.stdout


def test_average_plot_and_attention_plot(trained_run, tmp_path):
    _, _, run_dir, _ = trained_run
    steps = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    result = invoke("average", *steps, "-o", tmp_path / "avg.pt")
    assert result.exit_code == 0, result.output
    assert result.stdout == f"averaged {len(steps)} checkpoints -> {tmp_path / 'avg.pt'}\n" and len(steps) > 1
    result = invoke("average", steps[0], "-o", tmp_path / "one.pt")
    assert result.stdout == f"averaged 1 checkpoint -> {tmp_path / 'one.pt'}\n"
    result = invoke("average", run_dir, "-o", tmp_path / "run.pt")  # a run directory: its numbered checkpoints
    assert (
        result.exit_code == 0 and f"averaged {len(steps)} checkpoints ({', '.join(map(str, steps))})" in result.stdout
    )
    explicit, whole_run = Checkpoint.load(tmp_path / "avg.pt").model, Checkpoint.load(tmp_path / "run.pt").model
    assert all(torch.equal(explicit[name], whole_run[name]) for name in explicit)
    result = invoke("average", run_dir, "--last", "1", "-o", tmp_path / "newest.pt")  # the newest save alone
    assert result.exit_code == 0 and f"averaged 1 checkpoint ({steps[-1]})" in result.stdout
    newest, averaged = Checkpoint.load(steps[-1]).model, Checkpoint.load(tmp_path / "newest.pt").model
    assert all(torch.equal(averaged[name], newest[name]) for name in newest)
    assert not all(torch.equal(averaged[name], explicit[name]) for name in explicit)
    result = invoke("plot", run_dir)
    assert result.exit_code == 0, result.output
    for name in ("loss", "bleu", "lr", "memory"):
        assert (run_dir / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    train_records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in (r for r in train_records if r["kind"] == "train"):
        assert 0 < r["rss_mb"] <= r["window_peak_rss_mb"]
        if "cuda_reserved_mb" in r:  # the peak is then the GPU's: its allocator's peak allocated
            assert 0 < r["cuda_allocated_mb"] <= min(r["cuda_reserved_mb"], r["peak_memory_mb"])
        else:
            assert r["window_peak_rss_mb"] <= r["peak_memory_mb"]
    result = invoke(
        "translate", "-c", tmp_path / "avg.pt", "--attention-plot", tmp_path / "att", input="the cat sleeps\n"
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "att" / "attention_1.png").read_bytes()[:4] == b"\x89PNG"


def test_bad_config_key_exits_2_with_one_line(trained_run, tmp_path):
    _, config, _, _ = trained_run
    raw = yaml.safe_load(config.read_text())
    raw["model"]["d_modle"] = 64
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    assert_user_error(
        invoke("train", bad, "--run-dir", tmp_path / "r"), str(bad), "model.d_modle", "did you mean 'model.d_model'"
    )
    assert_user_error(
        invoke("train", config, "--run-dir", tmp_path / "r", "--set", "model.heads=5"),
        "model.d_model",
        "multiple of heads",
    )
    assert_user_error(invoke("train", config, "--set", "train.warmup_steps=-5"), "--set train.warmup_steps", ">= 0")


def test_bad_data_exits_2_naming_file_and_line(trained_run, tmp_path):
    _, config, _, data = trained_run
    broken = tmp_path / "broken.en"
    broken.write_bytes((data / "train.en").read_bytes().replace(b"cat", b"c\xfft", 1))
    line = next(n for n, text in enumerate(broken.read_bytes().splitlines(), 1) if b"\xff" in text)
    result = invoke("train", config, "--run-dir", tmp_path / "r", "--set", f"data.train.src={broken}")
    assert_user_error(result, f"{broken}:{line}: not valid UTF-8")
    short = tmp_path / "short.xx"
    short.write_text("one line\n")
    result = invoke("train", config, "--run-dir", tmp_path / "r2", "--set", f"data.train.tgt={short}")
    assert_user_error(result, "has 2000 lines but", "has 1")


def test_a_run_refused_for_its_validation_data_leaves_no_run_directory(trained_run, tmp_path):
    """The validation split is read before anything is written: the refused run leaves nothing to tidy."""
    _, config, _, _ = trained_run
    short = tmp_path / "short.xx"
    short.write_text("one line\n")
    run_dir = tmp_path / "runs" / "refused"
    result = invoke("train", config, "--run-dir", run_dir, "--set", f"data.valid.tgt={short}")
    assert_user_error(result, "data.valid", "has 1")
    assert not run_dir.parent.exists()


def test_a_run_directory_in_use_is_refused_to_a_second_training(trained_run, tmp_path):
    """A second `train` in a run directory whose training is still going (a --resume typed in another
    terminal) would write its checkpoints over the first's: it is refused before anything is written."""
    from seq2seq.training.run_dir import RunDir

    _, config, run_dir, _ = trained_run
    before = {path: path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file()}
    with RunDir(run_dir).held():  # stands for the training that still runs there
        result = invoke("train", config, "--resume", run_dir, "--set", "train.max_steps=40")
        assert_user_error(result, f"{run_dir}: another seq2seq process is working in this run directory")
        fresh = tmp_path / "fresh"
        with RunDir(fresh).held():
            assert_user_error(invoke("train", config, "--run-dir", fresh), "another seq2seq process is working")
            assert_user_error(invoke("tokenizer", "train", config, "--run-dir", fresh), "another seq2seq process")
    after = {path: path.read_bytes() for path in sorted(run_dir.rglob("*")) if path.is_file()}
    assert after == before
    assert [path.name for path in fresh.iterdir()] == []


def test_run_directory_and_checkpoint_errors(trained_run, tmp_path):
    _, config, run_dir, data = trained_run
    assert_user_error(invoke("train", config, "--run-dir", run_dir), "pass --resume")
    assert_user_error(invoke("train", config, "--resume", tmp_path / "nothing"), "no checkpoint to resume from")
    assert_user_error(invoke("translate", "-c", tmp_path / "missing.pt", input="x\n"), "checkpoint not found")
    not_a_checkpoint = tmp_path / "junk.pt"
    not_a_checkpoint.write_text("junk")
    assert_user_error(invoke("translate", "-c", not_a_checkpoint, input="x\n"), "not a readable seq2seq checkpoint")
    assert_user_error(
        invoke("translate", "-c", run_dir / "checkpoints" / "last.pt", "--set", "train.lr=1", input="x\n"),
        "only decode.* keys",
    )
    assert_user_error(
        invoke(
            "eval", "-c", run_dir / "checkpoints" / "last.pt", "--src", data / "test.en", "--ref", data / "train.xx"
        ),
        "train.xx has 2000 lines but",
        "test.en has 30",
    )


def test_missing_config_file_exits_2():
    assert_user_error(invoke("train", Path("no/such/config.yaml")), "config file not found")


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        ("model.d_model=wide", ["--set model.d_model", "expected an integer, got 'wide'"]),
        ("model.activation=tanh", ["--set model.activation", "expected one of relu, gelu; got 'tanh'"]),
        ("data.train.src=/no/such/file.en", ["--set data.train.src: file not found: /no/such/file.en"]),
        pytest.param(
            "train.precision=fp16",
            ["train.precision: fp16 needs a CUDA GPU"],
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is valid where CUDA is present"),
        ),
    ],
)
def test_each_kind_of_config_error_exits_2_with_its_message(trained_run, tmp_path, override, fragments):
    _, config, _, _ = trained_run
    assert_user_error(invoke("train", config, "--run-dir", tmp_path / "r", "--set", override), *fragments)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the case of a machine where torch sees no GPU")
def test_a_device_that_is_not_here_or_not_a_device_is_one_line(trained_run, tmp_path):
    checkpoint = trained_run[2] / "checkpoints" / "last.pt"
    src = tmp_path / "src.en"
    src.write_text("the cat\n")
    for command in (
        ["translate", "-c", checkpoint, "-i", src],
        ["score-pairs", "-c", checkpoint, "--src", src, "--tgt", src],
        ["eval", "-c", checkpoint, "--src", src, "--ref", src],
        ["serve", checkpoint, "--port", str(free_port())],
    ):
        assert_user_error(invoke(*command, "--device", "cuda"), "device cuda: torch sees no CUDA GPU here")
    assert_user_error(invoke("translate", "-c", checkpoint, "-i", src, "--device", "cuda:1"), "device cuda:1: torch")
    for name in ("tpu", "cuda:x", "cpu:0", "cuda:-1", "gpu"):
        result = invoke("translate", "-c", checkpoint, "-i", src, "--device", name)
        assert result.exit_code == 2 and f"device '{name}': expected cpu, cuda or cuda:N" in result.stderr, name
    assert invoke("translate", "-c", checkpoint, "-i", src, "--device", "cpu").exit_code == 0


def test_demo_refuses_a_run_directory_it_did_not_make(tmp_path, monkeypatch):
    """`demo --run-dir DIR` used to delete DIR whatever it held; now a non-demo directory is refused
    before any work (not even the demo corpus is written) and the user's file stays."""
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    result = invoke("demo", "--run-dir", str(mine), "--set", "train.max_steps=1")
    assert_user_error(result, f"--run-dir {mine}: not empty and not made by `seq2seq demo`")
    assert (mine / "notes.txt").read_text() == "keep"
    assert not (tmp_path / "data").exists()


def test_demo_leaves_a_run_the_user_trained_on_the_demo_config(tmp_path, monkeypatch):
    """`seq2seq train configs/demo.yaml` writes runs/demo, the demo's default directory: its config
    trains on data/demo like a demo run's, but the run is the user's and the demo must not replace it."""
    monkeypatch.chdir(tmp_path)
    users_run = tmp_path / "runs" / "demo"
    (users_run / "checkpoints").mkdir(parents=True)
    (users_run / "config.yaml").write_text("data:\n  train: {src: data/demo/train.en, tgt: data/demo/train.xx}\n")
    (users_run / "checkpoints" / "step_00002000.pt").write_bytes(b"two thousand steps of the user's training")
    assert_user_error(invoke("demo", "--set", "train.max_steps=1"), "--run-dir runs/demo: not empty and not made")
    assert (users_run / "checkpoints" / "step_00002000.pt").read_bytes().startswith(b"two thousand")


def test_demo_leaves_other_text_in_its_data_folder(tmp_path, monkeypatch):
    """The demo writes its corpus to data/demo/ under the current folder: a user's file of that name
    is refused before any work, while an earlier demo's corpus is written again."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data" / "demo"
    data.mkdir(parents=True)
    (data / "train.en").write_text("the user's own sentences\n")
    result = invoke("demo", "--run-dir", "fresh", "--set", "train.max_steps=1")
    assert_user_error(result, "data/demo/train.en: exists and is not the demo's corpus")
    assert (data / "train.en").read_text() == "the user's own sentences\n"
    assert not (tmp_path / "fresh").exists() and not (data / "train.xx").exists()


def test_demo_replaces_only_its_own_corpus(tmp_path):
    from seq2seq.cli.demo import _check_data_dir
    from seq2seq.data.demo_data import demo_corpus_files, write_demo_corpus

    files = demo_corpus_files()
    _check_data_dir(tmp_path / "new", files)
    write_demo_corpus(tmp_path / "earlier")
    _check_data_dir(tmp_path / "earlier", files)  # the same bytes
    (tmp_path / "earlier" / "valid.xx").write_text("edited\n")
    with pytest.raises(UserInputError, match="valid.xx: exists and is not the demo's corpus"):
        _check_data_dir(tmp_path / "earlier", files)


def test_demo_leaves_an_earlier_demo_run_that_is_still_training(tmp_path, monkeypatch):
    """An earlier demo's directory is the demo's to replace, but not while a process trains in it
    (another demo, or `train --resume` continuing it): refused before any work, every file kept."""
    from seq2seq.cli.demo import DEMO_MARKER
    from seq2seq.training.run_dir import RunDir

    monkeypatch.chdir(tmp_path)
    earlier = tmp_path / "runs" / "demo"
    (earlier / "checkpoints").mkdir(parents=True)
    (earlier / DEMO_MARKER).write_text("demo")
    (earlier / "checkpoints" / "last.pt").write_bytes(b"the training still running here")
    with RunDir(earlier).held():  # stands for the training that still runs there
        result = invoke("demo", "--set", "train.max_steps=1")
    assert_user_error(result, "runs/demo: another seq2seq process is working in this run directory")
    assert (earlier / "checkpoints" / "last.pt").read_bytes() == b"the training still running here"
    assert not (tmp_path / "data").exists()


def test_demo_replaces_only_its_own_runs(tmp_path):
    from seq2seq.cli.demo import DEMO_MARKER, _check_run_dir

    assert _check_run_dir(tmp_path / "new") is False
    assert _check_run_dir(tmp_path) is False  # empty
    (tmp_path / DEMO_MARKER).write_text("demo")
    (tmp_path / "train.log").write_text("")
    assert _check_run_dir(tmp_path) is True


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path):
    """`seq2seq ... | head -1`: once the reader has gone, the command stops without an error message."""
    hyps = tmp_path / "hyps.txt"
    hyps.write_text("a cat\n" * 10)
    command = [sys.executable, "-m", "seq2seq", "score", "--hyp", str(hyps), "--ref", str(hyps)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.stdout.close()  # the reader is gone before the first result is written
    stderr = process.stderr.read()
    assert process.wait() == 141 and stderr == ""


GATED_TRANSLATE = """
import pathlib, sys, time
from seq2seq.inference import pytorch_engine
gate = pathlib.Path(sys.argv[1])
def held(self, *args, **kwargs):  # tell the test the translation has begun, then wait to be stopped
    (gate / "entered").touch()
    while True:
        time.sleep(0.01)
pytorch_engine.PyTorchEngine.translate = held
from seq2seq.cli.main import main
sys.argv = ["seq2seq", "translate", *sys.argv[2:]]
main()
"""


def test_sigterm_ends_a_translation_without_a_half_written_output(trained_checkpoint, tmp_path):
    """SIGTERM (a `timeout`, a container that stops) once the translation has begun: the command ends
    through its error boundary, exit 143 and one line, and the output it was writing is neither there
    nor left half-written under a temporary name (the default action left `.out.txt.tmp-HOST-PID`)."""
    import signal
    import time

    source = tmp_path / "source.txt"
    source.write_text("the cat sleeps\n")
    command = [sys.executable, "-c", GATED_TRANSLATE, str(tmp_path), "-c", trained_checkpoint[0], "-i", source,
               "-o", tmp_path / "out.txt"]  # fmt: skip
    process = subprocess.Popen([str(part) for part in command], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not (tmp_path / "entered").exists():  # the event: the translation has begun
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    stderr = process.communicate(timeout=60)[1]
    assert process.returncode == 143 and stderr.splitlines()[-1] == "interrupted", stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["entered", "source.txt"]


def test_an_interrupted_command_says_what_it_leaves(trained_checkpoint, tiny_config_file, tmp_path, monkeypatch):
    """Ctrl-C: a training keeps its last checkpoint and says how to go on, or, stopped before its first
    one, how to start again (it said to --resume, which then found nothing to resume from); a
    translation has nothing half-written to tell of (it said "the last checkpoint is kept", as if it
    were a training)."""
    from seq2seq.inference import pytorch_engine
    from seq2seq.training.trainer import Trainer

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def interrupted_after_a_save(trainer):
        trainer._save()
        raise KeyboardInterrupt

    monkeypatch.setattr(pytorch_engine.PyTorchEngine, "translate", interrupted)
    translation = invoke("translate", "-c", trained_checkpoint[0], input="the cat\n")
    assert translation.exit_code == 130 and translation.stderr.splitlines()[-1] == "interrupted"
    train = f"seq2seq train {tiny_config_file}"
    for run, stop, hint in (
        ("early", interrupted, f"no checkpoint yet: start again with `{train} --run-dir {tmp_path / 'early'}`"),
        ("saved", interrupted_after_a_save, f"the last checkpoint is kept: continue with `{train} --resume "
                                            f"{tmp_path / 'saved'}`"),
    ):  # fmt: skip
        monkeypatch.setattr(Trainer, "run", stop)
        training = invoke("train", tiny_config_file, "--run-dir", tmp_path / run, "--set", "train.max_steps=9")
        assert training.exit_code == 130
        assert training.stderr.splitlines()[-1] == f"interrupted; {hint} with the same --set options"

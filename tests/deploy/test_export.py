"""CTranslate2 export: the parity gate passes for a faithful export and stops a wrong one; the exported
model translates like the checkpoint through the Python API and the CLI; bad input is one line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

pytest.importorskip("ctranslate2", reason="optional extra: pip install -e '.[export]' (included in [dev])")

from seq2seq.cli.main import app  # noqa: E402
from seq2seq.deploy import export as export_module  # noqa: E402
from seq2seq.errors import UserInputError  # noqa: E402
from seq2seq.inference.engine import EXPORT_METADATA  # noqa: E402
from seq2seq.inference.translator import Translator  # noqa: E402

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def checkpoint(trained_checkpoint):
    return trained_checkpoint


@pytest.fixture(scope="module")
def exported_model(trained_checkpoint, tmp_path_factory):
    """(our Translator, the float32 export's Translator, 60 test lines) of the half-trained model."""
    path, data = trained_checkpoint
    directory = tmp_path_factory.mktemp("exported") / "model"
    export_module.export_checkpoint(path, directory)
    lines = (data / "test.en").read_text(encoding="utf-8").splitlines()
    return Translator.load(path), Translator.load(directory), lines


def test_float32_export_passes_the_gate_and_translates_like_the_checkpoint(checkpoint, tmp_path):
    path, data = checkpoint
    result = invoke("export", path, "-o", tmp_path / "model")
    assert result.exit_code == 0, result.output
    assert "greedy outputs identical on 100.0%" in result.stdout
    metadata = json.loads((tmp_path / "model" / EXPORT_METADATA).read_text())
    assert metadata["parity"]["passed"] and metadata["step"] == 60 and metadata["tgt_lang"] == "xx"
    lines = (data / "test.en").read_text().splitlines()[:20] + [""]
    ours, exported = Translator.load(path), Translator.load(tmp_path / "model")
    assert (ours.engine, exported.engine) == ("pytorch", "ctranslate2")
    assert exported.translate(lines, beam=1) == ours.translate(lines, beam=1)
    assert exported.translate(lines)[-1] == ""  # an empty line stays empty
    nbest = exported.translate_nbest(lines[:3], beam=3, nbest=2)
    assert [len(t.nbest) for t in nbest] == [2, 2, 2]
    assert all(a[1] >= b[1] for a, b in (t.nbest for t in nbest))  # best first
    cli = invoke("translate", "-c", tmp_path / "model", "-i", data / "test.en", "--beam", "1")
    assert cli.exit_code == 0 and cli.stdout.splitlines()[:20] == ours.translate(lines[:20], beam=1)


@pytest.mark.parametrize(
    "settings",
    [{}, {"patience": 1.0}, {"patience": 3.0, "nbest": 3}, {"length_norm": "average"}, {"length_norm": "none"},
     {"length_penalty": 0.6}, {"beam": 1}],
    ids=["defaults", "patience-1", "patience-3-nbest-3", "average", "none", "power-0.6", "greedy"],
)  # fmt: skip
def test_both_engines_run_one_beam_search(exported_model, settings):
    """The same search in both engines: every n-best list equal, hypothesis for hypothesis (up to
    ties), and its scores within float tolerance, on the half-trained model (an unsure model, whose
    searches branch and stop in many ways). The settings cover the stopping rule (patience) and every ranking."""
    ours, exported, lines = exported_model
    decode = ours.settings(**{"beam": 5, **settings})
    mine, theirs = ours.translate_with(lines, decode), exported.translate_with(lines, decode)
    for a, b in zip(mine, theirs):
        assert_same_ranking(a.nbest, b.nbest)


SCORE_RTOL = 1e-3  # the engines' float differences: CTranslate2's search scores differ from ours by ~2e-4


def assert_same_ranking(mine: list[tuple[str, float]], theirs: list[tuple[str, float]]) -> None:
    """One n-best list, rank for rank, with scores equal within SCORE_RTOL; two hypotheses whose
    scores tie within it may trade ranks, or trade the last place (the other one falls off the list)."""
    assert len(mine) == len(theirs)
    np.testing.assert_allclose([s for _, s in theirs], [s for _, s in mine], rtol=SCORE_RTOL)
    for rank, ((text, score), (other, other_score)) in enumerate(zip(mine, theirs)):
        if text == other:
            continue
        for hypothesis, score_here, in_list, seen_in in (
            (text, score, mine, theirs),
            (other, other_score, theirs, mine),
        ):
            ties = [s for t, s in seen_in if t == hypothesis]
            if ties:
                assert ties[0] == pytest.approx(score_here, rel=SCORE_RTOL), (rank, mine, theirs)
            else:  # the list was cut between two tied hypotheses
                assert rank == len(in_list) - 1, (rank, mine, theirs)


def test_int8_export_reports_its_bleu_change(checkpoint, tmp_path):
    path, _ = checkpoint
    result = invoke("export", path, "-o", tmp_path / "int8", "--quantization", "int8", "--max-bleu-drop", "100")
    assert result.exit_code == 0, result.output
    assert "parity (int8" in result.stdout and "BLEU" in result.stdout
    assert json.loads((tmp_path / "int8" / EXPORT_METADATA).read_text())["quantization"] == "int8"


def test_a_wrong_export_is_caught_and_leaves_nothing(checkpoint, tmp_path, monkeypatch):
    path, _ = checkpoint
    faithful = export_module.build_spec

    def scrambled(checkpoint):  # every output row answers for its neighbour's token
        spec = faithful(checkpoint)
        spec.decoder.projection.weight = np.roll(spec.decoder.projection.weight, 1, axis=0)
        return spec

    monkeypatch.setattr(export_module, "build_spec", scrambled)
    result = invoke("export", path, "-o", tmp_path / "wrong")
    assert result.exit_code == 1
    assert "export refused: greedy outputs identical on" in result.stderr and "Traceback" not in result.output
    assert not any(tmp_path.iterdir())  # neither the model nor its staging folder


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--quantization", "int4"], "--quantization int4: expected one of float32, int8"),
        (["--format", "onnx"], "--format onnx: expected ctranslate2"),
        (["--check-src", "README.md"], "--check-src and --check-ref go together"),
    ],
)
def test_bad_export_options_are_one_line(checkpoint, tmp_path, args, fragment):
    path, _ = checkpoint
    result = invoke("export", path, "-o", tmp_path / "model", *args)
    assert result.exit_code == 2 and fragment in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "model").exists()


def test_existing_output_and_foreign_directories_are_refused(checkpoint, tmp_path):
    path, data = checkpoint
    (tmp_path / "taken").mkdir()
    result = invoke("export", path, "-o", tmp_path / "taken")
    assert result.exit_code == 2 and "already exists" in result.stderr
    result = invoke("translate", "-c", data, "-i", data / "test.en")
    assert result.exit_code == 2 and "not an exported model" in result.stderr
    (tmp_path / "taken" / EXPORT_METADATA).write_text(json.dumps({"config": {}, "tokenizer": {}}))
    result = invoke("translate", "-c", tmp_path / "taken", "-i", data / "test.en")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip() == f"error: {tmp_path / 'taken'} (stored config): data: required key is missing"


@pytest.mark.parametrize("settings", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 4, "top_p": 0.9}])
def test_both_engines_sample_from_one_distribution(exported_model, settings):
    """The same seed does not draw the same samples in two engines, so the test compares what they
    draw: 800 samples of one line from each, and the frequency of each first word agrees within 5
    standard deviations of the difference of two binomials (the half-trained model is unsure: its
    first words spread over many choices)."""
    ours, exported, lines = exported_model
    decode = ours.settings(**{"sample": True, "nbest": 200, **settings})
    first_words = {}
    for name, translator in (("ours", ours), ("exported", exported)):
        draws = [text for t in translator.translate_with([lines[3]] * 4, decode) for text, _ in t.nbest]
        assert len(draws) == 800
        first_words[name] = [draw.split(" ")[0] for draw in draws]
    common = {w for w in set(first_words["ours"]) if first_words["ours"].count(w) >= 40}
    assert len(common) >= 2  # the line has several likely first words: the comparison means something
    for word in set(first_words["ours"]) | set(first_words["exported"]):
        p_ours, p_exported = (first_words[name].count(word) / 800 for name in ("ours", "exported"))
        p = (p_ours + p_exported) / 2
        assert abs(p_ours - p_exported) <= 5 * math.sqrt(2 * p * (1 - p) / 800) + 1 / 800, word


def test_epsilon_sampling_on_an_exported_model_is_one_line(exported_model):
    _, exported, lines = exported_model
    with pytest.raises(UserInputError, match="decode.epsilon: CTranslate2 has no epsilon sampling"):
        exported.translate(lines[:1], sample=True, epsilon=0.01)


def test_both_engines_score_given_pairs_alike(exported_model, trained_checkpoint):
    """Force-decoding the test references: the same pieces and per-piece log-probabilities."""
    ours, exported, lines = exported_model
    _, data = trained_checkpoint
    references = (data / "test.xx").read_text(encoding="utf-8").splitlines()
    mine, theirs = ours.score(lines, references), exported.score(lines, references)
    assert [a.pieces for a in mine] == [b.pieces for b in theirs]
    for a, b in zip(mine, theirs):
        np.testing.assert_allclose(b.log_probs, a.log_probs, atol=2e-3)
        assert b.score == pytest.approx(a.score, abs=1e-3)


@pytest.mark.parametrize("settings", [{}, {"beam": 1}, {"nbest": 3}], ids=["beam-5", "greedy", "nbest-3"])
def test_both_engines_continue_a_prefix_alike(exported_model, trained_checkpoint, settings):
    """Each line's reference cut after its first words, and some lines without: both engines keep the
    prefix and return the same n-best lists, scored alike (the chosen tokens over the whole length)."""
    ours, exported, lines = exported_model
    _, data = trained_checkpoint
    references = (data / "test.xx").read_text(encoding="utf-8").splitlines()
    prefixes = [" ".join(ref.split()[: index % 4]) for index, ref in enumerate(references)]
    decode = ours.settings(**{"beam": 5, **settings})
    mine = ours.translate_with(lines, decode, prefixes=prefixes)
    theirs = exported.translate_with(lines, decode, prefixes=prefixes)
    for a, b, prefix in zip(mine, theirs, prefixes):
        assert all(text.startswith(prefix) for text, _ in a.nbest)
        assert_same_ranking(a.nbest, b.nbest)


def test_constraints_and_ensembles_on_an_exported_model_are_one_line(exported_model, checkpoint, tmp_path):
    _, exported, lines = exported_model
    with pytest.raises(UserInputError, match="CTranslate2 has no constrained search"):
        exported.translate(lines[:2], constraints=[["mofos"], []])
    export_module.export_checkpoint(checkpoint[0], tmp_path / "model")
    with pytest.raises(UserInputError, match="an ensemble needs checkpoints"):
        Translator.load([checkpoint[0], tmp_path / "model"])

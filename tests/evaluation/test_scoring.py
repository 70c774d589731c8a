"""`seq2seq score` and `seq2seq eval` print the figures the sacrebleu command line prints on the same files."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from seq2seq.errors import UserInputError
from seq2seq.evaluation.scoring import ScoreOptions, read_text_file, score

HYPOTHESES = ["Él comió una manzana roja.", "El niño está en la escuela", "Ça va très bien, merci!", "it rains"]
REFERENCES = ["Él comió la manzana roja.", "El niño está en la escuela.", "Ça va très bien, merci !", "it is raining"]
SECOND = ["Comió una manzana roja.", "El chico está en la escuela.", "Ça va bien, merci !", "It rains"]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _sacrebleu(hyp: Path, refs: list[Path], *args: str) -> list[dict]:
    """The sacrebleu command line's JSON for each metric, on the same files."""
    command = [sys.executable, "-m", "sacrebleu", *map(str, refs), "-i", str(hyp), "-f", "json", "-w", "4", *args]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    parsed = json.loads(out)
    return parsed if isinstance(parsed, list) else [parsed]


def _ours(tmp_path: Path, hyp: Path, refs: list[Path], *args: str) -> list[dict]:
    report = tmp_path / "report.json"
    command = [sys.executable, "-m", "seq2seq", "score", "--hyp", str(hyp), "--json", str(report), *args]
    for ref in refs:
        command += ["--ref", str(ref)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(report.read_text())["scores"]


CASES = {
    "bleu and chrf": ([], ["-m", "bleu", "chrf"]),
    "chrf++ and ter": (["--metrics", "chrf++,ter"], ["-m", "chrf", "ter", "--chrf-word-order", "2"]),
    "intl tokenizer, lowercase": (
        ["--metrics", "bleu", "--tokenize", "intl", "-lc"],
        ["-m", "bleu", "-tok", "intl", "-lc"],
    ),
    "char tokenizer": (["--metrics", "bleu", "--tokenize", "char"], ["-m", "bleu", "-tok", "char"]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("nfd", [False, True], ids=["nfc", "nfd"])
@pytest.mark.parametrize("references", [1, 2])
def test_same_scores_and_signatures_as_the_sacrebleu_cli(tmp_path: Path, case: str, nfd: bool, references: int):
    form = (lambda text: unicodedata.normalize("NFD", text)) if nfd else (lambda text: text)
    hyp = _write(tmp_path / "hyp.txt", HYPOTHESES)  # NFC hypotheses, as a model writes them
    refs = [_write(tmp_path / f"ref{n}.txt", [form(line) for line in lines])
            for n, lines in enumerate([REFERENCES, SECOND][:references])]  # fmt: skip
    ours_args, theirs_args = CASES[case]
    ours, theirs = _ours(tmp_path, hyp, refs, *ours_args), _sacrebleu(hyp, refs, *theirs_args)
    assert [m["name"] for m in ours] == [m["name"] for m in theirs]
    for mine, reference in zip(ours, theirs):
        assert round(mine["score"], 4) == reference["score"]
        assert mine["signature"] == reference["signature"]


def test_nfd_references_are_not_normalised():
    """The bug this guards against: NFC-normalised references turned BLEU 96.48 into 100.00."""
    nfd = [unicodedata.normalize("NFD", line) for line in REFERENCES]
    assert nfd != REFERENCES
    assert score(REFERENCES, [nfd]).bleu < score(REFERENCES, [REFERENCES]).bleu == pytest.approx(100.0)


def test_bleu_details_are_in_the_report():
    bleu = score(HYPOTHESES, [REFERENCES], ScoreOptions(metrics=("bleu",))).metrics[0]
    assert len(bleu.details["precisions"]) == 4
    assert 0 < bleu.details["brevity_penalty"] <= 1
    assert bleu.details["length_ratio"] == pytest.approx(bleu.details["hyp_len"] / bleu.details["ref_len"])


def test_files_are_read_as_sacrebleu_reads_them(tmp_path: Path):
    path = tmp_path / "refs.txt"
    path.write_bytes("\ufeffa b  \r\n  c d\n\ne\u0301\n".encode())
    assert read_text_file(path) == ["\ufeffa b", "  c d", "", "e\u0301"]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(metrics=("bleu", "meteor")), "--metrics: meteor; expected some of bleu, chrf, chrf++, ter"),
        (dict(metrics=()), "--metrics: none given"),
        (dict(metrics=("bleu", "chrf", "bleu")), "--metrics: bleu given twice; expected each metric once"),
        (dict(tokenize="moses"), "--tokenize: 'moses'; expected one of"),
    ],
)
def test_unknown_options_are_one_clear_error(options: dict, message: str):
    with pytest.raises(UserInputError, match=message.replace("+", r"\+")):
        ScoreOptions(**options)


def test_reference_files_must_match_the_hypotheses(tmp_path: Path):
    hyp = _write(tmp_path / "hyp.txt", HYPOTHESES)
    short = _write(tmp_path / "short.txt", REFERENCES[:3])
    result = subprocess.run([sys.executable, "-m", "seq2seq", "score", "--hyp", str(hyp), "--ref",
                             str(_write(tmp_path / "ok.txt", REFERENCES)), "--ref", str(short)],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: {short} has 3 lines but {hyp} has 4; expected equal counts"

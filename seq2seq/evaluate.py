"""Evaluation: translate sources, score the detokenized output against references with sacrebleu, report.

Every place that scores a model (`seq2seq eval`, validation during training, the demo, the
precision comparison) goes through `translate_and_score`; `score` alone serves hypotheses that
already exist. Scores carry sacrebleu's signatures, which make them comparable across papers.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF

from seq2seq.config import DecodeConfig
from seq2seq.data.sources import read_lines
from seq2seq.errors import UserInputError
from seq2seq.translator import Translator


@dataclass(frozen=True)
class Scores:
    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    sentences: int

    def describe(self) -> str:
        return f"BLEU = {self.bleu:.2f}  ({self.bleu_signature})\nchrF = {self.chrf:.2f}  ({self.chrf_signature})"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Evaluation:
    hypotheses: list[str]
    scores: Scores


def score(hypotheses: list[str], references: list[str]) -> Scores:
    """Corpus BLEU and chrF with sacrebleu's defaults."""
    if len(hypotheses) != len(references):
        raise UserInputError(f"{len(hypotheses)} hypotheses but {len(references)} references; expected equal counts")
    bleu, chrf = BLEU(), CHRF()
    return Scores(
        bleu=bleu.corpus_score(hypotheses, [references]).score,
        chrf=chrf.corpus_score(hypotheses, [references]).score,
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
        sentences=len(hypotheses),
    )


def translate_and_score(
    translator: Translator,
    sources: list[str],
    references: list[str],
    decode: DecodeConfig | None = None,
    *,
    progress: bool = False,
) -> Evaluation:
    """Translate `sources` (best hypothesis only; settings: `decode`, else the model's) and score them."""
    if len(sources) != len(references):
        raise UserInputError(f"{len(sources)} sources but {len(references)} references; expected equal counts")
    decode = dataclasses.replace(decode or translator.decode, nbest=1)
    hypotheses = [t.text for t in translator.translate_with(sources, decode, progress=progress)]
    return Evaluation(hypotheses, score(hypotheses, references))


def evaluate_files(
    model: Path,
    *,
    src: Path,
    ref: Path,
    decode_overrides: list[str],
    device: str | None = None,
    hypotheses_path: Path | None = None,
    json_path: Path | None = None,
) -> Evaluation:
    """`seq2seq eval`: translate the file `src` with a checkpoint or exported model, score against `ref`,
    write the reports."""
    sources, references = list(read_lines(src)), list(read_lines(ref))
    if len(sources) != len(references):
        raise UserInputError(f"{src} has {len(sources)} lines but {ref} has {len(references)}; expected equal counts")
    translator = Translator.load(model, device=device)
    decode = translator.settings(decode_overrides)
    evaluation = translate_and_score(translator, sources, references, decode, progress=True)
    if hypotheses_path:
        hypotheses_path.write_text("".join(h + "\n" for h in evaluation.hypotheses), encoding="utf-8")
    if json_path:
        report = {**evaluation.scores.to_dict(), "model": str(model), "engine": translator.engine, "src": str(src),
                  "ref": str(ref), "beam": decode.beam}  # fmt: skip
        json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return evaluation

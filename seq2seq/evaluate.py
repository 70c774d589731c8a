"""Corpus BLEU and chrF on detokenized text with sacrebleu, with the signatures that make them comparable."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sacrebleu.metrics import BLEU, CHRF

from seq2seq.errors import UserInputError


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


def score(hypotheses: list[str], references: list[str]) -> Scores:
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

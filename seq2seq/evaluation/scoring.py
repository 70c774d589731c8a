"""Scores exactly as the sacrebleu command line computes them: same reading of the files, same metrics.

References and hypotheses are read the way `sacrebleu` reads them (UTF-8, lines split at "\\n",
trailing whitespace removed, nothing else): no Unicode normalisation, which belongs to the model's
input and would make an NFD reference score higher here than in sacrebleu (BLEU 100 against 96.48).
Every score carries sacrebleu's signature, which is what makes it comparable across papers.
"""

from __future__ import annotations

import contextlib
import gzip
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sacrebleu.metrics import BLEU, CHRF, TER

from seq2seq.errors import UserInputError

METRICS = ("bleu", "chrf", "chrf++", "ter")
BLEU_TOKENIZERS = tuple(BLEU.TOKENIZERS)


@dataclass(frozen=True)
class ScoreOptions:
    """sacrebleu's options: metrics (bleu, chrf, chrf++ = chrF with word n-grams of order 2, ter),
    the BLEU tokenizer (None: sacrebleu's default, 13a) and lowercasing."""

    metrics: tuple[str, ...] = ("bleu", "chrf")
    tokenize: str | None = None
    lowercase: bool = False

    def __post_init__(self) -> None:
        unknown = [name for name in self.metrics if name not in METRICS]
        if unknown or not self.metrics:
            raise UserInputError(
                f"--metrics: {', '.join(unknown) or 'none given'}; expected some of {', '.join(METRICS)}"
            )
        repeated = sorted({name for name in self.metrics if self.metrics.count(name) > 1})
        if repeated:  # a report would hold the score twice under one name: a slip for another metric
            raise UserInputError(f"--metrics: {', '.join(repeated)} given twice; expected each metric once")
        if self.tokenize is not None and self.tokenize not in BLEU_TOKENIZERS:
            raise UserInputError(f"--tokenize: {self.tokenize!r}; expected one of {', '.join(BLEU_TOKENIZERS)}")


@dataclass(frozen=True)
class MetricScore:
    name: str  # as sacrebleu prints it: BLEU, chrF2, chrF2++, TER
    score: float
    signature: str
    details: dict = field(default_factory=dict)  # BLEU: precisions, brevity penalty, length ratio, lengths

    def describe(self) -> str:
        verbose = self.details.get("verbose", "")
        return f"{self.name} = {self.score:.2f} {verbose}".rstrip() + f"  ({self.signature})"


@dataclass(frozen=True)
class Scores:
    metrics: tuple[MetricScore, ...]
    sentences: int
    references: int  # reference sets (sacrebleu's nrefs)

    def get(self, metric: str) -> MetricScore:
        wanted = {"bleu": "BLEU", "chrf": "chrF2", "chrf++": "chrF2++", "ter": "TER"}[metric]
        return next(m for m in self.metrics if m.name == wanted)

    @property
    def bleu(self) -> float:
        return self.get("bleu").score

    @property
    def chrf(self) -> float:
        return self.get("chrf").score

    def describe(self) -> str:
        return "\n".join(metric.describe() for metric in self.metrics)

    def to_dict(self) -> dict:
        """The JSON report: each metric with its score, signature and details."""
        return {
            "sentences": self.sentences,
            "references": self.references,
            "scores": [{"name": m.name, "score": m.score, "signature": m.signature, **m.details} for m in self.metrics],
        }


def score(
    hypotheses: Sequence[str], references: Sequence[Sequence[str]], options: ScoreOptions = ScoreOptions()
) -> Scores:
    """Corpus scores of `hypotheses` against one or more reference sets (each as long as the hypotheses)."""
    if not references:
        raise UserInputError("no references given; expected at least one reference set")
    for number, reference_set in enumerate(references, 1):
        if len(reference_set) != len(hypotheses):
            raise UserInputError(
                f"{len(hypotheses)} hypotheses but {len(reference_set)} lines in reference set {number}; "
                "expected equal counts"
            )
    hypotheses, references = list(hypotheses), [list(r) for r in references]
    results = []
    for metric in metrics_for(options):
        with _tokenizer_problems(options):
            result = metric.corpus_score(hypotheses, references)
        results.append(MetricScore(result.name, result.score, str(metric.get_signature()), _details(result)))
    return Scores(tuple(results), len(hypotheses), len(references))


def metrics_for(options: ScoreOptions) -> list:
    """sacrebleu's metric objects for `options`. Making them is where sacrebleu sets up a BLEU tokenizer
    (imports ja-mecab's package, downloads flores200's model on first use), so a command that
    translates before it scores asks for them first: a tokenizer it cannot set up is one line, then."""
    with _tokenizer_problems(options):
        return [_metric(name, options) for name in options.metrics]


@contextlib.contextmanager
def _tokenizer_problems(options: ScoreOptions) -> Iterator[None]:
    """sacrebleu's failure to set up or run a BLEU tokenizer here, as one line for the user."""
    try:
        yield
    except (ImportError, RuntimeError, OSError) as error:  # a missing package; a download without network
        if options.tokenize is None:  # sacrebleu's default tokenizer needs nothing: not the user's to mend
            raise
        reason = " ".join(str(error).split())  # sacrebleu's messages span lines
        if isinstance(error, OSError):  # flores101/200 and spm fetch their model on first use
            reason = f"what it downloads or reads for it failed: {reason}"
        raise UserInputError(f"--tokenize {options.tokenize}: sacrebleu cannot use it here ({reason})") from None


def _metric(name: str, options: ScoreOptions):
    if name == "bleu":
        return BLEU(tokenize=options.tokenize, lowercase=options.lowercase)
    if name in ("chrf", "chrf++"):
        return CHRF(word_order=2 if name == "chrf++" else 0, lowercase=options.lowercase)
    return TER()  # case-insensitive, as in sacrebleu (whose -lc does not change TER)


def _details(result) -> dict:
    if result.name == "BLEU":
        return {
            "precisions": [round(p, 4) for p in result.precisions],
            "brevity_penalty": result.bp,
            "length_ratio": result.ratio,
            "hyp_len": result.sys_len,
            "ref_len": result.ref_len,
            "verbose": result._verbose,
        }
    if result.name == "TER":
        return {"num_edits": result.num_edits, "ref_length": result.ref_length}
    return {}


def read_text_file(path: str | Path) -> list[str]:
    """Lines of a hypothesis or reference file as `sacrebleu` reads them (optionally .gz): split at
    "\\n" only, trailing whitespace removed, no other change."""
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else open
    lines: list[str] = []
    try:
        with opener(path, "rb") as handle:
            for raw in handle:
                lines.append(raw.decode("utf-8").rstrip())
    except UnicodeDecodeError as error:
        where = f"{path}:{len(lines) + 1}"
        raise UserInputError(f"{where}: not valid UTF-8 (bad byte at column {error.start + 1})") from None
    except (gzip.BadGzipFile, EOFError) as error:
        raise UserInputError(f"{path}: not a readable gzip file ({error})") from None
    return lines

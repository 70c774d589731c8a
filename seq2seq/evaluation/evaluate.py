"""Evaluation: translate sources, score the detokenized output against references, report.

Every place that scores a model (`seq2seq eval`, validation during training, the demo, the
precision comparison) goes through `translate_and_score`; `score_files` serves hypotheses that
already exist (`seq2seq score`). Scoring itself is sacrebleu's, in scoring.py.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from seq2seq.data.sources import read_lines
from seq2seq.decoding import DecodeConfig
from seq2seq.errors import UserInputError
from seq2seq.evaluation.scoring import ScoreOptions, Scores, read_text_file, score
from seq2seq.files import check_new_file, write_text_atomic
from seq2seq.inference.admission import Names
from seq2seq.inference.translator import Translator
from seq2seq.progress import progress_bar


@dataclass(frozen=True)
class Evaluation:
    hypotheses: list[str]
    scores: Scores


def translate_and_score(
    translator: Translator,
    sources: list[str],
    references: list[str] | list[list[str]],
    decode: DecodeConfig | None = None,
    *,
    options: ScoreOptions = ScoreOptions(),
    progress: bool = False,
    on_batch: Callable[[int], None] = lambda done: None,
) -> Evaluation:
    """Translate `sources` (best hypothesis only; settings: `decode`, else the model's) and score them
    against one reference set (a list of lines) or several (a list of such lists). `on_batch` gets the
    count of sentences each translated batch adds."""
    reference_sets = [references] if references and isinstance(references[0], str) else references
    for reference_set in reference_sets:
        if len(sources) != len(reference_set):
            raise UserInputError(f"{len(sources)} sources but {len(reference_set)} references; expected equal counts")
    decode = dataclasses.replace(decode or translator.decode, nbest=1)
    with progress_bar(total=len(sources), desc="translate", unit="sent", enabled=progress, leave=False) as bar:

        def batch_done(done: int) -> None:
            bar.update(done)
            on_batch(done)

        hypotheses = [t.text for t in translator.translate_with(sources, decode, progress=batch_done)]
    return Evaluation(hypotheses, score(hypotheses, reference_sets, options))


def evaluate_files(
    model: Path | list[Path],
    *,
    src: Path,
    refs: list[Path],
    decode_overrides: list[str],
    options: ScoreOptions = ScoreOptions(),
    device: str | None = None,
    hypotheses_path: Path | None = None,
    json_path: Path | None = None,
    shortlist: Path | None = None,
) -> Evaluation:
    """`seq2seq eval`: translate the file `src` with a checkpoint, an exported model or an ensemble of
    checkpoints (a list), score against the
    reference files `refs`, write the reports. Every input and output is checked before translating."""
    for path in (hypotheses_path, json_path):
        if path is not None:
            check_new_file(path)
    if hypotheses_path is not None and json_path is not None and hypotheses_path.resolve() == json_path.resolve():
        raise UserInputError(f"--hyps and --json: both name {json_path}; expected two files")
    sources = list(read_lines(src))
    if not sources:
        raise UserInputError(f"{src}: no lines to translate; expected a source file with at least one line")
    reference_sets = _read_references(refs, len(sources), counted=str(src))
    translator = Translator.load(model, device=device, shortlist=shortlist)
    decode = translator.settings(decode_overrides)
    translator.plan(sources, decode, names=Names(line=f"{src}:{{number}}"))  # a line it would refuse: before any work
    evaluation = translate_and_score(translator, sources, reference_sets, decode, options=options, progress=True)
    if hypotheses_path:
        write_text_atomic(hypotheses_path, "".join(h + "\n" for h in evaluation.hypotheses))
    if json_path:
        named = ", ".join(map(str, model)) if isinstance(model, list) else str(model)
        report = {
            **evaluation.scores.to_dict(),
            "model": named,
            "engine": translator.engine,
            "src": str(src),
            "refs": [str(r) for r in refs],
            "beam": decode.beam,
            "decode": dataclasses.asdict(decode),  # every setting the translations were made with
            "shortlist": str(shortlist) if shortlist is not None else None,
        }
        write_text_atomic(json_path, json.dumps(report, indent=2) + "\n")
    return evaluation


def score_files(
    hyp: Path, refs: list[Path], *, options: ScoreOptions = ScoreOptions(), json_path: Path | None = None
) -> Scores:
    """`seq2seq score`: existing hypotheses against one or more reference files, as `sacrebleu` scores them."""
    if json_path is not None:
        check_new_file(json_path)
    hypotheses = read_text_file(hyp)
    if not hypotheses:
        raise UserInputError(f"{hyp}: no lines to score; expected a hypothesis file with at least one line")
    scores = score(hypotheses, _read_references(refs, len(hypotheses), counted=str(hyp)), options)
    if json_path:
        report = {**scores.to_dict(), "hyp": str(hyp), "refs": [str(r) for r in refs]}
        write_text_atomic(json_path, json.dumps(report, indent=2) + "\n")
    return scores


def _read_references(paths: list[Path], count: int, *, counted: str) -> list[list[str]]:
    """Each reference file, which must have as many lines as `counted` (a source or hypothesis file)."""
    if not paths:
        raise UserInputError("--ref: no reference file given; expected at least one")
    reference_sets = []
    for path in paths:
        lines = read_text_file(path)
        if len(lines) != count:
            raise UserInputError(f"{path} has {len(lines)} lines but {counted} has {count}; expected equal counts")
        reference_sets.append(lines)
    return reference_sets

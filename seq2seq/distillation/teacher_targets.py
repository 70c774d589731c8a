"""Stage 1 of `seq2seq distill`: the teacher translates the training sources (sequence-level
knowledge distillation), a chunk of lines at a time, each chunk saved as it completes.

Where the chunks go is named by what they are made of (the teacher's files, its search settings,
the sources): a run started again reuses every finished chunk of the same work and never mixes in
another's. A line is translated under its number in the corpus, so its sampled targets do not
depend on the chunking (translator.py's sampling contract) and a resumed stage writes what an
uninterrupted one writes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from seq2seq.checkpoint import run_checkpoint
from seq2seq.config import Config, CorpusConfig
from seq2seq.data.prepare import read_pairs
from seq2seq.errors import UserInputError
from seq2seq.files import content_digest, write_text_atomic
from seq2seq.inference.engine import EXPORT_METADATA
from seq2seq.inference.translator import Translator
from seq2seq.progress import progress_bar


@dataclass(frozen=True)
class DistilledCorpus:
    """The student's training pairs, as two text files (the teacher's targets, and the originals if asked)."""

    src: Path
    tgt: Path
    pairs: int


def teacher_paths(config: Config) -> list[Path]:
    """The teacher's checkpoint files, or its exported directory (CTranslate2 translates the corpus
    faster); one that is missing is named by its key, before any work."""
    paths = []
    for index, given in enumerate(config.distill.teacher):
        path = Path(given)
        if not path.exists():
            raise UserInputError(f"distill.teacher[{index}]: {given}: file not found; expected a checkpoint")
        exported = (path / EXPORT_METADATA).is_file()
        paths.append(run_checkpoint(path) if path.is_dir() and not exported else path)
    return paths


def distilled_corpora(config: Config, folder: Path, *, progress: bool) -> list[DistilledCorpus]:
    """The teacher's translation of each training corpus's sources (data.train, then each of
    data.extra_train) under `folder`, made, or reused when the same work was done or begun before.
    The teacher reads a tagged corpus's sources without the tag, which is the student's to learn."""
    return [
        _distilled(config, dataclasses.replace(corpus, tag=""), key, folder, progress=progress)
        for key, corpus in config.data.training_corpora()
    ]


def _distilled(config: Config, given: CorpusConfig, key: str, folder: Path, *, progress: bool) -> DistilledCorpus:
    distill, teachers = config.distill, teacher_paths(config)
    corpus = read_pairs(config.data, given, key)
    identity = {
        "teacher": [content_digest(path) for path in teachers],
        "beam": distill.beam,
        "nbest": distill.nbest,
        "sample": distill.sample,
        "max_length": config.data.max_length,  # longer sources are not translated
        "sources": hashlib.sha256("\n".join(corpus.src).encode("utf-8")).hexdigest(),
    }
    work = folder / f"teacher-{hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:16]}"
    work.mkdir(parents=True, exist_ok=True)
    write_text_atomic(work / "identity.json", json.dumps(identity, indent=2) + "\n")
    targets = _translate_in_chunks(config, teachers, corpus.src, work, progress=progress)
    suffix = "-originals" if distill.originals else ""
    src_path, tgt_path = work / f"train{suffix}.src", work / f"train{suffix}.tgt"
    pairs = [(src, tgt) for index, src in enumerate(corpus.src) for tgt in targets[index] if tgt.strip()]
    if distill.originals:
        pairs += list(zip(corpus.src, corpus.tgt))
    if not (src_path.is_file() and tgt_path.is_file()):
        write_text_atomic(src_path, "".join(src + "\n" for src, _ in pairs))
        write_text_atomic(tgt_path, "".join(tgt + "\n" for _, tgt in pairs))
    return DistilledCorpus(src_path, tgt_path, len(pairs))


def _translate_in_chunks(
    config: Config, teachers: list[Path], sources: list[str], work: Path, *, progress: bool
) -> list[list[str]]:
    """Per source line, the teacher's nbest targets; chunk k (lines k*chunk_lines ...) is saved in
    work/chunk-k.json once translated, and read back instead of translated again. A source longer
    than data.max_length pieces (the teacher's) gets none: the student would not train on it, and a
    runaway line (a whole chapter aligned as one verse) would cost more than the rest together."""
    distill = config.distill
    size = distill.chunk_lines
    starts = range(0, len(sources), size)
    pending = [start for start in starts if not _chunk_path(work, start, size).is_file()]
    translator = None
    with progress_bar(total=len(sources), desc="teacher", unit="sent", enabled=progress) as bar:
        bar.update(sum(min(size, len(sources) - start) for start in starts if start not in pending))
        for start in pending:
            if translator is None:  # loaded only when there is work left
                translator = Translator.load(teachers)
                decode = translator.settings(beam=distill.beam, nbest=distill.nbest, sample=distill.sample)
            lines = sources[start : start + size]
            kept = [i for i, n in enumerate(translator.source_lengths(lines)) if n <= config.data.max_length + 1]
            bar.update(len(lines) - len(kept))
            found = translator.translate_with(
                [lines[i] for i in kept], decode, line_numbers=[start + i for i in kept], progress=bar.update
            )
            texts = [[] for _ in lines]
            for i, translation in zip(kept, found):
                texts[i] = [text for text, _ in translation.nbest]
            write_text_atomic(_chunk_path(work, start, size), json.dumps(texts, ensure_ascii=False))
    return [
        targets
        for start in starts
        for targets in json.loads(_chunk_path(work, start, size).read_text(encoding="utf-8"))
    ]


def _chunk_path(work: Path, start: int, size: int) -> Path:
    return work / f"chunk-{start // size:06d}-of-{size}.json"

"""What `seq2seq translate` and `seq2seq score-pairs` do with files: read the input (and its
guidance files) a chunk at a time, check the whole of it before any work where a line could be
refused, translate or score each chunk with a Translator, and write the output atomically (an
output file keeps its finished chunks until it is whole: output_chunks.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from seq2seq.cli.output_chunks import OutputChunks, kept_in_chunks, work_identity, write_in_chunks
from seq2seq.data.sources import chunked, decode_lines, read_lines
from seq2seq.decoding import DecodeConfig
from seq2seq.errors import UserInputError
from seq2seq.files import atomic_text_write, check_new_file, input_problem, read_once
from seq2seq.inference.admission import Names
from seq2seq.inference.engine import PairScore, Translation
from seq2seq.inference.glossary import Glossary, constraint_fields, merged_constraints
from seq2seq.inference.translator import Translator
from seq2seq.progress import progress_bar

# A file is read, translated and written this many lines at a time, so memory stays flat however
# long it is; within a chunk, lines are sorted by length into batches.
FILE_CHUNK_LINES = 10_000
ATTENTION_PLOT_LINES = 5  # the first lines of the input get heatmaps with --attention-plot


@dataclass(frozen=True)
class LineGuides:
    """`seq2seq translate`'s guidance files: target prefixes and constraints (one line per input line)
    and a glossary (glossary.py has the formats)."""

    prefixes: Path | None = None
    constraints: Path | None = None
    glossary: Path | None = None

    def check(self) -> Glossary | None:
        """Fail on a missing file or a bad glossary line before anything is loaded; the glossary."""
        for option, path in (("--prefix", self.prefixes), ("--constraints", self.constraints)):
            if path is not None and (problem := input_problem(path)):
                raise UserInputError(f"{option} {path}: {problem}; expected a text file with one line per input line")
        return Glossary.load(self.glossary) if self.glossary is not None else None

    def read_once(self) -> bool:
        """Whether a prefix or constraints file is a stream (files.read_once)."""
        return any(path is not None and read_once(path) for path in (self.prefixes, self.constraints))

    def check_spelling(self, glossary: Glossary, translator: Translator) -> None:
        """A glossary term the target vocabulary cannot spell: one line naming its line in the glossary."""
        for (_, term), number in zip(glossary.entries, glossary.line_numbers):
            if problem := translator.unspellable(term):
                raise UserInputError(f"{self.glossary}:{number}: {problem}")

    def names(self, source: str) -> Names:
        """How errors name an input line and its guidance: by file and line."""
        source = "<stdin>" if source == "-" else source
        return Names(
            line=f"{source}:{{number}}",
            prefix=f"{self.prefixes}:{{number}}",
            constraint=f"{self.constraints}:{{number}}",
        )

    def aligned(self, lines: Iterable[str]) -> Iterator[tuple[str, str, list[str]]]:
        """(line, prefix, constraints) for each input line; a guidance file of another length is one line."""
        sides = {"input": iter(lines)}
        if self.prefixes is not None:
            sides[str(self.prefixes)] = read_lines(self.prefixes)
        if self.constraints is not None:
            sides[str(self.constraints)] = map(constraint_fields, read_lines(self.constraints, keep_tabs=True))
        for number in itertools.count(1):
            row = {name: next(side, None) for name, side in sides.items()}
            present = [name for name, value in row.items() if value is not None]
            if not present:
                return
            if len(present) != len(row):
                short = [name for name in row if name not in present]
                raise UserInputError(
                    f"{', '.join(short)}: ends before line {number} of {', '.join(present)}; "
                    "expected one guidance line per input line"
                )
            yield row["input"], row.get(str(self.prefixes), ""), row.get(str(self.constraints), [])


def translate_file(
    model: Path | list[Path],
    *,
    source: str,
    output: str,
    decode_overrides: list[str],
    stream: bool,
    device: str | None = None,
    attention_plot: Path | None = None,
    guides: LineGuides = LineGuides(),
    shortlist: Path | None = None,
) -> list[Path]:
    """`seq2seq translate`: `model` is a checkpoint, a run directory, an exported directory or a list of
    checkpoints (an ensemble); `source` and `output` are paths or "-" (stdin, stdout). With n-best > 1 each line
    becomes `index ||| text ||| score` lines. Returns the attention plots written, if asked for."""
    if source != "-" and (problem := input_problem(source)):
        raise UserInputError(f"{source}: {problem}; expected a text file with one sentence per line (or - for stdin)")
    if output != "-":
        check_new_file(output)
    if attention_plot is not None:
        _check_attention_folder(attention_plot)
    glossary = guides.check()
    translator = Translator.load(model, device=device, shortlist=shortlist)
    decode = translator.settings(decode_overrides)
    if attention_plot is not None and translator.bundle is None:
        models = model if isinstance(model, list) else [model]
        what = f"an ensemble of {len(models)} models" if len(models) > 1 else f"{models[0]} is an exported model"
        raise UserInputError(f"--attention-plot: {what}; attention maps need one checkpoint (.pt)")  # before work
    guided = guides != LineGuides()
    if guides.constraints is not None or glossary is not None:
        translator.check_supported(decode, constrained=True)
    if glossary is not None:
        guides.check_spelling(glossary, translator)
    names = guides.names(source)
    # a line it would refuse: named before any work, where the input can be read twice (not stdin or a pipe)
    rereadable = source != "-" and not read_once(source) and not guides.read_once()
    total = None  # the bar's end, where the input can be counted before it is translated
    if rereadable and (guided or translator.max_positions is not None):
        total = _check_whole_input(translator, decode, source, guides, glossary, names)
    elif rereadable:
        total = sum(1 for _ in read_lines(source))
    lines_in = decode_lines(sys.stdin.buffer, "<stdin>") if source == "-" else read_lines(source)
    rows = guides.aligned(lines_in)
    chunks = ([row] for row in rows) if stream else chunked(rows, FILE_CHUNK_LINES)
    first_chunk = next(chunks, [])
    numbered = _numbered(itertools.chain([first_chunk], chunks))
    translated = functools.partial(_translated, translator, decode=decode, glossary=glossary, guided=guided)
    # the bar is closed however translation ends, so that an error's line starts a line of its own
    with progress_bar(total=total, desc="translate", unit="sent", enabled=not (source == "-" or stream)) as bar:
        if rereadable and not stream and kept_in_chunks(output):
            inputs = {"input": Path(source), "--prefix": guides.prefixes, "--constraints": guides.constraints,
                      "--glossary": guides.glossary, "--shortlist": shortlist}  # fmt: skip
            kept = OutputChunks(Path(output), work_identity(_models(model), inputs, _settings(decode)))

            def text(chunk: list, first: int) -> str:
                written = io.StringIO()
                results = translated(chunk, bar=bar, names=dataclasses.replace(names, first=first))
                _write(written, results, nbest=decode.nbest > 1, flush=False, first=first)
                return written.getvalue()

            write_in_chunks(kept, numbered, text, bar, done="lines translated")
        else:
            results = (
                result
                for chunk, first in numbered
                for result in translated(chunk, bar=bar, names=dataclasses.replace(names, first=first))
            )
            with _output(output) as sink:
                _write(sink, results, nbest=decode.nbest > 1, flush=stream)
    if attention_plot is None or not first_chunk:
        return []
    return translator.plot_attention(
        [line for line, _, _ in first_chunk[:ATTENTION_PLOT_LINES]], attention_plot, decode
    )


def _settings(decode: DecodeConfig, **more) -> dict:
    """The settings a chunk is made with. batch_tokens decides the batches, not a line's result: a run
    that ran out of memory continues with fewer."""
    return {"decode": {**dataclasses.asdict(decode), "batch_tokens": None}, "chunk_lines": FILE_CHUNK_LINES, **more}


def _models(model: Path | list[Path]) -> list[Path]:
    return [Path(path) for path in model] if isinstance(model, list) else [Path(model)]


def _check_attention_folder(folder: Path) -> None:
    """--attention-plot: a folder (made if missing) in which no plot would replace an existing file."""
    from seq2seq.inference.attention_plot import plot_file  # matplotlib only when plots are asked for

    if folder.exists() and not folder.is_dir():
        raise UserInputError(f"--attention-plot {folder}: is a file; expected a folder for the PNG files")
    taken = [plot_file(folder, n) for n in range(1, ATTENTION_PLOT_LINES + 1) if plot_file(folder, n).exists()]
    if taken:
        raise UserInputError(
            f"--attention-plot {folder}: {taken[0].name} already exists; expected a folder without attention "
            "plots (delete them or choose another folder)"
        )


def score_file(
    model: Path | list[Path],
    *,
    src: Path,
    tgt: Path,
    output: str,
    decode_overrides: list[str],
    per_token: bool,
    device: str | None = None,
) -> None:
    """`seq2seq score-pairs`: one line per pair, `score<TAB>log-probability<TAB>pieces` (with
    per_token, a fourth column: each piece's log-probability, EOS last), in input order; the files are
    counted before the model is loaded and read a chunk at a time. A stream (a pipe: read_once) is read
    once, as it comes: its count and the pairs the model would refuse are found as it is scored. An
    output file keeps its finished chunks until it is whole (output_chunks.py), as translate_file's."""
    for path in (src, tgt):
        if problem := input_problem(path):
            raise UserInputError(f"{path}: {problem}; expected a text file with one sentence per line")
    rereadable = not (read_once(src) or read_once(tgt))
    count = None
    if rereadable:
        count, targets = (sum(1 for _ in read_lines(path)) for path in (src, tgt))
        if count != targets:
            raise UserInputError(f"{tgt}: has {targets} lines but {src} has {count}; expected one target per source")
    if output != "-":
        check_new_file(output)
    translator = Translator.load(model, device=device)
    decode = translator.scoring_settings(decode_overrides)
    names = Names(line=f"{src} and {tgt}, line {{number}}")
    if rereadable and translator.max_positions is not None:  # a pair it would refuse: before any work
        for chunk, first in _numbered(chunked(_pairs(src, tgt), FILE_CHUNK_LINES)):
            translator.plan_scoring(
                [s for s, _ in chunk], [t for _, t in chunk], names=dataclasses.replace(names, first=first)
            )
    pairs = _numbered(chunked(_pairs(src, tgt), FILE_CHUNK_LINES))
    with progress_bar(total=count, desc="score", unit="pair", enabled=output != "-") as bar:

        def text(chunk: list, first: int) -> str:  # the bar moves batch by batch: a chunk is up to FILE_CHUNK_LINES
            scored = translator.score_with([s for s, _ in chunk], [t for _, t in chunk], decode, progress=bar.update)
            return "".join(_score_line(pair, per_token=per_token) for pair in scored)

        if rereadable and kept_in_chunks(output):
            identity = work_identity(
                _models(model), {"--src": src, "--tgt": tgt}, _settings(decode, per_token=per_token)
            )
            write_in_chunks(OutputChunks(Path(output), identity), pairs, text, bar, done="pairs scored")
        else:
            with _output(output) as sink:
                for chunk, first in pairs:
                    sink.write(text(chunk, first))


def _score_line(pair: PairScore, *, per_token: bool) -> str:
    """`score<TAB>log-probability<TAB>pieces`, with per_token a fourth column: each piece's log-probability."""
    extra = "\t" + " ".join(f"{value:.4f}" for value in pair.log_probs) if per_token else ""
    return f"{pair.score:.4f}\t{pair.log_prob:.4f}\t{len(pair.log_probs)}{extra}\n"


def _pairs(src: Path, tgt: Path) -> Iterator[tuple[str, str]]:
    """The files' lines side by side; one that ends before the other is an error naming both."""
    sources, targets = read_lines(src), read_lines(tgt)
    for number in itertools.count(1):
        source, target = next(sources, None), next(targets, None)
        if source is None and target is None:
            return
        if source is None or target is None:
            short, long = (src, tgt) if source is None else (tgt, src)
            raise UserInputError(f"{short}: ends before line {number} of {long}; expected one target per source")
        yield source, target


@contextlib.contextmanager
def _output(output: str) -> Iterator[TextIO]:
    """stdout, or a file (gzip where its name ends in .gz) that appears under its name only once every
    line is written."""
    if output == "-":
        yield sys.stdout
        return
    with atomic_text_write(output) as text:
        yield text


def _check_whole_input(
    translator: Translator,
    decode: DecodeConfig,
    source: str,
    guides: LineGuides,
    glossary: Glossary | None,
    names: Names,
) -> int:
    """Plan every chunk of the input file, so that a line the model would refuse (past an export's
    positions, or with guidance its vocabulary cannot spell) is named before anything is translated;
    the file's line count."""
    guided, count = guides != LineGuides(), 0
    for chunk, first in _numbered(chunked(guides.aligned(read_lines(source)), FILE_CHUNK_LINES)):
        lines, prefixes, constraints = _guidance(chunk, glossary, guided=guided)
        names_here = dataclasses.replace(names, first=first)
        translator.plan(lines, decode, prefixes=prefixes, constraints=constraints, names=names_here)
        count = first + len(chunk)
    return count


def _write(sink: TextIO, results: Iterable[Translation], *, nbest: bool, flush: bool, first: int = 0) -> None:
    """One line per translation, or with n-best `index ||| text ||| score` lines, the index of the
    input line counted from `first` (an empty input line keeps its row: the empty translation)."""
    for index, result in enumerate(results, first):
        if nbest:
            sink.writelines(f"{index} ||| {text} ||| {value:.4f}\n" for text, value in result.nbest or [("", 0.0)])
        else:
            sink.write(result.text + "\n")
        if flush:
            sink.flush()


def _numbered(chunks: Iterable[list]) -> Iterator[tuple[list, int]]:
    """Each chunk with the index of its first line in the whole input."""
    first = 0
    for chunk in chunks:
        yield chunk, first
        first += len(chunk)


def _guidance(
    rows: list[tuple[str, str, list[str]]], glossary: Glossary | None, *, guided: bool
) -> tuple[list[str], list[str] | None, list[list[str]] | None]:
    """LineGuides.aligned rows as lines, prefixes and constraints (the glossary's terms merged in)."""
    lines = [line for line, _, _ in rows]
    prefixes = [prefix for _, prefix, _ in rows] if guided else None
    constraints = merged_constraints(lines, [own for _, _, own in rows], glossary) if guided else None
    return lines, prefixes, constraints


def _translated(
    translator: Translator,
    rows: list[tuple[str, str, list[str]]],
    *,
    decode: DecodeConfig,
    bar: tqdm,
    glossary: Glossary | None,
    guided: bool,
    names: Names,
) -> Iterator[Translation]:
    lines, prefixes, constraints = _guidance(rows, glossary, guided=guided)
    numbers = list(range(names.first, names.first + len(lines)))  # a sampled line draws by its line in the file
    results = translator.translate_with(
        lines,
        decode,
        prefixes=prefixes,
        constraints=constraints,
        line_numbers=numbers,
        names=names,
        progress=bar.update,  # batch by batch: a chunk is up to FILE_CHUNK_LINES lines
    )
    return iter(results)

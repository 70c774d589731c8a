"""The Python API for using a trained model, and `seq2seq translate` on top of it.

    from seq2seq import Translator
    translator = Translator.load("runs/bible/checkpoints/best.pt")   # or an exported directory
    translator.translate(["In the beginning God created the heavens and the earth."], beam=5)

A checkpoint (a .pt file) is decoded by our PyTorch search, several checkpoints as an ensemble
(ensemble.py); a directory written by `seq2seq export` by CTranslate2. Both take the same decode
settings (the model's `decode` section, overridable per call) and return the same `Translation`
objects, so everything above (`translate`, `eval`, the parity gate) works with either. This module
imports neither torch nor ctranslate2: `load` brings in the engine the path needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from seq2seq.config import decode_config_from, decode_config_with
from seq2seq.data.sources import chunked, decode_lines, read_lines
from seq2seq.decoding import DecodeConfig, refusals
from seq2seq.errors import UserInputError
from seq2seq.files import atomic_write, check_writable
from seq2seq.inference.admission import LinePlan, Names, plan_scoring, plan_translation, unspellable
from seq2seq.inference.engine import EXPORT_METADATA, Engine, PairScore, Translation
from seq2seq.inference.glossary import Glossary, constraint_fields, merged_constraints
from seq2seq.progress import progress_bar

# A file is read, translated and written this many lines at a time, so memory stays flat however
# long it is; within a chunk, lines are sorted by length into batches.
FILE_CHUNK_LINES = 10_000


class Translator:
    """A model ready to translate: its decode defaults and the engine that translates lines with settings."""

    def __init__(self, decode: DecodeConfig, engine: Engine, *, bundle: Any = None):
        self.decode = decode
        self.bundle = bundle  # PyTorch only: the model and tokenizer (attention plots need them)
        self._engine = engine

    @property
    def engine(self) -> str:
        """Which engine translates: "pytorch" or "ctranslate2"."""
        return self._engine.name

    @property
    def max_positions(self) -> int | None:
        """The longest source and output (in pieces) the model places; None: any."""
        return self._engine.max_positions

    @classmethod
    def load(cls, path: str | Path | list[str | Path], *, device: str | None = None) -> Translator:
        """A checkpoint file (PyTorch), several as an ensemble (a list; the first's decode settings),
        or a directory from `seq2seq export` (CTranslate2)."""
        if isinstance(path, (list, tuple)):
            if len(path) > 1:
                return cls._load_ensemble([Path(item) for item in path], device)
            path = path[0]
        path = Path(path)
        if path.is_dir():
            if not (path / EXPORT_METADATA).is_file():
                raise UserInputError(
                    f"{path}: not an exported model (no {EXPORT_METADATA}); expected a checkpoint "
                    "file (.pt) or a directory written by `seq2seq export`"
                )
            from seq2seq.inference.ctranslate2_engine import load_exported

            decode, engine = load_exported(path, device=device)
            return cls(decode, engine)
        import torch

        from seq2seq.checkpoint import load_for_inference

        bundle = load_for_inference(path, device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return cls.from_model(bundle.model, bundle.tokenizer, bundle.config.decode, bundle=bundle)

    @classmethod
    def _load_ensemble(cls, paths: list[Path], device: str | None) -> Translator:
        import torch

        from seq2seq.checkpoint import Checkpoint
        from seq2seq.inference.ensemble import Ensemble

        exported = [str(path) for path in paths if path.is_dir()]
        if exported:
            raise UserInputError(
                f"{', '.join(exported)}: an ensemble needs checkpoints (.pt); CTranslate2 decodes one model"
            )
        checkpoints = [Checkpoint.load(path) for path in paths]
        for path, checkpoint in zip(paths[1:], checkpoints[1:]):  # before any model is built
            if checkpoint.tokenizer.protos() != checkpoints[0].tokenizer.protos():
                raise UserInputError(
                    f"{path}: its vocabulary differs from {paths[0]}'s; an ensemble's models must "
                    "share the source and target SentencePiece models"
                )
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        ensemble = Ensemble([checkpoint.build_model(device) for checkpoint in checkpoints])
        return cls.from_model(ensemble, checkpoints[0].tokenizer, checkpoints[0].config.decode)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, decode: DecodeConfig, *, bundle: Any = None) -> Translator:
        """Our PyTorch model in memory (validation translates with the model being trained)."""
        from seq2seq.inference.pytorch_engine import PyTorchEngine

        return cls(decode, PyTorchEngine(model, tokenizer), bundle=bundle)

    def settings(self, overrides: Iterable[str] = (), **options: Any) -> DecodeConfig:
        """The decode defaults with `decode.KEY=VALUE` overrides, then typed keyword options (beam=5,
        nbest=2, ...); a setting this engine cannot honour (an explicit sampling seed on CTranslate2)
        is refused here, before any work."""
        overrides = list(overrides)
        decode = decode_config_with(self.decode, overrides) if overrides else self.decode
        typed = {key: value for key, value in options.items() if value is not None}
        decode = decode_config_from(decode, typed, origin="options") if typed else decode
        given = {item.partition("=")[0].removeprefix("decode.") for item in overrides} | set(typed)
        self.check_supported(decode, given=given)
        return decode

    def check_supported(self, decode: DecodeConfig, *, given: Iterable[str] = (), constrained: bool = False) -> None:
        """Refuse, in one line each, what these settings ask that the engine does not do: an option it
        does not honour (declared with the option, decoding.py), or constraints without constrained search."""
        if constrained and decode.sample:
            raise UserInputError("terminology constraints need beam search; they cannot be sampled (decode.sample)")
        engine = self._engine
        refused = [
            f"decode.{option.name}: {engine.title} has no {lacking}; leave it out, or {engine.instead}"
            for option, lacking in refusals(decode, engine.name, given=set(given))
        ]
        if constrained and not engine.constrained_search:
            refused.append(f"terminology constraints: {engine.title} has no constrained search; {engine.instead}")
        if refused:
            raise UserInputError("\n".join(refused))

    def plan(
        self,
        lines: list[str],
        decode: DecodeConfig,
        *,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        names: Names = Names(),
    ) -> list[LinePlan]:
        """Each line's pieces, length limit and hypotheses (admission.py), or UserInputError naming a
        line the engine cannot translate whole, or guidance its vocabulary cannot spell."""
        return plan_translation(self._engine, lines, decode, prefixes=prefixes, constraints=constraints, names=names)

    def plan_scoring(self, sources: list[str], targets: list[str], *, names: Names = Names()) -> list[LinePlan]:
        return plan_scoring(self._engine, sources, targets, names=names)

    def unspellable(self, phrase: str) -> str:
        """Why the target vocabulary cannot spell `phrase` ("" if it can)."""
        return unspellable(self._engine, phrase)

    def translate(self, lines: list[str], **options: Any) -> list[str]:
        """The best translation of each line, e.g. translate(lines, beam=5); the guidance keywords of
        translate_nbest apply."""
        return [t.text for t in self.translate_nbest(lines, **{**options, "nbest": 1})]

    def translate_nbest(
        self,
        lines: list[str],
        *,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        glossary: Glossary | None = None,
        **options: Any,
    ) -> list[Translation]:
        """Up to `nbest` (text, score) pairs per line, best first; scores are length-normalised log-probabilities.

        prefixes: per line, the target text its output starts with ("" for none: interactive
        translation, continuing a post-editor's words). constraints: per line, target phrases its
        output must contain; glossary: a Glossary whose terms apply to the lines that contain their
        source term (both checkpoint only)."""
        lines = list(lines)
        return self.translate_with(
            lines,
            self.settings(**options),
            prefixes=prefixes,
            constraints=merged_constraints(lines, constraints, glossary),
        )

    def score(self, sources: list[str], targets: list[str], **options: Any) -> list[PairScore]:
        """How likely the model finds each given target for its source (force-decoding): per-piece
        log-probabilities and their length-normalised sum, e.g. to filter noisy pairs or rerank."""
        return self.score_with(list(sources), list(targets), self.settings(**options))

    def score_with(
        self, sources: list[str], targets: list[str], decode: DecodeConfig, *, deadline: float | None = None
    ) -> list[PairScore]:
        """Score with a complete decode config (overrides already applied); a pair the model cannot
        place whole is refused, never scored in part."""
        if len(sources) != len(targets):
            raise UserInputError(f"{len(sources)} sources but {len(targets)} targets; expected equal counts")
        self.plan_scoring(sources, targets)
        return self._engine.score(sources, targets, decode, deadline=deadline)

    def translate_with(
        self,
        lines: list[str],
        decode: DecodeConfig,
        *,
        progress: bool = False,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        line_numbers: list[int] | None = None,
        deadline: float | None = None,
        names: Names = Names(),
    ) -> list[Translation]:
        """Translate with a complete decode config (overrides already applied) and per-line guidance.

        `line_numbers`: each line's index in its file or request (default: its place in `lines`):
        sampled lines draw from a generator of their own, derived from the seed and that index, so
        their samples never depend on the other lines of a call. `deadline`: a time.monotonic() past
        which the work stops (engine.DeadlinePassed). `names` name the lines in errors."""
        for name, given in (("prefixes", prefixes), ("constraints", constraints), ("line_numbers", line_numbers)):
            if given is not None and len(given) != len(lines):
                raise UserInputError(f"{name}: {len(given)} given for {len(lines)} lines; expected one per line")
        if constraints is not None and not any(constraints):
            constraints = None
        self.check_supported(decode, constrained=constraints is not None)
        self.plan(lines, decode, prefixes=prefixes, constraints=constraints, names=names)
        return self._engine.translate(
            lines,
            decode,
            progress,
            prefixes=prefixes,
            constraints=constraints,
            line_numbers=line_numbers,
            deadline=deadline,
        )


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
            if path is not None and not path.is_file():
                problem = "is a directory" if path.is_dir() else "file not found"
                raise UserInputError(f"{option} {path}: {problem}; expected a text file with one line per input line")
        return Glossary.load(self.glossary) if self.glossary is not None else None

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
) -> list[Path]:
    """`seq2seq translate`: `model` is a checkpoint, an exported directory or a list of checkpoints (an
    ensemble); `source` and `output` are paths or "-" (stdin, stdout). With n-best > 1 each line
    becomes `index ||| text ||| score` lines. Returns the attention plots written, if asked for."""
    if source != "-" and not Path(source).is_file():
        problem = "is a directory" if Path(source).is_dir() else "file not found"
        raise UserInputError(f"{source}: {problem}; expected a text file with one sentence per line (or - for stdin)")
    if output != "-":
        check_writable(output)
    if attention_plot is not None and attention_plot.exists() and not attention_plot.is_dir():
        raise UserInputError(f"--attention-plot {attention_plot}: is a file; expected a folder for the PNG files")
    glossary = guides.check()
    translator = Translator.load(model, device=device)
    decode = translator.settings(decode_overrides)
    if attention_plot is not None and translator.bundle is None:
        raise UserInputError(f"--attention-plot: {model} is not one checkpoint; attention maps need one")
    guided = guides != LineGuides()
    if guides.constraints is not None or glossary is not None:
        translator.check_supported(decode, constrained=True)
    if glossary is not None:
        guides.check_spelling(glossary, translator)
    names = guides.names(source)
    if source != "-" and (guided or translator.max_positions is not None):  # a line it would refuse: before any work
        for chunk, first in _numbered(chunked(guides.aligned(read_lines(source)), FILE_CHUNK_LINES)):
            lines, prefixes, constraints = _guidance(chunk, glossary, guided=guided)
            translator.plan(
                lines, decode, prefixes=prefixes, constraints=constraints, names=dataclasses.replace(names, first=first)
            )
    lines_in = decode_lines(sys.stdin.buffer, "<stdin>") if source == "-" else read_lines(source)
    rows = guides.aligned(lines_in)
    chunks = ([row] for row in rows) if stream else chunked(rows, FILE_CHUNK_LINES)
    first_chunk = next(chunks, [])
    bar = progress_bar(desc="translate", unit="sent", enabled=not (source == "-" or stream))
    results = (
        result
        for chunk, first in _numbered(itertools.chain([first_chunk], chunks))
        for result in _translated(
            translator, chunk, decode, bar, glossary, guided=guided, names=dataclasses.replace(names, first=first)
        )
    )
    with _output(output) as sink:
        for index, result in enumerate(results):
            if decode.nbest > 1:  # an empty input line keeps its row: the empty translation
                sink.writelines(f"{index} ||| {text} ||| {value:.4f}\n" for text, value in result.nbest or [("", 0.0)])
            else:
                sink.write(result.text + "\n")
            if stream:
                sink.flush()
    bar.close()
    if attention_plot is None or not first_chunk:
        return []
    from seq2seq.inference.attention_plot import ATTENTION_PLOT_LINES, plot_attention  # matplotlib when asked

    lines = [line for line, _, _ in first_chunk[:ATTENTION_PLOT_LINES]]
    return plot_attention(translator.bundle.model, translator.bundle.tokenizer, lines, attention_plot, decode)


def score_file(
    model: Path,
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
    counted before the model is loaded and read a chunk at a time."""
    counts = [sum(1 for _ in read_lines(path)) for path in (src, tgt)]
    if counts[0] != counts[1]:
        raise UserInputError(f"{tgt}: has {counts[1]} lines but {src} has {counts[0]}; expected one target per source")
    if output != "-":
        check_writable(output)
    translator = Translator.load(model, device=device)
    decode = translator.settings(decode_overrides)
    names = Names(line=f"{src} and {tgt}, line {{number}}")
    if translator.max_positions is not None:  # a pair it would refuse: before any work
        for chunk, first in _numbered(chunked(zip(read_lines(src), read_lines(tgt)), FILE_CHUNK_LINES)):
            translator.plan_scoring(
                [s for s, _ in chunk], [t for _, t in chunk], names=dataclasses.replace(names, first=first)
            )
    pairs = chunked(zip(read_lines(src), read_lines(tgt)), FILE_CHUNK_LINES)
    with (
        _output(output) as sink,
        progress_bar(total=counts[0], desc="score", unit="pair", enabled=output != "-") as bar,
    ):
        for chunk in pairs:
            for pair in translator.score_with([s for s, _ in chunk], [t for _, t in chunk], decode):
                extra = "\t" + " ".join(f"{value:.4f}" for value in pair.log_probs) if per_token else ""
                sink.write(f"{pair.score:.4f}\t{pair.log_prob:.4f}\t{len(pair.log_probs)}{extra}\n")
            bar.update(len(chunk))


@contextlib.contextmanager
def _output(output: str) -> Iterator[TextIO]:
    """stdout, or a file that appears under its name only once every line is written."""
    if output == "-":
        yield sys.stdout
        return
    with atomic_write(output) as handle:
        text = io.TextIOWrapper(handle, encoding="utf-8", write_through=True)
        yield text
        text.detach()  # atomic_write closes the file


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
    decode: DecodeConfig,
    bar: tqdm,
    glossary: Glossary | None,
    *,
    guided: bool,
    names: Names,
) -> Iterator[Translation]:
    lines, prefixes, constraints = _guidance(rows, glossary, guided=guided)
    numbers = list(range(names.first, names.first + len(lines)))  # a sampled line draws by its line in the file
    results = translator.translate_with(
        lines, decode, prefixes=prefixes, constraints=constraints, line_numbers=numbers, names=names
    )
    bar.update(len(lines))
    return iter(results)

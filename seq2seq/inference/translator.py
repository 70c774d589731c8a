"""The Python API for using a trained model, and `seq2seq translate` on top of it.

    from seq2seq import Translator
    translator = Translator.load("runs/bible/checkpoints/best.pt")   # or an exported directory
    translator.translate(["In the beginning God created the heavens and the earth."], beam=5)

A checkpoint (a .pt file) is decoded by our PyTorch search; a directory written by `seq2seq export`
by CTranslate2. Both take the same decode settings (the model's `decode` section, overridable per
call) and return the same `Translation` objects, so everything above (`translate`, `eval`, the
parity gate) works with either. This module imports neither torch nor ctranslate2: `load` brings in
the engine the path needs.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from seq2seq.config import DecodeConfig, decode_config_from, decode_config_with
from seq2seq.data.sources import chunked, decode_lines, read_lines
from seq2seq.errors import UserInputError
from seq2seq.files import atomic_write, check_writable
from seq2seq.inference.engine import EXPORT_METADATA, Engine, PairScore, Translation

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

    @classmethod
    def load(cls, path: str | Path, *, device: str | None = None) -> Translator:
        """A checkpoint file (PyTorch) or a directory from `seq2seq export` (CTranslate2)."""
        path = Path(path)
        if path.is_dir():
            if not (path / EXPORT_METADATA).is_file():
                raise UserInputError(f"{path}: not an exported model (no {EXPORT_METADATA}); expected a checkpoint "
                                     "file (.pt) or a directory written by `seq2seq export`")  # fmt: skip
            from seq2seq.inference.ctranslate2_engine import load_exported

            decode, engine = load_exported(path, device=device)
            return cls(decode, engine)
        import torch

        from seq2seq.checkpoint import load_for_inference

        bundle = load_for_inference(path, device or ("cuda" if torch.cuda.is_available() else "cpu"))
        return cls.from_model(bundle.model, bundle.tokenizer, bundle.config.decode, bundle=bundle)

    @classmethod
    def from_model(cls, model: Any, tokenizer: Any, decode: DecodeConfig, *, bundle: Any = None) -> Translator:
        """Our PyTorch model in memory (validation translates with the model being trained)."""
        from seq2seq.inference.pytorch_engine import PyTorchEngine

        return cls(decode, PyTorchEngine(model, tokenizer), bundle=bundle)

    def settings(self, overrides: Iterable[str] = (), **options: Any) -> DecodeConfig:
        """The decode defaults with `decode.KEY=VALUE` overrides, then typed keyword options (beam=5, nbest=2, ...)."""
        decode = decode_config_with(self.decode, list(overrides)) if overrides else self.decode
        typed = {key: value for key, value in options.items() if value is not None}
        return decode_config_from(decode, typed, origin="options") if typed else decode

    def translate(self, lines: list[str], **options: Any) -> list[str]:
        """The best translation of each line, e.g. translate(lines, beam=5)."""
        return [t.text for t in self.translate_nbest(lines, **{**options, "nbest": 1})]

    def translate_nbest(self, lines: list[str], **options: Any) -> list[Translation]:
        """Up to `nbest` (text, score) pairs per line, best first; scores are length-normalised log-probabilities."""
        return self.translate_with(list(lines), self.settings(**options))

    def score(self, sources: list[str], targets: list[str], **options: Any) -> list[PairScore]:
        """How likely the model finds each given target for its source (force-decoding): per-piece
        log-probabilities and their length-normalised sum, e.g. to filter noisy pairs or rerank."""
        return self.score_with(list(sources), list(targets), self.settings(**options))

    def score_with(self, sources: list[str], targets: list[str], decode: DecodeConfig) -> list[PairScore]:
        """Score with a complete decode config (overrides already applied)."""
        if len(sources) != len(targets):
            raise UserInputError(f"{len(sources)} sources but {len(targets)} targets; expected equal counts")
        return self._engine.score(sources, targets, decode)

    def translate_with(self, lines: list[str], decode: DecodeConfig, *, progress: bool = False) -> list[Translation]:
        """Translate with a complete decode config (overrides already applied)."""
        return self._engine.translate(lines, decode, progress)


def translate_file(
    model: Path,
    *,
    source: str,
    output: str,
    decode_overrides: list[str],
    stream: bool,
    device: str | None = None,
    attention_plot: Path | None = None,
) -> list[Path]:
    """`seq2seq translate`: `model` is a checkpoint or an exported directory; `source` and `output` are
    paths or "-" (stdin, stdout). With n-best > 1 each line becomes `index ||| text ||| score` lines.
    Returns the attention plots written, if asked for."""
    if source != "-" and not Path(source).is_file():
        problem = "is a directory" if Path(source).is_dir() else "file not found"
        raise UserInputError(f"{source}: {problem}; expected a text file with one sentence per line (or - for stdin)")
    if output != "-":
        check_writable(output)
    if attention_plot is not None and attention_plot.exists() and not attention_plot.is_dir():
        raise UserInputError(f"--attention-plot {attention_plot}: is a file; expected a folder for the PNG files")
    translator = Translator.load(model, device=device)
    decode = translator.settings(decode_overrides)
    if attention_plot is not None and translator.bundle is None:
        raise UserInputError(f"--attention-plot: {model} is an exported model; attention maps need the checkpoint")
    lines_in = decode_lines(sys.stdin.buffer, "<stdin>") if source == "-" else read_lines(source)
    chunks = ([line] for line in lines_in) if stream else chunked(lines_in, FILE_CHUNK_LINES)
    first_chunk = next(chunks, [])
    bar = tqdm(desc="translate", unit="sent", disable=source == "-" or stream)
    results = (result for chunk in itertools.chain([first_chunk], chunks)
               for result in _translated(translator, chunk, decode, bar))  # fmt: skip
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

    return plot_attention(translator.bundle.model, translator.bundle.tokenizer, first_chunk[:ATTENTION_PLOT_LINES],
                          attention_plot, decode)  # fmt: skip


def score_file(model: Path, *, src: Path, tgt: Path, output: str, decode_overrides: list[str], per_token: bool,
               device: str | None = None) -> None:  # fmt: skip
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
    pairs = chunked(zip(read_lines(src), read_lines(tgt)), FILE_CHUNK_LINES)
    with _output(output) as sink, tqdm(total=counts[0], desc="score", unit="pair", disable=output == "-") as bar:
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


def _translated(translator: Translator, lines: list[str], decode: DecodeConfig, bar: tqdm) -> Iterator[Translation]:
    results = translator.translate_with(lines, decode)
    bar.update(len(lines))
    return iter(results)

"""Translate lines of text: encode, sort into token-budgeted batches, search, detokenize, restore order;
and `translate_file`, the whole of `seq2seq translate` (checkpoint in, text or n-best lines out)."""

from __future__ import annotations

import contextlib
import itertools
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from seq2seq.checkpoint import load_for_inference
from seq2seq.config import DecodeConfig, decode_config_with
from seq2seq.data.batching import pad, token_batches
from seq2seq.data.sources import chunked, decode_lines, normalize, read_lines
from seq2seq.search import search
from seq2seq.tokenizer import Tokenizer

# A file is read, translated and written this many lines at a time, so memory stays flat however
# long it is; within a chunk, lines are sorted by length into batches.
FILE_CHUNK_LINES = 10_000


@dataclass(frozen=True)
class Translation:
    """The n best outputs of one input line, best first, as (text, score) pairs."""

    nbest: list[tuple[str, float]]

    @property
    def text(self) -> str:
        return self.nbest[0][0] if self.nbest else ""


def translate_lines(
    model: torch.nn.Module,
    tokenizer: Tokenizer,
    lines: list[str],
    config: DecodeConfig,
    *,
    progress: bool = False,
) -> list[Translation]:
    """Translate many lines at once; output order equals input order."""
    device = next(model.parameters()).device
    texts = [normalize(line) for line in lines]
    non_empty = np.array([i for i, text in enumerate(texts) if text], dtype=np.int64)
    encoded = tokenizer.encode_src([texts[i] for i in non_empty])
    lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
    results: list[Translation] = [Translation([]) for _ in lines]  # an empty line stays empty
    batches = token_batches(lengths, max_tokens=config.batch_tokens)
    with tqdm(total=len(lines), desc="translate", unit="sent", disable=not progress, leave=False) as bar:
        bar.update(len(lines) - len(non_empty))
        for indices in batches:
            src = pad([encoded[i] for i in indices]).to(device)
            for index, hyps in zip(non_empty[indices].tolist(), search(model, src, config)):
                results[index] = Translation([(tokenizer.decode_tgt(h.tokens), h.score) for h in hyps])
            bar.update(len(indices))
    return results


def translate_stream(
    model: torch.nn.Module, tokenizer: Tokenizer, lines: Iterable[str], config: DecodeConfig
) -> Iterator[Translation]:
    """Translate one line at a time as it arrives (interactive use through pipes)."""
    for line in lines:
        yield translate_lines(model, tokenizer, [line.rstrip("\n")], config)[0]


def translate_file(
    checkpoint: Path,
    *,
    source: str,
    output: str,
    decode_overrides: list[str],
    stream: bool,
    device: torch.device,
    attention_plot: Path | None = None,
) -> list[Path]:
    """`seq2seq translate`: `source` and `output` are paths or "-" (stdin, stdout). With n-best > 1 each
    line becomes `index ||| text ||| score` lines. Returns the attention plots written, if asked for."""
    bundle = load_for_inference(checkpoint, device)
    decode = decode_config_with(bundle.config.decode, decode_overrides)
    lines_in = decode_lines(sys.stdin.buffer, "<stdin>") if source == "-" else read_lines(source)
    first_lines: list[str] = []
    if stream:
        results = translate_stream(bundle.model, bundle.tokenizer, lines_in, decode)
    else:
        chunks = chunked(lines_in, FILE_CHUNK_LINES)
        first_lines = next(chunks, [])
        chunks = itertools.chain([first_lines], chunks)
        bar = tqdm(desc="translate", unit="sent", disable=source == "-")
        results = (result for chunk in chunks for result in _translate_chunk(bundle, chunk, decode, bar))
    with contextlib.nullcontext(sys.stdout) if output == "-" else open(output, "w", encoding="utf-8") as sink:
        for index, result in enumerate(results):
            if decode.nbest > 1:
                sink.writelines(f"{index} ||| {text} ||| {value:.4f}\n" for text, value in result.nbest)
            else:
                sink.write(result.text + "\n")
            if stream:
                sink.flush()
    if attention_plot is None or not first_lines:
        return []
    from seq2seq.plots import plot_attention  # matplotlib only when asked for

    return plot_attention(bundle.model, bundle.tokenizer, first_lines[:5], attention_plot)


def _translate_chunk(bundle, lines: list[str], decode: DecodeConfig, bar: tqdm) -> list[Translation]:
    results = translate_lines(bundle.model, bundle.tokenizer, lines, decode)
    bar.update(len(lines))
    return results

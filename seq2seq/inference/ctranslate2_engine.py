"""CTranslate2 as the engine of an exported model, running the beam search our engine runs.

Both engines take 2 x beam candidates a step, end a hypothesis when EOS is among the best `beam`,
end a sentence when beam x patience hypotheses have ended or at its length limit a * source length
+ b (where its best `beam` candidates all end), and rank by log-probability / length^alpha: the
settings map one to one onto CTranslate2's options, so the float32 parity gate checks the export,
not two algorithms (tests/deploy/test_export.py: equal n-best lists under every setting). `gnmt`
((5 + len) / 6)^alpha is the exception: CTranslate2 has no such option, so its beam keeps the
finished hypotheses that length^alpha ranks best and they are re-ranked here by gnmt. A target
prefix goes in as CTranslate2's `target_prefix`, scored as our search scores it (the chosen tokens'
log-probability over the whole output's length); terminology constraints and ensembles have no
CTranslate2 form (its issues #739, #273) and are refused with one line.

The exported model has a table of positions (`max_positions`, in its metadata): CTranslate2 would
cut a longer source without a word and fail on a longer output, so admission.py refuses such a
line before any work and CTranslate2's own truncation is switched off. Sampling draws from
CTranslate2's generators, one per worker thread, which a call's seed does not reset (its issue
#1757): samples are not reproducible, so an explicit seed is refused rather than promised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ctranslate2
import sentencepiece as spm

from seq2seq.config import Config
from seq2seq.config_files import config_from_dict
from seq2seq.data.sources import normalize
from seq2seq.data.special_tokens import NEVER_EMITTED
from seq2seq.decoding import DecodeConfig, guidance_limit
from seq2seq.errors import UserInputError
from seq2seq.inference.devices import ctranslate2_placement
from seq2seq.inference.engine import (
    EXPORT_METADATA,
    DeadlinePassed,
    Engine,
    LinesDone,
    PairScore,
    Translation,
    read_export_metadata,
)

NEGLIGIBLE_EXPONENT = 1e-9  # length^1e-9 is 1 within 1e-8 relative: the order of raw log-probabilities
SMALLEST_POSITION_TABLE = 1024  # CTranslate2's own default input limit
SHORTLIST_FILE = "vmap.txt"  # where CTranslate2 looks for a model's vocabulary map (its use_vmap)

# Where load_exported says that an export computes in another type than its weights' (float16 on a
# CPU): a logger of its own, which the export's parity gate mutes, since its parity line says so.
compute_type_note = logging.getLogger(f"{__name__}.compute_type")


def position_table_size(config: Config) -> int:
    """The positions an export holds by default: the longest training sentence and the longest output
    allowed for it, and at least SMALLEST_POSITION_TABLE."""
    data, decode = config.data, config.decode
    return max(SMALLEST_POSITION_TABLE, int(data.max_length * max(1.0, decode.max_len_a)) + decode.max_len_b + 2)


# What CTranslate2 says when it cannot run on the GPU it was given: no driver, an older driver than
# its CUDA, or not the CUDA libraries its wheel was built against (it loads cuBLAS at the first product).
CUDA_FAILURE = re.compile(r"CUDA|cuBLAS|cuDNN|Library \S+ is not found", re.IGNORECASE)


class GpuUnusable(UserInputError):
    """CTranslate2 was given a GPU that it cannot use here: a set-up problem, said in one line."""

    def __init__(self, cause: str) -> None:
        self.cause = cause
        super().__init__(
            f"CTranslate2 cannot use the GPU here ({cause}); translate on the CPU (--device cpu), or give it "
            "the CUDA libraries its wheel needs (docs/performance.md, GPU)"
        )


@contextlib.contextmanager
def gpu_failures_named(device: str):
    """CTranslate2's errors about CUDA on a GPU device raised as GpuUnusable; any other goes on."""
    try:
        yield
    except RuntimeError as error:
        if device == "cpu" or not CUDA_FAILURE.search(str(error)):
            raise
        raise GpuUnusable(str(error)) from None


@contextlib.contextmanager
def _ctranslate2_warnings_held():
    """CTranslate2's own log lines (its format, not ours) held back while a model loads: the one it
    writes there, of weights converted to another compute type, load_exported says in ours."""
    level = ctranslate2.get_log_level()
    ctranslate2.set_log_level(logging.ERROR)
    try:
        yield
    finally:
        ctranslate2.set_log_level(level)


def weights_format(compute_type: str) -> str:
    """The weights' format of a CTranslate2 compute type: int8_float32 computes int8 weights, as int8 does."""
    return compute_type.split("_")[0]


def load_exported(directory: Path, *, device: str | None = None) -> tuple[DecodeConfig, Engine]:
    """The exported model's decode defaults and an engine that translates with it."""
    metadata = read_export_metadata(directory)
    missing = [key for key in ("config", "tokenizer") if key not in metadata]
    if missing:
        raise UserInputError(f"{directory / EXPORT_METADATA}: lacks {', '.join(missing)}; re-export the checkpoint")
    config = config_from_dict(metadata["config"], origin=f"{directory} (stored config)")
    try:
        placement = ctranslate2_placement(device, ctranslate2.get_cuda_device_count())
        with gpu_failures_named(placement["device"]), _ctranslate2_warnings_held():
            runtime = ctranslate2.Translator(str(directory), **placement, **_threads(placement["device"]))
        models = metadata["tokenizer"]  # {"src": file, "tgt": file}
        src = spm.SentencePieceProcessor(model_file=str(directory / models["src"]))
        tgt = spm.SentencePieceProcessor(model_file=str(directory / models["tgt"]))
    except (RuntimeError, OSError, KeyError, TypeError) as error:
        raise UserInputError(f"{directory}: not a loadable exported model ({type(error).__name__}: {error})") from None
    quantization = metadata.get("quantization", runtime.compute_type)
    if weights_format(runtime.compute_type) != weights_format(quantization):
        compute_type_note.info(
            "%s: the %s export computes in %s on the %s (CTranslate2 has no %s kernels for it)",
            *(directory, quantization, runtime.compute_type, placement["device"].upper(), quantization),
        )
    positions = metadata.get("max_positions") or position_table_size(config)  # an export from before the record
    shortlisted = (directory / SHORTLIST_FILE).is_file()
    return config.decode, CTranslate2Engine(runtime, src, tgt, max_positions=positions, shortlisted=shortlisted)


class CTranslate2Engine:
    """engine.Engine over an exported model: CTranslate2 with the model's SentencePiece models."""

    name, title = "ctranslate2", "CTranslate2"
    instead = "translate with the checkpoint (.pt) instead of the exported model"
    constrained_search = False  # its issue #739

    def __init__(
        self,
        runtime: ctranslate2.Translator,
        src: spm.SentencePieceProcessor,
        tgt: spm.SentencePieceProcessor,
        *,
        max_positions: int,
        shortlisted: bool = False,
    ) -> None:
        self.runtime, self.src, self.tgt, self.shortlisted = runtime, src, tgt, shortlisted
        self.source_model, self.target_model, self.max_positions = src, tgt, max_positions
        self.never_emitted = [[tgt.id_to_piece(token)] for token in NEVER_EMITTED]  # as our search bans them

    @property
    def computes_in(self) -> str:
        """The compute type CTranslate2 chose on this device: it converts one that the device has no
        kernels for (float16 on a CPU, int16 on a CPU without them) and says so only in a log line."""
        return self.runtime.compute_type

    def translate(
        self,
        lines: list[str],
        decode: DecodeConfig,
        *,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        line_numbers: list[int] | None = None,
        deadline: float | None = None,
        progress: LinesDone | None = None,
    ) -> list[Translation]:
        """`line_numbers` is not used: CTranslate2's samples do not depend on a line's index (nor repeat)."""
        if constraints:  # Translator refuses them before they get here
            raise ValueError("CTranslate2 has no constrained search")
        texts = [normalize(line) for line in lines]
        rows = [index for index, text in enumerate(texts) if text]  # an empty line stays empty
        pieces = self.src.encode([texts[index] for index in rows], out_type=str)
        forced = self.tgt.encode([normalize(prefixes[index]) for index in rows], out_type=str) if prefixes else None
        limits = [decode.output_limit(len(sentence) + 1) for sentence in pieces]  # + the EOS CTranslate2 adds
        if forced is not None:
            limits = [guidance_limit(limit, len(prefix)) for limit, prefix in zip(limits, forced)]
        done = progress or (lambda _count: None)
        done(len(lines) - len(rows))
        with gpu_failures_named(self.runtime.device):
            outputs = _translate(
                self.runtime,
                pieces,
                limits,
                decode,
                forced,
                self.never_emitted,
                deadline=deadline,
                shortlisted=self.shortlisted,
                done=done,
            )
        results = [Translation([]) for _ in lines]
        for position, output in enumerate(outputs):
            nbest = [(self.tgt.decode(tokens), score) for tokens, score in zip(output.hypotheses, output.scores)]
            results[rows[position]] = Translation(nbest)
        return results

    def score(
        self,
        sources: list[str],
        targets: list[str],
        decode: DecodeConfig,
        *,
        deadline: float | None = None,
        progress: LinesDone | None = None,
    ) -> list[PairScore]:
        """CTranslate2's score_batch: the log-probability of each target piece and of the EOS after
        them. The pairs go in by length, in calls of at most decode.batch_tokens tokens (as score_batch
        would cut one call of them all), so that `progress` hears of each call's pairs as it returns and
        `deadline` is checked between calls (_submitted)."""
        src = self.src.encode([normalize(line) for line in sources], out_type=str)
        tgt = self.tgt.encode([normalize(line) for line in targets], out_type=str)
        by_length = sorted(range(len(src)), key=lambda index: (len(src[index]), len(tgt[index])))
        spans = _spans([len(src[index]) + len(tgt[index]) + 2 for index in by_length], decode.batch_tokens)
        results: list = [None] * len(src)
        done = progress or (lambda _count: None)

        def submit(members: list[int]) -> list:
            return self.runtime.score_batch(
                [src[index] for index in members],
                [tgt[index] for index in members],
                max_batch_size=decode.batch_tokens,
                batch_type="tokens",
                max_input_length=0,
                asynchronous=True,
            )

        def collect(members: list[int], pending: list) -> None:
            for index, result in zip(members, pending):
                results[index] = result.result()
            done(len(members))

        with gpu_failures_named(self.runtime.device):
            _submitted(self.runtime, [by_length[start:end] for start, end in spans], submit, collect, deadline)
        return [
            PairScore(
                [*pieces, "</s>"],
                list(result.log_probs),
                decode.normalized_score(sum(result.log_probs), len(result.log_probs)),
            )
            for pieces, result in zip(tgt, results)
        ]


def _translate(
    engine: ctranslate2.Translator,
    pieces: list[list[str]],
    limits: list[int],
    decode: DecodeConfig,
    prefixes: list[list[str]] | None,
    suppressed: list[list[str]],
    *,
    deadline: float | None = None,
    shortlisted: bool = False,
    done: LinesDone,
) -> list:
    """CTranslate2's outputs in input order, each with `hypotheses` and `scores`, best first;
    `suppressed`: the pieces no output may hold, each a sequence of one; `shortlisted`: over the
    model's vocabulary map (the union of a batch's lines' shortlists); `done` told of each line as
    all its draws are back.

    CTranslate2 runs our search: 2 x beam candidates a step, a hypothesis ends when EOS is among
    the best `beam`, a sentence ends when beam x patience have, and they are ranked by log-probability
    / length^alpha. Its length_penalty 0 would switch to another stopping rule (stop when the best
    beam ends), so `none` runs with a negligible exponent instead. It takes one length limit per call,
    and a beam search run with a larger limit is not the same search (beams our search ends at the
    limit live on), so sentences go in calls of one limit and at most decode.batch_tokens tokens.

    Calls go in as the workers take them (_submitted); where CTranslate2 offers it, greedy and
    sampled decoding also stop at the step that passes the `deadline`."""
    exponent = _ctranslate2_exponent(decode)
    search = {**_search_options(decode, deadline), "length_penalty": exponent, "use_vmap": shortlisted,
              "suppress_sequences": suppressed}  # fmt: skip
    draws = decode.nbest if decode.sample else 1  # a sampled line goes in nbest times, one draw each
    by_limit: dict[int, list[int]] = defaultdict(list)
    for position, limit in enumerate(limits):
        by_limit[limit].extend([position] * draws)
    calls = []  # (limit, its members)
    for limit, members in by_limit.items():
        spans = _spans([len(pieces[position]) + 1 for position in members], decode.batch_tokens)
        calls += [(limit, members[start:end]) for start, end in spans]
    finished: list[list] = [[] for _ in pieces]  # per line: (tokens, score) of its hypotheses or draws
    outstanding = [draws] * len(pieces)  # per line: its calls not yet back

    def submit(call: tuple[int, list[int]]) -> list:
        limit, members = call
        prefix = {"target_prefix": [prefixes[position] or None for position in members]} if prefixes else {}
        return engine.translate_batch(
            [pieces[position] for position in members], **prefix, asynchronous=True, **search, max_decoding_length=limit
        )

    def collect(call: tuple[int, list[int]], pending: list) -> None:
        for position, result in zip(call[1], pending):
            output = result.result()
            finished[position].extend(zip(output.hypotheses, output.scores))
            outstanding[position] -= 1
            if not outstanding[position]:
                done(1)

    _submitted(engine, calls, submit, collect, deadline)
    return [_ranked(found, decode, limit, exponent) for found, limit in zip(finished, limits)]


def _submitted(
    engine: ctranslate2.Translator,
    calls: list,
    submit: Callable[[Any], list],
    collect: Callable[[Any, list], None],
    deadline: float | None,
) -> None:
    """Each call submitted (asynchronously) as CTranslate2's workers take them and collected, oldest
    first: two per worker in flight, the oldest collected before the next goes in, so that work is
    counted done as it finishes (submitting all at once blocked until most of it was done). A
    submitted call cannot be taken back, so with a `deadline` one call per worker is in flight, and
    the deadline is checked before each call goes in and once all are back (a decoding stopped at it
    returned part of its output)."""
    in_flight: deque = deque()  # (call, its pending results), submitted and not yet collected
    window = engine.num_translators * (1 if deadline is not None else 2)
    for call in calls:
        if len(in_flight) >= window:
            collect(*in_flight.popleft())
        _check(deadline)
        in_flight.append((call, submit(call)))
    while in_flight:
        collect(*in_flight.popleft())
    _check(deadline)


def _search_options(decode: DecodeConfig, deadline: float | None) -> dict:
    """translate_batch's options for these settings (all but the length limit and the exponent)."""
    if decode.sample:
        search = {
            "beam_size": 1,
            "num_hypotheses": 1,
            "sampling_topk": decode.top_k,
            "sampling_topp": decode.top_p,
            "sampling_temperature": decode.temperature,
        }
    else:
        search = {"beam_size": decode.beam, "patience": decode.patience, "num_hypotheses": decode.beam}
    if deadline is not None and search["beam_size"] == 1:
        search["callback"] = lambda step: time.monotonic() > deadline
    return {
        **search,
        "return_scores": True,
        "min_decoding_length": decode.min_len,
        "no_repeat_ngram_size": decode.no_repeat_ngram,
        "max_batch_size": decode.batch_tokens,
        "batch_type": "tokens",
        "max_input_length": 0,  # admission.py refuses what the positions cannot hold: never cut silently
    }


def _spans(lengths: list[int], budget: int | None) -> list[tuple[int, int]]:
    """Consecutive (start, end) runs of items whose lengths sum to at most `budget` (one run without one)."""
    if budget is None:
        return [(0, len(lengths))] if lengths else []
    spans, start, total = [], 0, 0
    for index, length in enumerate(lengths):
        if total and total + length > budget:
            spans.append((start, index))
            start, total = index, 0
        total += length
    return [*spans, (start, len(lengths))] if lengths else spans


def _check(deadline: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise DeadlinePassed


def _ctranslate2_exponent(decode: DecodeConfig) -> float:
    """CTranslate2's length_penalty for our normalisation. `gnmt` ((5 + length) / 6)^alpha has no
    CTranslate2 form: its beam ranks by length^alpha, and the hypotheses it returns are re-ranked by
    gnmt, so the two engines may differ there (docs/commands.md, export)."""
    exponent = {"power": decode.length_penalty, "gnmt": decode.length_penalty, "average": 1.0, "none": 0.0}
    return exponent[decode.length_norm] or NEGLIGIBLE_EXPONENT


@dataclass(frozen=True)
class _Ranked:
    hypotheses: list[list[str]]
    scores: list[float]


def _ranked(found: list[tuple[list[str], float]], decode: DecodeConfig, limit: int, exponent: float) -> _Ranked:
    """The nbest of CTranslate2's finished hypotheses (tokens, score), scored and ranked as our search
    scores them. Both count the EOS of a hypothesis that ended in the length; one cut at the limit
    (`limit` tokens) has none."""
    scored = []
    for tokens, score in found:
        length = len(tokens) if len(tokens) >= limit else len(tokens) + 1
        scored.append((decode.normalized_score(score * length**exponent, length), tokens))
    best = sorted(scored, key=lambda pair: -pair[0])[: decode.nbest]
    return _Ranked([tokens for _, tokens in best], [score for score, _ in best])


def _threads(device: str) -> dict[str, int]:
    """On CPU, one worker per core, each on one thread: batches are decoded side by side. CTranslate2's
    default (4 threads in one worker) oversubscribes small machines (benchmark_decode compares the
    settings; its figures are in the ledger)."""
    if device != "cpu":
        return {}
    return {"inter_threads": max(1, len(os.sched_getaffinity(0))), "intra_threads": 1}

"""CTranslate2 as the engine of an exported model: our decode settings mapped onto its options.

What matches our search exactly: beam size, n-best, the minimum length, n-gram blocking, the source
EOS and decoder start token, and the length limit a * source length + b for greedy search
(CTranslate2 takes one limit per call: all sentences go in one call with the largest limit, and those
that reach their own limit are translated again with it; in beam search a beam of a sentence that
ends below its limit may still have been cut differently). Length normalisation: `average` and
`none` map onto CTranslate2's length_penalty (1 and 0); `gnmt` ((5 + len) / 6)^alpha has no
CTranslate2 option, so the beam's finished hypotheses come back with raw log-probabilities and are
ranked here with our formula, as our beam search ranks them (on the Bible model's 500 validation
verses: beam-5 BLEU -0.03 against our decoder, where approximating it by len^alpha gave +0.21).
The parity gate of `seq2seq export` measures the result.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import ctranslate2
import sentencepiece as spm

from seq2seq.config import DecodeConfig, config_from_dict
from seq2seq.data.sources import normalize
from seq2seq.errors import UserInputError
from seq2seq.translator import EXPORT_METADATA, Translation, Translator, read_export_metadata

LENGTH_PENALTY_EXPONENT = {"average": lambda decode: 1.0, "none": lambda decode: 0.0,
                           "gnmt": lambda decode: decode.length_penalty}  # fmt: skip


def load_exported(directory: Path, *, device: str | None = None) -> Translator:
    metadata = read_export_metadata(directory)
    missing = [key for key in ("config", "tokenizer") if key not in metadata]
    if missing:
        raise UserInputError(f"{directory / EXPORT_METADATA}: lacks {', '.join(missing)}; re-export the checkpoint")
    config = config_from_dict(metadata["config"], origin=f"{directory} (stored config)")
    try:
        engine = ctranslate2.Translator(str(directory), device=device or "cpu", **_threads(device or "cpu"))
        models = metadata["tokenizer"]  # {"src": file, "tgt": file}
        src = spm.SentencePieceProcessor(model_file=str(directory / models["src"]))
        tgt = spm.SentencePieceProcessor(model_file=str(directory / models["tgt"]))
    except (RuntimeError, OSError, KeyError, TypeError) as error:
        raise UserInputError(f"{directory}: not a loadable exported model ({type(error).__name__}: {error})") from None

    def translate_with(lines: list[str], decode: DecodeConfig, progress: bool) -> list[Translation]:
        texts = [normalize(line) for line in lines]
        rows = [index for index, text in enumerate(texts) if text]  # an empty line stays empty
        pieces = src.encode([texts[index] for index in rows], out_type=str)
        limits = [_length_limit(len(sentence) + 1, decode) for sentence in pieces]  # + the EOS CTranslate2 adds
        outputs = _translate(engine, pieces, decode, max(limits, default=1))
        # One call for all (small per-limit calls are slow); a sentence that reached its own limit is
        # translated again with that limit, as our search would have stopped it there.
        redo: dict[int, list[int]] = defaultdict(list)
        for position, output in enumerate(outputs):
            if any(len(tokens) >= limits[position] for tokens in output.hypotheses):
                redo[limits[position]].append(position)
        for limit, members in redo.items():
            for position, output in zip(members, _translate(engine, [pieces[p] for p in members], decode, limit)):
                outputs[position] = output
        results = [Translation([]) for _ in lines]
        for position, output in enumerate(outputs):
            nbest = [(tgt.decode(tokens), score) for tokens, score in zip(output.hypotheses, output.scores)]
            results[rows[position]] = Translation(nbest)
        return results

    return Translator(config.decode, translate_with, engine="ctranslate2")


def _translate(engine: ctranslate2.Translator, pieces: list[list[str]], decode: DecodeConfig, limit: int) -> list:
    """CTranslate2's outputs: each with `hypotheses` (token lists) and `scores`, best first, at most nbest."""
    if not pieces:
        return []
    rerank = decode.length_norm == "gnmt" and decode.beam > 1
    outputs = engine.translate_batch(
        pieces,
        beam_size=decode.beam,
        num_hypotheses=decode.beam if rerank else decode.nbest,
        return_scores=True,
        max_decoding_length=limit,
        min_decoding_length=decode.min_len,
        length_penalty=0.0 if rerank else LENGTH_PENALTY_EXPONENT[decode.length_norm](decode),
        no_repeat_ngram_size=decode.no_repeat_ngram,
        max_batch_size=decode.batch_tokens,
        batch_type="tokens",
    )
    return [_reranked(output, decode) for output in outputs] if rerank else outputs


@dataclass(frozen=True)
class _Ranked:
    hypotheses: list[list[str]]
    scores: list[float]


def _reranked(output, decode: DecodeConfig) -> _Ranked:
    """GNMT length normalisation has no CTranslate2 option: the beam's finished hypotheses come back
    with their raw log-probabilities (length_penalty 0, the scores our beam search also ranks beams
    by) and are ranked here with our formula, as our search ranks its finished hypotheses."""
    scored = [(decode.normalized_score(score, len(tokens) + 1), tokens)  # + the EOS
              for tokens, score in zip(output.hypotheses, output.scores)]  # fmt: skip
    ranked = sorted(scored, key=lambda pair: -pair[0])
    best = ranked[: decode.nbest]
    return _Ranked([tokens for _, tokens in best], [score for score, _ in best])


def _threads(device: str) -> dict[str, int]:
    """On CPU, one worker per core, each on one thread: batches are decoded side by side. CTranslate2's
    default (4 threads in one worker) oversubscribes small machines; on 2 cores, beam 5 with the Bible
    model: int8 1,443 tokens/s by default, 1,559 with 2 threads, 2,659 with 2 workers of 1 thread."""
    if device != "cpu":
        return {}
    return {"inter_threads": max(1, len(os.sched_getaffinity(0))), "intra_threads": 1}


def _length_limit(source_length: int, decode: DecodeConfig) -> int:
    """search.max_output_lengths for one sentence (source length with its EOS)."""
    return max(1, int(decode.max_len_a * source_length + decode.max_len_b))

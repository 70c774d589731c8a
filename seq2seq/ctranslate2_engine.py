"""CTranslate2 as the engine of an exported model: our decode settings mapped onto its options.

What matches our search exactly: beam size, n-best, the minimum length, n-gram blocking, the source
EOS and decoder start token, and the length limit a * source length + b for greedy search
(CTranslate2 takes one limit per call: all sentences go in one call with the largest limit, and those
that reach their own limit are translated again with it; in beam search a beam of a sentence that
ends below its limit may still have been cut differently). What differs: length normalisation
`average` and `none` map exactly (length_penalty 1 and 0), but `gnmt` ((5 + len) / 6)^alpha has no
CTranslate2 equivalent and is approximated by len^alpha, which can rank finished beam hypotheses
differently; greedy search is unaffected. The parity gate of `seq2seq export` measures the result.
"""

from __future__ import annotations

from collections import defaultdict
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
        engine = ctranslate2.Translator(str(directory), device=device or "cpu")
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
    if not pieces:
        return []
    return engine.translate_batch(
        pieces,
        beam_size=decode.beam,
        num_hypotheses=decode.nbest,
        return_scores=True,
        max_decoding_length=limit,
        min_decoding_length=decode.min_len,
        length_penalty=LENGTH_PENALTY_EXPONENT[decode.length_norm](decode),
        no_repeat_ngram_size=decode.no_repeat_ngram,
        max_batch_size=decode.batch_tokens,
        batch_type="tokens",
    )


def _length_limit(source_length: int, decode: DecodeConfig) -> int:
    """search.max_output_lengths for one sentence (source length with its EOS)."""
    return max(1, int(decode.max_len_a * source_length + decode.max_len_b))

"""From a validated config to what training needs: a tokenizer (trained once) and encoded, filtered splits.

The training split is streamed: its text is never held in memory as a whole, and its token ids end
up memory-mapped from the encoding cache (data.cache_dir).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from seq2seq.config import Config
from seq2seq.data.cache import cache_key, load_cached, store
from seq2seq.data.encoded import EncodedCorpus, encode_pairs, filter_corpus
from seq2seq.data.sources import PairCounts, ParallelText, iter_pairs, read_corpus
from seq2seq.errors import UserInputError
from seq2seq.tokenizer import Tokenizer, train_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingData:
    train: EncodedCorpus
    valid: EncodedCorpus
    valid_text: ParallelText  # raw sentences: BLEU is computed on detokenized text


def stream_split(config: Config, split: str, counts: PairCounts | None = None):
    corpus = getattr(config.data, split)
    return iter_pairs(
        corpus, src_lang=config.data.src_lang, tgt_lang=config.data.tgt_lang, key=f"data.{split}", counts=counts
    )


def read_split(config: Config, split: str) -> ParallelText:
    corpus = getattr(config.data, split)
    text = read_corpus(corpus, src_lang=config.data.src_lang, tgt_lang=config.data.tgt_lang, key=f"data.{split}")
    if not len(text):
        raise UserInputError(f"data.{split}: no sentence pairs found (empty file, or every pair had an empty side)")
    return text


def load_or_train_tokenizer(config: Config, directory: Path) -> Tokenizer:
    """Reuse the tokenizer in `directory` if present, otherwise train it on the training split and save it."""
    if directory.exists() and any(directory.glob("*.model")):
        return Tokenizer.load(directory)
    tokenizer = train_tokenizer(config.tokenizer, stream_split(config, "train"), seed=config.train.seed)
    tokenizer.save(directory)
    log.info("trained tokenizer: %d source / %d target pieces", tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    return tokenizer


def encode_training_split(config: Config, tokenizer: Tokenizer) -> EncodedCorpus:
    """The filtered training ids: from the cache when this data and tokenizer were encoded before."""
    data = config.data
    settings = {"langs": [data.src_lang, data.tgt_lang], "max_length": data.max_length,
                "max_length_ratio": data.max_length_ratio}  # fmt: skip
    entry = Path(data.cache_dir) / cache_key(data.train, tokenizer=tokenizer, settings=settings)
    cached = load_cached(entry) if data.cache_dir else None
    if cached is None:
        counts = PairCounts()
        encoded = encode_pairs(tokenizer, stream_split(config, "train", counts))
        if counts.kept == 0:
            raise UserInputError("data.train: no sentence pairs found (empty file, or every pair had an empty side)")
        encoded, filtered = filter_corpus(
            encoded, max_length=data.max_length, max_ratio=data.max_length_ratio, name="data.train"
        )
        report = {"read": counts.kept + counts.dropped_empty, "empty": counts.dropped_empty,
                  "too_long": filtered.too_long, "bad_ratio": filtered.bad_ratio, "kept": filtered.kept}  # fmt: skip
        if not data.cache_dir:
            _log_report(report, "")
            return encoded
        store(entry, encoded, report)
        cached = load_cached(entry)
        source = f"; cached in {entry}"
    else:
        source = f" (from the cache {entry})"
    corpus, report = cached
    _log_report(report, source)
    return corpus


def prepare_training_data(config: Config, tokenizer: Tokenizer) -> TrainingData:
    train = encode_training_split(config, tokenizer)
    valid_text = read_split(config, "valid")
    valid = encode_pairs(tokenizer, zip(valid_text.src, valid_text.tgt))
    return TrainingData(train, valid, valid_text)


def _log_report(report: dict, source: str) -> None:
    log.info(
        "data.train: %d pairs read; removed %d with an empty side, %d too long, %d with a bad length ratio; "
        "kept %d%s", report["read"], report["empty"], report["too_long"], report["bad_ratio"], report["kept"], source,
    )  # fmt: skip

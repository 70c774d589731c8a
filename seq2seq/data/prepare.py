"""From a validated config to what training needs: a tokenizer (trained once) and encoded, filtered splits.

The training split is streamed: neither its text nor its token ids are ever held in memory as a
whole; chunks are encoded, filtered and appended to the encoding cache (data.cache_dir), from which
the ids are then memory-mapped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from seq2seq.config import Config
from seq2seq.data import cache
from seq2seq.data.encoded import EncodedCorpus, FilterReport, encode_chunks, encode_pairs, length_filter, write_corpus
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
    report: dict = {}
    if not data.cache_dir:
        corpus = EncodedCorpus.concatenate(list(_filtered_chunks(config, tokenizer, report)))
        _log_report(report, "")
        return corpus
    settings = {"langs": [data.src_lang, data.tgt_lang], "max_length": data.max_length,
                "max_length_ratio": data.max_length_ratio}  # fmt: skip
    entry = Path(data.cache_dir) / cache.cache_key(data.train, tokenizer=tokenizer, settings=settings)
    cached, source = cache.load_cached(entry), f" (from the cache {entry})"
    if cached is None:
        with cache.new_entry(entry) as folder:
            write_corpus(folder, _filtered_chunks(config, tokenizer, report))
            cache.write_report(folder, report)
        cached, source = cache.load_cached(entry), f"; cached in {entry}"
    corpus, report = cached
    _log_report(report, source)
    return corpus


def _filtered_chunks(config: Config, tokenizer: Tokenizer, report: dict) -> Iterator[EncodedCorpus]:
    """The training split streamed through the tokenizer and the length filters, chunk by chunk; once
    exhausted, `report` holds the counts of what was read, removed and kept."""
    data, counts, filtered = config.data, PairCounts(), FilterReport(0, 0, 0)
    for chunk in encode_chunks(tokenizer, stream_split(config, "train", counts)):
        keep, chunk_report = length_filter(chunk, max_length=data.max_length, max_ratio=data.max_length_ratio)
        yield chunk.subset(keep)
        filtered += chunk_report
    if counts.kept == 0:
        raise UserInputError("data.train: no sentence pairs found (empty file, or every pair had an empty side)")
    if filtered.kept == 0:
        raise UserInputError(f"data.train: no sentence pairs left after filtering ({filtered.describe()})")
    report.update(read=counts.kept + counts.dropped_empty, empty=counts.dropped_empty, too_long=filtered.too_long,
                  bad_ratio=filtered.bad_ratio, kept=filtered.kept)  # fmt: skip


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

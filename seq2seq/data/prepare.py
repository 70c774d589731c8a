"""From a validated config to what training needs: a tokenizer (trained once) and encoded, filtered splits."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from seq2seq.config import Config
from seq2seq.data.encoded import EncodedCorpus, encode_corpus, filter_corpus
from seq2seq.data.sources import ParallelText, read_corpus
from seq2seq.errors import UserInputError
from seq2seq.tokenizer import Tokenizer, train_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingData:
    train: EncodedCorpus
    valid: EncodedCorpus
    valid_text: ParallelText  # raw sentences: BLEU is computed on detokenized text


def read_split(config: Config, split: str) -> ParallelText:
    corpus = getattr(config.data, split)
    text = read_corpus(corpus, src_lang=config.data.src_lang, tgt_lang=config.data.tgt_lang, key=f"data.{split}")
    if not len(text):
        raise UserInputError(f"data.{split}: no sentence pairs found (empty file, or every pair had an empty side)")
    if text.dropped_empty:
        log.info("data.%s: dropped %d pairs with an empty side", split, text.dropped_empty)
    return text


def load_or_train_tokenizer(config: Config, directory: Path, train_text: ParallelText | None = None) -> Tokenizer:
    """Reuse the tokenizer in `directory` if present, otherwise train it on the training split and save it."""
    if directory.exists() and any(directory.glob("*.model")):
        return Tokenizer.load(directory)
    text = train_text if train_text is not None else read_split(config, "train")
    tokenizer = train_tokenizer(config.tokenizer, text.src, text.tgt, seed=config.train.seed)
    tokenizer.save(directory)
    log.info("trained tokenizer: %d source / %d target pieces", tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    return tokenizer


def prepare_training_data(config: Config, tokenizer: Tokenizer, train_text: ParallelText) -> TrainingData:
    train, report = filter_corpus(
        encode_corpus(tokenizer, train_text.src, train_text.tgt),
        max_length=config.data.max_length,
        max_ratio=config.data.max_length_ratio,
        name="data.train",
    )
    log.info("data.train: %s", report.describe())
    valid_text = read_split(config, "valid")
    return TrainingData(train, encode_corpus(tokenizer, valid_text.src, valid_text.tgt), valid_text)

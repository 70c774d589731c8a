"""From the data section of a config to what training needs: encoded, filtered splits.

The training split is streamed: neither its text nor its token ids are ever held in memory as a
whole; chunks are encoded, filtered and appended to the encoding cache (data.cache_dir), from which
the ids are then memory-mapped. With subword sampling (data.subword_alpha), the training split is
encoded `subword_variants` times, each a seeded sampled segmentation with its own cache entry, and
epoch e trains on variant (e - 1) mod n: the order depends on the epoch alone, so a resumed run
trains on what the uninterrupted one would.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from seq2seq.config import DataConfig
from seq2seq.data import cache
from seq2seq.data.encoded import (
    SIDES,
    EncodedCorpus,
    FilterReport,
    encode_chunks,
    encode_pairs,
    length_filter,
    write_corpus,
)
from seq2seq.data.sources import PairCounts, ParallelText, iter_pairs, read_corpus
from seq2seq.data.special_tokens import UNK_ID
from seq2seq.data.tokenizer import SubwordSampling, Tokenizer
from seq2seq.errors import UserInputError
from seq2seq.progress import with_progress

log = logging.getLogger(__name__)
# A share of <unk> pieces in the training ids worth a warning: a tokenizer trained on this text with
# the default character coverage leaves well under a thousandth.
UNKNOWN_WARNING = 0.01
SIDE_NAMES = {"src": "source", "tgt": "target"}


@dataclass(frozen=True)
class TrainingData:
    train: EncodedCorpus  # the first (or only) segmentation of the training split
    valid: EncodedCorpus  # never sampled
    valid_text: ParallelText  # raw sentences: BLEU is computed on detokenized text
    variants: tuple[EncodedCorpus, ...] = ()  # sampled segmentations of the training split, one per epoch in turn
    text_digest: str = ""  # the training text read (sources.PairCounts): checkpoints record it, resumes compare it
    # with subword sampling, a digest of each variant's pieces: a variant sampled again (no cache) by
    # another SentencePiece version may differ, and a resumed run says so (run_dir.warn_if_resampled)
    segmentations: tuple[str, ...] = ()

    def train_for_epoch(self, epoch: int) -> EncodedCorpus:
        """The training split as epoch `epoch` (1 = the first) sees it."""
        return self.variants[(epoch - 1) % len(self.variants)] if self.variants else self.train


def stream_split(data: DataConfig, split: str, counts: PairCounts | None = None) -> Iterator[tuple[str, str]]:
    """The split's non-empty pairs, read lazily."""
    return iter_pairs(
        getattr(data, split), src_lang=data.src_lang, tgt_lang=data.tgt_lang, key=f"data.{split}", counts=counts
    )


def read_split(data: DataConfig, split: str) -> ParallelText:
    """A small split (valid, test) in memory; an empty one is an error."""
    corpus = getattr(data, split)
    if corpus is None:
        raise UserInputError(f"data.{split}: not set in the config; expected a corpus (format and files)")
    text = read_corpus(corpus, src_lang=data.src_lang, tgt_lang=data.tgt_lang, key=f"data.{split}")
    if not len(text):
        raise UserInputError(f"data.{split}: no sentence pairs found (empty file, or every pair had an empty side)")
    return text


def encode_training_split(
    data: DataConfig, tokenizer: Tokenizer, *, progress: bool = False, sampled_seed: int | None = None
) -> EncodedCorpus:
    """The filtered training ids: from the cache when this data and tokenizer were encoded before.
    With `sampled_seed`, a segmentation drawn under that seed with data.subword_alpha/nbest."""
    return _encoded_training_split(data, tokenizer, progress=progress, sampled_seed=sampled_seed)[0]


def _encoded_training_split(
    data: DataConfig,
    tokenizer: Tokenizer,
    *,
    progress: bool,
    sampled_seed: int | None,
    text_digest: Callable[[], str] | None = None,
) -> tuple[EncodedCorpus, dict]:
    """encode_training_split's corpus and its report: the counts read, removed and kept, and the text's
    digest (`text`), kept with a cache entry so that a cached corpus has it without reading the text.
    `text_digest` reads it where the cache has no entry for these files (_text_digest_reader)."""
    text_digest = text_digest or _text_digest_reader(data, progress)
    report: dict = {}
    sampling = None if sampled_seed is None else SubwordSampling(data.subword_alpha, data.subword_nbest)
    if not data.cache_dir:
        corpus = EncodedCorpus.concatenate(
            list(_filtered_chunks(data, tokenizer, report, progress, sampling, sampled_seed))
        )
        _log_report(report, "")
        return corpus, report
    settings = {
        "langs": [data.src_lang, data.tgt_lang],
        "max_length": data.max_length,
        "max_length_ratio": data.max_length_ratio,
    }
    if sampling is not None:
        settings["sampled"] = {"alpha": sampling.alpha, "nbest": sampling.nbest, "seed": sampled_seed}
    folder = Path(data.cache_dir)
    entry = folder / cache.cache_key(data.train, tokenizer=tokenizer, settings=settings)
    cached, source = cache.load_cached(entry), f" (from the cache {entry})"
    if cached is None and cache.names_by_text(folder):  # moved, copied or converted: the same text?
        same_text = cache.entry_by_text(folder, cache.text_key(text_digest(), tokenizer=tokenizer, settings=settings))
        if same_text is not None:
            entry, cached = same_text, cache.load_cached(same_text)
            source = f" (from the cache {entry}: the same text, encoded before from other files or another format)"
    if cached is None:
        with cache.new_entry(entry) as new:
            write_corpus(new, _filtered_chunks(data, tokenizer, report, progress, sampling, sampled_seed))
            cache.write_report(new, report)
        cached, source = cache.load_cached(entry), f"; cached in {entry}"
    corpus, report = cached
    # named by its text too (an entry made before entries were is named at its next use)
    cache.name_by_text(folder, cache.text_key(report["text"], tokenizer=tokenizer, settings=settings), entry)
    _log_report(report, source)
    return corpus, report


def _text_digest_reader(data: DataConfig, progress: bool) -> Callable[[], str]:
    """The digest of the training split's text (sources.PairCounts), read once when first asked for:
    what names a cache entry by its text, whatever files or format it came from."""

    @functools.cache
    def read() -> str:
        counts = PairCounts.with_digest()
        for _ in with_progress(stream_split(data, "train", counts), "read data.train", enabled=progress):
            pass
        return counts.text_digest()

    return read


def _filtered_chunks(
    data: DataConfig,
    tokenizer: Tokenizer,
    report: dict,
    progress: bool,
    sampling: SubwordSampling | None,
    sampled_seed: int | None,
) -> Iterator[EncodedCorpus]:
    """The training split streamed through the tokenizer and the length filters, chunk by chunk; once
    exhausted, `report` holds the counts of what was read, removed and kept."""
    counts, filtered = PairCounts.with_digest(), FilterReport(0, 0, 0)
    pieces, unknown = dict.fromkeys(SIDES, 0), dict.fromkeys(SIDES, 0)
    segmentation = hashlib.sha256()  # of the pieces kept, sentence by sentence
    pairs = with_progress(stream_split(data, "train", counts), "encode data.train", enabled=progress)
    if sampling is not None:
        sampling.seed(sampled_seed)
    for chunk in encode_chunks(tokenizer, pairs, sampling):
        keep, chunk_report = length_filter(chunk, max_length=data.max_length, max_ratio=data.max_length_ratio)
        kept = chunk.subset(keep)
        for side in SIDES:
            ids = getattr(kept, side).ids
            pieces[side] += ids.size
            unknown[side] += int(np.count_nonzero(ids == UNK_ID))
            if sampling is not None:
                segmentation.update(getattr(kept, side).lengths().astype(np.int64).tobytes())
                segmentation.update(ids.tobytes())
        yield kept
        filtered += chunk_report
    if counts.kept == 0:
        raise UserInputError("data.train: no sentence pairs found (empty file, or every pair had an empty side)")
    if filtered.kept == 0:
        raise UserInputError(f"data.train: no sentence pairs left after filtering ({filtered.describe()})")
    report.update(
        read=counts.kept + counts.dropped_empty,
        empty=counts.dropped_empty,
        too_long=filtered.too_long,
        bad_ratio=filtered.bad_ratio,
        kept=filtered.kept,
        text=counts.text_digest(),
        unknown={side: unknown[side] / max(pieces[side], 1) for side in SIDES},
    )
    if sampling is not None:
        report["segmentation"] = segmentation.hexdigest()


def prepare_training_data(
    data: DataConfig,
    tokenizer: Tokenizer,
    valid_text: ParallelText | None = None,
    *,
    progress: bool = False,
    seed: int = 1,
) -> TrainingData:
    """The encoded splits; with data.subword_alpha, the sampled segmentations too, variant v drawn
    under the seed 1000 * `seed` (the run's) + v."""
    valid_text = valid_text if valid_text is not None else read_split(data, "valid")
    valid = encode_pairs(tokenizer, zip(valid_text.src, valid_text.tgt))
    if not data.subword_alpha:
        train, report = _encoded_training_split(data, tokenizer, progress=progress, sampled_seed=None)
        return TrainingData(train, valid, valid_text, text_digest=report["text"])
    text_digest = _text_digest_reader(data, progress)  # read once for all the variants, if at all
    encoded = [
        _encoded_training_split(
            data, tokenizer, progress=progress, sampled_seed=1000 * seed + variant, text_digest=text_digest
        )
        for variant in range(data.subword_variants)
    ]
    variants = tuple(corpus for corpus, _ in encoded)
    segmentations = tuple(report.get("segmentation", "") for _, report in encoded)  # "": cached before digests
    return TrainingData(
        variants[0], valid, valid_text, variants, text_digest=encoded[0][1]["text"], segmentations=segmentations
    )


def _log_report(report: dict, source: str) -> None:
    log.info(
        "data.train: %d pairs read; removed %d with an empty side, %d too long, %d with a bad length ratio; kept %d%s",
        report["read"],
        report["empty"],
        report["too_long"],
        report["bad_ratio"],
        report["kept"],
        source,
    )
    uncovered = {side: share for side, share in report["unknown"].items() if share > UNKNOWN_WARNING}
    if uncovered:
        shares = " and ".join(f"{share:.1%} of the {SIDE_NAMES[side]} pieces" for side, share in uncovered.items())
        log.warning(
            "data.train: %s are unknown to the tokenizer (<unk>), which the model cannot learn to read or write: "
            "a tokenizer trained on other text (train.init_from's?) or with a low tokenizer.character_coverage",
            shares,
        )

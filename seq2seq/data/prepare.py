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

from seq2seq.config import CorpusConfig, DataConfig
from seq2seq.data import cache
from seq2seq.data.batching import weighted_rows
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
    weights: tuple[float, ...] = (1.0,)  # of each training corpus: data.train, then data.extra_train's
    # the pairs each corpus kept, one after another in the encoded split: of `train`, or of each variant
    # (sampled segmentations have other lengths, so the length filters may keep other pairs)
    corpus_sizes: tuple[tuple[int, ...], ...] = ()

    def train_for_epoch(self, epoch: int) -> EncodedCorpus:
        """The training split as epoch `epoch` (1 = the first) sees it."""
        return self.variants[self._variant(epoch)] if self.variants else self.train

    def rows_for_epoch(self, epoch: int, *, seed: int) -> np.ndarray | None:
        """The pairs of train_for_epoch(epoch) that epoch trains on, by the corpora's weights
        (batching.weighted_rows); None for every pair once."""
        if not self.corpus_sizes:
            return None
        sizes = self.corpus_sizes[self._variant(epoch) if self.variants else 0]
        return weighted_rows(sizes, self.weights, seed=seed, epoch=epoch)

    def _variant(self, epoch: int) -> int:
        return (epoch - 1) % len(self.variants)


def stream_split(data: DataConfig, split: str, counts: PairCounts | None = None) -> Iterator[tuple[str, str]]:
    """The split's non-empty pairs, read lazily; for "train", every training corpus's in turn."""
    if split == "train":
        return stream_training_pairs(data, counts)
    return iter_pairs(
        getattr(data, split), src_lang=data.src_lang, tgt_lang=data.tgt_lang, key=f"data.{split}", counts=counts
    )


def stream_training_pairs(
    data: DataConfig, counts: PairCounts | None = None, starts: list[int] | None = None
) -> Iterator[tuple[str, str]]:
    """The pairs of data.train, then of each of data.extra_train, tags put before their sources; as each
    corpus begins, `starts` gets the number of pairs read before it (a kept pair's corpus, by position)."""
    counts = counts if counts is not None else PairCounts()
    for index, (key, corpus) in enumerate(data.training_corpora()):
        if index:
            counts.begin_corpus(index)
        if starts is not None:
            starts.append(counts.kept)
        yield from iter_pairs(corpus, src_lang=data.src_lang, tgt_lang=data.tgt_lang, key=key, counts=counts)


def read_split(data: DataConfig, split: str) -> ParallelText:
    """A small split (valid, test) in memory; an empty one is an error."""
    corpus = getattr(data, split)
    if corpus is None:
        raise UserInputError(f"data.{split}: not set in the config; expected a corpus (format and files)")
    return read_pairs(data, corpus, f"data.{split}")


def read_pairs(data: DataConfig, corpus: CorpusConfig, key: str) -> ParallelText:
    """One corpus in memory (a small split, or a corpus to distil), `key` naming it; an empty one is an error."""
    text = read_corpus(corpus, src_lang=data.src_lang, tgt_lang=data.tgt_lang, key=key)
    if not len(text):
        raise _no_pairs(key)
    return text


def _no_pairs(key: str) -> UserInputError:
    return UserInputError(f"{key}: no sentence pairs found (empty file, or every pair had an empty side)")


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
        _log_report(report, "", data)
        return corpus, report
    settings = {
        "langs": [data.src_lang, data.tgt_lang],
        "max_length": data.max_length,
        "max_length_ratio": data.max_length_ratio,
    }
    if sampling is not None:
        settings["sampled"] = {"alpha": sampling.alpha, "nbest": sampling.nbest, "seed": sampled_seed}
    folder = Path(data.cache_dir)
    entry = folder / cache.cache_key(data.training_corpora(), tokenizer=tokenizer, settings=settings)
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
    _log_report(report, source, data)
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
    starts: list[int] = []  # where each training corpus begins among the pairs read
    corpora = data.training_corpora()
    kept_by_corpus, position = np.zeros(len(corpora), np.int64), 0
    pairs = with_progress(stream_training_pairs(data, counts, starts), "encode data.train", enabled=progress)
    if sampling is not None:
        sampling.seed(sampled_seed)
    for chunk in encode_chunks(tokenizer, pairs, sampling):
        keep, chunk_report = length_filter(chunk, max_length=data.max_length, max_ratio=data.max_length_ratio)
        corpus_of = np.searchsorted(starts, position + np.arange(len(chunk)), side="right") - 1
        kept_by_corpus += np.bincount(corpus_of[keep], minlength=len(corpora))
        position += len(chunk)
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
    read_by_corpus = np.diff([*starts, counts.kept])
    for (key, _), read, kept_pairs in zip(corpora, read_by_corpus, kept_by_corpus):
        if read == 0:
            raise _no_pairs(key)
        if kept_pairs == 0:
            in_all = " in all the training corpora" if len(corpora) > 1 else ""
            raise UserInputError(f"{key}: no sentence pairs left after filtering ({filtered.describe()}{in_all})")
    report.update(
        read=counts.kept + counts.dropped_empty,
        empty=counts.dropped_empty,
        too_long=filtered.too_long,
        bad_ratio=filtered.bad_ratio,
        kept=filtered.kept,
        text=counts.text_digest(),
        unknown={side: unknown[side] / max(pieces[side], 1) for side in SIDES},
        kept_by_corpus=kept_by_corpus.tolist(),
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
    weights = tuple(corpus.weight for _, corpus in data.training_corpora())
    if not data.subword_alpha:
        train, report = _encoded_training_split(data, tokenizer, progress=progress, sampled_seed=None)
        sizes = _corpus_sizes(report)
        _log_mixture(data, sizes)
        return TrainingData(
            train, valid, valid_text, text_digest=report["text"], weights=weights, corpus_sizes=(sizes,)
        )
    text_digest = _text_digest_reader(data, progress)  # read once for all the variants, if at all
    encoded = [
        _encoded_training_split(
            data, tokenizer, progress=progress, sampled_seed=1000 * seed + variant, text_digest=text_digest
        )
        for variant in range(data.subword_variants)
    ]
    variants = tuple(corpus for corpus, _ in encoded)
    segmentations = tuple(report.get("segmentation", "") for _, report in encoded)  # "": cached before digests
    corpus_sizes = tuple(_corpus_sizes(report) for _, report in encoded)
    _log_mixture(data, corpus_sizes[0])
    return TrainingData(
        variants[0],
        valid,
        valid_text,
        variants,
        text_digest=encoded[0][1]["text"],
        segmentations=segmentations,
        weights=weights,
        corpus_sizes=corpus_sizes,
    )


def _corpus_sizes(report: dict) -> tuple[int, ...]:
    """The pairs each training corpus kept (an entry cached before several corpora were possible: one)."""
    return tuple(report.get("kept_by_corpus", [report["kept"]]))


def _log_mixture(data: DataConfig, sizes: tuple[int, ...]) -> None:
    """With several training corpora or a weight: what each brings to an epoch."""
    corpora = data.training_corpora()
    if len(corpora) == 1 and corpora[0][1].weight == 1:
        return
    parts = [
        f"{key} {size} pairs x {corpus.weight:g}" + (f" (tagged {corpus.tag})" if corpus.tag else "")
        for (key, corpus), size in zip(corpora, sizes)
    ]
    rows = weighted_rows(sizes, [corpus.weight for _, corpus in corpora], seed=1, epoch=1)  # its length alone
    shown = sum(sizes) if rows is None else len(rows)
    log.info("training corpora: %s; an epoch shows %d pairs", ", ".join(parts), shown)


def _log_report(report: dict, source: str, data: DataConfig) -> None:
    log.info(
        "%s: %d pairs read; removed %d with an empty side, %d too long, %d with a bad length ratio; kept %d%s",
        "data.train and data.extra_train" if data.extra_train else "data.train",
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

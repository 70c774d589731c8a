"""Read parallel text from plain files, TSV, JSONL or HuggingFace datasets, with clear errors on bad input.

Every line is decoded as UTF-8 (a bad byte names the file and line) and stripped of a BOM, CRLF and
surrounding spaces; nothing else changes: the target side is also what validation scores against,
as given. Unicode normalisation belongs to the model's input, where SentencePiece applies NFKC
(its default rule), so visually equal text gets equal token ids.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import itertools
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from seq2seq.config import CorpusConfig
from seq2seq.data.hub import offline_unless_reachable
from seq2seq.errors import UserInputError

T = TypeVar("T")


@dataclass
class ParallelText:
    """Aligned source and target sentences, held in memory (validation and test splits)."""

    src: list[str]
    tgt: list[str]

    def __len__(self) -> int:
        return len(self.src)


@dataclass
class PairCounts:
    """Filled in while a stream of pairs is consumed: how many, and where asked for (`with_digest`), a
    hash of the pairs kept, in order (`text_digest`): the text a run trained on, whatever file, path or
    format it came from. Hashing nearly doubles the cost of reading a pair, so other reads go without."""

    kept: int = 0
    dropped_empty: int = 0  # pairs with an empty side
    hashed: Any = dataclasses.field(default=None, repr=False)  # a hashlib hash, or None

    @classmethod
    def with_digest(cls) -> PairCounts:
        return cls(hashed=hashlib.sha256())

    def keep(self, src: str, tgt: str) -> None:
        self.kept += 1
        if self.hashed is not None:
            self.hashed.update(f"{len(src)}:{src}{len(tgt)}:{tgt}".encode())  # lengths: no two pairs read alike

    def begin_corpus(self, index: int) -> None:
        """Another training corpus (data.extra_train) begins: its pairs are hashed as its own, so that
        a pair moved from one corpus to another, which may be weighted otherwise, changes the digest."""
        if self.hashed is not None:
            self.hashed.update(f"corpus {index}\n".encode())

    def text_digest(self) -> str:
        return self.hashed.hexdigest()


def iter_pairs(
    corpus: CorpusConfig, *, src_lang: str, tgt_lang: str, key: str, counts: PairCounts | None = None
) -> Iterator[tuple[str, str]]:
    """Stream one split's non-empty pairs, a training corpus's tag (corpus.tag) put before each source;
    `key` (e.g. 'data.train') names the config section in errors."""
    counts = counts if counts is not None else PairCounts()
    if corpus.format == "text":
        pairs = _text_pairs(corpus.src, corpus.tgt, key)
    elif corpus.format == "tsv":
        pairs = _tsv_pairs(corpus.path)
    elif corpus.format == "jsonl":
        pairs = _jsonl_pairs(corpus.path, corpus.src_field, corpus.tgt_field)
    else:
        pairs = _hf_pairs(corpus, src_lang=src_lang, tgt_lang=tgt_lang, key=key)
    for src, tgt in pairs:
        if src and tgt:
            src = f"{corpus.tag} {src}" if corpus.tag else src
            counts.keep(src, tgt)
            yield src, tgt
        else:
            counts.dropped_empty += 1


def read_corpus(corpus: CorpusConfig, *, src_lang: str, tgt_lang: str, key: str) -> ParallelText:
    """One split in memory; for small splits (large training sets are streamed with iter_pairs)."""
    text = ParallelText([], [])
    for src, tgt in iter_pairs(corpus, src_lang=src_lang, tgt_lang=tgt_lang, key=key):
        text.src.append(src)
        text.tgt.append(tgt)
    return text


def _text_pairs(src_path: str, tgt_path: str, key: str) -> Iterator[tuple[str, str]]:
    src_lines, tgt_lines = read_lines(src_path), read_lines(tgt_path)
    for count, (src, tgt) in enumerate(itertools.zip_longest(src_lines, tgt_lines)):
        if src is None or tgt is None:  # one file ended first: count the rest of the other for the message
            rest = 1 + sum(1 for _ in (tgt_lines if src is None else src_lines))
            src_count, tgt_count = (count, count + rest) if src is None else (count + rest, count)
            raise UserInputError(
                f"{key}: {src_path} has {src_count} lines but {tgt_path} has {tgt_count}; "
                "parallel files need one sentence per line on both sides"
            )
        yield src, tgt


def read_lines(path: str | Path, *, keep_tabs: bool = False) -> Iterator[str]:
    """Normalised lines of a UTF-8 text file (optionally .gz). With keep_tabs, tabs at either end stay
    (a TSV line "source<TAB>" has an empty target, not no tab)."""
    path = str(path)
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            yield from decode_lines(handle, path, keep_tabs=keep_tabs)
    except FileNotFoundError:
        raise UserInputError(f"{path}: file not found") from None
    except (gzip.BadGzipFile, EOFError) as exc:
        raise UserInputError(f"{path}: not a readable gzip file ({exc})") from None


def decode_lines(handle: BinaryIO, name: str, *, keep_tabs: bool = False) -> Iterator[str]:
    """Normalised lines of a binary stream; `name` identifies it in the error for a non-UTF-8 line."""
    for number, raw in enumerate(handle, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise UserInputError(f"{name}:{number}: not valid UTF-8 (bad byte at column {exc.start + 1})") from None
        yield normalize(text, keep_tabs=keep_tabs)


def chunked(items: Iterable[T], size: int) -> Iterator[list[T]]:
    """Lists of `size` consecutive items (the last one shorter): streams processed a chunk at a time."""
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


_SPACE_BUT_TAB_AT_ENDS = re.compile(r"^[^\S\t]+|[^\S\t]+$")


def normalize(text: str, *, keep_tabs: bool = False) -> str:
    """A line without its BOM, line end and surrounding spaces (and tabs, unless keep_tabs)."""
    text = text.lstrip("\ufeff")
    return _SPACE_BUT_TAB_AT_ENDS.sub("", text) if keep_tabs else text.strip()


def _tsv_pairs(path: str) -> Iterator[tuple[str, str]]:
    for number, line in enumerate(read_lines(path, keep_tabs=True), 1):
        if not line:
            continue
        tabs = line.count("\t")
        if tabs != 1:
            raise UserInputError(
                f"{path}:{number}: expected source<TAB>target (one tab), found {tabs or 'no'} tab{'s' * (tabs != 1)}"
            )
        src, tgt = line.split("\t")
        yield src.strip(), tgt.strip()


def _jsonl_pairs(path: str, src_field: str, tgt_field: str) -> Iterator[tuple[str, str]]:
    for number, line in enumerate(read_lines(path), 1):
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserInputError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise UserInputError(f"{path}:{number}: expected a JSON object with '{src_field}' and '{tgt_field}'")
        for field in (src_field, tgt_field):
            if not isinstance(record.get(field), str):
                raise UserInputError(f"{path}:{number}: missing string field '{field}'")
        yield normalize(record[src_field]), normalize(record[tgt_field])


def _hf_pairs(corpus: CorpusConfig, *, src_lang: str, tgt_lang: str, key: str) -> Iterator[tuple[str, str]]:
    dataset = _load_hf(corpus, key)
    columns = dataset.column_names
    if "translation" in columns:
        languages = set(dataset[0]["translation"]) if len(dataset) else set()
        missing = [lang for lang in (src_lang, tgt_lang) if lang not in languages]
        if missing:
            raise UserInputError(
                f"{key}: the dataset's 'translation' column has languages {sorted(languages)}, "
                f"not {missing} (set data.src_lang / data.tgt_lang)"
            )
        for number, row in enumerate(dataset["translation"]):
            yield _hf_text(row.get(src_lang), key, number, src_lang), _hf_text(row.get(tgt_lang), key, number, tgt_lang)
    elif corpus.src_field in columns and corpus.tgt_field in columns:
        for number, (src, tgt) in enumerate(zip(dataset[corpus.src_field], dataset[corpus.tgt_field])):
            yield _hf_text(src, key, number, corpus.src_field), _hf_text(tgt, key, number, corpus.tgt_field)
    else:
        raise UserInputError(
            f"{key}: the dataset has columns {columns}; expected 'translation' or "
            f"'{corpus.src_field}' and '{corpus.tgt_field}' (set {key}.src_field / {key}.tgt_field)"
        )


def _hf_text(value: object, key: str, row: int, field: str) -> str:
    if not isinstance(value, str):
        raise UserInputError(f"{key}: row {row}: '{field}' is {type(value).__name__}; expected text")
    return normalize(value)


def corpus_identity(corpus: CorpusConfig, key: str) -> dict:
    """What identifies a corpus's content, cheaply: the settings, and for each local file its path,
    size and modification time (every file inside a folder, e.g. a `save_to_disk` dataset, not the
    folder's own times, which a re-save need not change); for a hub dataset, its `datasets`
    fingerprint. Caches and the tokenizer's record of its training data compare these."""
    settings = dataclasses.asdict(corpus)
    del settings["weight"]  # how often pairs are shown, not what they are
    if not corpus.tag:
        del settings["tag"]  # so an untagged corpus keeps the identity it had before tags existed
    identity: dict = {"corpus": settings}
    files = corpus.files()
    if files:
        identity["files"] = {name: _path_identity(Path(path)) for name, path in files.items()}
    if corpus.format == "hf" and not corpus.path:
        identity["fingerprint"] = getattr(_load_hf(corpus, key), "_fingerprint", None)
    return identity


def _path_identity(path: Path) -> list:
    if path.is_dir():
        return [[str(inner.relative_to(path)), *_stat(inner)] for inner in sorted(path.rglob("*")) if inner.is_file()]
    return [str(path.resolve()), *_stat(path)]


def _stat(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


_DATA_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def _load_hf(corpus: CorpusConfig, key: str):
    """A datasets.Dataset from the hub (name/subset/split) or a local folder or file."""
    import datasets  # imported here: it is slow to import and only this source needs it

    def split() -> str:
        if corpus.split is None and not key.startswith(("data.train", "data.extra_train")):
            # for valid or test, the default would silently read the training split
            raise UserInputError(f"{key}.split: not set; expected the dataset's split for {key}, e.g. validation")
        return corpus.split or "train"

    def one_split(loaded, where: str):
        """The configured split of a dataset with several, or a one-line error listing those it has."""
        if not isinstance(loaded, datasets.DatasetDict):
            return loaded
        if split() not in loaded:
            raise UserInputError(
                f"{key}.split: {split()!r} is not a split of {where}; it has {', '.join(map(repr, loaded))}"
            )
        return loaded[split()]

    unreachable = None
    try:
        if corpus.path and Path(corpus.path).is_dir():
            return one_split(datasets.load_from_disk(corpus.path), corpus.path)
        if corpus.path:
            builder = _DATA_FILE_BUILDERS.get(Path(corpus.path).suffix)
            if builder is None:
                raise UserInputError(
                    f"{key}.path: {corpus.path}: expected a save_to_disk folder or a "
                    f"{'/'.join(_DATA_FILE_BUILDERS)} file"
                )
            return datasets.load_dataset(builder, data_files=corpus.path, split="train")
        name = corpus.name + (f" ({corpus.subset})" if corpus.subset else "")
        with offline_unless_reachable(name) as unreachable:
            return one_split(datasets.load_dataset(corpus.name, corpus.subset), name)  # every split is prepared anyway
    except UserInputError:
        raise
    except Exception as exc:  # datasets raises many types (network, missing config, bad split)
        if unreachable is not None:
            raise UserInputError(
                f"{key}.name: {corpus.name}: the HuggingFace hub cannot be reached from here ({unreachable}) and "
                "the dataset is not in the local cache; download it once where the hub is reachable (it is "
                f"cached under ~/.cache/huggingface), or give a local copy as {key}.path"
            ) from None
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserInputError(f"{key}: could not load the dataset: {first_line}") from None

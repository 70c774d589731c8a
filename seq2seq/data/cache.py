"""On-disk cache of encoded training data, so a second or resumed run skips reading and encoding.

An entry is keyed by what determines its content: each training corpus's identity (sources.corpus_identity:
its settings, each local data file's path, size and modification time, every file of a dataset
folder, a hub dataset's fingerprint), the tokenizer models and the length filters. A changed file or
tokenizer gives a new key; entries are written to a temporary folder and renamed into place.

That identity is cheap to take but changes with more than the text: a corpus moved, copied without
its times (another machine, `rsync` without -t) or converted to another format misses its entry. So
each entry is also named by its text (`text-KEY` files: the digest of the pairs as read, with the
same tokenizer and filters), which a miss reads the corpus once to compute, far faster than encoding.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from seq2seq.config import CorpusConfig
from seq2seq.data.encoded import EncodedCorpus
from seq2seq.data.sources import corpus_identity
from seq2seq.data.tokenizer import Tokenizer
from seq2seq.files import remove_stale_temporaries, temporary_path, write_text_atomic

CACHE_VERSION = 4  # 2: raw .bin id files, appended chunk by chunk; 3: content identity of dataset folders;
# 4: the report holds the text's digest (prepare.TrainingData.text_digest) and its share of unknown pieces;
# a sampled entry's, since, its segmentation's digest too (entries without it are compared with nothing)


def cache_key(corpora: list[tuple[str, CorpusConfig]], *, tokenizer: Tokenizer, settings: dict) -> str:
    """An entry's name by the files of the training corpora, (config key, corpus) in the order read."""
    identities = [corpus_identity(corpus, key) for key, corpus in corpora]
    described = {"corpus": identities[0]} if len(identities) == 1 else {"corpora": identities}  # one: as before
    return _key({**described, **settings}, tokenizer)


def text_key(text_digest: str, *, tokenizer: Tokenizer, settings: dict) -> str:
    """An entry's name by its text (prepare.TrainingData.text_digest) rather than its files."""
    return _key({"text": text_digest, **settings}, tokenizer)


def _key(description: dict, tokenizer: Tokenizer) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"version": CACHE_VERSION, **description}, sort_keys=True).encode())
    for name, proto in sorted(tokenizer.protos().items()):
        digest.update(name.encode() + proto)
    return digest.hexdigest()[:24]


def names_by_text(folder: Path) -> bool:
    """Whether any entry in `folder` is named by its text: only then is a miss worth reading the text for."""
    return folder.is_dir() and any(folder.glob(f"{_TEXT_PREFIX}*"))


def entry_by_text(folder: Path, key: str) -> Path | None:
    """The entry of `folder` named by text key `key`, if there is one and it is whole."""
    name = folder / f"{_TEXT_PREFIX}{key}"
    entry = folder / name.read_text().strip() if name.is_file() else None
    return entry if entry is not None and (entry / "report.json").is_file() else None


def name_by_text(folder: Path, key: str, entry: Path) -> None:
    """Name `entry` by its text key `key` (kept if it is already). A cache folder this process may only
    read (shared, made by another user) keeps its entries unnamed: naming only saves later encodings."""
    name = folder / f"{_TEXT_PREFIX}{key}"
    if not name.is_file() or name.read_text().strip() != entry.name:
        with contextlib.suppress(OSError):
            write_text_atomic(name, entry.name)


_TEXT_PREFIX = "text-"


def load_cached(entry: Path) -> tuple[EncodedCorpus, dict] | None:
    """(memory-mapped corpus, preparation report) if the entry exists."""
    report = entry / "report.json"
    if not report.exists():
        return None
    return EncodedCorpus.load(entry), json.loads(report.read_text())


@contextmanager
def new_entry(entry: Path) -> Iterator[Path]:
    """A temporary folder to fill with an entry's files and report.json (write_report); it becomes
    `entry` when the block completes and is removed if the block fails, so a reader never sees half."""
    remove_stale_temporaries(entry.parent)  # entries a killed process was filling
    tmp = temporary_path(entry)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        os.replace(tmp, entry)
    except OSError:  # another process stored the same entry first; theirs is as good
        if not entry.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_report(folder: Path, report: dict) -> None:
    (folder / "report.json").write_text(json.dumps(report))

"""On-disk cache of encoded training data, so a second or resumed run skips reading and encoding.

An entry is keyed by what determines its content: the corpus settings, each local data file's
path, size and modification time, the tokenizer models and the length filters. A changed file or
tokenizer gives a new key; entries are written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from seq2seq.config import CorpusConfig
from seq2seq.data.encoded import EncodedCorpus
from seq2seq.tokenizer import Tokenizer

CACHE_VERSION = 1


def cache_key(corpus: CorpusConfig, *, tokenizer: Tokenizer, settings: dict) -> str:
    digest = hashlib.sha256()
    files = {key: _file_identity(path) for key, path in corpus.files().items()}
    description = {"version": CACHE_VERSION, "corpus": dataclasses.asdict(corpus), "files": files, **settings}
    digest.update(json.dumps(description, sort_keys=True).encode())
    for name, proto in sorted(tokenizer.protos().items()):
        digest.update(name.encode() + proto)
    return digest.hexdigest()[:24]


def load_cached(entry: Path) -> tuple[EncodedCorpus, dict] | None:
    """(memory-mapped corpus, preparation report) if the entry exists."""
    report = entry / "report.json"
    if not report.exists():
        return None
    return EncodedCorpus.load(entry), json.loads(report.read_text())


def store(entry: Path, corpus: EncodedCorpus, report: dict) -> None:
    tmp = entry.with_name(f".{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    corpus.save(tmp)
    (tmp / "report.json").write_text(json.dumps(report))
    try:
        os.replace(tmp, entry)
    except OSError:  # another process stored the same entry first; theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)


def _file_identity(path: str) -> list:
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]

"""Where `seq2seq translate -i FILE -o OUT` keeps its work until OUT is whole, so that an interrupted
translation (Ctrl-C, a kill, a full disk) is continued by the same command instead of begun again:
back-translating a corpus takes hours.

Each chunk of input lines, once translated, is saved in .OUT.partial/ beside OUT; OUT is written
from the chunks when the last is done, and the folder removed. A chunk is translated whole, in the
batches an uninterrupted run makes of it, and a sampled line draws by its line number, so a resumed
translation writes what an uninterrupted one writes. The folder records what its chunks are a
translation of (the models, the input and guidance files, the settings): one left by other work is
replaced, one seq2seq did not make is refused.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from seq2seq.checkpoint import run_checkpoint
from seq2seq.errors import UserInputError
from seq2seq.files import atomic_text_write, content_digest, write_text_atomic
from seq2seq.inference.engine import EXPORT_METADATA

log = logging.getLogger(__name__)

KIND = "seq2seq partial translation"  # what marks the folder as this module's
IDENTITY = "identity.json"


def model_files(models: list[Path]) -> list[Path]:
    """What each model given to translate is read from: a checkpoint file, the best.pt a run directory
    stands for (it changes while the run trains on), or an exported directory."""
    return [
        run_checkpoint(path) if path.is_dir() and not (path / EXPORT_METADATA).is_file() else path for path in models
    ]


def work_identity(models: list[Path], inputs: dict[str, Path | None], settings: dict) -> dict:
    """What a translation's chunks are made of: the content of its models and of each input file
    (`inputs`, by option; None: not given), and its settings."""
    return {
        "kind": KIND,
        "models": [content_digest(path) for path in model_files(models)],
        "inputs": {name: content_digest(path) if path is not None else None for name, path in inputs.items()},
        "settings": settings,
    }


class TranslationChunks:
    """The translated chunks of one output file, by index."""

    def __init__(self, output: Path, identity: dict):
        self.output = output
        self.folder = output.with_name(f".{output.name}.partial")
        self._identity = identity

    def open(self) -> int:
        """Make the folder, or take up the one an interrupted run of the same work left; the number of
        chunks already translated."""
        recorded = self._recorded()
        if recorded is not None and recorded != self._identity:
            log.info("%s: the partial translation there is of other models, input or settings; starting again",
                     self.folder)  # fmt: skip
            self.discard()
        elif recorded is not None:
            return len(list(self.folder.glob("chunk-*.txt")))
        self.folder.mkdir()
        write_text_atomic(self.folder / IDENTITY, json.dumps(self._identity, indent=2) + "\n")
        return 0

    def _recorded(self) -> dict | None:
        """The identity of the work in the folder, None where there is no folder; a folder that holds
        something else is refused (this command removes only what it made)."""
        if not self.folder.exists():
            return None
        try:
            recorded = json.loads((self.folder / IDENTITY).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            recorded = None
        if not isinstance(recorded, dict) or recorded.get("kind") != KIND:
            raise UserInputError(
                f"{self.folder}: exists and is not a partial translation seq2seq made for {self.output}; "
                "move it away, then run again"
            )
        return recorded

    def _chunk(self, index: int) -> Path:
        return self.folder / f"chunk-{index:08d}.txt"

    def has(self, index: int) -> bool:
        return self._chunk(index).is_file()

    def save(self, index: int, text: str) -> None:
        write_text_atomic(self._chunk(index), text)

    def finish(self, chunks: int) -> None:
        """Write the output from chunks 0..chunks-1 (gzip where its name ends in .gz), then remove the folder."""
        with atomic_text_write(self.output) as sink:
            for index in range(chunks):
                with open(self._chunk(index), encoding="utf-8", newline="") as chunk:
                    shutil.copyfileobj(chunk, sink)
        self.discard()

    def discard(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

"""Where `seq2seq translate -i FILE -o OUT` and `seq2seq score-pairs ... -o OUT` keep their work
until OUT is whole, so that an interrupted run (Ctrl-C, a kill, a full disk) is continued by the
same command instead of begun again: back-translating or scoring a corpus takes hours.

Each chunk of input lines, once done, is saved in .OUT.partial/ beside OUT; OUT is written from the
chunks when the last is done, and the folder removed. A chunk is done whole, in the batches an
uninterrupted run makes of it, and a sampled line draws by its line number, so a resumed run writes
what an uninterrupted one writes. The folder records what its chunks are made of (the models, the
input files, the settings): one left by other work is replaced, one seq2seq did not make is refused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from tqdm import tqdm

from seq2seq.checkpoint import run_checkpoint
from seq2seq.cli.boundary import Terminated
from seq2seq.errors import UserInputError
from seq2seq.files import (
    atomic_text_write,
    content_digest,
    remove_stale_temporaries,
    temporary_path,
    write_text_atomic,
    written_as_it_comes,
)
from seq2seq.inference.engine import EXPORT_METADATA

log = logging.getLogger(__name__)

KIND = "seq2seq partial output"  # what marks the folder as this module's
IDENTITY = "identity.json"


def kept_in_chunks(output: str) -> bool:
    """Whether an output (a path, or - for stdout) is a file to keep chunks for: not a stream."""
    return output != "-" and not written_as_it_comes(output)


def model_files(models: list[Path]) -> list[Path]:
    """What each model given to a command is read from: a checkpoint file, the best.pt a run directory
    stands for (it changes while the run trains on), or an exported directory."""
    return [
        run_checkpoint(path) if path.is_dir() and not (path / EXPORT_METADATA).is_file() else path for path in models
    ]


def work_identity(models: list[Path], inputs: dict[str, Path | None], settings: dict) -> dict:
    """What a command's chunks are made of: the content of its models and of each input file
    (`inputs`, by option; None: not given), and its settings."""
    return {
        "kind": KIND,
        "models": [content_digest(path) for path in model_files(models)],
        "inputs": {name: content_digest(path) if path is not None else None for name, path in inputs.items()},
        "settings": settings,
    }


class OutputChunks:
    """The finished chunks of one output file, by index."""

    def __init__(self, output: Path, identity: dict):
        self.output = output
        self.folder = output.with_name(f".{output.name}.partial")
        self._identity = identity

    def open(self) -> int:
        """Make the folder, or take up the one an interrupted run of the same work left; the number of
        chunks already done."""
        recorded = self._recorded()
        if recorded is not None and recorded != self._identity:
            log.info("%s: the partial output there is of other models, input or settings; starting again",
                     self.folder)  # fmt: skip
            self.discard()
        elif recorded is not None:
            return len(list(self.folder.glob("chunk-*.txt")))
        building = temporary_path(self.folder)  # the folder appears with its identity, or not at all
        remove_stale_temporaries(self.folder.parent, self.folder.name)
        building.mkdir()
        write_text_atomic(building / IDENTITY, json.dumps(self._identity, indent=2) + "\n")
        os.replace(building, self.folder)
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
                f"{self.folder}: exists and is not a partial output seq2seq made for {self.output}; "
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


def write_in_chunks(
    kept: OutputChunks,
    chunks: Iterable[tuple[list, int]],
    produce: Callable[[list, int], str],
    bar: tqdm,
    *,
    done: str,
) -> None:
    """The output text of each (chunk, index of its first line) from `produce`, saved in `kept`, the
    chunks an interrupted run of the same work saved read back instead, then the output written from
    them. An interruption says what is kept (`done`: what a line kept is, e.g. "lines translated")."""
    before, count, lines = kept.open(), 0, 0
    try:
        for index, (chunk, first) in enumerate(chunks):
            if index == before and before:
                log.info("%s: kept the first %s %s before; going on with the rest", kept.folder, f"{first:,}", done)
            if kept.has(index):
                bar.update(len(chunk))
            else:
                kept.save(index, produce(chunk, first))
            count, lines = index + 1, first + len(chunk)
    except (KeyboardInterrupt, Terminated) as stop:
        if lines:
            stop.hint = f"the first {lines:,} {done} are kept in {kept.folder}: the same command continues"
        else:  # stopped in its first chunk: nothing to keep
            kept.discard()
        raise
    kept.finish(count)

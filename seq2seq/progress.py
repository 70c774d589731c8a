"""Progress bars on stderr for long work, hidden when the seq2seq logger is set above INFO.

A bar is INFO-level output: `seq2seq --quiet` (or a program that sets the "seq2seq" logger to
WARNING) silences it with the log lines, so stderr carries only warnings and errors. A logger left
at its default level shows them, so a Python user of the Translator API sees bars as before.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def bars_allowed() -> bool:
    """False when the seq2seq logger's level, or that of every handler of it that shows lines (a
    file keeps them: cli.boundary), hides INFO lines."""
    logger = logging.getLogger("seq2seq")
    shown = [handler.level for handler in logger.handlers if not isinstance(handler, logging.FileHandler)]
    return max(logger.level, min(shown, default=logging.NOTSET)) <= logging.INFO


# On a terminal a bar is redrawn in place: one line. Written to a file (a cluster job's log, `2> log`)
# every redraw stays, ten a second by tqdm's default, megabytes of them in a day's training; there a
# bar is redrawn once a minute (its first and last states are always written).
FILE_REDRAW_S = 60.0


def progress_bar(*, enabled: bool = True, **options) -> tqdm:
    """A tqdm bar (its options as given), disabled unless `enabled` and bars are allowed; redrawn once
    a minute where its stream (stderr) is not a terminal."""
    stream = options.get("file") or sys.stderr
    if not _is_terminal(stream):
        options = {"mininterval": FILE_REDRAW_S, "maxinterval": FILE_REDRAW_S, **options}
    return tqdm(disable=not (enabled and bars_allowed()), **options)


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no stream (pythonw), or a closed one
        return False


def with_progress(items: Iterable[T], desc: str, *, enabled: bool) -> Iterator[T]:
    """`items` passed through a progress bar on stderr, shown from the first item on (a stream that
    is never read shows none)."""
    with progress_bar(enabled=enabled, desc=desc, unit=" pairs", unit_scale=True, leave=False) as bar:
        for item in items:
            bar.update()
            yield item

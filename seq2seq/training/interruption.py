"""Ctrl-C or SIGTERM while a run trains: the update under way ends, a checkpoint is saved, and then the
run stops as the signal asks; a second signal stops it at once. A validation under way is dropped
between two of its batches (`StopRequests.check`) and left for the resumed run to make first.

A signal acted on where it lands loses every update since the last periodic save (`train.save_every`,
often many minutes), and an update cut halfway cannot be saved at all. Preempted cloud machines and
SLURM jobs get SIGTERM and a grace period before they are killed, which this uses; Marian saves and
exits on SIGTERM the same way (its `--sigterm save-and-exit`).

One process only: the ranks of a torchrun job would have to agree on the update to stop after, and
torchrun sends its workers a signal of its own after the user's, which would count as the second.
They stop at once, as before, and keep the last periodic save.
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequested(BaseException):
    """Raised by StopRequests.check where work may be dropped. A BaseException, as KeyboardInterrupt is,
    so that no `except Exception` on the way takes it for an error."""


class StopRequests:
    """While entered, in the main thread of a single-process run, the first SIGINT or SIGTERM is only
    recorded (`requested`); `deliver` then does what the signal would have done. A signal ignored
    when the block begins (a background job's SIGINT, `nohup`) stays ignored."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.received: int | None = None  # the first signal's number
        self._previous: dict[int, object] = {}  # the handlers to give back

    @property
    def requested(self) -> bool:
        return self.received is not None

    def check(self) -> None:
        """Raise StopRequested once a stop is asked for: called between the batches of work that can be
        dropped and made again (a validation), where nothing is half-changed."""
        if self.requested:
            raise StopRequested

    def __enter__(self) -> StopRequests:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                previous = signal.getsignal(number)
                if previous is not signal.SIG_IGN:
                    self._previous[number] = previous
                    signal.signal(number, self._record)
        return self

    def __exit__(self, *exc_info) -> None:
        self._restore()

    def _restore(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)

    def _record(self, number: int, frame) -> None:
        if self.received is not None:  # the second: what the first would have done, now
            self.deliver(number)
            return
        self.received = number
        log.warning(
            "%s: the run stops once this update ends and its checkpoint is saved (send it again to stop at once)",
            signal.Signals(number).name,
        )

    def deliver(self, number: int | None = None) -> None:
        """Hand the signal (the first one recorded, unless `number`) to the handler it would have met:
        Python's KeyboardInterrupt for Ctrl-C, the CLI's Terminated for SIGTERM, or the default action."""
        number = self.received if number is None else number
        previous = self._previous.get(number, signal.SIG_DFL)
        self._restore()
        if callable(previous):
            previous(number, None)
        else:  # SIG_DFL: the process ends as it would have
            signal.raise_signal(number)

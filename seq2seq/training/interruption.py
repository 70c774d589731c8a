"""Ctrl-C or SIGTERM while a run trains: the update under way ends, a checkpoint is saved, and then the
run stops as the signal asks; a second signal stops it at once. A validation under way is dropped
between two of its batches (`StopRequests.check`) and left for the resumed run to make first.

A signal acted on where it lands loses every update since the last periodic save (`train.save_every`,
often many minutes), and an update cut halfway cannot be saved at all. Preempted cloud machines and
SLURM jobs get SIGTERM and a grace period before they are killed, which this uses; Marian saves and
exits on SIGTERM the same way (its `--sigterm save-and-exit`).

Under torchrun every rank records its signals, and rank 0's decides: the trainer shares it with the
clock it already shares after each update, and with a validation's outcome, so that all ranks stop
after the same update and save it together. There a signal again does not stop a rank at once:
torchrun passes the user's signal on to its workers, who may have had it from the terminal already,
and ends them itself when they outlast its grace period (30 s).
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
    """While entered, in the main thread, the first SIGINT or SIGTERM is only recorded (`requested`);
    `deliver` then does what the signal would have done. With `again_stops_at_once` (one process) a
    second signal is delivered at once; otherwise (torchrun's ranks) it is ignored. A signal ignored
    when the block begins (a background job's SIGINT, `nohup`) stays ignored."""

    def __init__(self, *, again_stops_at_once: bool, announce: bool = True) -> None:
        self.again_stops_at_once = again_stops_at_once
        self.announce = announce  # the warning line: rank 0's alone
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
        if threading.current_thread() is threading.main_thread():
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
        if self.received is not None:  # the second: what the first would have done, now (one process)
            if self.again_stops_at_once:
                self.deliver(number)
            return
        self.received = number
        if self.announce:
            again = " (send it again to stop at once)" if self.again_stops_at_once else ""
            name = signal.Signals(number).name
            log.warning("%s: the run stops once this update ends and its checkpoint is saved%s", name, again)

    def deliver(self, number: int) -> None:
        """Hand signal `number` to the handler it would have met: Python's KeyboardInterrupt for Ctrl-C,
        the CLI's Terminated for SIGTERM, or the default action."""
        previous = self._previous.get(number, signal.SIG_DFL)
        self._restore()
        if callable(previous):
            previous(number, None)
        else:  # SIG_DFL: the process ends as it would have
            signal.raise_signal(number)

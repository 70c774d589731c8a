"""The server's one translation thread: requests that arrive together are translated together.

It takes the first waiting request, then gathers more with the same decode settings for up to
`batch_wait` seconds or until a token budget is full, and translates them as one batch, so that the
server's throughput grows with concurrency. At most `max_queue` requests are open (queued or in
translation): a request's place is given back when the worker lets it go, never while it still sits
in the queue, so the bound holds even for clients that left.
"""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
import traceback
from concurrent.futures import Future

from seq2seq.deploy.requests import Job, RequestError
from seq2seq.inference.engine import DeadlinePassed
from seq2seq.inference.translator import Translator
from seq2seq.training.host_memory import release_free_heap


class BatchingWorker:
    """One thread that translates queued jobs in batches of jobs with equal decode settings."""

    def __init__(self, translator: Translator, batch_wait: float, max_queue: int) -> None:
        self.translator, self.batch_wait, self.max_queue = translator, batch_wait, max_queue
        self._open = threading.Semaphore(max_queue)  # one per request queued or in translation
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._held: collections.deque[Job] = collections.deque()  # other settings: next batch
        self.requests = self.batches = 0  # /health reports them: batches < requests shows batching at work
        self._thread = threading.Thread(target=self._run, name="translate-batches", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        """Requests queued, not yet taken into a batch."""
        return self._queue.qsize() + len(self._held)

    def submit(self, job: Job) -> Future:
        """Queue a job, or refuse it (RequestError 503) when max_queue requests are already open. Its
        place is given back when the worker lets the job go (done, or skipped after its client left),
        never while it still sits in the queue."""
        if not self._open.acquire(blocking=False):
            raise RequestError(503, f"the server is busy ({self.max_queue} requests open); retry shortly")
        self._queue.put(job)
        return job.future

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            first = self._held.popleft() if self._held else self._queue.get()
            if first is None:
                return
            batch, stopping = self._gather(first)
            try:
                self._translate(batch)
            finally:
                for _ in batch:
                    self._open.release()
            if stopping:
                return

    def _gather(self, first: Job) -> tuple[list[Job], bool]:
        batch, tokens = [first], first.tokens
        deadline = time.monotonic() + self.batch_wait
        while tokens < first.decode.batch_tokens and (remaining := deadline - time.monotonic()) > 0:
            try:
                job = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if job is None:
                return batch, True
            if job.decode != first.decode or job.kind != first.kind:
                self._held.append(job)
                continue
            batch.append(job)
            tokens += job.tokens
        return batch, False

    def _translate(self, batch: list[Job]) -> None:
        batch = [job for job in batch if job.future.set_running_or_notify_cancel()]  # timed out: skipped
        if not batch:
            return
        self.requests, self.batches = self.requests + len(batch), self.batches + 1
        lines = [line for job in batch for line in job.lines]
        deadline = max(job.deadline for job in batch)  # stop once no client of the batch still waits
        try:
            if batch[0].kind == "score":
                targets = [target for job in batch for target in job.targets]
                results = self.translator.score_with(lines, targets, batch[0].decode, deadline=deadline)
            else:
                prefixes = [p for job in batch for p in (job.prefixes or [""] * len(job.lines))]
                constraints = [c for job in batch for c in (job.constraints or [[]] * len(job.lines))]
                numbers = [number for job in batch for number in range(len(job.lines))]  # a line's index in its request
                results = self.translator.translate_with(
                    lines,
                    batch[0].decode,
                    prefixes=prefixes,
                    constraints=constraints,
                    line_numbers=numbers,
                    deadline=deadline,
                )
        except Exception as error:  # DeadlinePassed: the clients have left; anything else answers 500
            if not isinstance(error, DeadlinePassed):  # the details go to the server's log, never to the client
                traceback.print_exc(file=sys.stderr)
            # without its traceback, whose frames hold the search's tensors for as long as the future lives
            error = error.with_traceback(None)
            for job in batch:
                job.future.set_exception(error)
            release_free_heap()  # a search stopped part-way left its caches' holes in the heap
            return
        start = 0
        for job in batch:
            job.future.set_result(results[start : start + len(job.lines)])
            start += len(job.lines)

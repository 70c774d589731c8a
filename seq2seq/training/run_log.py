"""What a run records as it goes: metrics.jsonl (one JSON object per line), train.log (the log lines
that also go to stderr) and the memory figures the metrics carry."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from seq2seq.files import write_text_atomic

log = logging.getLogger(__name__)


class _LogFileHandler(logging.FileHandler):
    """A FileHandler that makes the file (and its folder) at its first line, not when it is set up: a
    run refused before it logs anything (bad validation data) leaves no run directory behind."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, encoding="utf-8", delay=True)

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


@contextlib.contextmanager
def log_to_file(path: Path) -> Iterator[None]:
    """Copy the toolkit's log lines (INFO and up, whatever stderr shows) into `path`, appended, while
    the block runs."""
    handler = _LogFileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s | %(levelname)s | %(message)s", "%Y-%m-%d %H:%M:%S"))
    logger = logging.getLogger("seq2seq")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()


class MetricsLog:
    """RUN_DIR/metrics.jsonl: {"kind": "train"|"valid", "time": ..., ...} per line; survives resume.

    When the optional `tensorboard` package is installed, the same scalars also go to
    RUN_DIR/tensorboard/ as TensorBoard events.
    """

    def __init__(self, path: Path, *, tensorboard: bool = False) -> None:
        self.path = path
        self._events = None
        if tensorboard and importlib.util.find_spec("tensorboard") is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._events = SummaryWriter(str(path.parent / "tensorboard"))

    def write(self, kind: str, **values: float | int) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps({"kind": kind, "time": round(time.time(), 3), **values}) + "\n")
        if self._events is not None:
            for name, value in values.items():
                if name != "step":
                    self._events.add_scalar(f"{kind}/{name}", value, values["step"])
            self._events.flush()

    def truncate_after(self, step: int) -> None:
        """Forget records past `step` (a resumed run logs those steps again) and any torn line."""
        kept = [record for record in self.read() if record.get("step", 0) <= step]
        write_text_atomic(self.path, "".join(json.dumps(record) + "\n" for record in kept))

    def read(self) -> list[dict]:
        """The records; a line that is not a whole JSON object (what a kill or a full disk leaves in the
        middle of an append) is skipped with a warning naming it."""
        if not self.path.exists():
            return []
        records = []
        with open(self.path, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except ValueError:
                    record = None
                if isinstance(record, dict):
                    records.append(record)
                else:
                    log.warning("%s:%d: not a whole metrics record (torn by a crash?); skipped", self.path, number)
        return records


def peak_memory_mb(device: torch.device) -> float:
    """Peak GPU memory allocated on CUDA, else the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def current_rss_mb() -> float | None:
    """The process's resident set size now (Linux; None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return None


def high_water_rss_mb() -> float | None:
    """The process's peak RSS since it started or since reset_high_water_rss() (Linux's VmHWM)."""
    try:
        with open("/proc/self/status") as handle:
            line = next(line for line in handle if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 1024  # KiB


def reset_high_water_rss() -> bool:
    """Starts a new high-water mark at the RSS now (Linux 4.0+: 5 written to clear_refs); False where
    that is not allowed. getrusage's peak is reset with it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


class PeakRss:
    """The peak RSS since the previous log line, and over the whole process.

    On CPU the trainer hands the heap's free pages back every HEAP_TRIM_EVERY steps, so RSS is a
    sawtooth: a single reading depends on where in that cycle it falls (low just after a release,
    up to several times that before the next), while the top of each log
    window, the memory the run actually needs, shows whether memory grows over a run. The kernel's
    high-water mark sees that top, inside the backward pass too, at no cost per step; resetting it
    at each log line gives every window its own peak. As that also resets what getrusage reports,
    the process's peak is kept here.
    """

    def __init__(self) -> None:
        self.process_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        self._resettable = reset_high_water_rss()

    def take(self) -> float | None:
        """The peak since the previous take (or since this object was made), and a new window; None
        where the high-water mark cannot be read or reset."""
        peak = high_water_rss_mb()
        if peak is None:
            return None
        self.process_peak = max(self.process_peak, peak)
        if not self._resettable:
            return None
        self._resettable = reset_high_water_rss()
        return peak


def memory_figures(device: torch.device, rss_peaks: PeakRss | None = None) -> dict[str, float]:
    """What metrics.jsonl logs about memory: the peak, the RSS now, the peak RSS of the log window
    (PeakRss) and, on CUDA, the caching allocator's allocated and reserved memory now (a growing
    reserved figure is fragmentation)."""
    figures = {"peak_memory_mb": peak_memory_mb(device)}
    window_peak = rss_peaks.take() if rss_peaks is not None else None
    if window_peak is not None:
        figures["window_peak_rss_mb"] = window_peak
    rss = current_rss_mb()
    if rss is not None:
        figures["rss_mb"] = rss
    if device.type != "cuda" and rss_peaks is not None:  # getrusage's peak starts again with each window
        figures["peak_memory_mb"] = max(figures["peak_memory_mb"], rss_peaks.process_peak)
    if device.type == "cuda":
        figures["cuda_allocated_mb"] = torch.cuda.memory_allocated(device) / 2**20
        figures["cuda_reserved_mb"] = torch.cuda.memory_reserved(device) / 2**20
    return figures


class LogWindow:
    """The training loss and tokens since the last log line. The loss of the applied updates stays on
    the device until the line is written (reading it every step would stall a GPU); a skipped
    update's NaN never enters the mean."""

    def __init__(self, device: torch.device) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=device)
        self.loss_tokens = torch.zeros_like(self.loss)
        self.tokens, self.start, self.device = 0, time.perf_counter(), device

    def add(self, step, tokens: int) -> None:
        """One update (train_step.StepResult) of `tokens` target tokens on this rank."""
        self.loss += torch.where(step.skipped, 0.0, step.loss_sum)
        self.loss_tokens += (~step.skipped) * tokens
        self.tokens += tokens

    def flush(self, dist) -> tuple[float, float]:
        """The window's mean loss per token and target tokens per second, over every rank; then empty it."""
        loss, loss_tokens, tokens = dist.sum(
            [*torch.stack([self.loss, self.loss_tokens]).tolist(), self.tokens], self.device
        )
        seconds = time.perf_counter() - self.start
        self.loss.zero_()
        self.loss_tokens.zero_()
        self.tokens, self.start = 0, time.perf_counter()
        return loss / max(loss_tokens, 1), tokens / seconds

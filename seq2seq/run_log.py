"""Append-only metrics log (one JSON object per line) and memory figures for it."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import time
from pathlib import Path

import torch


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
        """Forget records past `step`: a resumed run logs those steps again."""
        kept = [record for record in self.read() if record.get("step", 0) <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")
        tmp.replace(self.path)

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]


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


def memory_figures(device: torch.device) -> dict[str, float]:
    """What metrics.jsonl logs about memory: the peak, the RSS now and, on CUDA, the caching
    allocator's allocated and reserved memory now (a growing reserved figure is fragmentation)."""
    figures = {"peak_memory_mb": peak_memory_mb(device)}
    rss = current_rss_mb()
    if rss is not None:
        figures["rss_mb"] = rss
        if device.type != "cuda":  # the kernel updates the recorded peak lazily: it can trail the RSS now
            figures["peak_memory_mb"] = max(figures["peak_memory_mb"], rss)
    if device.type == "cuda":
        figures["cuda_allocated_mb"] = torch.cuda.memory_allocated(device) / 2**20
        figures["cuda_reserved_mb"] = torch.cuda.memory_reserved(device) / 2**20
    return figures

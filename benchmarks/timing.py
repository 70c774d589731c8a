"""Timing shared by the benchmarks that time calls side by side."""

from __future__ import annotations

import time
from collections.abc import Callable


def seconds_per_call(call: Callable[[], object], repeats: int) -> float:
    """The mean wall time of `repeats` calls, after one untimed call (first-call work: kernel builds,
    oneDNN's kernel cache, allocations)."""
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats

"""Give the memory that training frees back to the operating system (Linux, glibc).

What held it (`mallinfo2` on a bf16 CPU run of the Bible config): glibc's heap had grown to several
times the memory in use, most of it free, in thousands of holes between live blocks. Activation
tensors change size with every batch; glibc serves blocks up to 32 MiB from its heap (its mmap
threshold rises to the largest block freed so far), and it returns memory to the kernel only from
the top of the heap, so the holes stay resident. `malloc_trim(0)` releases the whole free pages of
every hole. Each call costs re-faulting those pages: the heap holds hundreds of MB of free chunks
at the end of a step, and the step after a call faults them in again. Every 10 steps that cost a
step several times the page faults and kernel CPU time it takes untrimmed; every 100 costs a
fraction of that, and RSS's window peak stays level over a long run, nearly as low as every 10's,
where never trimming levels off higher (benchmark_train's fault, time and memory columns, in the
ledger; docs/performance.md, memory in long runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

HEAP_TRIM_EVERY = 100  # training steps between two releases


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Return the heap's free pages to the kernel; False where that cannot be done."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True

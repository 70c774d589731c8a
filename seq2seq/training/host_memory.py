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

tcmalloc keeps freed blocks for the next ones of their size instead: a bf16 step under it faults a
few hundred pages where glibc's faults thousands, and the run holds less memory. seq2seq does not
load it into a running process (an allocator is chosen before the first block is allocated), so
training on a CPU says how to preload it where it is installed and not in use (allocator_hint).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import platform
from pathlib import Path

from seq2seq.mapped_libraries import library_of

HEAP_TRIM_EVERY = 100  # training steps between two releases
PRELOADED_ALLOCATORS = ("tcmalloc", "jemalloc")  # in the file names of the allocators people preload
TCMALLOC_NAMES = ("tcmalloc_minimal", "tcmalloc")  # as ctypes.util.find_library looks them up


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (macOS, musl) or another allocator
    serves this process (whose heap glibc's trim would not touch)."""
    name = ctypes.util.find_library("c")
    if name is None or allocator_in_use() is not None:
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


def allocator_hint() -> str | None:
    """One line saying how to run under tcmalloc, where glibc's malloc serves this process and tcmalloc
    is installed (Linux); None elsewhere, or where another allocator is in use already."""
    if platform.system() != "Linux" or allocator_in_use() is not None:
        return None
    library = installed_tcmalloc()
    if library is None:
        return None
    return (f"memory: glibc's malloc; tcmalloc is installed, under which training on a CPU holds less memory "
            f"and the kernel less time: set LD_PRELOAD={library} before the command (docs/performance.md)")  # fmt: skip


def installed_tcmalloc() -> str | None:
    """The name under which the loader finds tcmalloc here (libtcmalloc_minimal.so.4), or None."""
    return next(filter(None, map(ctypes.util.find_library, TCMALLOC_NAMES)), None)


@functools.cache
def allocator_in_use() -> str | None:
    """The preloaded allocator that serves this process's malloc ("tcmalloc", "jemalloc"), or None:
    glibc's (asked once: a process keeps the allocator it started with). It is the library that
    defines the malloc the process's global scope resolves, where a preload comes first."""
    try:
        library = library_of(ctypes.CDLL(None).malloc)
    except (OSError, AttributeError):
        return None
    name = Path(library).name if library else ""
    return next((allocator for allocator in PRELOADED_ALLOCATORS if allocator in name), None)

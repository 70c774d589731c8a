"""The shared libraries this process has loaded, and which of them a loaded function lies in (Linux:
/proc/self/maps). Two questions are answered this way, where a library's name alone would mislead: the
OpenMP library PyTorch runs on (model/cpu_kernels.py: wheels bundle OpenMP libraries of their own), and
the allocator that serves malloc (training/host_memory.py: a wheel may bundle an allocator for its own
use without serving the process's malloc)."""

from __future__ import annotations

import ctypes
from pathlib import Path


def mapped_libraries() -> dict[tuple[int, int], str]:
    """This process's file mappings: their address ranges and the files they map (/proc/self/maps)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        return {}
    mapped = {}
    for line in maps.read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            start, end = fields[0].split("-")
            mapped[int(start, 16), int(end, 16)] = fields[5]
    return mapped


def library_of(function: ctypes._CFuncPtr, mapped: dict[tuple[int, int], str] | None = None) -> str | None:
    """The path of the library whose code `function` (a ctypes function) lies in, or None."""
    address = ctypes.cast(function, ctypes.c_void_p).value
    libraries = mapped_libraries() if mapped is None else mapped
    return next((path for (start, end), path in libraries.items() if start <= address < end), None)

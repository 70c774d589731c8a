"""Training on a CPU under glibc's malloc says how to preload tcmalloc where it is installed (fewer
page faults, less memory: docs/performance.md), and says nothing where it is in use or absent."""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys

import pytest

from seq2seq.training import host_memory
from seq2seq.training.host_memory import TCMALLOC_NAMES, allocator_hint, allocator_in_use, installed_tcmalloc

from ..conftest import make_trainer

pytestmark = pytest.mark.skipif(platform.system() != "Linux", reason="LD_PRELOAD and /proc/self/maps are Linux's")


def pretend_installed(monkeypatch, library: str | None) -> None:
    """ctypes.util.find_library finds `library` under tcmalloc's first name, or nothing."""
    names = {TCMALLOC_NAMES[0]: library}
    monkeypatch.setattr(host_memory.ctypes.util, "find_library", lambda name: names.get(name))


@pytest.fixture
def under_glibc():
    if allocator_in_use() is not None:
        pytest.skip(f"this test process runs under {allocator_in_use()}")


def test_a_cpu_run_under_glibc_says_how_to_preload_an_installed_tcmalloc(tmp_path, tiny_data, monkeypatch,
                                                                         caplog, under_glibc):  # fmt: skip
    pretend_installed(monkeypatch, "libtcmalloc_minimal.so.4")
    trainer = make_trainer(tmp_path, tiny_data, device="cpu", max_steps=1, save_every=1, valid_every=100)
    with caplog.at_level(logging.INFO, logger="seq2seq.training.trainer"):
        trainer.run()
    hints = [record.getMessage() for record in caplog.records if "LD_PRELOAD" in record.getMessage()]
    assert len(hints) == 1 and "LD_PRELOAD=libtcmalloc_minimal.so.4 " in hints[0]


def test_nothing_is_said_where_tcmalloc_is_not_installed(monkeypatch, under_glibc):
    pretend_installed(monkeypatch, None)
    assert allocator_hint() is None


def test_nothing_is_said_under_a_preloaded_tcmalloc():
    """The real thing: a process started with LD_PRELOAD maps tcmalloc; the hint sees it, and the
    trainer's heap release (glibc's malloc_trim, which tcmalloc's blocks are not under) is not made."""
    library = installed_tcmalloc()
    if library is None:
        pytest.skip("tcmalloc is not installed (Debian: libtcmalloc-minimal4)")
    probe = "from seq2seq.training.host_memory import *\n"
    probe += "print(allocator_in_use(), allocator_hint(), release_free_heap())"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={**os.environ, "LD_PRELOAD": library})  # fmt: skip
    assert run.stdout.split() == ["tcmalloc", "None", "False"]


def test_a_tcmalloc_loaded_for_a_librarys_own_use_is_not_the_allocator_in_use():
    """A wheel may load an allocator for itself: glibc's malloc still serves the process, so its heap is
    still trimmed and the hint still said. The allocator is the library that defines the malloc the
    process resolves, not one whose name the process maps."""
    library = installed_tcmalloc()
    if library is None:
        pytest.skip("tcmalloc is not installed (Debian: libtcmalloc-minimal4)")
    probe = f"import ctypes\nctypes.CDLL({library!r}, mode=ctypes.RTLD_LOCAL)\n"
    probe += "from seq2seq.training.host_memory import *\nprint(allocator_in_use(), release_free_heap())"
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                         env={name: value for name, value in os.environ.items() if name != "LD_PRELOAD"})  # fmt: skip
    assert run.stdout.split() == ["None", "True"]

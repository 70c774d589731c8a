"""Where the fused CPU kernels cannot or must not be used, callers are told None, never an error; and
the loops written for vector registers are built into them."""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

import pytest
import torch

import seq2seq.model.cpu_kernels as kernels_module
from seq2seq.model.cpu_kernels import (
    CAPPED_TARGETS,
    COMPILE_FLAGS,
    SOURCES,
    SWITCH,
    _built,
    _load,
    _remove_stale_builds,
    cpu_kernels,
    one_unit,
)


def test_the_switch_turns_them_off(monkeypatch):
    monkeypatch.setenv(SWITCH, "0")
    assert cpu_kernels() is None


def test_a_build_that_fails_is_one_warning_and_leaves_nothing_behind(tmp_path, monkeypatch, caplog):
    """No working C++ compiler: the loss takes PyTorch's path, the log says why, the cache stays empty."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="seq2seq"):
        assert _built.__wrapped__() is None
    assert "fused CPU kernels unavailable" in caplog.text
    assert list((tmp_path / "seq2seq" / "cpu_kernels").iterdir()) == []


def test_processes_that_want_them_at_once_build_them_once(tmp_path, monkeypatch):
    """pytest's workers and DDP's ranks start together with an empty cache: the first builds, the other
    waits for its build and loads it, where each built a copy of its own on the same cores. The build
    is a stand-in held until the second is at the lock."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    building, release, second_at_lock = threading.Event(), threading.Event(), threading.Event()
    builds, loads = [], []

    def build(name, sources, *, build_directory, **options):
        builds.append(name)
        building.set()
        assert release.wait(timeout=60)
        (Path(build_directory) / f"{name}.so").write_bytes(b"built")

    flock = kernels_module.fcntl.flock

    def flock_noting_the_second(folder, operation):
        if threading.current_thread().name == "second":
            second_at_lock.set()
        return flock(folder, operation)

    monkeypatch.setattr(cpp_extension, "load", build)
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    monkeypatch.setattr(kernels_module.fcntl, "flock", flock_noting_the_second)
    first = threading.Thread(target=_load, name="first")
    first.start()
    assert building.wait(timeout=60)
    second = threading.Thread(target=_load, name="second")
    second.start()
    assert second_at_lock.wait(timeout=60)  # it found no build and asks for the lock the first holds
    release.set()
    first.join(timeout=60)
    second.join(timeout=60)
    assert len(builds) == 1
    built = tmp_path / "seq2seq" / "cpu_kernels" / f"{builds[0]}.so"
    assert loads == [str(built)] and built.read_bytes() == b"built"  # the second loaded the first's build
    assert [path.name for path in built.parent.iterdir()] == [built.name]  # no lock file, no build folder


def _stand_in_builds(monkeypatch, tmp_path) -> tuple[Path, list, list]:
    """An empty cache in tmp_path whose builds are stand-ins: (the cache, the builds made, the loads)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    builds, loads = [], []

    def build(name, sources, *, build_directory, **options):
        builds.append(name)
        (Path(build_directory) / f"{name}.so").write_bytes(b"built")

    monkeypatch.setattr(cpp_extension, "load", build)
    monkeypatch.setattr(torch.ops, "load_library", loads.append)
    return tmp_path / "seq2seq" / "cpu_kernels", builds, loads


def _aged(path: Path, days: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_bytes(b"old")
    when = time.time() - days * 24 * 3600
    os.utime(path, (when, when))
    return path


def test_a_build_removes_the_builds_no_process_loaded_for_a_month_and_those_a_dead_build_left(tmp_path, monkeypatch):
    cache, builds, _ = _stand_in_builds(monkeypatch, tmp_path)
    stale = _aged(cache / "seq2seq_cpu_0123456789abcdef.so", days=40)
    recent = _aged(cache / "seq2seq_cpu_fedcba9876543210.so", days=20)
    users = _aged(cache / "notes.txt", days=400)
    died_building = cache / "build-k2x9" / "seq2seq_cpu.o"  # a build killed before it could clean up
    died_building.parent.mkdir()
    died_building.write_bytes(b"half")
    _load()
    assert len(builds) == 1 and (cache / f"{builds[0]}.so").read_bytes() == b"built"
    assert not stale.exists() and recent.exists() and users.exists()
    assert sorted(path.name for path in cache.iterdir()) == sorted([f"{builds[0]}.so", recent.name, users.name])


def test_loading_a_build_keeps_it_from_being_removed(tmp_path, monkeypatch):
    cache, builds, loads = _stand_in_builds(monkeypatch, tmp_path)
    _load()
    built = _aged(cache / f"{builds[0]}.so", days=40)
    _load()  # from the cache: its last use is now
    assert loads[-1] == str(built) and len(builds) == 1
    _remove_stale_builds(cache)  # as the next build, of other sources, does
    assert built.exists()


# A process that imports `first`, then loads the kernels: the path of the build it loaded.
BUILD_LOADED_AFTER = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from seq2seq.model.cpu_kernels import cpu_kernels
if cpu_kernels() is None:
    sys.exit(3)
print(next(line.split()[-1] for line in open("/proc/self/maps") if "seq2seq_cpu_" in line))
"""


@pytest.mark.skipif(platform.system() != "Linux", reason="reads a process's mappings in /proc")
def test_a_process_loads_the_same_build_whatever_it_imported_first(fused_kernels):
    """sentencepiece's and CTranslate2's wheels each bundle a libgomp of their own, mapped beside
    PyTorch's once imported. The kernels link to PyTorch's, in every process: where a process linked
    to the copy it had mapped first, a training process and a command that imported CTranslate2
    built them again, each for its own copy."""
    imports = [["torch"], ["torch", "sentencepiece", *(["ctranslate2"] if _installed("ctranslate2") else [])]]
    loaded = []
    for modules in imports:
        run = subprocess.run([sys.executable, "-c", BUILD_LOADED_AFTER, *modules], capture_output=True, text=True,
                             timeout=300)  # fmt: skip
        if run.returncode == 3:
            pytest.skip("the fused CPU kernels are not built in a fresh process")
        assert run.returncode == 0, run.stderr
        loaded.append(run.stdout.strip())
    assert loaded[0] == loaded[1]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@functools.cache
def _compiler_reports() -> str:
    """GCC's vectoriser report for the kernels, built as they are (one unit) for an AVX2-only CPU."""
    from torch.utils import cpp_extension

    flags = [*COMPILE_FLAGS, CAPPED_TARGETS["avx2"], "-fopenmp", "-std=c++17", "-fopt-info-vec-missed"]
    includes = [f"-I{path}" for path in (*cpp_extension.include_paths(), sysconfig.get_paths()["include"])]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    built = subprocess.run(["g++", *flags, *includes, abi, "-x", "c++", "-c", "-", "-o", os.devnull], input=one_unit(),
                           capture_output=True, text=True, check=True)  # fmt: skip
    return built.stderr


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None,
                    reason="the check cross-compiles for AVX2 with GCC on x86")  # fmt: skip
@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.name)
def test_every_loop_marked_simd_is_vectorised_on_avx2(source):
    """A loop written to run in vector registers (`#pragma omp simd`) that GCC leaves scalar runs several
    times slower, silently: on AVX2, which lacks AVX-512's masks, it happened to every loop that chose
    between two values (until -fno-trapping-math) or read memory under a condition."""
    lines = source.read_text().splitlines()
    reports = [report.partition(": missed: ") for report in _compiler_reports().splitlines()]
    scalar = set()
    # A loop left scalar: "couldn't vectorize loop", then "not vectorized: <why>" at the same place (a
    # bare first line is also printed for the scalar twin GCC keeps beside a vectorised simd loop).
    for (where, _, message), (next_where, _, reason) in zip(reports, reports[1:]):
        left_scalar = message == "couldn't vectorize loop" and reason.startswith("not vectorized")
        if left_scalar and where == next_where and where.startswith(str(source)):
            loop = _enclosing_loop(lines, int(where.split(":")[-2]))  # GCC names a line of the body
            if loop > 1 and "#pragma omp simd" in lines[loop - 2]:
                scalar.add(f"{source.name}:{loop}: {lines[loop - 1].strip()}")
    assert not scalar, "\n".join(sorted(scalar))


def _enclosing_loop(lines: list[str], number: int) -> int:
    """The number of the nearest line at or above `number` that opens a for loop."""
    while number > 1 and not lines[number - 1].lstrip().startswith("for ("):
        number -= 1
    return number

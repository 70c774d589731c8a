"""Fused CPU kernels (cpu_kernels.cpp, cpu_attention.cpp, cpu_residual_norm.cpp, cpu_linear.cpp,
cpu_embedding.cpp, cpu_optimizer.cpp), built for this machine the first time they are needed.

Where a CPU's matrix products are fast (bf16 on AMX), a training step is bound by the memory traffic
of the work between them. PyTorch runs that work as one pass over a whole tensor per operation, each
reading and writing DRAM: the output layer's loss made about ten passes over every chunk of logits.
A fused kernel reads a row once and keeps it in the core's cache for every step of its work.
torch.compile's CPU code for the same work was slower than eager PyTorch (docs/performance.md, tried
and not taken) and the library that shipped such kernels, intel-extension-for-pytorch, stops at
PyTorch 2.8, so they are written here and compiled with PyTorch's extension builder (a C++
compiler and ninja): once, then cached by source, PyTorch version and CPU. The sources
are compiled as one unit: each spent nearly all of its compile reading PyTorch's headers. They are
built with `-march=native` (fewer instructions where ATEN_CPU_CAPABILITY caps PyTorch's), so the
cache key holds the flags and the CPU's: a cache shared by machines of several kinds keeps one build
per kind. A build removes those no process has loaded for a month.

`cpu_kernels()` is None where they cannot be built (no compiler: one warning says so), where
SEQ2SEQ_CPU_KERNELS=0 is set, or on a machine that is not Linux; callers then take their PyTorch
path, which computes the same (tests hold the two paths to each other).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from seq2seq.mapped_libraries import library_of, mapped_libraries

log = logging.getLogger(__name__)

KERNEL_FILES = ("cpu_kernels", "cpu_attention", "cpu_residual_norm", "cpu_linear", "cpu_embedding", "cpu_optimizer")
SOURCES = tuple(Path(__file__).with_name(f"{name}.cpp") for name in KERNEL_FILES)
HEADER = Path(__file__).with_name("cpu_kernels.h")
SWITCH = "SEQ2SEQ_CPU_KERNELS"  # "0": never build or use them (compare speed, rule them out)
# -ffp-contract=off: no multiply and add fused into one rounding, so that a sum rounds as PyTorch's
# separate operations do (dropout_add equals x + dropout(y) bitwise in fp32) on every CPU.
# -fno-trapping-math: nothing here reads floating-point exception flags, and without it GCC will not
# vectorise a loop whose elements choose between two values (`kept ? x * scale : 0`, a clamp before
# exp) below AVX-512, whose masks it uses instead: on AVX2 the softmax, dropout and loss loops ran
# one float at a time. It changes no result: each element's operations and their rounding stay.
# -fno-math-errno: nor does anything read errno, which std::sqrt would otherwise set for a negative
# argument, through a branch that leaves the loop around it scalar (Adam's update, cpu_optimizer.cpp).
COMPILE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno")
# PyTorch's own cap on the vector instructions of its CPU kernels, which ours follow too: an AVX-512
# machine run with ATEN_CPU_CAPABILITY=avx2 stands in for an AVX2-only one (benchmarks/ledger.py).
CAPPED_TARGETS = {"default": "-march=x86-64", "avx2": "-march=haswell"}
REASON_CHARS = 200  # of a build error's line in the warning
BUILD_NAME = "seq2seq_cpu_{key}.so"  # the cache's builds, one per key
BUILD_FOLDER = "build-"  # the prefix of a build's work folder in the cache, removed when it ends
# A build no process has loaded for this long is removed when another is built: each new version of
# the sources, of PyTorch or of a virtual environment's path builds anew, and the cache kept them all.
STALE_AFTER_S = 30 * 24 * 3600


def cpu_kernels():
    """The kernels' op namespace (torch.ops.seq2seq_cpu), or None where they are not available or
    switched off (read at every call, so that a test or a benchmark can switch them off for a while)."""
    return None if os.environ.get(SWITCH, "1") == "0" else _built()


@functools.cache
def _built():
    """Build or load the kernels once per process; None where that cannot be done."""
    if platform.system() != "Linux":
        return None
    try:
        _load()
    except Exception as error:  # no compiler or ninja, or a build error: the PyTorch path computes the same
        lines = str(error).strip().splitlines() or [type(error).__name__]
        reason = next((line for line in lines if "error:" in line), lines[0])  # the compiler's, where it has one
        log.warning("fused CPU kernels unavailable (%s): training takes PyTorch's slower path",
                    reason if len(reason) <= REASON_CHARS else reason[:REASON_CHARS] + "...")  # fmt: skip
        return None
    return torch.ops.seq2seq_cpu


def _load() -> None:
    """Load the cached build for this machine, or build it (in a fresh folder, then renamed into the
    cache), one process at a time: processes that want the kernels at once (pytest's workers, DDP's
    ranks on one machine) wait for the first one's build and load it, where each built its own copy,
    side by side on the same cores."""
    flags, openmp = build_flags()
    texts = [path.read_text() for path in (*SOURCES, HEADER)]
    key = hashlib.sha256("\n".join([*texts, torch.__version__, *flags, str(openmp), _cpu_flags()])
                         .encode()).hexdigest()[:16]  # fmt: skip
    cache = _cache_dir()
    built = cache / BUILD_NAME.format(key=key)
    if not built.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with _one_build_at_a_time(cache):
            if not built.exists():  # else another process built it while this one waited
                _build(built, flags, openmp)
                _remove_stale_builds(cache)
                return  # the builder loaded it
    with contextlib.suppress(OSError):  # a cache this user cannot write: nothing is ever removed from it
        os.utime(built)  # its last use (_remove_stale_builds)
    torch.ops.load_library(str(built))


def _remove_stale_builds(cache: Path) -> None:
    """Remove the cache's builds that no process has loaded for STALE_AFTER_S (a load sets a build's
    modification time; a process that still runs one keeps its mapping), and the build folders of
    processes that died building: builds run one at a time, under the lock this one holds."""
    for folder in cache.glob(f"{BUILD_FOLDER}*"):
        shutil.rmtree(folder, ignore_errors=True)
    now = time.time()
    for build in cache.glob(BUILD_NAME.format(key="*")):
        with contextlib.suppress(OSError):  # removed meanwhile by another process
            if now - build.stat().st_mtime > STALE_AFTER_S:
                build.unlink()


def build_flags() -> tuple[list[str], str | None]:
    """The compiler's flags for this machine, and the OpenMP library to link (None: none)."""
    openmp = _openmp_runtime()
    return [*COMPILE_FLAGS, *_target(), "-fopenmp" if openmp else "-fopenmp-simd"], openmp


def _build(built: Path, flags: list[str], openmp: str | None) -> None:
    """Build the kernels into `built` and load them."""
    log.info("building the fused CPU kernels for this machine (once, well under a minute)")
    cache = built.parent
    work = Path(tempfile.mkdtemp(dir=cache, prefix=BUILD_FOLDER))
    try:
        from torch.utils import cpp_extension

        unit = work / "seq2seq_cpu.cpp"
        unit.write_text(one_unit())
        with _ninja_on_path():
            cpp_extension.load(built.stem, [str(unit)], extra_cflags=flags,
                               is_python_module=False, extra_ldflags=[openmp] if openmp else [],
                               build_directory=str(work))  # fmt: skip
        os.replace(work / built.name, built)  # loaded above; later processes load the cached file
    finally:
        shutil.rmtree(work, ignore_errors=True)


def one_unit() -> str:
    """The sources as one C++ unit, so that PyTorch's headers are compiled once, not once per source."""
    return "".join(f'#include "{path}"\n' for path in SOURCES)


@contextlib.contextmanager
def _one_build_at_a_time(cache: Path):
    """An exclusive lock on the cache folder for the block: an flock on the folder itself, so that
    nothing is left in it, and the kernel frees it if the process dies."""
    folder = os.open(cache, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # which releases the lock


def _target() -> list[str]:
    """The instructions to compile for: this CPU's (-march=native), or fewer where PyTorch's kernels
    are capped (on x86). GCC vectorises loops in 256-bit registers even where the CPU has 512-bit
    ones; the kernels' long loops over rows (the loss, LayerNorm, dropout) run faster in 512, so on
    x86 they ask for them (a no-op below AVX-512; cpu_attention.cpp keeps 256 for its short loops)."""
    capped = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if platform.machine() not in ("x86_64", "AMD64"):
        return ["-march=native"]
    if capped in CAPPED_TARGETS:
        return [CAPPED_TARGETS[capped]]
    return ["-march=native", "-mprefer-vector-width=512"]


def _openmp_runtime() -> str | None:
    """The OpenMP library this process's PyTorch runs on, which the kernels link to as well: their
    parallel loops (at::parallel_for) run on PyTorch's threads, as many as torch.set_num_threads says.
    It is the library in which libtorch_cpu finds `omp_get_max_threads`, not the first OpenMP library
    the process maps: sentencepiece's and CTranslate2's wheels each bundle a libgomp of their own, so
    that one depended on what the process had imported, and each kind of process (pytest's workers, the
    CLI, a script that imported CTranslate2) built the kernels again for its own. None where PyTorch runs
    without OpenMP (the kernels then run on one thread)."""
    if torch.__config__.parallel_info().find("OpenMP") < 0:
        return None
    mapped = mapped_libraries()
    torch_cpu = next((path for path in mapped.values() if Path(path).name.startswith("libtorch_cpu")), None)
    if torch_cpu is None:
        return None
    try:  # looked up from libtorch_cpu's handle: found in the libraries it was linked to, as it uses it
        return library_of(ctypes.CDLL(torch_cpu).omp_get_max_threads, mapped)
    except AttributeError:
        return None


def _cpu_flags() -> str:
    """The CPU's feature flags (what -march=native compiles for)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor()


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "seq2seq" / "cpu_kernels"


@contextlib.contextmanager
def _ninja_on_path():
    """PyTorch's builder runs `ninja` from PATH; the ninja package installed with seq2seq puts it in
    the virtual environment's bin folder, which a run of .venv/bin/seq2seq need not have on PATH."""
    saved = os.environ.get("PATH", "")
    if shutil.which("ninja") is None:
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, saved])
    try:
        yield
    finally:
        os.environ["PATH"] = saved

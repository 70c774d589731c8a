#!/usr/bin/env python3
"""The first build of the fused CPU kernels on a machine: the sources as one C++ unit (as
model/cpu_kernels.py builds them) against one unit per source (as they were built before), side by
side, each in a fresh process with an empty build folder, timed whole: wall time, and the CPU time
of the process and the compilers it ran.

Each unit compiles PyTorch's headers, which are nearly all of a source's compile; ninja compiles
separate units in parallel, as far as the machine has cores, so the wall time gains less than the
CPU time where there are several.

    python benchmarks/benchmark_kernel_build.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ledger import describe_machine

ONE_UNIT = "one unit"
# A fresh process builds the kernels into the folder it is given, from the files it is given.
BUILD = """
import sys
from pathlib import Path
from torch.utils import cpp_extension
from seq2seq.model.cpu_kernels import SOURCES, build_flags, one_unit
folder, one = Path(sys.argv[1]), sys.argv[2] == "one"
flags, openmp = build_flags()
if one:
    (folder / "unit.cpp").write_text(one_unit())
sources = [str(folder / "unit.cpp")] if one else [str(path) for path in SOURCES]
cpp_extension.load("seq2seq_cpu_timed", sources, extra_cflags=flags, is_python_module=False,
                   extra_ldflags=[openmp] if openmp else [], build_directory=str(folder))
"""


def timed_build(one: bool) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one build in a fresh process."""
    folder = Path(tempfile.mkdtemp(prefix="kernel-build-"))
    try:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", BUILD, str(folder), "one" if one else "each"], check=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="builds a side (the best is kept)")
    args = parser.parse_args()
    if shutil.which("g++") is None and shutil.which("c++") is None:
        raise SystemExit("no C++ compiler here: nothing to build")
    from seq2seq.model.cpu_kernels import SOURCES

    sides = {"one unit per source": False, ONE_UNIT: True}
    best = {name: (float("inf"), float("inf")) for name in sides}
    for _ in range(args.rounds):
        for name, one in sides.items():
            wall, cpu = timed_build(one)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    print(f"{describe_machine()}; {len(SOURCES)} sources; best of {args.rounds} builds a side")
    print(f"\n| side | wall s | CPU s | wall vs {ONE_UNIT} | CPU vs {ONE_UNIT} |")
    print("|---|---|---|---|---|")
    for name in sides:
        wall, cpu = best[name]
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {wall / best[ONE_UNIT][0]:.2f}x | {cpu / best[ONE_UNIT][1]:.2f}x |")


if __name__ == "__main__":
    main()

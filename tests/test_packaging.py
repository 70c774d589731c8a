"""What a built wheel holds: the files seq2seq reads from its own package at run time, so that an
install from a wheel (not only the editable one of `make install`) runs the demo and builds the fused
CPU kernels."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from seq2seq.cli.demo import DEMO_CONFIG
from seq2seq.model.cpu_kernels import HEADER, SOURCES

ROOT = Path(__file__).resolve().parent.parent


def test_a_wheel_holds_the_kernels_sources_and_the_demo_config(tmp_path):
    pytest.importorskip("setuptools", reason="builds the wheel with the environment's setuptools (no network)")
    source = tmp_path / "source"  # a copy: the build writes its folders next to pyproject.toml
    shutil.copytree(ROOT / "seq2seq", source / "seq2seq", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp_path / "dist"), str(source)], check=True, timeout=300)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("seq2seq-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    needed = {str(path.relative_to(ROOT)) for path in (*SOURCES, HEADER, DEMO_CONFIG)}
    assert needed <= held, f"missing from the wheel: {sorted(needed - held)}"

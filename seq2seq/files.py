"""Files the toolkit writes: checked before the work that produces them, written atomically.

An output path is checked before minutes of translation or training are spent on its content; a
file is written to a temporary name in the same folder, flushed to disk and renamed, so a crash or a
full disk never leaves half a file under the real name, and a failed write removes its temporary
file instead of leaving it to hold the space a retry needs. Of the files it reads, one fact decides
how: a stream (a pipe) can be read only once (read_once).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

from seq2seq.errors import UserInputError


def check_writable(path: str | Path, *, what: str = "output file") -> None:
    """Fail now, in one line, if `path` cannot be written later: its folder is missing or read-only,
    or it is a directory."""
    path = Path(path)
    folder = path.parent
    if path.is_dir():
        raise UserInputError(f"{path}: is a directory; expected an {what} path")
    if not folder.is_dir():
        problem = "is not a directory" if folder.exists() else "does not exist"
        raise UserInputError(f"{path}: the folder {folder} {problem}; expected an {what} in an existing folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserInputError(f"{path}: the folder {folder} is not writable; expected a writable folder")


def check_new_file(path: str | Path, *, what: str = "output file") -> None:
    """check_writable, and refuse a path that exists: a command never replaces a file it did not make
    (`-o` naming the command's own input, a checkpoint). A stream (read_once: /dev/null, /dev/stdout,
    a pipe such as `-o >(gzip > out.gz)`) is written into as it comes (atomic_write): nothing is replaced."""
    path = Path(path)
    if written_as_it_comes(path):
        return
    if path.exists() and not path.is_dir():
        raise UserInputError(f"{path}: already exists; expected a new {what} (delete it or choose another path)")
    check_writable(path, what=what)


def temporary_path(path: str | Path) -> Path:
    """Where `path` is built before it is renamed into place: .NAME.tmp-HOST-PID beside it. The host
    and PID tell remove_stale_temporaries whether its writer is still alive: a PID means nothing on
    another host or container sharing the folder (a network file system, a mounted cache)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def remove_stale_temporaries(folder: str | Path, name: str = "*") -> None:
    """Remove the temporaries (.NAME.tmp-HOST-PID files or folders) of `name` in `folder` that a
    process of this host which no longer runs left behind. A live process's, which it is still
    writing, stay; so do another host's, whose processes this one cannot see."""
    folder, host = Path(folder), socket.gethostname()
    for stale in folder.glob(f".{name}.tmp-*") if folder.is_dir() else ():
        writer_host, _, pid = stale.name.rpartition(".tmp-")[2].rpartition("-")
        if writer_host != host or not pid.isdigit() or _running(int(pid)):
            continue
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def atomic_write(path: str | Path) -> Iterator[BinaryIO]:
    """A binary handle whose content replaces `path` only when the block completes; on any failure the
    temporary file is deleted and `path` is left as it was. A killed writer's leftovers for `path` go first.
    A stream (written_as_it_comes) is written directly, appended to: it has no folder to rename in,
    its reader takes what comes (the rename would have replaced /dev/null with a regular file), and a
    file the shell opened for it (`-o /dev/stdout >> log.txt`) keeps what it held."""
    path = Path(path)
    if written_as_it_comes(path):
        with open(path, "ab") as handle:
            yield handle
        return
    remove_stale_temporaries(path.parent, path.name)
    tmp = temporary_path(path)
    try:
        with open(tmp, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_text_write(path: str | Path) -> Iterator[TextIO]:
    """UTF-8 text written through atomic_write, gzip-compressed where the name ends in .gz: every
    reader here (sources.read_lines) opens such a name as gzip, so `-o out.gz` written as plain text
    could not be read back by `seq2seq score --hyp out.gz`."""
    with atomic_write(path) as handle:
        compressed = gzip.GzipFile(fileobj=handle, mode="wb", mtime=0) if str(path).endswith(".gz") else None
        text = io.TextIOWrapper(compressed or handle, encoding="utf-8", write_through=True)
        try:
            yield text
        finally:
            text.detach()  # atomic_write closes the file; GzipFile.close writes its trailer and leaves it open
            if compressed:
                compressed.close()


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_text_write(path) as handle:
        handle.write(text)


DIGEST_BLOCK = 1 << 20  # bytes read at a time when fingerprinting a file


def content_digest(path: str | Path) -> str:
    """The content of a file (a checkpoint), or of every file under a directory (an export) with its
    name, as a sha256: what a stage that depends on it compares to know it is still current."""
    path, digest = Path(path), hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]:
        digest.update(file.relative_to(path).as_posix().encode() if path.is_dir() else b"")
        with open(file, "rb") as handle:
            while block := handle.read(DIGEST_BLOCK):
                digest.update(block)
    return digest.hexdigest()


PNG_SOFTWARE = "seq2seq"  # the PNG's Software text field: what marks a plot as written by seq2seq


def save_png(figure, path: str | Path) -> None:
    """A matplotlib figure as a PNG, written atomically like every file seq2seq writes, and marked as
    seq2seq's (written_by_seq2seq) so that a command drawing it again knows it may replace it."""
    with atomic_write(path) as handle:
        figure.savefig(handle, format="png", dpi=110, metadata={"Software": PNG_SOFTWARE})


def written_by_seq2seq(path: str | Path) -> bool:
    """Whether the PNG at `path` is one that save_png wrote (anything else, a PNG or not, is not)."""
    from PIL import Image, UnidentifiedImageError  # Pillow, which matplotlib needs: only when a plot exists

    try:
        with Image.open(path) as image:
            return image.format == "PNG" and image.info.get("Software") == PNG_SOFTWARE
    except (OSError, UnidentifiedImageError):
        return False


def check_replaceable_plots(paths: list[Path], *, command: str) -> None:
    """Fail now, in one line, if a plot `command` would write is a file that seq2seq did not write:
    a command replaces its own earlier plots, never a file someone put under the same name."""
    for path in paths:
        if path.is_dir() or (path.exists() and not written_by_seq2seq(path)):
            raise UserInputError(
                f"{path}: exists and is not a plot seq2seq wrote; `{command}` replaces only its own plots "
                "(move that file away, then run it again)"
            )


def read_once(path: str | Path) -> bool:
    """Whether `path` is a stream that can be read only once rather than a regular file: a pipe (the
    shell's process substitution, `-i <(zcat corpus.gz)`, hands a command /dev/fd/N), a named pipe, a
    terminal, /dev/stdin. Work that reads its input twice (a check of every line, then the work) must
    read such a stream once, as it reads stdin: the second read would find it empty."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def input_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a text file ("file not found", "is a directory"), or None: a
    regular file or a stream (read_once)."""
    if os.path.isdir(path):
        return "is a directory"
    return None if os.path.exists(path) else "file not found"


# Paths that name a descriptor the process was handed, whatever it leads to (a terminal, a pipe, or
# the file a shell redirected it to: `-o /dev/stdout > out.txt`): these, and any under those folders.
OWN_OUTPUTS = ("/dev/stdout", "/dev/stderr")
OWN_DESCRIPTOR_FOLDERS = ("/dev/fd/", "/proc/self/fd/")


def written_as_it_comes(path: str | Path) -> bool:
    """Whether an output path is a stream to write into rather than a file to replace: a pipe or device
    (read_once), or one of this process's own descriptors."""
    name = str(path)
    return read_once(path) or name in OWN_OUTPUTS or name.startswith(OWN_DESCRIPTOR_FOLDERS)

"""What every `seq2seq` command runs inside: log lines on stderr, and the one boundary for errors.

Bad input (UserInputError), operating-system errors on a user's path (missing, a directory, not
writable, disk full) and command-line mistakes (a bad flag value, an unknown option) become one line
per problem on stderr and exit code 2; running out of memory is one line saying what to ask less of
(exit 1); anything else is a bug, reported in one line with exit 1.
`--debug` (or SEQ2SEQ_DEBUG=1) shows the traceback instead. stdout is left to the results.
Ctrl-C and SIGTERM end a command through the same boundary: what it holds is released and its
half-written files are removed on the way out (exit 130 and 143).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import signal
import sys
import threading

import typer
from tqdm import tqdm
from typer.core import TyperGroup

try:  # recent typer ships its own copy of click
    from typer._click.exceptions import NoArgsIsHelpError, NoSuchOption, UsageError
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import NoArgsIsHelpError, NoSuchOption, UsageError

from seq2seq.errors import UserInputError


class OneLineUsageErrors(TyperGroup):
    """Command-line mistakes (an unknown option, a bad flag value, a missing argument) as one line
    and exit 2, like every other bad input, instead of click's usage block."""

    def main(self, *args, **kwargs):
        standalone = kwargs.pop("standalone_mode", True)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except NoArgsIsHelpError as error:  # `seq2seq` or `seq2seq tokenizer` alone: the help
            error.show()
            result = error.exit_code
        except UsageError as error:
            command = f"{error.ctx.command_path}: " if error.ctx is not None else ""
            typer.echo(f"error: {command}{error.format_message()}{_argument_hint(error)} (see --help)", err=True)
            result = 2
        except typer.Abort:
            typer.echo("interrupted", err=True)
            result = 130
        if not standalone:
            return result
        sys.exit(result if isinstance(result, int) else 0)


def _argument_hint(error: UsageError) -> str:
    """For an unknown option that names one of the command's arguments (`train --config x.yaml`, as
    Marian and eole spell it; `export --checkpoint`), how the argument is given here; for one of
    seq2seq's own options given after the command (`seq2seq translate -q`), where it goes."""
    if not isinstance(error, NoSuchOption) or error.ctx is None:
        return ""
    wanted = error.option_name.lstrip("-").replace("-", "_")
    for param in error.ctx.command.params:
        if param.param_type_name == "argument" and param.name == wanted:
            name = param.name.upper()
            return f"; {name} is an argument, given without a flag: {error.ctx.command_path} {name}"
    root = error.ctx.find_root()
    for param in root.command.params if root is not error.ctx else ():
        if error.option_name in param.opts:
            given = error.option_name if param.is_flag else f"{error.option_name} {param.name.upper()}"
            subcommand = error.ctx.command_path.removeprefix(root.command_path).strip()
            return (
                f"; {error.option_name} is an option of {root.command_path} itself, given before the "
                f"command: {root.command_path} {given} {subcommand}"
            )
    return ""


class _TqdmHandler(logging.Handler):
    """Log lines that do not break an active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


LOG_LEVEL_VARIABLE = "SEQ2SEQ_LOG_LEVEL"
LOG_LEVELS = ("debug", "info", "warning", "error")


def setup_logging() -> None:
    """Log lines go to stderr (stdout carries only results); --log-level / --quiet choose how many.

    The logger itself passes INFO lines on whatever stderr shows, so that a run's train.log
    (run_log.log_to_file) keeps them under --quiet too."""
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s | %(message)s", "%H:%M:%S"))
    root = logging.getLogger("seq2seq")
    root.handlers[:] = [handler]
    is_main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 alone reports progress
    level = getattr(logging, os.environ.get(LOG_LEVEL_VARIABLE, "info").upper())
    handler.setLevel(level if is_main_rank else max(logging.WARNING, level))
    root.setLevel(min(level, logging.INFO) if is_main_rank else handler.level)


DEBUG_VARIABLE = "SEQ2SEQ_DEBUG"


def debugging() -> bool:
    return os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")


def _describe_os_error(error: OSError) -> str:
    """One line naming the path and what was expected, for the OS errors a user's path can cause."""
    path = error.filename if error.filename is not None else "a file"
    expected = {
        errno.ENOENT: "expected an existing path",
        errno.EISDIR: "expected a file, not a directory",
        errno.ENOTDIR: "expected a directory along this path",
        errno.EACCES: "expected permission to read or write it",
        errno.EROFS: "expected a writable file system",
        errno.ENOSPC: "free some space and run again (--resume continues a training run)",
        errno.EDQUOT: "free some space and run again (--resume continues a training run)",
    }.get(error.errno, "expected a readable or writable path")
    return f"{path}: {error.strerror or type(error).__name__}; {expected}"


# The optional extras (pyproject.toml) by the top-level modules they bring: a command that needs one
# that is not installed says which to install, as bad set-up rather than a bug.
EXTRAS = {"ctranslate2": "export", "fastapi": "serve", "starlette": "serve", "uvicorn": "serve"}


def _missing_extra(error: ModuleNotFoundError) -> str | None:
    """One line for a missing optional package (what to install), or None for any other import failure."""
    module = (error.name or "").partition(".")[0]
    extra = EXTRAS.get(module)
    if extra is None:
        return None
    return f"{module} is not installed; this command needs seq2seq's [{extra}] extra: pip install 'seq2seq[{extra}]'"


# What a command that ran out of memory can ask less of: the work it holds at once.
LESS_AT_ONCE = (
    "ask for less at once: train.max_tokens when training, decode.batch_tokens when translating or "
    "scoring (--set decode.batch_tokens=N), or split very long lines"
)


def _out_of_memory(error: Exception) -> bool:
    """The host's memory (MemoryError, a C++ std::bad_alloc included) or a GPU's (torch's own error)."""
    torch = sys.modules.get("torch")  # imported by any command that can run out: --help never does
    return isinstance(error, MemoryError) or (torch is not None and isinstance(error, torch.OutOfMemoryError))


class Terminated(BaseException):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt. The default action would
    end the process on the spot, leaving a half-written output beside its target (files.atomic_write
    removes it on the way out of an exception) and a run directory's lock to the kernel."""


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises Terminated while the block runs (only the main thread may take signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# What an interrupted command leaves that a user can go on from, by command (the others: nothing
# half-written, since every file is written whole or not at all). A command that knows more (train:
# the command that resumes its run) sets the interruption's own `hint`.
INTERRUPTED_HINTS = {
    "distill": "finished stages are kept: the same command continues from them",
}


def user_errors(command):
    """The error boundary of every command: one line per problem, never a traceback (unless --debug)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        setup_logging()
        try:
            with _sigterm_raises():
                return command(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except (KeyboardInterrupt, Terminated) as stop:
            hint = getattr(stop, "hint", None) or INTERRUPTED_HINTS.get(command.__name__)
            if int(os.environ.get("RANK", "0")) == 0:  # torchrun's other workers: one line is enough
                typer.echo(f"interrupted; {hint}" if hint else "interrupted", err=True)
            raise typer.Exit(143 if isinstance(stop, Terminated) else 130) from None
        except BrokenPipeError:  # the reader of stdout stopped (`| head`): stop quietly, as Unix tools do
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit's flush cannot fail again
            raise typer.Exit(141) from None  # 128 + SIGPIPE, what `cat big | head` reports
        except Exception as error:
            if debugging():
                raise
            code, lines = 1, [f"internal error: {type(error).__name__}: {error}"]
            if isinstance(error, UserInputError):
                code, lines = 2, str(error).splitlines()
            elif isinstance(error, ModuleNotFoundError) and (missing := _missing_extra(error)):
                code, lines = 2, [missing]
            elif _out_of_memory(error):
                lines = [f"out of memory ({error or type(error).__name__}); {LESS_AT_ONCE}"]
            elif isinstance(error, OSError) and (
                error.filename is not None or error.errno in (errno.ENOSPC, errno.EDQUOT)
            ):
                code, lines = 2, [_describe_os_error(error)]
            else:
                lines.append("this is a bug in seq2seq; run again with --debug for the traceback and report it")
            for line in lines:
                typer.echo(f"error: {line}", err=True)
            raise typer.Exit(code) from None

    return wrapper

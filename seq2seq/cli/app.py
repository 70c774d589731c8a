"""The Typer application every command registers on, the options all commands share, and the options
that go before a command (--debug, --log-level, --quiet, --version)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from seq2seq.cli.boundary import DEBUG_VARIABLE, LOG_LEVEL_VARIABLE, LOG_LEVELS, OneLineUsageErrors

app = typer.Typer(
    cls=OneLineUsageErrors,
    help="Train and use encoder-decoder Transformer translation models.\n\n"
    "Quick start: seq2seq demo   (synthetic data -> tokenizer -> model -> translations -> BLEU)",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain text: "[default: ...]" must not be read as markup
    context_settings={"help_option_names": ["-h", "--help"]},  # -h as in sacrebleu, fairseq and Marian
)
tokenizer_app = typer.Typer(help="SentencePiece tokenizer commands.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")

ConfigArg = Annotated[Path, typer.Argument(help="YAML config, e.g. configs/demo.yaml", show_default=False)]
SetOption = Annotated[
    Optional[list[str]],  # noqa: UP045 - typer needs Optional here
    typer.Option("--set", help="Override one config key, e.g. --set train.lr=0.001 (repeatable).", show_default=False),
]
# A trained model's config is fixed but for its decoding defaults (config_files.decode_config_with).
DecodeSetOption = Annotated[
    Optional[list[str]],  # noqa: UP045
    typer.Option(
        "--set",
        help="Override one of the model's decode settings, e.g. --set decode.length_penalty=1.0 (repeatable).",
        show_default=False,
    ),
]
RunDirOption = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option("--run-dir", help="Run directory [default: runs/<config name>].", show_default=False),
]


def shortlist_option(help: str):
    """--shortlist FILE, as a command uses it (`help`)."""
    return Annotated[Optional[Path], typer.Option("--shortlist", help=help, show_default=False)]  # noqa: UP045


def _known_device(value: str | None) -> str | None:
    from seq2seq.errors import UserInputError
    from seq2seq.inference.devices import Device

    if value is not None:
        try:
            Device.parse(value)
        except UserInputError as error:
            raise typer.BadParameter(str(error)) from None
    return value


DeviceOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        "--device",
        callback=_known_device,
        help="Where the model runs: cpu, cuda or cuda:N (the GPU of index N) [default: a checkpoint on the GPU "
        "where torch sees one, an export on the CPU].",
        show_default=False,
    ),
]
ShortlistOption = shortlist_option(
    "Hold each output to its source's shortlist (a file from `seq2seq shortlist`; checkpoints only: "
    "an export carries its own)."
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import (
            version,
        )  # the installed package's, which pyproject reads from seq2seq.__version__

        typer.echo(f"seq2seq {version('seq2seq')}")
        raise typer.Exit()


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option("--debug", help=f"Show Python tracebacks for errors (or set {DEBUG_VARIABLE}=1).")
    ] = False,
    log_level: Annotated[
        str, typer.Option("--log-level", help=f"How much to log on stderr: {', '.join(LOG_LEVELS)}.")
    ] = "info",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only warnings and errors on stderr.")] = False,
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    # options for every command; they go before it: seq2seq --log-level warning train ...
    if log_level.lower() not in LOG_LEVELS:
        typer.echo(f"error: --log-level {log_level}: expected one of {', '.join(LOG_LEVELS)}", err=True)
        raise typer.Exit(2)
    # environment variables: also seen by the processes torchrun starts
    os.environ[LOG_LEVEL_VARIABLE] = "warning" if quiet else log_level.lower()
    if debug:
        os.environ[DEBUG_VARIABLE] = "1"

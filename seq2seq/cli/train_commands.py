"""`seq2seq tokenizer train`, `seq2seq train` (one process, or torchrun with DDP) and `seq2seq distill`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from seq2seq.cli.app import ConfigArg, RunDirOption, SetOption, app, tokenizer_app
from seq2seq.cli.boundary import Terminated, user_errors
from seq2seq.errors import UserInputError


def _run_dir(config_path: Path, run_dir: Path | None) -> Path:
    return run_dir if run_dir is not None else Path("runs") / config_path.stem


@tokenizer_app.command("train")
@user_errors
def tokenizer_train(config: ConfigArg, overrides: SetOption = None, run_dir: RunDirOption = None) -> None:
    """Train SentencePiece on the config's training data; saves RUN_DIR/tokenizer/.

    Example: seq2seq tokenizer train configs/demo.yaml
    """
    from seq2seq.config_files import load_config
    from seq2seq.training.run_dir import RunDir, train_run_tokenizer

    run = RunDir(_run_dir(config, run_dir))
    tokenizer = train_run_tokenizer(load_config(config, overrides or []), run)
    typer.echo(
        f"tokenizer: {tokenizer.src_vocab_size} source / {tokenizer.tgt_vocab_size} target pieces -> {run.tokenizer}"
    )


@app.command()
@user_errors
def train(
    config: ConfigArg,
    overrides: SetOption = None,
    run_dir: RunDirOption = None,
    resume: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            "--resume", help="Continue the run in this directory from its last checkpoint.", show_default=False
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bar.")] = False,
    nproc: Annotated[
        int, typer.Option("--nproc", min=1, help="Processes (GPUs) on this machine: >1 launches torchrun with DDP.")
    ] = 1,
) -> None:
    """Train a model (and its tokenizer, if the run has none yet).

    Writes RUN_DIR/config.yaml (the resolved config), tokenizer/, checkpoints/ and metrics.jsonl.

    \b
    Examples:
      seq2seq train configs/demo.yaml --set train.max_steps=2000
      seq2seq train configs/demo.yaml --resume runs/demo
      seq2seq train configs/demo.yaml --run-dir runs/tuned --set train.init_from=runs/demo   (fine-tuning)
      seq2seq train configs/wmt14_en_de_base.yaml --nproc 8      (= torchrun --nproc_per_node 8 -m seq2seq train ...)
    """
    from seq2seq.config_files import load_config
    from seq2seq.training.distributed import leave_worker, shutdown_distributed
    from seq2seq.training.run_dir import RunDir
    from seq2seq.training.trainer import Trainer

    if resume is not None and run_dir is not None and resume.resolve() != run_dir.resolve():
        raise UserInputError(
            f"--resume {resume} and --run-dir {run_dir}: a resumed run continues in its own directory; "
            "expected one of the two (--resume alone continues it, --run-dir alone starts a new run)"
        )
    cfg = load_config(config, overrides or [])  # validated once here, before any process is launched
    directory = resume if resume is not None else _run_dir(config, run_dir)
    try:
        if nproc > 1 and "WORLD_SIZE" not in os.environ:
            raise typer.Exit(_launch_torchrun(nproc, config, overrides or [], directory, resume is not None, quiet))
        result = Trainer(cfg, directory, resume=resume is not None, show_progress=not quiet).run()
    except (KeyboardInterrupt, Terminated) as stop:  # the command that continues this run, for the boundary's line
        again = " with the same --set options" if overrides else ""
        if RunDir(directory).has_checkpoints():
            stop.hint = f"the last checkpoint is kept: continue with `seq2seq train {config} --resume {directory}`"
        else:  # stopped while it prepared its data or tokenizer: there is nothing to resume yet
            stop.hint = f"no checkpoint yet: start again with `seq2seq train {config} --run-dir {directory}`"
        stop.hint += again
        raise
    finally:
        shutdown_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        steps = f"{result.progress.step} step{'' if result.progress.step == 1 else 's'}"
        typer.echo(f"stopped after {steps} ({result.stop_reason}); checkpoint: {result.last_checkpoint}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        leave_worker()


def _launch_torchrun(nproc: int, config: Path, overrides: list[str], run_dir: Path, resume: bool, quiet: bool) -> int:
    """Run this same training under torchrun on this machine; returns its exit code.

    Ctrl-C or SIGTERM here is passed on to torchrun, which passes it to its workers: they save the
    update under way and stop (training/interruption.py), and this process waits for them. Killing
    torchrun instead (subprocess.run's way) left its workers training on, orphaned, holding the run."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "seq2seq",
        "train",
        str(config),
        "--resume" if resume else "--run-dir",
        str(run_dir),
    ]
    for item in overrides:
        command += ["--set", item]
    if quiet:
        command.append("--quiet")
    torchrun = subprocess.Popen(command)
    try:
        return torchrun.wait()
    except (KeyboardInterrupt, Terminated) as stop:
        torchrun.send_signal(signal.SIGINT if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM)
        torchrun.wait()
        raise


@app.command()
@user_errors
def distill(
    config: ConfigArg,
    overrides: SetOption = None,
    run_dir: RunDirOption = None,
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bars.")] = False,
) -> None:
    """Distil a teacher into a small student and ship it: the teacher translates the training sources,
    the student trains on its outputs, a shortlist is built, the student is exported through the
    parity gate, and both are compared on the test split (BLEU, chrF, lines per second, size).

    The config is the student's (tokenizer, model, train, decode) with a distill section naming the
    teacher; run it again after a stop and it continues where it stopped.

    \b
    Examples:
      seq2seq distill configs/student_tiny.yaml
      seq2seq distill configs/student_tiny.yaml --set distill.teacher=[runs/bible_en_es] --set train.max_steps=4000
    """
    from seq2seq.config_files import load_config
    from seq2seq.distillation.pipeline import distill as run_distillation
    from seq2seq.distillation.report import table

    cfg = load_config(config, overrides or [])
    if cfg.distill is None:
        raise UserInputError(f"{config}: no distill section; expected one naming the teacher (distill.teacher)")
    done = run_distillation(
        cfg, _run_dir(config, run_dir), progress=not quiet, echo=lambda line: typer.echo(line, err=True)
    )
    typer.echo(table(done.runs))

"""The `seq2seq` command line: each command parses options, loads the config and calls one library function.

Bad input (UserInputError) becomes one line per problem on stderr and exit code 2.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from tqdm import tqdm

from seq2seq.errors import UserInputError

app = typer.Typer(
    help="Train and use encoder-decoder Transformer translation models.\n\n"
    "Quick start: seq2seq demo   (synthetic data -> tokenizer -> model -> translations -> BLEU)",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
tokenizer_app = typer.Typer(help="SentencePiece tokenizer commands.", no_args_is_help=True)
app.add_typer(tokenizer_app, name="tokenizer")

ConfigArg = Annotated[Path, typer.Argument(help="YAML config, e.g. configs/demo.yaml", show_default=False)]
SetOption = Annotated[
    Optional[list[str]],  # noqa: UP045 - typer needs Optional here
    typer.Option("--set", help="Override one config key, e.g. --set train.lr=0.001 (repeatable).", show_default=False),
]
RunDirOption = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option("--run-dir", help="Run directory [default: runs/<config name>].", show_default=False),
]


class _TqdmHandler(logging.Handler):
    """Log lines that do not break an active progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm.write(self.format(record), file=sys.stderr)


def _setup_logging() -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s | %(message)s", "%H:%M:%S"))
    root = logging.getLogger("seq2seq")
    root.handlers[:] = [handler]
    is_main_rank = int(os.environ.get("RANK", "0")) == 0  # under torchrun, rank 0 alone reports progress
    root.setLevel(logging.INFO if is_main_rank else logging.WARNING)


def user_errors(command):
    """Report UserInputError as one line per problem and exit 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        _setup_logging()
        try:
            return command(*args, **kwargs)
        except UserInputError as exc:
            for line in str(exc).splitlines():
                typer.echo(f"error: {line}", err=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            typer.echo("interrupted; the last checkpoint is kept (resume with --resume RUN_DIR)", err=True)
            raise typer.Exit(130) from None

    return wrapper


def _run_dir(config_path: Path, run_dir: Path | None) -> Path:
    return run_dir if run_dir is not None else Path("runs") / config_path.stem


@tokenizer_app.command("train")
@user_errors
def tokenizer_train(config: ConfigArg, overrides: SetOption = None, run_dir: RunDirOption = None) -> None:
    """Train SentencePiece on the config's training data; saves RUN_DIR/tokenizer/.

    Example: seq2seq tokenizer train configs/demo.yaml
    """
    from seq2seq.config import load_config
    from seq2seq.run_dir import RunDir, train_run_tokenizer

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

    Examples:
      seq2seq train configs/demo.yaml --set train.max_steps=2000
      seq2seq train configs/demo.yaml --resume runs/demo
      seq2seq train configs/wmt14_en_de_base.yaml --nproc 8      (= torchrun --nproc_per_node 8 -m seq2seq train ...)
    """
    from seq2seq.config import load_config
    from seq2seq.distributed import shutdown_distributed
    from seq2seq.train import Trainer

    cfg = load_config(config, overrides or [])  # validated once here, before any process is launched
    directory = resume if resume is not None else _run_dir(config, run_dir)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        raise typer.Exit(_launch_torchrun(nproc, config, overrides or [], directory, resume is not None, quiet))
    try:
        result = Trainer(cfg, directory, resume=resume is not None, show_progress=not quiet).run()
    finally:
        shutdown_distributed()
    if int(os.environ.get("RANK", "0")) == 0:
        typer.echo(
            f"stopped after {result.progress.step} steps ({result.stop_reason}); checkpoint: {result.last_checkpoint}"
        )


def _launch_torchrun(nproc: int, config: Path, overrides: list[str], run_dir: Path, resume: bool, quiet: bool) -> int:
    """Run this same training under torchrun on this machine; returns its exit code."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "seq2seq", "train", str(config), "--resume" if resume else "--run-dir", str(run_dir)]  # fmt: skip
    for item in overrides:
        command += ["--set", item]
    if quiet:
        command.append("--quiet")
    return subprocess.run(command, check=False).returncode


CheckpointOption = Annotated[Path, typer.Option("--checkpoint", "-c", help="A checkpoint (.pt) from training.")]
BeamOption = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option(
        "--beam", min=1, help="Beam size (1 = greedy) [default: the checkpoint's decode.beam].", show_default=False
    ),
]


def _decode_overrides(overrides: list[str] | None, beam: int | None, nbest: int | None) -> list[str]:
    """--set decode.KEY=VALUE items, then --beam and --nbest on top."""
    extra = [f"decode.beam={beam}"] if beam is not None else []
    extra += [f"decode.nbest={nbest}"] if nbest is not None else []
    return [*(overrides or []), *extra]


@app.command()
@user_errors
def translate(
    checkpoint: CheckpointOption,
    input: Annotated[str, typer.Option("--input", "-i", help="Source file, or - for stdin.")] = "-",
    output: Annotated[str, typer.Option("--output", "-o", help="Output file, or - for stdout.")] = "-",
    beam: BeamOption = None,
    nbest: Annotated[
        Optional[int], typer.Option("--nbest", min=1, help="Print the N best per line: idx ||| text ||| score.")  # noqa: UP045
    ] = None,
    overrides: SetOption = None,
    stream: Annotated[bool, typer.Option("--stream", help="Translate each stdin line as it arrives.")] = False,
    attention_plot: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--attention-plot", help="Write cross-attention heatmaps (PNG) of the first lines here."),
    ] = None,
) -> None:
    """Translate text, one sentence per line.

    Examples:
      seq2seq translate -c runs/demo/checkpoints/last.pt -i test.en -o test.out --beam 5
      echo "the cat sleeps" | seq2seq translate -c runs/demo/checkpoints/best.pt
    """
    from seq2seq.translate import translate_file

    written = translate_file(checkpoint, source=input, output=output, decode_overrides=_decode_overrides(
        overrides, beam, nbest), stream=stream, device=_device(), attention_plot=attention_plot)  # fmt: skip
    if written:
        typer.echo(f"attention plots: {', '.join(map(str, written))}", err=True)


@app.command("eval")
@user_errors
def evaluate(
    checkpoint: CheckpointOption,
    src: Annotated[Path, typer.Option("--src", help="Source sentences, one per line.")],
    ref: Annotated[Path, typer.Option("--ref", help="Reference translations, one per line.")],
    beam: BeamOption = None,
    json_path: Annotated[
        Optional[Path], typer.Option("--json", help="Also write a JSON report here.", show_default=False)  # noqa: UP045
    ] = None,
    hypotheses_path: Annotated[
        Optional[Path], typer.Option("--hyps", help="Also write the translations here.", show_default=False)  # noqa: UP045
    ] = None,
) -> None:
    """Translate --src and score it against --ref with sacrebleu (BLEU and chrF, with signatures).

    Example: seq2seq eval -c runs/demo/checkpoints/best.pt --src data/demo/test.en --ref data/demo/test.xx
    """
    from seq2seq.evaluate import evaluate_files

    evaluation = evaluate_files(checkpoint, src=src, ref=ref, decode_overrides=_decode_overrides(None, beam, None),
                                device=_device(), hypotheses_path=hypotheses_path, json_path=json_path)  # fmt: skip
    typer.echo(evaluation.scores.describe())


@app.command()
@user_errors
def demo(
    config: Annotated[Path, typer.Option("--config", help="The demo config.")] = Path("configs/demo.yaml"),
    overrides: SetOption = None,
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Where the run goes (replaced).")] = Path("runs/demo"),
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bars.")] = False,
) -> None:
    """The whole path on the embedded synthetic task: data, tokenizer, training, translation, test BLEU.

    Example: seq2seq demo --set train.max_steps=500
    """
    from seq2seq.demo import run_demo

    run_demo(config, overrides or [], run_dir, show_progress=not quiet, echo=typer.echo)


@app.command()
@user_errors
def average(
    checkpoints: Annotated[list[Path], typer.Argument(help="Checkpoints to average (e.g. the last 5).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the averaged checkpoint.")],
) -> None:
    """Average the parameters of several checkpoints of one run (Vaswani et al. averaged the last 5).

    Example: seq2seq average runs/demo/checkpoints/step_*.pt -o runs/demo/checkpoints/avg.pt
    """
    from seq2seq.checkpoint import average_checkpoints

    average_checkpoints(checkpoints, output)
    typer.echo(f"averaged {len(checkpoints)} checkpoints -> {output}")


@app.command()
@user_errors
def plot(run_dir: Annotated[Path, typer.Argument(help="A run directory with metrics.jsonl.")]) -> None:
    """Write PNG curves of training/validation loss, BLEU and learning rate into RUN_DIR/plots/.

    Example: seq2seq plot runs/demo
    """
    from seq2seq.plots import plot_training_curves

    for path in plot_training_curves(run_dir):
        typer.echo(str(path))


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def main() -> None:
    app()

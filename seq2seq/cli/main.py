"""The `seq2seq` command line: each command parses options, loads the config and calls one library function.

Every command runs inside the error boundary of cli_boundary.py (`user_errors`): one line per
problem, exit 2 for bad input, never a traceback unless --debug.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from seq2seq.cli.boundary import DEBUG_VARIABLE, LOG_LEVEL_VARIABLE, LOG_LEVELS, OneLineUsageErrors, user_errors
from seq2seq.errors import UserInputError

app = typer.Typer(
    cls=OneLineUsageErrors,
    help="Train and use encoder-decoder Transformer translation models.\n\n"
    "Quick start: seq2seq demo   (synthetic data -> tokenizer -> model -> translations -> BLEU)",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain text: "[default: ...]" must not be read as markup
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


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

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


def _run_dir(config_path: Path, run_dir: Path | None) -> Path:
    return run_dir if run_dir is not None else Path("runs") / config_path.stem


@tokenizer_app.command("train")
@user_errors
def tokenizer_train(config: ConfigArg, overrides: SetOption = None, run_dir: RunDirOption = None) -> None:
    """Train SentencePiece on the config's training data; saves RUN_DIR/tokenizer/.

    Example: seq2seq tokenizer train configs/demo.yaml
    """
    from seq2seq.config import load_config
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

    Examples:
      seq2seq train configs/demo.yaml --set train.max_steps=2000
      seq2seq train configs/demo.yaml --resume runs/demo
      seq2seq train configs/wmt14_en_de_base.yaml --nproc 8      (= torchrun --nproc_per_node 8 -m seq2seq train ...)
    """
    from seq2seq.config import load_config
    from seq2seq.training.distributed import shutdown_distributed
    from seq2seq.training.trainer import Trainer

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
    return subprocess.run(command, check=False).returncode


CheckpointOption = Annotated[
    Path, typer.Option("--checkpoint", "-c", help="A checkpoint (.pt), or a directory from `seq2seq export`.")
]
CheckpointsOption = Annotated[
    list[Path],
    typer.Option(
        "--checkpoint", "-c", help="A checkpoint (.pt) or a directory from `seq2seq export`; repeat for an ensemble."
    ),
]
BeamOption = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option(
        "--beam", min=1, help="Beam size (1 = greedy) [default: the model's decode.beam].", show_default=False
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
    checkpoint: CheckpointsOption,
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
    prefix: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--prefix", help="Target prefixes, one per input line (empty: none); outputs start with them."),
    ] = None,
    constraints: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            "--constraints",
            help="Target phrases each output must contain: one line per input line, "
            "phrases separated by tabs (checkpoints only).",
        ),
    ] = None,
    glossary: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            "--glossary",
            help="TSV 'source term<TAB>target term': lines with a source term must contain "
            "its target term (checkpoints only).",
        ),
    ] = None,
) -> None:
    """Translate text, one sentence per line.

    Examples:
      seq2seq translate -c runs/demo/checkpoints/last.pt -i test.en -o test.out --beam 5
      echo "the cat sleeps" | seq2seq translate -c runs/demo/checkpoints/best.pt
      seq2seq translate -c runs/bible/checkpoints/step_00009000.pt -c runs/bible/checkpoints/step_00010000.pt -i test.en
      seq2seq translate -c best.pt -i test.en --glossary terms.tsv --prefix prefixes.txt
      seq2seq translate -c reverse.pt -i mono.es --set decode.sample=true --set decode.top_k=10 -o synthetic.en
    """
    from seq2seq.inference.translator import LineGuides, translate_file

    guides = LineGuides(prefixes=prefix, constraints=constraints, glossary=glossary)
    written = translate_file(
        checkpoint,
        source=input,
        output=output,
        decode_overrides=_decode_overrides(overrides, beam, nbest),
        stream=stream,
        attention_plot=attention_plot,
        guides=guides,
    )
    if written:
        typer.echo(f"attention plots: {', '.join(map(str, written))}", err=True)


@app.command("score-pairs")
@user_errors
def score_pairs(
    checkpoint: CheckpointsOption,
    src: Annotated[Path, typer.Option("--src", help="Source sentences, one per line.", show_default=False)],
    tgt: Annotated[Path, typer.Option("--tgt", help="Their given translations, one per line.", show_default=False)],
    output: Annotated[str, typer.Option("--output", "-o", help="Output file, or - for stdout.")] = "-",
    per_token: Annotated[bool, typer.Option("--per-token", help="Add each piece's log-probability.")] = False,
    overrides: SetOption = None,
) -> None:
    """Score given translations with the model (force-decoding): score, log-probability, pieces per pair.

    The score is the log-probability normalised by length as beam search ranks outputs
    (decode.length_norm); use it to filter noisy parallel data or rerank.

    Examples:
      seq2seq score-pairs -c runs/demo/checkpoints/best.pt --src data/demo/test.en --tgt data/demo/test.xx
      seq2seq score-pairs -c models/demo-ct2 --src train.en --tgt train.xx -o scores.tsv --per-token
    """
    from seq2seq.inference.translator import score_file

    score_file(checkpoint, src=src, tgt=tgt, output=output, decode_overrides=overrides or [], per_token=per_token)


RefsOption = Annotated[
    list[Path], typer.Option("--ref", help="Reference translations, one per line (repeat for several references).")
]
MetricsOption = Annotated[
    str, typer.Option("--metrics", help="Comma-separated, of bleu, chrf, chrf++, ter (as sacrebleu computes them).")
]
TokenizeOption = Annotated[
    Optional[str],  # noqa: UP045
    typer.Option(
        "--tokenize",
        help="BLEU tokenizer, as sacrebleu's --tokenize (13a, intl, zh, char, none, ...) [default: 13a].",
        show_default=False,
    ),
]
LowercaseOption = Annotated[bool, typer.Option("--lowercase", "-lc", help="Case-insensitive scores.")]
JsonOption = Annotated[
    Optional[Path],  # noqa: UP045
    typer.Option("--json", help="Also write a JSON report (scores, details, signatures) here.", show_default=False),
]


def _score_options(metrics: str, tokenize: str | None, lowercase: bool):
    from seq2seq.evaluation.scoring import ScoreOptions

    names = tuple(name.strip().lower() for name in metrics.split(",") if name.strip())
    return ScoreOptions(metrics=names, tokenize=tokenize, lowercase=lowercase)


@app.command("eval")
@user_errors
def evaluate(
    checkpoint: CheckpointsOption,
    src: Annotated[Path, typer.Option("--src", help="Source sentences, one per line.")],
    refs: RefsOption,
    beam: BeamOption = None,
    metrics: MetricsOption = "bleu,chrf",
    tokenize: TokenizeOption = None,
    lowercase: LowercaseOption = False,
    json_path: JsonOption = None,
    hypotheses_path: Annotated[
        Optional[Path], typer.Option("--hyps", help="Also write the translations here.", show_default=False)  # noqa: UP045
    ] = None,
    overrides: SetOption = None,
) -> None:
    """Translate --src and score it against --ref with sacrebleu (scores with their signatures).

    Examples:
      seq2seq eval -c runs/demo/checkpoints/best.pt --src data/demo/test.en --ref data/demo/test.xx
      seq2seq eval -c models/bible-int8 --src test.en --ref test.es --ref test2.es --metrics bleu,chrf++,ter
      seq2seq eval -c best.pt --src data/demo/test.en --ref data/demo/test.xx --set decode.length_penalty=0.6
    """
    from seq2seq.evaluation.evaluate import evaluate_files

    options = _score_options(metrics, tokenize, lowercase)
    decode_overrides = _decode_overrides(overrides, beam, None)
    evaluation = evaluate_files(
        checkpoint,
        src=src,
        refs=refs,
        decode_overrides=decode_overrides,
        options=options,
        hypotheses_path=hypotheses_path,
        json_path=json_path,
    )
    typer.echo(evaluation.scores.describe())


@app.command()
@user_errors
def score(
    hyp: Annotated[Path, typer.Option("--hyp", help="Translations to score, one per line.")],
    refs: RefsOption,
    metrics: MetricsOption = "bleu,chrf",
    tokenize: TokenizeOption = None,
    lowercase: LowercaseOption = False,
    json_path: JsonOption = None,
) -> None:
    """Score existing translations against references: the same figures as `sacrebleu REF... -i HYP`.

    Example: seq2seq score --hyp test.out --ref data/bible/test.es --metrics bleu,chrf,ter
    """
    from seq2seq.evaluation.evaluate import score_files

    typer.echo(
        score_files(hyp, refs, options=_score_options(metrics, tokenize, lowercase), json_path=json_path).describe()
    )


@app.command()
@user_errors
def demo(
    config: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            "--config",
            help="The demo config [default: the one shipped in the package, = configs/demo.yaml].",
            show_default=False,
        ),
    ] = None,
    overrides: SetOption = None,
    run_dir: Annotated[
        Path, typer.Option("--run-dir", help="Where the run goes: new, empty, or an earlier demo run (replaced).")
    ] = Path("runs/demo"),
    quiet: Annotated[bool, typer.Option("--quiet", help="No progress bars.")] = False,
) -> None:
    """The whole path on the embedded synthetic task: data, tokenizer, training, translation, test BLEU.

    Example: seq2seq demo --set train.max_steps=500
    """
    from seq2seq.cli.demo import run_demo

    run_demo(config, overrides or [], run_dir, show_progress=not quiet, echo=typer.echo)


@app.command()
@user_errors
def export(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint to export.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="The model directory to write (must not exist).")],
    format: Annotated[str, typer.Option("--format", help="Only ctranslate2 for now.")] = "ctranslate2",
    quantization: Annotated[
        str, typer.Option("--quantization", help="float32, int8, int8_float32, int16, float16 or bfloat16.")
    ] = "float32",
    check_src: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--check-src", help="Parity-gate sources [default: the validation split].", show_default=False),
    ] = None,
    check_ref: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option("--check-ref", help="References of --check-src.", show_default=False),
    ] = None,
    check_lines: Annotated[int, typer.Option("--check-lines", min=1, help="Sentences the gate decodes.")] = 500,
    max_bleu_drop: Annotated[
        float, typer.Option("--max-bleu-drop", min=0.0, help="Quantized exports: the BLEU the gate lets go.")
    ] = 1.0,
    max_positions: Annotated[
        Optional[int],  # noqa: UP045
        typer.Option(
            "--max-positions",
            min=1,
            show_default=False,
            help="The longest source and output (pieces) the export places; longer lines are refused "
            "[default: the longest training sentence's allowance, at least 1024].",
        ),
    ] = None,
) -> None:
    """Export a checkpoint as a CTranslate2 model, through a parity gate that decodes with both.

    Nothing is written unless the exported model translates like the checkpoint (float32: greedy
    outputs identical on >= 99% of sentences and beam BLEU within 0.2; quantized: BLEU drop at most
    --max-bleu-drop); then it exits 1.

    Examples:
      seq2seq export runs/demo/checkpoints/best.pt -o models/demo-ct2
      seq2seq export runs/bible/checkpoints/best.pt -o models/bible-int8 --quantization int8
    """
    from seq2seq.deploy.export import ExportFailed, export_checkpoint

    if format != "ctranslate2":
        raise UserInputError(f"--format {format}: expected ctranslate2 (the only format for now)")
    try:
        report = export_checkpoint(
            checkpoint,
            output,
            quantization=quantization,
            check_src=check_src,
            check_ref=check_ref,
            check_lines=check_lines,
            max_bleu_drop=max_bleu_drop,
            max_positions=max_positions,
        )
    except ExportFailed as failure:
        for line in str(failure).splitlines():
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(1) from None
    typer.echo(report.describe())
    typer.echo(f"exported -> {output}")


@app.command()
@user_errors
def serve(
    model: Annotated[
        list[Path],
        typer.Argument(
            help="A checkpoint (.pt) or an exported directory; several checkpoints: an ensemble.", show_default=False
        ),
    ],
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to listen on.")] = 8000,
    max_lines: Annotated[int, typer.Option("--max-lines", min=1, help="Lines per request.")] = 64,
    max_chars: Annotated[int, typer.Option("--max-chars", min=1, help="Characters per line.")] = 2000,
    max_tokens_per_line: Annotated[
        int, typer.Option("--max-tokens-per-line", min=1, help="SentencePiece pieces per line, its end included.")
    ] = 256,
    max_work: Annotated[
        int,
        typer.Option(
            "--max-work",
            min=1,
            help="A request's work: source pieces x beam (or samples) x length limit, over its lines.",
        ),
    ] = 2_000_000,
    batch_wait_ms: Annotated[
        float, typer.Option("--batch-wait-ms", min=0.0, help="How long to wait for requests to batch with.")
    ] = 5.0,
    max_queue: Annotated[
        int, typer.Option("--max-queue", min=1, help="Requests open at once; more are answered 503.")
    ] = 256,
    timeout_s: Annotated[
        float,
        typer.Option(
            "--timeout", min=0.1, help="Seconds a request may take, queued and translating (then 503; its work stops)."
        ),
    ] = 60.0,
    api_key: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option(
            "--api-key",
            envvar="SEQ2SEQ_API_KEY",
            show_default=False,
            help="Require 'Authorization: Bearer KEY' on every request (better set in SEQ2SEQ_API_KEY).",
        ),
    ] = None,
) -> None:
    """Serve a model over HTTP: POST /translate {"lines": [...]}, POST /score and GET /health.

    Examples:
      seq2seq serve models/bible-int8 --port 8000
      seq2seq serve runs/bible/checkpoints/step_00009000.pt runs/bible/checkpoints/step_00010000.pt
      curl -s localhost:8000/translate -H 'content-type: application/json' -d '{"lines": ["the cat sleeps"], "beam": 5}'
      SEQ2SEQ_API_KEY=s3cret seq2seq serve models/bible-int8 --host 0.0.0.0
    """
    from seq2seq.deploy.requests import Limits
    from seq2seq.deploy.serve import serve as serve_model

    missing = [str(path) for path in model if not path.exists()]
    if missing:
        raise UserInputError(f"{', '.join(missing)}: no such checkpoint or exported model")
    if api_key is not None and not api_key.strip():
        raise UserInputError("--api-key: empty; expected a secret that clients send as 'Authorization: Bearer KEY'")
    limits = Limits(
        max_lines=max_lines,
        max_chars=max_chars,
        max_tokens_per_line=max_tokens_per_line,
        max_work=max_work,
        batch_wait=batch_wait_ms / 1000,
        max_queue=max_queue,
        request_timeout=timeout_s,
    )
    named = " + ".join(map(str, model))
    typer.echo(
        f"serving {named} on http://{host}:{port} (POST /translate, /score; GET /health); Ctrl-C stops", err=True
    )
    serve_model(model, host=host, port=port, limits=limits, api_key=api_key)


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
    from seq2seq.training.plots import plot_training_curves

    for path in plot_training_curves(run_dir):
        typer.echo(str(path))


def main() -> None:
    app()

"""`seq2seq demo`, `export`, `serve`, `average`, `info`, `plot` and `shortlist`: the whole path at
once, and what ships or inspects a trained model."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer

from seq2seq.cli.app import DeviceOption, SetOption, ShortlistOption, app, shortlist_option
from seq2seq.cli.boundary import user_errors
from seq2seq.config import SHORTLIST_FREQUENT, SHORTLIST_PER_SOURCE
from seq2seq.deploy.requests import Limits
from seq2seq.errors import UserInputError


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


QuantizationOption = Annotated[
    str, typer.Option("--quantization", help="float32, int8, int8_float32, int16, float16 or bfloat16.")
]
MaxPositionsOption = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option("--max-positions", min=1, show_default=False,
                 help="The longest source and output (pieces) the export places; longer lines are refused "
                 "[default: the longest training sentence's allowance, at least 1024]."),
]  # fmt: skip


@app.command()
@user_errors
def export(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint to export.", show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="The model directory to write (must not exist).")],
    format: Annotated[str, typer.Option("--format", help="Only ctranslate2 for now.")] = "ctranslate2",
    quantization: QuantizationOption = "float32",
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
    max_positions: MaxPositionsOption = None,
    shortlist: shortlist_option(
        "A file from `seq2seq shortlist` the export decodes over (CTranslate2's vocabulary map); the gate "
        "checks it against the checkpoint with the same shortlist."
    ) = None,
) -> None:
    """Export a checkpoint as a CTranslate2 model, through a parity gate that decodes with both.

    The model is written only if it translates like the checkpoint (float32: greedy
    outputs identical on >= 99% of sentences and beam BLEU within 0.2; quantized: BLEU drop at most
    --max-bleu-drop); otherwise nothing is written and it exits 1.

    \b
    Examples:
      seq2seq export runs/demo/checkpoints/best.pt -o models/demo-ct2
      seq2seq export runs/bible/checkpoints/best.pt -o models/bible-int8 --quantization int8
      seq2seq export student.pt -o models/student --quantization int8 --shortlist student.shortlist
    """
    from seq2seq.deploy.export import ExportFailed, export_checkpoint

    if format != "ctranslate2":
        raise UserInputError(f"--format {format}: expected ctranslate2 (the only format for now)")
    try:
        report = export_checkpoint(checkpoint, output, quantization=quantization, check_src=check_src,
                                   check_ref=check_ref, check_lines=check_lines, max_bleu_drop=max_bleu_drop,
                                   max_positions=max_positions, shortlist=shortlist)  # fmt: skip
    except ExportFailed as failure:
        for line in str(failure).splitlines():
            typer.echo(f"error: {line}", err=True)
        raise typer.Exit(1) from None
    typer.echo(report.describe())
    typer.echo(f"exported -> {output}")


SERVED = Limits()  # the server's defaults: each option below takes its default from here


def _limit(flag: str, help: str, kind: type = int, minimum: float = 1, maximum: float | None = None):
    return Annotated[kind, typer.Option(flag, min=minimum, max=maximum, help=help)]


@app.command()
@user_errors
def serve(
    model: Annotated[
        list[Path],
        typer.Argument(help="A checkpoint (.pt), a run directory (its best.pt) or an exported directory; several "
                           "checkpoints: an ensemble.",
                       show_default=False),
    ],
    host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=1, max=65535, help="Port to listen on.")] = 8000,
    max_lines: _limit("--max-lines", "Lines per request.") = SERVED.max_lines,
    max_chars: _limit("--max-chars", "Characters per line.") = SERVED.max_chars,
    max_tokens_per_line: _limit("--max-tokens-per-line", "SentencePiece pieces per line, its end included."
                                ) = SERVED.max_tokens_per_line,
    max_work: _limit("--max-work", "A request's work: source pieces x beam (or samples) x length limit, over its "
                     "lines.") = SERVED.max_work,
    batch_wait_ms: _limit("--batch-wait-ms", "How long to wait for requests to batch with.", float, 0.0, 10_000
                          ) = SERVED.batch_wait * 1000,
    max_queue: _limit("--max-queue", "Requests open at once; more are answered 503.") = SERVED.max_queue,
    timeout_s: _limit("--timeout", "Seconds a request may take, queued and translating (then 503; its work stops).",
                      float, 0.1, 3600) = SERVED.request_timeout,
    api_key: Annotated[
        Optional[str],  # noqa: UP045
        typer.Option("--api-key", envvar="SEQ2SEQ_API_KEY", show_default=False,
                     help="Require 'Authorization: Bearer KEY' on every request (better set in SEQ2SEQ_API_KEY)."),
    ] = None,
    shortlist: ShortlistOption = None,
    device: DeviceOption = None,
) -> None:  # fmt: skip
    """Serve a model over HTTP: POST /translate {"lines": [...]}, POST /score and GET /health.

    \b
    Examples:
      seq2seq serve models/bible-int8 --port 8000
      seq2seq serve runs/bible/checkpoints/step_00009000.pt runs/bible/checkpoints/step_00010000.pt
      curl -s localhost:8000/translate -H 'content-type: application/json' -d '{"lines": ["the cat sleeps"], "beam": 5}'
      SEQ2SEQ_API_KEY=s3cret seq2seq serve models/bible-int8 --host 0.0.0.0
    """
    from seq2seq.deploy.serve import serve as serve_model

    missing = [str(path) for path in model if not path.exists()]
    if missing:
        raise UserInputError(f"{', '.join(missing)}: no such checkpoint or exported model")
    if api_key is not None and not api_key.strip():
        raise UserInputError("--api-key: empty; expected a secret that clients send as 'Authorization: Bearer KEY'")
    limits = dataclasses.replace(SERVED, max_lines=max_lines, max_chars=max_chars, max_work=max_work,
                                 max_tokens_per_line=max_tokens_per_line, batch_wait=batch_wait_ms / 1000,
                                 max_queue=max_queue, request_timeout=timeout_s)  # fmt: skip
    typer.echo(f"serving {' + '.join(map(str, model))} on http://{host}:{port} (POST /translate, /score; GET "
               "/health); Ctrl-C stops", err=True)  # fmt: skip
    serve_model(model, host=host, port=port, limits=limits, api_key=api_key, shortlist=shortlist, device=device)


@app.command()
@user_errors
def average(
    checkpoints: Annotated[
        list[Path],
        typer.Argument(help="Checkpoints to average, or a run directory: its numbered checkpoints (step_*.pt)."),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the averaged checkpoint.")],
    last: Annotated[
        Optional[int],  # noqa: UP045 - typer needs Optional here
        typer.Option("--last", min=1, help="Of a run directory's numbered checkpoints, the newest N only."),
    ] = None,
) -> None:
    """Average the parameters of several checkpoints of one run (Vaswani et al. averaged the last 5).

    Examples:
      seq2seq average runs/demo --last 5 -o runs/demo/checkpoints/avg.pt
      seq2seq average runs/demo/checkpoints/step_00000400.pt runs/demo/checkpoints/step_00000500.pt -o avg.pt
    """
    from seq2seq.checkpoint import average_checkpoints, checkpoints_to_average
    from seq2seq.files import check_new_file

    check_new_file(output, what="output checkpoint")  # -o naming one of the checkpoints would replace it
    files = checkpoints_to_average(checkpoints, last)
    average_checkpoints(files, output)
    named = ", ".join(str(path) for path in files) if any(path.is_dir() for path in checkpoints) else None
    typer.echo(f"averaged {len(files)} checkpoint{'s' if len(files) > 1 else ''}"
               f"{f' ({named})' if named else ''} -> {output}")  # fmt: skip


@app.command()
@user_errors
def info(
    path: Annotated[
        Path, typer.Argument(help="A checkpoint (.pt), a run directory (its best.pt) or an exported model.")
    ],
    as_json: Annotated[bool, typer.Option("--json", help="JSON instead of YAML.")] = False,
) -> None:
    """Describe a saved model: its step, best validation, shape and size, vocabulary, languages, training
    corpora and settings, and decoding defaults (an export: its metadata).

    Example: seq2seq info runs/demo
    """
    import json

    import yaml

    from seq2seq.deploy.describe import describe

    described = describe(path)
    typer.echo(json.dumps(described, indent=2) if as_json else yaml.safe_dump(described, sort_keys=False).rstrip())


@app.command()
@user_errors
def plot(run_dir: Annotated[Path, typer.Argument(help="A run directory with metrics.jsonl.")]) -> None:
    """Write PNG curves of training/validation loss, BLEU and learning rate into RUN_DIR/plots/.

    Example: seq2seq plot runs/demo
    """
    from seq2seq.training.plots import plot_training_curves

    for path in plot_training_curves(run_dir):
        typer.echo(str(path))


@app.command("shortlist")
@user_errors
def shortlist(
    checkpoint: Annotated[Path, typer.Argument(help="The checkpoint (or run directory) whose vocabulary it is for.",
                                               show_default=False)],
    output: Annotated[Path, typer.Option("--output", "-o", help="The shortlist file to write.", show_default=False)],
    src: Annotated[Optional[Path], typer.Option("--src", help="Source sentences [default: the training split]."  # noqa: UP045
                                                ,show_default=False)] = None,
    tgt: Annotated[Optional[Path], typer.Option("--tgt", help="Their translations.", show_default=False)] = None,  # noqa: UP045
    per_source: Annotated[int, typer.Option("--per-source", min=1, help="Target pieces kept per source piece.")
                          ] = SHORTLIST_PER_SOURCE,
    frequent: Annotated[int, typer.Option("--frequent", min=0, help="Most frequent target pieces always allowed.")
                        ] = SHORTLIST_FREQUENT,
) -> None:  # fmt: skip
    """Build a lexical shortlist: for each source piece the target pieces most associated with it in
    parallel text, and the most frequent target pieces (Marian's --shortlist, CTranslate2's vocabulary map).

    \b
    Examples:
      seq2seq shortlist runs/bible/checkpoints/best.pt -o bible.shortlist
      seq2seq translate -c runs/bible/checkpoints/best.pt --shortlist bible.shortlist -i test.en
      seq2seq export runs/bible/checkpoints/best.pt -o models/bible-int8 --quantization int8 --shortlist bible.shortlist
    """
    from seq2seq.checkpoint import Checkpoint
    from seq2seq.data.prepare import read_split
    from seq2seq.data.sources import read_lines
    from seq2seq.files import check_new_file
    from seq2seq.inference.shortlist import shortlist_from_corpus

    if (src is None) != (tgt is None):
        raise UserInputError("--src and --tgt go together (source sentences and their translations)")
    check_new_file(output)
    if src is not None:  # read and matched before the checkpoint loads
        sources, targets = list(read_lines(src)), list(read_lines(tgt))
        if len(sources) != len(targets) or not sources:
            raise UserInputError(
                f"{tgt}: {len(targets)} lines, {src}: {len(sources)}; expected one translation per source line, "
                "and at least one"
            )
    loaded = Checkpoint.load(checkpoint)
    if src is None:
        pairs = read_split(loaded.config.data, "train")
        sources, targets = pairs.src, pairs.tgt
    built = shortlist_from_corpus(loaded.tokenizer, sources, targets, per_source=per_source, frequent=frequent)
    built.write(output)
    typer.echo(f"shortlist of {len(built.candidates)} source pieces, {len(built.frequent)} frequent -> {output}")

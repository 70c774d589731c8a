"""`seq2seq translate`, `score-pairs`, `eval` and `score`: the commands that use a trained model
(or score existing translations)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from seq2seq.cli.app import DecodeSetOption, DeviceOption, ShortlistOption, app
from seq2seq.cli.boundary import user_errors

MODEL_HELP = "A checkpoint (.pt), a run directory (its best.pt), or a directory from `seq2seq export`"
CheckpointOption = Annotated[Path, typer.Option("--checkpoint", "-c", help=f"{MODEL_HELP}.")]
CheckpointsOption = Annotated[
    list[Path], typer.Option("--checkpoint", "-c", help=f"{MODEL_HELP}; repeat for an ensemble.")
]
BeamOption = Annotated[
    Optional[int],  # noqa: UP045
    typer.Option("--beam", help="Beam size (1 = greedy) [default: the model's decode.beam].", show_default=False),
]


def _decode_overrides(overrides: list[str] | None, beam: int | None, nbest: int | None) -> list[str]:
    """--set decode.KEY=VALUE items, then --beam and --nbest on top."""
    from seq2seq.config_files import FlagOverride

    extra = [FlagOverride(f"decode.beam={beam}", "--beam")] if beam is not None else []
    extra += [FlagOverride(f"decode.nbest={nbest}", "--nbest")] if nbest is not None else []
    return [*(overrides or []), *extra]


@app.command()
@user_errors
def translate(
    checkpoint: CheckpointsOption,
    input: Annotated[str, typer.Option("--input", "-i", help="Source file, or - for stdin.")] = "-",
    output: Annotated[str, typer.Option("--output", "-o", help="Output file, or - for stdout.")] = "-",
    beam: BeamOption = None,
    nbest: Annotated[
        Optional[int], typer.Option("--nbest", help="Print the N best per line: idx ||| text ||| score.")  # noqa: UP045
    ] = None,
    overrides: DecodeSetOption = None,
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
    shortlist: ShortlistOption = None,
    device: DeviceOption = None,
) -> None:
    """Translate text, one sentence per line.

    \b
    Examples:
      seq2seq translate -c runs/demo/checkpoints/last.pt -i test.en -o test.out --beam 5
      echo "the cat sleeps" | seq2seq translate -c runs/demo/checkpoints/best.pt
      seq2seq translate -c runs/bible/checkpoints/step_00009000.pt -c runs/bible/checkpoints/step_00010000.pt -i test.en
      seq2seq translate -c best.pt -i test.en --glossary terms.tsv --prefix prefixes.txt
      seq2seq translate -c reverse.pt -i mono.es --set decode.sample=true --set decode.top_k=10 -o synthetic.en
    """
    from seq2seq.cli.file_translation import LineGuides, translate_file

    guides = LineGuides(prefixes=prefix, constraints=constraints, glossary=glossary)
    written = translate_file(
        checkpoint,
        source=input,
        output=output,
        decode_overrides=_decode_overrides(overrides, beam, nbest),
        stream=stream,
        attention_plot=attention_plot,
        guides=guides,
        shortlist=shortlist,
        device=device,
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
    overrides: DecodeSetOption = None,
    device: DeviceOption = None,
) -> None:
    """Score given translations with the model (force-decoding): score, log-probability, pieces per pair.

    The score is the log-probability normalised by length as beam search ranks outputs
    (decode.length_norm); use it to filter noisy parallel data or rerank.

    \b
    Examples:
      seq2seq score-pairs -c runs/demo/checkpoints/best.pt --src data/demo/test.en --tgt data/demo/test.xx
      seq2seq score-pairs -c models/demo-ct2 --src train.en --tgt train.xx -o scores.tsv --per-token
    """
    from seq2seq.cli.file_translation import score_file

    options = {"decode_overrides": overrides or [], "per_token": per_token, "device": device}
    score_file(checkpoint, src=src, tgt=tgt, output=output, **options)


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
    from seq2seq.evaluation.scoring import ScoreOptions, metrics_for

    names = tuple(name.strip().lower() for name in metrics.split(",") if name.strip())
    options = ScoreOptions(metrics=names, tokenize=tokenize, lowercase=lowercase)
    metrics_for(options)  # a tokenizer sacrebleu cannot set up here: one line, before any translation
    return options


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
    overrides: DecodeSetOption = None,
    shortlist: ShortlistOption = None,
    device: DeviceOption = None,
) -> None:
    """Translate --src and score it against --ref with sacrebleu (scores with their signatures).

    \b
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
        shortlist=shortlist,
        device=device,
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

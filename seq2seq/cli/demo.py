"""`seq2seq demo`: the whole product path on the embedded synthetic task, in a few minutes on a laptop CPU."""

from __future__ import annotations

import contextlib
import importlib.util
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from seq2seq.config_files import load_config
from seq2seq.data.demo_data import demo_corpus_files, write_demo_corpus
from seq2seq.data.prepare import read_split
from seq2seq.errors import UserInputError
from seq2seq.evaluation.evaluate import translate_and_score
from seq2seq.evaluation.scoring import Scores
from seq2seq.inference.translator import Translator
from seq2seq.training.plots import plot_training_curves
from seq2seq.training.run_dir import RunDir
from seq2seq.training.trainer import Trainer

DEMO_DATA_DIR = Path("data/demo")  # demo.yaml reads its files from here (relative to where the demo runs)
DEMO_CONFIG = Path(__file__).with_name("demo.yaml")  # shipped in the package: the demo runs from any directory
DEMO_MARKER = ".seq2seq-demo"  # written into every demo run directory: only those may be replaced


def _check_run_dir(run_dir: Path) -> bool:
    """Whether run_dir holds an earlier demo run (to be replaced): only a directory carrying the marker
    that the demo writes into its own runs. New or empty is fine; anything else is the user's (a run
    of `seq2seq train configs/demo.yaml` included) and is refused before any work, so the demo never
    deletes what it did not make."""
    if not run_dir.exists():
        return False
    if not run_dir.is_dir():
        raise UserInputError(f"--run-dir {run_dir}: exists and is not a directory; choose a new path")
    if not any(run_dir.iterdir()):
        return False
    if not (run_dir / DEMO_MARKER).is_file():
        raise UserInputError(
            f"--run-dir {run_dir}: not empty and not made by `seq2seq demo` (no {DEMO_MARKER}); the demo replaces "
            "only its own runs: choose a new or empty directory"
        )
    return True


def _check_data_dir(folder: Path, files: dict[str, str]) -> None:
    """The demo writes its corpus into `folder` (data/demo under the current one): a file there of one
    of its names is rewritten only when it holds the demo's own text, as an earlier demo wrote it; any
    other is the user's and is refused before any work."""
    if folder.exists() and not folder.is_dir():
        raise UserInputError(f"{folder}: exists and is not a directory; the demo writes its corpus there")
    for name, text in files.items():
        path = folder / name
        if path.exists() and (not path.is_file() or path.read_bytes() != text.encode("utf-8")):
            raise UserInputError(
                f"{path}: exists and is not the demo's corpus; the demo writes its data to {folder}/ under the "
                "current folder: run it from another folder"
            )


def run_demo(
    config_path: Path | None, overrides: list[str], run_dir: Path, *, show_progress: bool, echo: Callable[[str], None]
) -> Scores:
    """Write the corpus, train from scratch into run_dir (new, empty, or an earlier demo run, which is
    replaced), then translate and score the test split."""
    started = time.perf_counter()
    replace = _check_run_dir(run_dir)
    # an earlier demo run that a process still trains in (another demo, a --resume of it) is refused,
    # not deleted under it: its lock is held from here until the directory is gone
    with RunDir(run_dir).held() if replace else contextlib.nullcontext():
        corpus = demo_corpus_files()
        _check_data_dir(DEMO_DATA_DIR, corpus)
        write_demo_corpus(DEMO_DATA_DIR, corpus)
        echo(f"demo corpus written to {DEMO_DATA_DIR}/ (train/valid/test .en -> .xx)")
        config = load_config(config_path or DEMO_CONFIG, overrides)
        if replace:
            echo(f"replacing the earlier demo run in {run_dir}")
            shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / DEMO_MARKER).write_text("written by `seq2seq demo`, which may replace this directory\n")
    result = Trainer(config, run_dir, show_progress=show_progress).run()
    best = result.last_checkpoint.with_name("best.pt")
    translator = Translator.load(best if best.exists() else result.last_checkpoint)
    test = read_split(config.data, "test")
    evaluation = translate_and_score(translator, test.src, test.tgt, config.decode, progress=show_progress)
    echo("\nsample translations (test split):")
    for src, ref, hyp in list(zip(test.src, test.tgt, evaluation.hypotheses))[:5]:
        echo(f"  src: {src}\n  ref: {ref}\n  hyp: {hyp}\n")
    scores = evaluation.scores
    plots = plot_training_curves(run_dir)
    echo(f"training curves: {', '.join(str(p) for p in plots)}")
    echo(f"test set, beam {config.decode.beam}, {scores.sentences} sentences:\n{scores.describe()}")
    _ship(best if best.exists() else result.last_checkpoint, run_dir / "exported-int8", test, scores, echo)
    echo(f"demo finished in {time.perf_counter() - started:.0f}s; run directory: {run_dir}")
    return scores


def _ship(checkpoint: Path, output: Path, test, scores: Scores, echo: Callable[[str], None]) -> None:
    """The last step of the path: export to CTranslate2 int8 through the parity gate, and score that."""
    if importlib.util.find_spec("ctranslate2") is None:
        echo("(to also ship the model: pip install -e '.[export]', then seq2seq export)")
        return
    from seq2seq.deploy.export import export_checkpoint

    report = export_checkpoint(checkpoint, output, quantization="int8")
    exported = translate_and_score(Translator.load(output), test.src, test.tgt).scores
    echo(f"\nexported to {output} (CTranslate2, int8); {report.describe()}")
    echo(f"test BLEU: checkpoint {scores.bleu:.2f}, exported int8 model {exported.bleu:.2f}")

"""A training run's directory: its layout, the start-or-resume rule, and what it prepares before training.

RUN_DIR/config.yaml      the resolved config (enough to reproduce the run), its first line CONFIG_HEADER
RUN_DIR/tokenizer/       the SentencePiece model(s), trained once (not made by fine-tuning: train.init_from's)
RUN_DIR/checkpoints/     step_NNNNNNNN.pt, last.pt, best.pt (checkpoint.py)
RUN_DIR/metrics.jsonl    one JSON record per log or validation step (run_log.py); an earlier run's, found
                         by a new run, is kept as metrics.earlier-N.jsonl
RUN_DIR/train.log        the log lines stderr showed, appended by every start and resume
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import yaml

from seq2seq.checkpoint import BEST, LAST, Checkpoint, numbered_checkpoints, run_checkpoint
from seq2seq.config import Config
from seq2seq.config_changes import architecture_differences, config_differences, run_defining_differences
from seq2seq.data.prepare import TrainingData, prepare_training_data, read_split, stream_split
from seq2seq.data.sources import corpus_identity
from seq2seq.data.tokenizer import (
    Tokenizer,
    check_model_files_hold,
    load_or_train_tokenizer,
    saved_tokenizer_exists,
)
from seq2seq.errors import UserInputError
from seq2seq.files import remove_stale_temporaries, write_text_atomic
from seq2seq.inference.engine import EXPORT_METADATA
from seq2seq.progress import with_progress
from seq2seq.training.distributed import DistributedContext

log = logging.getLogger(__name__)

# The first line of every config.yaml a run writes: what tells a new run that the file is a run's,
# which it may replace, and not a config someone keeps in the directory they train into.
CONFIG_HEADER = "# seq2seq train: this run's resolved config (every setting), written at each start and resume\n"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config_file(self) -> Path:
        return self.root / "config.yaml"

    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def log(self) -> Path:
        return self.root / "train.log"

    def check(self, *, resume: bool) -> None:
        """A new run needs a directory without checkpoints; a resumed one needs a checkpoint."""
        for path in (self.root, *self.root.parents):
            if path.exists() and not path.is_dir():
                raise UserInputError(f"{path}: is a file; expected a run directory (or a path where one can be made)")
        existing = self.has_checkpoints()
        if resume and not existing:
            raise UserInputError(f"--resume: {self.checkpoints} has no checkpoint to resume from")
        if existing and not resume:
            raise UserInputError(
                f"{self.root}: this run directory already has checkpoints; pass --resume to continue it "
                "or --run-dir to start a new run"
            )
        if not resume and self.config_file.exists() and not self._config_written_by_a_run():
            raise UserInputError(
                f"{self.config_file}: exists and is not a config a seq2seq run wrote; a run records its resolved "
                "config under that name: keep yours outside the run directory, or choose another --run-dir"
            )

    def _config_written_by_a_run(self) -> bool:
        try:
            with open(self.config_file, encoding="utf-8", errors="replace") as handle:
                return handle.readline() == CONFIG_HEADER
        except OSError:  # a directory of that name, or one that cannot be read: not a run's config
            return False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The directory (made if missing), held by this process while the block runs: a second
        training or resume in it meanwhile (another terminal, a second job) would write its checkpoints
        over this run's, and is refused. The lock is the kernel's (flock on the directory), so a
        killed process leaves none behind. A directory made here and still empty when the block fails
        (bad data found before anything was written) is removed: the command leaves what it found."""
        made = not self.root.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        handle = os.open(self.root, os.O_RDONLY)
        try:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UserInputError(
                    f"{self.root}: another seq2seq process is working in this run directory (train, tokenizer "
                    "train, distill or demo); wait for it to stop, or choose another --run-dir"
                ) from None
            yield
        except BaseException:
            if made:
                with contextlib.suppress(OSError):  # not empty: it holds what the run wrote, kept
                    self.root.rmdir()
            raise
        finally:
            os.close(handle)  # and with it the lock

    def set_earlier_metrics_aside(self) -> None:
        """A new run's metrics.jsonl starts empty: one found here (a run stopped before its first
        checkpoint, or whose checkpoints were removed) is renamed metrics.earlier-N.jsonl, N the first
        free number, and a warning says so. Appended to, its steps would count from 1 again in the middle
        of the file, and `plot` would draw two runs as one."""
        if not self.metrics.exists():
            return
        number = 1
        while (kept := self.root / f"metrics.earlier-{number}.jsonl").exists():
            number += 1
        os.rename(self.metrics, kept)
        log.warning("%s: an earlier run's metrics; this new run starts its own, and that file is kept as %s",
                    self.metrics, kept.name)  # fmt: skip

    def remove_stale_temporaries(self) -> None:
        """Temporary files a killed process left half-written (files.temporary_path names them .NAME.tmp-HOST-PID)."""
        for folder in (self.root, self.checkpoints, self.tokenizer):
            remove_stale_temporaries(folder)

    def has_checkpoints(self) -> bool:
        """Whether a run can resume from here (numbered checkpoints saved)."""
        return bool(numbered_checkpoints(self.checkpoints))

    def latest_checkpoint(self) -> Path:
        return numbered_checkpoints(self.checkpoints)[-1]


def check_resumable(stored: Config, given: Config, run_dir: RunDir, *, data_recorded: bool) -> list[str]:
    """A resumed run keeps what it trains (config_changes.RUN_DEFINING_KEYS); other keys may change: one line for each
    that did, for the trainer to log once it holds the run directory (its train.log is then its own).
    Where the checkpoint recorded its training text (`data_recorded`), data.train may name other files,
    a moved corpus: prepare_run then checks that they hold the same text."""
    differences = config_differences(stored, given)
    fixed = run_defining_differences(stored, given, text_compared=data_recorded)
    if fixed:
        lines = [
            f"--resume {run_dir.root}: {key}: {differences[key][0]!r} in the run, {differences[key][1]!r} given; "
            "a resumed run must keep it (start a new run with --run-dir to change it)"
            for key in fixed
        ]
        raise UserInputError("\n".join(lines))
    return [f"resume: {key} changed from {before!r} to {after!r}" for key, (before, after) in differences.items()]


def fine_tuning_start(config: Config) -> Checkpoint:
    """The checkpoint named by train.init_from, checked before any work: a new run takes its weights
    and tokenizer, so its model and tokenizer sections must be the checkpoint's (dropout rates aside)."""
    given = Path(config.train.init_from)
    if (given / EXPORT_METADATA).is_file():
        raise UserInputError(
            f"train.init_from {given}: an exported model (CTranslate2) cannot be trained on; expected the "
            "checkpoint (.pt) it was exported from, or its run directory"
        )
    try:
        path = run_checkpoint(given) if given.is_dir() else given
    except UserInputError:  # its message offers an export, which cannot be trained on
        raise UserInputError(
            f"train.init_from {given}: a directory without checkpoints/{BEST} or checkpoints/{LAST}; expected a "
            "checkpoint (.pt) or a run directory that has saved one"
        ) from None
    try:
        start = Checkpoint.load(path)
    except UserInputError as error:
        raise UserInputError(f"train.init_from: {error}") from None
    differences = config_differences(start.config, config)
    differing = architecture_differences(start.config, config)
    if differing:
        raise UserInputError(
            "\n".join(
                f"train.init_from {config.train.init_from}: {key}: {differences[key][0]!r} in the checkpoint, "
                f"{differences[key][1]!r} given; a fine-tuned model keeps the shape and vocabulary it starts from"
                for key in differing
            )
        )
    return start


def check_same_text(data: TrainingData, recorded: str, config: Config) -> None:
    """A resumed run trains on the text its checkpoint recorded (TrainingData.text_digest), or not at
    all: other pairs would change the batch order and every update from here on, silently."""
    if data.text_digest != recorded:
        raise UserInputError(
            f"data.train ({_corpus_name(config)}): not the text this run trained on (its pairs differ); a "
            "resumed run must keep its data: give it the run's files back, or start a new run with --run-dir"
        )


def warn_if_resampled(data: TrainingData, recorded: list[str]) -> None:
    """A resumed run's sampled segmentations (data.subword_alpha) repeat those it trained on when they
    come from the encoding cache or the same SentencePiece; sampled again by another version they may
    not, and the run then goes on, but no longer as the uninterrupted one would: it says so."""
    differing = [
        variant + 1
        for variant, (digest, before) in enumerate(zip(data.segmentations, recorded))
        if digest and before and digest != before
    ]
    if differing:
        log.warning(
            "data.subword_alpha: the sampled segmentations of data.train (variant %s) differ from those this run "
            "trained on: sampled again here (no encoding cache) by sentencepiece %s; training goes on, though not "
            "as the uninterrupted run would have",
            ", ".join(map(str, differing)),
            spm.__version__,
        )


def prepare_run(
    config: Config,
    run_dir: RunDir,
    dist: DistributedContext,
    held: contextlib.ExitStack,
    *,
    tokenizer: Tokenizer | None = None,
    trained_on: str = "",
    segmented_as: list[str] | None = None,
    progress: bool = False,
    resumed: bool = False,
) -> tuple[Tokenizer, TrainingData]:
    """Train or reuse the tokenizer (a resumed run passes its checkpoint's), encode the data, then write
    config.yaml: rank 0 first, then the other ranks reuse its tokenizer and encoding cache. The
    validation split is read first: a problem in it shows before the long work, and before the run
    directory is made; a run refused for its training data leaves no config.yaml. A resumed run passes
    the digest of its training text (`trained_on`), which the data must match, and those of its sampled
    segmentations (`segmented_as`), which it warns of when they differ. Rank 0 holds the directory
    (RunDir.held) until `held` closes; a new run (not `resumed`) sets an earlier run's metrics aside."""
    if tokenizer is not None and config.tokenizer.model_files:
        check_model_files_hold(tokenizer, config.tokenizer)
    valid_text = read_split(config.data, "valid")
    if dist.is_main:
        held.enter_context(run_dir.held())
        run_dir.remove_stale_temporaries()
        tokenizer = tokenizer or _load_or_train_tokenizer(config, run_dir, progress)
        data = prepare_training_data(config.data, tokenizer, valid_text, progress=progress, seed=config.train.seed)
        if trained_on:
            check_same_text(data, trained_on, config)
        warn_if_resampled(data, segmented_as or [])
        write_text_atomic(run_dir.config_file, CONFIG_HEADER + yaml.safe_dump(config.to_dict(), sort_keys=False))
        if not resumed:
            run_dir.set_earlier_metrics_aside()
    dist.barrier()
    if not dist.is_main:
        tokenizer = tokenizer or Tokenizer.load(run_dir.tokenizer)
        data = prepare_training_data(config.data, tokenizer, valid_text, seed=config.train.seed)
    return tokenizer, data


def train_run_tokenizer(config: Config, run_dir: RunDir) -> Tokenizer:
    """`seq2seq tokenizer train`: a new tokenizer for the run; an existing one is never replaced."""
    if saved_tokenizer_exists(run_dir.tokenizer):
        raise UserInputError(f"{run_dir.tokenizer}: a tokenizer already exists; delete it to train a new one")
    with run_dir.held():  # a training there would be reading it
        return _load_or_train_tokenizer(config, run_dir, progress=True)


def _load_or_train_tokenizer(config: Config, run_dir: RunDir, progress: bool) -> Tokenizer:
    # read only if a tokenizer has to be trained
    pairs = with_progress(stream_split(config.data, "train"), "tokenizer: read data.train", enabled=progress)
    data = {"langs": [config.data.src_lang, config.data.tgt_lang], **corpus_identity(config.data.train, "data.train")}
    if config.data.extra_train:  # (without, the record a tokenizer trained before extra_train existed has)
        data["extra_train"] = [corpus_identity(corpus, key) for key, corpus in config.data.training_corpora()[1:]]
    name = f"data.train ({_corpus_name(config)})"
    return load_or_train_tokenizer(
        run_dir.tokenizer, config.tokenizer, pairs, seed=config.train.seed, data_identity=data, data_name=name
    )


def _corpus_name(config: Config) -> str:
    """The training corpora's files (or hub names), for messages."""
    corpora = [corpus for _, corpus in config.data.training_corpora()]
    return ", ".join(", ".join(corpus.files().values()) or str(corpus.name) for corpus in corpora)

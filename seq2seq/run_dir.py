"""A training run's directory: its layout, the start-or-resume rule, and what it prepares before training.

RUN_DIR/config.yaml      the resolved config (enough to reproduce the run)
RUN_DIR/tokenizer/       the SentencePiece model(s), trained once
RUN_DIR/checkpoints/     step_NNNNNNNN.pt, last.pt, best.pt (checkpoint.py)
RUN_DIR/metrics.jsonl    one JSON record per log or validation step (run_log.py)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from seq2seq.checkpoint import numbered_checkpoints
from seq2seq.config import Config
from seq2seq.data.prepare import TrainingData, prepare_training_data, stream_split
from seq2seq.distributed import DistributedContext
from seq2seq.errors import UserInputError
from seq2seq.tokenizer import Tokenizer, load_or_train_tokenizer, saved_tokenizer_exists


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

    def check(self, *, resume: bool) -> None:
        """A new run needs a directory without checkpoints; a resumed one needs a checkpoint."""
        existing = bool(numbered_checkpoints(self.checkpoints))
        if resume and not existing:
            raise UserInputError(f"--resume: {self.checkpoints} has no checkpoint to resume from")
        if existing and not resume:
            raise UserInputError(
                f"{self.root}: this run directory already has checkpoints; pass --resume to continue it "
                "or --run-dir to start a new run"
            )

    def latest_checkpoint(self) -> Path:
        return numbered_checkpoints(self.checkpoints)[-1]


def prepare_run(config: Config, run_dir: RunDir, dist: DistributedContext) -> tuple[Tokenizer, TrainingData]:
    """Write config.yaml, train or reuse the tokenizer and encode the data: rank 0 first, then the other
    ranks reuse its tokenizer and encoding cache."""
    if dist.is_main:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        run_dir.config_file.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
        tokenizer = _load_or_train_tokenizer(config, run_dir)
        data = prepare_training_data(config.data, tokenizer)
    dist.barrier()
    if not dist.is_main:
        tokenizer = Tokenizer.load(run_dir.tokenizer)
        data = prepare_training_data(config.data, tokenizer)
    return tokenizer, data


def train_run_tokenizer(config: Config, run_dir: RunDir) -> Tokenizer:
    """`seq2seq tokenizer train`: a new tokenizer for the run; an existing one is never replaced."""
    if saved_tokenizer_exists(run_dir.tokenizer):
        raise UserInputError(f"{run_dir.tokenizer}: a tokenizer already exists; delete it to train a new one")
    return _load_or_train_tokenizer(config, run_dir)


def _load_or_train_tokenizer(config: Config, run_dir: RunDir) -> Tokenizer:
    pairs = stream_split(config.data, "train")  # read only if a tokenizer has to be trained
    return load_or_train_tokenizer(run_dir.tokenizer, config.tokenizer, pairs, seed=config.train.seed)

"""The checkpoint format: one `Checkpoint` type, written atomically, read with weights_only=True.

A checkpoint describes itself: the config and the tokenizer travel with the weights, so
translation needs nothing else; the optimizer, loss scaler, progress and RNG states make a resumed
run continue exactly. On disk it is a dict of plain data and tensors (no pickled objects), with a
format version; `Checkpoint.from_state` names the field a foreign or damaged file lacks.
This module also owns the checkpoint files of a run: numbered ones, `last.pt`, their rotation.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from seq2seq.config import Config
from seq2seq.config_changes import run_defining_differences
from seq2seq.config_files import config_from_dict
from seq2seq.data.tokenizer import Tokenizer
from seq2seq.errors import UserInputError
from seq2seq.files import atomic_write, check_writable
from seq2seq.model.transformer import Seq2SeqTransformer, build_model

FORMAT_VERSION = 1
LAST = "last.pt"
BEST = "best.pt"
AVERAGED = "averaged.pt"  # the mean of a run's last saves (train.average_last)


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0
    epoch: int = 1
    next_batch: int = 0  # index into this epoch's batch order
    best_bleu: float = -1.0  # the validation BLEU of the model in best.pt
    # its train.best_metric, higher is better (a loss negated); None: no validation yet, or a checkpoint
    # saved before best_metric, whose best.pt is the best by BLEU (validation.best_so_far)
    best_score: float | None = None
    stale_validations: int = 0
    train_seconds: float = 0.0
    skipped_steps: int = 0  # non-finite gradients (fp16 overflow or NaN loss): never applied
    decay_start: float = 0.0  # the share of the budget spent when warmup ended (schedule.learning_rate)
    validation_due: bool = False  # a stop request cut the last validation short: a resumed run makes it first


@dataclass
class RngStates:
    """Every rank's CPU generator state (one per rank, in rank order) and this process's CUDA states."""

    torch: list[Tensor]
    cuda: list[Tensor] = field(default_factory=list)


@dataclass
class Checkpoint:
    config: Config
    tokenizer: Tokenizer
    model: dict[str, Tensor]
    optimizer: dict[str, Any]
    scaler: dict[str, Any]
    progress: Progress
    rng: RngStates
    averaged_from: list[str] = field(default_factory=list)  # set by `seq2seq average`
    ema: dict[str, Tensor] = field(default_factory=dict)  # train.ema_decay's weight average, to resume it
    weights: str = "trained"  # what `model` holds: "trained", "ema" or "average" (best.pt: which validated best)
    train_data: str = ""  # the digest of the training text (prepare.TrainingData.text_digest): a resume keeps it
    interrupted: bool = False  # saved between periodic saves as a signal stopped the run: its next save replaces it
    segmentations: list[str] = field(default_factory=list)  # prepare.TrainingData.segmentations: a resume compares

    def to_state(self) -> dict[str, Any]:
        """Plain data and tensors only, so that loading never needs to unpickle an object."""
        tokenizer = {
            name: torch.frombuffer(bytearray(proto), dtype=torch.uint8)
            for name, proto in self.tokenizer.protos().items()
        }
        return {
            "format_version": FORMAT_VERSION,
            "config": self.config.to_dict(),
            "tokenizer": tokenizer,
            "model": self.model,
            "optimizer": self.optimizer,
            "scaler": self.scaler,
            "progress": dataclasses.asdict(self.progress),
            "rng": {"torch": self.rng.torch, "cuda": self.rng.cuda},
            "averaged_from": self.averaged_from,
            "ema": self.ema,
            "weights": self.weights,
            "train_data": self.train_data,
            "interrupted": self.interrupted,
            "segmentations": self.segmentations,
        }

    @classmethod
    def from_state(cls, state: Any, origin: str) -> Checkpoint:
        """Check the version and every field; `origin` (the file) names the problem in errors."""
        if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
            raise UserInputError(f"{origin}: not a seq2seq checkpoint (format version {FORMAT_VERSION} expected)")
        missing = [name for name in _REQUIRED if name not in state]
        if missing:
            raise UserInputError(
                f"{origin}: checkpoint lacks {', '.join(missing)}; expected every field of format "
                f"version {FORMAT_VERSION} ({', '.join(_REQUIRED)})"
            )
        progress_fields = {f.name for f in dataclasses.fields(Progress)}
        if not isinstance(state["progress"], dict) or not (
            progress_fields - _PROGRESS_ADDED <= set(state["progress"]) <= progress_fields
        ):
            raise UserInputError(f"{origin}: the checkpoint's progress has other fields than {sorted(progress_fields)}")
        protos = {name: tensor.numpy().tobytes() for name, tensor in state["tokenizer"].items()}
        return cls(
            config=config_from_dict(state["config"], origin=f"{origin} (stored config)"),
            tokenizer=Tokenizer.from_protos(protos),
            model=state["model"],
            optimizer=state["optimizer"],
            scaler=state["scaler"],
            progress=Progress(**state["progress"]),
            rng=RngStates(state["rng"]["torch"], state["rng"]["cuda"]),
            averaged_from=list(state.get("averaged_from", [])),
            ema=dict(state.get("ema", {})),
            weights=str(state.get("weights", "trained")),
            train_data=str(state.get("train_data", "")),
            interrupted=bool(state.get("interrupted", False)),
            segmentations=[str(digest) for digest in state.get("segmentations", [])],
        )

    def save(self, path: str | Path) -> None:
        """Write atomically (files.atomic_write): a crash or a full disk never leaves half a file, and a
        failed write removes its temporary file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(path) as handle:
            torch.save(self.to_state(), handle)

    @classmethod
    def load(cls, path: str | Path) -> Checkpoint:
        """Load tensors and plain data only; arbitrary pickled objects are refused. A run directory
        means its best checkpoint (its last when it has not validated yet)."""
        path = run_checkpoint(Path(path)) if Path(path).is_dir() else path
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise UserInputError(f"{path}: checkpoint not found") from None
        except Exception as exc:  # torch raises several types for corrupt or foreign files
            # torch.save writes a zip archive; any other file (a YAML config, a SentencePiece model) is
            # read as a bare pickle, whose first byte the weights-only loader refuses like an object
            refused = isinstance(exc, pickle.UnpicklingError) and WEIGHTS_ONLY_REFUSAL in str(exc)
            holds_objects = refused and zipfile.is_zipfile(path)
            raise UserInputError(f"{path}: {HOLDS_OBJECTS if holds_objects else NOT_A_CHECKPOINT}") from None
        return cls.from_state(state, origin=str(path))

    def build_model(self, device: torch.device | str = "cpu") -> Seq2SeqTransformer:
        """The trained model, in eval mode, on `device`."""
        model = build_model(self.config.model, self.tokenizer)
        model.load_state_dict(self.model)
        return model.to(device).eval()


NOT_A_CHECKPOINT = "not a readable seq2seq checkpoint; expected a .pt file that seq2seq wrote (train, average, distill)"
HOLDS_OBJECTS = (
    "not a readable seq2seq checkpoint: it holds Python objects beside tensors and plain data, which seq2seq "
    "never unpickles (they can run code)"
)
WEIGHTS_ONLY_REFUSAL = "Weights only load failed"  # how torch.load(weights_only=True) begins its refusal
_REQUIRED = ("config", "tokenizer", "model", "optimizer", "scaler", "progress", "rng")
_PROGRESS_ADDED = {
    "decay_start",
    "validation_due",
    "best_score",
}  # fields added within this format version: older checkpoints take the default


@dataclass
class InferenceBundle:
    """What translation needs, all from one checkpoint file."""

    model: Seq2SeqTransformer
    tokenizer: Tokenizer
    config: Config


def run_checkpoint(run_dir: Path) -> Path:
    """The checkpoint a run directory stands for, as users of `translate -c runs/NAME` expect."""
    for name in (BEST, LAST):
        if (run_dir / "checkpoints" / name).is_file():
            return run_dir / "checkpoints" / name
    raise UserInputError(
        f"{run_dir}: a directory without checkpoints/{BEST} or checkpoints/{LAST}; expected a checkpoint "
        "file (.pt), a run directory that has saved one, or a directory written by `seq2seq export`"
    )


def load_for_inference(path: str | Path, device: torch.device | str = "cpu") -> InferenceBundle:
    checkpoint = Checkpoint.load(path)
    return InferenceBundle(checkpoint.build_model(device), checkpoint.tokenizer, checkpoint.config)


def save_numbered(folder: Path, checkpoint: Checkpoint, *, keep_last: int, replaces: Path | None = None) -> Path:
    """Save as step_NNNNNNNN.pt, point last.pt at it, and delete all but the newest `keep_last` numbered ones.

    A checkpoint saved at an interruption, between periodic saves, is there for the run to resume from:
    the run's next save `replaces` it, so that a run interrupted and resumed keeps (and averages,
    train.average_last) the checkpoints the uninterrupted one keeps."""
    path = folder / f"step_{checkpoint.progress.step:08d}.pt"
    try:
        checkpoint.save(path)
    except OSError as error:
        previous = numbered_checkpoints(folder)
        kept = f"the last good checkpoint is {previous[-1]}" if previous else "no earlier checkpoint exists"
        raise UserInputError(
            f"{path}: could not be written ({error.strerror or error}); {kept}; "
            "free some space and continue with --resume"
        ) from None
    _link_latest(path, folder / LAST)
    if replaces is not None and replaces != path:
        replaces.unlink(missing_ok=True)
    for old in numbered_checkpoints(folder)[:-keep_last]:
        old.unlink()
    return path


def numbered_checkpoints(folder: Path) -> list[Path]:
    """The numbered checkpoints in `folder`, oldest first."""
    return sorted(folder.glob("step_*.pt")) if folder.is_dir() else []


def checkpoints_to_average(paths: list[Path], last: int | None = None) -> list[Path]:
    """The checkpoint files `seq2seq average` is given: files as named, and a run directory (or its
    checkpoints/ folder) as its numbered checkpoints, oldest first, or the newest `last` of them
    (fairseq's --num-update-checkpoints). A directory is never its best.pt here: the mean of one
    checkpoint is that checkpoint."""
    if last is not None and (len(paths) != 1 or not paths[0].is_dir()):
        raise UserInputError(f"--last {last}: picks from one run directory's numbered checkpoints; "
                             f"got {len(paths)} path(s): {', '.join(map(str, paths))}")  # fmt: skip
    files: list[Path] = []
    for path in paths:
        if not path.is_dir():
            files.append(path)
            continue
        saves = numbered_checkpoints(path / "checkpoints") or numbered_checkpoints(path)
        if not saves:
            raise UserInputError(
                f"{path}: a directory without numbered checkpoints (checkpoints/step_*.pt); expected a run "
                "directory that has saved some, or checkpoint files"
            )
        if last is not None and len(saves) < last:
            raise UserInputError(
                f"{path}: {len(saves)} numbered checkpoint(s) ({', '.join(save.name for save in saves)}); "
                f"--last {last} expected at least {last} (a run keeps train.keep_last of them)"
            )
        files.extend(saves[-last:] if last is not None else saves)
    return files


def _link_latest(path: Path, latest: Path) -> None:
    """Point `latest` (e.g. last.pt) at `path` atomically, as a hard link: no second copy is written."""
    tmp = latest.with_name(f".{latest.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:  # file systems without hard links
        tmp.write_bytes(path.read_bytes())
    os.replace(tmp, latest)


def _weights_digest(checkpoint: Checkpoint) -> str:
    """The step and every weight's bytes as a sha256: what tells that two files hold one save."""
    digest = hashlib.sha256(str(checkpoint.progress.step).encode())
    for name in sorted(checkpoint.model):
        digest.update(name.encode())
        digest.update(checkpoint.model[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _check_same_run(first: Checkpoint, first_path: Path, checkpoint: Checkpoint, path: Path) -> None:
    same_text = bool(first.train_data) and checkpoint.train_data == first.train_data
    differing = run_defining_differences(first.config, checkpoint.config, text_compared=same_text)
    if differing:
        raise UserInputError(
            f"{path}: {', '.join(differing)} differ from {first_path}'s; average checkpoints "
            "of one run (same data, tokenizer and model)"
        )
    if checkpoint.tokenizer.protos() != first.tokenizer.protos():
        raise UserInputError(f"{path}: its tokenizer differs from {first_path}'s; average checkpoints of one run")
    if set(checkpoint.model) != set(first.model):
        raise UserInputError(f"{path}: its parameters differ from {first_path}'s; average checkpoints of one run")


def average_checkpoints(paths: list[Path], output: Path) -> None:
    """Mean of the model parameters of checkpoints of one run; the rest is taken from the last one.

    One checkpoint is held at a time, beside the running sum (float64): ten saves of a large model,
    each with its optimizer's state, need not fit in memory together. The same weights given twice
    are refused (last.pt and best.pt repeat a numbered checkpoint, so `average checkpoints/*.pt`
    would weigh those steps double and say nothing)."""
    check_writable(output, what="output checkpoint")
    sums: dict[str, Tensor] = {}
    seen: dict[str, Path] = {}
    for index, path in enumerate(paths):
        checkpoint = Checkpoint.load(path)
        if index == 0:  # what the others must match, without its weights and optimizer state
            reference = dataclasses.replace(checkpoint, optimizer={}, model=dict.fromkeys(checkpoint.model))
            sums = {name: torch.zeros_like(tensor, dtype=torch.float64) for name, tensor in checkpoint.model.items()}
        else:
            _check_same_run(reference, paths[0], checkpoint, path)
        digest = _weights_digest(checkpoint)
        if digest in seen:
            raise UserInputError(
                f"{path}: the same weights as {seen[digest]} (step {checkpoint.progress.step}); expected each "
                "checkpoint once (last.pt and best.pt repeat a numbered one)"
            )
        seen[digest] = path
        for name, tensor in checkpoint.model.items():
            sums[name] += tensor
        if index < len(paths) - 1:
            del checkpoint  # before the next one loads
    averaged = {name: (total / len(paths)).to(checkpoint.model[name].dtype) for name, total in sums.items()}
    averaged_from = [str(p) for p in paths]
    dataclasses.replace(checkpoint, model=averaged, averaged_from=averaged_from, ema={}, weights="average").save(output)

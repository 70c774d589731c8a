"""What a saved model is, for `seq2seq info`: a checkpoint's (or a run directory's) step, best
validation, shape, vocabulary, training and decoding settings (a run directory's, with its numbered
saves and their validations); an export's metadata.

Users sharing a checkpoint or picking one from a run ask these before translating with it; the run's
config.yaml answers only for the run, not for the file, and a file alone has no config beside it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from seq2seq.checkpoint import Checkpoint, numbered_checkpoints, run_checkpoint
from seq2seq.config import Config
from seq2seq.errors import UserInputError
from seq2seq.inference.engine import EXPORT_METADATA
from seq2seq.training.run_log import MetricsLog


def describe(path: Path) -> dict[str, Any]:
    """Plain data (YAML- and JSON-ready) describing the checkpoint, run directory or export at `path`."""
    if not path.exists():
        raise UserInputError(f"{path}: not found; expected a checkpoint (.pt), a run directory or an export")
    if path.is_dir() and (path / EXPORT_METADATA).is_file():
        return _describe_export(path)
    checkpoint_path = run_checkpoint(path) if path.is_dir() else path
    described = _describe_checkpoint(checkpoint_path, Checkpoint.load(checkpoint_path))
    if path.is_dir():
        described["saves"] = _saves(path)
    return described


def _saves(run_dir: Path) -> list[dict[str, Any]]:
    """The run's numbered checkpoints, oldest first, each with the validation logged at its step (if
    one was): what to pick from, or average (`seq2seq average`). Read from file names and
    metrics.jsonl, without loading a checkpoint."""
    validations = {
        record["step"]: {key: round(record[key], 4 if key == "loss" else 2) for key in ("loss", "bleu", "chrf")}
        for record in MetricsLog(run_dir / "metrics.jsonl").read()
        if record.get("kind") == "valid" and {"step", "loss", "bleu", "chrf"} <= record.keys()
    }
    saves = []
    for file in numbered_checkpoints(run_dir / "checkpoints"):
        step = int(file.stem.removeprefix("step_"))
        saves.append({"file": file.name, "step": step} | ({"valid": validations[step]} if step in validations else {}))
    return saves


def _describe_checkpoint(path: Path, checkpoint: Checkpoint) -> dict[str, Any]:
    config, progress = checkpoint.config, checkpoint.progress
    described: dict[str, Any] = {
        "path": str(path),
        "kind": "checkpoint",
        "step": progress.step,
        "epoch": progress.epoch,
        "weights": checkpoint.weights,  # trained, ema or average: what best.pt validated best with
    }
    if checkpoint.averaged_from:
        described["averaged_from"] = list(checkpoint.averaged_from)
    if progress.best_bleu >= 0:  # a validation has run
        described["best_validation"] = _best_validation(config, progress.best_bleu, progress.best_score)
    described["languages"] = {"source": config.data.src_lang, "target": config.data.tgt_lang}
    described["model"] = _model(config, _parameter_count(checkpoint.model))
    tokenizer = checkpoint.tokenizer
    described["vocabulary"] = {
        "joint": tokenizer.joint,
        "source": tokenizer.src_vocab_size,
        "target": tokenizer.tgt_vocab_size,
    }
    if config.tokenizer.model_files:  # a SentencePiece model the user brought, not one trained for the run
        described["vocabulary"]["from_files"] = list(config.tokenizer.model_files)
    described["training"] = _training(config, checkpoint.train_data)
    described["decode"] = config.to_dict()["decode"]
    return described


def _best_validation(config: Config, best_bleu: float, best_score: float | None) -> dict[str, Any]:
    """The run's best validation up to this checkpoint (for best.pt: its own), by train.best_metric."""
    metric = config.train.best_metric
    best: dict[str, Any] = {"metric": metric, "bleu": round(best_bleu, 2)}
    if best_score is not None and metric != "bleu":  # (stored negated for a loss: higher is better)
        best[metric] = round(-best_score if metric == "loss" else best_score, 4)
    return best


def _model(config: Config, parameters: int) -> dict[str, Any]:
    model = config.model
    return {
        "encoder_layers": model.encoder_layers,
        "decoder_layers": model.decoder_layers,
        "d_model": model.d_model,
        "heads": model.heads,
        "ffn_dim": model.ffn_dim,
        "norm": model.norm,
        "activation": model.activation,
        "parameters": parameters,
    }


def _training(config: Config, text_digest: str) -> dict[str, Any]:
    train = config.train
    corpora = [
        {"key": key, "files": list(corpus.files().values()) or [str(corpus.name)], "weight": corpus.weight}
        | ({"tag": corpus.tag} if corpus.tag else {})
        for key, corpus in config.data.training_corpora()
    ]
    training = {
        "precision": train.precision,
        "tokens_per_update": train.max_tokens * train.accum_steps,  # per rank
        "seed": train.seed,
        "corpora": corpora,
    }
    if text_digest:
        training["text_sha256"] = text_digest
    if train.init_from:
        training["fine_tuned_from"] = train.init_from
    return training


def _parameter_count(state: dict[str, Any]) -> int:
    """Parameters of a state dict, a tied weight (shared embeddings) once: tensors that share storage
    are one parameter, as torch.load restores them."""
    seen, count = set(), 0
    for tensor in state.values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            count += tensor.numel()
    return count


def _describe_export(path: Path) -> dict[str, Any]:
    try:
        metadata = json.loads((path / EXPORT_METADATA).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise UserInputError(f"{path / EXPORT_METADATA}: not readable export metadata ({error})") from None
    if not isinstance(metadata, dict):
        raise UserInputError(f"{path / EXPORT_METADATA}: expected a JSON object")
    described = {"path": str(path), "kind": "export", "engine": metadata.get("engine")}
    for key in ("quantization", "max_positions", "step", "checkpoint_sha256", "src_lang", "tgt_lang", "decode"):
        if key in metadata:
            described[key] = metadata[key]
    if isinstance(metadata.get("best_bleu"), (int, float)) and metadata["best_bleu"] >= 0:
        described["best_validation_bleu"] = round(metadata["best_bleu"], 2)
    return described

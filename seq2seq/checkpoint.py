"""Self-describing checkpoints: written atomically, read with weights_only=True, enough for inference alone."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from seq2seq.config import Config, config_from_dict
from seq2seq.errors import UserInputError
from seq2seq.model import Seq2SeqTransformer
from seq2seq.tokenizer import Tokenizer

FORMAT_VERSION = 1


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write to a temporary file in the same folder, fsync, then rename: a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        torch.save({"format_version": FORMAT_VERSION, **state}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load tensors and plain data only; arbitrary pickled objects are refused."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserInputError(f"{path}: checkpoint not found") from None
    except Exception as exc:  # torch raises several types for corrupt or foreign files
        raise UserInputError(f"{path}: not a readable seq2seq checkpoint ({type(exc).__name__})") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise UserInputError(f"{path}: not a seq2seq checkpoint (format version {FORMAT_VERSION} expected)")
    return state


def tokenizer_to_state(tokenizer: Tokenizer) -> dict[str, torch.Tensor]:
    return {name: torch.frombuffer(bytearray(proto), dtype=torch.uint8) for name, proto in tokenizer.protos().items()}


def tokenizer_from_state(state: dict[str, torch.Tensor]) -> Tokenizer:
    return Tokenizer.from_protos({name: tensor.numpy().tobytes() for name, tensor in state.items()})


@dataclass
class InferenceBundle:
    """What translation needs, all from one checkpoint file."""

    model: Seq2SeqTransformer
    tokenizer: Tokenizer
    config: Config


def load_for_inference(path: str | Path, device: torch.device | str = "cpu") -> InferenceBundle:
    state = read_checkpoint(path)
    config = config_from_dict(state["config"], origin=f"{path} (stored config)")
    tokenizer = tokenizer_from_state(state["tokenizer"])
    model = build_model(config, tokenizer)
    model.load_state_dict(state["model"])
    return InferenceBundle(model.to(device).eval(), tokenizer, config)


def build_model(config: Config, tokenizer: Tokenizer) -> Seq2SeqTransformer:
    return Seq2SeqTransformer(
        config.model, src_vocab_size=tokenizer.src_vocab_size, tgt_vocab_size=tokenizer.tgt_vocab_size
    )


def link_latest(path: Path, latest: Path) -> None:
    """Point `latest` (e.g. last.pt) at `path` atomically, as a hard link: no second copy is written."""
    tmp = latest.with_name(f".{latest.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(path, tmp)
    except OSError:  # file systems without hard links
        tmp.write_bytes(path.read_bytes())
    os.replace(tmp, latest)


def average_checkpoints(paths: list[Path], output: Path) -> None:
    """Mean of the model parameters of checkpoints of one run; the rest is taken from the last one."""
    states = [read_checkpoint(path) for path in paths]
    names = set(states[0]["model"])
    for path, state in zip(paths, states):
        if set(state["model"]) != names:
            raise UserInputError(f"{path}: its parameters differ from {paths[0]}'s; average checkpoints of one run")
    averaged = {
        name: torch.stack([state["model"][name].float() for state in states]).mean(0).to(states[0]["model"][name].dtype)
        for name in names
    }
    save_checkpoint(output, {**states[-1], "model": averaged, "averaged_from": [str(p) for p in paths]})

"""Shared fixtures: tiny configs and corpora built on the fly (no committed binaries)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from filelock import FileLock

from seq2seq.data.demo_data import make_demo_corpus
from seq2seq.model.cpu_kernels import SWITCH, cpu_kernels


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that train (any test marked slow) first, each kept whole and in place otherwise.

    `make test` hands whole modules to its processes in this order (--dist loadscope): a module that
    trains for minutes, handed out last, left the other processes idle while it ran."""
    training = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in training)


def write_pairs(directory: Path, split: str, pairs: list[tuple[str, str]]) -> tuple[Path, Path]:
    src, tgt = directory / f"{split}.en", directory / f"{split}.xx"
    src.write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    tgt.write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return src, tgt


def tiny_config_dict(data_dir: Path, **train_overrides) -> dict:
    """A model small enough to train for a few hundred steps in seconds on a CPU."""
    splits = {
        split: {"format": "text", "src": str(data_dir / f"{split}.en"), "tgt": str(data_dir / f"{split}.xx")}
        for split in ("train", "valid", "test")
    }
    return {
        "data": {"src_lang": "en", "tgt_lang": "xx", "cache_dir": str(data_dir.parent / "cache"), **splits},
        "tokenizer": {"vocab_size": 400},
        "model": {
            "d_model": 96,
            "heads": 4,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "ffn_dim": 192,
            "dropout": 0.1,
            "norm": "pre",
        },
        "train": {
            "max_tokens": 2048,
            "max_steps": 20,
            "lr": 0.004,
            "warmup_steps": 50,
            "log_every": 10,
            "valid_every": 10,
            "save_every": 10,
            "valid_max_sentences": 20,
            "threads": 1,
            "precision": "fp32",  # the same arithmetic on every CPU kind (auto would pick bf16 on some)
            **train_overrides,
        },
        "decode": {"beam": 2, "max_len_a": 1.5, "max_len_b": 5},
    }


def make_trainer(tmp_path: Path, data: Path, name: str = "run", **train):
    """A Trainer of the tiny config on `data`, writing to tmp_path/name."""
    from seq2seq.config_files import config_from_dict
    from seq2seq.training.trainer import Trainer

    raw = tiny_config_dict(data, **train)
    return Trainer(config_from_dict(raw, origin="test"), tmp_path / name, show_progress=False)


@pytest.fixture(scope="session")
def demo_pairs() -> dict[str, list[tuple[str, str]]]:
    return make_demo_corpus(seed=3, sizes={"train": 3000, "valid": 60, "test": 60})


@pytest.fixture
def tiny_data(tmp_path: Path, demo_pairs) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    for split, pairs in demo_pairs.items():
        write_pairs(data, split, pairs)
    return data


@pytest.fixture
def tiny_config_file(tmp_path: Path, tiny_data: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(tiny_data)))
    return path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _trained(tmp_path_factory, demo_pairs, name: str, steps: int) -> tuple[Path, Path]:
    """(last.pt of the tiny config after `steps` steps, its data folder). Trained on the CPU, so that
    every machine, a GPU one too, tests the same model (a GPU's rounding trains another). Once per
    run of the suite: pytest-xdist's workers share the run's temporary folder, and the first to want
    the model trains it under a file lock while the others wait for it (each trained its own)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # this run's folder, above each worker's own
    root, data = shared / f"shared-{name}", shared / f"shared-{name}" / "data"
    checkpoint = root / "run" / "checkpoints" / "last.pt"
    with FileLock(f"{root}.lock"):
        if not checkpoint.exists():
            shutil.rmtree(root, ignore_errors=True)  # what a worker that died while training left
            data.mkdir(parents=True)
            for split, pairs in demo_pairs.items():
                write_pairs(data, split, pairs)
            make_trainer(root, data, device="cpu", max_steps=steps, valid_every=steps, save_every=steps,
                         log_every=20).run()  # fmt: skip
    return checkpoint, data


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory, demo_pairs) -> tuple[Path, Path]:
    """A model that has begun to learn (60 steps): unsure, so its searches branch and stop in many ways."""
    return _trained(tmp_path_factory, demo_pairs, "trained", 60)


@pytest.fixture(scope="session")
def learned_checkpoint(tmp_path_factory, demo_pairs) -> tuple[Path, Path]:
    """A model that translates (300 steps, valid BLEU above 30), for the checks a half-trained model
    cannot make, such as a BLEU drop."""
    return _trained(tmp_path_factory, demo_pairs, "learned", 300)


@pytest.fixture(params=["fused", "pytorch"])
def cpu_path(request, monkeypatch):
    """The test runs twice: through the fused CPU kernels (model/cpu_kernels.py) and through PyTorch's
    operations alone, the path of a machine where they cannot be built."""
    if request.param == "pytorch":
        monkeypatch.setenv(SWITCH, "0")
    elif cpu_kernels() is None:
        pytest.skip("the fused CPU kernels are not built on this machine (no C++ compiler, or not Linux)")
    return request.param


@pytest.fixture
def fused_kernels():
    """The fused CPU kernels' ops, for tests of the kernels themselves."""
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the fused CPU kernels are not built on this machine (no C++ compiler, or not Linux)")
    return kernels

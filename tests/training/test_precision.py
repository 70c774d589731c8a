"""train.precision auto: bf16 where the hardware runs it natively, else fp32 (or fp16 on an old GPU);
an explicit bf16 on a CPU that emulates it warns with the measured rates; the run records its choice."""

from __future__ import annotations

import logging

import pytest
import torch

import seq2seq.training.precision as precision
from seq2seq.checkpoint import Checkpoint
from seq2seq.training.precision import MatmulRates, choose_precision

from ..conftest import make_trainer

CPU = torch.device("cpu")


def pretend_cpu(monkeypatch, *, onednn_bf16: bool, bf16: float, fp32: float = 170.0) -> None:
    monkeypatch.setattr(precision, "onednn_runs_bf16", lambda: onednn_bf16)
    monkeypatch.setattr(precision, "cpu_matmul_rates", lambda: MatmulRates(fp32=fp32, bf16=bf16))


def test_auto_picks_fp32_on_a_cpu_without_bf16_kernels(monkeypatch):
    pretend_cpu(monkeypatch, onednn_bf16=False, bf16=1.0)
    choice = choose_precision("auto", CPU)
    assert choice.precision == "fp32" and "no bf16" in choice.reason


def test_auto_picks_bf16_where_bf16_matmuls_are_native_and_fast(monkeypatch):
    pretend_cpu(monkeypatch, onednn_bf16=True, bf16=900.0)
    assert choose_precision("auto", CPU).precision == "bf16"


def test_auto_keeps_fp32_where_onednn_emulates_bf16_slower_than_fp32(monkeypatch):
    pretend_cpu(monkeypatch, onednn_bf16=True, bf16=60.0)  # AVX-512 without bf16 instructions
    assert choose_precision("auto", CPU).precision == "fp32"


@pytest.mark.parametrize(
    ("onednn_bf16", "warning"),
    [(False, "bf16 on this CPU is emulated: its matrix products run in fp32 and are rounded to bf16 "
             "(model/cpu_linear.py), no faster than fp32; use train.precision auto or fp32"),
     (True, "bf16 on this CPU is emulated: matmul 60 GFLOP/s vs 170 in fp32; use train.precision auto or fp32")],
    ids=["avx2-only", "onednn-emulates"],
)  # fmt: skip
def test_explicit_bf16_on_an_emulating_cpu_is_kept_with_one_warning(monkeypatch, caplog, onednn_bf16, warning):
    pretend_cpu(monkeypatch, onednn_bf16=onednn_bf16, bf16=60.0)
    with caplog.at_level(logging.WARNING, logger="seq2seq.training.precision"):
        choice = choose_precision("bf16", CPU)
    assert choice.precision == "bf16"
    assert [r.getMessage() for r in caplog.records] == [warning]


def test_explicit_precisions_pass_unchanged_without_a_warning(monkeypatch, caplog):
    pretend_cpu(monkeypatch, onednn_bf16=True, bf16=900.0)
    with caplog.at_level(logging.WARNING):
        assert [choose_precision(p, CPU).precision for p in ("fp32", "bf16")] == ["fp32", "bf16"]
    assert not caplog.records


def test_auto_wants_a_clear_margin_before_it_takes_bf16(monkeypatch):
    """A near tie is noise: it could pick bf16 on one start and fp32 on the next."""
    pretend_cpu(monkeypatch, onednn_bf16=True, bf16=187.0)  # 1.1x fp32
    assert choose_precision("auto", CPU).precision == "fp32"
    pretend_cpu(monkeypatch, onednn_bf16=True, bf16=221.0)  # 1.3x
    assert choose_precision("auto", CPU).precision == "bf16"


def test_a_cpu_without_bf16_kernels_pays_for_no_probe(monkeypatch):
    def probe():
        raise AssertionError("the matmul probe ran on a CPU without oneDNN bf16 kernels")

    monkeypatch.setattr(precision, "onednn_runs_bf16", lambda: False)
    monkeypatch.setattr(precision, "cpu_matmul_rates", probe)
    assert choose_precision("auto", CPU).precision == "fp32"


@pytest.mark.parametrize(("capability", "expected"), [((7, 0), "fp16"), ((7, 5), "fp16"), ((8, 0), "bf16"),
                                                      ((9, 0), "bf16")])  # fmt: skip
def test_auto_takes_bf16_only_on_gpus_with_bf16_arithmetic(monkeypatch, capability, expected):
    """torch.cuda.is_bf16_supported() says yes on a V100 (7.0) or a T4 (7.5), where bf16 is emulated."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    assert choose_precision("auto", torch.device("cuda", 0)).precision == expected


def test_a_resumed_run_keeps_the_precision_it_started_with(tmp_path, tiny_data, monkeypatch, caplog):
    """The probe is noisy and the machine may have changed: auto is decided once, when the run starts."""
    pretend_cpu(monkeypatch, onednn_bf16=False, bf16=1.0)
    make_trainer(tmp_path, tiny_data, device="cpu", precision="auto", max_steps=2, save_every=2, valid_every=100).run()
    pretend_cpu(monkeypatch, onednn_bf16=True, bf16=900.0)  # now bf16 would win
    from seq2seq.config_files import config_from_dict
    from seq2seq.training.trainer import Trainer

    from ..conftest import tiny_config_dict

    raw = tiny_config_dict(tiny_data, device="cpu", precision="auto", max_steps=4, save_every=2, valid_every=100)
    resumed = Trainer(config_from_dict(raw, origin="test"), tmp_path / "run", resume=True, show_progress=False)
    with caplog.at_level(logging.INFO, logger="seq2seq.training.trainer"):
        result = resumed.run()
    assert resumed.config.train.precision == "fp32"
    assert Checkpoint.load(result.last_checkpoint).config.train.precision == "fp32"
    assert "precision: fp32 (auto: kept from the run's start" in caplog.text
    assert choose_precision("bf16", CPU, recorded="fp32").precision == "bf16"  # an explicit choice still wins


def test_a_run_logs_and_records_the_precision_it_chose(tmp_path, tiny_data, monkeypatch, caplog):
    pretend_cpu(monkeypatch, onednn_bf16=False, bf16=1.0)
    trainer = make_trainer(
        tmp_path, tiny_data, device="cpu", precision="auto", max_steps=2, save_every=2, valid_every=100
    )
    with caplog.at_level(logging.INFO, logger="seq2seq.training.trainer"):
        result = trainer.run()
    assert trainer.config.train.precision == "fp32"
    assert Checkpoint.load(result.last_checkpoint).config.train.precision == "fp32"
    assert "precision: fp32 (auto: this CPU has no bf16 arithmetic" in caplog.text


def test_a_train_step_refuses_an_unresolved_auto():
    from seq2seq.training.train_step import autocast

    with pytest.raises(ValueError, match="resolve 'auto' first"):
        autocast(CPU, "auto")

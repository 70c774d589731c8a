"""train.precision auto: bf16 where the hardware runs it natively, else fp32 (or fp16 on an old GPU);
an explicit bf16 on a CPU that emulates it warns with the measured rates; the run records its choice."""

from __future__ import annotations

import logging

import pytest
import torch

import seq2seq.training.precision as precision
from seq2seq.checkpoint import Checkpoint
from seq2seq.training.precision import MatmulRates, choose_precision, cpu_matmul_rates, onednn_runs_bf16

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


def test_explicit_bf16_on_an_emulating_cpu_is_kept_with_one_warning(monkeypatch, caplog):
    pretend_cpu(monkeypatch, onednn_bf16=False, bf16=1.0)
    with caplog.at_level(logging.WARNING, logger="seq2seq.training.precision"):
        choice = choose_precision("bf16", CPU)
    assert choice.precision == "bf16"
    assert [r.getMessage() for r in caplog.records] == [
        "bf16 on this CPU is emulated: matmul 1 GFLOP/s vs 170 in fp32; use train.precision auto or fp32"
    ]


def test_explicit_precisions_pass_unchanged_without_a_warning(monkeypatch, caplog):
    pretend_cpu(monkeypatch, onednn_bf16=True, bf16=900.0)
    with caplog.at_level(logging.WARNING):
        assert [choose_precision(p, CPU).precision for p in ("fp32", "bf16")] == ["fp32", "bf16"]
    assert not caplog.records


def test_the_real_probe_on_this_cpu_decides_by_its_own_measurements():
    """Whichever CPU this is: no oneDNN bf16 kernels means fp32 without measuring; otherwise the
    measured rates decide."""
    choice = choose_precision("auto", CPU)
    if not onednn_runs_bf16():
        assert choice.precision == "fp32"
        return
    rates = cpu_matmul_rates()
    assert rates.fp32 > 0 and rates.bf16 > 0
    assert choice.precision == ("bf16" if rates.bf16 >= rates.fp32 else "fp32")


def test_a_run_logs_and_records_the_precision_it_chose(tmp_path, tiny_data, monkeypatch, caplog):
    pretend_cpu(monkeypatch, onednn_bf16=False, bf16=1.0)
    trainer = make_trainer(tmp_path, tiny_data, precision="auto", max_steps=2, save_every=2, valid_every=100)
    with caplog.at_level(logging.INFO, logger="seq2seq.training.trainer"):
        result = trainer.run()
    assert trainer.config.train.precision == "fp32"
    assert Checkpoint.load(result.last_checkpoint).config.train.precision == "fp32"
    assert "precision: fp32 (auto: this CPU has no bf16 arithmetic" in caplog.text


def test_a_train_step_refuses_an_unresolved_auto():
    from seq2seq.training.train_step import autocast

    with pytest.raises(ValueError, match="resolve 'auto' first"):
        autocast(CPU, "auto")

"""train.compile: a compiled run trains as the eager one does. Apart from test_train.py because
compiling is the slowest thing the suite does, and pytest-xdist keeps a module on one worker."""

from __future__ import annotations

import pytest

from seq2seq.config_files import config_from_dict
from seq2seq.training.trainer import Trainer

from ..conftest import tiny_config_dict


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "dropout"), [("fp32", 0.0), ("bf16", 0.1)])
def test_torch_compile_gives_the_eager_losses(tmp_path, tiny_data, precision, dropout):
    """fp32 without dropout: the same arithmetic. bf16 with dropout (the working copy, the 1s-and-0s
    dropout mask): compiled, it must train as eager does; the random draws may differ, the losses only by noise."""
    losses = {}
    for compiled in (False, True):
        raw = tiny_config_dict(tiny_data, max_steps=3, log_every=1, valid_every=100, compile=compiled,
                               precision=precision)  # fmt: skip
        raw["model"]["dropout"] = dropout
        # a layer a stack: each layer is the same code, and every further one is more to trace and compile
        raw["model"]["encoder_layers"] = raw["model"]["decoder_layers"] = 1
        trainer = Trainer(config_from_dict(raw, origin="test"), tmp_path / f"run{compiled}", show_progress=False)
        trainer.run()
        losses[compiled] = [r["loss"] for r in trainer.metrics.read() if r["kind"] == "train"]
    assert losses[True] == pytest.approx(losses[False], abs=1e-4 if precision == "fp32" else 0.05)

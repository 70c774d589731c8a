"""`seq2seq demo` end to end, on a tiny model: the path a new user takes first writes the corpus,
trains, scores the test split, exports int8 through the parity gate, and a second demo replaces the
first (its own run) and nothing else."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from seq2seq.cli.main import app

# A model that trains in seconds; short output limits, since its outputs run to them.
TINY = ["model.d_model=32", "model.heads=2", "model.ffn_dim=64", "model.encoder_layers=1", "model.decoder_layers=1",
        "train.max_steps=30", "train.valid_every=30", "train.threads=1", "train.precision=fp32",
        "decode.max_len_a=0.5", "decode.max_len_b=4"]  # fmt: skip


@pytest.mark.slow
def test_the_demo_trains_scores_and_ships_then_replaces_only_its_own_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sets = [arg for key in TINY for arg in ("--set", key)]
    first = CliRunner().invoke(app, ["demo", "--quiet", *sets])
    assert first.exit_code == 0, first.output
    assert "test set, beam 5, 1000 sentences:\nBLEU = " in first.stdout and "chrF2 = " in first.stdout
    assert "exported to runs/demo/exported-int8 (CTranslate2, int8); parity (int8, 500 sentences)" in first.stdout
    run = tmp_path / "runs" / "demo"
    assert {path.name for path in (run / "plots").iterdir()} == {"loss.png", "bleu.png", "lr.png", "memory.png"}
    assert (run / "checkpoints" / "best.pt").is_file() and (run / "exported-int8" / "model.bin").is_file()
    assert sorted(path.name for path in (tmp_path / "data" / "demo").iterdir()) == sorted(
        f"{split}.{lang}" for split in ("train", "valid", "test") for lang in ("en", "xx"))  # fmt: skip
    (tmp_path / "runs" / "mine").mkdir()
    (tmp_path / "runs" / "mine" / "notes.txt").write_text("keep")
    second = CliRunner().invoke(app, ["demo", "--quiet", *sets])
    assert second.exit_code == 0, second.output
    assert "replacing the earlier demo run in runs/demo" in second.stdout
    assert (tmp_path / "runs" / "mine" / "notes.txt").read_text() == "keep"

"""Every config shipped in configs/ is valid (data files aside: corpora are fetched or prepared first)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from seq2seq.config_files import config_from_dict

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_config_is_valid(path):
    config = config_from_dict(yaml.safe_load(path.read_text()), origin=str(path))
    assert config.model.d_model % config.model.heads == 0


def test_all_expected_configs_ship():
    assert {p.stem for p in CONFIGS} >= {
        "demo",
        "bible_en_es",
        "small_data",
        "iwslt14_de_en",
        "wmt14_en_de_base",
        "student_tiny",
    }


def test_the_demo_config_in_configs_is_the_one_the_demo_ships():
    """`seq2seq demo` runs its packaged config (from any directory); configs/demo.yaml is the copy users
    read and train with: one config, checked to stay one."""
    shipped = Path(__file__).parents[2] / "seq2seq" / "cli" / "demo.yaml"
    assert (Path(__file__).parents[2] / "configs" / "demo.yaml").read_bytes() == shipped.read_bytes()

"""docs/configuration.md is the schema's own words: regenerating it changes nothing."""

from __future__ import annotations

from pathlib import Path

from seq2seq.config_reference import reference

PAGE = Path(__file__).parents[1] / "docs" / "configuration.md"


def test_the_configuration_reference_is_current():
    assert PAGE.read_text(encoding="utf-8") == reference(), (
        "docs/configuration.md differs from the schema: run python -m seq2seq.config_reference docs/configuration.md"
    )


def test_every_key_of_every_section_has_a_line():
    import dataclasses

    from seq2seq.config import Config, CorpusConfig, DataConfig, ModelConfig, TokenizerConfig, TrainConfig
    from seq2seq.decoding import DecodeConfig

    page = PAGE.read_text(encoding="utf-8")
    for section in (Config, CorpusConfig, DataConfig, ModelConfig, TokenizerConfig, TrainConfig, DecodeConfig):
        for item in dataclasses.fields(section):
            assert item.metadata.get("help"), f"{section.__name__}.{item.name} has no help"
            assert f"`{item.name}`" in page

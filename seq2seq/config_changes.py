"""Which differences between two configs matter: a resumed run must keep the keys that define what it
trains, checkpoints averaged together must agree on them, and a model fine-tuned from another must
keep its architecture and vocabulary. Everything else (stop rules, logging, validation, decoding,
the learning rate) may change between them.
"""

from __future__ import annotations

from typing import Any

from seq2seq.config import Config

# What a run trains: a resumed run must keep these keys, and only checkpoints that agree on them can
# be averaged. Everything else (stop rules, logging, validation, decoding, the learning rate) may change.
RUN_DEFINING_KEYS = (
    "data.train",
    "data.extra_train",
    "data.src_lang",
    "data.tgt_lang",
    "data.max_length",
    "data.max_length_ratio",
    "tokenizer",
    "model",
    "train.seed",
    "train.max_tokens",
    "train.accum_steps",
)


# Where a run's vocabulary was read from, not what it is: a checkpoint carries its tokenizer, and a run
# that resumes or starts from one checks the files against it (run_dir.prepare_run), so the files may
# move, as a corpus may.
VOCABULARY_LOCATIONS = ("tokenizer.model_files",)


def config_differences(first: Config, second: Config) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (first value, second value) for every leaf key whose values differ (None where a
    list of sections is shorter: data.extra_train[1].src)."""
    flat_first, flat_second = _flatten(first.to_dict()), _flatten(second.to_dict())

    def differs(key: str) -> bool:
        if key in flat_first and key in flat_second:
            return flat_first[key] != flat_second[key]
        # in one config alone: an indexed key, or an empty list whose sections the other lists by index
        return flat_first.get(key, flat_second.get(key)) != []

    return {
        key: (flat_first.get(key), flat_second.get(key))
        for key in sorted(flat_first.keys() | flat_second.keys())
        if differs(key)
    }


# Model keys that only regularise training: a fine-tuned model (train.init_from) may change them.
REGULARISATION_KEYS = (
    "model.dropout",
    "model.attention_dropout",
    "model.activation_dropout",
    "model.encoder_layerdrop",
    "model.decoder_layerdrop",
    "model.target_word_dropout",
)


def _unread_by_both(first: Config, second: Config) -> set[str]:
    """The tokenizer keys that neither config reads (TokenizerConfig.unread), and where a vocabulary
    lies: differences that change nothing a run trains."""
    unread = set(first.tokenizer.unread) & set(second.tokenizer.unread)
    return {f"tokenizer.{key}" for key in unread} | set(VOCABULARY_LOCATIONS)


def architecture_differences(first: Config, second: Config) -> list[str]:
    """The model and tokenizer keys whose values differ, but for REGULARISATION_KEYS: what a model
    fine-tuned from another (train.init_from) must keep of it to take its weights and vocabulary."""
    ignored = {*REGULARISATION_KEYS, *_unread_by_both(first, second)}
    return [
        key
        for key in config_differences(first, second)
        if key.startswith(("model.", "tokenizer.")) and key not in ignored
    ]


def run_defining_differences(first: Config, second: Config, *, text_compared: bool = False) -> list[str]:
    """The run-defining keys whose values differ. With `text_compared` (the training text's digests are
    compared instead, checkpoint.train_data), a training corpus's own keys may differ but for its
    weight, which the text does not show: a corpus that moved, or the same pairs in another format."""
    ignored = _unread_by_both(first, second)
    return [
        key
        for key in config_differences(first, second)
        if any(key == prefix or key.startswith((prefix + ".", prefix + "[")) for prefix in RUN_DEFINING_KEYS)
        and key not in ignored
        and not (text_compared and key.startswith(("data.train.", "data.extra_train[")) and not key.endswith(".weight"))
    ]


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaf keys, dotted; the sections in a list (data.extra_train) by their index, data.extra_train[0].src,
    and an empty list as a leaf (config_differences leaves it out where the other config has sections)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        elif isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            for index, item in enumerate(value):
                flat.update(_flatten(item, f"{prefix}{key}[{index}]."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat

"""The configuration's schema: one frozen dataclass per YAML section, each with its defaults and
the checks between its values (`problems`); the decode section is decoding.py's. Which keys define
a run (a resumed run must keep them). Reading and validating a file is config_files.py's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from seq2seq.decoding import DecodeConfig


@dataclass(frozen=True)
class CorpusConfig:
    """Where one split of parallel data comes from."""

    format: Literal["text", "tsv", "jsonl", "hf"] = "text"
    src: str | None = None  # text: the source-side file (one sentence per line, optionally .gz)
    tgt: str | None = None  # text: the target-side file
    path: str | None = None  # tsv/jsonl: the file; hf: a save_to_disk folder or data file(s)
    src_field: str = "src"  # jsonl/hf flat columns: the source field
    tgt_field: str = "tgt"  # jsonl/hf flat columns: the target field
    name: str | None = None  # hf: a hub dataset name, e.g. wmt14
    subset: str | None = None  # hf: the dataset's config name, e.g. de-en
    split: str | None = None  # hf: which split; data.train reads 'train' if unset, valid and test must name theirs

    def problems(self) -> list[tuple[str, str]]:
        if self.format == "text" and not (self.src and self.tgt):
            return [("src", "format 'text' needs both 'src' and 'tgt' files")]
        if self.format in ("tsv", "jsonl") and not self.path:
            return [("path", f"format '{self.format}' needs 'path'")]
        if self.format == "hf" and not (self.name or self.path):
            return [("name", "format 'hf' needs a hub 'name' or a local 'path'")]
        return []

    def files(self) -> dict[str, str]:
        """The local files this corpus reads, by config key (for existence checks)."""
        keys = ("src", "tgt") if self.format == "text" else ("path",)
        return {key: getattr(self, key) for key in keys if getattr(self, key)}


@dataclass(frozen=True)
class DataConfig:
    train: CorpusConfig
    valid: CorpusConfig
    test: CorpusConfig | None = None
    src_lang: str = "src"
    tgt_lang: str = "tgt"
    max_length: int = 256  # drop training pairs longer than this many tokens on either side
    max_length_ratio: float = 0.0  # drop pairs whose length ratio exceeds this; 0 disables
    cache_dir: str = ".cache/seq2seq"  # encoded training data is kept here for later runs; "" disables
    # subword regularisation (Kudo 2018; BPE-dropout, Provilkov et al. 2020): the training split encoded
    # `subword_variants` times with SentencePiece sampling, one segmentation per epoch, in turn
    subword_alpha: float = 0.0  # 0 = off; unigram: the smoothing alpha (e.g. 0.1); bpe: the dropout rate
    subword_nbest: int = 64  # unigram: sample among the n best segmentations (-1 = all: far more pieces)
    subword_variants: int = 8  # segmentations encoded (and cached) once, reused in turn by the epochs

    def problems(self) -> list[tuple[str, str]]:
        found = []
        if self.max_length < 1:
            found.append(("max_length", "expected an integer >= 1"))
        if not 0.0 <= self.subword_alpha < 1.0:
            found.append(("subword_alpha", "expected a number in [0, 1) (0 = no subword sampling)"))
        if self.subword_nbest == 0 or self.subword_nbest < -1:
            found.append(("subword_nbest", "expected -1 (every segmentation) or an integer >= 1"))
        if self.subword_variants < 1:
            found.append(("subword_variants", "expected an integer >= 1"))
        if self.max_length_ratio < 0:
            found.append(("max_length_ratio", "expected a number >= 0 (0 disables the filter)"))
        return found


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = 8000
    model_type: Literal["unigram", "bpe"] = "unigram"
    joint: bool = True  # one vocabulary for both languages (needed to share embeddings)
    character_coverage: float = 1.0
    sample_sentences: int = 1_000_000  # train on at most this many randomly sampled sentences
    user_defined_symbols: tuple[str, ...] = ()

    def problems(self) -> list[tuple[str, str]]:
        found = []
        if self.vocab_size < 8:
            found.append(("vocab_size", "expected an integer >= 8"))
        if not 0.9 <= self.character_coverage <= 1.0:
            found.append(("character_coverage", "expected a number in [0.9, 1.0]"))
        if self.sample_sentences < 1:
            found.append(("sample_sentences", "expected an integer >= 1"))
        return found


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 512
    heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    ffn_dim: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.0  # on attention probabilities
    activation_dropout: float = 0.0  # inside the feed-forward block, after the activation
    encoder_layerdrop: float = 0.0  # training skips each encoder layer with this probability (LayerDrop)
    decoder_layerdrop: float = 0.0  # the same for decoder layers (Araabi & Monz 2020: pays on small data)
    target_word_dropout: float = 0.0  # training zeroes a target input word's embedding with this probability
    activation: Literal["relu", "gelu"] = "relu"
    norm: Literal["post", "pre"] = "post"  # post = the paper; pre = stabler for deep models
    share_embeddings: bool = True  # source, target and output embeddings are one matrix (joint vocab)
    tie_output: bool = True  # the output projection reuses the target embedding matrix

    def problems(self) -> list[tuple[str, str]]:
        found = []
        for key in ("d_model", "heads", "encoder_layers", "decoder_layers", "ffn_dim"):
            if getattr(self, key) < 1:
                found.append((key, "expected an integer >= 1"))
        if self.heads >= 1 and self.d_model % self.heads:
            found.append(("d_model", f"expected a multiple of heads ({self.heads}), got {self.d_model}"))
        elif self.d_model % 2:
            found.append(("d_model", f"expected an even number (sin/cos position pairs), got {self.d_model}"))
        for key in (
            "dropout",
            "attention_dropout",
            "activation_dropout",
            "encoder_layerdrop",
            "decoder_layerdrop",
            "target_word_dropout",
        ):
            if not 0.0 <= getattr(self, key) < 1.0:
                found.append((key, "expected a number in [0, 1)"))
        return found


@dataclass(frozen=True)
class TrainConfig:
    max_tokens: int = 4096  # target tokens per batch (token-bucketed batches)
    max_steps: int = 100_000
    max_epochs: int = 0  # 0 = no epoch limit
    max_time: float = 0.0  # stop after this many seconds of training; 0 = no limit
    accum_steps: int = 1  # batches per update: the effective batch is max_tokens * accum_steps
    lr: float = 5e-4  # peak learning rate
    schedule: Literal["inverse_sqrt", "noam", "linear", "cosine", "constant", "wsd"] = "inverse_sqrt"
    warmup_steps: int = 4000
    warmup_fraction: float = 0.0  # > 0: warm up over this share of the budget instead (linear, cosine, constant, wsd)
    min_lr: float = 0.0  # the floor linear, cosine and wsd reach when the budget is spent
    cooldown_fraction: float = 0.2  # wsd: the share at the end of the budget over which the rate decays
    cooldown_shape: Literal["linear", "sqrt"] = "sqrt"  # wsd: lr x (1 - p), or x (1 - sqrt(p)), p through the cooldown
    ema_decay: float = 0.0  # > 0: keep an exponential moving average of the weights (weight_average.py)
    optimizer: Literal["adam", "adamw"] = "adam"
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 1.0  # 0 disables clipping
    label_smoothing: float = 0.1
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: what the hardware runs natively (precision.py)
    seed: int = 1
    threads: int = 0  # torch intra-op threads; 0 keeps torch's default
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: the GPU when torch sees one (torchrun: one per rank)
    log_every: int = 100
    valid_every: int = 1000
    valid_max_sentences: int = 500  # BLEU on at most this many validation sentences
    valid_beam: int = 1  # beam size for validation BLEU (1 = greedy, fastest)
    patience: int = 0  # stop after this many validations without a better BLEU; 0 disables
    compile: bool = False  # wrap the model in torch.compile
    save_every: int = 1000
    keep_last: int = 5
    average_last: int = 0  # >= 2: when the run stops, average its last N saves into averaged.pt (best.pt if better)

    def problems(self) -> list[tuple[str, str]]:
        found = []
        for key in (
            "max_tokens",
            "max_steps",
            "accum_steps",
            "log_every",
            "valid_every",
            "save_every",
            "keep_last",
            "valid_max_sentences",
            "valid_beam",
        ):
            if getattr(self, key) < 1:
                found.append((key, "expected an integer >= 1"))
        for key in ("max_epochs", "max_time", "warmup_steps", "weight_decay", "clip_norm", "threads", "patience"):
            if getattr(self, key) < 0:
                found.append((key, "expected a number >= 0"))
        if self.lr <= 0:
            found.append(("lr", "expected a number > 0"))
        if self.schedule == "noam" and self.warmup_steps == 0:
            found.append(("warmup_steps", "schedule 'noam' needs warmup_steps >= 1"))
        if self.average_last == 1 or self.average_last < 0 or self.average_last > self.keep_last:
            found.append(("average_last", f"expected 0 (off) or an integer in [2, keep_last ({self.keep_last})]"))
        if not 0.0 < self.cooldown_fraction <= 1.0:
            found.append(("cooldown_fraction", "expected a number in (0, 1]"))
        elif self.schedule == "wsd" and self.warmup_fraction + self.cooldown_fraction > 1.0:
            found.append(
                (
                    "cooldown_fraction",
                    f"expected at most 1 - warmup_fraction ({1 - self.warmup_fraction:g}): "
                    "the warmup and the cooldown share one budget",
                )
            )
        if not 0.0 <= self.warmup_fraction < 1.0:
            found.append(("warmup_fraction", "expected a number in [0, 1)"))
        elif self.warmup_fraction and self.schedule in ("noam", "inverse_sqrt"):
            found.append(
                (
                    "warmup_fraction",
                    f"schedule '{self.schedule}' warms up over warmup_steps; "
                    "warmup_fraction needs linear, cosine, constant or wsd",
                )
            )
        if not 0.0 <= self.ema_decay < 1.0:
            found.append(("ema_decay", "expected a number in [0, 1), e.g. 0.999 (0 = no weight average)"))
        if not 0.0 <= self.min_lr <= self.lr:
            found.append(("min_lr", f"expected a number in [0, lr ({self.lr:g})]"))
        if not 0.0 <= self.label_smoothing < 1.0:
            found.append(("label_smoothing", "expected a number in [0, 1)"))
        if not all(0.0 <= b < 1.0 for b in self.betas):
            found.append(("betas", "expected two numbers in [0, 1)"))
        return found


@dataclass(frozen=True)
class Config:
    data: DataConfig
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def problems(self) -> list[tuple[str, str]]:
        if self.model.share_embeddings and not self.tokenizer.joint:
            return [("model.share_embeddings", "needs tokenizer.joint: true (one vocabulary)")]
        return []

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-ready data (tuples become lists) for the run directory and checkpoints."""
        return _plain(dataclasses.asdict(self))


# What a run trains: a resumed run must keep these keys, and only checkpoints that agree on them can
# be averaged. Everything else (stop rules, logging, validation, decoding, the learning rate) may change.
RUN_DEFINING_KEYS = (
    "data.train",
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


def config_differences(first: Config, second: Config) -> dict[str, tuple[Any, Any]]:
    """Dotted key -> (first value, second value) for every leaf key whose values differ."""
    flat_first, flat_second = _flatten(first.to_dict()), _flatten(second.to_dict())
    return {
        key: (flat_first.get(key), flat_second.get(key))
        for key in sorted(flat_first.keys() | flat_second.keys())
        if flat_first.get(key) != flat_second.get(key)
    }


def is_run_defining(key: str) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in RUN_DEFINING_KEYS)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value

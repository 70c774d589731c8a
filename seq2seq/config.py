"""The configuration's schema: one frozen dataclass per YAML section, each with its defaults and
the checks between its values (`problems`); the decode section is decoding.py's. Reading and
validating a file is config_files.py's; which differences between two configs matter, config_changes.py's.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from seq2seq.decoding import SEED_LIMIT, DecodeConfig
from seq2seq.schema import Bound, setting


@dataclass(frozen=True)
class CorpusConfig:
    """Where one split of parallel data comes from."""

    format: Literal["text", "tsv", "jsonl", "hf"] = setting(
        "text",
        "text: two parallel files; tsv: source<TAB>target lines; jsonl: one object per line; hf: a "
        "HuggingFace dataset (hub or local)",
    )
    src: str | None = setting(None, "text: the source-side file, one sentence per line (optionally .gz)", path=True)
    tgt: str | None = setting(None, "text: the target-side file", path=True)
    path: str | None = setting(
        None, "tsv/jsonl: the file; hf: a save_to_disk folder or a parquet/arrow/json/csv file", path=True
    )
    src_field: str = setting("src", "jsonl, hf with flat columns: the source field")
    tgt_field: str = setting("tgt", "jsonl, hf with flat columns: the target field")
    name: str | None = setting(None, "hf: a hub dataset name, e.g. wmt14")
    subset: str | None = setting(None, "hf: the dataset's config name, e.g. de-en")
    split: str | None = setting(
        None,
        "hf: which split; training corpora read 'train' if unset, valid and test must name theirs (e.g. validation)",
    )
    weight: float = setting(
        1.0,
        "training corpora: how many times an epoch shows each pair (2: twice; 0.5: a random half, another each epoch)",
        Bound(0.0, low_open=True),
    )
    tag: str = setting(
        "",
        "training corpora: a token put before every source sentence (e.g. `<bt>` for back-translations); "
        "also list it in tokenizer.user_defined_symbols",
    )

    def problems(self) -> list[tuple[str, str]]:
        if self.tag and not self.tag_is_one_token:
            return [("tag", f"expected one token without spaces, got {self.tag!r}")]
        if self.format == "text" and not (self.src and self.tgt):
            return [("src", "format 'text' needs both 'src' and 'tgt' files")]
        if self.format in ("tsv", "jsonl") and not self.path:
            return [("path", f"format '{self.format}' needs 'path'")]
        if self.format == "hf" and not (self.name or self.path):
            return [("name", "format 'hf' needs a hub 'name' or a local 'path'")]
        return []

    @property
    def tag_is_one_token(self) -> bool:
        return len(self.tag.split()) == 1

    def files(self) -> dict[str, str]:
        """The local files this corpus reads, by config key (for existence checks)."""
        keys = ("src", "tgt") if self.format == "text" else ("path",)
        return {key: getattr(self, key) for key in keys if getattr(self, key)}


@dataclass(frozen=True)
class DataConfig:
    train: CorpusConfig = setting(help="the training corpus (a corpus section, required)")
    valid: CorpusConfig = setting(help="the validation corpus (required)")
    test: CorpusConfig | None = setting(None, "a test corpus, for `seq2seq demo` and the benchmarks")
    extra_train: tuple[CorpusConfig, ...] = setting(
        (), "more training corpora (a list of corpus sections), mixed with data.train by their weights"
    )
    src_lang: str = setting("src", "the source language code; selects a language of an HF translation column")
    tgt_lang: str = setting("tgt", "the target language code")
    max_length: int = setting(256, "drop training pairs longer than this many tokens on either side", Bound(1))
    max_length_ratio: float = setting(
        0.0, "drop training pairs whose token-length ratio exceeds this (0: off)", Bound(0.0)
    )
    cache_dir: str = setting(
        ".cache/seq2seq",
        "encoded training ids are kept here for later and resumed runs, keyed by the data files (or "
        'their text, once moved or converted), the tokenizer and the filters; "" disables',
        path=True,
    )
    # subword regularisation (Kudo 2018; BPE-dropout, Provilkov et al. 2020): the training split encoded
    # `subword_variants` times with SentencePiece sampling, one segmentation per epoch, in turn
    subword_alpha: float = setting(
        0.0,
        "subword regularisation: > 0 samples segmentations of the training split "
        "(unigram: the smoothing alpha, 0.1-0.3; bpe: the dropout rate)",
        Bound(0.0, 1.0, high_open=True),
    )
    subword_nbest: int = setting(64, "unigram sampling among the n best segmentations (-1: all, far more pieces)")
    subword_variants: int = setting(8, "sampled segmentations encoded once and used in turn by the epochs", Bound(1))

    def problems(self) -> list[tuple[str, str]]:
        if self.subword_nbest == 0 or self.subword_nbest < -1:
            return [("subword_nbest", "expected -1 (every segmentation) or an integer >= 1")]
        return [
            (f"data.{split}.{key}", "only training corpora (data.train, data.extra_train) have one")
            for split in ("valid", "test")
            if (corpus := getattr(self, split)) is not None
            for key, unset in (("weight", 1.0), ("tag", ""))
            if getattr(corpus, key) != unset
        ]

    def training_corpora(self) -> list[tuple[str, CorpusConfig]]:
        """(config key, corpus) of every training corpus, data.train first: the order they are read in."""
        return [("data.train", self.train)] + [
            (f"data.extra_train[{index}]", corpus) for index, corpus in enumerate(self.extra_train)
        ]


@dataclass(frozen=True)
class TokenizerConfig:
    vocab_size: int = setting(8000, "SentencePiece pieces (a small corpus may yield fewer)", Bound(8))
    model_type: Literal["unigram", "bpe"] = setting("unigram", "the SentencePiece model")
    joint: bool = setting(True, "one vocabulary for both languages (needed by model.share_embeddings)")
    character_coverage: float = setting(
        1.0, "share of characters the vocabulary covers (0.9995 suits CJK)", Bound(0.9, 1.0)
    )
    sample_sentences: int = setting(1_000_000, "train on at most this many randomly sampled sentences", Bound(1))
    user_defined_symbols: tuple[str, ...] = setting((), "pieces never split (e.g. tags)")
    model_files: tuple[str, ...] = setting(
        (),
        "existing SentencePiece models used instead of training one: one file (joint) or two (source, "
        "target; joint: false); vocab_size, model_type, character_coverage and sample_sentences are then "
        "the files' own",
        path=True,
    )

    @property
    def unread(self) -> tuple[str, ...]:
        """The settings that make no difference: with model_files, those of a training (the files'
        own); they may change between a run and its resume."""
        return ("vocab_size", "model_type", "character_coverage", "sample_sentences") if self.model_files else ()

    def problems(self) -> list[tuple[str, str]]:
        count = len(self.model_files)
        if count > 2:
            return [("model_files", f"expected one file (joint) or two (source, target), got {count}")]
        if count == 2 and self.joint:
            return [("model_files", "two files are a source and a target vocabulary; expected joint: false")]
        if count == 1 and not self.joint:
            return [("model_files", "one file is a joint vocabulary; expected joint: true, or two files")]
        return []


RATE = Bound(0.0, 1.0, high_open=True)  # a probability that must leave something


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = setting(512, "model width (even, a multiple of heads)", Bound(1))
    heads: int = setting(8, "attention heads", Bound(1))
    encoder_layers: int = setting(6, "encoder depth", Bound(1))
    decoder_layers: int = setting(6, "decoder depth", Bound(1))
    ffn_dim: int = setting(2048, "inner size of the position-wise feed-forward block", Bound(1))
    dropout: float = setting(0.1, "on embeddings and residual branches", RATE)
    attention_dropout: float = setting(0.0, "on attention probabilities", RATE)
    activation_dropout: float = setting(0.0, "inside the feed-forward block, after the activation", RATE)
    encoder_layerdrop: float = setting(0.0, "training skips each encoder layer with this probability (LayerDrop)", RATE)
    decoder_layerdrop: float = setting(
        0.0, "the same for decoder layers (Araabi & Monz 2020: pays on small data)", RATE
    )
    target_word_dropout: float = setting(
        0.0, "training zeroes a target input word's embedding with this probability (its position stays)", RATE
    )
    activation: Literal["relu", "gelu"] = setting("relu", "the feed-forward activation")
    norm: Literal["post", "pre"] = setting(
        "post",
        "post: LayerNorm after each residual (the paper); pre: before "
        "(stabler for deep models; a final LayerNorm per stack)",
    )
    share_embeddings: bool = setting(
        True, "source, target and output embeddings are one matrix (needs tokenizer.joint)"
    )
    tie_output: bool = setting(True, "the output projection reuses the target embedding matrix")

    def problems(self) -> list[tuple[str, str]]:
        if self.d_model % self.heads:
            return [("d_model", f"expected a multiple of heads ({self.heads}), got {self.d_model}")]
        if self.d_model % 2:
            return [("d_model", f"expected an even number (sin/cos position pairs), got {self.d_model}")]
        return []


AT_LEAST_ONE, NOT_NEGATIVE = Bound(1), Bound(0)


@dataclass(frozen=True)
class TrainConfig:
    max_tokens: int = setting(4096, "padded tokens per batch, cut from length-sorted sentences", AT_LEAST_ONE)
    max_steps: int = setting(100_000, "stop after this many updates", AT_LEAST_ONE)
    max_epochs: int = setting(0, "stop after this many epochs (0: no limit)", NOT_NEGATIVE)
    max_time: float = setting(
        0.0, "stop after this many seconds of training (0: no limit); under DDP on rank 0's clock", NOT_NEGATIVE
    )
    accum_steps: int = setting(1, "batches per update: the effective batch is max_tokens x accum_steps", AT_LEAST_ONE)
    lr: float = setting(5e-4, "peak learning rate (noam: its scale factor)", Bound(0.0, low_open=True))
    schedule: Literal["inverse_sqrt", "noam", "linear", "cosine", "constant", "wsd"] = setting(
        "inverse_sqrt",
        "inverse_sqrt (fairseq), noam (the paper), linear / cosine (decay to min_lr when the "
        "budget is spent), constant, wsd (the peak, then a cooldown over the budget's last cooldown_fraction)",
    )
    warmup_steps: int = setting(4000, "warmup length in updates", NOT_NEGATIVE)
    warmup_fraction: float = setting(
        0.0,
        "> 0: warm up over this share of the budget instead (linear, cosine, constant, wsd)",
        Bound(0.0, 1.0, high_open=True),
    )
    min_lr: float = setting(0.0, "the floor linear, cosine and wsd reach when the budget is spent")
    cooldown_fraction: float = setting(
        0.2, "wsd: the share at the end of the budget over which the rate decays", Bound(0.0, 1.0, low_open=True)
    )
    cooldown_shape: Literal["linear", "sqrt"] = setting(
        "sqrt", "wsd: lr x (1 - p) or x (1 - sqrt(p)), p going from 0 to 1 through the cooldown"
    )
    ema_decay: float = setting(
        0.0,
        "> 0 (e.g. 0.999): keep an exponential moving average of the weights; best.pt holds whichever validates better",
        RATE,
    )
    dropout_from_epoch: int = setting(
        1,
        "late dropout (Liu et al. 2023): model.dropout is off before this epoch and on from it, so that a "
        "short run that sees the corpus a few times is not slowed by it (1: on from the start)",
        AT_LEAST_ONE,
    )
    optimizer: Literal["adam", "adamw"] = setting("adam", "the optimizer")
    betas: tuple[float, float] = setting((0.9, 0.98), "the optimizer's betas")
    eps: float = setting(1e-9, "the optimizer's epsilon", NOT_NEGATIVE)
    weight_decay: float = setting(0.0, "the optimizer's weight decay", NOT_NEGATIVE)
    clip_norm: float = setting(1.0, "clip gradients to this global norm (0: off)", NOT_NEGATIVE)
    label_smoothing: float = setting(0.1, "label-smoothed cross entropy", RATE)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = setting(
        "auto",
        "auto: bf16 where the hardware runs it natively, fp16 on an older GPU, fp32 otherwise (decided once, "
        "logged, kept on resume); or fp32, bf16, fp16 (CUDA only)",
    )
    seed: int = setting(1, "seeds parameter init, dropout and the batch order", Bound(0, SEED_LIMIT, high_open=True))
    init_from: str | None = setting(
        None,
        "fine-tuning: a checkpoint (.pt) or run directory whose weights and tokenizer a new run starts from; "
        "the optimizer, schedule and step count start afresh (the model and tokenizer sections must match "
        "its own, but for dropout rates)",
        path=True,
    )
    threads: int = setting(0, "torch CPU threads (0: torch's default)", NOT_NEGATIVE)
    device: Literal["auto", "cpu", "cuda"] = setting(
        "auto", "auto: the GPU when torch sees one (torchrun: each rank its local rank's), else the CPU"
    )
    log_every: int = setting(100, "updates between log lines (metrics.jsonl and the progress bar)", AT_LEAST_ONE)
    valid_every: int = setting(1000, "updates between validations", AT_LEAST_ONE)
    valid_max_sentences: int = setting(500, "validation BLEU on at most this many sentences", AT_LEAST_ONE)
    valid_beam: int = setting(1, "beam size of validation BLEU (1: greedy, fastest)", AT_LEAST_ONE)
    patience: int = setting(
        0, "stop after this many validations without a better train.best_metric (0: off)", NOT_NEGATIVE
    )
    best_metric: Literal["bleu", "chrf", "loss"] = setting(
        "bleu",
        "the validation score that picks best.pt (of the trained weights, the ema and the average_last "
        "average) and that patience waits for: bleu or chrf (higher is better), or loss (lower)",
    )
    compile: bool = setting(False, "wrap the model in torch.compile (pays on GPUs, not on CPUs)")
    save_every: int = setting(1000, "updates between checkpoints", AT_LEAST_ONE)
    keep_last: int = setting(5, "numbered checkpoints kept (besides last.pt and best.pt)", AT_LEAST_ONE)
    average_last: int = setting(
        0,
        ">= 2: when the run stops, average its last N saves into averaged.pt, which "
        "becomes best.pt where it validates better (at most keep_last)",
        NOT_NEGATIVE,
    )

    def problems(self) -> list[tuple[str, str]]:
        found = []
        if self.schedule == "noam" and self.warmup_steps == 0:
            found.append(("warmup_steps", "schedule 'noam' needs warmup_steps >= 1"))
        if self.average_last == 1 or self.average_last > self.keep_last:
            found.append(("average_last", f"expected 0 (off) or an integer in [2, keep_last ({self.keep_last})]"))
        if self.schedule == "wsd" and self.warmup_fraction + self.cooldown_fraction > 1.0:
            found.append(
                (
                    "cooldown_fraction",
                    f"expected at most 1 - warmup_fraction ({1 - self.warmup_fraction:g}): "
                    "the warmup and the cooldown share one budget",
                )
            )
        if self.warmup_fraction and self.schedule in ("noam", "inverse_sqrt"):
            found.append(
                (
                    "warmup_fraction",
                    f"schedule '{self.schedule}' warms up over warmup_steps; "
                    "warmup_fraction needs linear, cosine, constant or wsd",
                )
            )
        if not 0.0 <= self.min_lr <= self.lr:
            found.append(("min_lr", f"expected a number in [0, lr ({self.lr:g})]"))
        if not all(0.0 <= b < 1.0 for b in self.betas):
            found.append(("betas", "expected two numbers in [0, 1)"))
        return found


# A shortlist's size, `seq2seq shortlist` and distill alike: on the Bible student (8k vocabulary),
# 20 target pieces per source piece ran faster than 30 or 50 and changed BLEU least (the ledger's
# benchmark_shortlist entries); Marian's students keep 50 of a 32k vocabulary.
SHORTLIST_PER_SOURCE, SHORTLIST_FREQUENT = 20, 100
Quantization = Literal["float32", "int8", "int8_float32", "int16", "float16", "bfloat16"]  # CTranslate2's
QUANTIZATIONS: tuple[str, ...] = typing.get_args(Quantization)


@dataclass(frozen=True)
class DistillConfig:
    """Sequence-level knowledge distillation (Kim & Rush 2016), `seq2seq distill`: the teacher
    translates the training sources, the student (this config's tokenizer, model and train
    sections) learns from its outputs, and ships small: a shortlist, a quantized export."""

    teacher: tuple[str, ...] = setting((), "the teacher: a list of checkpoints (.pt or run directories; several "
                                           "translate as an ensemble), or one exported directory",
                                           path=True)  # fmt: skip
    beam: int = setting(5, "the teacher's beam", AT_LEAST_ONE)
    nbest: int = setting(1, "targets per source: the teacher's n best (or n draws), each a training pair", AT_LEAST_ONE)
    sample: bool = setting(False, "targets drawn from the teacher (its decode section's top_k/top_p) instead of beam")
    originals: bool = setting(False, "also train on the corpus's own targets, beside the teacher's")
    chunk_lines: int = setting(2000, "source lines translated between saves: a kill loses one chunk", AT_LEAST_ONE)
    shortlist: bool = setting(True, "build a lexical shortlist for the student and ship it with the export")
    shortlist_per_source: int = setting(
        SHORTLIST_PER_SOURCE, "shortlist: target pieces kept per source piece", AT_LEAST_ONE
    )
    shortlist_frequent: int = setting(
        SHORTLIST_FREQUENT, "shortlist: the most frequent target pieces, always allowed", NOT_NEGATIVE
    )
    quantization: Quantization = setting("int8", "how the student is exported (CTranslate2)")
    max_bleu_drop: float = setting(1.0, "the export gate: BLEU a quantized student may lose to its checkpoint",
                                   NOT_NEGATIVE)  # fmt: skip

    def problems(self) -> list[tuple[str, str]]:
        if not self.teacher:
            return [("teacher", "expected a list of one or more checkpoints (.pt files or run directories)")]
        return []


@dataclass(frozen=True)
class Config:
    data: DataConfig = setting(help="where the parallel text comes from")
    tokenizer: TokenizerConfig = setting(factory=TokenizerConfig, help="the SentencePiece model(s)")
    model: ModelConfig = setting(factory=ModelConfig, help="the Transformer's shape")
    train: TrainConfig = setting(factory=TrainConfig, help="how it trains")
    decode: DecodeConfig = setting(factory=DecodeConfig, help="how it translates (the model's defaults)")
    distill: DistillConfig | None = setting(None, "a student distilled from a teacher (`seq2seq distill`)")

    def problems(self) -> list[tuple[str, str]]:
        if self.model.share_embeddings and not self.tokenizer.joint:
            return [("model.share_embeddings", "needs tokenizer.joint: true (one vocabulary)")]
        return [
            (
                f"{key}.tag",
                f"{corpus.tag!r} is not in tokenizer.user_defined_symbols, so the tokenizer would cut it "
                "into pieces; add it there",
            )
            for key, corpus in self.data.training_corpora()
            if corpus.tag and corpus.tag_is_one_token and corpus.tag not in self.tokenizer.user_defined_symbols
        ]  # a tag of several words is its own section's problem

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-ready data (tuples become lists) for the run directory and checkpoints."""
        return _plain(dataclasses.asdict(self))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value

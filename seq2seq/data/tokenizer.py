"""SentencePiece training and a small Tokenizer wrapper (ids in, ids out, text back).

Every model is trained with the special ids of special_tokens.py (pad=0, unk=1, bos=2, eos=3), so
the rest of the code can rely on them. Training here also decides when a saved tokenizer is reused.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import logging
import os
import random
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

import sentencepiece as spm

from seq2seq.config import TokenizerConfig
from seq2seq.data.sentencepiece_files import read_model_files
from seq2seq.data.special_tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID
from seq2seq.errors import UserInputError
from seq2seq.files import atomic_write, content_digest, write_text_atomic

T = TypeVar("T")
log = logging.getLogger(__name__)

TRAINED_ON = "trained_on.json"  # the settings and data identity a saved tokenizer was trained with


@dataclasses.dataclass(frozen=True)
class SubwordSampling:
    """SentencePiece's sampled segmentation (subword regularisation): `alpha` smooths the unigram
    model's distribution over segmentations (BPE: the probability of dropping a merge); `nbest`
    limits a unigram draw to the n best segmentations (-1: all of them)."""

    alpha: float
    nbest: int = 64

    def seed(self, seed: int) -> None:
        """Seed SentencePiece's generator (process-wide): the draws that follow repeat under a seed,
        as long as they run on one thread (_encode_options)."""
        spm.set_random_generator_seed(seed)


def _encode_options(sampling: SubwordSampling | None) -> dict:
    if sampling is None:
        return {"num_threads": _threads()}
    return {"enable_sampling": True, "alpha": sampling.alpha, "nbest_size": sampling.nbest, "num_threads": 1}


class Tokenizer:
    """Source and target SentencePiece models (the same object when the vocabulary is joint)."""

    def __init__(self, src_proto: bytes, tgt_proto: bytes | None = None) -> None:
        self.src_model = spm.SentencePieceProcessor(model_proto=src_proto)
        self.tgt_model = self.src_model if tgt_proto is None else spm.SentencePieceProcessor(model_proto=tgt_proto)

    @property
    def joint(self) -> bool:
        return self.src_model is self.tgt_model

    @property
    def src_vocab_size(self) -> int:
        return self.src_model.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt_model.get_piece_size()

    def encode_src(self, lines: list[str], sampling: SubwordSampling | None = None) -> list[list[int]]:
        """Source ids end with EOS (the encoder sees where the sentence stops)."""
        return self.src_model.encode(lines, out_type=int, add_eos=True, **_encode_options(sampling))

    def encode_tgt(self, lines: list[str], sampling: SubwordSampling | None = None) -> list[list[int]]:
        """Target ids without BOS/EOS; `Batch` adds them for teacher forcing."""
        return self.tgt_model.encode(lines, out_type=int, **_encode_options(sampling))

    def decode_tgt(self, ids: list[int]) -> str:
        """Text of output ids: PAD, BOS and EOS dropped, an unknown token shown as SentencePiece shows
        it (⁇), as the CTranslate2 engine shows it: a reader sees that something was not known."""
        return self.tgt_model.decode([i for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)])

    @functools.cached_property
    def tgt_word_continuations(self) -> frozenset[int]:
        """The target pieces that continue a word: those without SentencePiece's word-start mark ▁
        (special pieces excluded); read once from the vocabulary."""
        model = self.tgt_model
        return frozenset(
            i
            for i in range(model.get_piece_size())
            if not model.id_to_piece(i).startswith("\u2581") and not model.is_control(i) and not model.is_unknown(i)
        )

    def src_pieces(self, line: str) -> list[str]:
        return self.src_model.encode(line, out_type=str, add_eos=True)

    def tgt_pieces(self, ids: list[int]) -> list[str]:
        return [self.tgt_model.id_to_piece(i) for i in ids]

    def protos(self) -> dict[str, bytes]:
        """The serialized models, for checkpoints and the run directory."""
        if self.joint:
            return {"joint": self.src_model.serialized_model_proto()}
        return {"src": self.src_model.serialized_model_proto(), "tgt": self.tgt_model.serialized_model_proto()}

    @classmethod
    def from_protos(cls, protos: dict[str, bytes]) -> Tokenizer:
        if "joint" in protos:
            return cls(protos["joint"])
        return cls(protos["src"], protos["tgt"])

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, proto in self.protos().items():
            with atomic_write(directory / f"{name}.model") as handle:
                handle.write(proto)

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        directory = Path(directory)
        names = ("joint",) if (directory / "joint.model").exists() else ("src", "tgt")
        missing = [n for n in names if not (directory / f"{n}.model").exists()]
        if missing:
            raise UserInputError(f"{directory}: no tokenizer found (expected joint.model, or src.model and tgt.model)")
        return cls.from_protos({n: (directory / f"{n}.model").read_bytes() for n in names})


def saved_tokenizer_exists(directory: str | Path) -> bool:
    return Path(directory).is_dir() and any(Path(directory).glob("*.model"))


def load_or_train_tokenizer(
    directory: str | Path,
    config: TokenizerConfig,
    pairs: Iterable[tuple[str, str]],
    *,
    seed: int,
    data_identity: dict | None = None,
    data_name: str = "the training data",
) -> Tokenizer:
    """Reuse the tokenizer saved in `directory` if it was trained with these settings on this data
    (`data_identity`, recorded in TRAINED_ON next to it); train one on `pairs` and save it there if
    there is none. One trained otherwise is refused, never replaced: it may be what a user made with
    `seq2seq tokenizer train` (long work, on a large corpus), and training on it would be wrong.

    With `tokenizer.model_files`, those models are taken instead of training one (sentencepiece_files.py),
    and recorded by their content.

    `pairs` is consumed only when training, so a lazy stream of a large corpus costs nothing on reuse.
    A tokenizer saved before this record existed is reused as it is. `data_name` (the config key and
    files) names the data in an error.
    """
    directory = Path(directory)
    # given models are recorded by content (they may move), not by the data or seed a training would use
    if config.model_files:
        unrecorded = {*config.unread, "model_files"}
        settings = {key: value for key, value in dataclasses.asdict(config).items() if key not in unrecorded}
        trained_on = {"settings": settings, "files": [content_digest(f) for f in config.model_files]}
    else:
        trained_on = {"settings": dataclasses.asdict(config), "seed": seed, "data": data_identity}
    trained_on = json.loads(json.dumps(trained_on))  # tuples as lists, as read back from the file
    if saved_tokenizer_exists(directory):
        recorded = _read_trained_on(directory)
        if recorded is None or recorded == trained_on:
            return Tokenizer.load(directory)
        raise UserInputError(
            f"{directory}: trained on other settings ({'; '.join(_differences(recorded, trained_on))}); expected "
            f"the tokenizer this config trains: start the run in a new --run-dir, or delete {directory} to "
            "train it again"
        )
    if config.model_files:
        tokenizer = Tokenizer(*read_model_files(config))
    else:
        tokenizer = train_tokenizer(config, pairs, seed=seed, data_name=data_name)
        sizes = (tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
        # hard_vocab_limit=False: a small corpus gets the pieces it supports, which the log then says
        fewer = f" (tokenizer.vocab_size {config.vocab_size}: the training text supports no more)"
        log.info(
            "trained tokenizer: %d source / %d target pieces%s", *sizes, fewer if min(sizes) < config.vocab_size else ""
        )
    tokenizer.save(directory)
    write_text_atomic(directory / TRAINED_ON, json.dumps(trained_on, indent=1) + "\n")
    return tokenizer


def check_model_files_hold(tokenizer: Tokenizer, config: TokenizerConfig) -> None:
    """Refuse model files that are not the vocabulary of the checkpoint a run resumes or starts from:
    the run goes on with the checkpoint's, and a config naming another would say what it is not."""
    if Tokenizer(*read_model_files(config)).protos() != tokenizer.protos():
        raise UserInputError(
            f"tokenizer.model_files: {' and '.join(config.model_files)} hold another vocabulary than the "
            "checkpoint's; expected the files it was trained with (they may have moved), or a new run"
        )


def _differences(recorded: dict, wanted: dict) -> list[str]:
    """What a saved tokenizer was trained on that this run's would not be, by config key."""
    saved, settings = recorded.get("settings"), wanted["settings"]
    found = [
        f"tokenizer.{key} {saved.get(key)!r} there, {value!r} here"
        for key, value in settings.items()
        if isinstance(saved, dict) and saved.get(key) != value
    ]
    if not isinstance(saved, dict):
        found.append("its tokenizer settings")
    if recorded.get("seed") != wanted.get("seed"):
        found.append(f"train.seed {recorded.get('seed')!r} there, {wanted['seed']!r} here")
    if recorded.get("data") != wanted.get("data"):
        found.append("other training data")
    if recorded.get("files") != wanted.get("files"):
        found.append("other contents of tokenizer.model_files")
    return found


def _read_trained_on(directory: Path) -> dict | None:
    try:
        recorded = json.loads((directory / TRAINED_ON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return recorded if isinstance(recorded, dict) else None


def train_tokenizer(
    config: TokenizerConfig, pairs: Iterable[tuple[str, str]], *, seed: int = 1, data_name: str = "the training data"
) -> Tokenizer:
    """Train SentencePiece on at most `sample_sentences` random training pairs (one pass over the data)."""
    sample = _reservoir(pairs, config.sample_sentences, seed)
    if not sample:
        raise UserInputError(
            f"{data_name}: no sentence pair with text on both sides (empty files, or every line "
            "blank on one side); expected parallel text to learn a vocabulary from"
        )
    src, tgt = [s for s, _ in sample], [t for _, t in sample]
    if config.joint:
        return Tokenizer(_train_model(config, src + tgt))
    return Tokenizer(_train_model(config, src), _train_model(config, tgt))


def _train_model(config: TokenizerConfig, sentences: list[str]) -> bytes:
    proto = io.BytesIO()
    try:
        _train_sentencepiece(config, sentences, proto)
    except RuntimeError as error:  # SentencePiece's own checks: say what to change in the config
        raise UserInputError(_sentencepiece_problem(str(error), config)) from None
    return proto.getvalue()


def _train_sentencepiece(config: TokenizerConfig, sentences: list[str], proto: io.BytesIO) -> None:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=proto,
        vocab_size=config.vocab_size,
        model_type=config.model_type,
        character_coverage=config.character_coverage,
        user_defined_symbols=list(config.user_defined_symbols),
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        hard_vocab_limit=False,  # a small corpus may not support vocab_size pieces; take what it has
        num_threads=_threads(),
        minloglevel=2,
    )


def _sentencepiece_problem(message: str, config: TokenizerConfig) -> str:
    """One line in our terms for an error SentencePiece raised while training."""
    too_small = re.search(r"Vocabulary size is smaller than required_chars\. (\d+) vs (\d+)", message)
    if too_small:
        return (
            f"tokenizer.vocab_size: {config.vocab_size} is below the {too_small.group(2)} pieces that the "
            f"training text's characters and the 4 special pieces need; expected at least {too_small.group(2)}, "
            "or a lower tokenizer.character_coverage (e.g. 0.9995) to map rare characters to unknown"
        )
    reason = message.split("] ", 1)[-1].strip() or message
    return (
        f"tokenizer: SentencePiece could not train with vocab_size {config.vocab_size}, model_type "
        f"{config.model_type}, character_coverage {config.character_coverage}: {reason}"
    )


def _reservoir(items: Iterable[T], size: int, seed: int) -> list[T]:
    """A uniform random sample of at most `size` items, in one pass (Algorithm R)."""
    rng = random.Random(seed)
    sample: list[T] = []
    for index, item in enumerate(items):
        if index < size:
            sample.append(item)
        elif (slot := rng.randrange(index + 1)) < size:
            sample[slot] = item
    return sample


def _threads() -> int:
    return max(1, len(os.sched_getaffinity(0)))

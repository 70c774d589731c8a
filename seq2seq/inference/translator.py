"""The Python API for using a trained model (the commands' file handling is cli/file_translation.py).

    from seq2seq import Translator
    translator = Translator.load("runs/bible/checkpoints/best.pt")   # or an exported directory
    translator.translate(["In the beginning God created the heavens and the earth."], beam=5)

A checkpoint (a .pt file) is decoded by our PyTorch search, several checkpoints as an ensemble
(ensemble.py); a directory written by `seq2seq export` by CTranslate2. Both take the same decode
settings (the model's `decode` section, overridable per call) and return the same `Translation`
objects, so everything above (`translate`, `eval`, the parity gate) works with either. This module
imports neither torch nor ctranslate2: `load` brings in the engine the path needs.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from seq2seq.config_files import decode_config_from, decode_config_with
from seq2seq.data.sources import normalize
from seq2seq.decoding import DecodeConfig, refusals, scoring_options, unused_by_scoring
from seq2seq.errors import UserInputError
from seq2seq.inference.admission import LinePlan, Names, plan_scoring, plan_translation, unspellable
from seq2seq.inference.devices import torch_device
from seq2seq.inference.engine import EXPORT_METADATA, Engine, LinesDone, PairScore, Translation
from seq2seq.inference.glossary import Glossary, merged_constraints


class Translator:
    """A model ready to translate: its decode defaults and the engine that translates lines with settings."""

    def __init__(self, decode: DecodeConfig, engine: Engine, *, bundle: Any = None):
        self.decode = decode
        self.bundle = bundle  # PyTorch only: the model and tokenizer (attention plots need them)
        self._engine = engine

    @property
    def engine(self) -> str:
        """Which engine translates: "pytorch" or "ctranslate2"."""
        return self._engine.name

    @property
    def shortlisted(self) -> bool:
        """Whether outputs are held to a lexical shortlist (shortlist.py)."""
        return self._engine.shortlisted

    @property
    def max_positions(self) -> int | None:
        """The longest source and output (in pieces) the model places; None: any."""
        return self._engine.max_positions

    @property
    def computes_in(self) -> str:
        """The number format the model's products run in: "float32", or an export's CTranslate2 compute
        type on this device, which may differ from its quantization (export.py's parity line says so)."""
        return self._engine.computes_in

    @classmethod
    def load(
        cls, path: str | Path | list[str | Path], *, device: str | None = None, shortlist: str | Path | None = None
    ) -> Translator:
        """A checkpoint file (PyTorch) or a run directory (its best checkpoint), several as an ensemble (a
        list; the first's decode settings), or a directory from `seq2seq export` (CTranslate2).

        `shortlist`: a file from `seq2seq shortlist` that a checkpoint's outputs are held to
        (shortlist.py); an export carries its own (`seq2seq export --shortlist`)."""
        if isinstance(path, (list, tuple)):
            if not path:
                raise UserInputError(
                    "no model given; expected a checkpoint, a run directory or an export (a list: an ensemble)"
                )
            if len(path) > 1:
                return cls._load_ensemble([Path(item) for item in path], device, shortlist)
            path = path[0]
        path = Path(path)
        if (path / EXPORT_METADATA).is_file():
            if shortlist is not None:
                raise UserInputError(
                    f"{path}: an exported model carries its shortlist (seq2seq export --shortlist FILE); "
                    "--shortlist applies to checkpoints"
                )
            from seq2seq.inference.ctranslate2_engine import load_exported

            decode, engine = load_exported(path, device=device)
            return cls(decode, engine)
        from seq2seq.checkpoint import load_for_inference

        lists = _read_shortlist(shortlist)  # a bad file is named before the model loads
        bundle = load_for_inference(path, torch_device(device))
        return cls.from_model(
            bundle.model, bundle.tokenizer, bundle.config.decode, bundle=bundle, shortlist=_for(lists, bundle.tokenizer)
        )

    @classmethod
    def _load_ensemble(cls, paths: list[Path], device: str | None, shortlist: str | Path | None) -> Translator:
        from seq2seq.checkpoint import Checkpoint
        from seq2seq.inference.ensemble import Ensemble

        exported = [str(path) for path in paths if (path / EXPORT_METADATA).is_file()]
        if exported:
            raise UserInputError(
                f"{', '.join(exported)}: an ensemble needs checkpoints (.pt); CTranslate2 decodes one model"
            )
        checkpoints = [Checkpoint.load(path) for path in paths]
        for path, checkpoint in zip(paths[1:], checkpoints[1:]):  # before any model is built
            if checkpoint.tokenizer.protos() != checkpoints[0].tokenizer.protos():
                raise UserInputError(
                    f"{path}: its vocabulary differs from {paths[0]}'s; an ensemble's models must "
                    "share the source and target SentencePiece models"
                )
        lists = _for(_read_shortlist(shortlist), checkpoints[0].tokenizer)
        ensemble = Ensemble([checkpoint.build_model(torch_device(device)) for checkpoint in checkpoints])
        return cls.from_model(ensemble, checkpoints[0].tokenizer, checkpoints[0].config.decode, shortlist=lists)

    @classmethod
    def from_model(
        cls, model: Any, tokenizer: Any, decode: DecodeConfig, *, bundle: Any = None, shortlist: Any = None
    ) -> Translator:
        """Our PyTorch model in memory (validation translates with the model being trained);
        `shortlist`: shortlist.TargetLists for this tokenizer."""
        from seq2seq.inference.pytorch_engine import PyTorchEngine

        return cls(decode, PyTorchEngine(model, tokenizer, shortlist=shortlist), bundle=bundle)

    def plot_attention(self, lines: list[str], folder: Path, decode: DecodeConfig) -> list[Path]:
        """Cross-attention heatmaps (PNG, one panel per layer) of these lines' translations, written
        into `folder`: one checkpoint only (an exported model or an ensemble has no maps to give)."""
        if self.bundle is None:
            raise UserInputError("attention maps need one checkpoint (.pt), not an exported model or an ensemble")
        from seq2seq.inference.attention_plot import plot_attention  # matplotlib when asked

        return plot_attention(self.bundle.model, self.bundle.tokenizer, lines, folder, decode)

    def settings(self, overrides: Iterable[str] = (), **options: Any) -> DecodeConfig:
        """The decode defaults with `decode.KEY=VALUE` overrides, then typed keyword options (beam=5,
        nbest=2, ...); a setting this engine cannot honour (an explicit sampling seed on CTranslate2)
        is refused here, before any work."""
        overrides = list(overrides)
        decode = decode_config_with(self.decode, overrides) if overrides else self.decode
        typed = {key: value for key, value in options.items() if value is not None}
        decode = decode_config_from(decode, typed, origin="options") if typed else decode
        self.check_supported(decode, given=_given(overrides, typed))
        return decode

    def scoring_settings(self, overrides: Iterable[str] = (), **options: Any) -> DecodeConfig:
        """`settings` for scoring given pairs, which reads only the options declared for scoring
        (decoding.py); one it never reads (a beam, a temperature) is refused, not ignored: a score
        that seemed to honour it would be silently wrong."""
        overrides = list(overrides)
        decode = self.settings(overrides, **options)  # unknown keys and bad values first, as everywhere
        typed = {key for key, value in options.items() if value is not None}
        given = _given(overrides, typed)
        unused = unused_by_scoring(given)
        if unused:
            takes = ", ".join(f"decode.{name}" for name in scoring_options())
            raise UserInputError(
                "\n".join(
                    f"{'options: ' if name in typed else ''}decode.{name}: scoring given pairs does not use it "
                    f"(a score is the model's log-probability of the given target); scoring takes {takes}"
                    for name in unused
                )
            )
        return decode

    def check_supported(self, decode: DecodeConfig, *, given: Iterable[str] = (), constrained: bool = False) -> None:
        """Refuse, in one line each, what these settings ask that the engine does not do: an option it
        does not honour (declared with the option, decoding.py), or constraints without constrained search."""
        if constrained and decode.sample:
            raise UserInputError("terminology constraints need beam search; they cannot be sampled (decode.sample)")
        engine = self._engine
        refused = [
            f"decode.{option.name}: {engine.title} has no {lacking}; leave it out, or {engine.instead}"
            for option, lacking in refusals(decode, engine.name, given=set(given))
        ]
        if constrained and not engine.constrained_search:
            refused.append(f"terminology constraints: {engine.title} has no constrained search; {engine.instead}")
        if refused:
            raise UserInputError("\n".join(refused))

    def plan(
        self,
        lines: list[str],
        decode: DecodeConfig,
        *,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        names: Names = Names(),
    ) -> list[LinePlan]:
        """Each line's pieces, length limit and hypotheses (admission.py), or UserInputError naming a
        line the engine cannot translate whole, or guidance its vocabulary cannot spell."""
        return plan_translation(self._engine, lines, decode, prefixes=prefixes, constraints=constraints, names=names)

    def source_lengths(self, lines: list[str]) -> list[int]:
        """Each line's source pieces with the end of sentence the encoder reads."""
        encoded = self._engine.source_model.encode([normalize(line) for line in lines], add_eos=True)
        return [len(ids) for ids in encoded]

    def plan_scoring(self, sources: list[str], targets: list[str], *, names: Names = Names()) -> list[LinePlan]:
        return plan_scoring(self._engine, sources, targets, names=names)

    def unspellable(self, phrase: str) -> str:
        """Why the target vocabulary cannot spell `phrase` ("" if it can)."""
        return unspellable(self._engine, phrase)

    def translate(self, lines: list[str], **options: Any) -> list[str]:
        """The best translation of each line, e.g. translate(lines, beam=5); the guidance keywords of
        translate_nbest apply. An nbest other than 1 is refused: it would be dropped unseen."""
        if options.get("nbest", 1) != 1:
            raise UserInputError(
                f"options: nbest: translate() returns the best translation of each line; "
                f"translate_nbest(lines, nbest={options['nbest']!r}) returns the N best"
            )
        return [t.text for t in self.translate_nbest(lines, **{**options, "nbest": 1})]

    def translate_nbest(
        self,
        lines: list[str],
        *,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        glossary: Glossary | None = None,
        **options: Any,
    ) -> list[Translation]:
        """Up to `nbest` (text, score) pairs per line, best first; scores are length-normalised log-probabilities.

        prefixes: per line, the target text its output starts with ("" for none: interactive
        translation, continuing a post-editor's words). constraints: per line, target phrases its
        output must contain; glossary: a Glossary whose terms apply to the lines that contain their
        source term (both checkpoint only)."""
        lines = _text_list(lines, "lines")
        return self.translate_with(
            lines,
            self.settings(**options),
            prefixes=None if prefixes is None else _text_list(prefixes, "prefixes"),
            constraints=merged_constraints(lines, _nested_text_lists(constraints), glossary),
        )

    def score(self, sources: list[str], targets: list[str], **options: Any) -> list[PairScore]:
        """How likely the model finds each given target for its source (force-decoding): per-piece
        log-probabilities and their length-normalised sum, e.g. to filter noisy pairs or rerank."""
        sources, targets = _text_list(sources, "sources"), _text_list(targets, "targets")
        return self.score_with(sources, targets, self.scoring_settings(**options))

    def score_with(
        self,
        sources: list[str],
        targets: list[str],
        decode: DecodeConfig,
        *,
        deadline: float | None = None,
        progress: LinesDone | None = None,
    ) -> list[PairScore]:
        """Score with a complete decode config (overrides already applied); a pair the model cannot
        place whole is refused, never scored in part. `progress`: told the pairs done as each batch is."""
        if len(sources) != len(targets):
            raise UserInputError(f"{len(sources)} sources but {len(targets)} targets; expected equal counts")
        self.plan_scoring(sources, targets)
        return self._engine.score(sources, targets, decode, deadline=deadline, progress=progress)

    def translate_with(
        self,
        lines: list[str],
        decode: DecodeConfig,
        *,
        progress: LinesDone | None = None,
        prefixes: list[str] | None = None,
        constraints: list[list[str]] | None = None,
        line_numbers: list[int] | None = None,
        deadline: float | None = None,
        names: Names = Names(),
    ) -> list[Translation]:
        """Translate with a complete decode config (overrides already applied) and per-line guidance.

        `line_numbers`: each line's index in its file or request (default: its place in `lines`):
        sampled lines draw from a generator of their own, derived from the seed and that index, so
        their samples never depend on the other lines of a call. `deadline`: a time.monotonic() past
        which the work stops (engine.DeadlinePassed). `progress`: told the number of lines done as each
        batch is (a progress bar's update). `names` name the lines in errors."""
        for name, given in (("prefixes", prefixes), ("constraints", constraints), ("line_numbers", line_numbers)):
            if given is not None and len(given) != len(lines):
                raise UserInputError(f"{name}: {len(given)} given for {len(lines)} lines; expected one per line")
        if constraints is not None and not any(constraints):
            constraints = None
        self.check_supported(decode, constrained=constraints is not None)
        self.plan(lines, decode, prefixes=prefixes, constraints=constraints, names=names)
        return self._engine.translate(
            lines,
            decode,
            prefixes=prefixes,
            constraints=constraints,
            line_numbers=line_numbers,
            deadline=deadline,
            progress=progress,
        )


def _given(overrides: list[str], typed: Iterable[str]) -> set[str]:
    """The decode options a caller set: the keys of its `decode.KEY=VALUE` overrides and its keywords."""
    return {item.partition("=")[0].removeprefix("decode.") for item in overrides} | set(typed)


def _text_list(texts: Iterable[str], name: str) -> list[str]:
    """`texts` as a list, or a TypeError (ValueError) naming the culprit: a str passed for a list would
    be translated character by character, and a bytes or None line, or one with a lone surrogate
    (what `errors="surrogateescape"` reading leaves), would fail deep in SentencePiece."""
    if isinstance(texts, str):
        raise TypeError(f"{name}: got one str; expected a list of strings, one sentence each: [{texts[:30]!r}]")
    texts = list(texts)
    for index, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"{name}[{index}]: expected a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{name}[{index}]: holds a lone surrogate; expected text UTF-8 can encode") from None
    return texts


def _nested_text_lists(constraints: Iterable[Iterable[str]] | None) -> list[list[str]] | None:
    """Each line's constraints as a list of phrases (a str there would be a phrase per character)."""
    if constraints is None:
        return None
    return [_text_list(terms, f"constraints[{index}]") for index, terms in enumerate(constraints)]


def _read_shortlist(path: str | Path | None):
    if path is None:
        return None
    from seq2seq.inference.shortlist import Shortlist

    return Shortlist.read(path)


def _for(shortlist: Any, tokenizer: Any):
    """The shortlist as ids of this tokenizer (None stays None)."""
    return None if shortlist is None else shortlist.target_lists(tokenizer.src_model, tokenizer.tgt_model)

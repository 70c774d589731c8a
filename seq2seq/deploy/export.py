"""`seq2seq export`: a checkpoint as a CTranslate2 model directory, shipped only through a parity gate.

The model is described with CTranslate2's own specification API (TransformerSpec: encoder and
decoder layers, pre- or post-norm, relu/gelu, scaled embeddings) and written by its converter,
which also quantizes. Our sinusoidal positions interleave sin and cos (CTranslate2's built-in table
puts all sines first), so the spec is given our table. The directory also holds the SentencePiece
model(s) and seq2seq_export.json: languages, decode defaults, the training config, the checkpoint's
step and best validation BLEU, and the parity report.

The parity gate decodes the check sentences with our PyTorch search and with the exported model,
same settings: greedy outputs must be identical on >= 99% of sentences and beam BLEU within 0.2
(float32), or BLEU may drop at most `max_bleu_drop` (quantized). The model is written into a
temporary folder next to the output and renamed into place only when the gate passes. A check
sentence longer than the exported model's positions is refused before any of that, as the
exported model would refuse it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from ctranslate2.converters.converter import Converter
from ctranslate2.specs import common_spec, transformer_spec

from seq2seq.checkpoint import Checkpoint
from seq2seq.config import QUANTIZATIONS
from seq2seq.data.prepare import read_split
from seq2seq.data.sources import read_lines
from seq2seq.errors import UserInputError
from seq2seq.evaluation.evaluate import translate_and_score
from seq2seq.evaluation.scoring import Scores
from seq2seq.files import content_digest, remove_stale_temporaries, temporary_path
from seq2seq.inference.admission import ModelCapacity, Names, plan_translation
from seq2seq.inference.ctranslate2_engine import (
    SHORTLIST_FILE,
    GpuUnusable,
    compute_type_note,
    position_table_size,
    weights_format,
)
from seq2seq.inference.engine import EXPORT_METADATA
from seq2seq.inference.shortlist import Shortlist
from seq2seq.inference.translator import Translator
from seq2seq.model.embedding import sinusoidal_positions

ACTIVATIONS = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}
EXPORT_FORMAT_VERSION = 1
LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which our layers use


# Quantizations that CTranslate2 computes only on a GPU (on a CPU it converts them to float32): the
# parity gate decodes such an export on the GPU when there is one, so that it checks what users run.
GPU_QUANTIZATIONS = ("float16", "bfloat16")
# The most positions an export's table may hold: 65,536 x d_model floats (256 MB at d 1024). A table
# sized by a slip of the keyboard (10^8) would ask for tens of GB before anything is written.
MAX_POSITIONS = 65_536


class ExportFailed(Exception):
    """The exported model does not translate like the checkpoint; nothing was written."""


@dataclass(frozen=True)
class ParityReport:
    quantization: str
    sentences: int
    identical_greedy: float  # share of sentences whose greedy outputs are the same text
    beam: int
    ours: Scores
    exported: Scores
    max_bleu_drop: float
    device: str = "cpu"  # where the export was decoded: float16 on a GPU where there is one
    gpu_unusable: str = ""  # why CTranslate2 could not decode it on the GPU that torch sees
    computed_in: str = ""  # CTranslate2's compute type there: float32 for float16 on a CPU, say

    @property
    def failures(self) -> list[str]:
        drop = self.ours.bleu - self.exported.bleu
        if self.quantization == "float32":
            found = []
            if self.identical_greedy < 0.99:
                found.append(f"greedy outputs identical on {self.identical_greedy:.1%} of sentences (need >= 99%)")
            if abs(drop) > 0.2:
                found.append(f"beam-{self.beam} BLEU differs by {-drop:+.2f} (need within 0.2)")
            return found
        return [f"BLEU dropped by {drop:.2f} (allowed {self.max_bleu_drop:g})"] if drop > self.max_bleu_drop else []

    def describe(self) -> str:
        ours, exported = self.ours, self.exported
        return (
            f"parity ({self.quantization}, {self.sentences} sentences): greedy outputs identical on "
            f"{self.identical_greedy:.1%}; beam {self.beam} BLEU {ours.bleu:.2f} -> {exported.bleu:.2f} "
            f"({exported.bleu - ours.bleu:+.2f}), chrF {ours.chrf:.2f} -> {exported.chrf:.2f}{self._where()}"
        )

    def _where(self) -> str:
        """Where the gate decoded the export, and in what, where CTranslate2 computed it in other
        weights than its quantization (what users on this device will run, so the line says it)."""
        converted = weights_format(self.computed_in) != weights_format(self.quantization)
        computed = f" in {self.computed_in}" if self.computed_in and converted else ""
        if self.device != "cpu":
            return f"; the export decoded on {self.device}{computed}"
        if not computed:
            return ""
        if self.quantization in GPU_QUANTIZATIONS:
            why = f"CTranslate2 cannot use the GPU here ({self.gpu_unusable})" if self.gpu_unusable else "no GPU here"
        else:
            why = f"CTranslate2 has no {self.quantization} kernels for this CPU"
        return f"; {why}: the {self.quantization} export decoded{computed} on the CPU"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "passed": not self.failures}


def export_checkpoint(
    checkpoint_path: Path,
    output: Path,
    *,
    quantization: str = "float32",
    check_src: Path | None = None,
    check_ref: Path | None = None,
    check_lines: int = 500,
    max_bleu_drop: float = 1.0,
    max_positions: int | None = None,
    shortlist: Path | None = None,
) -> ParityReport:
    """Export, run the parity gate, and only then put the model at `output`. Raises ExportFailed.
    `max_positions`: the longest source and output the exported model will place (default:
    ctranslate2_engine.position_table_size); longer lines are refused by the exported model.
    `shortlist`: a file from `seq2seq shortlist` the export decodes over (CTranslate2's vocabulary
    map); the gate then compares it with the checkpoint held to the same shortlist."""
    if quantization not in QUANTIZATIONS:
        raise UserInputError(f"--quantization {quantization}: expected one of {', '.join(QUANTIZATIONS)}")
    if max_positions is not None and not 1 <= max_positions <= MAX_POSITIONS:
        raise UserInputError(f"--max-positions {max_positions}: expected an integer in [1, {MAX_POSITIONS:,}]")
    if output.exists():
        raise UserInputError(f"{output}: already exists; expected a new directory (delete it or choose another -o)")
    missing = _missing_folders(output.parent)  # made when the work starts, removed again if it fails
    checkpoint = Checkpoint.load(checkpoint_path)
    if shortlist is not None:  # a file of another vocabulary is named before any work
        Shortlist.read(shortlist).target_lists(checkpoint.tokenizer.src_model, checkpoint.tokenizer.tgt_model)
    sources, references = _check_sentences(checkpoint, check_src, check_ref, check_lines)
    positions = max_positions or position_table_size(checkpoint.config)
    tokenizer = checkpoint.tokenizer
    plan_translation(  # a check sentence the export could not place: before any work
        ModelCapacity(tokenizer.src_model, tokenizer.tgt_model, positions),
        sources,
        checkpoint.config.decode,
        names=Names(line=_gate_sentence_name(checkpoint, check_src)),
    )
    spec = build_spec(checkpoint, positions)
    for folder in reversed(missing):
        folder.mkdir()
    remove_stale_temporaries(output.parent, output.name)  # a killed export's staging folder
    staging = temporary_path(output)
    try:
        _SpecConverter(spec).convert(str(staging), quantization=quantization, force=True)
        _write_tokenizer_and_metadata(staging, checkpoint, content_digest(checkpoint_path), quantization, positions)
        if shortlist is not None:
            shutil.copyfile(shortlist, staging / SHORTLIST_FILE)
        ours = Translator.load(checkpoint_path, device="cpu", shortlist=shortlist)
        gate = functools.partial(
            parity, ours, sources=sources, references=references, quantization=quantization, max_bleu_drop=max_bleu_drop
        )
        device = "cuda" if quantization in GPU_QUANTIZATIONS and torch.cuda.is_available() else "cpu"
        compute_type_note.disabled = True  # the parity line says what the export computed in
        try:
            report = gate(Translator.load(staging, device=device), device=device)
        except GpuUnusable as error:  # the export is sound; the GPU's libraries are not there
            report = gate(Translator.load(staging, device="cpu"), gpu_unusable=error.cause)
        if report.failures:
            raise ExportFailed(f"{report.describe()}\nexport refused: {'; '.join(report.failures)}")
        metadata = json.loads((staging / EXPORT_METADATA).read_text(encoding="utf-8"))
        (staging / EXPORT_METADATA).write_text(json.dumps({**metadata, "parity": report.to_dict()}, indent=2) + "\n")
        os.replace(staging, output)
        return report
    finally:
        compute_type_note.disabled = False
        shutil.rmtree(staging, ignore_errors=True)
        for folder in missing if not output.exists() else []:
            with contextlib.suppress(OSError):  # emptied of our staging only; anything else keeps it
                folder.rmdir()


def _missing_folders(folder: Path) -> list[Path]:
    """The folders of `folder`'s path that do not exist yet, deepest first (as users of `-o models/x`
    expect them made); one line now if the nearest existing one is a file or read-only."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    if not folder.is_dir():
        raise UserInputError(f"{folder}: is not a directory; expected a folder for the exported model")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserInputError(f"{folder}: is not writable; expected a writable folder for the exported model")
    return missing


def parity(
    ours: Translator,
    exported: Translator,
    sources: list[str],
    references: list[str],
    *,
    quantization: str,
    max_bleu_drop: float,
    device: str = "cpu",
    gpu_unusable: str = "",
) -> ParityReport:
    """Both engines on the same sentences and settings: greedy agreement and beam scores.

    A shortlisted export decodes a batch over the union of its lines' shortlists (CTranslate2's
    vocabulary map), our search each line over its own: the gate gives the export one line a batch,
    so that both hold each line to its own list."""
    searched = dataclasses.replace(ours.decode, sample=False)  # the gate compares searches, never samples
    alone = dataclasses.replace(searched, batch_tokens=1) if exported.shortlisted else searched
    greedy = dataclasses.replace(searched, beam=1, nbest=1)
    greedy_alone = dataclasses.replace(alone, beam=1, nbest=1)
    same = sum(
        a.text == b.text
        for a, b in zip(ours.translate_with(sources, greedy), exported.translate_with(sources, greedy_alone))
    )
    return ParityReport(
        quantization=quantization,
        sentences=len(sources),
        identical_greedy=same / len(sources),
        beam=ours.decode.beam,
        ours=translate_and_score(ours, sources, references, searched).scores,
        exported=translate_and_score(exported, sources, references, alone).scores,
        max_bleu_drop=max_bleu_drop,
        device=device,
        gpu_unusable=gpu_unusable,
        computed_in=exported.computes_in,
    )


def build_spec(checkpoint: Checkpoint, max_positions: int) -> transformer_spec.TransformerSpec:
    """The checkpoint's model as a CTranslate2 Transformer specification, weights set, with a table
    of `max_positions` positions."""
    config = checkpoint.config.model
    spec = transformer_spec.TransformerSpec.from_config(
        (config.encoder_layers, config.decoder_layers),
        config.heads,
        pre_norm=config.norm == "pre",
        activation=ACTIVATIONS[config.activation],
    )
    weights = {name: tensor.float().numpy() for name, tensor in checkpoint.model.items()}
    positions = sinusoidal_positions(torch.arange(max_positions), config.d_model).numpy()
    _set_stack_inputs(spec.encoder, weights["src_embed.weight"], positions)
    _set_stack_inputs(spec.decoder, weights["tgt_embed.weight"], positions)
    for index, layer in enumerate(spec.encoder.layer):
        prefix = f"encoder_layers.{index}"
        _set_attention(layer.self_attention, weights, f"{prefix}.self_attn", f"{prefix}.self_attn_block", fused=3)
        _set_ffn(layer.ffn, weights, prefix)
    for index, layer in enumerate(spec.decoder.layer):
        prefix = f"decoder_layers.{index}"
        _set_attention(layer.self_attention, weights, f"{prefix}.self_attn", f"{prefix}.self_attn_block", fused=3)
        _set_attention(layer.attention, weights, f"{prefix}.cross_attn", f"{prefix}.cross_attn_block", fused=2)
        _set_ffn(layer.ffn, weights, prefix)
    if config.norm == "pre":
        _set_norm(spec.encoder.layer_norm, weights, "encoder_norm")
        _set_norm(spec.decoder.layer_norm, weights, "decoder_norm")
    spec.decoder.projection.weight = weights["output_proj.weight"]
    src_model, tgt_model = checkpoint.tokenizer.src_model, checkpoint.tokenizer.tgt_model
    spec.register_source_vocabulary([src_model.id_to_piece(i) for i in range(src_model.get_piece_size())])
    spec.register_target_vocabulary([tgt_model.id_to_piece(i) for i in range(tgt_model.get_piece_size())])
    spec.config.add_source_eos = True  # our encoder sees where the source ends
    spec.config.decoder_start_token = "<s>"
    spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
    return spec


class _SpecConverter(Converter):
    """CTranslate2's converter (validation, quantization, saving) over a spec we built."""

    def __init__(self, spec: transformer_spec.TransformerSpec) -> None:
        self._spec = spec

    def _load(self) -> transformer_spec.TransformerSpec:
        return self._spec


def _set_stack_inputs(stack, embedding: np.ndarray, positions: np.ndarray) -> None:
    embeddings = stack.embeddings[0] if isinstance(stack.embeddings, list) else stack.embeddings
    embeddings.weight = embedding
    stack.scale_embeddings = True  # x * sqrt(d_model), as ours
    stack.position_encodings.encodings = positions


def _set_attention(spec, weights: dict, attention: str, block: str, *, fused: int) -> None:
    """fused=3: self-attention, q/k/v in one matrix; fused=2: cross-attention, q apart and k/v fused."""
    names = ("q_proj", "k_proj", "v_proj")
    if fused == 3:
        _set_linear(spec.linear[0], weights, [f"{attention}.{n}" for n in names])
    else:
        _set_linear(spec.linear[0], weights, [f"{attention}.q_proj"])
        _set_linear(spec.linear[1], weights, [f"{attention}.{n}" for n in names[1:]])
    _set_linear(spec.linear[-1], weights, [f"{attention}.out_proj"])
    _set_norm(spec.layer_norm, weights, f"{block}.norm")


def _set_ffn(spec, weights: dict, prefix: str) -> None:
    _set_linear(spec.linear_0, weights, [f"{prefix}.ffn.fc1"])
    _set_linear(spec.linear_1, weights, [f"{prefix}.ffn.fc2"])
    _set_norm(spec.layer_norm, weights, f"{prefix}.ffn_block.norm")


def _set_linear(spec, weights: dict, modules: list[str]) -> None:
    spec.weight = np.concatenate([weights[f"{m}.weight"] for m in modules])
    spec.bias = np.concatenate([weights[f"{m}.bias"] for m in modules])


def _set_norm(spec, weights: dict, module: str) -> None:
    spec.gamma, spec.beta = weights[f"{module}.weight"], weights[f"{module}.bias"]


def _check_sentences(checkpoint: Checkpoint, src: Path | None, ref: Path | None, limit: int) -> tuple[list, list]:
    """The parity gate's sentences: --check-src/--check-ref, else the checkpoint's validation split."""
    if (src is None) != (ref is None):
        raise UserInputError("--check-src and --check-ref go together (sources and their references)")
    if src is not None:
        sources, references = list(read_lines(src)), list(read_lines(ref))
        if not sources:
            raise UserInputError(f"{src}: no lines; expected the parity gate's source sentences")
        if len(sources) != len(references):  # counted whole: files that part after --check-lines are not a pair
            raise UserInputError(
                f"{ref}: has {len(references)} lines but {src} has {len(sources)}; expected one reference per source"
            )
        return sources[:limit], references[:limit]
    try:
        valid = read_split(checkpoint.config.data, "valid")
    except UserInputError as error:
        raise UserInputError(f"{error}; the parity gate needs sentences: pass --check-src and --check-ref") from None
    return valid.src[:limit], valid.tgt[:limit]


def _gate_sentence_name(checkpoint: Checkpoint, src: Path | None) -> str:
    """How a refusal names a parity-gate sentence: a line of --check-src or of the validation split's
    source file, where each line is a sentence; for other formats, the split and the sentence's place."""
    valid = checkpoint.config.data.valid
    if src is None and (valid is None or valid.format != "text"):
        return "data.valid, sentence {number}"
    return f"{src if src is not None else valid.src}:{{number}}"


def _write_tokenizer_and_metadata(
    directory: Path, checkpoint: Checkpoint, checkpoint_sha256: str, quantization: str, positions: int
) -> None:
    protos = checkpoint.tokenizer.protos()
    files = {name: f"{name}.model" for name in protos}
    for name, proto in protos.items():
        (directory / files[name]).write_bytes(proto)
    config = checkpoint.config
    metadata = {
        "format_version": EXPORT_FORMAT_VERSION,
        "engine": "ctranslate2",
        "quantization": quantization,
        "max_positions": positions,
        "src_lang": config.data.src_lang,
        "tgt_lang": config.data.tgt_lang,
        "tokenizer": {"src": files.get("joint", files.get("src")), "tgt": files.get("joint", files.get("tgt"))},
        "step": checkpoint.progress.step,
        "checkpoint_sha256": checkpoint_sha256,  # the file it came from: a later checkpoint is another model
        "best_bleu": checkpoint.progress.best_bleu,
        "decode": dataclasses.asdict(config.decode),
        "config": config.to_dict(),
    }
    (directory / EXPORT_METADATA).write_text(json.dumps(metadata, indent=2) + "\n", encoding="utf-8")

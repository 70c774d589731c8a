#!/usr/bin/env python3
"""Decoding speed, measured side by side in one run on one trained model.

Prints sentences/s and generated tokens/s of greedy and beam-5 search over N sentences, then two
ratios with their targets:
  * the KV-cached decoder against re-running the decoder over the whole prefix at every step
    (beam 5, every output forced to exactly 40 tokens), and
  * batched beam search (64 sentences per batch) against one sentence at a time.

With --references, the shipped sides follow: the checkpoint exported to CTranslate2 in float32 and
int8 (through `seq2seq export` and its parity gate) against our PyTorch decoder, each side in its
own process (so its peak RSS is its own), greedy and beam 5, with BLEU against the references.

    python benchmarks/benchmark_decode.py [--checkpoint runs/demo/checkpoints/best.pt] [--input data/demo/test.en]
    python benchmarks/benchmark_decode.py --checkpoint CKPT --input test.en --references test.es --sentences 300
    python benchmarks/benchmark_decode.py --device cuda ... --references test.es --exported DIR_FLOAT16 DIR_INT8
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from seq2seq.checkpoint import load_for_inference
from seq2seq.config import DecodeConfig
from seq2seq.data.batching import pad
from seq2seq.data.sources import read_lines
from seq2seq.inference.pytorch_engine import translate_lines
from seq2seq.inference.search import search
from seq2seq.inference.search_steps import PrefixCache
from seq2seq.inference.translator import Translator
from seq2seq.model.interop import to_torch_transformer


class RecomputingDecoder:
    """The same model without a KV cache: every step runs the decoder over the whole prefix."""

    def __init__(self, model) -> None:
        self.model = model

    def encode(self, src, src_mask):
        return self.model.encode(src, src_mask)

    def new_cache(self) -> PrefixCache:
        return PrefixCache()

    def decode(self, tgt, memory, src_mask, cache: PrefixCache):
        return self.model.decode(cache.append(tgt), memory, src_mask)[:, -1:]


class TorchTransformerDecoder:
    """The same trained weights inside torch.nn.Transformer, decoded as one writes it by hand:
    nn.TransformerDecoder has no KV cache, so every step re-runs it over the whole prefix."""

    def __init__(self, model) -> None:
        self.model, self.reference = model, to_torch_transformer(model)

    def encode(self, src, src_mask):
        x = self.model.embed(self.model.src_embed, src, 0)
        return self.reference.encoder(x, src_key_padding_mask=~src_mask[:, 0, 0, :])

    def new_cache(self) -> PrefixCache:
        return PrefixCache()

    def parameters(self):
        return self.model.parameters()

    def decode(self, tgt, memory, src_mask, cache: PrefixCache):
        prefix = cache.append(tgt)
        beams, length = tgt.size(0) // memory.size(0), prefix.size(1)
        hidden = self.reference.decoder(
            self.model.embed(self.model.tgt_embed, prefix, 0),
            memory.repeat_interleave(beams, 0),
            tgt_mask=torch.ones(length, length, dtype=torch.bool, device=prefix.device).triu(1),
            memory_key_padding_mask=~src_mask[:, 0, 0, :].repeat_interleave(beams, 0),
        )
        return self.model.output_proj(hidden[:, -1:])


class EagerDecoder:
    """Our model as a plain search.Decoder, so that translation does not wrap it in CUDA graphs: the
    eager row that the graphed one is compared with on a GPU."""

    def __init__(self, model) -> None:
        self.model = model

    def encode(self, src, src_mask):
        return self.model.encode(src, src_mask)

    def new_cache(self):
        return self.model.new_cache()

    def decode(self, tgt, memory, src_mask, cache):
        return self.model.decode(tgt, memory, src_mask, cache)

    def parameters(self):
        return self.model.parameters()


def timed(function):
    start = time.perf_counter()
    result = function()
    return result, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/demo/checkpoints/best.pt"))
    parser.add_argument("--input", type=Path, default=Path("data/demo/test.en"))
    parser.add_argument("--sentences", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--references", type=Path, help="references of --input: adds the CTranslate2 sides")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where every side decodes")
    parser.add_argument("--exported", type=Path, nargs="+", default=[],
                        help="with --references: decode these exported models (no export here) instead")  # fmt: skip
    args = parser.parse_args()
    if not args.checkpoint.exists() or not args.input.exists():
        print(f"error: {args.checkpoint} or {args.input} missing; run `make demo` first", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = load_for_inference(args.checkpoint, args.device)
    model, tokenizer = bundle.model, bundle.tokenizer
    lines = list(read_lines(args.input))[: args.sentences]
    base = dataclasses.replace(bundle.config.decode, nbest=1)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"model: {args.checkpoint} | {len(lines)} sentences from {args.input} | {where}")

    reference = TorchTransformerDecoder(model)
    print("\n| search | decoder | sentences/s | generated tokens/s | speed-up | same output |")
    print("|---|---|---|---|---|---|")
    for name, beam in (("greedy", 1), ("beam 5", 5)):
        config = dataclasses.replace(base, beam=beam)
        rates = {}
        ours = [("seq2seq", model)]
        if args.device == "cuda":  # translation wraps our model in CUDA graphs; EagerDecoder hides it from that
            ours = [("seq2seq, eager", EagerDecoder(model)), ("seq2seq, CUDA graphs", model)]
        for decoder_name, decoder in (("nn.Transformer, no cache", reference), *ours):
            translate_lines(decoder, tokenizer, lines[:50], config)  # warm-up: one-time kernel setup
            results, seconds = timed(lambda d=decoder, c=config: translate_lines(d, tokenizer, lines, c))
            tokens = sum(len(tokenizer.encode_tgt([r.text])[0]) + 1 for r in results)  # + EOS
            rates[decoder_name] = (tokens / seconds, [r.text for r in results])
            speedup = tokens / seconds / rates["nn.Transformer, no cache"][0]
            same = sum(a == b for a, b in zip(rates["nn.Transformer, no cache"][1], rates[decoder_name][1]))
            print(f"| {name} | {decoder_name} | {len(lines) / seconds:,.1f} | {tokens / seconds:,.0f} | "
                  f"{speedup:.2f}x | {same / len(lines):.1%} |")  # fmt: skip
    print("(target: seq2seq >= 2x the reference in generated tokens/s, greedy and beam 5)")

    encoded = tokenizer.encode_src(lines[:64])
    batch = pad(encoded).to(args.device)
    forced = DecodeConfig(beam=5, min_len=40, max_len_a=0.0, max_len_b=40, length_norm="none")
    cached_hyps, cached = timed(lambda: search(model, batch, forced))
    recomputed_hyps, recomputed = timed(lambda: search(RecomputingDecoder(model), batch, forced))
    assert [h[0].tokens for h in cached_hyps] == [h[0].tokens for h in recomputed_hyps], "cache changed the output"
    print(f"\nKV cache, beam 5, 64 sentences x 40 tokens: cached {cached:.2f}s, recomputing {recomputed:.2f}s "
          f"-> {recomputed / cached:.1f}x (target >= 3x)")  # fmt: skip

    natural = dataclasses.replace(base, beam=5)
    _, batched = timed(lambda: search(model, batch, natural))
    _, one_by_one = timed(lambda: [search(model, pad([ids]).to(args.device), natural) for ids in encoded])
    print(f"batched beam 5, 64 sentences: batch of 64 {batched:.2f}s, one at a time {one_by_one:.2f}s "
          f"-> {one_by_one / batched:.1f}x (target >= 5x)")  # fmt: skip
    print(f"peak RSS: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB")
    if args.references:
        shipped_sides(args, lines, list(read_lines(args.references))[: len(lines)])
    return 0


def shipped_sides(args, lines: list[str], references: list[str]) -> None:
    """Our PyTorch decoder against its CTranslate2 exports (float32, int8), each in a fresh process."""
    from seq2seq.deploy.export import export_checkpoint

    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as work:
        models = {"seq2seq (PyTorch)": args.checkpoint}
        for directory in args.exported:
            models[f"CTranslate2 {directory.name}"] = directory
        for quantization in () if args.exported else ("float32", "int8"):
            output = Path(work) / quantization
            report = export_checkpoint(args.checkpoint, output, quantization=quantization, check_src=args.input,
                                       check_ref=args.references, check_lines=len(lines))  # fmt: skip
            print(f"\nexport: {report.describe()}")
            models[f"CTranslate2 {quantization}"] = output
        rows = {}
        for name, model in models.items():
            queue = context.Queue()
            process = context.Process(target=_decode_side, args=(model, lines, references, args, queue))
            process.start()
            rows[name] = queue.get()
            process.join()
    print(f"\n{len(lines)} sentences; each side in its own process")
    print("| search | engine | sentences/s | generated tokens/s | vs PyTorch | BLEU | peak RSS |")
    print("|---|---|---|---|---|---|---|")
    for search_name in ("greedy", "beam 5"):
        ours = rows["seq2seq (PyTorch)"][search_name][1]
        for name, row in rows.items():
            sentences, tokens, bleu = row[search_name]
            print(f"| {search_name} | {name} | {sentences:,.1f} | {tokens:,.0f} | {tokens / ours:.2f}x | {bleu:.2f} "
                  f"| {row['peak_rss']:,.0f} MiB |")  # fmt: skip
    if args.exported:
        return
    int8, float32 = rows["CTranslate2 int8"]["beam 5"], rows["CTranslate2 float32"]["beam 5"]
    print(f"int8 beam 5: {int8[1] / rows['seq2seq (PyTorch)']['beam 5'][1]:.2f}x our PyTorch beam 5 in generated "
          f"tokens/s (target >= 2x), BLEU {int8[2] - float32[2]:+.2f} against float32 (target within 0.5)")  # fmt: skip


def _decode_side(model: Path, lines: list[str], references: list[str], args, queue) -> None:
    from seq2seq.data.tokenizer import Tokenizer
    from seq2seq.evaluation.scoring import score

    if args.threads:
        torch.set_num_threads(args.threads)
    translator = Translator.load(model, device=args.device)
    # the target tokenizer counts generated tokens the same way for every side
    tokenizer = translator.bundle.tokenizer if translator.bundle else Tokenizer.load(model)
    row = {}
    for name, beam in (("greedy", 1), ("beam 5", 5)):
        settings = dataclasses.replace(translator.decode, beam=beam, nbest=1)
        translator.translate_with(lines[:50], settings)  # warm-up
        results, seconds = timed(lambda s=settings: translator.translate_with(lines, s))
        hypotheses = [r.text for r in results]
        tokens = sum(len(ids) + 1 for ids in tokenizer.encode_tgt(hypotheses))  # + EOS
        row[name] = (len(lines) / seconds, tokens / seconds, score(hypotheses, [references]).bleu)
    row["peak_rss"] = _own_peak_rss_mb()  # not ru_maxrss: Linux carries it over from the parent through exec
    queue.put(row)


def _own_peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())

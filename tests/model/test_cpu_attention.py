"""Attention straight from a stack's flat rows (model/cpu_attention.py): equal to PyTorch's attention of
each sentence, forward and backward, in fp32 and bf16, self (causal or not) and cross; zeros in the
padding rows; the same for any thread count; and a model that takes it trains as one that does not.
The AMX tile path's packing is checked apart, on any CPU with AVX-512 BW and VL (tile_packing_check.cpp)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks.op_census import take_census
from seq2seq.config import ModelConfig
from seq2seq.data.special_tokens import PAD_ID
from seq2seq.model import cpu_attention, layers
from seq2seq.model.cpu_attention import flat_attention
from seq2seq.model.cpu_kernels import CAPPED_TARGETS, COMPILE_FLAGS, SOURCES, SWITCH, _cpu_flags
from seq2seq.model.rows import Rows
from seq2seq.model.transformer import Seq2SeqTransformer

HEADS = 3
PADDING_ROWS = 5  # rows after the last sentence, as a stack padded to a multiple of rows has


def _spans(lengths: list[int]) -> torch.Tensor:
    lengths = torch.tensor(lengths)
    return torch.stack([lengths.cumsum(0) - lengths, lengths], 1)


def _heads(x, start, count):
    """Rows [start, start + count) of x (rows, d) as (heads, count, head_dim)."""
    return x[start : start + count].unflatten(1, (HEADS, -1)).transpose(0, 1)


def _per_sentence(q, k, v, query_spans, key_spans, causal):
    """PyTorch's attention of each sentence on its own, in (rows, d) like flat_attention's output."""
    out = torch.zeros_like(q)
    for (q_start, queries), (k_start, keys) in zip(query_spans.tolist(), key_spans.tolist()):
        attended = F.scaled_dot_product_attention(
            _heads(q, q_start, queries), _heads(k, k_start, keys), _heads(v, k_start, keys), is_causal=causal
        )
        out[q_start : q_start + queries] = attended.transpose(0, 1).flatten(1)
    return out


def _inputs(dtype, causal, head_dim, query_lengths, key_lengths):
    torch.manual_seed(0)
    width = HEADS * head_dim
    queries = torch.randn(sum(query_lengths) + PADDING_ROWS, (3 if causal else 1) * width).to(dtype)
    keys_values = None if causal else torch.randn(sum(key_lengths) + PADDING_ROWS, 2 * width).to(dtype)
    return queries, keys_values


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [16, 20])  # 20: not a multiple of the kernel's 16 lanes
@pytest.mark.parametrize("kept", [True, False])  # the backward pass reads the probabilities, or recomputes them
def test_equals_pytorch_attention_of_each_sentence_forward_and_backward(
    fused_kernels, monkeypatch, dtype, tolerance, causal, head_dim, kept
):
    if not kept:
        monkeypatch.setattr(cpu_attention, "MAX_KEPT_PROBABILITY_BYTES", 0)
    query_lengths = [5, 1, 37, 18]
    key_lengths = query_lengths if causal else [7, 3, 2, 41]
    queries, keys_values = _inputs(dtype, causal, head_dim, query_lengths, key_lengths)
    query_spans, key_spans = _spans(query_lengths), _spans(key_lengths)
    inputs = [queries] if causal else [queries, keys_values]
    ours_in = [x.clone().requires_grad_() for x in inputs]
    theirs_in = [x.float().requires_grad_() for x in inputs]

    ours = flat_attention(ours_in[0], None if causal else ours_in[1], query_spans, key_spans, HEADS, causal=causal)
    q, k, v = theirs_in[0].chunk(3, 1) if causal else (theirs_in[0], *theirs_in[1].chunk(2, 1))
    theirs = _per_sentence(q, k, v, query_spans, key_spans, causal)
    assert (ours.grad_fn.saved_tensors[-1].numel() > 0) == kept  # the probabilities kept for backward, or not
    grad = torch.randn(ours.shape).to(dtype)
    (ours * grad).sum().backward()
    (theirs * grad.float()).sum().backward()

    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), theirs, atol=tolerance, rtol=tolerance)
    assert not ours[-PADDING_ROWS:].any()
    for mine, reference in zip(ours_in, theirs_in):
        torch.testing.assert_close(mine.grad.float(), reference.grad, atol=tolerance, rtol=tolerance)
        assert not mine.grad[-PADDING_ROWS:].any()


def test_bf16_attention_takes_amx_tiles_where_the_kernels_are_built_for_them(fused_kernels):
    """On an AMX CPU the tests above run bf16 through the tile products; this says that they did."""
    capped = os.environ.get("ATEN_CPU_CAPABILITY", "").lower() in CAPPED_TARGETS
    if "amx_bf16" not in _cpu_flags().split() or capped:
        pytest.skip("no AMX here (or the kernels are built below it): bf16 attention multiplies in fp32")
    assert fused_kernels.attention_tiles()


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("g++") is None,
                    reason="the check builds for this x86 CPU with GCC")  # fmt: skip
def test_tile_packing_and_block_transposes_equal_their_definitions(tmp_path):
    """The AMX tile path's packing (k^T, v^T, the transposed probabilities, rounded to bf16) and the
    transposed reads move 16 x 16 blocks through AVX-512 registers: each equals its definition as a
    plain loop, bit for bit, NaNs, denormals and rounding ties included. Built with AMX's flags, it runs
    on any CPU with AVX-512 BW and VL: the packing, never a tile instruction (tile_packing_check.cpp)."""
    if not {"avx512bw", "avx512vl"} <= set(_cpu_flags().split()):
        pytest.skip("no AVX-512 BW and VL here: the kernels keep the scalar loops, which the tests above cover")
    from torch.utils import cpp_extension

    check = Path(__file__).with_name("tile_packing_check.cpp")
    includes = [f"-I{path}" for path in (SOURCES[0].parent, *cpp_extension.include_paths())]
    libraries = cpp_extension.library_paths()
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"
    program = tmp_path / "check"
    built = subprocess.run(
        ["g++", *COMPILE_FLAGS, "-march=native", "-mamx-tile", "-mamx-bf16", "-fopenmp", "-std=c++17", abi,
         *includes, str(check), "-o", str(program), *(f"-L{path}" for path in libraries),
         *(f"-Wl,-rpath,{path}" for path in libraries), "-ltorch", "-ltorch_cpu", "-lc10"],
        capture_output=True, text=True,
    )  # fmt: skip
    if built.returncode != 0 and "unrecognized command-line option" in built.stderr:
        pytest.skip("this GCC cannot build for AMX")
    assert built.returncode == 0, built.stderr[-2000:]
    ran = subprocess.run([str(program)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "checked 8000" in ran.stdout, ran.stdout


def test_any_thread_count_gives_the_same_bits(fused_kernels):
    lengths = [9, 30, 4, 22, 17]
    queries, _ = _inputs(torch.bfloat16, True, 32, lengths, lengths)
    spans = _spans(lengths)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            x = queries.clone().requires_grad_()
            out = flat_attention(x, None, spans, spans, HEADS, causal=True)
            out.square().sum().backward()
            results.append((out, x.grad))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("causal", [False, True])
def test_a_long_sentence_attends_in_blocks_of_queries_with_the_same_bits(fused_kernels, causal):
    """Without probabilities kept for a backward pass (decoding, validation), a sentence whose scores
    would not fit in the kernel's block takes its queries a block at a time: the output is the one the
    whole task gives when it keeps them (training's forward pass), bit for bit."""
    query_lengths = [3, 1100, 40]  # 1,100 x 1,104 scores: over the 2^20 of one block
    key_lengths = query_lengths if causal else [5, 1300, 60]
    queries, keys_values = _inputs(torch.float32, causal, 16, query_lengths, key_lengths)
    query_spans, key_spans = _spans(query_lengths), _spans(key_lengths)
    with torch.no_grad():
        blocks = flat_attention(queries, keys_values, query_spans, key_spans, HEADS, causal=causal)
    whole = flat_attention(queries.requires_grad_(), keys_values, query_spans, key_spans, HEADS, causal=causal)
    assert whole.grad_fn.saved_tensors[-1].numel() > 0  # kept: the whole task in one block
    assert torch.equal(blocks, whole.detach())


LONG_LINE_IN_LITTLE_MEMORY = """
import resource

import torch

from seq2seq.model.cpu_attention import flat_attention
torch.set_num_threads(1)
rows = 20_000  # its whole scores: 1.6 GB
queries = torch.randn(rows, 3 * 64)
spans = torch.tensor([[0, rows]])
size = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmSize")))
resource.setrlimit(resource.RLIMIT_AS, ((size << 10) + (512 << 20),) * 2)
with torch.no_grad():
    out = flat_attention(queries, None, spans, spans, 1, causal=False)
print(bool(out.isfinite().all()))
"""


def test_a_line_of_twenty_thousand_pieces_attends_in_far_less_than_its_scores_memory(fused_kernels):
    """The encoder of a very long line: 512 MB to spare where its whole scores would take 1.6 GB."""
    done = subprocess.run([sys.executable, "-c", LONG_LINE_IN_LITTLE_MEMORY], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr[-2000:]


def test_spans_are_listed_for_right_padded_rows_only():
    right_padded = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    assert Rows.of(right_padded, 1).spans.tolist() == [[0, 2], [2, 3], [5, 1]]
    assert Rows.of(torch.ones(2, 3, dtype=torch.bool), 1).spans.tolist() == [[0, 3], [3, 3]]
    hole = torch.tensor([[True, False, True], [True, True, True]])
    assert Rows.of(hole, 1).spans is None


def _gradients(model, src, tgt_in, tgt_out):
    model.zero_grad()
    logits = model(src, tgt_in)
    loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD_ID)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_a_model_computes_the_same_loss_and_gradients_with_and_without_it(fused_kernels, monkeypatch):
    """Teacher forcing on right-padded batches: encoder self-attention, decoder causal self-attention and
    cross-attention all take the flat path; with the kernels switched off, PyTorch's attention."""
    config = ModelConfig(d_model=48, heads=HEADS, ffn_dim=64, encoder_layers=2, decoder_layers=2, dropout=0.0)
    torch.manual_seed(0)
    model = Seq2SeqTransformer(config, src_vocab_size=50, tgt_vocab_size=50)
    src = torch.randint(4, 50, (4, 11))
    tgt = torch.randint(4, 50, (4, 9))
    for row, (src_length, tgt_length) in enumerate([(11, 9), (3, 2), (7, 9), (1, 4)]):
        src[row, src_length:] = PAD_ID
        tgt[row, tgt_length:] = PAD_ID
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["causal"])
        return flat_attention(*args, **kwargs)

    monkeypatch.setattr(layers, "flat_attention", counted)
    flat = _gradients(model, src, tgt_in, tgt_out)
    assert sorted(calls) == [False] * 4 + [True] * 2  # 2 encoder + 2 cross; 2 decoder self-attentions
    monkeypatch.setenv(SWITCH, "0")
    pytorch = _gradients(model, src, tgt_in, tgt_out)
    assert len(calls) == 6

    torch.testing.assert_close(flat[0], pytorch[0], atol=1e-5, rtol=1e-5)
    assert flat[1].keys() == pytorch[1].keys()
    for name, grad in flat[1].items():
        torch.testing.assert_close(grad, pytorch[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_cross_attentions_write_their_keys_and_values_gradients_in_place(fused_kernels):
    """Several layers' keys and values are column blocks of one projection (column_blocks): each
    attention's backward kernel writes its block's gradient into one tensor that the projection's
    backward then reads, the gradient the copying path gives, and no block is copied."""
    query_lengths, key_lengths, layers_count, width = [4, 7, 2], [6, 3, 5], 3, HEADS * 8
    query_spans, key_spans = _spans(query_lengths), _spans(key_lengths)
    torch.manual_seed(0)
    queries = [torch.randn(sum(query_lengths) + PADDING_ROWS, width) for _ in range(layers_count)]
    stacked = torch.randn(sum(key_lengths) + PADDING_ROWS, layers_count * 2 * width)
    weights = torch.randn(sum(query_lengths) + PADDING_ROWS, width)

    def gradient(in_place: bool):
        x = stacked.clone().requires_grad_()
        blocks, home = cpu_attention.column_blocks(x, layers_count)
        total = sum(
            (flat_attention(q, block, query_spans, key_spans, HEADS, causal=False,
                            keys_values_gradient_into=home.into(index) if in_place else None) * weights).sum()
            for index, (q, block) in enumerate(zip(queries, blocks))
        )  # fmt: skip
        census = take_census(total.backward)
        return x.grad, census.by_op["copy_"]

    (in_place, copied_in_place), (copied, copied_bytes) = gradient(True), gradient(False)
    assert torch.equal(in_place, copied)
    assert in_place[: sum(key_lengths)].abs().sum(0).ne(0).all()  # every column of every layer got a gradient
    assert copied_in_place == 0 and copied_bytes > 0


@pytest.mark.parametrize("causal", [False, True])
def test_bf16_rows_attend_in_fp32_rounded_once(fused_kernels, causal):
    """bf16 q, k, v in: the output is fp32 attention rounded once to bf16, not attention over bf16-rounded
    scores (which cost BLEU: docs/performance.md). On AMX the tile products also round the probabilities
    to bf16 as they multiply v, which stays within that bound."""
    torch.manual_seed(0)
    head_dim, length = 16, 20  # 20: on AMX, on its tiles
    fused = torch.randn(length, 3 * HEADS * head_dim).mul(4).bfloat16()
    spans = _spans([length])
    out = flat_attention(fused, None, spans, spans, HEADS, causal=causal)
    q, k, v = (part.double().unflatten(1, (HEADS, -1)).transpose(0, 1) for part in fused.chunk(3, 1))
    scores = q @ k.transpose(-2, -1) * head_dim**-0.5
    if causal:
        scores = scores.masked_fill(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    exact = (scores.softmax(-1) @ v).transpose(0, 1).flatten(1)
    rounded_scores = (scores.bfloat16().double().softmax(-1) @ v).transpose(0, 1).flatten(1)
    ours, theirs = (out.double() - exact).abs().max(), (rounded_scores - exact).abs().max()
    assert out.dtype == torch.bfloat16
    assert ours <= exact.abs().max() * 2**-8  # one bf16 rounding of the output, nothing more
    assert theirs > 2 * ours  # the check can tell the two apart

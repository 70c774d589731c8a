"""A stack's input rows in one pass (embedding.py, cpu_embedding.cpp): equal to the PyTorch path
(the embedding scaled, words dropped, sinusoids added, dropout with the same key, the kept positions
gathered into flat rows), forward and backward, with and without padding; its bf16 weight gradient
the exact sum rounded once; the same bits for any thread count; and the model takes it in training."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

from seq2seq.config import ModelConfig
from seq2seq.model import transformer
from seq2seq.model.dropout import dropout, kernel_mask
from seq2seq.model.embedding import embedded_rows, sinusoidal_positions
from seq2seq.model.rows import Rows
from seq2seq.model.transformer import Seq2SeqTransformer

VOCAB, WIDTH, LENGTH, P = 60, 20, 9, 0.3  # a width that is not a multiple of the 4 draws per word
SCALE = math.sqrt(WIDTH)


def _batch(padded: bool) -> tuple[Tensor, Rows]:
    tokens = torch.randint(1, VOCAB, (5, LENGTH), generator=torch.Generator().manual_seed(1))
    tokens[:, 0] = 3  # a token in every sentence: its gradient sums many rows
    if padded:
        for sentence, length in enumerate([9, 4, 7, 1, 6]):
            tokens[sentence, length:] = 0
    return tokens, Rows.of(tokens != 0, multiple=8)  # 28 or 45 rows, then zero rows up to a multiple of 8


def _weight(dtype) -> nn.Embedding:
    embedding = nn.Embedding(VOCAB, WIDTH, padding_idx=0)
    with torch.no_grad():
        embedding.weight.normal_(0, WIDTH**-0.5, generator=torch.Generator().manual_seed(2))
    return embedding.to(dtype)


def _words_kept(tokens: Tensor) -> Tensor:
    return torch.rand(tokens.shape, generator=torch.Generator().manual_seed(3)) >= 0.25


def _pytorch_path(embedding, tokens, rows, words_kept):
    x = embedding(tokens) * SCALE * words_kept.unsqueeze(-1).to(embedding.weight.dtype)
    x = x + sinusoidal_positions(torch.arange(LENGTH), WIDTH).to(x.dtype)
    return rows.flatten(dropout(x, P, training=True))


def _rows_and_gradient(fused: bool, dtype, padded: bool):
    embedding = _weight(dtype)
    tokens, rows = _batch(padded)
    words_kept = _words_kept(tokens)
    torch.manual_seed(7)  # the dropout key
    if fused:
        out = embedded_rows(embedding, tokens, rows, 0, SCALE, words_kept, P)
    else:
        out = _pytorch_path(embedding, tokens, rows, words_kept)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    out.backward(grad)
    return out, embedding.weight.grad, grad


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_the_pytorch_path_forward_and_backward(fused_kernels, dtype, padded):
    out, weight_grad, _ = _rows_and_gradient(True, dtype, padded)
    expected, expected_grad, _ = _rows_and_gradient(False, dtype, padded)
    assert out.dtype == dtype and out.shape == expected.shape
    assert torch.equal(out, expected)
    used = _batch(padded)[1].used
    assert (out[:used] == 0).float().mean().item() == pytest.approx(P, abs=0.05)  # dropout's zeros
    if dtype == torch.float32:  # the same products, summed in the same order
        assert torch.equal(weight_grad, expected_grad)
    assert weight_grad[0].eq(0).all() and weight_grad[3].ne(0).any()  # PAD's row gets none, a word's some


@pytest.mark.parametrize("padded", [True, False])
def test_the_bf16_weight_gradient_is_the_exact_sum_rounded_once(fused_kernels, padded):
    """Each token's gradient rows summed in fp32 and rounded to bf16 once: within bf16's rounding of
    the exact (fp64) sum, for a token that dozens of rows read too."""
    _, weight_grad, grad = _rows_and_gradient(True, torch.bfloat16, padded)
    tokens, rows = _batch(padded)
    torch.manual_seed(7)
    key, dropped_below, dropout_scale = kernel_mask(P)  # the mask the fused path drew
    where = torch.arange(tokens.numel()) if rows.tokens is None else rows.tokens  # each row's flat position
    kept = fused_kernels.dropout(torch.ones(tokens.numel(), WIDTH), None, key, dropped_below, dropout_scale)[where]
    words = _words_kept(tokens).reshape(-1)[where, None]
    rows_grad = grad.double()[: rows.used] * kept.double() * SCALE * words
    exact = torch.zeros(VOCAB, WIDTH, dtype=torch.float64).index_add_(0, tokens.reshape(-1)[where], rows_grad)
    assert weight_grad.dtype == torch.bfloat16
    assert ((weight_grad.double() - exact).abs() <= exact.abs() * 2**-8).all()


def test_any_thread_count_gives_the_same_bits(fused_kernels):
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(_rows_and_gradient(True, torch.bfloat16, True)[:2])
    finally:
        torch.set_num_threads(threads)
    for out, weight_grad in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(weight_grad, results[0][1])


def test_a_training_model_embeds_through_it(fused_kernels, monkeypatch):
    """In training, the model's stack input comes from the fused kernel (with its word dropout and
    dropout), and equals its PyTorch path, `embed`, flattened, forward and backward."""
    config = ModelConfig(d_model=WIDTH, heads=2, ffn_dim=32, encoder_layers=1, decoder_layers=1, dropout=P,
                         target_word_dropout=0.25)  # fmt: skip
    model = Seq2SeqTransformer(config, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB).train()
    tokens, rows = _batch(padded=True)
    calls = []
    monkeypatch.setattr(transformer, "embedded_rows", lambda *args: calls.append(args) or embedded_rows(*args))
    outputs = []
    for fused in (True, False):
        model.zero_grad()
        torch.manual_seed(7)
        if fused:
            out = model.embed_rows(model.tgt_embed, tokens, rows, 0, config.target_word_dropout)
        else:
            out = rows.flatten(model.embed(model.tgt_embed, tokens, 0, config.target_word_dropout))
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(4)))
        outputs.append((out, model.tgt_embed.weight.grad.clone()))
    assert len(calls) == 1
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    words_kept = calls[0][5]
    assert not words_kept.all() and words_kept.any()  # word dropout dropped some words, as the PyTorch path did

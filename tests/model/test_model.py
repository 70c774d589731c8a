"""The Transformer: parity with torch.nn.Transformer, masks that block what they must, cache == full pass."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import seq2seq.model.dropout as dropout_module
from seq2seq.config import ModelConfig
from seq2seq.data.batching import POSITION_MULTIPLE
from seq2seq.data.special_tokens import PAD_ID, padding_mask
from seq2seq.model.cpu_kernels import SWITCH as CPU_KERNELS_SWITCH
from seq2seq.model.embedding import sinusoidal_positions
from seq2seq.model.execution import attention, split_heads
from seq2seq.model.interop import to_torch_transformer
from seq2seq.model.layers import memory_keys_values, stack_input
from seq2seq.model.rows import ROW_MULTIPLE, Memory, Rows
from seq2seq.model.transformer import Seq2SeqTransformer
from seq2seq.training.train_step import compile_for_training
from tests.model.test_cpu_linear import DispatchedOps

D_MODEL, HEADS, FFN, LAYERS, VOCAB = 32, 4, 64, 2, 50


def make_model(norm: str = "post", **overrides) -> Seq2SeqTransformer:
    settings = dict(
        d_model=D_MODEL, heads=HEADS, encoder_layers=LAYERS, decoder_layers=LAYERS, ffn_dim=FFN, dropout=0.0
    )
    config = ModelConfig(**{**settings, "norm": norm, **overrides})
    return Seq2SeqTransformer(config, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB).eval()


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_layers_match_torch_transformer_with_padding(norm):
    ours = make_model(norm)
    with torch.no_grad():  # random biases and LayerNorm parameters too, so every mapped tensor matters
        for param in ours.parameters():
            param.normal_(0.0, 0.3)
    ref = to_torch_transformer(ours)
    src_tokens = torch.randint(4, VOCAB, (3, 7))
    src_tokens[0, 5:] = PAD_ID
    src_tokens[2, 3:] = PAD_ID
    src_embedded, tgt_embedded = torch.randn(3, 7, D_MODEL), torch.randn(3, 6, D_MODEL)
    src_mask = padding_mask(src_tokens)
    src_rows, tgt_rows = Rows(3, 7, ROW_MULTIPLE), Rows(3, 6, ROW_MULTIPLE)  # with padding rows, as in bf16
    with torch.no_grad():
        layers = list(ours.encoder_layers)
        (x, h), next_norms = stack_input(
            src_rows.flatten(src_embedded), layers, ours.encoder_norm, pre_norm=ours.pre_norm
        )
        for layer, next_norm in zip(layers, next_norms, strict=True):
            x, h = layer(x, h, src_rows, src_mask, next_norm)
        memory = Memory(src_rows.unflatten(h), src_mask, ROW_MULTIPLE)
        layers = list(ours.decoder_layers)
        (x, h), next_norms = stack_input(
            tgt_rows.flatten(tgt_embedded), layers, ours.decoder_norm, pre_norm=ours.pre_norm
        )
        every = memory_keys_values([layer.cross_attn for layer in layers], memory)
        for layer, memory_kv, next_norm in zip(layers, every, next_norms, strict=True):
            x, h = layer(x, h, tgt_rows, memory_kv, src_mask, None, next_norm)
        out = tgt_rows.unflatten(h)
        expected = ref(
            src_embedded,
            tgt_embedded,
            tgt_mask=nn.Transformer.generate_square_subsequent_mask(6),
            src_key_padding_mask=src_tokens == PAD_ID,
            memory_key_padding_mask=src_tokens == PAD_ID,
        )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_sinusoidal_positions_follow_the_paper_for_any_length():
    d_model = 16
    table = sinusoidal_positions(torch.arange(10_000), d_model)  # far past the usual 5000-row table
    pos, i = 9_999, 3
    angle = pos / 10000 ** (2 * i / d_model)
    assert table.shape == (10_000, d_model)
    assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-3)
    assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-3)
    assert torch.equal(table[0, 0::2], torch.zeros(d_model // 2))
    assert torch.equal(table[0, 1::2], torch.ones(d_model // 2))


def test_changing_a_future_target_token_leaves_earlier_outputs_unchanged():
    model = make_model("pre")
    src = torch.randint(4, VOCAB, (2, 5))
    tgt = torch.randint(4, VOCAB, (2, 8))
    changed = tgt.clone()
    changed[:, 5] = (changed[:, 5] + 1 - 4) % (VOCAB - 4) + 4
    with torch.no_grad():
        before, after = model(src, tgt), model(src, changed)
    assert torch.equal(before[:, :5], after[:, :5])
    assert not torch.allclose(before[:, 5:], after[:, 5:])


def test_changing_a_padded_source_token_leaves_outputs_unchanged():
    model = make_model("post")
    src = torch.randint(4, VOCAB, (2, 6))
    src[:, 4:] = PAD_ID
    tgt = torch.randint(4, VOCAB, (2, 5))
    src_mask = padding_mask(src)  # the mask of the real sentence: the padded slots hold other ids below
    garbage = src.clone()
    garbage[:, 4:] = 7
    with torch.no_grad():
        clean = model.decode(tgt, model.encode(src, src_mask), src_mask)
        noisy = model.decode(tgt, model.encode(garbage, src_mask), src_mask)
    assert torch.equal(clean, noisy)


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_cached_step_by_step_logits_equal_the_full_forward_pass(norm):
    model = make_model(norm)
    src = torch.randint(4, VOCAB, (3, 6))
    src[1, 4:] = PAD_ID
    tgt = torch.randint(4, VOCAB, (3, 9))
    with torch.no_grad():
        full = model(src, tgt)
        src_mask = padding_mask(src)
        memory = model.encode(src, src_mask)
        cache = model.new_cache()
        steps = [model.decode(tgt[:, t : t + 1], memory, src_mask, cache) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == tgt.size(1)


def test_cache_accepts_a_prefix_then_single_steps():
    model = make_model("pre")
    src, tgt = torch.randint(4, VOCAB, (2, 5)), torch.randint(4, VOCAB, (2, 7))
    with torch.no_grad():
        full = model(src, tgt)
        src_mask = padding_mask(src)
        memory = model.encode(src, src_mask)
        cache = model.new_cache()
        first = model.decode(tgt[:, :4], memory, src_mask, cache)
        rest = model.decode(tgt[:, 4:], memory, src_mask, cache)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=1e-5)


def test_shared_embeddings_are_one_matrix_and_scaled():
    model = make_model("post", share_embeddings=True)
    assert model.src_embed.weight is model.tgt_embed.weight is model.output_proj.weight
    separate = make_model("post", share_embeddings=False, tie_output=False)
    assert separate.src_embed.weight is not separate.tgt_embed.weight
    assert separate.output_proj.weight is not separate.tgt_embed.weight
    # the embedding is scaled by sqrt(d_model) before the positions are added (Vaswani et al. 3.4)
    tokens = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        embedded = model.embed(model.src_embed, tokens, 0)
        expected = model.src_embed.weight[tokens] * math.sqrt(D_MODEL) + sinusoidal_positions(torch.arange(3), D_MODEL)
    torch.testing.assert_close(embedded, expected)


def test_gelu_activation_changes_the_output():
    torch.manual_seed(1)
    relu = make_model("pre")
    torch.manual_seed(1)
    gelu = make_model("pre", activation="gelu")
    src, tgt = torch.randint(4, VOCAB, (1, 4)), torch.randint(4, VOCAB, (1, 4))
    with torch.no_grad():
        assert not torch.allclose(relu(src, tgt), gelu(src, tgt))


def test_cross_attention_maps_are_distributions_over_real_source_tokens():
    model = make_model("pre")
    src = torch.randint(4, VOCAB, (1, 6))
    src[0, 4:] = PAD_ID
    maps = model.cross_attention(src, torch.randint(4, VOCAB, (1, 3)))
    assert maps.shape == (LAYERS, 1, HEADS, 3, 6)
    torch.testing.assert_close(maps.sum(-1), torch.ones(LAYERS, 1, HEADS, 3))
    assert torch.all(maps[..., 4:] == 0)


def _padded_pairs() -> tuple[Tensor, Tensor, Tensor, list[tuple[int, int]]]:
    """Three pairs of different source and target lengths, right-padded: src, tgt_in, tgt_out, lengths."""
    lengths = [(7, 6), (3, 2), (5, 4)]
    src = torch.full((3, 7), PAD_ID)
    tgt_in, tgt_out = torch.full((3, 6), PAD_ID), torch.full((3, 6), PAD_ID)
    for row, (source, target) in enumerate(lengths):
        src[row, :source] = torch.randint(4, VOCAB, (source,))
        tgt_in[row, :target] = torch.randint(4, VOCAB, (target,))
        tgt_out[row, :target] = torch.randint(4, VOCAB, (target,))
    return src, tgt_in, tgt_out, lengths


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_a_padded_batch_has_the_logits_and_gradients_of_its_sentences_alone(norm):
    """PAD positions change nothing that training reads: the logits of every real position, and the
    gradient of the summed loss, equal those of each sentence run without any padding."""
    torch.manual_seed(0)
    model = make_model(norm)
    src, tgt_in, tgt_out, lengths = _padded_pairs()

    def loss_and_grads(logits: Tensor, gold: Tensor) -> tuple[Tensor, list[Tensor]]:
        loss = F.cross_entropy(logits.flatten(0, 1), gold.flatten(), ignore_index=PAD_ID, reduction="sum")
        model.zero_grad()
        loss.backward()
        return loss.detach(), [param.grad.clone() for param in model.parameters()]

    batched = model(src, tgt_in)
    batched_loss, batched_grads = loss_and_grads(batched, tgt_out)
    alone_loss, alone_grads = 0.0, [torch.zeros_like(param) for param in model.parameters()]
    for row, (source, target) in enumerate(lengths):
        logits = model(src[row : row + 1, :source], tgt_in[row : row + 1, :target])
        torch.testing.assert_close(batched[row, :target], logits[0], atol=1e-5, rtol=1e-5)
        loss, grads = loss_and_grads(logits, tgt_out[row : row + 1, :target])
        alone_loss += loss
        alone_grads = [total + grad for total, grad in zip(alone_grads, grads)]
    torch.testing.assert_close(batched_loss, alone_loss, atol=1e-4, rtol=1e-5)
    for batched_grad, alone_grad in zip(batched_grads, alone_grads):
        torch.testing.assert_close(batched_grad, alone_grad, atol=1e-5, rtol=1e-4)


GATHERS = {"index_select", "index_fill_", "index_fill", "index_add", "index_add_", "index_copy_", "gather", "scatter"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("norm", ["post", "pre"])
def test_training_reads_the_stacks_rows_as_they_stand(cpu_path, norm, dtype):
    """A CPU step's flat rows are the first of the batch's target positions as training lists them
    (Batch.target_positions: the real ones in order, then padding to a multiple of 64, as bf16 rows
    are padded), so the loss reads the decoder's rows, and the cross-attentions the encoder's, as
    they stand: the real rows and every gradient are those of the gathered positions, bit for bit,
    and with the fused kernels the step gathers nothing, forward or backward. Positions listed
    otherwise are gathered."""
    torch.manual_seed(0)
    model = make_model(norm, dropout=0.1).to(dtype).train()
    src, tgt_in, tgt_out, _ = _padded_pairs()
    real = (tgt_out.flatten() != PAD_ID).nonzero().squeeze(1)
    positions = F.pad(real, (0, -real.numel() % POSITION_MULTIPLE))  # as batching.make_batch pads them
    weights = torch.randn(real.numel(), D_MODEL)

    def rows_and_gradients(forward) -> tuple[Tensor, list[Tensor]]:
        torch.manual_seed(1)  # the same dropout masks
        rows = forward()[: real.numel()]
        model.zero_grad()
        (rows.float() * weights).sum().backward()
        return rows.detach(), [param.grad.clone() for param in model.parameters()]

    with DispatchedOps() as dispatched:
        flat, flat_gradients = rows_and_gradients(lambda: model(src, tgt_in, positions, output_layer=False))
    mask = padding_mask(src)
    gathered, gathered_gradients = rows_and_gradients(
        lambda: model.decode_hidden(tgt_in, model.encode(src, mask), mask).flatten(0, 1)[positions]
    )
    assert torch.equal(flat, gathered)
    for name, a, b in zip([name for name, _ in model.named_parameters()], flat_gradients, gathered_gradients):
        assert torch.equal(a, b), name
    if cpu_path == "fused":
        assert not GATHERS & set(dispatched.names), sorted(GATHERS & set(dispatched.names))
    shuffled = positions[torch.randperm(positions.numel())]  # positions in another order: gathered
    with torch.no_grad():
        assert model(src, tgt_in, positions, output_layer=False).shape == (positions.numel(), D_MODEL)
        torch.manual_seed(1)
        rows = model(src, tgt_in, shuffled, output_layer=False)
        torch.manual_seed(1)
        assert torch.equal(rows, model.decode_hidden(tgt_in, model.encode(src, mask), mask).flatten(0, 1)[shuffled])


def test_position_wise_layers_compute_the_tokens_and_not_the_padding_on_cpu(monkeypatch):
    """rows.Rows: on CPU, every linear but the output layer (self-attention's q, k, v projected
    together, the cross-attentions' k, v of the memory, every decoder layer's in one product, the
    feed-forward) runs on the token positions alone."""
    model = make_model("pre", ffn_dim=5 * D_MODEL)  # every projection's width tells which it is
    src, tgt_in, _, lengths = _padded_pairs()
    linear, calls = F.linear, []

    def counting(x, weight, bias=None):
        calls.append((weight.size(0), x.size(0)))
        return linear(x, weight, bias)

    monkeypatch.setattr(F, "linear", counting)
    with torch.no_grad():
        model(src, tgt_in)
    source_tokens, target_tokens = sum(s for s, _ in lengths), sum(t for _, t in lengths)
    d, config = model.config.d_model, model.config
    assert calls.count((3 * d, source_tokens)) == config.encoder_layers
    assert calls.count((3 * d, target_tokens)) == config.decoder_layers
    assert calls.count((2 * d * config.decoder_layers, source_tokens)) == 1
    assert 2 * config.decoder_layers not in (3, 5)  # the widths tell the projections apart
    assert {rows for width, rows in calls if width != model.output_proj.out_features} == {source_tokens, target_tokens}
    assert source_tokens < src.numel() and target_tokens < tgt_in.numel()


@pytest.mark.parametrize(
    "keep",
    [torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]).bool(), torch.ones(3, 4, dtype=torch.bool)],
    ids=["some-positions", "every-position"],
)
@pytest.mark.parametrize("multiple", [1, ROW_MULTIPLE])
def test_rows_move_values_and_gradients_as_plain_indexing_does(keep, multiple):
    """Rows.flatten and Rows.unflatten (one pass each way) against the same moves by boolean indexing."""
    rows, kept = Rows.of(keep, multiple), keep.reshape(-1)
    x = torch.randn(3, 4, 5, requires_grad=True)
    flat = rows.flatten(x)
    expected = torch.cat([x.reshape(12, 5)[kept], x.new_zeros(rows.padded - rows.used, 5)])
    assert torch.equal(flat, expected)
    weight = torch.randn(rows.padded, 5)
    (gradient,) = torch.autograd.grad((flat * weight).sum(), x)
    assert torch.equal(gradient.reshape(12, 5)[kept], weight[: rows.used]) and not gradient.reshape(12, 5)[~kept].any()

    y = torch.randn(rows.padded, 5, requires_grad=True)
    out = rows.unflatten(y)
    expected = y.new_zeros(12, 5)
    expected[kept] = y[: rows.used]
    assert torch.equal(out, expected.view(3, 4, 5))
    weight = torch.randn(3, 4, 5)
    (gradient,) = torch.autograd.grad((out * weight).sum(), y)
    assert torch.equal(gradient[: rows.used], weight.reshape(12, 5)[kept]) and not gradient[rows.used :].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16 attending in fp32"])
@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2)], ids=["every part", "one part unused"])
def test_split_heads_moves_values_and_gradients_as_views_do(used, dtype):
    """execution.split_heads (q, k, v projected side by side) against a cast, view, permute and unbind;
    a part that nothing reads (no gradient) must get a zero gradient, and the gradient comes back in
    the projections' dtype (bf16 projections that attention reads in fp32, as on a CPU)."""
    batch, length, heads, head_dim = 2, 5, 3, 4
    fused = torch.randn(batch, length, 3 * heads * head_dim, dtype=dtype, requires_grad=True)
    ours = split_heads(fused, 3, heads, torch.float32)
    theirs = fused.float().view(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    assert all(
        torch.equal(a, b) and a.shape == (batch, heads, length, head_dim) and a.dtype == torch.float32
        for a, b in zip(ours, theirs)
    )
    weights = [torch.randn(batch, heads, length, head_dim) for _ in range(3)]
    gradients = [
        torch.autograd.grad(sum((parts[i] * weights[i]).sum() for i in used), fused)[0] for parts in (ours, theirs)
    ]
    assert gradients[0].dtype == dtype and torch.equal(*gradients)


def test_rows_list_no_token_positions_off_the_cpu():
    """Listing the kept positions (nonzero) makes the host wait for a GPU: off the CPU every position is computed."""
    keep = torch.tensor([[True, True, False], [True, False, False]])
    assert Rows.of(keep, 1).tokens.tolist() == [0, 1, 3]
    assert Rows.of(keep.to("meta"), 1).tokens is None
    assert Rows.of(torch.ones(2, 3, dtype=torch.bool), 1).tokens is None  # nothing to skip


@pytest.fixture
def gpu_code_path(monkeypatch):
    """The model as a GPU runs it, on this CPU: its two CPU-only choices off (listing the token
    positions, the cheap dropout mask)."""
    every_position = classmethod(lambda cls, keep, multiple: cls(keep.size(0), keep.size(1), multiple))
    monkeypatch.setattr(Rows, "of", every_position)
    monkeypatch.setattr(dropout_module, "dropout", lambda x, p, *, training: F.dropout(x, p, training=training))
    monkeypatch.setenv(CPU_KERNELS_SWITCH, "0")  # dropout_add: the residual's addition, then the dropout above


@pytest.mark.parametrize("code_path", ["gpu", "cpu"])
def test_training_compiles_the_model_as_one_graph(request, code_path):
    """Where training is compiled, nothing in the model may break torch.compile's graph: each break
    is a piece compiled and launched apart, and on Python 3.11 the lock inside
    functools.cached_property made the compiled decoder fall back to running eagerly. On a CPU the
    packed rows (nonzero) and the cheap dropout mask (random bits as int16) broke it at every layer,
    and a break inside the layer loop ran the stacks eagerly. fullgraph=True raises at the first break."""
    if code_path == "gpu":
        request.getfixturevalue("gpu_code_path")
    model = make_model("post", dropout=0.1).train()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="eager")
    src, tgt_in, _, _ = _padded_pairs()
    for cut in (0, 1):  # a second batch of other lengths runs through the same graph
        compiled(src[:, cut:], tgt_in[:, : tgt_in.size(1) - cut], output_layer=False).sum().backward()
    assert all(parameter.grad is not None for parameter in model.parameters())


@pytest.mark.usefixtures("gpu_code_path")
def test_compiled_training_traces_once_when_the_first_batch_has_equal_source_and_target_lengths(monkeypatch):
    """torch.compile gives sizes that are equal at the first trace one symbol: a first batch whose
    sources and targets were equally long compiled a graph for equal lengths alone, and every GPU run
    whose first batch was such compiled twice. compile_for_training keeps them apart: one graph serves
    every later batch."""
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compile_with = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda module, **options: compile_with(module, **options, backend=counting_backend)
    )
    model = make_model("post", dropout=0.1).train()
    forward = compile_for_training(model)
    for sentences, source_length, target_length in ((4, 9, 9), (3, 11, 7), (5, 6, 13), (2, 12, 12)):
        src, tgt_in = (
            torch.randint(4, VOCAB, (sentences, source_length)),
            torch.randint(4, VOCAB, (sentences, target_length)),
        )
        forward(src, tgt_in, output_layer=False).sum().backward()
    assert len(graphs) == 1


def test_beams_sharing_one_memory_row_equal_a_repeated_memory():
    model = make_model("pre")
    src = torch.randint(4, VOCAB, (2, 6))
    src[1, 3:] = PAD_ID
    beams = 3
    tgt = torch.randint(4, VOCAB, (2 * beams, 5))
    tgt[1, 3:] = PAD_ID  # a shorter target too: its PAD positions are skipped on CPU (rows.Rows)
    with torch.no_grad():
        src_mask = padding_mask(src)
        memory = model.encode(src, src_mask)
        shared = model.decode(tgt, memory, src_mask)  # (B*K rows against B memory rows)
        repeated = model.decode(tgt, memory.repeat_interleave(beams, 0), src_mask.repeat_interleave(beams, 0))
    torch.testing.assert_close(shared, repeated, atol=1e-5, rtol=1e-5)


def test_bf16_cpu_attention_path_matches_the_fused_kernel():
    model = make_model("pre")
    src = torch.randint(4, VOCAB, (2, 6))
    src[1, 4:] = PAD_ID
    tgt = torch.randint(4, VOCAB, (2, 5))
    with torch.no_grad():
        fp32 = model(src, tgt)  # fused scaled_dot_product_attention
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = model(src, tgt)  # bf16 projections, attention itself in fp32 (execution._cpu_bf16_attention)
    assert bf16.dtype == torch.bfloat16
    torch.testing.assert_close(bf16.float(), fp32, atol=0.15, rtol=0.05)
    assert (bf16.float().argmax(-1) == fp32.argmax(-1)).float().mean() > 0.9


def test_bf16_cpu_attention_with_dropout_is_the_same_attention_on_average():
    """With attention dropout the fused CPU kernels do not apply and the explicit path runs: averaged
    over many dropout masks it must give what the fused kernel gives without dropout."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, 5, 8).bfloat16() for _ in range(3))
    mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2]).view(2, 1, 1, 5)
    without = attention(q, k, v, mask=mask, is_causal=False, dropout_p=0.0)
    draws = torch.stack([attention(q, k, v, mask=mask, is_causal=False, dropout_p=0.2) for _ in range(3000)])
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    torch.testing.assert_close(without.double(), exact, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(draws.double().mean(0), exact, atol=5e-2, rtol=0)
    assert not torch.equal(draws[0], draws[1])  # dropout did act


def test_bf16_cpu_attention_keeps_scores_and_softmax_in_fp32():
    """Scores rounded to bf16 before the softmax raised the demo's validation loss on 7 of 8 seeds."""
    torch.manual_seed(0)
    attention = make_model().encoder_layers[0].self_attn
    query = torch.randn(2 * 7, D_MODEL) * 4  # flat rows of 2 sentences x 7 positions
    k = (torch.randn(2, HEADS, 9, D_MODEL // HEADS) * 4).bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        probabilities = attention.weights(query, Rows(2, 7), k, mask=None)
        q = attention.q_proj(query).view(2, 7, HEADS, -1).transpose(1, 2)  # the same bf16 queries
    expected = (q.float() @ k.float().transpose(-2, -1) * (D_MODEL // HEADS) ** -0.5).softmax(-1)
    assert probabilities.dtype == torch.float32
    torch.testing.assert_close(probabilities, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_bf16_training_path_computes_attention_in_fp32(is_causal):
    """The fused path training runs (execution._cpu_bf16_attention): bf16 q, k, v in, and the result is
    fp32 attention rounded once to bf16 at the end, not attention over bf16-rounded scores."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, 9, D_MODEL // HEADS).mul(4).bfloat16() for _ in range(3))
    out = attention(q, k, v, mask=None, is_causal=is_causal, dropout_p=0.0)
    scores = q.double() @ k.double().transpose(-2, -1) * (D_MODEL // HEADS) ** -0.5
    if is_causal:
        scores = scores.masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    exact = scores.softmax(-1) @ v.double()
    rounded_scores = scores.bfloat16().double().softmax(-1) @ v.double()  # what bf16 scores would give
    assert out.dtype == torch.bfloat16
    ours, theirs = (out.double() - exact).abs().max(), (rounded_scores - exact).abs().max()
    assert ours <= exact.abs().max() * 2**-8  # one bf16 rounding of the output, nothing more
    assert theirs > 2 * ours  # the check can tell the two apart


def test_layerdrop_skips_each_layer_at_its_rate_in_training_and_none_in_evaluation():
    """decoder_layerdrop 0.5: over 400 training passes each decoder layer runs about half the time
    (within 5 standard deviations) and every encoder layer always; in evaluation every layer runs."""
    model = make_model(decoder_layerdrop=0.5)
    runs = {name: 0 for name in ("encoder_layers.0", "encoder_layers.1", "decoder_layers.0", "decoder_layers.1")}
    for name, module in model.named_modules():
        if name in runs:
            module.register_forward_hook(lambda *args, name=name: runs.__setitem__(name, runs[name] + 1))
    src, tgt = torch.randint(4, VOCAB, (2, 5)), torch.randint(4, VOCAB, (2, 4))
    model.train()
    for _ in range(400):
        model(src, tgt)
    assert runs["encoder_layers.0"] == runs["encoder_layers.1"] == 400
    assert all(abs(runs[f"decoder_layers.{i}"] - 200) <= 5 * math.sqrt(100) for i in (0, 1))
    model.eval()
    before = dict(runs)
    model(src, tgt)
    assert all(runs[name] == before[name] + 1 for name in runs)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("skipped", [{0}, {1}, {0, 1}], ids=["first", "last", "both"])
def test_a_stack_with_layers_skipped_is_the_stack_without_them(norm, skipped):
    """LayerDrop skipping encoder and decoder layers `skipped` gives what a model without those layers
    gives (a pre-norm layer's LayerNorm is applied by the layer before it: a skipped layer's must not
    be), and with every layer skipped, the stacks' last LayerNorms of the embeddings."""
    model = make_model(norm, encoder_layerdrop=0.5, decoder_layerdrop=0.5)
    with torch.no_grad():  # LayerNorm parameters of their own, so that using the wrong one shows
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    decisions = iter([index in skipped for index in range(LAYERS)] * 2)  # the encoder's, then the decoder's
    model._skipped = lambda layerdrop: model.training and next(decisions)
    src, tgt = torch.randint(4, VOCAB, (2, 5)), torch.randint(4, VOCAB, (2, 4))
    with torch.no_grad():
        out = model.train()(src, tgt)  # dropout 0: training differs from evaluation only by LayerDrop
        kept = [index for index in range(LAYERS) if index not in skipped]
        model.encoder_layers = nn.ModuleList(model.encoder_layers[index] for index in kept)
        model.decoder_layers = nn.ModuleList(model.decoder_layers[index] for index in kept)
        expected = model.eval()(src, tgt)
    torch.testing.assert_close(out, expected)


def test_target_word_dropout_zeroes_whole_word_embeddings_in_training_only():
    """target_word_dropout 0.5: about half the target tokens enter the decoder as their position alone."""
    model = make_model(target_word_dropout=0.5)
    tokens = torch.randint(4, VOCAB, (40, 50))
    positions = sinusoidal_positions(torch.arange(50), D_MODEL)
    model.train()
    embedded = model.embed(model.tgt_embed, tokens, 0, model.config.target_word_dropout)
    dropped = (embedded - positions).abs().amax(-1) < 1e-6  # (40, 50): the word's embedding is gone
    assert abs(dropped.float().mean().item() - 0.5) < 0.05
    kept = model.embed(model.tgt_embed, tokens, 0) - positions  # the same words, never dropped
    torch.testing.assert_close((embedded - positions)[~dropped], kept[~dropped])
    model.eval()
    assert not ((model.embed(model.tgt_embed, tokens, 0, 0.5) - positions).abs().amax(-1) < 1e-6).any()

"""Long bf16 runs on CPU keep flat memory: once the shapes of a corpus's batches were seen, training
compiles no new oneDNN kernels (each is kept in a per-shape cache) and RSS stops growing."""

from __future__ import annotations

import pytest
import torch

from seq2seq.config import ModelConfig, TokenizerConfig, TrainConfig
from seq2seq.data.batching import epoch_batches, make_batch
from seq2seq.data.encoded import encode_pairs
from seq2seq.layers import RowRoundedLinear
from seq2seq.model import build_model
from seq2seq.run_log import PeakRss, current_rss_mb
from seq2seq.tokenizer import train_tokenizer
from seq2seq.train_step import build_optimizer, build_scaler, train_step

MODEL = ModelConfig(d_model=64, heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=128)
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or current_rss_mb() is None,
    reason="needs oneDNN (PyTorch's CPU build) and /proc for RSS",
)


def test_bf16_training_memory_is_flat_once_the_batch_shapes_were_seen(demo_pairs, capfd):
    tokenizer = train_tokenizer(TokenizerConfig(vocab_size=400), demo_pairs["train"][:1500])
    corpus = encode_pairs(tokenizer, demo_pairs["train"][:1500])
    config = TrainConfig(precision="bf16")
    model = build_model(MODEL, tokenizer)
    optimizer, scaler = build_optimizer(model, config), build_scaler(CPU, "bf16")

    def train_epoch(epoch: int) -> int:
        batches = epoch_batches(corpus, max_tokens=1024, seed=1, epoch=epoch)
        for indices in batches:
            batch = make_batch(corpus, indices)
            train_step(model, optimizer, scaler, [batch], update_tokens=batch.num_tokens, lr=1e-4, config=config)
        return len(batches)

    for epoch in (1, 2):  # every shape of this corpus's batches is met once
        train_epoch(epoch)
    capfd.readouterr()
    rss_before = current_rss_mb()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        steps = sum(train_epoch(epoch) for epoch in (3, 4, 5))
    growth = current_rss_mb() - rss_before
    created = capfd.readouterr().out.count("create:cache_miss")
    assert created <= steps // 10, f"{created} new oneDNN kernels in {steps} steps"
    assert growth < 32, f"RSS grew by {growth:.0f} MiB in {steps} steps"


def test_freed_heap_holes_go_back_to_the_kernel():
    """Blocks freed between long-lived ones stay resident under glibc until release_free_heap()."""
    from seq2seq.host_memory import release_free_heap

    held, transient = [], []
    for size in range(300):  # varying sizes below glibc's 32 MiB mmap ceiling, as activations are
        transient.append(torch.ones(250_000 + 1_000 * size, dtype=torch.uint8))
        held.append(torch.ones(64, dtype=torch.uint8))  # a small survivor after each: holes, not a top
    before = current_rss_mb()
    transient.clear()
    if not release_free_heap():
        pytest.skip("no glibc malloc_trim here")
    assert current_rss_mb() < before - 40, f"RSS {before:.0f} -> {current_rss_mb():.0f} MiB"
    assert len(held) == 300


def test_the_window_peak_keeps_the_top_of_a_step_that_rss_now_no_longer_shows():
    """metrics.jsonl's window_peak_rss_mb: a step's activations are freed before the log line reads RSS."""
    peaks = PeakRss()
    activations = torch.ones(200 * 2**20, dtype=torch.uint8)  # above the mmap threshold: freed at once
    del activations
    now, peak = current_rss_mb(), peaks.take()
    if peak is None:
        pytest.skip("the kernel's high-water mark cannot be reset here")
    assert peak > now + 150, f"window peak {peak:.0f} MiB, now {now:.0f} MiB"
    assert peaks.take() < peak - 150  # a new window
    assert peaks.process_peak >= peak


def test_linear_layers_compile_one_kernel_set_for_many_row_counts(capfd):
    """Each epoch cuts batches of new sentences x length products; each used to cost oneDNN kernels."""
    layer = RowRoundedLinear(32, 48)
    capfd.readouterr()
    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION),
    ):
        for rows in range(129, 193):  # 64 row counts, all rounded to 192
            layer(torch.randn(rows, 32, requires_grad=True)).sum().backward()
    created = capfd.readouterr().out.count("create:cache_miss")
    assert created <= 6, f"{created} new oneDNN kernels for 64 row counts"


def test_row_rounded_linear_gives_nn_linear_outputs_and_gradients():
    torch.manual_seed(0)
    rounded, plain = RowRoundedLinear(64, 96), torch.nn.Linear(64, 96)
    plain.load_state_dict(rounded.state_dict())
    x = torch.randn(3, 23, 64, requires_grad=True)  # 69 rows: padded to 128 inside
    y = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_rounded, out_plain = rounded(x), plain(y)
    out_rounded.float().square().sum().backward()
    out_plain.float().square().sum().backward()
    assert out_rounded.shape == out_plain.shape and torch.allclose(out_rounded.float(), out_plain.float(), atol=1e-2)
    assert torch.allclose(x.grad, y.grad, atol=1e-2)
    assert torch.allclose(rounded.weight.grad, plain.weight.grad, rtol=1e-2, atol=1e-2)
    assert torch.allclose(rounded.bias.grad, plain.bias.grad, rtol=1e-2, atol=1e-2)

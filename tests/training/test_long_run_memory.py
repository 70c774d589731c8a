"""Long bf16 runs on CPU keep flat memory: once the shapes of a corpus's batches were seen, training
compiles no new oneDNN kernels (each is kept in a per-shape cache) and RSS stops growing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from seq2seq.config import ModelConfig, TokenizerConfig, TrainConfig
from seq2seq.data.batching import collate, epoch_batches, make_batch
from seq2seq.data.encoded import encode_pairs
from seq2seq.data.special_tokens import PAD_ID, padding_mask
from seq2seq.data.tokenizer import train_tokenizer
from seq2seq.model.cpu_linear import onednn_runs_bf16
from seq2seq.model.rows import ROW_MULTIPLE
from seq2seq.model.transformer import build_model
from seq2seq.training.loss import output_layer_loss
from seq2seq.training.optimizer import build_optimizer
from seq2seq.training.run_log import current_rss_mb
from seq2seq.training.train_step import build_scaler, train_step

MODEL = ModelConfig(d_model=64, heads=4, encoder_layers=1, decoder_layers=1, ffn_dim=128)
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(current_rss_mb() is None, reason="needs /proc for RSS")
# The kernel-cache tests count the bf16 kernels oneDNN creates; a CPU it has no bf16 kernels for (AVX2
# only: bf16 is emulated outside oneDNN) creates none, so there they could not fail and mean nothing.
needs_onednn_bf16 = pytest.mark.skipif(
    not onednn_runs_bf16(), reason="oneDNN has no bf16 kernels for this CPU (AVX2 only): no kernel cache to grow"
)


@needs_onednn_bf16
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
    from seq2seq.training.host_memory import release_free_heap

    held, transient = [], []
    for size in range(300):  # varying sizes below glibc's 32 MiB mmap ceiling, as activations are
        transient.append(torch.ones(250_000 + 1_000 * size, dtype=torch.uint8))
        held.append(torch.ones(64, dtype=torch.uint8))  # a small survivor after each: holes, not a top
    before = current_rss_mb()
    transient.clear()
    if not release_free_heap():
        pytest.skip("glibc's malloc does not serve this process, or has no malloc_trim here")
    assert current_rss_mb() < before - 40, f"RSS {before:.0f} -> {current_rss_mb():.0f} MiB"
    assert len(held) == 300


WINDOW_PEAK_PROBE = """
import json, torch
from seq2seq.training.run_log import PeakRss, current_rss_mb
peaks = PeakRss()
activations = torch.ones(200 * 2**20, dtype=torch.uint8)  # above the mmap threshold: freed at once
del activations
now, peak = current_rss_mb(), peaks.take()
print(json.dumps({"now": now, "peak": peak, "next": peaks.take(), "process_peak": peaks.process_peak}))
"""


def test_the_window_peak_keeps_the_top_of_a_step_that_rss_now_no_longer_shows():
    """metrics.jsonl's window_peak_rss_mb: a step's activations are freed before the log line reads RSS.
    RSS is the whole process's, so the probe runs in a process of its own: in the suite's, threads
    that earlier tests left could move it while it measures; under glibc's malloc, which frees a block
    that large at once (a preloaded tcmalloc keeps it)."""
    glibc = {name: value for name, value in os.environ.items() if name != "LD_PRELOAD"}
    probe = subprocess.run([sys.executable, "-c", WINDOW_PEAK_PROBE], capture_output=True, text=True, check=True,
                           env=glibc)  # fmt: skip
    found = json.loads(probe.stdout)
    now, peak = found["now"], found["peak"]
    if peak is None:
        pytest.skip("the kernel's high-water mark cannot be reset here")
    assert peak > now + 150, f"window peak {peak:.0f} MiB, now {now:.0f} MiB"
    assert found["next"] < peak - 150  # a new window
    assert found["process_peak"] >= peak


def _shapes_of_one_row_block():
    """Batches of (sentences, source length, target length) whose source and target row counts all
    lie in (128, 192]: 24 products that training would otherwise meet one by one."""
    for sentences in (4, 6):
        for length in range(129 // sentences + 1, 192 // sentences + 1):
            yield sentences, length, length - 1


def _train_on_shape(model, sentences: int, source_length: int, target_length: int) -> None:
    """One bf16 forward and backward on a random batch of that shape, as train_step runs them."""
    src = torch.randint(4, 100, (sentences, source_length))
    tgt = torch.randint(4, 100, (sentences, target_length))
    batch = collate(list(src.numpy()), list(tgt.numpy()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows = model(batch.src, batch.tgt_in, batch.target_positions, output_layer=False)
        loss = output_layer_loss(rows, model.output_proj.weight, batch.targets, 0.1)
    loss.backward()


@needs_onednn_bf16
@pytest.mark.parametrize(("multiple", "compiles"), [(ROW_MULTIPLE, False), (1, True)], ids=["padded", "unpadded"])
def test_a_block_of_row_counts_compiles_one_set_of_kernels(multiple, compiles, monkeypatch, capfd):
    """Each epoch cuts batches of new sentences x length products; each used to cost oneDNN kernels.

    Padded, a block of row counts shares one kernel set; unpadded, the same batches create kernels,
    which shows that the count sees what it is meant to catch.
    """
    monkeypatch.setattr("seq2seq.model.transformer.row_multiple", lambda device, dtype: multiple)
    torch.manual_seed(0)
    model = build_model(MODEL, _Vocabulary())
    shapes = list(_shapes_of_one_row_block())
    _train_on_shape(model, *shapes[0])  # the block's kernel set
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
        for shape in shapes[1:]:
            _train_on_shape(model, *shape)
    created = capfd.readouterr().out.count("create:cache_miss")
    assert (created > 0) == compiles, f"{created} new oneDNN kernels for {len(shapes) - 1} more row counts"


@pytest.mark.parametrize("beams", [1, 3])
def test_padded_rows_change_no_output_and_no_gradient(beams, monkeypatch):
    """The stack's padding rows never reach attention or the output: bf16 results equal unpadded ones,
    for teacher forcing (with gradients) and for cached step-by-step decoding with beams."""
    torch.manual_seed(0)
    model = build_model(MODEL, _Vocabulary()).eval()
    src = torch.randint(4, 100, (3, 11))
    src[1, 7:] = PAD_ID
    tgt = torch.randint(4, 100, (3 * beams, 6))

    def run(multiple: int) -> tuple[torch.Tensor, ...]:
        monkeypatch.setattr("seq2seq.model.transformer.row_multiple", lambda device, dtype: multiple)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            src_mask = padding_mask(src)
            memory = model.encode(src, src_mask)
            full = model.decode(tgt, memory, src_mask)
            cache = model.new_cache()
            steps = [model.decode(tgt[:, t : t + 1], memory, src_mask, cache) for t in range(tgt.size(1))]
        full.float().square().mean().backward()
        return full, torch.cat(steps, dim=1), *(p.grad for p in model.parameters())

    padded, unpadded = run(ROW_MULTIPLE), run(1)
    torch.testing.assert_close(padded[:2], unpadded[:2], atol=0, rtol=0)  # the same bf16 matmuls, row by row
    # LayerNorm's weight gradients sum over rows in blocks that the zero rows move: fp32 rounding apart
    torch.testing.assert_close(padded[2:], unpadded[2:], atol=1e-7, rtol=1e-6)


class _Vocabulary:
    src_vocab_size = tgt_vocab_size = 100

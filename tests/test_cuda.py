"""CUDA paths: fp16 with loss scaling, bf16, fused attention. They run wherever a GPU is present
(`pytest -m gpu`); a machine without one skips them, since these paths cannot run there."""

from __future__ import annotations

import pytest
import torch

from seq2seq.config import ModelConfig
from seq2seq.config_files import config_from_dict
from seq2seq.data.batching import epoch_batches, make_batch
from seq2seq.data.special_tokens import padding_mask
from seq2seq.model.transformer import Seq2SeqTransformer
from seq2seq.training.train_step import train_step
from seq2seq.training.trainer import Trainer

from .conftest import tiny_config_dict

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def cuda_trainer(tmp_path, tiny_data, precision: str, **train) -> Trainer:
    raw = tiny_config_dict(tiny_data, precision=precision, **train)
    return Trainer(config_from_dict(raw, origin="test"), tmp_path / precision, show_progress=False)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_trains_on_cuda(tmp_path, tiny_data, precision):
    trainer = cuda_trainer(tmp_path, tiny_data, precision, max_steps=30, log_every=10, valid_every=30)
    trainer.run()
    losses = [r["loss"] for r in trainer.metrics.read() if r["kind"] == "train"]
    assert trainer.device.type == "cuda"
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert trainer.model.output_proj.weight.dtype == torch.float32  # fp32 master weights


def test_fp16_overflow_is_skipped_not_applied(tmp_path, tiny_data, monkeypatch):
    import seq2seq.training.train_step as step_module

    trainer = cuda_trainer(tmp_path, tiny_data, "fp16", max_steps=1, valid_every=100)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    real_loss = step_module.output_layer_loss
    monkeypatch.setattr(step_module, "output_layer_loss", lambda *a: real_loss(*a) * float("inf"))
    trainer.run()
    assert trainer.progress.skipped_steps == 1
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_a_training_step_never_waits_for_the_gpu(tmp_path, tiny_data, precision):
    trainer = cuda_trainer(tmp_path, tiny_data, precision, max_steps=10)
    state, config = trainer.state, trainer.config.train
    batch = make_batch(state.data.train, epoch_batches(state.data.train, max_tokens=512, seed=1, epoch=1)[0])

    def step():
        train_step(state.model, state.optimizer, state.scaler, [batch], update_tokens=batch.num_tokens, lr=1e-4,
                   config=config)  # fmt: skip

    step()  # first step: lazy optimizer state and allocator warm-up
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation now raises
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_attention_builds_no_cudnn_graph_per_shape(precision):
    """cuDNN's attention builds a graph for every new batch shape (~6 ms of host time each): training
    on token-bucketed batches must take the flash or memory-efficient kernels instead."""
    from torch.profiler import ProfilerActivity, profile

    config = ModelConfig(d_model=128, heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=256, dropout=0.0)
    model = Seq2SeqTransformer(config, src_vocab_size=50, tgt_vocab_size=50).cuda()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for length in (9, 13):  # head_dim 64, as Transformer-base: the shapes cuDNN would take
            src, tgt = (torch.randint(4, 50, (3, length), device="cuda") for _ in range(2))
            with torch.autocast("cuda", dtype=getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[precision])):
                model(src, tgt).float().sum().backward()
    names = {event.key for event in prof.key_averages()}
    assert any("attention" in name for name in names), sorted(names)  # the profile saw attention at all
    assert not [name for name in names if "cudnn_attention" in name]


def test_cached_decoding_equals_full_pass_with_fused_attention():
    config = ModelConfig(d_model=64, heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=128, dropout=0.0)
    model = Seq2SeqTransformer(config, src_vocab_size=50, tgt_vocab_size=50).cuda().eval()
    src, tgt = torch.randint(4, 50, (3, 7), device="cuda"), torch.randint(4, 50, (3, 6), device="cuda")
    with torch.no_grad():
        full = model(src, tgt)
        mask = padding_mask(src)
        memory, cache = model.encode(src, mask), model.new_cache()
        steps = torch.cat([model.decode(tgt[:, t : t + 1], memory, mask, cache) for t in range(6)], dim=1)
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("length", "kernel"), [(40, "_efficient_attention"), (200, "_flash_attention")])
def test_short_sentences_take_the_memory_efficient_kernel_long_ones_flash(length, kernel):
    """Flash attention's 128-position tiles waste most of their work on ~40-token sentences, where the
    memory-efficient kernel is faster (benchmarks/benchmark_attention.py); past SHORT_ATTENTION, flash."""
    from torch.profiler import ProfilerActivity, profile

    config = ModelConfig(d_model=128, heads=2, encoder_layers=1, decoder_layers=1, ffn_dim=256, dropout=0.0)
    model = Seq2SeqTransformer(config, src_vocab_size=50, tgt_vocab_size=50).cuda()
    tgt = torch.randint(4, 50, (3, length), device="cuda")
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.autocast("cuda", dtype=torch.bfloat16):
        model(tgt, tgt).float().sum().backward()
    names = {event.key for event in prof.key_averages()}
    assert any(kernel in name for name in names), sorted(name for name in names if "attention" in name)

"""One optimizer update, without a trainer or a run directory: exact accumulation, skipped updates."""

from __future__ import annotations

import pytest
import torch

from seq2seq.config import ModelConfig, TokenizerConfig, TrainConfig
from seq2seq.data.batching import epoch_batches, make_batch
from seq2seq.data.encoded import encode_pairs
from seq2seq.data.tokenizer import train_tokenizer
from seq2seq.model.transformer import build_model
from seq2seq.training.optimizer import build_optimizer
from seq2seq.training.train_step import build_scaler, train_step

MODEL = ModelConfig(d_model=96, heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=192, dropout=0.0)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer_and_corpus(demo_pairs):
    tokenizer = train_tokenizer(TokenizerConfig(vocab_size=400), demo_pairs["train"])
    return tokenizer, encode_pairs(tokenizer, demo_pairs["train"][:600])


def test_gradient_accumulation_equals_one_full_batch(tokenizer_and_corpus):
    tokenizer, corpus = tokenizer_and_corpus
    full, halves = build_model(MODEL, tokenizer), build_model(MODEL, tokenizer)
    halves.load_state_dict(full.state_dict())
    initial = {name: value.clone() for name, value in full.state_dict().items()}
    config = TrainConfig(precision="fp32")
    indices = epoch_batches(corpus, max_tokens=2048, seed=1, epoch=1)[0]
    whole = make_batch(corpus, indices)
    parts = [make_batch(corpus, indices[: len(indices) // 2]), make_batch(corpus, indices[len(indices) // 2 :])]
    for model, batches in ((full, [whole]), (halves, parts)):
        # Plain SGD: Adam would blow float noise in zero gradients (e.g. key biases) up to full-size steps.
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0, fused=True)
        train_step(model, optimizer, build_scaler(CPU, "fp32"), batches, update_tokens=whole.num_tokens, lr=0.5,
                   config=config)  # fmt: skip
    for (name, a), b in zip(full.named_parameters(), halves.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    moved = [name for name, value in full.named_parameters() if not torch.equal(value, initial[name])]
    assert len(moved) == len(list(full.parameters()))  # the update did move every parameter, from where it began


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_non_finite_update_is_reported_and_never_applied(tokenizer_and_corpus, monkeypatch, precision):
    import seq2seq.training.train_step as step_module

    tokenizer, corpus = tokenizer_and_corpus
    model = build_model(MODEL, tokenizer)
    config = TrainConfig(precision=precision)
    optimizer, scaler = build_optimizer(model, config), build_scaler(CPU, precision)
    batch = make_batch(corpus, epoch_batches(corpus, max_tokens=1024, seed=1, epoch=1)[0])

    def step():
        return train_step(model, optimizer, scaler, [batch], update_tokens=batch.num_tokens, lr=1e-3, config=config)

    applied = step()
    assert not applied.skipped and torch.isfinite(applied.grad_norm) and applied.loss_sum > 0
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    moments = {id(p): s["exp_avg"].clone() for p, s in optimizer.state.items()}
    real_loss = step_module.output_layer_loss
    monkeypatch.setattr(step_module, "output_layer_loss", lambda *a: real_loss(*a) * float("nan"))
    skipped = step()
    assert skipped.skipped and not torch.isfinite(skipped.grad_norm)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert all(torch.equal(s["exp_avg"], moments[id(p)]) for p, s in optimizer.state.items())


@pytest.mark.parametrize("left_in_eval", ["the whole model", "one layer"])
def test_a_step_trains_every_module_in_training_mode(tokenizer_and_corpus, left_in_eval):
    """After validation (the model in eval mode), or with any one submodule left in eval mode, a step
    puts every module of the master and of the bf16 working copy in training mode (dropout on)."""
    from seq2seq.training.working_copy import working_copy_for

    tokenizer, corpus = tokenizer_and_corpus
    model = build_model(MODEL, tokenizer)
    working = working_copy_for(model, "bf16")
    for each in (model, working.model):
        (each if left_in_eval == "the whole model" else each.decoder_layers[1]).eval()
    config = TrainConfig(precision="bf16")
    batch = make_batch(corpus, epoch_batches(corpus, max_tokens=1024, seed=1, epoch=1)[0])
    optimizer, scaler = build_optimizer(model, config), build_scaler(CPU, "bf16")
    train_step(model, optimizer, scaler, [batch], update_tokens=batch.num_tokens, lr=1e-3, config=config,
               forward=working.model, working=working)  # fmt: skip
    for each in (model, working.model):
        assert all(module.training for module in each.modules())

"""bf16 training on a working copy (training/working_copy.py): its update follows the fp32 gradient,
the master weights stay fp32 and the copy is their rounding after every update, a weight that got no
gradient is left alone, the end of an update is PyTorch's clipping and Adam, and a resumed bf16 run
is the uninterrupted one."""

from __future__ import annotations

import copy as copy_module

import pytest
import torch

from seq2seq.checkpoint import Checkpoint
from seq2seq.config import ModelConfig, TokenizerConfig, TrainConfig
from seq2seq.data.batching import epoch_batches, make_batch
from seq2seq.data.encoded import encode_pairs
from seq2seq.data.tokenizer import train_tokenizer
from seq2seq.model.transformer import build_model
from seq2seq.training.train_step import build_scaler, train_step
from seq2seq.training.working_copy import working_copy_for
from tests.conftest import make_trainer

MODEL = ModelConfig(d_model=64, heads=4, encoder_layers=2, decoder_layers=2, ffn_dim=128, dropout=0.0)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer_and_batch(demo_pairs):
    tokenizer = train_tokenizer(TokenizerConfig(vocab_size=300), demo_pairs["train"])
    corpus = encode_pairs(tokenizer, demo_pairs["train"][:300])
    return tokenizer, make_batch(corpus, epoch_batches(corpus, max_tokens=1024, seed=1, epoch=1)[0])


def one_update(model, batch, precision: str, *, model_config: ModelConfig = MODEL, weight_decay: float = 0.0):
    """The weights after one plain-SGD update of `model` at `precision`, and its working copy (if any)."""
    working = working_copy_for(model, precision)
    config = TrainConfig(precision=precision, clip_norm=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, weight_decay=weight_decay, fused=True)
    train_step(model, optimizer, build_scaler(CPU, precision), [batch], update_tokens=batch.num_tokens, lr=1.0,
               config=config, forward=None if working is None else working.model, working=working)  # fmt: skip
    return working


def test_a_working_copy_update_follows_the_fp32_gradient(tokenizer_and_batch):
    tokenizer, batch = tokenizer_and_batch
    torch.manual_seed(0)
    start = build_model(MODEL, tokenizer).state_dict()
    updates = {}
    for precision in ("fp32", "bf16"):
        model = build_model(MODEL, tokenizer)
        model.load_state_dict(start)
        one_update(model, batch, precision)
        updates[precision] = {name: value - start[name] for name, value in model.state_dict().items()}
    exact, ours = (torch.cat([update.flatten() for update in updates[p].values()]) for p in ("fp32", "bf16"))
    norm = torch.linalg.vector_norm
    # bf16 activations and weights: a few percent off the fp32 gradient, in the same direction
    assert norm(ours - exact) <= 0.05 * norm(exact)
    for name, update in updates["fp32"].items():
        if norm(update) > 1e-3 * norm(exact):  # not a weight whose gradient is zero but for float noise (k_proj.bias)
            # each weight within 15%: a LayerNorm weight's update came 10.4% off on an H200 host's CPU
            assert norm(updates["bf16"][name] - update) <= 0.15 * norm(update), name


def test_the_masters_stay_fp32_and_the_copy_is_their_rounding_after_each_update(tokenizer_and_batch):
    tokenizer, batch = tokenizer_and_batch
    model = build_model(MODEL, tokenizer)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    working = one_update(model, batch, "bf16")
    masters, copies = dict(model.named_parameters()), dict(working.model.named_parameters())
    assert masters.keys() == copies.keys()
    for name, master in masters.items():
        assert master.dtype == torch.float32 and copies[name].dtype == torch.bfloat16
        assert torch.equal(copies[name], master.detach().bfloat16()), name
    assert not torch.equal(before["output_proj.weight"], model.output_proj.weight)  # the update moved the masters
    assert all(copy.grad is None for copy in copies.values())  # handed over, nothing left to leak into the next


def test_clipping_the_flat_gradients_is_pytorchs_clipping(tokenizer_and_batch, cpu_path):
    """One norm and one scaling of the handed-over gradients' buffer give what torch.nn.utils does weight
    by weight, also in an update where only some weights got a gradient (LayerDrop) after one where all
    did: the others count as zeros, not as their last gradients. Through the fused kernels (the norm
    of the bf16 gradients, cast and scaled in one pass) and through PyTorch's operations."""
    model = build_model(MODEL, tokenizer_and_batch[0])
    working = working_copy_for(model, "bf16")
    copies = list(working.model.parameters())
    torch.manual_seed(0)
    for given in (copies, copies[::2]):
        grads = [torch.randn_like(weight) for weight in given]
        for weight, grad in zip(given, grads, strict=True):
            weight.grad = grad
        theirs = [torch.empty_like(grad, dtype=torch.float32).requires_grad_() for grad in grads]
        for their, grad in zip(theirs, grads, strict=True):
            their.grad = grad.float()
        expected = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        norm = working.hand_over(1.0)
        masters = [master for master in model.parameters() if master.grad is not None]
        assert len(masters) == len(given)
        # one sum of squares over millions of floats, in another order: fp32 rounding apart
        torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)
        assert expected > 1.0  # the scaling was taken
        for their, master in zip(theirs, masters, strict=True):
            torch.testing.assert_close(master.grad, their.grad, rtol=1e-5, atol=1e-9)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_a_weight_that_gets_no_gradient_is_left_alone(tokenizer_and_batch, side):
    """LayerDrop skips a layer: its weights get no gradient, so not even weight decay moves them. On the
    decoder's side the first layer is skipped and the second runs: the cross-attentions' k, v, which
    the running layers project together, move only in the second."""
    tokenizer, batch = tokenizer_and_batch
    skipping = ModelConfig(**{**MODEL.__dict__, f"{side}_layerdrop": 0.5})
    model = build_model(skipping, tokenizer)
    decisions = iter([True, False] * MODEL.decoder_layers)  # skip, run, skip, ...
    model._skipped = lambda rate: rate > 0 and next(decisions)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    one_update(model, batch, "bf16", weight_decay=0.1)
    after = model.state_dict()
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    skipped = [name for name in before if name.startswith(f"{side}_layers.0.")]
    assert skipped and not moved.intersection(skipped)
    assert {f"{side}_layers.1.self_attn.k_proj.weight", "output_proj.weight"} <= moved
    if side == "decoder":
        assert "decoder_layers.1.cross_attn.k_proj.weight" in moved


def test_a_resumed_bf16_run_is_the_uninterrupted_one(tmp_path, tiny_data):
    settings = dict(precision="bf16", max_steps=6, save_every=3, valid_every=100, log_every=3)
    straight = make_trainer(tmp_path, tiny_data, "straight", **settings)
    straight.run()
    stopped = make_trainer(tmp_path, tiny_data, "stopped", **settings)
    update = stopped._update

    def stop_after_the_checkpoint(*args, **kwargs):
        if stopped.progress.step == 4:
            raise RuntimeError("stopped")  # the run dies mid-way, its last checkpoint at step 3
        return update(*args, **kwargs)

    stopped._update = stop_after_the_checkpoint
    with pytest.raises(RuntimeError, match="stopped"):
        stopped.run()
    from seq2seq.training.trainer import Trainer

    resumed = Trainer(stopped.config, tmp_path / "stopped", resume=True, show_progress=False)
    resumed.run()
    ours = Checkpoint.load(tmp_path / "stopped" / "checkpoints" / "last.pt")
    theirs = Checkpoint.load(tmp_path / "straight" / "checkpoints" / "last.pt")
    assert ours.progress.step == theirs.progress.step == 6
    for name, tensor in theirs.model.items():
        assert tensor.dtype == torch.float32 and torch.equal(ours.model[name], tensor), name


@pytest.mark.parametrize("optimizer_class", [torch.optim.AdamW, torch.optim.Adam])
def test_a_working_copy_update_is_pytorchs_adam_on_the_clipped_gradients(tokenizer_and_batch, cpu_path,
                                                                         optimizer_class, monkeypatch):  # fmt: skip
    """The end of a bf16 update (the norm, the clipping, Adam or AdamW with weight decay, the working copy
    made again) against PyTorch's Adam on fp32 weights given the same gradients, clipped by
    torch.nn.utils: through the updates where the clipping bites, where only some weights get a gradient
    (LayerDrop) and where a NaN skips the update. With the fused kernels every update, the first (which
    creates the optimizer's state) included, is their one pass (cpu_optimizer.cpp)."""
    import seq2seq.training.working_copy as working_copy_module

    model = build_model(MODEL, tokenizer_and_batch[0])
    reference = [master.detach().clone().requires_grad_() for master in model.parameters()]
    working = working_copy_for(model, "bf16")
    settings = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.1, fused=True)
    ours, theirs = optimizer_class(model.parameters(), **settings), optimizer_class(reference, **settings)
    pytorch_steps = []
    step_on_flag = working_copy_module.step_on_flag
    monkeypatch.setattr(working_copy_module, "step_on_flag", lambda *a: pytorch_steps.append(1) or step_on_flag(*a))
    copies = list(working.model.parameters())
    generator = torch.Generator().manual_seed(0)
    # (the weights given a gradient, its size, a NaN in it): half the weights' first update, the other
    # half's (clipped), a skipped one, LayerDrop, clipped
    updates = [(copies[::2], 0.01, False), (copies, 1.0, False), (copies, 0.01, True), (copies[1::2], 0.01, False)]
    for update, (given, size, poisoned) in enumerate([*updates, (copies, 1.0, False)]):
        for weight in given:
            weight.grad = (torch.randn(weight.shape, generator=generator) * size).bfloat16()
        if poisoned:
            given[1].grad.view(-1)[0] = float("nan")
        for their, copy in zip(reference, copies, strict=True):
            their.grad = None if copy.grad is None else copy.grad.float()
        expected_norm = torch.nn.utils.clip_grad_norm_([t for t in reference if t.grad is not None], 1.0)
        if not poisoned:
            theirs.step()
        norm, skipped = working.update(ours, 1.0)
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)

        assert bool(skipped) == poisoned
        torch.testing.assert_close(norm, expected_norm, rtol=1e-5, atol=0, equal_nan=True)
        if update == 1:
            assert expected_norm > 1.0  # the clipping bit
        # the norms' sums in another order: the clipped gradients a rounding apart, which Adam's moments
        # carry (near zero, relatively more), so each is held to the rounding of its largest, and a
        # weight to a thousandth of a step (lr): a wrong term would move it by about a whole one
        for master, their, copy in zip(model.parameters(), reference, copies, strict=True):
            torch.testing.assert_close(master, their, rtol=1e-5, atol=1e-3 * settings["lr"])
            assert torch.equal(copy, master.detach().bfloat16())
            assert copy.grad is None
            state, their_state = ours.state.get(master), theirs.state.get(their)
            assert (state is None) == (their_state is None)
            if state is not None:
                assert torch.equal(state["step"], their_state["step"])
                for moment in ("exp_avg", "exp_avg_sq"):
                    largest = their_state[moment].abs().max().item()
                    torch.testing.assert_close(state[moment], their_state[moment], rtol=1e-5, atol=1e-5 * largest)
    assert pytorch_steps == ([] if cpu_path == "fused" else [1] * 5)


def test_an_update_after_a_checkpoint_is_loaded_into_the_optimizer_steps_the_loaded_state(tokenizer_and_batch,
                                                                                         cpu_path):  # fmt: skip
    """The same optimizer and working copy go on after the optimizer's state (and the weights) are loaded
    from an earlier update, as a fine-tuning or a resume in one process does: the next update reads and
    writes the loaded moments and step counts, not those the earlier updates left (the fused update keeps
    what it hands its kernel from one update to the next)."""
    model = build_model(MODEL, tokenizer_and_batch[0])
    reference = [master.detach().clone().requires_grad_() for master in model.parameters()]
    working = working_copy_for(model, "bf16")
    settings = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.1, fused=True)
    ours, theirs = torch.optim.AdamW(model.parameters(), **settings), torch.optim.AdamW(reference, **settings)
    copies = list(working.model.parameters())
    generator = torch.Generator().manual_seed(0)

    def update() -> None:
        for copy, their in zip(copies, reference, strict=True):
            copy.grad = (torch.randn(copy.shape, generator=generator) * 0.01).bfloat16()
            their.grad = copy.grad.float()
        theirs.step()
        working.update(ours, float("inf"))
        ours.zero_grad(set_to_none=True)
        theirs.zero_grad(set_to_none=True)

    update()
    saved = {name: value.clone() for name, value in model.state_dict().items()}
    saved_state = copy_module.deepcopy(ours.state_dict())
    update()
    update()
    model.load_state_dict(saved)
    working.refresh()
    ours.load_state_dict(saved_state)
    with torch.no_grad():
        for master, their in zip(model.parameters(), reference, strict=True):
            their.copy_(master)
    theirs.load_state_dict(copy_module.deepcopy(ours.state_dict()))
    update()
    for master, their in zip(model.parameters(), reference, strict=True):
        torch.testing.assert_close(master, their, rtol=1e-5, atol=1e-3 * settings["lr"])
        assert torch.equal(ours.state[master]["step"], torch.tensor(2.0))

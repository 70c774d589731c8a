"""The checkpoint format: self-contained for inference, safe to load, atomic to write, averaged exactly."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from pathlib import Path

import pytest
import torch

from seq2seq.checkpoint import Checkpoint, average_checkpoints, load_for_inference
from seq2seq.errors import UserInputError

from .conftest import make_trainer


@pytest.fixture
def two_checkpoints(tmp_path, tiny_data) -> list[Path]:
    make_trainer(tmp_path, tiny_data, max_steps=4, save_every=2, valid_every=100, keep_last=5).run()
    return sorted((tmp_path / "run" / "checkpoints").glob("step_*.pt"))


def test_checkpoint_is_self_contained_for_inference(tmp_path, tiny_data):
    trainer = make_trainer(tmp_path, tiny_data, max_steps=10, valid_every=5, save_every=5, keep_last=1)
    result = trainer.run()
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["best.pt", "last.pt", "step_00000010.pt"]  # keep_last: 1
    bundle = load_for_inference(result.last_checkpoint)
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(tensor.cpu(), bundle.model.state_dict()[name].cpu())
    assert bundle.tokenizer.encode_src(["the cat"]) == trainer.state.tokenizer.encode_src(["the cat"])
    assert bundle.config == trainer.config
    assert (tmp_path / "run" / "config.yaml").exists()


def test_state_round_trip_keeps_every_field(two_checkpoints):
    checkpoint = Checkpoint.load(two_checkpoints[-1])
    again = Checkpoint.from_state(checkpoint.to_state(), origin="memory")
    assert again.progress == checkpoint.progress and again.progress.step == 4
    assert again.config == checkpoint.config
    assert again.tokenizer.protos() == checkpoint.tokenizer.protos()
    assert all(torch.equal(again.model[name], tensor) for name, tensor in checkpoint.model.items())
    assert all(torch.equal(a, b) for a, b in zip(again.rng.torch, checkpoint.rng.torch))
    assert again.train_data == checkpoint.train_data and len(checkpoint.train_data) == 64  # a sha256


def test_checkpoint_loading_refuses_pickled_code(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"format_version": 1, "payload": Path("x")}, evil)  # an arbitrary object, not plain data
    with pytest.raises(UserInputError, match="holds Python objects beside tensors and plain data"):
        Checkpoint.load(evil)
    (tmp_path / "text.pt").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (tmp_path / "config.yaml").write_bytes("\ufeffdata:\n  src_lang: en\n".encode())  # a BOM: not a pickle opcode
    for other in ("text.pt", "config.yaml"):
        with pytest.raises(UserInputError, match="not a readable seq2seq checkpoint; expected a .pt file that seq2seq"):
            Checkpoint.load(tmp_path / other)
    torch.save({"model": {}}, tmp_path / "foreign.pt")
    with pytest.raises(UserInputError, match="not a seq2seq checkpoint"):
        Checkpoint.load(tmp_path / "foreign.pt")


def test_a_checkpoint_that_lacks_a_field_is_named(tmp_path, two_checkpoints):
    state = Checkpoint.load(two_checkpoints[0]).to_state()
    del state["optimizer"], state["rng"]
    damaged = tmp_path / "damaged.pt"
    torch.save(state, damaged)
    with pytest.raises(UserInputError, match=rf"{damaged}: checkpoint lacks optimizer, rng; expected every field"):
        Checkpoint.load(damaged)
    state = Checkpoint.load(two_checkpoints[0]).to_state()
    del state["progress"]["epoch"]
    torch.save(state, damaged)
    with pytest.raises(UserInputError, match="the checkpoint's progress has other fields than"):
        Checkpoint.load(damaged)


def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, two_checkpoints):
    first, second = (Checkpoint.load(path) for path in two_checkpoints)
    path = tmp_path / "c.pt"
    first.save(path)

    def crash(*args, **kwargs):
        args[1].write(b"partial garbage")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        second.save(path)
    monkeypatch.undo()
    assert Checkpoint.load(path).progress == first.progress


def test_average_of_checkpoints_is_the_parameter_mean(tmp_path, two_checkpoints):
    first, second = two_checkpoints
    average_checkpoints([first, second], tmp_path / "avg.pt")
    a, b = Checkpoint.load(first).model, Checkpoint.load(second).model
    averaged = Checkpoint.load(tmp_path / "avg.pt")
    for name in a:
        torch.testing.assert_close(averaged.model[name], (a[name] + b[name]) / 2)
    assert averaged.averaged_from == [str(first), str(second)] and averaged.weights == "average"
    assert dataclasses.replace(averaged.progress) == Checkpoint.load(second).progress
    load_for_inference(tmp_path / "avg.pt")  # still a complete checkpoint


def test_averaging_holds_one_checkpoint_at_a_time(tmp_path, tiny_data, monkeypatch):
    """Ten saves of a large model with their optimizer states need not fit in memory together
    (fairseq's script streams them too): when each checkpoint loads, no earlier one is still held."""
    make_trainer(tmp_path, tiny_data, max_steps=3, save_every=1, valid_every=100, keep_last=5).run()
    paths = sorted((tmp_path / "run" / "checkpoints").glob("step_*.pt"))
    models = [Checkpoint.load(path).model for path in paths]
    loaded, held_at_each_load, real_load = [], [], Checkpoint.load

    def load_and_track(path):
        gc.collect()
        held_at_each_load.append(sum(ref() is not None for ref in loaded))
        checkpoint = real_load(path)
        loaded.append(weakref.ref(checkpoint))
        return checkpoint

    monkeypatch.setattr(Checkpoint, "load", load_and_track)
    average_checkpoints(paths, tmp_path / "avg.pt")
    monkeypatch.undo()
    assert held_at_each_load == [0, 0, 0]
    averaged = Checkpoint.load(tmp_path / "avg.pt").model
    for name in averaged:
        torch.testing.assert_close(averaged[name], sum(model[name] for model in models) / 3)


def test_averaging_accepts_moved_data_that_holds_the_same_pairs_only(tmp_path, two_checkpoints):
    """A run resumed after its corpus moved: its checkpoints name other files but record the same pairs."""
    first, second = (Checkpoint.load(path) for path in two_checkpoints)
    moved_data = dataclasses.replace(second.config.data, train=dataclasses.replace(second.config.data.train, src="x"))
    moved = tmp_path / "moved.pt"
    dataclasses.replace(second, config=dataclasses.replace(second.config, data=moved_data)).save(moved)
    average_checkpoints([two_checkpoints[0], moved], tmp_path / "avg.pt")
    other = tmp_path / "other.pt"
    dataclasses.replace(Checkpoint.load(moved), train_data="0" * 64).save(other)
    with pytest.raises(UserInputError, match=rf"{other}: data.train.src differ from"):
        average_checkpoints([two_checkpoints[0], other], tmp_path / "avg2.pt")
    assert not (tmp_path / "avg2.pt").exists()


def test_averaging_refuses_the_same_weights_twice(tmp_path, two_checkpoints):
    """`average checkpoints/*.pt` names last.pt beside the numbered checkpoint it repeats: that step would
    count double in the mean."""
    last = two_checkpoints[0].parent / "last.pt"
    output = tmp_path / "avg.pt"
    with pytest.raises(UserInputError, match=rf"{two_checkpoints[1]}: the same weights as {last} \(step 4\)"):
        average_checkpoints([last, *two_checkpoints], output)
    assert not output.exists()

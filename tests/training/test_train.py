"""The training loop: a tiny model learns, pinned first losses (resume after SIGKILL: test_faults.py),
stop rules, skipped updates, no host reads per step, mixed precision behaves."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil

import pytest
import torch
import yaml

from seq2seq.checkpoint import Checkpoint
from seq2seq.config_files import config_from_dict
from seq2seq.data.batching import epoch_batches, pair_lengths
from seq2seq.errors import UserInputError
from seq2seq.training.trainer import Trainer

from ..conftest import make_trainer, tiny_config_dict

PINNED_WITH_TORCH = "2.13.0"  # the Makefile's torch, on CPU


@pytest.mark.slow
def test_tiny_model_learns_loss_falls_and_bleu_rises(tmp_path, learned_checkpoint):
    """The 300 updates of the shared learned_checkpoint, against the same model untrained."""
    path, data = learned_checkpoint
    untrained = make_trainer(tmp_path, data).evaluate_valid().scores
    records = [json.loads(line) for line in (path.parent.parent / "metrics.jsonl").read_text().splitlines()]
    train_losses = [r["loss"] for r in records if r["kind"] == "train"]
    final_bleu = [r["bleu"] for r in records if r["kind"] == "valid"][-1]
    assert train_losses[-1] < 0.6 * train_losses[0]
    assert final_bleu > 30.0
    assert final_bleu > untrained.bleu + 25.0


@pytest.mark.skipif(
    torch.__version__.split("+")[0] != PINNED_WITH_TORCH, reason=f"losses pinned with torch {PINNED_WITH_TORCH}"
)
def test_first_losses_are_pinned(tmp_path, tiny_data, cpu_path):
    """A loss-regression test: the first steps of the tiny config must not drift silently. The figures
    are one build's arithmetic (torch 2.11 on the GPU machine's CPU gave 6.625 for the first); the
    fused CPU kernels draw other dropout masks than PyTorch's path, so each path has its own."""
    trainer = make_trainer(tmp_path, tiny_data, max_steps=4, log_every=1, valid_every=100, device="cpu")
    trainer.run()
    losses = [round(r["loss"], 3) for r in trainer.metrics.read() if r["kind"] == "train"]
    assert losses == pytest.approx(PINNED_LOSSES[cpu_path], abs=2e-3)


PINNED_LOSSES = {"pytorch": [6.679, 6.693, 6.597, 6.492], "fused": [6.692, 6.679, 6.589, 6.496]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; fp16 is allowed there")
def test_fp16_without_cuda_is_a_clear_error(tmp_path, tiny_data):
    with pytest.raises(UserInputError, match="train.precision: fp16 needs a CUDA GPU"):
        make_trainer(tmp_path, tiny_data, precision="fp16")


def test_bf16_trains_on_cpu(tmp_path, tiny_data):
    trainer = make_trainer(tmp_path, tiny_data, precision="bf16", max_steps=10, log_every=5, valid_every=100)
    trainer.run()
    losses = [r["loss"] for r in trainer.metrics.read() if r["kind"] == "train"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    assert trainer.model.output_proj.weight.dtype == torch.float32  # master weights stay fp32


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        ({"max_epochs": 1, "max_steps": 10_000}, "max_epochs"),
        ({"max_time": 0.5, "max_steps": 10_000}, "max_time"),
        ({"patience": 1, "valid_every": 2, "max_steps": 10_000, "lr": 1e-9}, "patience"),
    ],
)
def test_stopping_rules(tmp_path, tiny_data, settings, reason):
    result = make_trainer(tmp_path, tiny_data, **settings).run()
    assert reason in result.stop_reason
    assert result.last_checkpoint.exists()


class FakeClock:
    """perf_counter for the trainer: one second passes between any two readings, so every update
    (timed from before its batches to after its step) takes exactly one second."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize(
    ("budget", "last_step"),
    [({"max_time": 12.0, "log_every": 1}, 12), ({"max_epochs": 1, "max_tokens": 1024, "log_every": 1}, None)],
)
def test_a_budgeted_schedule_ends_at_its_floor(tmp_path, tiny_data, monkeypatch, budget, last_step):
    """Whatever the budget (seconds, here on a clock that ticks once per update, or one epoch), the
    linear schedule's last update runs at min_lr and the run's final weights are validated."""
    monkeypatch.setattr("seq2seq.training.trainer.time", FakeClock())
    trainer = make_trainer(tmp_path, tiny_data, max_steps=10_000, schedule="linear", warmup_steps=3,
                           min_lr=0.0005, valid_every=1000, **budget)  # fmt: skip
    result = trainer.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["lr"] for r in records if r["kind"] == "train"]
    assert rates[-1] == pytest.approx(0.0005) and min(rates) == pytest.approx(0.0005)
    assert max(rates) == pytest.approx(0.004)  # the peak, once warmup is over
    assert rates[3:] == sorted(rates[3:], reverse=True)  # decaying since
    assert last_step is None or result.progress.step == last_step
    assert records[-1]["kind"] == "valid" and records[-1]["step"] == result.progress.step
    assert (tmp_path / "run" / "checkpoints" / "best.pt").exists()


def test_a_single_process_run_stops_at_its_deadline_between_log_steps(tmp_path, tiny_data, monkeypatch):
    monkeypatch.setattr("seq2seq.training.trainer.time", FakeClock())
    trainer = make_trainer(tmp_path, tiny_data, max_steps=10_000, max_time=12.0, log_every=100, valid_every=1000)
    assert trainer.run().progress.step == 12


def test_existing_run_directory_is_not_overwritten(tmp_path, tiny_data):
    make_trainer(tmp_path, tiny_data, max_steps=2, valid_every=100).run()
    with pytest.raises(UserInputError, match="already has checkpoints; pass --resume"):
        make_trainer(tmp_path, tiny_data, max_steps=2)


def test_a_new_run_replaces_a_runs_config_and_no_config_it_did_not_write(tmp_path, tiny_data):
    """A run directory whose config.yaml a run wrote (a run stopped before its first checkpoint, here
    one whose checkpoints were removed) takes a new run, which writes it again. One holding a config
    someone keeps there (the very file `seq2seq train DIR/config.yaml --run-dir DIR` reads) is refused
    before the directory is touched, the file as it was."""
    make_trainer(tmp_path, tiny_data, max_steps=2, valid_every=100).run()
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    make_trainer(tmp_path, tiny_data, max_steps=3, valid_every=100).run()
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["max_steps"] == 3
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text(yaml.safe_dump(tiny_config_dict(tiny_data, max_steps=2)))
    kept = (mine / "config.yaml").read_bytes()
    refusal = f"^{re.escape(str(mine / 'config.yaml'))}: exists and is not a config a seq2seq run wrote"
    with pytest.raises(UserInputError, match=refusal):
        make_trainer(tmp_path, tiny_data, name="mine", max_steps=2)
    assert (mine / "config.yaml").read_bytes() == kept
    assert sorted(path.name for path in mine.iterdir()) == ["config.yaml"]


def test_a_new_run_keeps_an_earlier_runs_metrics_apart_and_a_resume_continues_its_own(tmp_path, tiny_data):
    """A new run in a directory an earlier run left metrics in (its checkpoints removed) starts its
    own metrics.jsonl; the earlier ones are kept whole, as metrics.earlier-1.jsonl, then -2. A resume
    logs on in the run's own file."""
    run = tmp_path / "run"

    def train_steps(lines: list[str]) -> list[int]:
        return [r["step"] for r in (json.loads(line) for line in lines) if r["kind"] == "train"]

    make_trainer(tmp_path, tiny_data, max_steps=2, log_every=1, valid_every=100).run()
    first = (run / "metrics.jsonl").read_bytes()
    shutil.rmtree(run / "checkpoints")
    make_trainer(tmp_path, tiny_data, max_steps=3, log_every=1, save_every=3, valid_every=100).run()
    second = (run / "metrics.jsonl").read_bytes()
    assert train_steps(second.decode().splitlines()) == [1, 2, 3]
    assert (run / "metrics.earlier-1.jsonl").read_bytes() == first
    raw = tiny_config_dict(tiny_data, max_steps=4, log_every=1, save_every=3, valid_every=100)
    Trainer(config_from_dict(raw, origin="test"), run, resume=True, show_progress=False).run()
    assert train_steps((run / "metrics.jsonl").read_text().splitlines()) == [1, 2, 3, 4]
    shutil.rmtree(run / "checkpoints")
    make_trainer(tmp_path, tiny_data, max_steps=1, log_every=1, valid_every=100).run()
    assert (run / "metrics.earlier-1.jsonl").read_bytes() == first
    assert train_steps((run / "metrics.earlier-2.jsonl").read_text().splitlines()) == [1, 2, 3, 4]
    assert train_steps((run / "metrics.jsonl").read_text().splitlines()) == [1]


def test_a_resumed_run_records_what_changed_in_its_train_log(tmp_path, tiny_data, caplog):
    """The log of a run says which settings a resume changed, not only the terminal that typed it."""
    caplog.set_level(logging.INFO, logger="seq2seq")  # as the CLI sets it (cli.boundary.setup_logging)
    make_trainer(tmp_path, tiny_data, max_steps=2, save_every=2, valid_every=100).run()
    raw = tiny_config_dict(tiny_data, max_steps=4, save_every=2, valid_every=100)
    Trainer(config_from_dict(raw, origin="test"), tmp_path / "run", resume=True, show_progress=False).run()
    assert "resume: train.max_steps changed from 2 to 4" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.parametrize(("warmup", "said"), [(8, "rises to 25% of its peak"), (2, None)])
def test_a_warmup_longer_than_the_run_is_said_at_its_start(tmp_path, tiny_data, caplog, warmup, said):
    """A run cut to fewer updates than its warmup (max_steps lowered for a quick try, warmup_steps
    left) never reaches train.lr: the log says so before the first update, not after a wasted run."""
    caplog.set_level(logging.INFO, logger="seq2seq")
    trainer = make_trainer(tmp_path, tiny_data, max_steps=2, warmup_steps=warmup, save_every=2, log_every=1,
                           valid_every=100)  # fmt: skip
    trainer.run()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "warmup" in r.getMessage()]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last_rate = [r["lr"] for r in records if r["kind"] == "train"][-1] / trainer.config.train.lr
    if said is None:
        assert warnings == [] and last_rate == 1.0
    else:
        assert len(warnings) == 1 and said in warnings[0] and "train.warmup_steps (8)" in warnings[0]
        assert last_rate == pytest.approx(0.25)  # what the warning said: the run's last update
        said_at = [r.getMessage() for r in caplog.records].index(warnings[0])
        assert "effective batch" in caplog.records[said_at - 1].getMessage()  # with the run's opening lines


@pytest.mark.parametrize(("max_tokens", "some_over"), [(12, True), (2048, False)])
def test_pairs_longer_than_max_tokens_are_said_at_the_start(tmp_path, tiny_data, caplog, max_tokens, some_over):
    """A pair alone longer than train.max_tokens is a batch of its own, over it (fairseq refuses it):
    the opening lines say how many there are and how long the longest is, which is the largest batch
    the run then trains on."""
    caplog.set_level(logging.WARNING, logger="seq2seq")
    trainer = make_trainer(tmp_path, tiny_data, max_steps=1, max_tokens=max_tokens, valid_every=100)
    trainer.run()
    warnings = [r.getMessage() for r in caplog.records if "train.max_tokens" in r.getMessage()]
    corpus = trainer.state.data.train
    batches = epoch_batches(corpus, max_tokens=max_tokens, seed=0, epoch=1)
    largest = max(len(batch) * int(pair_lengths(corpus, batch).max()) for batch in batches)
    assert (largest > max_tokens) == some_over
    if not some_over:
        assert warnings == []
    else:
        alone = sum(len(batch) == 1 and int(pair_lengths(corpus, batch).max()) > max_tokens for batch in batches)
        assert warnings == [f"train.max_tokens ({max_tokens}) is below the length of {alone:,} training pairs "
                            f"(the longest {largest} tokens): each of them is a batch of its own, over "
                            "train.max_tokens"]  # fmt: skip


def test_a_run_resumes_on_its_pairs_moved_or_reformatted_and_refuses_other_pairs(tmp_path, tiny_data, caplog):
    """data.train's files may move (another machine, another mount) or change format: the resumed run
    holds the same pairs and is the uninterrupted one. Other pairs, even at the run's own paths, are
    refused, and the run's config.yaml is left as it was."""
    caplog.set_level(logging.INFO, logger="seq2seq")
    settings = dict(max_steps=4, save_every=2, valid_every=100)
    make_trainer(tmp_path, tiny_data, "straight", **settings).run()
    make_trainer(tmp_path, tiny_data, "moved", **{**settings, "max_steps": 2}).run()
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tiny_data, elsewhere)
    lines = [(tiny_data / f"train.{lang}").read_text().splitlines() for lang in ("en", "xx")]
    (elsewhere / "train.tsv").write_text("".join(f"{src}\t{tgt}\n" for src, tgt in zip(*lines)))
    raw = tiny_config_dict(elsewhere, **settings)
    raw["data"]["train"] = {"format": "tsv", "path": str(elsewhere / "train.tsv")}
    Trainer(config_from_dict(raw, origin="test"), tmp_path / "moved", resume=True, show_progress=False).run()
    ours = Checkpoint.load(tmp_path / "moved" / "checkpoints" / "last.pt")
    theirs = Checkpoint.load(tmp_path / "straight" / "checkpoints" / "last.pt")
    assert ours.progress.step == theirs.progress.step == 4
    for name, tensor in theirs.model.items():
        assert torch.equal(ours.model[name], tensor), name
    assert "resume: data.train.format changed from 'text' to 'tsv'" in (tmp_path / "moved" / "train.log").read_text()

    (tiny_data / "train.xx").write_text("\n".join(["another target", *lines[1][1:]]) + "\n")  # one pair changed
    config_yaml = (tmp_path / "straight" / "config.yaml").read_bytes()
    raw = tiny_config_dict(tiny_data, **{**settings, "max_steps": 6})
    with pytest.raises(
        UserInputError, match=r"data.train \(.*train.en, .*train.xx\): not the text this run trained on"
    ):
        Trainer(config_from_dict(raw, origin="test"), tmp_path / "straight", resume=True, show_progress=False)
    assert (tmp_path / "straight" / "config.yaml").read_bytes() == config_yaml


def test_a_resumed_run_says_when_its_segmentations_were_sampled_otherwise(tmp_path, tiny_data, monkeypatch, caplog):
    """Subword sampling without an encoding cache: a resume samples the segmentations again, the same
    ones under the same SentencePiece (no warning, and the run goes on exactly); other draws (another
    SentencePiece version, here another seed) are named, since the run no longer repeats itself."""
    from seq2seq.data.tokenizer import SubwordSampling

    def run(name: str, max_steps: int, *, resume: bool = False):
        raw = tiny_config_dict(tiny_data, max_steps=max_steps, save_every=2, valid_every=100)
        raw["data"].update(subword_alpha=0.2, subword_variants=2, cache_dir="")
        Trainer(config_from_dict(raw, origin="test"), tmp_path / name, resume=resume, show_progress=False).run()

    caplog.set_level(logging.WARNING, logger="seq2seq")
    run("straight", 4)
    run("resumed", 2)
    run("resumed", 4, resume=True)
    assert not [r for r in caplog.records if "segmentations" in r.getMessage()]
    ours, theirs = (Checkpoint.load(tmp_path / name / "checkpoints" / "last.pt") for name in ("resumed", "straight"))
    assert len(ours.segmentations) == 2 and ours.segmentations == theirs.segmentations
    for name, tensor in theirs.model.items():
        assert torch.equal(ours.model[name], tensor), name

    seed = SubwordSampling.seed
    monkeypatch.setattr(SubwordSampling, "seed", lambda self, value: seed(self, value + 1))
    run("resumed", 6, resume=True)
    (warning,) = [r.getMessage() for r in caplog.records if "segmentations" in r.getMessage()]
    assert warning.startswith("data.subword_alpha: the sampled segmentations of data.train (variant 1, 2) differ")


def test_a_checkpoint_that_did_not_record_its_pairs_keeps_its_data_paths(tmp_path, tiny_data):
    """Written before checkpoints recorded their pairs: nothing shows that moved files hold the same
    pairs, so data.train stays as it was (the rule before)."""
    make_trainer(tmp_path, tiny_data, max_steps=2, save_every=2, valid_every=100).run()
    (numbered,) = (tmp_path / "run" / "checkpoints").glob("step_*.pt")
    dataclasses.replace(Checkpoint.load(numbered), train_data="").save(numbered)
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(tiny_data, elsewhere)
    raw = tiny_config_dict(elsewhere, max_steps=4)
    with pytest.raises(UserInputError, match="data.train.src: .* a resumed run must keep it"):
        Trainer(config_from_dict(raw, origin="test"), tmp_path / "run", resume=True, show_progress=False)


def test_a_new_run_fine_tunes_from_a_checkpoints_weights_and_tokenizer(tmp_path, tiny_data):
    """train.init_from: the new run starts at step 0 from the checkpoint's weights and tokenizer, so its
    first loss is the trained model's, not a fresh one's; its dropout may differ, its shape may not."""
    base = make_trainer(tmp_path, tiny_data, "base", max_steps=60, save_every=60, valid_every=100, log_every=1)
    base.run()
    trained = Checkpoint.load(tmp_path / "base")
    raw = tiny_config_dict(tiny_data, max_steps=3, valid_every=100, log_every=1, init_from=str(tmp_path / "base"))
    raw["model"]["dropout"] = 0.2
    tuned = Trainer(config_from_dict(raw, origin="test"), tmp_path / "tuned", show_progress=False)
    for name, tensor in trained.model.items():
        assert torch.equal(tuned.model.state_dict()[name], tensor), name
    assert tuned.state.tokenizer.protos() == trained.tokenizer.protos()
    assert tuned.run().progress.step == 3
    losses = [[r["loss"] for r in run.metrics.read() if r["kind"] == "train"] for run in (base, tuned)]
    assert losses[1][0] < 0.8 * losses[0][0]  # the trained model's loss, far below a fresh model's first
    assert losses[1][0] < 1.2 * losses[0][-1], losses
    validations = [r for r in tuned.metrics.read() if r["kind"] == "valid"]
    assert validations[0]["step"] == 0 and validations[-1]["step"] == 3  # the model it was given, validated first
    base_bleu = [r["bleu"] for r in base.metrics.read() if r["kind"] == "valid"][-1]
    assert validations[0]["bleu"] == base_bleu  # the same weights on the same validation split

    raw["model"]["d_model"], raw["model"]["heads"] = 64, 2
    with pytest.raises(UserInputError, match=r"train.init_from .*base: model.d_model: 96 in the checkpoint, 64 given"):
        Trainer(config_from_dict(raw, origin="test"), tmp_path / "refused", show_progress=False)
    assert not (tmp_path / "refused").exists()


def test_a_fine_tuning_run_resumes_from_its_own_checkpoints(tmp_path, tiny_data):
    """Resumed, a fine-tuning run continues from its own last checkpoint (not train.init_from's
    weights again): it ends as the uninterrupted one does."""
    make_trainer(tmp_path, tiny_data, "base", max_steps=4, save_every=4, valid_every=100).run()
    settings = dict(max_steps=4, save_every=2, valid_every=100, init_from=str(tmp_path / "base"))
    make_trainer(tmp_path, tiny_data, "straight", **settings).run()
    make_trainer(tmp_path, tiny_data, "stopped", **{**settings, "max_steps": 2}).run()
    raw = tiny_config_dict(tiny_data, **settings)
    Trainer(config_from_dict(raw, origin="test"), tmp_path / "stopped", resume=True, show_progress=False).run()
    ours, theirs = (Checkpoint.load(tmp_path / name / "checkpoints" / "last.pt") for name in ("stopped", "straight"))
    assert ours.progress.step == theirs.progress.step == 4
    for name, tensor in theirs.model.items():
        assert torch.equal(ours.model[name], tensor), name


def test_non_finite_steps_are_skipped_and_too_many_stop_with_a_message(tmp_path, tiny_data, monkeypatch):
    import seq2seq.training.train_step as step_module

    trainer = make_trainer(tmp_path, tiny_data, max_steps=100, log_every=5, valid_every=1000)
    before = {name: p.clone() for name, p in trainer.model.named_parameters()}
    real_loss = step_module.output_layer_loss
    monkeypatch.setattr(step_module, "output_layer_loss", lambda *a: real_loss(*a) * float("nan"))
    with pytest.raises(step_module.TrainingDiverged, match="20 updates in a row had non-finite gradients"):
        trainer.run()
    assert trainer.progress.skipped_steps == step_module.MAX_SKIPPED_IN_A_ROW
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name  # nothing was applied


def test_skipped_update_counters_track_runs_across_reads():
    from seq2seq.training.train_step import SkippedUpdates

    counters = SkippedUpdates(torch.device("cpu"))
    for flag in (1, 1, 0, 1, 1):
        counters.record(torch.tensor(bool(flag)))
    assert counters.collect() == (4, 2)
    for flag in (1, 1):
        counters.record(torch.tensor(bool(flag)))
    assert counters.collect() == (2, 4)  # the run that straddles the read is counted whole
    counters.record(torch.tensor(False))
    assert counters.collect() == (0, 0)


HOST_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")


def count_host_reads(monkeypatch) -> list[str]:
    """Record every read of a tensor's value into Python: on a GPU each one waits for the device (a sync)."""
    reads: list[str] = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def recording(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, recording)
    return reads


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_steps_read_nothing_back_from_the_device_between_log_steps(tmp_path, tiny_data, monkeypatch, precision):
    """Host reads happen when logging, validating or saving, never per step: their count does not grow with steps."""
    reads_per_run = {}
    for steps in (2, 5):
        trainer = make_trainer(tmp_path, tiny_data, name=f"run{steps}", max_steps=steps, log_every=steps,
                               valid_every=1000, save_every=1000, precision=precision)  # fmt: skip
        with monkeypatch.context() as patch:
            reads = count_host_reads(patch)
            trainer.run()
        reads_per_run[steps] = reads
    assert len(reads_per_run[5]) == len(reads_per_run[2]) > 0  # the final log and save do read


def test_tensorboard_events_when_the_optional_extra_is_installed(tmp_path, tiny_data):
    pytest.importorskip("tensorboard", reason="optional extra: pip install -e '.[tensorboard]'")
    make_trainer(tmp_path, tiny_data, max_steps=4, log_every=2, valid_every=100).run()
    assert any((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_late_dropout_is_off_before_its_epoch_and_on_from_it(tmp_path, tiny_data, precision):
    """train.dropout_from_epoch 2 (a quarter of the tiny corpus: 8 or 9 updates an epoch): through the first
    epoch the run is the run without dropout, loss for loss; from the second epoch's first update it is not.
    bf16: the working copy, whose modules are not the master model's, must switch too."""
    for lang in ("en", "xx"):
        train = tiny_data / f"train.{lang}"
        train.write_text("".join(train.read_text().splitlines(keepends=True)[:750]))
    records = {}
    for name, dropout, start in [("late", 0.1, 2), ("none", 0.0, 1)]:
        raw = tiny_config_dict(tiny_data, max_steps=12, log_every=1, valid_every=100, save_every=100,
                               precision=precision, dropout_from_epoch=start)  # fmt: skip
        raw["model"]["dropout"] = dropout
        trainer = Trainer(config_from_dict(raw, origin="test"), tmp_path / name, show_progress=False)
        trainer.run()
        records[name] = [(r["epoch"], r["loss"]) for r in trainer.metrics.read() if r["kind"] == "train"]
    first_epoch = [loss for epoch, loss in records["late"] if epoch == 1]
    assert 5 < len(first_epoch) < 12
    assert first_epoch == [loss for epoch, loss in records["none"] if epoch == 1]
    second_epoch = [(late, none) for (epoch, late), (_, none) in zip(records["late"], records["none"]) if epoch == 2]
    assert second_epoch and all(late != none for late, none in second_epoch)


def test_weighted_and_tagged_corpora_resume_as_the_uninterrupted_run_and_keep_their_weights(tmp_path, tiny_data):
    """data.extra_train with a tag and weight 1.5: each epoch draws another half of it on top of the whole;
    a run stopped and resumed two epochs later, its corpora moved meanwhile, trains exactly as the
    uninterrupted one did. A resume with another weight would train on other batches, and is refused,
    naming the key."""
    for lang in ("en", "xx"):
        lines = (tiny_data / f"train.{lang}").read_text().splitlines(keepends=True)
        (tiny_data / f"head.{lang}").write_text("".join(lines[:300]))
        (tiny_data / f"tail.{lang}").write_text("".join(lines[300:500]))
    moved = tmp_path / "moved"
    shutil.copytree(tiny_data, moved)

    def config(max_steps: int, weight: float = 1.5, data=tiny_data):
        raw = tiny_config_dict(data, max_steps=max_steps, save_every=4, valid_every=100)
        raw["data"]["train"] = {"src": str(data / "head.en"), "tgt": str(data / "head.xx")}
        tail = {"src": str(data / "tail.en"), "tgt": str(data / "tail.xx"), "tag": "<bt>", "weight": weight}
        raw["data"]["extra_train"] = [tail]
        raw["tokenizer"]["user_defined_symbols"] = ["<bt>"]
        return config_from_dict(raw, origin="test")

    Trainer(config(24), tmp_path / "straight", show_progress=False).run()
    Trainer(config(8), tmp_path / "resumed", show_progress=False).run()
    Trainer(config(24, data=moved), tmp_path / "resumed", resume=True, show_progress=False).run()
    ours, theirs = (Checkpoint.load(tmp_path / name / "checkpoints" / "last.pt") for name in ("resumed", "straight"))
    assert ours.progress.step == theirs.progress.step == 24 and theirs.progress.epoch >= 3  # resumed across epochs
    for name, tensor in theirs.model.items():
        assert torch.equal(ours.model[name], tensor), name
    with pytest.raises(UserInputError, match=r"data.extra_train\[0\].weight: 1.5 in the run, 2.0 given; a resumed run"):
        Trainer(config(30, weight=2.0), tmp_path / "resumed", resume=True, show_progress=False)


# Validations whose three scores disagree on the best step: (loss, BLEU, chrF) at steps 10, 20, ..., 60.
DISAGREEING = [(5.0, 1.0, 10.0), (3.0, 0.5, 20.0), (4.0, 2.0, 15.0), (3.5, 1.5, 25.0), (3.2, 1.0, 22.0),
               (3.1, 1.0, 21.0)]  # fmt: skip


def validations_scoring(monkeypatch, scores: list[tuple[float, float, float]]) -> None:
    """Trainer validations at steps 10, 20, ... score (loss, BLEU, chrF) = scores[0], scores[1], ..."""
    real = Trainer.evaluate_valid

    def evaluate(self, *between_batches):
        result = real(self, *between_batches)
        loss, bleu, chrf = scores[self.progress.step // 10 - 1]
        stand_ins = {"BLEU": bleu, "chrF2": chrf}
        metrics = tuple(dataclasses.replace(m, score=stand_ins.get(m.name, m.score)) for m in result.scores.metrics)
        return dataclasses.replace(result, loss=loss, scores=dataclasses.replace(result.scores, metrics=metrics))

    monkeypatch.setattr(Trainer, "evaluate_valid", evaluate)


@pytest.mark.parametrize(("metric", "best_step", "stop_step"), [("loss", 20, 40), ("bleu", 30, 50), ("chrf", 40, 60)])
def test_best_pt_and_patience_follow_the_chosen_metric(tmp_path, tiny_data, monkeypatch, metric, best_step, stop_step):
    """train.best_metric: best.pt is the model of the best validation by that score (the lowest loss, the
    highest BLEU or chrF) and patience counts the validations that did not beat it."""
    validations_scoring(monkeypatch, DISAGREEING)
    settings = dict(max_steps=60, valid_every=10, save_every=10, keep_last=6, patience=2, best_metric=metric)
    result = make_trainer(tmp_path, tiny_data, **settings).run()
    assert result.progress.step == stop_step
    best = Checkpoint.load(tmp_path / "run" / "checkpoints" / "best.pt")
    saved = Checkpoint.load(tmp_path / "run" / "checkpoints" / f"step_{best_step:08d}.pt")
    assert best.progress.step == best_step and best.progress.best_bleu == DISAGREEING[best_step // 10 - 1][1]
    for name, tensor in saved.model.items():
        assert torch.equal(best.model[name], tensor), name


def test_a_resume_keeps_best_pt_by_bleu_from_an_older_checkpoint_and_restarts_it_for_another_metric(
    tmp_path, tiny_data, monkeypatch, caplog
):
    """A checkpoint saved before best_metric recorded its best BLEU alone: resumed by BLEU, a worse
    validation leaves best.pt as it was. A resume that changes the metric validates best.pt again by
    it, so that only a better model replaces it."""
    validations_scoring(monkeypatch, [(3.0, 2.0, 20.0), (3.0, 1.0, 10.0), (3.5, 0.5, 5.0), (2.5, 0.1, 1.0)])
    make_trainer(tmp_path, tiny_data, max_steps=10, valid_every=10, save_every=10).run()
    (saved,) = (tmp_path / "run" / "checkpoints").glob("step_*.pt")
    older = Checkpoint.load(saved).to_state()
    del older["progress"]["best_score"]  # as written before best_metric existed
    torch.save(older, saved)
    raw = tiny_config_dict(tiny_data, max_steps=20, valid_every=10, save_every=10)
    Trainer(config_from_dict(raw, origin="test"), tmp_path / "run", resume=True, show_progress=False).run()
    assert Checkpoint.load(tmp_path / "run" / "checkpoints" / "best.pt").progress.step == 10  # BLEU 2 beats 1

    caplog.set_level(logging.INFO, logger="seq2seq")
    make_trainer(tmp_path, tiny_data, "changed", max_steps=20, valid_every=10, save_every=10).run()  # best: step 10
    raw = tiny_config_dict(tiny_data, max_steps=30, valid_every=10, save_every=10, best_metric="loss")
    Trainer(config_from_dict(raw, origin="test"), tmp_path / "changed", resume=True, show_progress=False).run()
    assert "train.best_metric is now loss: best.pt validated again, loss 3" in caplog.text  # the stand-in's
    best = Checkpoint.load(tmp_path / "changed" / "checkpoints" / "best.pt")
    assert best.progress.step == 10  # loss 3.5 at step 30 does not beat its 3
    make_trainer(tmp_path, tiny_data, "straight", max_steps=30, valid_every=10, save_every=10).run()
    ours, theirs = (Checkpoint.load(tmp_path / name / "checkpoints" / "last.pt") for name in ("changed", "straight"))
    for name, tensor in theirs.model.items():  # validating best.pt left the trained weights as they were
        assert torch.equal(ours.model[name], tensor), name
    raw = tiny_config_dict(tiny_data, max_steps=40, valid_every=10, save_every=10, best_metric="loss")
    Trainer(config_from_dict(raw, origin="test"), tmp_path / "changed", resume=True, show_progress=False).run()
    best = Checkpoint.load(tmp_path / "changed" / "checkpoints" / "best.pt")
    assert best.progress.step == 40 and best.progress.best_score == -2.5  # loss 2.5 does

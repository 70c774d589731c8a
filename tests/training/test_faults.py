"""Injected faults: a full disk while a checkpoint is written, a torn metrics line, kills at random
moments, Ctrl-C and SIGTERM. Each gets one clear line (or none needed), nothing half-written is left,
and the run resumes."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import seq2seq.checkpoint
from seq2seq.checkpoint import Checkpoint, numbered_checkpoints
from seq2seq.cli.main import app

from ..conftest import tiny_config_dict

runner = CliRunner()


def _config(tmp_path: Path, data: Path, **train) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config_dict(data, **train)))
    return path


def _temporaries(run_dir: Path) -> list[Path]:
    return [path for path in run_dir.rglob("*") if ".tmp" in path.name]


def test_disk_full_during_a_checkpoint_names_the_last_good_one_and_resume_continues(tmp_path, tiny_data, monkeypatch):
    config, run_dir = _config(tmp_path, tiny_data, max_steps=30, save_every=10, valid_every=100), tmp_path / "run"
    real_save, calls = torch.save, []

    def save_until_the_disk_is_full(obj, handle, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the second checkpoint: half written, then no space
            handle.write(b"x" * 4096)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, handle, *args, **kwargs)

    monkeypatch.setattr(seq2seq.checkpoint.torch, "save", save_until_the_disk_is_full)
    result = runner.invoke(app, ["train", str(config), "--run-dir", str(run_dir), "--quiet"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    first = run_dir / "checkpoints" / "step_00000010.pt"
    failed = run_dir / "checkpoints" / "step_00000020.pt"
    assert errors == [
        f"error: {failed}: could not be written (No space left on device); the last good checkpoint is {first}; "
        "free some space and continue with --resume"
    ]
    assert not _temporaries(run_dir)  # the half-written file does not hold the space a retry needs
    assert numbered_checkpoints(run_dir / "checkpoints") == [first]
    monkeypatch.setattr(seq2seq.checkpoint.torch, "save", real_save)
    result = runner.invoke(app, ["train", str(config), "--resume", str(run_dir), "--quiet"])
    assert result.exit_code == 0, result.output
    assert Checkpoint.load(run_dir / "checkpoints" / "last.pt").progress.step == 30
    again = runner.invoke(app, ["train", str(config), "--resume", str(run_dir), "--quiet"])  # e.g. killed at exit
    assert again.exit_code == 0 and "stopped after 30 steps" in again.stdout  # a finished run trains no more


def test_a_torn_metrics_line_is_skipped_with_a_warning(tmp_path, tiny_data):
    config, run_dir = _config(tmp_path, tiny_data, max_steps=20, save_every=10, valid_every=10), tmp_path / "run"
    assert runner.invoke(app, ["train", str(config), "--run-dir", str(run_dir), "--quiet"]).exit_code == 0
    metrics = run_dir / "metrics.jsonl"
    with open(metrics, "a") as handle:
        handle.write('{"kind": "train", "step": 21, "lo')  # what a kill in the middle of an append leaves
    lines = len(metrics.read_text().splitlines())
    plotted = runner.invoke(app, ["plot", str(run_dir)])
    assert plotted.exit_code == 0, plotted.output
    assert f"{metrics}:{lines}: not a whole metrics record" in plotted.stderr
    resumed = runner.invoke(app, ["train", str(config), "--resume", str(run_dir), "--quiet",
                                  "--set", "train.max_steps=30"])  # fmt: skip
    assert resumed.exit_code == 0, resumed.output
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line whole again
    assert max(r["step"] for r in records) == 30


def _train_command(config: Path, run_dir: Path, *, resume: bool) -> list[str]:
    where = ["--resume", str(run_dir)] if resume else ["--run-dir", str(run_dir)]
    return [sys.executable, "-m", "seq2seq", "train", str(config), *where, "--quiet"]


# A training run that SIGKILLs itself at the n-th time it reaches a chosen point: a kill that lands
# exactly there on any machine, however fast, where a kill after a random delay may land anywhere.
KILLED_AT = """
import io, os, signal, sys
import seq2seq.checkpoint as checkpoint, seq2seq.training.run_log as run_log, seq2seq.training.trainer as trainer
where, nth, calls = sys.argv[1], int(sys.argv[2]), [0]

def due():
    calls[0] += 1
    return calls[0] == nth

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if where == "inside a checkpoint write":  # half its bytes on disk, under its temporary name
    save = checkpoint.torch.save
    def half_then_die(obj, handle, *args, **kwargs):
        if due():
            whole = io.BytesIO()
            save(obj, whole, *args, **kwargs)
            handle.write(whole.getvalue()[: len(whole.getvalue()) // 2])
            handle.flush()
            die()
        return save(obj, handle, *args, **kwargs)
    checkpoint.torch.save = half_then_die
elif where == "before last.pt moves on":  # the new checkpoint is whole, last.pt still the one before
    link = checkpoint._link_latest
    checkpoint._link_latest = lambda path, latest: die() if due() else link(path, latest)
elif where == "inside a metrics line":  # a torn line at the end of metrics.jsonl
    write = run_log.MetricsLog.write
    def torn_then_die(self, kind, **values):
        if due():
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write('{"kind": "' + kind + '", "ste')
            die()
        return write(self, kind, **values)
    run_log.MetricsLog.write = torn_then_die
else:  # "inside an update"
    step = trainer.train_step
    trainer.train_step = lambda *args, **kwargs: die() if due() else step(*args, **kwargs)
from seq2seq.cli.main import main
sys.argv = ["seq2seq", *sys.argv[3:]]
main()
"""


@pytest.mark.slow
def test_kills_at_chosen_moments_then_resume_give_the_uninterrupted_model(tmp_path, tiny_data):
    """SIGKILL inside a checkpoint write, between a checkpoint and last.pt, inside a metrics line and
    inside an update, each at a seeded random occurrence (save_every=2: many checkpoints); every
    restart resumes from the last whole checkpoint, and the end result is bitwise the uninterrupted run.
    What a resume must carry on is all in play: a budgeted schedule that decays to its floor, a weight
    average, 32 updates over four epochs (a quarter of the tiny corpus: 8 or 9 batches each), each with
    its own sampled segmentation, and dropout that is off through the first (train.dropout_from_epoch)."""
    for lang in ("en", "xx"):
        train = tiny_data / f"train.{lang}"
        train.write_text("".join(train.read_text().splitlines(keepends=True)[:750]))
    raw = tiny_config_dict(tiny_data, max_steps=32, save_every=2, valid_every=16, keep_last=3, log_every=4,
                           schedule="linear", warmup_steps=10, min_lr=0.0004, ema_decay=0.99,
                           dropout_from_epoch=2)  # fmt: skip
    raw["data"].update(subword_alpha=0.2, subword_variants=3)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    reference = tmp_path / "reference"
    subprocess.run(_train_command(config, reference, resume=False), check=True, env=env, capture_output=True)
    run_dir, rng = tmp_path / "killed", random.Random(7)
    kills = [("inside a checkpoint write", rng.randint(2, 6)), ("before last.pt moves on", rng.randint(2, 6)),
             ("inside a metrics line", rng.randint(1, 3)), ("inside an update", rng.randint(3, 12))]  # fmt: skip
    for where, nth in kills:
        resume = bool(numbered_checkpoints(run_dir / "checkpoints"))
        command = [
            sys.executable,
            "-c",
            KILLED_AT,
            where,
            str(nth),
            *_train_command(config, run_dir, resume=resume)[3:],
        ]
        result = subprocess.run(command, env=env, capture_output=True, timeout=300)
        assert result.returncode == -signal.SIGKILL, (where, result.stderr.decode()[-2000:])
        for checkpoint in numbered_checkpoints(run_dir / "checkpoints"):
            Checkpoint.load(checkpoint)  # never a half-written checkpoint under its real name
    finished = subprocess.run(_train_command(config, run_dir, resume=True), env=env, capture_output=True, timeout=300)
    assert finished.returncode == 0, finished.stderr.decode()
    assert not _temporaries(run_dir)  # what the kills left half-written is gone
    ours = Checkpoint.load(run_dir / "checkpoints" / "last.pt")
    theirs = Checkpoint.load(reference / "checkpoints" / "last.pt")
    assert ours.progress.step == theirs.progress.step == 32 and theirs.progress.epoch == 4
    for name, tensor in theirs.model.items():
        assert torch.equal(ours.model[name], tensor), name
    assert ours.ema.keys() == theirs.ema.keys() and theirs.ema
    for name, tensor in theirs.ema.items():
        assert torch.equal(ours.ema[name], tensor), name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]  # all whole
    logged = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in logged] == list(range(4, 33, 4))  # none lost, none twice
    assert logged[-1]["lr"] == pytest.approx(0.0004)  # the floor, at the budget's end


def _dead_pid() -> int:
    """The PID of a process that has ended (a killed writer's)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


HOST = socket.gethostname()


def test_stale_temporaries_of_ended_processes_go_and_a_live_writers_stay(tmp_path):
    from seq2seq.files import remove_stale_temporaries

    dead, alive = _dead_pid(), os.getpid()
    (tmp_path / f".out.txt.tmp-{HOST}-{dead}").write_text("half")
    (tmp_path / f".entry.tmp-{HOST}-{dead}").mkdir()
    (tmp_path / f".entry.tmp-{HOST}-{dead}" / "ids.bin").write_text("half")
    keep = [tmp_path / f".out.txt.tmp-{HOST}-{alive}", tmp_path / "out.txt", tmp_path / ".notes.tmp-draft"]
    for path in keep:
        path.write_text("mine")
    remove_stale_temporaries(tmp_path, "out.txt")
    assert not (tmp_path / f".out.txt.tmp-{HOST}-{dead}").exists() and (tmp_path / f".entry.tmp-{HOST}-{dead}").exists()
    remove_stale_temporaries(tmp_path)
    assert not (tmp_path / f".entry.tmp-{HOST}-{dead}").exists()
    assert all(path.read_text() == "mine" for path in keep)  # a live writer's, the user's, not ours


def test_another_hosts_temporaries_stay_whatever_their_pid(tmp_path):
    """A cache folder shared between hosts or containers: another host's writer may be alive with a
    PID that no process here has; its folder is not this host's to sweep."""
    from seq2seq.files import remove_stale_temporaries, temporary_path

    dead = _dead_pid()
    theirs = tmp_path / f".0123abcd.tmp-{HOST}x-{dead}"  # the PID is dead here, not on host {HOST}x
    theirs.mkdir()
    (theirs / "ids.bin").write_text("being written on another host")
    ours = tmp_path / f".4567cdef.tmp-{HOST}-{dead}"
    ours.mkdir()
    remove_stale_temporaries(tmp_path)
    assert (theirs / "ids.bin").exists() and not ours.exists()
    assert temporary_path(tmp_path / "out.txt").name == f".out.txt.tmp-{HOST}-{os.getpid()}"


def test_every_writer_sweeps_what_a_killed_one_left(tmp_path, trained_checkpoint):
    """-o outputs, exported models and encoding-cache entries: each kind of temporary seq2seq writes."""
    from seq2seq.data import cache
    from seq2seq.files import write_text_atomic

    dead = _dead_pid()
    stale_output = tmp_path / f".report.json.tmp-{HOST}-{dead}"
    stale_output.write_text("half")
    write_text_atomic(tmp_path / "report.json", "{}\n")
    assert not stale_output.exists() and (tmp_path / "report.json").read_text() == "{}\n"

    stale_entry = tmp_path / "cache" / f".0123abcd.tmp-{HOST}-{dead}"
    stale_entry.mkdir(parents=True)
    with cache.new_entry(tmp_path / "cache" / "4567cdef") as folder:
        cache.write_report(folder, {})
    assert not stale_entry.exists() and (tmp_path / "cache" / "4567cdef" / "report.json").exists()

    pytest.importorskip("ctranslate2", reason="optional extra: pip install -e '.[export]' (included in [dev])")
    from seq2seq.deploy.export import export_checkpoint

    stale_staging = tmp_path / f".model.tmp-{HOST}-{dead}"
    stale_staging.mkdir()
    (stale_staging / "model.bin").write_text("half")
    checkpoint, _ = trained_checkpoint
    export_checkpoint(checkpoint, tmp_path / "model", check_lines=5)
    assert not stale_staging.exists() and (tmp_path / "model" / "model.bin").exists()


def _interrupt_at(monkeypatch, steps: dict[int, list[int]]) -> list[int]:
    """Send this process the signals steps[n] during its n-th update (counted from 1), as Ctrl-C or a
    SIGTERM landing in the middle of an update would; the calls are counted in the list returned."""
    import seq2seq.training.trainer as trainer

    real_step, calls = trainer.train_step, []

    def signalled_step(*args, **kwargs):
        calls.append(1)
        for number in steps.get(len(calls), []):
            os.kill(os.getpid(), number)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", signalled_step)
    return calls


@pytest.mark.slow
def test_an_interrupted_run_saves_its_last_update_and_resumes_as_the_uninterrupted_one(
    tmp_path, tiny_data, monkeypatch
):
    """Ctrl-C in the middle of update 7, between the saves of steps 4 and 8: the update ends, step 7 is
    saved (not lost back to step 4), KeyboardInterrupt follows. Resumed, the run ends bitwise as the
    uninterrupted one, with the same checkpoints kept (keep_last), the step-7 save replaced."""
    from seq2seq.config_files import config_from_dict
    from seq2seq.training.trainer import Trainer

    from ..conftest import make_trainer

    settings = dict(max_steps=12, save_every=4, keep_last=3, valid_every=6, ema_decay=0.99)
    make_trainer(tmp_path, tiny_data, "straight", **settings).run()
    interrupted = make_trainer(tmp_path, tiny_data, "interrupted", **settings)
    calls = _interrupt_at(monkeypatch, {7: [signal.SIGINT]})
    with pytest.raises(KeyboardInterrupt):
        interrupted.run()
    assert len(calls) == 7
    checkpoints = tmp_path / "interrupted" / "checkpoints"
    assert [path.name for path in numbered_checkpoints(checkpoints)] == ["step_00000004.pt", "step_00000007.pt"]
    saved = Checkpoint.load(checkpoints / "last.pt")
    assert saved.progress.step == 7 and saved.interrupted
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handed back

    monkeypatch.undo()
    raw = tiny_config_dict(tiny_data, **settings)
    Trainer(config_from_dict(raw, origin="test"), tmp_path / "interrupted", resume=True, show_progress=False).run()
    kept = [[path.name for path in numbered_checkpoints(tmp_path / name / "checkpoints")]
            for name in ("interrupted", "straight")]  # fmt: skip
    assert kept[0] == kept[1] == ["step_00000004.pt", "step_00000008.pt", "step_00000012.pt"]
    ours, theirs = (Checkpoint.load(tmp_path / run / "checkpoints" / "last.pt") for run in ("interrupted", "straight"))
    clockless = [dataclasses.replace(run.progress, train_seconds=0.0) for run in (ours, theirs)]
    assert clockless[0] == clockless[1] and not ours.interrupted
    for name, tensor in theirs.model.items():
        assert torch.equal(ours.model[name], tensor), name
    for name, tensor in theirs.ema.items():
        assert torch.equal(ours.ema[name], tensor), name


@pytest.mark.slow
def test_a_validation_cut_short_by_a_signal_is_made_first_by_the_resumed_run(tmp_path, tiny_data, monkeypatch):
    """SIGTERM while step 6 validates: the validation is dropped between its batches rather than
    awaited, step 6 is saved with it due, and the resumed run validates step 6 first: its validations,
    best.pt and weights are the uninterrupted run's."""
    import seq2seq.training.trainer as trainer
    from seq2seq.cli.boundary import Terminated, _sigterm_raises
    from seq2seq.config_files import config_from_dict
    from seq2seq.training.trainer import Trainer

    from ..conftest import make_trainer

    settings = dict(max_steps=12, save_every=4, valid_every=6, ema_decay=0.99)
    straight = make_trainer(tmp_path, tiny_data, "straight", **settings)
    straight.run()
    real_validate, batches = trainer.validate, []

    def signalled_validate(*args, between_batches, **kwargs):
        def counted():
            batches.append(1)
            if len(batches) == 2:  # the first batch done: SIGTERM, and no batch after it
                os.kill(os.getpid(), signal.SIGTERM)
            between_batches()

        return real_validate(*args, between_batches=counted, **kwargs)

    monkeypatch.setattr(trainer, "validate", signalled_validate)
    stopped = make_trainer(tmp_path, tiny_data, "stopped", **settings)
    with _sigterm_raises(), pytest.raises(Terminated):
        stopped.run()
    assert len(batches) == 2
    saved = Checkpoint.load(tmp_path / "stopped" / "checkpoints" / "last.pt")
    assert saved.progress.step == 6 and saved.progress.validation_due and saved.interrupted
    assert not [r for r in stopped.metrics.read() if r["kind"] == "valid"]
    assert not (tmp_path / "stopped" / "checkpoints" / "best.pt").exists()

    monkeypatch.undo()
    raw = tiny_config_dict(tiny_data, **settings)
    resumed = Trainer(config_from_dict(raw, origin="test"), tmp_path / "stopped", resume=True, show_progress=False)
    resumed.run()
    validations = [[(r["step"], r["bleu"]) for r in run.metrics.read() if r["kind"] == "valid"]
                   for run in (resumed, straight)]  # fmt: skip
    assert validations[0] == validations[1] and [step for step, _ in validations[0]] == [6, 12]
    for name in ("best.pt", "last.pt"):
        ours, theirs = (Checkpoint.load(tmp_path / run / "checkpoints" / name) for run in ("stopped", "straight"))
        assert ours.progress.step == theirs.progress.step and not ours.progress.validation_due
        for key, tensor in theirs.model.items():
            assert torch.equal(ours.model[key], tensor), (name, key)


def test_a_second_signal_stops_the_run_at_once(tmp_path, tiny_data, monkeypatch):
    """Ctrl-C, then SIGTERM in the same update: the second is not deferred; it stops the run as a SIGTERM
    does (Terminated, the CLI's exit 143), and nothing is saved past the last periodic save."""
    from seq2seq.cli.boundary import Terminated, _sigterm_raises

    from ..conftest import make_trainer

    trainer = make_trainer(tmp_path, tiny_data, max_steps=12, save_every=4, valid_every=100)
    _interrupt_at(monkeypatch, {2: [signal.SIGINT, signal.SIGTERM]})
    with _sigterm_raises(), pytest.raises(Terminated):
        trainer.run()
    assert numbered_checkpoints(tmp_path / "run" / "checkpoints") == []


def test_sigterm_saves_the_run_and_the_command_says_where_it_stopped(tmp_path, tiny_data):
    """SIGTERM (a preempted machine, `timeout`, a container that stops) to `seq2seq train` once it trains:
    exit 143, the update under way saved although no periodic save was due, and the step named."""
    import time

    config = _config(tmp_path, tiny_data, max_steps=100000, save_every=100000, valid_every=100000, log_every=1)
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [str(part) for part in _train_command(config, run_dir, resume=False)], stderr=subprocess.PIPE, text=True
    )
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n")):  # the event: an update has been logged
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stderr = process.communicate(timeout=120)[1]
    assert process.returncode == 143, stderr
    (saved,) = numbered_checkpoints(run_dir / "checkpoints")
    step = Checkpoint.load(saved).progress.step
    assert step >= 1 and f"interrupted at step {step}; saved {saved}" in stderr
    assert stderr.splitlines()[-1] == (
        f"interrupted; the last checkpoint is kept: continue with `seq2seq train {config} --resume {run_dir}`"
    )

"""DDP on CPU with gloo: two ranks equal one process with the same global batch, and resume works;
a time budget runs on rank 0's clock from the first update; a launch that train.device cannot place
is one clear error."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from seq2seq.checkpoint import Checkpoint
from seq2seq.errors import UserInputError
from seq2seq.training.distributed import cuda_chosen

from ..conftest import tiny_config_dict

pytestmark = pytest.mark.slow


def train(config: Path, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    where = ["--resume", str(run_dir)] if "--resume" in extra else ["--run-dir", str(run_dir)]
    command = [sys.executable, "-m", "seq2seq", "train", str(config), "--quiet", *where]
    command += [arg for arg in extra if arg != "--resume"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    # the workers end without the interpreter's teardown (distributed.leave_worker): rank 0's buffered
    # result line still arrives, once
    assert result.stdout.count("steps (max_steps") == 1, result.stdout
    return result


def final_parameters(run_dir: Path) -> dict[str, torch.Tensor]:
    return Checkpoint.load(run_dir / "checkpoints" / "last.pt").model


@pytest.fixture
def config(tmp_path, tiny_data) -> Path:
    raw = tiny_config_dict(tiny_data, max_steps=6, save_every=3, valid_every=100, log_every=3, threads=1, device="cpu")
    raw["model"]["dropout"] = 0.0  # ranks draw their own dropout masks; compare the arithmetic alone
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(("untied", "precision"), [(False, "fp32"), (True, "fp32"), (False, "bf16")],
                         ids=["tied", "untied-output-layer", "bf16-working-copy"])  # fmt: skip
def test_two_ranks_equal_one_process_with_the_same_global_batch(tmp_path, config, untied, precision):
    """Untied, the output layer's weight is used outside DDP's forward, by the fused loss: its
    gradient must still be averaged over the ranks. In bf16, DDP wraps the working copy
    (training/working_copy.py), whose gradients it averages before they are handed to the masters."""
    untie = ["--set", "model.share_embeddings=false", "--set", "model.tie_output=false"] if untied else []
    untie += ["--set", f"train.precision={precision}"]
    ddp_run = train(config, tmp_path / "ddp", "--nproc", "2", *untie)
    train(config, tmp_path / "single", "--set", "train.accum_steps=2", *untie)
    assert ddp_run.stderr.count("outlasts train.max_steps") == 1  # every rank shows warnings; rank 0 says this
    ddp, single = final_parameters(tmp_path / "ddp"), final_parameters(tmp_path / "single")
    for name, tensor in single.items():
        torch.testing.assert_close(ddp[name], tensor, atol=1e-6, rtol=0, msg=name)
    halfway = Checkpoint.load(tmp_path / "single" / "checkpoints" / "step_00000003.pt").model
    assert not torch.equal(halfway["output_proj.weight"], single["output_proj.weight"])  # training moved them
    log = [yaml.safe_load(line) for line in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["kind"], line["step"]) for line in log] == [("train", 3), ("train", 6), ("valid", 6)]  # rank 0 alone


def _train_on_a_fake_clock(rank: int, port: int, raw: dict, run_dir: Path, seconds: list[float]) -> None:
    """One rank of a two-rank run whose clock advances `seconds[rank]` per update (a slower rank 1:
    the ranks' clocks disagree, as real ones do); it writes the learning rate of each update."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import seq2seq.training.trainer as trainer
    from seq2seq.config_files import config_from_dict
    from seq2seq.training.distributed import shutdown_distributed

    now, rates, real_step = [0.0], [], trainer.train_step

    def timed_step(*args, lr: float, **kwargs):
        rates.append(lr)
        now[0] += seconds[rank]
        return real_step(*args, lr=lr, **kwargs)

    trainer.train_step = timed_step
    trainer.time = types.SimpleNamespace(perf_counter=lambda: now[0])
    torch.set_num_threads(1)
    result = trainer.Trainer(config_from_dict(raw, origin="test"), run_dir, show_progress=False).run()
    shutdown_distributed()
    (run_dir / f"rates-{rank}.json").write_text(json.dumps({"rates": rates, "step": result.progress.step}))


def test_a_time_budget_runs_on_rank_zeros_clock_from_the_first_update(tmp_path, tiny_data):
    """max_time 10 s, rank 0 takes 1 s an update and rank 1 3 s: both ranks decay the learning rate
    linearly by rank 0's clock from the first update (not by steps until a log step shares the
    clock) and stop together after update 10."""
    import torch.multiprocessing as mp

    raw = tiny_config_dict(tiny_data, max_steps=1000, max_time=10.0, schedule="linear", warmup_steps=0, lr=0.002,
                           log_every=100, valid_every=1000, save_every=1000, device="cpu")  # fmt: skip
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_dir = tmp_path / "run"
    mp.spawn(_train_on_a_fake_clock, args=(port, raw, run_dir, [1.0, 3.0]), nprocs=2, join=True)
    ranks = [json.loads((run_dir / f"rates-{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["step"] == 10
    # update k runs at the budget share k / 10 (from update 2 on: the first has no clock yet)
    assert ranks[0]["rates"][1:] == pytest.approx([0.002 * (1 - k / 10) for k in range(2, 11)])


def test_more_ranks_than_gpus_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cuda_chosen("auto", local_rank=0) and not cuda_chosen("cpu", local_rank=1)
    with pytest.raises(UserInputError, match=r"LOCAL_RANK 1, 1 GPU\(s\).*--nproc-per-node 1, or train.device=cpu"):
        cuda_chosen("auto", local_rank=1)


def test_cuda_asked_for_without_a_gpu_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not cuda_chosen("auto", local_rank=0)
    with pytest.raises(UserInputError, match="train.device: cuda, but torch sees no CUDA GPU"):
        cuda_chosen("cuda", local_rank=0)


def _train_signalled(rank: int, port: int, raw: dict, run_dir: Path, resume: bool, signal_at: int) -> None:
    """One rank of a two-rank run; rank 0 alone gets SIGINT during update `signal_at` (0: never), and
    each rank writes the step it ended at and how ("interrupted" or "finished")."""
    import signal

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))  # fmt: skip
    import seq2seq.training.trainer as trainer
    from seq2seq.config_files import config_from_dict
    from seq2seq.training.distributed import shutdown_distributed

    real_step, calls = trainer.train_step, []

    def signalled_step(*args, **kwargs):
        calls.append(1)
        if rank == 0 and len(calls) == signal_at:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(*args, **kwargs)

    trainer.train_step = signalled_step
    torch.set_num_threads(1)
    run = trainer.Trainer(config_from_dict(raw, origin="test"), run_dir, resume=resume, show_progress=False)
    try:
        run.run()
        ended = "finished"
    except KeyboardInterrupt:
        ended = "interrupted"
    shutdown_distributed()
    (run_dir / f"ended-{rank}.json").write_text(json.dumps({"how": ended, "step": run.progress.step}))


def test_two_ranks_stop_together_after_rank_zeros_signal_and_resume_exactly(tmp_path, tiny_data):
    """Ctrl-C reaches rank 0 alone during update 4 (between saves): both ranks end that update, save
    it together and stop as interrupted; resumed, the run ends as the uninterrupted one does. With
    decoder LayerDrop, so that each rank skips its own layers (parameters without gradients) and
    resumes its own random state."""
    import torch.multiprocessing as mp

    raw = tiny_config_dict(tiny_data, max_steps=6, save_every=5, valid_every=100, threads=1, device="cpu")
    raw["model"]["decoder_layerdrop"] = 0.3

    def spawn(run_dir: Path, *, resume: bool = False, signal_at: int = 0) -> list[dict]:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        mp.spawn(_train_signalled, args=(port, raw, run_dir, resume, signal_at), nprocs=2, join=True)
        return [json.loads((run_dir / f"ended-{rank}.json").read_text()) for rank in (0, 1)]

    assert spawn(tmp_path / "straight") == [{"how": "finished", "step": 6}] * 2
    assert spawn(tmp_path / "stopped", signal_at=4) == [{"how": "interrupted", "step": 4}] * 2
    saved = Checkpoint.load(tmp_path / "stopped" / "checkpoints" / "last.pt")
    assert saved.progress.step == 4 and saved.interrupted and len(saved.rng.torch) == 2
    assert spawn(tmp_path / "stopped", resume=True) == [{"how": "finished", "step": 6}] * 2
    straight, resumed = final_parameters(tmp_path / "straight"), final_parameters(tmp_path / "stopped")
    for name, tensor in straight.items():
        assert torch.equal(resumed[name], tensor), name


def test_sigterm_to_a_multi_process_training_saves_it_and_leaves_no_worker_behind(tmp_path, config):
    """`seq2seq train --nproc 2` stopped by SIGTERM (a `timeout`, a container's stop) once it trains: the
    signal reaches torchrun's workers, which save the update under way although no save was due, and the
    command ends with them, 143. Its torchrun was killed before: the workers trained on, orphaned,
    holding the run directory, which a two-rank resume right after the command ended now takes."""
    import signal
    import time

    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "seq2seq", "train", str(config), "--quiet", "--run-dir", str(run_dir),
               "--nproc", "2", "--set", "train.max_steps=100000", "--set", "train.save_every=100000",
               "--set", "train.log_every=1"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n")):  # the event: an update has been logged
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    stderr = process.communicate(timeout=120)[1]  # the workers hold stderr too: all of them have ended
    assert process.returncode == 143, stderr
    saved = Checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert saved.progress.step >= 1 and saved.interrupted and len(saved.rng.torch) == 2
    assert stderr.count("interrupted; the last checkpoint is kept") == 2  # rank 0's and the command's
    step = saved.progress.step
    train(config, run_dir, "--nproc", "2", "--resume", "--set", f"train.max_steps={step + 1}")  # nothing holds the run
    assert Checkpoint.load(run_dir / "checkpoints" / "last.pt").progress.step == step + 1

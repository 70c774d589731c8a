"""Multi-process training on torch.distributed (launched by torchrun): setup and the few collectives we need.

A single process (no WORLD_SIZE in the environment) gets a context whose collectives are no-ops,
so the trainer has one code path.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from seq2seq.errors import UserInputError


@dataclass(frozen=True)
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    use_cuda: bool = False
    host_group: Any = None  # gloo, for values that live on the host (under nccl: its own group)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes checkpoints, logs and progress bars."""
        return self.rank == 0

    def device(self) -> torch.device:
        """This rank's device: its own GPU (by local rank), or the CPU."""
        return torch.device("cuda", self.local_rank) if self.use_cuda else torch.device("cpu")

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def sum(self, values: list[float], device: torch.device) -> list[float]:
        """Element-wise sum over ranks (one collective for the whole list)."""
        if not self.enabled:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def broadcast(self, value: Any) -> Any:
        """Rank 0's value, on every rank (for decisions only rank 0 can make: time limits, patience)."""
        if not self.enabled:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def rank_zero_numbers(self, *values: float) -> list[float]:
        """Rank 0's numbers on every rank, over the host (no GPU is waited for): a cheap collective
        that an update can afford, e.g. rank 0's training clock, so that every rank sets the same
        learning rate and stops at the same step."""
        if not self.enabled:
            return list(values)
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.broadcast(tensor, src=0, group=self.host_group)
        return tensor.tolist()

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value, in rank order, on every rank."""
        if not self.enabled:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


def setup_distributed(device: str = "auto") -> DistributedContext:
    """Join the process group torchrun described in the environment (nccl on CUDA, gloo on CPU).

    `device` is train.device: auto takes the GPU when torch sees one. Each rank needs a GPU of its
    own, so a launch with more processes on a machine than it has GPUs is refused here, in one line,
    rather than by CUDA's "invalid device ordinal" deep inside the first step.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = cuda_chosen(device, local_rank)
    if world_size == 1:
        return DistributedContext(use_cuda=use_cuda)
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    host_group = dist.new_group(backend="gloo") if use_cuda else None  # None: the default group, gloo itself
    return DistributedContext(dist.get_rank(), world_size, local_rank, use_cuda, host_group)


def cuda_chosen(device: str, local_rank: int) -> bool:
    """Whether train.device (auto, cpu or cuda) puts this rank on a GPU; UserInputError when it cannot."""
    if device == "cpu":
        return False
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and available == 0:
        raise UserInputError("train.device: cuda, but torch sees no CUDA GPU here; use auto or cpu")
    if available and local_rank >= available:
        raise UserInputError(
            f"train.device: {device}: torchrun started more processes on this machine than it has GPUs "
            f"(LOCAL_RANK {local_rank}, {available} GPU(s)); use --nproc-per-node {available}, or train.device=cpu"
        )
    return available > 0


def shutdown_distributed() -> None:
    if dist.is_initialized():
        # DDP's reducer, left in the finished trainer's reference cycles, holds the process group and
        # gloo's pending work: collected only at interpreter exit, after the group was destroyed, they
        # sometimes aborted a rank ("terminate called without an active exception"). Collect them first.
        gc.collect()
        dist.destroy_process_group()


def leave_worker() -> NoReturn:
    """End a torchrun worker whose training finished, without the interpreter's teardown.

    Gloo's C++ threads can outlive the destroyed process group, and when the interpreter tears down
    the objects they still reference, a rank now and then aborts ("terminate called without an
    active exception", SIGABRT) after its work is saved: torchrun then reports the whole run failed.
    PyTorch's own attempt to fix this at exit was abandoned (pytorch/pytorch#179291). The worker's
    output is flushed and the process ends here, exit code 0, before that teardown."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""Multi-process training on torch.distributed (launched by torchrun): setup and the few collectives we need.

A single process (no WORLD_SIZE in the environment) gets a context whose collectives are no-ops,
so the trainer has one code path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 alone writes checkpoints, logs and progress bars."""
        return self.rank == 0

    def device(self) -> torch.device:
        return torch.device("cuda", self.local_rank) if torch.cuda.is_available() else torch.device("cpu")

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

    def gather(self, value: Any) -> list[Any]:
        """Every rank's value, in rank order, on every rank."""
        if not self.enabled:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


def setup_distributed() -> DistributedContext:
    """Join the process group torchrun described in the environment (nccl on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DistributedContext()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return DistributedContext(dist.get_rank(), world_size, local_rank)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()

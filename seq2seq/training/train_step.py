"""One optimizer update, as a function of its inputs: the mixed-precision train step, written once.

In the canonical order: autocast forward (or a bf16 working copy's) -> scaled backward -> unscale ->
clip -> step -> update -> zero_grad. Nothing here reads a tensor's value into Python, so on a GPU a
step never waits for the device (a host sync); what the step measured comes back as device tensors,
read when the trainer logs. The loss scaler that the step needs is built here too (the optimizer in
optimizer.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx.experimental._config
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from seq2seq.checkpoint import Progress
from seq2seq.config import TrainConfig
from seq2seq.data.batching import Batch
from seq2seq.errors import UserInputError
from seq2seq.training.loss import output_layer_loss
from seq2seq.training.optimizer import step_on_flag
from seq2seq.training.working_copy import WorkingCopy

log = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StepResult:
    """What one update measured, still on the device."""

    loss_sum: Tensor  # () label-smoothed loss summed over this rank's target tokens
    skipped: Tensor  # () bool: True when non-finite gradients meant the update was never applied
    grad_norm: Tensor  # () global gradient norm before clipping


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The autocast context of `precision` (fp32: a disabled one) on `device`; `auto` must have been
    resolved first (precision.choose_precision), so a step never guesses."""
    if precision != "fp32" and precision not in AUTOCAST_DTYPES:
        raise ValueError(f"precision {precision!r}: expected fp32, bf16 or fp16 (resolve 'auto' first)")
    dtype = AUTOCAST_DTYPES.get(precision)
    return torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None)


def compile_for_training(module: nn.Module) -> Callable[..., Tensor]:
    """torch.compile with every size symbolic from the first step, and no two sizes assumed equal.

    Token-bucketed batches change (sentences, length) at almost every step. Left to find out which
    sizes vary, torch.compile recompiled for each new combination until its limit of 8 and then ran
    the model eagerly, minutes of compiling for eager speed. With dynamic sizes it compiles a few
    times early on (for source and target lengths that are or are not multiples of 8), and the
    compiled step is faster than eager (benchmark_train's compiled side on an H100, in the ledger).
    By default it also gives sizes that are equal when it first traces them one symbol ("duck
    sizing"): a first batch whose sources and targets had the same length compiled a graph for equal
    lengths alone, and the next batch compiled it again, a minute or two of a GPU's time
    (`TORCH_LOGS=recompiles`). Each call compiles, where it does, without that assumption.
    """
    compiled = torch.compile(module, dynamic=True)

    def forward(*args, **kwargs) -> Tensor:
        with _sizes_kept_apart():
            return compiled(*args, **kwargs)

    return forward


def _sizes_kept_apart() -> contextlib.AbstractContextManager:
    """Duck sizing off while torch.compile traces, where this PyTorch has the (private) switch; where it
    has not, sizes that start equal cost one more compile, nothing else."""
    shapes = torch.fx.experimental._config
    return shapes.patch(use_duck_shape=False) if hasattr(shapes, "use_duck_shape") else contextlib.nullcontext()


def build_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """Loss scaling for fp16 only; for the other precisions a disabled scaler that passes through."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    batches: list[Batch],
    *,
    update_tokens: int,
    lr: float,
    config: TrainConfig,
    forward: Callable[..., Tensor] | None = None,
    ddp: DistributedDataParallel | None = None,
    working: WorkingCopy | None = None,
) -> StepResult:
    """One update of `model` over this rank's `batches` (accumulated), at learning rate `lr`.

    The loss is normalised by `update_tokens`, the target tokens of the whole update on all ranks,
    so any split over ranks and accumulation steps gives the same gradient. `forward` is the model
    as wrapped for training (DDP, torch.compile; default: `model`); under DDP, pass the wrapper as
    `ddp` too, so that inner accumulation steps skip its gradient all-reduce. With a `working` copy
    (bf16 weights, working_copy.py), the passes run on it outside autocast (`forward` and `ddp` wrap
    it), and it ends the update (`WorkingCopy.update`): its gradients step `model`'s fp32 weights and
    it is made again from them.
    """
    runs = model if working is None else working.model
    if forward is None:  # not `or`: a compiled module has no truth value
        forward = runs if ddp is None else ddp
    world_size = torch.distributed.get_world_size() if ddp is not None else 1
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), device=device)
    _training_mode(model)
    _training_mode(runs)
    precision = config.precision if working is None else "fp32"  # a working copy is bf16 through and through
    for index, batch in enumerate(batches):
        batch = batch.to(device)
        last = index == len(batches) - 1
        sync = contextlib.nullcontext() if ddp is None or last else ddp.no_sync()
        with sync:
            with autocast(device, precision):
                rows = forward(batch.src, batch.tgt_in, batch.target_positions, output_layer=False)
                loss = output_layer_loss(rows, runs.output_proj.weight, batch.targets, config.label_smoothing)
            scaler.scale(loss * (world_size / update_tokens)).backward()  # DDP averages over ranks
        loss_sum += loss.detach()
    max_norm = config.clip_norm if config.clip_norm > 0 else math.inf
    for group in optimizer.param_groups:
        group["lr"] = lr
    if working is None:
        scaler.unscale_(optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        skipped = ~torch.isfinite(grad_norm)  # any inf/NaN gradient makes the norm non-finite
        step_unless_skipped(optimizer, scaler, skipped)
    else:  # bf16: no loss scaling to undo
        grad_norm, skipped = working.update(optimizer, max_norm)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss_sum, skipped, grad_norm)


def _training_mode(module: nn.Module) -> None:
    """module.train(), where some submodule is not in training mode (validation left them in eval mode).
    train() sets each submodule's flag through nn.Module.__setattr__, whatever it was: a step paid that
    for every module of the master and of the working copy, a large share of a small model's host time a step
    (profile_train.py's fixed host cost)."""
    if not all(submodule.training for submodule in module.modules()):
        module.train()


def step_unless_skipped(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, skipped: Tensor) -> None:
    """Apply the update unless the device flag `skipped` is set, without reading the flag on the host:
    the fp16 scaler hands the optimizer its own overflow flag, and for the other precisions we hand
    it `skipped`."""
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
        return
    step_on_flag(optimizer, skipped)


MAX_SKIPPED_IN_A_ROW = 20  # fp16 loss scaling alone can skip a few in a row; this many means divergence


class TrainingDiverged(UserInputError):
    """Too many consecutive updates with non-finite gradients: the settings need changing."""


class SkippedUpdates:
    """Counts updates skipped for non-finite gradients, on the device.

    Reading a flag every step would stall a GPU until the step finishes (a host sync); these
    counters are read only when the trainer logs or saves.
    """

    def __init__(self, device: torch.device) -> None:
        self.total = torch.zeros((), dtype=torch.long, device=device)
        self.in_a_row = torch.zeros_like(self.total)
        self.longest_run = torch.zeros_like(self.total)

    def record(self, skipped: torch.Tensor) -> None:
        self.total += skipped
        self.in_a_row = (self.in_a_row + 1) * skipped
        torch.maximum(self.longest_run, self.in_a_row, out=self.longest_run)

    def collect(self) -> tuple[int, int]:
        """Skipped updates since the last call and the longest run in a row that reached into them.

        A run that straddles two calls is counted whole once it goes on.
        """
        total, longest_run = (int(value) for value in torch.stack([self.total, self.longest_run]).tolist())
        self.total.zero_()
        self.longest_run.zero_()
        return total, longest_run

    def count_into(self, progress: Progress) -> None:
        """Add the updates skipped since the last call to `progress`, with a warning; raise
        TrainingDiverged where MAX_SKIPPED_IN_A_ROW of them came in a row."""
        skipped, longest_run = self.collect()
        progress.skipped_steps += skipped
        if skipped:
            log.warning("%d updates skipped for non-finite gradients (up to step %d)", skipped, progress.step)
        if longest_run >= MAX_SKIPPED_IN_A_ROW:
            raise TrainingDiverged(
                f"training diverged: {longest_run} updates in a row had non-finite gradients "
                f"(up to step {progress.step}); lower train.lr, raise train.warmup_steps or use fp32/bf16"
            )

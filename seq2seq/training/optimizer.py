"""The optimizer: Adam or AdamW, built fused, stepped on a device flag, and on a CPU with the fused
kernels, for bf16 training, one pass with the end of the update.

A bf16 update on a working copy (working_copy.py) ended with five passes over every weight: its
gradients gathered into one buffer, their norm, their widening to fp32 and clipping into another,
PyTorch's fused Adam reading those and the moments and writing the fp32 weights, and the weights
cast into the working copy. Where the matrix products are fast those passes are a share of the step.
After the norm, `adam_update_cpu` takes one (cpu_optimizer.cpp): each gradient read where autograd
left it, clipped, the Adam step applied as PyTorch's fused Adam applies it, and the working copy
written beside the weight. The optimizer stays PyTorch's: its settings, its state (moments, step
counts) and so its checkpoints and resumes are the same whichever path stepped it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from seq2seq.config import TrainConfig
from seq2seq.model.cpu_kernels import cpu_kernels


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """Adam or AdamW, fused: one kernel for all parameters, which can skip an update on a device flag."""
    optimizer_class = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return optimizer_class(
        model.parameters(), lr=0.0, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, fused=True
    )


def step_on_flag(optimizer: torch.optim.Optimizer, skipped: Tensor) -> None:
    """Apply the update unless the device flag `skipped` is set, without reading the flag on the host:
    a fused optimizer leaves parameters and state alone when its `found_inf` tensor is non-zero."""
    optimizer.found_inf = skipped.float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def adam_update_cpu(optimizer: torch.optim.Optimizer, pairs: list[tuple[Tensor, Tensor]], scale: Tensor,
                    skipped: Tensor) -> bool:  # fmt: skip
    """One step of `optimizer` on each (fp32 master, bf16 working weight) pair in `pairs`, from the working
    weight's gradient times `scale`, unless `skipped` is set, writing each moved master's bf16 rounding
    into its working weight; a master with no pair or whose working weight has no gradient is left
    alone, as PyTorch leaves a weight without a gradient. A weight's first update creates its state as
    PyTorch's Adam creates it (zero moments, a step count of 0 before it). True where done; False,
    with nothing changed, where it does not apply: without the fused CPU kernels, for an optimizer
    other than Adam(W) or with options the kernel lacks (amsgrad, maximize)."""
    kernels = cpu_kernels()
    if kernels is None or not isinstance(optimizer, torch.optim.Adam):
        return False
    working_of = {id(master): working for master, working in pairs}
    calls, new_states = [], {}
    for group in optimizer.param_groups:
        if group["amsgrad"] or group["maximize"] or group["differentiable"] or group["capturable"]:
            return False
        lists: tuple[list[Tensor], ...] = ([], [], [], [], [], [])
        for master in group["params"]:
            working = working_of.get(id(master))
            if working is None or working.grad is None:
                continue
            state = optimizer.state.get(master)
            if not state:  # its first update (a skipped one creates it too, as PyTorch's does)
                state = new_states[master] = _first_state(master)
            if not _kernel_state(state, master):
                return False
            for values, tensor in zip(lists, (master, state["exp_avg"], state["exp_avg_sq"], state["step"], working,
                                              working.grad.contiguous())):  # fmt: skip
                values.append(tensor.detach())
        calls.append((group, lists))
    optimizer.state.update(new_states)
    for group, lists in calls:
        if lists[0]:
            beta1, beta2 = group["betas"]
            kernels.adam_update_(*lists, scale, skipped, float(group["lr"]), beta1, beta2, group["eps"],
                                 group["weight_decay"], group["decoupled_weight_decay"])  # fmt: skip
    return True


def _first_state(master: Tensor) -> dict[str, Tensor]:
    """A weight's Adam state before its first update, as torch.optim.Adam(fused=True) creates it."""
    return {
        "step": torch.zeros((), dtype=torch.float32, device=master.device),
        "exp_avg": torch.zeros_like(master, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(master, memory_format=torch.preserve_format),
    }


def _kernel_state(state: dict, master: Tensor) -> bool:
    """Whether `master`'s Adam state is what the kernel updates: fp32 moments of its shape, contiguous,
    and a one-element fp32 step count, all on the CPU (as PyTorch's fused Adam keeps them there)."""
    moments = [state.get("exp_avg"), state.get("exp_avg_sq")]
    step = state.get("step")
    return (
        master.device.type == "cpu" and master.dtype == torch.float32 and master.is_contiguous()
        and all(isinstance(m, Tensor) and m.dtype == torch.float32 and m.shape == master.shape
                and m.is_contiguous() and m.device.type == "cpu" for m in moments)
        and isinstance(step, Tensor) and step.dtype == torch.float32 and step.numel() == 1
        and step.device.type == "cpu"
    )  # fmt: skip

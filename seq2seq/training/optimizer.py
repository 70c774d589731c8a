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

import weakref

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
    pairs = [(master, working) for master, working in pairs if working.grad is not None]
    plan = _plans.get(optimizer)
    if plan is None or not plan.serves(optimizer, pairs):
        plan = _AdamPlan.make(optimizer, pairs)
        if plan is None:
            return False
        _plans[optimizer] = plan
    for group, lists, workings in plan.calls:
        grads = [working.grad.contiguous() for working in workings]
        beta1, beta2 = group["betas"]
        kernels.adam_update_(*lists, grads, scale, skipped, float(group["lr"]), beta1, beta2, group["eps"],
                             group["weight_decay"], group["decoupled_weight_decay"])  # fmt: skip
    return True


class _AdamPlan:
    """What adam_update_ is handed for each of an optimizer's groups: its masters, their moments and
    step counts, and their working weights (detached), in the order of `pairs`. Made when an update
    first meets the optimizer and these pairs, and again when the optimizer's state or settings change
    (a checkpoint loaded into it, a weight's first update): checking every weight's state and
    building six lists of them each update was a large share of a small model's host time a step
    (profile_train.py's fixed host cost)."""

    def __init__(self, pairs: list[tuple[Tensor, Tensor]], checked: list[tuple[dict, dict, tuple]], calls: list):
        self.pairs = pairs
        self.checked = checked  # (group, its settings as checked, each weight's state and its tensors)
        self.calls = calls  # (group, (masters, exp_avgs, exp_avg_sqs, steps, workings) detached, workings)

    @staticmethod
    def make(optimizer: torch.optim.Adam, pairs: list[tuple[Tensor, Tensor]]) -> _AdamPlan | None:
        """The plan of `optimizer` over `pairs` (working weights with a gradient), creating the state
        of a weight's first update; None, with nothing changed, where the kernel does not apply."""
        working_of = {id(master): working for master, working in pairs}
        checked, calls, new_states = [], [], {}
        for group in optimizer.param_groups:
            if any(group[option] for option in _UNSUPPORTED):
                return None
            lists: tuple[list[Tensor], ...] = ([], [], [], [], [])
            states, workings = [], []
            for master in group["params"]:
                working = working_of.get(id(master))
                if working is None:
                    continue
                state = optimizer.state.get(master)
                if not state:  # its first update (a skipped one creates it too, as PyTorch's does)
                    state = new_states[master] = _first_state(master)
                if not _kernel_state(state, master):
                    return None
                tensors = (master, state["exp_avg"], state["exp_avg_sq"], state["step"], working)
                for values, tensor in zip(lists, tensors):
                    values.append(tensor.detach())
                states.append((master, state, tensors[1:4]))
                workings.append(working)
            checked.append((group, _settings(group), states))
            if lists[0]:
                calls.append((group, lists, workings))
        optimizer.state.update(new_states)
        return _AdamPlan(list(pairs), checked, calls)

    def serves(self, optimizer: torch.optim.Adam, pairs: list[tuple[Tensor, Tensor]]) -> bool:
        """Whether this plan is still the one `make` would give: the same pairs, groups, settings and
        state tensors."""
        if len(pairs) != len(self.pairs) or len(optimizer.param_groups) != len(self.checked):
            return False
        if any(a is not b or c is not d for (a, c), (b, d) in zip(pairs, self.pairs)):
            return False
        for group, (checked_group, settings, states) in zip(optimizer.param_groups, self.checked):
            if group is not checked_group or _settings(group) != settings:
                return False
            for master, state, tensors in states:
                now = optimizer.state.get(master)
                if now is not state or any(now[key] is not t for key, t in zip(_STATE_KEYS, tensors)):
                    return False
        return True


_UNSUPPORTED = ("amsgrad", "maximize", "differentiable", "capturable")
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "step")
_plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _AdamPlan] = weakref.WeakKeyDictionary()


def _settings(group: dict) -> tuple:
    """A group's parameters and options as a plan checks them (the learning rate is read each update)."""
    return (tuple(id(p) for p in group["params"]), *(group[option] for option in _UNSUPPORTED))


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

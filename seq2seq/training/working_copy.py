"""bf16 training with its casts paid once per update: a bf16 working copy of the model.

Under autocast, every weight is cast to bf16 at each use in the forward pass, its gradient cast
back in the backward pass, and every LayerNorm, residual sum and attention input crosses between
fp32 and bf16: hundreds of conversions a step (benchmarks/profile_train.py counts them), which cost
little where matrix products are slow and a large share of the step where they are nearly free (AMX,
GPUs).

Here the model that trains (the optimizer's, the checkpoint's, validation's) keeps its fp32
weights, the master copy. The forward and backward passes run on a bf16 copy of it. `update` ends an
update: its gradients are handed to the master in one pass (`hand_over`), clipped on the way, the
optimizer works in fp32 as before, and the copy is made again from the master (`refresh`); on a CPU
with the fused kernels the last three are one pass (training/optimizer.py). In between, activations
stay in bf16: the residual stream, attention's inputs, LayerNorm's inputs and outputs (PyTorch
computes LayerNorm's statistics in fp32 for bf16 input), the output layer's rows (the loss computes
its softmax in fp32, training/loss.py). The gradients of an update's accumulation steps add up in bf16,
as DDP averages them. The model's own code is unchanged; it runs in whatever dtype its weights have.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from seq2seq.model.cpu_kernels import cpu_kernels
from seq2seq.training.optimizer import adam_update_cpu, step_on_flag


class WorkingCopy:
    """`model`'s weights in `dtype` for the forward and backward passes; `model` keeps the fp32 master.

    Both sets of weights live in one flat buffer each (the parameters are views of it), and so do
    the gradients handed over, so that each cast is one conversion of every weight at once rather
    than one per tensor."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        self.model = copy.deepcopy(model).to(dtype)
        masters = list(dict(model.named_parameters()).values())  # a tied weight once, in the same order
        working = list(dict(self.model.named_parameters()).values())
        self._pairs = list(zip(masters, working))
        self._masters = _flatten(masters)
        self._weights = _flatten(working)
        # hand_over's flat buffers (the working gradients gathered, 2 bytes a weight, and the fp32 ones
        # handed to the masters, 4): made when it first runs, which `update` never calls on a CPU
        # with the fused kernels
        self._grads: torch.Tensor | None = None
        self._grad_views: list[torch.Tensor] = []
        self._master_grads: torch.Tensor | None = None
        self._master_grad_views: list[torch.Tensor] = []

    @torch.no_grad()
    def refresh(self) -> None:
        """Copy the master weights into the working copy: after each optimizer step, and after a
        checkpoint is loaded into the master."""
        self._weights.copy_(self._masters)

    @torch.no_grad()
    def update(self, optimizer: torch.optim.Optimizer, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `optimizer` (over the master weights) with the working copy's gradients, clipped as
        `hand_over` clips them, unless their norm is not finite; clear them and refresh the copy.
        Return their norm before clipping and whether the update was skipped, both on the device."""
        given = [(master, working) for master, working in self._pairs if working.grad is not None]
        kernels = self._kernels()
        if kernels is not None and given:
            norm = kernels.square_sum([working.grad.contiguous() for _, working in given]).sqrt().float()
            skipped = ~torch.isfinite(norm)
            if adam_update_cpu(optimizer, given, _clip_coefficient(norm, max_norm), skipped):
                for _, working in given:
                    working.grad = None
                return norm, skipped
        norm = self.hand_over(max_norm)
        skipped = ~torch.isfinite(norm)  # any inf/NaN gradient makes the norm non-finite
        step_on_flag(optimizer, skipped)
        self.refresh()
        return norm, skipped

    @torch.no_grad()
    def hand_over(self, max_norm: float) -> torch.Tensor:
        """Move the working copy's gradients to the master weights, cast to fp32 and clipped as
        torch.nn.utils.clip_grad_norm_(max_norm) clips them, and clear them; return their norm before
        clipping. One norm and one scaling of their flat buffer, where PyTorch's takes a norm and a
        scaling per weight. A weight that got no gradient this update (a layer LayerDrop skipped)
        gets none, and counts as zeros in the norm."""
        given = [index for index, (_, working) in enumerate(self._pairs) if working.grad is not None]
        if self._grads is None:
            self._grads = torch.zeros_like(self._weights)
            self._grad_views = _views(self._grads, [working for _, working in self._pairs])
            self._master_grads = torch.zeros_like(self._masters)
            self._master_grad_views = _views(self._master_grads, [master for master, _ in self._pairs])
        torch._foreach_copy_([self._grad_views[i] for i in given], [self._pairs[i][1].grad for i in given])
        missing = set(range(len(self._pairs))).difference(given)
        if missing:
            torch._foreach_zero_([self._grad_views[i] for i in missing])
        norm = self._clip_into_masters(max_norm)
        for index in given:
            self._pairs[index][0].grad = self._master_grad_views[index]
        for _, working in self._pairs:
            working.grad = None
        return norm

    def _clip_into_masters(self, max_norm: float) -> torch.Tensor:
        """The gathered gradients' norm; the master gradients set to them, cast and clipped. On a CPU
        with the fused kernels the norm is taken of the bf16 gradients (the values the fp32 ones
        hold) and the cast and the scaling are one pass; elsewhere the cast, a norm and a scaling."""
        kernels = self._kernels()
        if kernels is None:
            self._master_grads.copy_(self._grads)  # the one conversion
            norm = torch.linalg.vector_norm(self._master_grads)
            self._master_grads.mul_(_clip_coefficient(norm, max_norm))
            return norm
        norm = kernels.square_sum([self._grads]).sqrt().float()
        kernels.widen_scaled_(self._master_grads, self._grads, _clip_coefficient(norm, max_norm))
        return norm

    def _kernels(self):
        """The fused CPU kernels where they apply (a bf16 copy on a CPU), else None."""
        on_cpu = self._weights.device.type == "cpu" and self._weights.dtype == torch.bfloat16
        return cpu_kernels() if on_cpu else None


def _clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What clip_grad_norm_ scales gradients of norm `norm` by: at most 1."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _flatten(parameters: list[nn.Parameter]) -> torch.Tensor:
    """One buffer holding `parameters`' values, each parameter made a view of its part of it."""
    first = parameters[0]
    flat = torch.empty(sum(p.numel() for p in parameters), dtype=first.dtype, device=first.device)
    for parameter, view in zip(parameters, _views(flat, parameters)):
        view.copy_(parameter.detach())
        parameter.data = view
    return flat


def _views(flat: torch.Tensor, shaped_like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` cut into consecutive views shaped like `shaped_like`."""
    views, offset = [], 0
    for tensor in shaped_like:
        views.append(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
    return views


def working_copy_for(model: nn.Module, precision: str) -> WorkingCopy | None:
    """The working copy that training at `precision` runs on: one for bf16, none for fp32 (nothing
    to cast) or fp16 (autocast, whose loss scaler needs fp32 gradients to unscale)."""
    return WorkingCopy(model) if precision == "bf16" else None

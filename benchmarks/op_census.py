"""What a training step asks of the machine, counted op by op: a measure that does not depend on it.

Time says how fast a step is on one machine; on an AVX2-only CPU, where bf16 is emulated, time says
little about a bf16 step on hardware that runs it natively. The census runs one step under a
TorchDispatchMode, which sees every ATen op the forward and backward passes dispatch, and counts:
- dtype conversions (a copy whose output has another floating dtype than its input) and their bytes,
  the implicit ones too: an elementwise op given inputs of two floating dtypes (fp32 += bf16) casts
  the other one into a temporary inside the op, which no dispatched op shows. Not so our fused
  kernels (model/cpu_*.cpp, the seq2seq_cpu ops): each reads every input in its own dtype as it goes
  (fp32 row statistics beside bf16 rows, bf16 logits into fp32 losses), no temporary, no pass;
- matrix products (mm, addmm, bmm, baddbmm, oneDNN's linear layer, ...) and their FLOPs;
- the bytes every other op reads and writes (its tensor inputs and outputs; a factory such as
  zeros_like only its output, an allocation such as empty_like none): the memory traffic of what is
  not a matrix product, which is the step's work when matrix products are nearly free.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from seq2seq.model.cpu_linear import bf16_products_unwidened

MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "_addmm_activation"}  # out.addmm_: in place
# oneDNN's linear layer, and what stands for it where the CPU has no bf16 kernels (model/cpu_linear.py):
# x, weight (out, in), bias
LINEARS = {"_linear_pointwise", "emulated_linear_pointwise"}
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "_fused_sdp")
CONVERSIONS = {"_to_copy", "copy_", "to", "_autocast_to_reduced_precision", "_autocast_to_full_precision"}
VIEWS = {"view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
         "squeeze", "as_strided", "detach", "alias", "split", "split_with_sizes", "unbind", "narrow",
         "_reshape_alias"}  # fmt: skip
# Ops that make a tensor like their input without reading it: another dtype there is no conversion.
FACTORIES = {"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "new_empty",
             "new_zeros", "new_ones", "new_full", "new_empty_strided"}  # fmt: skip
# Ops that only reserve memory: the op that first writes it is the one that moves its bytes.
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


@dataclasses.dataclass
class Census:
    conversions: int = 0
    conversion_bytes: int = 0
    matmuls: int = 0
    matmul_flops: int = 0
    attention_calls: int = 0
    other_ops: int = 0
    other_bytes: int = 0
    by_op: Counter = dataclasses.field(default_factory=Counter)  # bytes moved by op name (not matmuls)
    conversions_by_op: Counter = dataclasses.field(default_factory=Counter)

    def per_step(self, steps: int) -> dict[str, float]:
        return {"dtype conversions": self.conversions / steps, "conversion MB": self.conversion_bytes / steps / 1e6,
                "matmuls": self.matmuls / steps, "matmul GFLOP": self.matmul_flops / steps / 1e9,
                "other ops": self.other_ops / steps, "other MB moved": self.other_bytes / steps / 1e6}  # fmt: skip


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _moved(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int:
    """The bytes an op that is not a product reads and writes: an allocation none, a factory its output."""
    if name in ALLOCATIONS:
        return 0
    return _bytes(outputs) + (0 if name in FACTORIES else _bytes(inputs))


class _Counting(TorchDispatchMode):
    def __init__(self, census: Census) -> None:
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        census = self.census
        if name in VIEWS:
            return out
        if name == "_foreach_copy_":  # one op, but a conversion of every pair whose dtype differs
            targets, sources = args[0], args[1]
            changed = [(t, s) for t, s in zip(targets, sources) if t.dtype != s.dtype]
            if changed:
                census.conversions += len(changed)
                census.conversion_bytes += sum(_bytes([t, s]) for t, s in changed)
                census.conversions_by_op[name] += len(changed)
                return out
        if name in CONVERSIONS and inputs and outputs:
            source = inputs[-1] if name == "copy_" else inputs[0]
            if source.dtype != outputs[0].dtype and source.is_floating_point() and outputs[0].is_floating_point():
                census.conversions += 1
                census.conversion_bytes += _bytes([source, outputs[0]])
                census.conversions_by_op[name] += 1
                return out
        if name in LINEARS:
            census.matmuls += 1
            census.matmul_flops += 2 * inputs[0].numel() * inputs[1].shape[0]
            return out
        if name in MATMULS:
            census.matmuls += 1
            a, b = _tensors(args)[-2:]  # the operands: not an out= tensor, which kwargs hold
            census.matmul_flops += 2 * a.numel() * b.shape[-1]
            return out
        if any(word in name for word in ATTENTION):
            census.attention_calls += 1
        elif outputs and name not in FACTORIES and func.namespace != "seq2seq_cpu":
            implicit = [t for t in inputs if t.is_floating_point() and t.dim() and t.dtype != outputs[0].dtype]
            if implicit:
                census.conversions += len(implicit)
                census.conversion_bytes += sum(t.numel() * outputs[0].element_size() + _bytes([t]) for t in implicit)
                census.conversions_by_op[f"{name} (implicit)"] += len(implicit)
        census.other_ops += 1
        moved = _moved(name, inputs, outputs)
        census.other_bytes += moved
        census.by_op[name] += moved
        return out


def take_census(step: Callable[[], None], steps: int = 1) -> Census:
    """Run `step` `steps` times under the counting mode and return what it dispatched: bf16 products
    as a CPU with bf16 kernels runs them, not widened to fp32 where it has none (model/cpu_linear.py)."""
    census = Census()
    with bf16_products_unwidened(), _Counting(census):
        for _ in range(steps):
            step()
    return census

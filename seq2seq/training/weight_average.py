"""An exponential moving average (EMA) of the model's weights, kept beside training.

Averaged weights generalise better than the last ones (Polyak averaging; Marian's
`--exponential-smoothing`, eole's `average_decay`): validation scores them next to the raw weights,
and best.pt holds whichever validated better. The average is kept in fp32, whatever the autocast
precision, and travels in every checkpoint so that a resumed run continues it exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn


class ExponentialAverage:
    """average <- d * average + (1 - d) * weights after every update, with d = min(decay,
    (1 + step) / (10 + step)): early on the average follows the weights closely, so that the random
    initial weights do not linger in it (the warm-up of TensorFlow's ExponentialMovingAverage)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.decay = decay
        self.names = [name for name, _ in model.named_parameters()]
        self.weights = [parameter for _, parameter in model.named_parameters()]
        self.average = [parameter.detach().float().clone() for parameter in self.weights]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the weights after update `step` (1 = the first)."""
        decay = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.average, [weight.float() for weight in self.weights], 1.0 - decay)

    def state_dict(self) -> dict[str, Tensor]:
        return dict(zip(self.names, self.average))

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Continue the average of a checkpoint; its names must be this model's."""
        if set(state) != set(self.names):
            raise ValueError("the checkpoint's weight average has other parameters than this model")
        for average, name in zip(self.average, self.names):
            average.copy_(state[name])

    def model_state(self, model: nn.Module) -> dict[str, Tensor]:
        """The model's state dict with the averaged weights in place of its own (tied names alike)."""
        with self.swapped_in():
            return {name: tensor.clone() for name, tensor in model.state_dict().items()}

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """The averaged weights in the model for the duration (validation), the trained ones after."""
        trained = [weight.detach().clone() for weight in self.weights]
        try:
            for weight, average in zip(self.weights, self.average):
                weight.copy_(average)
            yield
        finally:
            for weight, kept in zip(self.weights, trained):
                weight.copy_(kept)

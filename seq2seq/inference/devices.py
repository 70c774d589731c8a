"""What a `--device` (or `Translator.load(device=...)`) names, checked once for both engines.

`cpu`, `cuda` (the current GPU) or `cuda:N` (the GPU of index N, as torch and HF spell it): a
machine with several GPUs runs one model on each. PyTorch takes the name as it is; CTranslate2 takes
the kind and the index apart (`device="cuda", device_index=N`). A name that is not one of these, or
an index past the GPUs here, is refused in one line before a model loads. This module imports
neither torch nor ctranslate2 at its top: the command line checks the name before either loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from seq2seq.errors import UserInputError

DEVICE_NAME = re.compile(r"(?P<kind>cpu|cuda)(?::(?P<index>[0-9]+))?")
EXPECTED = "expected cpu, cuda or cuda:N (N: a GPU's index)"


@dataclass(frozen=True)
class Device:
    """A device by kind and, for a GPU, its index (None: the current GPU)."""

    kind: str
    index: int | None = None

    @classmethod
    def parse(cls, name: str) -> Device:
        match = DEVICE_NAME.fullmatch(name)
        if match is None or (match["kind"] == "cpu" and match["index"] is not None):
            raise UserInputError(f"device {name!r}: {EXPECTED}")
        index = match["index"]
        return cls(match["kind"], None if index is None else int(index))

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    def check_index(self, gpus: int, runtime: str) -> None:
        """Refuse an index past the `gpus` that `runtime` (torch, CTranslate2) sees."""
        if self.index is not None and self.index >= gpus:
            seen = f"cuda:0 to cuda:{gpus - 1}" if gpus > 1 else "cuda:0"
            raise UserInputError(f"device {self}: {runtime} sees {gpus} CUDA GPU(s) here ({seen})")


def torch_device(name: str | None) -> str:
    """Where a checkpoint runs: the device asked for, else the GPU where torch sees one."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = Device.parse(name)
    if device.kind == "cuda":
        if not torch.cuda.is_available():
            raise UserInputError(f"device {device}: torch sees no CUDA GPU here; expected cpu")
        device.check_index(torch.cuda.device_count(), "torch")
    return str(device)


def ctranslate2_placement(name: str | None, gpus: int) -> dict[str, object]:
    """ctranslate2.Translator's device arguments for a device name (None: the CPU). `gpus`: the
    GPUs CTranslate2 sees; with none, a GPU is left for CTranslate2 to refuse, which names its
    cause (no driver, no cuBLAS) better than a count of zero does."""
    device = Device.parse(name or "cpu")
    if device.kind == "cpu":
        return {"device": "cpu"}
    if gpus > 0:
        device.check_index(gpus, "CTranslate2")
    return {"device": "cuda", "device_index": device.index or 0}

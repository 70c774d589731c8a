"""Which GPU `--device cuda:N` names, for both engines, on a machine with several (torch's count
stood in for here: the machines that run the suite have one GPU or none)."""

from __future__ import annotations

import pytest
import torch

from seq2seq.errors import UserInputError
from seq2seq.inference.devices import ctranslate2_placement, torch_device


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_a_gpu_index_is_taken_as_given_up_to_the_gpus_torch_sees(two_gpus):
    assert [torch_device(name) for name in ("cuda", "cuda:0", "cuda:1", "cpu")] == ["cuda", "cuda:0", "cuda:1", "cpu"]
    with pytest.raises(UserInputError, match=r"device cuda:2: torch sees 2 CUDA GPU\(s\) here \(cuda:0 to cuda:1\)"):
        torch_device("cuda:2")


def test_ctranslate2_gets_the_kind_and_the_index_apart():
    assert ctranslate2_placement(None, gpus=2) == {"device": "cpu"}
    assert ctranslate2_placement("cuda", gpus=2) == {"device": "cuda", "device_index": 0}
    assert ctranslate2_placement("cuda:1", gpus=2) == {"device": "cuda", "device_index": 1}
    with pytest.raises(UserInputError, match=r"device cuda:1: CTranslate2 sees 1 CUDA GPU\(s\) here \(cuda:0\)"):
        ctranslate2_placement("cuda:1", gpus=1)


def test_a_name_that_is_no_device_is_refused_before_torch_is_asked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("asked torch about a bad name"))
    for name in ("gpu", "cuda:", "cuda:one", "cpu:1", "CUDA"):
        with pytest.raises(UserInputError, match="expected cpu, cuda or cuda:N"):
            torch_device(name)

"""The decoding features on a GPU decode as on the CPU: the same checkpoint, loaded on each, gives the
same outputs and scores for greedy and beam search, n-best lists, sampling from a seed, prefixes,
terminology constraints, ensembles and force-decoding. Both sides compute in fp32, so only the
matmuls' order of summation differs: outputs must agree on all but a rare near-tie, scores to 1e-3.
Skipped where no CUDA device is present (`pytest -m gpu` on a GPU machine)."""

from __future__ import annotations

import pytest
import torch

from seq2seq.inference.translator import Translator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LINES = 40
SCORE_TOLERANCE = 1e-3
AGREEMENT = 0.95  # of the n-best entries; a near-tie between two tokens may flip on another device


def nbest_lists(translator: Translator, lines: list[str], **options) -> list[list[tuple[str, float]]]:
    return [t.nbest for t in translator.translate_nbest(lines, **options)]


def assert_same_outputs(on_cpu, on_gpu) -> None:
    """The same texts in the same order (all but rare near-ties), and where the texts agree, scores to 1e-3."""
    pairs = [(a, b) for cpu_list, gpu_list in zip(on_cpu, on_gpu, strict=True) for a, b in zip(cpu_list, gpu_list)]
    assert len(pairs) == sum(map(len, on_cpu)) == sum(map(len, on_gpu))
    same = [(a, b) for a, b in pairs if a[0] == b[0]]
    assert len(same) >= AGREEMENT * len(pairs), [(a[0], b[0]) for a, b in pairs if a[0] != b[0]]
    for (_, cpu_score), (_, gpu_score) in same:
        assert gpu_score == pytest.approx(cpu_score, abs=SCORE_TOLERANCE)


@pytest.fixture(scope="module")
def sides(learned_checkpoint):
    path, data = learned_checkpoint
    lines = (data / "test.en").read_text(encoding="utf-8").splitlines()[:LINES]
    return Translator.load(path, device="cpu"), Translator.load(path, device="cuda"), lines


@pytest.mark.parametrize(
    "options",
    [{"beam": 1}, {"beam": 4}, {"beam": 5, "nbest": 3}, {"sample": True, "nbest": 3, "seed": 7, "top_k": 20}],
    ids=["greedy", "beam", "nbest", "sampling"],
)
def test_searches_and_samples_on_cuda_are_the_cpus(sides, options):
    cpu, gpu, lines = sides
    assert_same_outputs(nbest_lists(cpu, lines, **options), nbest_lists(gpu, lines, **options))


def test_prefixes_and_constraints_on_cuda_are_the_cpus(sides):
    cpu, gpu, lines = sides
    greedy = [t.text for t in cpu.translate_nbest(lines, beam=1)]
    prefixes = [" ".join(text.split()[:2]) for text in greedy]  # continue a post-editor's first words
    constraints = [[text.split()[-1]] if text.split() else [] for text in greedy[::-1]]  # another line's word
    checks = [
        ({"prefixes": prefixes}, lambda text, i: text.startswith(prefixes[i])),
        ({"constraints": constraints}, lambda text, i: all(phrase in text for phrase in constraints[i])),
    ]
    for guidance, holds in checks:
        on_cpu, on_gpu = nbest_lists(cpu, lines, beam=4, **guidance), nbest_lists(gpu, lines, beam=4, **guidance)
        assert_same_outputs(on_cpu, on_gpu)
        assert all(holds(nbest[0][0], i) for i, nbest in enumerate(on_gpu))  # the guidance held on the GPU


def test_an_ensemble_and_force_decoding_on_cuda_are_the_cpus(learned_checkpoint, trained_checkpoint, sides):
    _, _, lines = sides
    members = [learned_checkpoint[0], trained_checkpoint[0]]
    ensembles = [Translator.load(members, device=device) for device in ("cpu", "cuda")]
    assert_same_outputs(*(nbest_lists(ensemble, lines, beam=4) for ensemble in ensembles))
    cpu, gpu, _ = sides
    targets = [t.text for t in cpu.translate_nbest(lines, beam=1)]
    for on_cpu, on_gpu in zip(cpu.score(lines, targets), gpu.score(lines, targets), strict=True):
        assert on_gpu.pieces == on_cpu.pieces
        assert on_gpu.score == pytest.approx(on_cpu.score, abs=SCORE_TOLERANCE)

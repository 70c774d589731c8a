"""Search: sampling, greedy or beam search for a batch of source sentences, on any model that
honours the `Decoder` contract (search_steps.py), with per-sentence guidance (guidance.py).

greedy.py runs greedy search and sampling, beam.py beam search; every loop checks a deadline
before each decoder step, so a server request whose client has gone frees the worker.
"""

from __future__ import annotations

from torch import Tensor

from seq2seq.decoding import DecodeConfig
from seq2seq.inference.beam import beam_search
from seq2seq.inference.greedy import greedy_search, sample_search
from seq2seq.inference.guidance import Guidance
from seq2seq.inference.search_steps import Decoder, Hypothesis


def search(
    model: Decoder,
    src: Tensor,
    config: DecodeConfig,
    *,
    lines: list[int] | None = None,
    guidance: Guidance | None = None,
    deadline: float | None = None,
) -> list[list[Hypothesis]]:
    """Sampling when asked for (`lines`: sample_search's keys), else greedy when beam is 1 and no
    sentence has constraints, else beam search (constraints need its candidates, even at beam 1).
    Past `deadline` (a time.monotonic()), DeadlinePassed."""
    constrained = guidance is not None and any(map(any, guidance.constraints))
    if config.sample:
        if constrained:
            raise ValueError("terminology constraints cannot be sampled")
        return sample_search(model, src, config, lines=lines, guidance=guidance, deadline=deadline)
    if config.beam == 1 and not constrained:
        return greedy_search(model, src, config, guidance=guidance, deadline=deadline)
    return beam_search(model, src, config, guidance=guidance, deadline=deadline)

"""The `Batch` type and token-budgeted batches built from length-sorted sentences (fairseq style).

Sorting by length before cutting batches keeps padding low; shuffling the batch order per epoch
with a (seed, epoch) generator keeps training random yet exactly reproducible and resumable.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from seq2seq.data.encoded import EncodedCorpus, RaggedIds
from seq2seq.data.special_tokens import BOS_ID, EOS_ID, PAD_ID

# The output layer projects the real target positions of a batch, a count that differs in nearly
# every batch. On CPU, oneDNN compiles and caches a bf16 matmul kernel per shape (up to 1,024 of
# them): an ever-new count made a long bf16 run's memory grow at every step until that cache was
# full (docs/performance.md, memory in long runs). Rounded up to this multiple, the counts repeat (a
# few dozen per corpus), at a cost of at most 63 padding rows in the output layer.
POSITION_MULTIPLE = 64


@dataclass(frozen=True)
class Batch:
    """Padded source ids and the teacher-forcing pair: tgt_in = BOS + y, tgt_out = y + EOS.

    `target_positions` indexes the real (non-pad) positions of the flattened (B*T) target, padded
    with position 0 to a multiple of POSITION_MULTIPLE, and `targets` holds the ids of the real ones,
    so the output layer and the loss skip padding without a host sync.
    """

    src: Tensor  # (B, S)
    tgt_in: Tensor  # (B, T)
    tgt_out: Tensor  # (B, T)
    target_positions: Tensor  # (R,) flat indices of the real target positions, then padding; R >= N
    targets: Tensor  # (N,) their ids
    num_tokens: int  # N: real target tokens (EOS included); the loss is normalised by this

    def to(self, device: torch.device) -> Batch:
        """Copy to `device`; to a GPU from pinned memory, so the copy does not wait for the GPU to catch up."""
        tensors = (self.src, self.tgt_in, self.tgt_out, self.target_positions, self.targets)
        if device.type == "cuda":
            tensors = tuple(t.pin_memory() for t in tensors)
        return Batch(*(t.to(device, non_blocking=True) for t in tensors), self.num_tokens)


def pad(sequences: Sequence[np.ndarray | list[int]]) -> Tensor:
    """Right-pad id sequences with PAD into a (B, max_len) long tensor."""
    out = np.full((len(sequences), max(len(s) for s in sequences)), PAD_ID, dtype=np.int64)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = seq
    return torch.from_numpy(out)


def collate(src: Sequence[np.ndarray | list[int]], tgt: Sequence[np.ndarray | list[int]]) -> Batch:
    """The Batch of these source sentences (ending with EOS) and target sentences (without BOS/EOS)."""
    corpus = EncodedCorpus(RaggedIds.from_lists(src), RaggedIds.from_lists(tgt))
    return make_batch(corpus, np.arange(len(corpus)))


def token_batches(lengths: np.ndarray, *, max_tokens: int, order_noise: np.ndarray | None = None) -> list[np.ndarray]:
    """Cut length-sorted indices into batches whose padded size (count * longest) fits max_tokens.

    `order_noise` breaks ties between equal lengths randomly; a sentence longer than max_tokens
    gets a batch of its own.
    """
    keys = (np.zeros(len(lengths)) if order_noise is None else order_noise, lengths)
    order = np.lexsort(keys)
    batches, start, longest = [], 0, 0
    for position, index in enumerate(order):
        longest_with = max(longest, int(lengths[index]))
        if position > start and (position - start + 1) * longest_with > max_tokens:
            batches.append(order[start:position])
            start, longest_with = position, int(lengths[index])
        longest = longest_with
    if start < len(order):
        batches.append(order[start:])
    return batches


def pair_lengths(corpus: EncodedCorpus, rows: np.ndarray | None = None) -> np.ndarray:
    """Each pair's length as batches count it: its longer side, the target with its EOS."""
    return np.maximum(corpus.src.lengths(rows), corpus.tgt.lengths(rows) + 1)


def over_the_budget(corpus: EncodedCorpus, max_tokens: int) -> str | None:
    """What a run should be told when some pairs alone are longer than max_tokens (fairseq refuses
    them): each is a batch of its own, over the budget. None where every pair fits."""
    lengths = pair_lengths(corpus)
    over = int((lengths > max_tokens).sum())
    if not over:
        return None
    return (
        f"train.max_tokens ({max_tokens}) is below the length of {over:,} training pairs (the longest "
        f"{int(lengths.max())} tokens): each of them is a batch of its own, over train.max_tokens"
    )


def epoch_batches(
    corpus: EncodedCorpus, *, max_tokens: int, seed: int, epoch: int, rows: np.ndarray | None = None
) -> list[np.ndarray]:
    """The training batches of one epoch, in a shuffled order fixed by (seed, epoch): of every pair of
    `corpus`, or of the pairs `rows` lists (weighted_rows: some more than once, some not at all)."""
    rng = np.random.default_rng([seed, epoch])
    lengths = pair_lengths(corpus, rows)
    batches = token_batches(lengths, max_tokens=max_tokens, order_noise=rng.random(len(lengths)))
    if rows is not None:
        batches = [rows[batch] for batch in batches]
    return [batches[i] for i in rng.permutation(len(batches))]


# The draws of weighted_rows come from a generator of their own, so that epoch_batches' order noise
# and shuffle stay what they are without weights.
_WEIGHTING_STREAM = 1


def weighted_rows(sizes: Sequence[int], weights: Sequence[float], *, seed: int, epoch: int) -> np.ndarray | None:
    """The rows an epoch trains on, of a corpus made of consecutive parts of `sizes` pairs (the training
    corpora), part i shown `weights[i]` times: every pair once per whole time, then a random share of
    them for the fraction, another share each epoch, drawn under (seed, epoch) so that a resumed run
    draws what the uninterrupted one did. None where every weight is 1: each pair once, as without parts."""
    if all(weight == 1 for weight in weights):
        return None
    rng = np.random.default_rng([seed, epoch, _WEIGHTING_STREAM])
    chosen, start = [], 0
    for size, weight in zip(sizes, weights, strict=True):
        rows = np.arange(start, start + size, dtype=np.int64)
        whole, share = divmod(weight, 1.0)
        chosen += [rows] * int(whole)
        chosen.append(np.sort(rng.choice(rows, size=round(share * size), replace=False)))
        start += size
    return np.concatenate(chosen)


def make_batch(corpus: EncodedCorpus, indices: np.ndarray) -> Batch:
    """The Batch of the sentence pairs `indices` of `corpus`."""
    tgt_out = torch.from_numpy(corpus.tgt.padded(indices, last=EOS_ID))
    positions = (tgt_out.flatten() != PAD_ID).nonzero().squeeze(1)
    targets = tgt_out.flatten()[positions]
    padded = F.pad(positions, (0, -len(positions) % POSITION_MULTIPLE))  # pointing at position 0
    src = torch.from_numpy(corpus.src.padded(indices))
    tgt_in = torch.from_numpy(corpus.tgt.padded(indices, first=BOS_ID))
    return Batch(src, tgt_in, tgt_out, padded, targets, len(targets))


def padding_fraction(corpus: EncodedCorpus, batches: list[np.ndarray]) -> float:
    """Share of source and target positions in the batches that are padding (wasted work)."""
    src_lengths, tgt_lengths = corpus.src.lengths(), corpus.tgt.lengths() + 1  # +1: BOS/EOS shift
    real = sum(int(src_lengths[b].sum() + tgt_lengths[b].sum()) for b in batches)
    padded = sum(len(b) * int(src_lengths[b].max() + tgt_lengths[b].max()) for b in batches)
    return 1.0 - real / padded if padded else 0.0

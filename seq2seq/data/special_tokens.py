"""The special token ids every model and tokenizer share, and the padding mask built from them.

Kept apart from tokenizer.py so that the model, batching and search can use them without
importing sentencepiece.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# Never a target token, so never an output: both engines' searches ban them at every step (a young
# model may rank them first).
NEVER_EMITTED = (PAD_ID, BOS_ID)


def padding_mask(tokens: Tensor) -> Tensor:
    """(B, S) ids -> (B, 1, 1, S) bool, True where a real token may be attended to."""
    return (tokens != PAD_ID)[:, None, None, :]

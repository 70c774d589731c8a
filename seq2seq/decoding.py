"""The decode settings, each declared once: its name, type and default (the DecodeConfig field), and
in its `option(...)` its help, its range, the server's tighter maximum, whether a server request may
set it, and which engines honour it.

Every door derives from these declarations: config validation and `--set` (schema.py builds the
section), the Python API's keyword options, the server's request schema and checks
(deploy/requests.py), the engines' refusals (`refusals` below) and the configuration reference.
Adding an option is one field here, plus the search code that uses it. Torch-free: the CTranslate2
engine and the server import it without torch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

from seq2seq.schema import Bound, bound_problems, setting

ENGINES = frozenset({"pytorch", "ctranslate2"})
SEED_LIMIT = 2**32  # sampling seeds are 32-bit, as NumPy's and CTranslate2's generators take them


def option(
    default: Any,
    help: str,
    bound: Bound | None = None,
    *,
    served_max: float | None = None,
    served: bool = True,
    scoring: bool = False,
    engines: frozenset[str] = ENGINES,
    lacking: str = "",
    used: Callable[[DecodeConfig, Collection[str]], bool] | None = None,
) -> Any:
    """A DecodeConfig field and its declaration. `served_max`: the server's tighter maximum (a number
    that sets the amount of work); `served`: whether a request may set it; `scoring`: whether scoring
    given pairs (score-pairs, /score, Translator.score) uses it, and so may set it; `engines`: those
    that honour it, and for the others `lacking` (what they have no way to do) and `used` (when a
    call relies on the option: from its settings and the keys the caller set)."""
    return setting(default, help, bound, served_max=served_max, served=served, scoring=scoring, engines=engines,
                   lacking=lacking, used=used)  # fmt: skip


def _sampling_with_epsilon(decode: DecodeConfig, given: Collection[str]) -> bool:
    return decode.sample and decode.epsilon > 0


def _sampling_with_a_given_seed(decode: DecodeConfig, given: Collection[str]) -> bool:
    return decode.sample and "seed" in given


@dataclass(frozen=True)
class DecodeConfig:
    beam: int = option(5, "beam size; 1 = greedy search", Bound(1, 256), served_max=16)
    length_penalty: float = option(
        1.0, "alpha of length_norm power and gnmt (ignored by average and none)", Bound(0.0, 10.0), scoring=True
    )
    length_norm: Literal["power", "gnmt", "average", "none"] = option(
        "power",
        "how finished hypotheses are ranked: score / len^alpha (power, as fairseq, Marian, CTranslate2 and "
        "HF rank), score / ((5 + len) / 6)^alpha (gnmt), score / len (average) or the score (none); len counts the EOS",
        scoring=True,
    )
    max_len_a: float = option(
        1.2, "outputs stop at max_len_a x source length + max_len_b tokens", Bound(0.0, 10.0), served_max=4.0
    )
    max_len_b: int = option(10, "see max_len_a", Bound(0, 4096), served_max=256)
    min_len: int = option(
        1, "no EOS before this many tokens (at most the length limit of a one-piece source)", Bound(0)
    )
    nbest: int = option(1, "hypotheses returned per line (at most beam, unless sampling)", Bound(1, 256), served_max=16)
    patience: float = option(
        1.5,
        "a line's beam search ends when beam x patience hypotheses have finished "
        "(Kasai et al. 2022; fewer than beam could leave an n-best list short)",
        Bound(1.0, 8.0),
        served_max=4.0,
    )
    no_repeat_ngram: int = option(
        0, "forbid repeating any n-gram of this size within an output (0: off)", Bound(0, 32), served_max=8
    )
    batch_tokens: int = option(
        4096, "source tokens per translation batch", Bound(1, 1_000_000), served=False, scoring=True
    )
    sample: bool = option(False, "draw nbest outputs per line from the model instead of searching (beam unused)")
    temperature: float = option(
        1.0,
        "sampling: the logits are divided by it (far below 0.01 a sample is the greedy output)",
        Bound(0.001, 100.0),
    )
    top_k: int = option(0, "sampling: only the k most likely tokens (0: all)", Bound(0))
    top_p: float = option(
        1.0,
        "sampling: only the most likely tokens whose probabilities sum to top_p (nucleus)",
        Bound(0.0, 1.0, low_open=True),
    )
    epsilon: float = option(
        0.0,
        "sampling: only tokens of probability above epsilon (the most likely always)",
        Bound(0.0, 1.0, high_open=True),
        engines=frozenset({"pytorch"}),
        lacking="epsilon sampling",
        used=_sampling_with_epsilon,
    )
    seed: int = option(
        1,
        "sampling: a line at the same index draws the same samples for the same seed and "
        "settings, whatever is translated with it",
        Bound(0, SEED_LIMIT, high_open=True),
        engines=frozenset({"pytorch"}),
        used=_sampling_with_a_given_seed,
        lacking="samples that repeat from a seed (its generators belong to its threads)",
    )

    def normalized_score(self, log_prob: float, length: int) -> float:
        """How finished hypotheses are ranked: `log_prob` of `length` output tokens (EOS included)."""
        if self.length_norm == "power":
            return log_prob / length**self.length_penalty
        if self.length_norm == "average":
            return log_prob / length
        if self.length_norm == "gnmt":
            return log_prob / ((5 + length) / 6) ** self.length_penalty
        return log_prob

    @property
    def finished_per_sentence(self) -> int:
        """How many finished hypotheses end a sentence's beam search: beam x patience, rounded half
        away from zero as CTranslate2 rounds it (Kasai et al. 2022, "A Call for Clarity in Beam Search")."""
        return max(1, math.floor(self.beam * self.patience + 0.5))

    def problems(self) -> list[tuple[str, str]]:
        """Each declared range, then the rules between fields (the ranges are checked here too, for a
        DecodeConfig built outside a config file)."""
        found = bound_problems(self)
        if found:
            return found
        if self.nbest > self.beam and not self.sample:  # samples are drawn, not kept from a beam
            found.append(("nbest", f"expected at most beam ({self.beam}), got {self.nbest}"))
        if self.min_len > self.shortest_limit:  # an EOS could never be allowed in time
            found.append(
                (
                    "min_len",
                    f"expected at most the length limit of a one-token input, max_len_a x 2 + "
                    f"max_len_b = {self.shortest_limit}, got {self.min_len}",
                )
            )
        return found

    @property
    def shortest_limit(self) -> int:
        """The output length limit of the shortest input (one piece and its EOS), as search computes it."""
        return self.output_limit(2)

    def output_limit(self, source_length: int, *, prefix: int = 0, constraint_tokens: int = 0) -> int:
        """The most tokens a search may produce for a source of `source_length` pieces (its EOS
        included): a * length + b, at least 1; with a forced target prefix of `prefix` tokens, at
        least the prefix and one token more; plus the tokens of its constraints. Both engines and the
        server's work budget apply it (search.max_output_lengths is its batched form)."""
        limit = max(1, math.floor(self.max_len_a * source_length + self.max_len_b))
        return guidance_limit(limit, prefix) + constraint_tokens


def guidance_limit(limit: int, prefix_length: int) -> int:
    """A sentence's output length limit with a forced target prefix of `prefix_length` tokens: at
    least the prefix and one token more (both engines apply it)."""
    return max(limit, prefix_length + 1) if prefix_length else limit


@dataclass(frozen=True)
class Declared:
    """One decode option as declared: its field, and what `option` said of it."""

    name: str
    kind: type  # int, float, bool or str (a choice among `choices`)
    choices: tuple[str, ...]
    default: Any
    help: str
    bound: Bound | None
    served_max: float | None
    served: bool
    scoring: bool
    engines: frozenset[str]
    lacking: str
    used: Callable[[DecodeConfig, Collection[str]], bool] | None


@functools.cache
def declarations() -> tuple[Declared, ...]:
    """Every decode option, in declaration order."""
    hints, found = typing.get_type_hints(DecodeConfig), []
    for item in dataclasses.fields(DecodeConfig):
        hint = hints[item.name]
        choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
        found.append(Declared(item.name, str if choices else hint, choices, item.default, **item.metadata))
    return tuple(found)


def refusals(decode: DecodeConfig, engine: str, *, given: Collection[str] = ()) -> list[tuple[Declared, str]]:
    """The options these settings rely on that `engine` does not honour, each with what it lacks."""
    return [
        (item, item.lacking)
        for item in declarations()
        if engine not in item.engines and item.used is not None and item.used(decode, given)
    ]


def unused_by_scoring(given: Collection[str]) -> list[str]:
    """The decode options among `given` that scoring given pairs never reads (a beam, a temperature):
    setting one there would change nothing, so the doors that score refuse it rather than ignore it."""
    return [item.name for item in declarations() if item.name in given and not item.scoring]


def scoring_options() -> list[str]:
    """The decode options scoring reads: how scores are normalised, and how pairs are batched."""
    return [item.name for item in declarations() if item.scoring]

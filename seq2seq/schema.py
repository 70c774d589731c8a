"""Building frozen dataclasses from parsed YAML, collecting every problem as (dotted key, message).

Understands the types our config sections use: nested dataclasses, Optional, Literal choices,
fixed and variadic tuples, bool, int, float and str. Unknown keys come with the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Bound:
    """The range a number must lie in, declared once: config validation checks it and the server's
    request schema publishes it (`low_open` / `high_open`: the end itself is excluded)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def problem(self, value: float, *, integer: bool) -> str:
        """ "" when `value` lies in range, else what was expected."""
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if not (below or above):
            return ""
        kind = "an integer" if integer else "a number"
        if self.high is None:
            return f"expected {kind} {'>' if self.low_open else '>='} {_number(self.low)}, got {value}"
        if self.low is None:
            return f"expected {kind} {'<' if self.high_open else '<='} {_number(self.high)}, got {value}"
        interval = (
            f"{'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}{')' if self.high_open else ']'}"
        )
        return f"expected {kind} in {interval}, got {value}"

    def json_schema(self) -> dict[str, float]:
        """The bound as JSON Schema keywords."""
        found = {}
        if self.low is not None:
            found["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            found["exclusiveMaximum" if self.high_open else "maximum"] = self.high
        return found


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def setting(default: Any = dataclasses.MISSING, help: str = "", bound: Bound | None = None, *,
            factory: Any = dataclasses.MISSING, **declared: Any) -> Any:  # fmt: skip
    """A config field declared once: its default, one line of help for the reference, its range
    (checked for every door) and whatever else a section declares of it (`declared`)."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": help, "bound": bound,
                                                                                **declared})  # fmt: skip


def bound_problems(obj: Any) -> list[tuple[str, str]]:
    """The fields of `obj` outside their declared range."""
    hints, found = typing.get_type_hints(type(obj)), []
    for item in dataclasses.fields(obj):
        bound = item.metadata.get("bound")
        if bound is not None and (problem := bound.problem(getattr(obj, item.name), integer=hints[item.name] is int)):
            found.append((item.name, problem))
    return found


def section_problems(obj: Any) -> list[tuple[str, str]]:
    """One section's problems: its fields outside their ranges, else its own rules between fields."""
    return bound_problems(obj) or (obj.problems() if hasattr(obj, "problems") else [])


def collect_problems(obj: Any, prefix: str, errors: list[tuple[str, str]]) -> None:
    """Value checks: every field's declared range, then (once those hold) the section's own rules
    (`problems()`: between fields); keys relative to the section unless already dotted."""
    for key, message in section_problems(obj):
        errors.append((key if "." in key else prefix + key, message))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            collect_problems(value, f"{prefix}{f.name}.", errors)
        elif isinstance(value, tuple):
            for index, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    collect_problems(item, f"{prefix}{f.name}[{index}].", errors)


def build_dataclass(cls: type, raw: Any, prefix: str, errors: list[tuple[str, str]]) -> Any:
    """Build dataclass `cls` from `raw`, appending (dotted key, message) for each problem."""
    section = prefix.rstrip(".") or "config"
    if not isinstance(raw, dict):
        errors.append((section, f"expected a mapping, got {_describe(raw)}"))
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {', '.join(fields)}"
            errors.append((f"{prefix}{key}", f"unknown key{hint}"))
    values = {}
    for name, f in fields.items():
        if name in raw:
            values[name] = _convert(hints[name], raw[name], f"{prefix}{name}", errors)
            if f.metadata.get("path"):
                values[name] = _home_expanded(values[name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.append((f"{prefix}{name}", "required key is missing"))
    try:
        return cls(**values)
    except TypeError:  # a required key was missing; already reported
        return None


def _home_expanded(value: Any) -> Any:
    """A path setting (declared `path=True`) with a leading ~ or ~user made the home folder, as a shell
    would: `--set data.train.src=~/corpus/train.en` reaches us unexpanded (the ~ is not at the start
    of the shell's word), and so does every path in a YAML file."""
    if isinstance(value, str):
        return os.path.expanduser(value)
    if isinstance(value, tuple):
        return tuple(_home_expanded(item) for item in value)
    return value


_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def _convert(hint: Any, value: Any, key: str, errors: list[tuple[str, str]]) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [arg for arg in args if arg is not type(None)]
        return _convert(inner, value, key, errors)
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, key + ".", errors)
    if origin is Literal:
        if value in args:
            return value
        errors.append((key, f"expected one of {', '.join(map(str, args))}; got {_describe(value)}"))
    elif origin is tuple:
        variadic = len(args) == 2 and args[1] is Ellipsis
        if isinstance(value, list) and (variadic or len(value) == len(args)):
            kinds = [args[0]] * len(value) if variadic else list(args)
            # a list of sections names each by its index: data.extra_train[1].src
            keys = [f"{key}[{index}]" if dataclasses.is_dataclass(kind) else key for index, kind in enumerate(kinds)]
            return tuple(_convert(kind, item, where, errors) for kind, item, where in zip(kinds, value, keys))
        size = "a list" if variadic else f"a list of {len(args)} items"
        errors.append((key, f"expected {size}, got {_describe(value)}"))
    elif hint is bool:
        if isinstance(value, bool):
            return value
        errors.append((key, f"expected true or false, got {_describe(value)}"))
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        errors.append((key, f"expected an integer, got {_describe(value)}"))
    elif hint is float:
        number = None
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            or isinstance(value, str)
            and _FLOAT.match(value)
        ):
            number = float(value)
        if number is not None and math.isfinite(number):  # .nan and .inf would pass every range check
            return number
        errors.append((key, f"expected a finite number, got {_describe(value)}"))
    elif hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        unquoted = " (YAML reads an unquoted yes, no, on, off, true or false as a boolean: quote the value, 'no')"
        errors.append((key, f"expected a string, got {_describe(value)}{unquoted if isinstance(value, bool) else ''}"))
    else:  # pragma: no cover - a programming error in the schema, not user input
        raise TypeError(f"unsupported config type {hint} for {key}")
    return None


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{value!r}"

"""The checks of option values, written once: numbers finite and in range, booleans that are booleans, choices.

Note [Checking options by their types]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A check written as ``if x < 0: raise`` lets NaN through (every comparison with NaN is False), and
a string given for a bool (``tie_embeddings="no"``) is truthy. So the options of every public
config type (the strategy's :class:`~lightning_seqpar.parallel.config.StrategyConfig`, ``CausalLMModule``,
the model configs, the datamodules) are checked from their TYPE ANNOTATIONS by one function,
:func:`check_options`, called once per config type (in ``__post_init__`` or ``__init__``, before
anything else runs):

* ``bool``: ``True`` or ``False`` only (not ``"no"``, not 1);
* ``int``: an int, not a bool and not a float (``2.5`` is refused, not truncated);
* ``float``: an int or a float, not a bool, and FINITE (NaN, inf and -inf are refused);
* ``Literal[...]``: one of the values (compared with their types: ``True`` is not ``1``);
* ``str`` (a ``pathlib.Path`` too), ``dict``, ``list``, ``tuple[...]`` (each entry checked), a class: an instance of it;
* ``X | Y | None``: any one of them.

Then the option's range, from the type's table (``option_ranges``: :class:`Range` by option
name; numbers only, the other values of a union pass). The error is a ``ValueError`` that names
the owner, the option, what was expected and what was given. Because the checks are derived from
the annotations, an option added later is checked (and fuzzed: tests/test_fuzz_options.py reads
the same annotations and tables) without anyone remembering to; a numeric option without a range
in its type's table fails that test.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union

__all__ = ["ANY", "AT_LEAST_ONE", "FRACTION", "NON_NEGATIVE", "POSITIVE", "Range", "check_options", "check_ranges",
           "option_hints", "option_values"]


@dataclass(frozen=True)
class Range:
    """The allowed numbers of an option: ``low`` <= x <= ``high`` (strict where ``low_open`` / ``high_open``); None: no bound."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return not (self.high is not None and (value >= self.high if self.high_open else value > self.high))

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_number(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_number(self.high)}")
        return " and ".join(parts) if parts else "any finite number"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


ANY = Range()
"""Any finite number (seeds, offsets): documented as such in the type's table."""
POSITIVE = Range(low=0, low_open=True)
NON_NEGATIVE = Range(low=0)
AT_LEAST_ONE = Range(low=1)
FRACTION = Range(low=0, high=1)


@functools.lru_cache(maxsize=None)
def option_hints(target: type | Callable[..., Any]) -> dict[str, Any]:
    """The resolved annotations of a dataclass's fields, or of the arguments of a class's ``__init__`` or a function."""
    if isinstance(target, type) and hasattr(target, "__dataclass_fields__"):
        from dataclasses import fields

        hints = typing.get_type_hints(target)
        return {f.name: hints[f.name] for f in fields(target)}
    hints = typing.get_type_hints(target.__init__ if isinstance(target, type) else target)
    hints.pop("return", None)
    return hints


def option_values(config: Any) -> dict[str, Any]:
    """``{field: value}`` of a dataclass instance (not copied, unlike ``dataclasses.asdict``)."""
    from dataclasses import fields

    return {f.name: getattr(config, f.name) for f in fields(config)}


def _members(hint: Any) -> tuple[Any, ...]:
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        out: tuple[Any, ...] = ()
        for arg in typing.get_args(hint):
            out += _members(arg)
        return out
    return (hint,)


def _matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotation member ``hint`` (Note [Checking options by their types]); numbers are
    checked finite by :func:`check_options` afterwards."""
    if hint is Any or hint is object:
        return True
    if hint is None or hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:  # numpy's integers too
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, (str, os.PathLike))  # a path given as a pathlib.Path
    origin = typing.get_origin(hint)
    if origin is Literal:
        return any(type(value) is type(choice) and value == choice for choice in typing.get_args(hint))
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        args = typing.get_args(hint)
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
        inner = args[0] if args else Any
        return all(_matches(v, inner) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, Mapping)
    if origin is not None:
        return isinstance(value, origin) if isinstance(origin, type) else True
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a forward reference or a construct not modelled here: its own check decides


def _describe(hint: Any) -> str:
    if hint is None or hint is type(None):
        return "None"
    if hint is bool:
        return "True or False"
    if hint is int:
        return "an int"
    if hint is float:
        return "a finite number"
    origin = typing.get_origin(hint)
    if origin is Literal:
        return " or ".join(repr(c) for c in typing.get_args(hint))
    if origin is tuple:
        args = typing.get_args(hint)
        return f"a tuple ({', '.join(_describe(a) for a in args)})" if args else "a tuple"
    if origin is list:
        return "a list"
    if origin is dict or hint is dict:
        return "a dict"
    return f"a {getattr(hint, '__name__', str(hint))}"


def _non_finite(value: Any) -> bool:
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return not math.isfinite(value)
    if isinstance(value, (tuple, list)):
        return any(_non_finite(v) for v in value)
    return False


def check_options(values: Mapping[str, Any], hints: Mapping[str, Any], *, owner: str,
                  ranges: Mapping[str, Range] | None = None) -> None:
    """Check every option of ``values`` that ``hints`` annotates (Note [Checking options by their types]): its type,
    finite numbers, and the range in ``ranges``. Raises a ``ValueError`` naming ``owner`` and the option."""
    ranges = ranges or {}
    for name, value in values.items():
        hint = hints.get(name)
        if hint is None:
            continue
        members = _members(hint)
        if not any(_matches(value, m) for m in members):
            if all(typing.get_origin(m) is Literal or m is type(None) for m in members):
                choices = tuple(c for m in members for c in (typing.get_args(m) if m is not type(None) else (None,)))
                raise ValueError(f"{owner}: {name}={value!r} is not supported; expected one of {choices}")
            words = list(dict.fromkeys(w for m in members for w in (("True", "False") if m is bool else (_describe(m),))))
            expected = words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
            raise ValueError(f"{owner}: {name} must be {expected}, got {value!r} ({type(value).__name__})")
        if _non_finite(value):
            raise ValueError(f"{owner}: {name} must be finite, got {value!r}")
    check_ranges(values, ranges, owner=owner)


def check_ranges(values: Mapping[str, Any], ranges: Mapping[str, Range] | None, *, owner: str) -> None:
    """The numbers of ``values`` (an entry of a list or tuple included; bools and other values pass) inside their
    option's :class:`Range` (the second half of :func:`check_options`, for types that check their types first and
    their ranges after their own messages)."""
    for name, within in (ranges or {}).items():
        if name not in values:
            continue
        value = values[name]
        entries = value if isinstance(value, (tuple, list)) else (value,)
        for entry in entries:
            if isinstance(entry, numbers.Real) and not isinstance(entry, bool) and (not math.isfinite(entry) or entry not in within):
                raise ValueError(f"{owner}: {name} must be {within.describe()}, got {value!r}")

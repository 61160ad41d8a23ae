"""Every option of the public surface, fed bad values: a ValueError that names the option, never a run that trains
on NaN, a string taken as a bool or a number out of its range (Note [Checking options by their types] in
``lightning_seqpar.checks``).

The surface is FOUND, not listed: every public class defined in a module of ``lightning_seqpar`` that is a config
dataclass (``...Config``), a LightningModule or a LightningDataModule. Its options and their types come from its annotations, its ranges from its ``option_ranges``
table; a class found without a table, or a numeric option without a range, fails here. So an option added later is
fuzzed without anyone remembering to. Only objects are constructed: no training, no process, no file read.

The values tried for each option come from its annotation: NaN, inf and -inf; 0, -1, -0.5, 1.5 and 1e30; strings
("no", "1") and ``None``; a list and an ``object()``; for a tuple of numbers, a NaN entry, an out-of-range entry and
the wrong length. A value that the annotation and the range allow is not asserted on (other checks may still refuse
it: e.g. ``attention_backend="no"``); every other value must raise a ValueError (or TypeError) naming the option.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
import os
import pkgutil
import types
import typing
from typing import Any, Literal, Union

import lightning as L
import pytest

import lightning_seqpar
from lightning_seqpar.checks import Range, option_hints

REQUIRED: dict[str, dict[str, Any]] = {
    "CausalLMModule": {"model": "tiny"},
    "TokenFileDataModule": {"train_path": "tokens.bin", "seq_len": 8, "batch_size": 2},
    "HFTextDataModule": {"train_files": "docs.jsonl", "tokenizer_path": "tokenizer", "seq_len": 8, "batch_size": 2},
    "ChatDataModule": {"train_files": "chats.jsonl", "tokenizer_path": "tokenizer", "seq_len": 8, "batch_size": 2},
    "CharDataModule": {"path": "enwik8", "seq_len": 8, "batch_size": 2},
    "LongRangeDataModule": {"vocab_size": 16, "seq_len": 8, "batch_size": 2},
}
"""The arguments a surface needs to be built at all (valid values: each option is then replaced by a bad one)."""

OWN_RULES: dict[str, set[str]] = {
    "CausalLMModule": {"model", "lora", "config_overrides"},  # a config / name / folder, peft's and transformers' fields
}
"""Options checked by rules of their own, not by their annotation (tests/test_refused_inputs.py, test_context_extension.py)."""


def _surfaces() -> list[type]:
    """Every public config dataclass (``...Config``), LightningModule and LightningDataModule defined in a module of the
    package (all of them are imported: a module added later is searched too)."""
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(lightning_seqpar.__path__, "lightning_seqpar."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency that is not installed (its options are fuzzed where it is)
            continue
        for name, obj in vars(module).items():
            if name.startswith("_") or not isinstance(obj, type) or obj.__module__ != module.__name__:
                continue
            is_config = dataclasses.is_dataclass(obj) and name.endswith("Config")
            if is_config or issubclass(obj, (L.LightningModule, L.LightningDataModule)):
                found[name] = obj
    return sorted(found.values(), key=lambda c: c.__name__)


SURFACES = _surfaces()


def _options(cls: type) -> dict[str, Any]:
    hints = option_hints(cls)
    return {k: v for k, v in hints.items() if k not in OWN_RULES.get(cls.__name__, set())}


def _members(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) in (Union, types.UnionType):
        return tuple(m for a in typing.get_args(hint) for m in _members(a))
    return (hint,)


def _allowed(value: Any, hint: Any, within: Range | None) -> bool:
    """An oracle written apart from the package's checks: does the annotation (and the range) allow ``value``?"""
    for member in _members(hint):
        if member is Any:
            return True
        if member is type(None):
            if value is None:
                return True
            continue
        origin = typing.get_origin(member)
        if origin is Literal:
            if any(type(value) is type(c) and value == c for c in typing.get_args(member)):
                return True
            continue
        if member is bool:
            if isinstance(value, bool):
                return True
            continue
        if member in (int, float):
            ok = not isinstance(value, bool) and (isinstance(value, int) or (member is float and isinstance(value, float)))
            if ok and math.isfinite(value) and (within is None or _in(value, within)):
                return True
            continue
        if member is str:
            if isinstance(value, (str, os.PathLike)):
                return True
            continue
        if origin is tuple:
            args = typing.get_args(member)
            if isinstance(value, (tuple, list)) and len(value) == len(args) and all(_allowed(v, a, within) for v, a in zip(value, args)):
                return True
            continue
        if origin is list or member is list:
            if isinstance(value, list) and all(_allowed(v, (typing.get_args(member) or (Any,))[0], within) for v in value):
                return True
            continue
        if origin is dict or member is dict:
            if isinstance(value, dict):
                return True
            continue
        if isinstance(member, type) and isinstance(value, member):
            return True
    return False


def _in(value: float, within: Range) -> bool:
    if within.low is not None and (value <= within.low if within.low_open else value < within.low):
        return False
    return not (within.high is not None and (value >= within.high if within.high_open else value > within.high))


BAD_SCALARS: tuple[Any, ...] = (math.nan, math.inf, -math.inf, 0, -1, -0.5, 1.5, 10**30, "no", "1", None, [], object())


def _values(hint: Any) -> list[Any]:
    values = list(BAD_SCALARS)
    for member in _members(hint):
        if typing.get_origin(member) is tuple:
            n = len(typing.get_args(member))
            values += [(0.5,) * (n - 1) + (math.nan,), (0.5,) * (n - 1) + (1.0,), (0.5,) * (n - 1) + (-0.1,), (0.5,) * (n + 1)]
    return values


def _numeric(hint: Any) -> bool:
    def numeric(m: Any) -> bool:
        return m in (int, float) or (typing.get_origin(m) is tuple and any(numeric(a) for a in typing.get_args(m)))

    return any(numeric(m) for m in _members(hint))


def test_the_surface_is_found():
    names = {cls.__name__ for cls in SURFACES}
    assert {"StrategyConfig", "CausalLMModule", "LlamaConfig", "GPTConfig", "TransNormerConfig", "TokenFileDataModule",
            "HFTextDataModule", "ChatDataModule", "CharDataModule", "LongRangeDataModule"} <= names, names


@pytest.mark.parametrize("cls", SURFACES, ids=lambda c: c.__name__)
def test_every_numeric_option_has_a_documented_range(cls):
    ranges = getattr(cls, "option_ranges", None)
    assert isinstance(ranges, dict), f"{cls.__name__} has no option_ranges table (Note [Checking options by their types])"
    missing = [k for k, hint in _options(cls).items() if _numeric(hint) and k not in ranges]
    assert not missing, f"{cls.__name__}: numeric options without a range in option_ranges: {missing}"
    assert set(ranges) <= set(option_hints(cls)), f"{cls.__name__}: option_ranges names no option {set(ranges) - set(option_hints(cls))}"


def _cases() -> list[tuple[type, str, Any]]:
    cases = []
    for cls in SURFACES:
        ranges = getattr(cls, "option_ranges", {}) or {}
        for name, hint in _options(cls).items():
            for value in _values(hint):
                if not _allowed(value, hint, ranges.get(name)):
                    cases.append((cls, name, value))
    return cases


CASES = _cases()


def test_the_fuzz_covers_every_option():
    """How many (option, value) pairs are tried: recorded in docs/reliability.md."""
    options = {(cls.__name__, name) for cls, name, _ in CASES}
    every = {(cls.__name__, name) for cls in SURFACES for name in _options(cls)}
    assert options == every, every - options
    assert len(CASES) >= 900, len(CASES)


@pytest.mark.parametrize("cls", SURFACES, ids=lambda c: c.__name__)
def test_bad_values_are_refused_naming_the_option(cls):
    base = REQUIRED.get(cls.__name__, {})
    required = [p.name for p in inspect.signature(cls).parameters.values()
                if p.default is inspect.Parameter.empty and p.kind is p.KEYWORD_ONLY or
                (p.default is inspect.Parameter.empty and p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self")]
    assert set(required) <= set(base), f"add {cls.__name__}'s required arguments {required} to REQUIRED"
    failures = []
    for case_cls, name, value in CASES:
        if case_cls is not cls:
            continue
        try:
            cls(**{**base, name: value})
        except (ValueError, TypeError) as error:
            if name not in str(error):
                failures.append(f"{name}={value!r}: {type(error).__name__} without the option's name: {error}")
            continue
        except Exception as error:  # noqa: BLE001 - any other exception is a failure of the check
            failures.append(f"{name}={value!r}: {type(error).__name__}: {error}")
            continue
        failures.append(f"{name}={value!r} was accepted")
    assert not failures, f"{cls.__name__}:\n" + "\n".join(failures)


def test_the_strategy_refuses_through_its_config():
    from lightning_seqpar import SequenceParallelStrategy

    for name, value in (("save_distributed_checkpoint", "no"), ("timeout", math.nan), ("pad_to_multiple", "yes")):
        with pytest.raises(ValueError, match=f"SequenceParallelStrategy: {name}"):
            SequenceParallelStrategy(**{name: value})

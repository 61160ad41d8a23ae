"""The transformers config of a model: reading it, overriding fields before the model is built, extending its RoPE.

Public names: :class:`HFConfigSpec`, :func:`is_hf_source`, :func:`load_hf_config` (a config from a local folder,
a ``PretrainedConfig``, a ``PreTrainedModel`` or a dict with ``"model_type"``), :func:`apply_config_overrides`
(Note [Config overrides]) and :func:`rope_extension` (Note [Extending the context through RoPE]).

Note [Config overrides]
~~~~~~~~~~~~~~~~~~~~~~~
``CausalLMModule(model=..., config_overrides={...})`` changes fields of the transformers config
BEFORE the model is built (``from_pretrained(folder, config=...)`` or ``from_config``), e.g. the
RoPE of a context extension::

    {"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192},
     "max_position_embeddings": 65536}

:func:`apply_config_overrides` works on a deep copy of the config:

1. every key must be a field of the config (``config.to_dict()``, or one of its ``attribute_map``
   aliases); ``model_type`` cannot change; the deprecated ``rope_scaling`` is refused for
   ``rope_parameters``;
2. a dict given for a dict-valued field is MERGED into it (recursively; a sub-config such as
   ``text_config`` is overridden the same way), so that a RoPE override keeps the config's
   ``rope_theta``. One exception: a ``rope_parameters`` dict whose ``rope_type`` changes keeps only
   the type-independent fields of the old one (``rope_theta``, ``partial_rotary_factor``) — Llama
   3.1's ``low_freq_factor`` means nothing to YaRN;
3. each value is set with ``setattr``, which transformers 5's strict configs check against the
   field's type;
4. the RoPE parameters are standardised and validated by transformers itself
   (``standardize_rope_params``, ``validate_rope``). transformers only LOGS most problems
   (a factor < 1, an unknown key, an unknown ``rope_type``, a LongRoPE factor list of the wrong
   length); the records of its ``modeling_rope_utils`` logger during the call are collected and
   any that the unchanged config does not also produce is an error. Two advisory messages stay
   warnings (YaRN's ``factor`` differing from ``max_position_embeddings / original``, which
   transformers resolves by using ``factor``; LongRoPE's advice to set ``factor``). Then the
   frequencies are computed once (``ROPE_INIT_FUNCTIONS[rope_type](config)``, a few numbers), as
   building the model would;
5. ``config.validate()`` runs the config class's own checks (architecture, layer types).

Every failure is a ``ValueError`` naming ``config_overrides[<key>]`` and what was expected; it is
raised in ``CausalLMModule.__init__``, before any process group exists. A ``PreTrainedModel``
given as the model is already built from its config: overrides are refused for it (build it from
its folder or config instead).
"""

from __future__ import annotations

import copy
import difflib
import logging
import math
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["EXTENSIBLE_ROPE_TYPES", "HFConfigSpec", "apply_config_overrides", "is_hf_source", "load_hf_config", "rope_extension"]

RopeType = Literal["linear", "dynamic", "yarn", "llama3", "longrope"]
EXTENSIBLE_ROPE_TYPES: tuple[str, ...] = ("linear", "dynamic", "yarn", "llama3", "longrope")
"""The ``rope_type`` values :func:`rope_extension` can fill in (transformers' scaled RoPE types)."""

# the fields of a rope_parameters dict that do not depend on its rope_type (Note [Config overrides], 2.)
_TYPE_INDEPENDENT_ROPE_FIELDS: tuple[str, ...] = ("rope_theta", "partial_rotary_factor")
# messages of transformers' RoPE validation that are advice, not a rejection (Note [Config overrides], 4.)
_ADVISORY_ROPE_MESSAGES: tuple[str, ...] = ("does not match the ratio implicitly set", "Please set the `factor` field")
_ROPE_LOGGER = "transformers.modeling_rope_utils"


# --------------------------------------------------------------------------------------------- reading a config


def _transformers() -> Any:
    """The transformers module (this file imports nothing else of the package: it is read first, at construction).
    The version check is ``lightning_seqpar.hf.attention.require_transformers``'s, when a model is built."""
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - exercised only without transformers
        raise ImportError("Hugging Face models need `transformers`: pip install 'lightning-seqpar[hf]'") from error
    return transformers


@dataclass(frozen=True)
class HFConfigSpec:
    """A transformers config named by ``model_type`` with its ``config`` fields (random init): the form a recipe
    gives ``CausalLMModule(model=...)``, e.g. ``{model_type: qwen3_next, config: {hidden_size: 64, ...}}``
    (``AutoConfig.for_model(model_type, **config)``); the same as the dict ``{"model_type": ..., **config}``."""

    model_type: str
    config: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        if "model_type" in self.config:
            raise ValueError(f"HFConfigSpec: give model_type once (model_type={self.model_type!r}, not in config)")
        return {"model_type": self.model_type, **self.config}


def is_hf_source(model: object) -> bool:
    """Whether ``model`` designates a transformers causal LM: a local folder with ``config.json``, a
    ``PretrainedConfig``, a ``PreTrainedModel`` or a mapping with a ``"model_type"`` key."""
    if isinstance(model, (str, os.PathLike)):
        return os.path.isfile(os.path.join(os.fspath(model), "config.json"))
    if isinstance(model, HFConfigSpec):
        return True
    if isinstance(model, Mapping):
        return "model_type" in model
    transformers = sys.modules.get("transformers")  # an object of transformers exists only once it is imported
    return transformers is not None and isinstance(model, (transformers.PretrainedConfig, transformers.PreTrainedModel))


def load_hf_config(source: Any, *, config_overrides: Mapping[str, Any] | None = None) -> PretrainedConfig:
    """The ``PretrainedConfig`` of an :func:`is_hf_source` ``source`` (a folder is read, nothing is downloaded),
    with ``config_overrides`` applied (:func:`apply_config_overrides`: a new, checked config; ``source`` is
    never changed). Overrides are refused for a ``PreTrainedModel``: it is built already."""
    transformers = _transformers()
    if isinstance(source, transformers.PreTrainedModel):
        if config_overrides:
            raise ValueError(
                f"config_overrides={dict(config_overrides)!r} cannot be applied to a model that is already built "
                f"({type(source).__name__}): its layers were made from its config. Give the model as its local folder "
                "or its config (CausalLMModule(model=folder_or_config, config_overrides=...)) so that the overridden "
                "config builds it"
            )
        return source.config
    if isinstance(source, transformers.PretrainedConfig):
        config = source
    elif isinstance(source, HFConfigSpec):
        return load_hf_config(source.as_dict(), config_overrides=config_overrides)
    elif isinstance(source, Mapping):
        fields = dict(source)
        if isinstance(fields.get("config"), Mapping):  # the recipe's form {model_type, config: {...}} given as a dict
            if extra := sorted(set(fields) - {"model_type", "config"}):
                raise ValueError(f"model: give the config fields either inside 'config' or beside 'model_type', not both; "
                                 f"got {extra} beside 'config'")
            return load_hf_config(HFConfigSpec(fields["model_type"], dict(fields["config"])), config_overrides=config_overrides)
        model_type = fields.pop("model_type")
        config = transformers.AutoConfig.for_model(model_type, **fields)
        _check_fields(config, fields, model_type)
    elif isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model={path!r} is not a local Hugging Face model folder (no config.json)")
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    else:
        raise ValueError(
            f"model must be a local Hugging Face model folder, a transformers.PretrainedConfig, a PreTrainedModel or a dict "
            f"with 'model_type'; got {type(source).__name__}"
        )
    return apply_config_overrides(config, config_overrides) if config_overrides else config


def _check_fields(config: PretrainedConfig, fields: Mapping[str, Any], model_type: str) -> None:
    """Refuse a misspelt field: transformers keeps any keyword as an attribute, so ``hiden_size`` would silently build
    the class's default shape. A field the class does not list is refused only where it is close to one it does
    (difflib, ratio >= 0.85) and changes nothing else of the config; legacy keywords transformers converts
    (``rope_theta``, ``rope_scaling`` -> ``rope_parameters``) and the general ones of an older ``config.json``
    (``is_decoder``, ``tokenizer_class``, ...) pass, as transformers takes them."""
    transformers = _transformers()
    default = transformers.AutoConfig.for_model(model_type)
    known = set(default.to_dict()) | set(getattr(type(default), "attribute_map", {}) or {}) | _GENERAL_FIELDS
    built = config.to_dict()
    for key in fields:
        if key in known:
            continue
        close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.85)
        if not close:
            continue
        without = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if k != key}).to_dict()
        if any(built.get(k) != without.get(k) for k in set(built) | set(without) if k != key):
            continue  # it changed the config: a keyword transformers converts
        raise ValueError(f"model[{key!r}]: {type(config).__name__} (model_type={model_type!r}) has no field {key!r}; "
                         f"did you mean {' or '.join(repr(c) for c in close)}?")


# keywords every PretrainedConfig takes that its to_dict() may leave out
_GENERAL_FIELDS = frozenset({"torch_dtype", "dtype", "attn_implementation", "name_or_path", "_attn_implementation",
                             "transformers_version", "architectures", "auto_map"})


# --------------------------------------------------------------------------------------------- overriding it


def apply_config_overrides(config: PretrainedConfig, overrides: Mapping[str, Any], *, prefix: str = "config_overrides") -> PretrainedConfig:
    """A copy of ``config`` with ``overrides`` applied and checked (Note [Config overrides]); ``config`` is unchanged.

    Raises:
        ValueError: naming ``config_overrides[<key>]``: an unknown key, a value of the wrong type, RoPE
            parameters transformers rejects, or a config its class's checks refuse.
    """
    transformers = _transformers()
    if not isinstance(config, transformers.PretrainedConfig):
        raise ValueError(f"{prefix} apply to a transformers PretrainedConfig, got {type(config).__name__}")
    if not isinstance(overrides, Mapping):
        raise ValueError(f"{prefix} must be a dict of config fields, e.g. {{'max_position_embeddings': 65536}}; got {overrides!r}")
    new = copy.deepcopy(config)
    known = set(new.to_dict()) | set(getattr(type(new), "attribute_map", {}) or {})
    for key, value in overrides.items():
        where = f"{prefix}[{key!r}]"
        if not isinstance(key, str):
            raise ValueError(f"{where}: keys must be config field names (strings)")
        if key == "rope_scaling":
            raise ValueError(f"{where}: rope_scaling is transformers' deprecated name; give the RoPE fields as 'rope_parameters' "
                             "(with rope_type, factor, ...)")
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise ValueError(f"{where}: {type(config).__name__} (model_type={config.model_type!r}) has no field {key!r}{hint}")
        if key == "model_type":
            if value != config.model_type:
                raise ValueError(f"{where}: the model type cannot change ({config.model_type!r} -> {value!r}); give another model instead")
            continue
        current = getattr(new, key, None)
        if isinstance(current, transformers.PretrainedConfig):  # a sub-config (text_config, ...): overridden field by field
            if not isinstance(value, Mapping):
                raise ValueError(f"{where}: {key} is a sub-config; give a dict of its fields, got {type(value).__name__}")
            value = apply_config_overrides(current, value, prefix=where)
        elif isinstance(value, Mapping) and isinstance(current, Mapping):
            value = _merge(current, value, rope=key == "rope_parameters")
        try:
            setattr(new, key, copy.deepcopy(value))
        except Exception as error:  # noqa: BLE001 - transformers' strict field checks (StrictDataclassFieldValidationError, ...)
            raise ValueError(f"{where}={value!r} is refused by {type(config).__name__}: {_one_line(error)}") from error
    _check_rope(config, new, overrides, prefix=prefix)
    validate = getattr(new, "validate", None)  # transformers 5's strict configs: the class's own checks
    if callable(validate):
        try:
            validate()
        except Exception as error:  # noqa: BLE001 - whatever the class raises, re-raised naming the overrides
            raise ValueError(f"{prefix} {sorted(overrides)}: {type(config).__name__} refuses the overridden config: "
                             f"{_one_line(error)}") from error
    return new


def _merge(old: Mapping[str, Any], new: Mapping[str, Any], *, rope: bool) -> dict[str, Any]:
    """``new`` merged into ``old`` (Note [Config overrides], 2.); ``rope``: ``old`` is a ``rope_parameters`` dict (or a
    dict of them by layer type)."""
    is_rope_dict = rope and ("rope_type" in old or "rope_theta" in old or "rope_type" in new)
    if is_rope_dict and "rope_type" in new and new["rope_type"] != old.get("rope_type", old.get("type", "default")):
        out = {k: copy.deepcopy(old[k]) for k in _TYPE_INDEPENDENT_ROPE_FIELDS if k in old}
    else:
        out = copy.deepcopy(dict(old))
    for key, value in new.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value, rope=rope and not is_rope_dict)  # per-layer-type rope dicts
        else:
            out[key] = copy.deepcopy(value)
    return out


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _rope_messages() -> Iterator[list[str]]:
    """The warnings transformers' RoPE module logs inside the block (whatever its verbosity is set to)."""
    logger = logging.getLogger(_ROPE_LOGGER)
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _rope_problems(config: PretrainedConfig) -> tuple[list[str], str | None]:
    """(transformers' RoPE validation messages that are not advisory, the exception it raised or None) for ``config``
    (standardised in place)."""
    if not getattr(config, "rope_parameters", None) or not hasattr(config, "validate_rope"):
        return [], None
    error = None
    with _rope_messages() as messages:
        try:
            config.standardize_rope_params()
            config.validate_rope()
        except Exception as exc:  # noqa: BLE001 - KeyError for a missing key, ValueError for an odd rotary dim
            error = _one_line(exc)
    return [m for m in messages if not any(a in m for a in _ADVISORY_ROPE_MESSAGES)], error


def _rope_dicts(config: PretrainedConfig) -> dict[str, Mapping[str, Any]]:
    """``{layer type or "": rope_parameters dict}`` of a config (flat, or nested by layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if any(isinstance(v, Mapping) for v in params.values()):
        return {k: v for k, v in params.items() if isinstance(v, Mapping)}
    return {"": params} if params else {}


def _check_rope(old: PretrainedConfig, new: PretrainedConfig, overrides: Mapping[str, Any], *, prefix: str) -> None:
    """Step 4 of Note [Config overrides]: transformers' RoPE validation, its logged complaints made errors."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    before, _ = _rope_problems(copy.deepcopy(old))
    after, error = _rope_problems(new)
    keys = [k for k in overrides if "rope" in k or "position" in k or k in ("head_dim", "hidden_size", "num_attention_heads")]
    where = f"{prefix}[{(keys or sorted(overrides))[0]!r}]"
    if error is not None:
        raise ValueError(f"{where}: transformers rejects the RoPE parameters {getattr(new, 'rope_parameters', None)!r}: {error}")
    fresh = [m for m in after if m not in before]
    if fresh:
        raise ValueError(f"{where}: transformers rejects the RoPE parameters {getattr(new, 'rope_parameters', None)!r}: "
                         + "; ".join(fresh))
    for layer_type, params in _rope_dicts(new).items():
        rope_type = params.get("rope_type", "default")
        label = f"{where}" + (f"[{layer_type!r}]" if layer_type else "")
        if rope_type == getattr(new, "default_rope_type", "default") or rope_type == "default":
            _check_rope_numbers(new, params, rope_type, label)
            continue
        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"{label}: rope_type={rope_type!r} is not one of transformers' RoPE types "
                             f"{sorted(['default', *ROPE_INIT_FUNCTIONS])}")
        _check_rope_numbers(new, params, rope_type, label)  # Note [RoPE parameters at the lengths they run]
        for length in _rope_lengths(new, params, rope_type):  # the frequencies at the lengths they will run (a few numbers)
            try:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](new, "cpu", seq_len=length, layer_type=layer_type or None)
            except Exception as exc:  # noqa: BLE001 - whatever transformers raises, named
                raise ValueError(f"{label}: transformers cannot compute {rope_type!r} RoPE from {dict(params)!r}: {_one_line(exc)}") from exc
            at = "" if length is None else f" at length {length}"
            if not bool(inv_freq.isfinite().all()) or not bool((inv_freq > 0).all()):
                raise ValueError(f"{label}: {rope_type!r} RoPE from {dict(params)!r} gives frequencies that are not finite and > 0"
                                 f"{at} (min {float(inv_freq.min())}, max {float(inv_freq.max())})")
            if not math.isfinite(float(scaling)) or not float(scaling) > 0:
                raise ValueError(f"{label}: {rope_type!r} RoPE from {dict(params)!r} gives the attention scaling {float(scaling)}{at}; "
                                 "it must be finite and > 0 (it multiplies cos and sin)")


# Note [RoPE parameters at the lengths they run]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers validates RoPE parameters with comparisons that NaN and inf pass, and computes the
# frequencies of a length-dependent type (LongRoPE, dynamic NTK) for the ORIGINAL length only when
# a model is built: a LongRoPE long_factor with a 0 entry (an infinite frequency: NaN logits for
# every position past original_max_position_embeddings, exactly those an extension trains), a
# negative one (the rotation runs backwards), YaRN's attention_factor=0 (cos and sin zeroed) or a
# linear factor=inf (no position information left) all pass it. So every number of a scaled
# rope_parameters dict is checked finite and in its range (:data:`_ROPE_RANGES`; each LongRoPE
# factor finite and > 0, one per rotary frequency), and the frequencies are computed at every length
# they will run at (:func:`_rope_lengths`: the short and the long factors of LongRoPE, dynamic NTK at
# twice its start) and must be finite and > 0, the attention scaling finite and > 0.

_ROPE_RANGES: dict[str, tuple[float, bool]] = {
    "factor": (1.0, False), "attention_factor": (0.0, True), "rope_theta": (0.0, True), "beta_fast": (0.0, True),
    "beta_slow": (0.0, True), "low_freq_factor": (0.0, True), "high_freq_factor": (0.0, True),
    "partial_rotary_factor": (0.0, True), "mscale": (0.0, False), "mscale_all_dim": (0.0, False),
}
"""(lowest value, whether it is excluded) of each number of a scaled rope_parameters dict (Note [RoPE parameters at the
lengths they run]); any other number must be finite."""


def _check_rope_numbers(config: PretrainedConfig, params: Mapping[str, Any], rope_type: str, label: str) -> None:
    for key, value in params.items():
        if key in ("long_factor", "short_factor"):
            if value is None:
                continue
            dims = _rotary_dims(config, params) // 2
            if not isinstance(value, (list, tuple)) or len(value) != dims:
                raise ValueError(f"{label}: rope_parameters[{key!r}] must be a list of {dims} factors (one per rotary frequency: "
                                 f"head_dim x partial_rotary_factor / 2), got {value!r}")
            bad = [(i, f) for i, f in enumerate(value)
                   if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not f > 0]
            if bad:
                raise ValueError(f"{label}: every entry of rope_parameters[{key!r}] must be a finite number > 0 (it divides the "
                                 f"frequency: 0 makes it infinite, a negative one turns the rotation backwards); entries "
                                 f"{[i for i, _ in bad][:8]} are {[f for _, f in bad][:8]}")
            continue
        if key in _ROPE_RANGES and value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{label}: rope_parameters[{key!r}] must be a finite number, got {value!r} ({type(value).__name__})")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # a type name, a flag (mrope_interleaved), a list (mrope_section), None: transformers' own checks
        if not math.isfinite(value):
            raise ValueError(f"{label}: rope_parameters[{key!r}] must be a finite number, got {value!r}")
        if key in _ROPE_RANGES:
            low, strict = _ROPE_RANGES[key]
            if value < low or (strict and value == low):
                raise ValueError(f"{label}: rope_parameters[{key!r}] must be {'>' if strict else '>='} {low:g} for rope_type="
                                 f"{rope_type!r}, got {value!r}")
        if key == "partial_rotary_factor" and value > 1:
            raise ValueError(f"{label}: rope_parameters['partial_rotary_factor'] must be in (0, 1], got {value!r}")


def _rope_lengths(config: PretrainedConfig, params: Mapping[str, Any], rope_type: str) -> list[int | None]:
    """The lengths at which the frequencies of ``rope_type`` differ (Note [RoPE parameters at the lengths they run]):
    None (what building the model computes) and, for LongRoPE, one past the original length (the long factors); for
    dynamic NTK, twice the length at which its scaling starts."""
    if rope_type == "longrope":
        original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
        return [None] + ([int(original) + 1] if isinstance(original, int) else [])
    if "dynamic" in rope_type:
        start = getattr(config, "max_position_embeddings", None)
        return [None] + ([2 * int(start)] if isinstance(start, int) else [])
    return [None]


# --------------------------------------------------------------------------------------------- extending RoPE

# Note [Extending the context through RoPE]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``rope_extension(config, target_length, rope_type=...)`` returns the ``config_overrides`` that
# stretch a model's RoPE from the length it was pretrained at, L0, to ``target_length`` T (the
# factor s = T / L0), for transformers' scaled RoPE types:
#
#   type      rope_parameters set                                     max_position_embeddings
#   linear    factor s (positions divided by s: Chen et al. 2023)     T
#   dynamic   factor s (NTK base grown with the CURRENT length once   L0 (the length at which the
#             it passes max_position_embeddings)                      scaling starts)
#   yarn      factor s, original_max_position_embeddings L0           T
#             (NTK-by-parts + attention temperature: Peng et al. 2023, Qwen's and TRL's recipe)
#   llama3    factor s, original_max_position_embeddings L0,          T
#             low_freq_factor 1, high_freq_factor 4 (Llama 3.1's)
#   longrope  long_factor / short_factor: one factor per rotary       T
#             frequency, found by LongRoPE's search (Ding et al. 2024)
#             -- they cannot be derived from a length, so the caller
#             gives long_factor (short_factor: the config's, or 1s);
#             factor s sets the attention scaling sqrt(1 + ln s / ln L0)
#
# L0 is the config's ``original_max_position_embeddings`` when it has one (in ``rope_parameters``, or
# Phi-3's top-level field: the model was extended before, e.g. Llama 3.1's 8192), else its
# ``max_position_embeddings``. An existing scaling is replaced, not composed: the factor is always
# measured from L0. ``rope_theta`` and ``partial_rotary_factor`` are kept; other fields (YaRN's
# beta_fast / beta_slow / attention_factor / mscale, llama3's frequency factors) go in ``fields``.
# Refused (ValueError): a model without RoPE, RoPE nested by layer type (Gemma 3: give
# config_overrides by hand), another ``rope_type`` (default, proportional, ...), T <= L0. The
# overrides are checked by applying them (:func:`apply_config_overrides`).


def rope_extension(model: Any, target_length: int, *, rope_type: RopeType = "yarn", **fields: Any) -> dict[str, Any]:
    """The ``config_overrides`` that extend ``model``'s RoPE to ``target_length`` tokens (Note [Extending the context
    through RoPE]): ``{"rope_parameters": {...}, "max_position_embeddings": ...}``, checked.

    Args:
        model: a local model folder, a transformers config or model, or a dict with ``"model_type"``.
        target_length: the context length to train and evaluate at (> the original length).
        rope_type: "linear", "dynamic", "yarn" (default), "llama3" or "longrope" (needs ``long_factor``).
        fields: more ``rope_parameters`` fields (e.g. ``beta_fast=32``, ``long_factor=[...]``).

    Example::

        overrides = rope_extension("/models/qwen3-8b", 131072)   # YaRN, factor 131072 / 32768 = 4.0
        CausalLMModule(model="/models/qwen3-8b", config_overrides=overrides)
    """
    config = load_hf_config(model)
    name = "rope_extension"
    if isinstance(target_length, bool) or not isinstance(target_length, int) or target_length < 1:
        raise ValueError(f"{name}: target_length must be a positive integer (tokens), got {target_length!r}")
    if rope_type not in EXTENSIBLE_ROPE_TYPES:
        raise ValueError(f"{name}: rope_type={rope_type!r} cannot extend a context; expected one of {list(EXTENSIBLE_ROPE_TYPES)} "
                         "('default' and 'proportional' have no length factor)")
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, Mapping) or not params:
        raise ValueError(f"{name}: {type(config).__name__} (model_type={config.model_type!r}) has no rope_parameters: its positions "
                         "are not rotary (learned or none), so there is no RoPE to extend")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(f"{name}: {type(config).__name__} has rope_parameters per layer type ({sorted(params)}); extend the "
                         "layer types you mean by hand with config_overrides={'rope_parameters': {<layer type>: {...}}}")
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None) \
        or getattr(config, "max_position_embeddings", None)
    if not isinstance(original, int) or original < 1:
        raise ValueError(f"{name}: {type(config).__name__} gives no original length (original_max_position_embeddings or "
                         f"max_position_embeddings), got {original!r}")
    if target_length <= original:
        raise ValueError(f"{name}: target_length={target_length} is not longer than the model's original length {original}: "
                         "nothing to extend")
    factor = target_length / original
    rope: dict[str, Any] = {k: params[k] for k in _TYPE_INDEPENDENT_ROPE_FIELDS if k in params}
    rope.update(rope_type=rope_type, factor=factor)
    max_positions = target_length
    if rope_type == "dynamic":
        max_positions = original
    elif rope_type == "yarn":
        rope["original_max_position_embeddings"] = original
    elif rope_type == "llama3":
        rope.update(original_max_position_embeddings=original, low_freq_factor=1.0, high_freq_factor=4.0)
    elif rope_type == "longrope":
        if "long_factor" not in fields:
            raise ValueError(f"{name}: rope_type='longrope' needs long_factor: one factor per rotary frequency, found by "
                             "LongRoPE's search for this model and length; it cannot be derived from target_length. Pass "
                             "long_factor=[...] (and short_factor), or use rope_type='yarn'")
        dims = _rotary_dims(config, params)
        short = params.get("short_factor") if params.get("rope_type") == "longrope" else None
        rope.update(original_max_position_embeddings=original, short_factor=list(short or [1.0] * (dims // 2)))
    rope.update(fields)
    overrides: dict[str, Any] = {"rope_parameters": rope, "max_position_embeddings": max_positions}
    if rope_type != "dynamic" and getattr(config, "original_max_position_embeddings", None) is not None \
            and "original_max_position_embeddings" in config.to_dict():
        overrides["original_max_position_embeddings"] = original  # Phi-3 keeps it at the top level too (and it wins)
    apply_config_overrides(config, overrides, prefix=f"{name}(rope_type={rope_type!r})")  # the check
    return overrides


def _rotary_dims(config: PretrainedConfig, params: Mapping[str, Any]) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * (params.get("partial_rotary_factor") or 1.0))

"""The package's model families: name or config -> (config class, model class), and a model's attention heads.

Note [The model registry]
~~~~~~~~~~~~~~~~~~~~~~~~~
``CausalLMModule`` and ``SequenceParallelStrategy`` ask this registry instead of guessing from
dict keys or attribute names:

* :func:`resolve_config` turns what a user or a checkpoint gives into a config: a named
  configuration ("llama-7b", "tnl-385m", "lss-gpt-small", ...: each family's ``CONFIGS``), a
  config instance, or a dict of a config's fields (checkpoints store the config that way, so that
  ``torch.load(weights_only=True)`` reads them). A dict belongs to the first family, in
  :data:`MODEL_FAMILIES` order, whose config class has every one of its keys as a field: a full
  dict names fields that only its own class has (Llama's ``rope_theta``, TNL's ``glu_dim``, the
  GPT's ``kv_comm``), and a partial dict of shared fields is a Llama, as it always was.
* :func:`build_model` builds the model of a config (the family's model class).
* :func:`attention_heads` gives (query heads, key/value heads, head dim) of a model, from the
  first ``config`` in it that the registry knows: a config of one of the families (each family
  says how, ``ModelFamily.heads``) or a Hugging Face ``PretrainedConfig`` (transformers maps every
  model's own names onto ``num_attention_heads`` / ``num_key_value_heads``; ``head_dim`` or
  ``hidden_size / num_attention_heads``). A model with neither gives None: the strategy then
  cannot check head counts in setup, and the attention op checks them at its first call.
* ``ModelFamily.linear_attention`` says that a family's token mixer is linear attention (LASP):
  the strategy reads it to plan ``attention="auto"`` before the model is built.
* :func:`cudnn_attention_exact` says whether ``attention_backend="auto"`` may run cuDNN for a model
  (Note [Choosing the local kernel]), also before it is built: the planner models the kernel that
  will run (a cost model of the wrong kernel picks the wrong algorithm: Note [Choosing attention
  automatically]).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Any

from torch import nn

from lightning_seqpar.models.gpt import CONFIGS as GPT_CONFIGS
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.models.llama import CONFIGS as LLAMA_CONFIGS
from lightning_seqpar.models.llama import Llama, LlamaConfig
from lightning_seqpar.models.transnormer import CONFIGS as TNL_CONFIGS
from lightning_seqpar.models.transnormer import TransNormer, TransNormerConfig

__all__ = [
    "MODEL_FAMILIES",
    "AttentionHeads",
    "ModelConfig",
    "ModelFamily",
    "attention_heads",
    "build_model",
    "cudnn_attention_exact",
    "family_of",
    "is_named_config",
    "resolve_config",
    "rotates_whole_head",
]

ModelConfig = LlamaConfig | TransNormerConfig | GPTConfig
AttentionHeads = tuple[int, int, int | None]
"""(query heads, key/value heads, head dim or None when the config does not determine it)."""


@dataclass(frozen=True)
class ModelFamily:
    """One architecture of the package: its config and model classes, named configs, and how to read its heads."""

    name: str
    config_class: type
    model_class: type[nn.Module]
    named_configs: Mapping[str, Mapping[str, Any]]
    heads: Callable[[Any], AttentionHeads]
    linear_attention: bool = False


MODEL_FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("llama", LlamaConfig, Llama, LLAMA_CONFIGS, heads=lambda c: (c.n_head, c.n_kv_head, c.head_dim)),
    ModelFamily("transnormer", TransNormerConfig, TransNormer, TNL_CONFIGS, heads=lambda c: (c.n_head, c.n_head, c.head_dim),
                linear_attention=True),
    ModelFamily("gpt", GPTConfig, GPT, GPT_CONFIGS, heads=lambda c: (c.n_head, c.n_kv_head, c.head_dim)),
)
"""The families, in the order a dict of shared fields is matched (Note [The model registry])."""


def is_named_config(name: str) -> bool:
    """Whether ``name`` is one of the families' named configurations."""
    return any(name in family.named_configs for family in MODEL_FAMILIES)


def family_of(config: Any) -> ModelFamily | None:
    """The family of a config instance, or None (not one of the package's configs)."""
    return next((f for f in MODEL_FAMILIES if isinstance(config, f.config_class)), None)


def resolve_config(model: str | Mapping[str, Any] | ModelConfig, *, owner: str = "model") -> ModelConfig:
    """A config of one of the families from its name, a dict of its fields, or itself (Note [The model registry]).

    Raises ValueError naming ``owner`` for an unknown name or a dict no family's config takes."""
    if family_of(model) is not None:
        return model  # type: ignore[return-value]
    if isinstance(model, str):
        for family in MODEL_FAMILIES:
            if model in family.named_configs:
                return family.config_class.from_name(model)
        return LlamaConfig.from_name(model)  # its error lists the names
    if isinstance(model, Mapping):
        keys = set(model)
        for family in MODEL_FAMILIES:
            if keys <= {f.name for f in fields(family.config_class)}:
                return family.config_class(**model)
        raise ValueError(
            f"{owner}: the dict {sorted(keys)} is not the fields of any of "
            f"{[f.config_class.__name__ for f in MODEL_FAMILIES]}"
        )
    raise ValueError(f"{owner}: expected a config name, a dict of its fields or one of "
                     f"{[f.config_class.__name__ for f in MODEL_FAMILIES]}, got {type(model).__name__}")


def build_model(config: ModelConfig) -> nn.Module:
    """The model of ``config`` (its family's model class), built on the current device."""
    family = family_of(config)
    if family is None:
        raise ValueError(f"build_model: {type(config).__name__} is not the config of a model family of the package")
    return family.model_class(config)


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _hf_fields(config: Any) -> Any:
    """A transformers ``PretrainedConfig``, or a dict of its fields as attributes (a config's ``to_dict()``,
    LitGPTModule's planner fields); None for anything else."""
    if isinstance(config, Mapping):
        return SimpleNamespace(**{k: v for k, v in config.items() if isinstance(k, str)})
    transformers = sys.modules.get("transformers")  # a PretrainedConfig exists only once transformers is imported
    return config if transformers is not None and isinstance(config, transformers.PretrainedConfig) else None


def _hf_heads(config: Any) -> AttentionHeads | None:
    """Heads of a transformers ``PretrainedConfig`` or a dict of its fields (transformers' standard attribute names)."""
    config = _hf_fields(config)
    if config is None:
        return None
    h_q = getattr(config, "num_attention_heads", None)
    if not _positive(h_q):
        return None
    h_kv = getattr(config, "num_key_value_heads", None)
    h_kv = h_kv if _positive(h_kv) else h_q
    try:  # Gemma 4's per-layer head_dim raises on the global read
        head_dim = getattr(config, "head_dim", None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError and the like
        head_dim = None
    if not _positive(head_dim):
        width = getattr(config, "hidden_size", None)
        head_dim = width // h_q if _positive(width) and width % h_q == 0 else None
    return h_q, h_kv, head_dim


def config_heads(config: Any) -> AttentionHeads | None:
    """(H_q, H_kv, D or None) of a config the registry knows (a family's, or a Hugging Face one), else None."""
    family = family_of(config)
    if family is not None:
        return family.heads(config)
    return _hf_heads(config)


def attention_heads(model: nn.Module | None, *, complete: bool = False) -> AttentionHeads | None:
    """(H_q, H_kv, D) of ``model``'s attention from the first ``config`` on it or a submodule that the registry
    knows (Note [The model registry]). ``complete=True``: the first one whose head dim is known and whose
    query heads are a multiple of its key/value heads."""
    if model is None:
        return None
    for module in model.modules():
        heads = config_heads(getattr(module, "config", None))
        if heads is None:
            continue
        if not complete or (heads[2] is not None and heads[0] % heads[1] == 0):
            return heads
    return None


_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "chunked_attention")


def rotates_whole_head(config: Any) -> bool:
    """A transformers config (or the text config of a multimodal one) whose rotary embedding, if any, turns the whole
    head on every attention layer, read from its fields: no partial rotary factor below 1 (top level or in any
    ``rope_parameters``), no ``rotary_dim`` / ``qk_rope_head_dim`` (a rotated part of the head), no NoPE layers.
    Whether a rotary embedding exists at all is the built model's to say (``HFCausalLM.cudnn_attention_exact``)."""
    config = getattr(config, "text_config", None) or config
    factors = [getattr(config, "partial_rotary_factor", 1.0)]
    params = getattr(config, "rope_parameters", None) or {}
    for value in [params, *(v for v in params.values() if isinstance(v, Mapping))] if isinstance(params, Mapping) else []:
        factors.append(value.get("partial_rotary_factor", 1.0))
    if any(f is not None and float(f) < 1.0 for f in factors):
        return False
    if any(getattr(config, field, None) for field in ("rotary_dim", "qk_rope_head_dim", "rotary_emb_base_dim")):
        return False
    no_rope = getattr(config, "no_rope_layers", None)
    return not (isinstance(no_rope, (list, tuple)) and 0 in no_rope)


def cudnn_attention_exact(model: Any) -> bool:
    """Whether ``attention_backend="auto"`` may run cuDNN for ``model`` (its backward exact for the model: Note [Choosing
    the local kernel]), also before the model is built: the ``cudnn_attention_exact`` of ``model`` or of a child (what
    a built model says: the strategy installs attention with it), else read from ``model.config``: a family's model
    class's, or a transformers config with rotary positions (``rope_parameters`` / ``rope_theta``) over the whole head
    (:func:`rotates_whole_head`) and attention layers only. False when none says."""
    if model is None:
        return False
    for module in (model, *(model.children() if isinstance(model, nn.Module) else ())):
        exact = getattr(module, "cudnn_attention_exact", None)
        if isinstance(exact, bool):
            return exact
    config = getattr(model, "config", None)
    family = family_of(config)
    if family is not None:
        return getattr(family.model_class, "cudnn_attention_exact", False) is True
    if _hf_heads(config) is None:
        return False
    fields = _hf_fields(config)
    text = getattr(fields, "text_config", None) or fields
    text = _hf_fields(text) if isinstance(text, Mapping) else text  # a dict's own text_config dict
    rotary = getattr(text, "rope_parameters", None) or getattr(text, "rope_theta", None)
    layers = getattr(text, "layer_types", None) or ()
    return bool(rotary) and rotates_whole_head(text) and all(t in _ATTENTION_LAYERS for t in layers)

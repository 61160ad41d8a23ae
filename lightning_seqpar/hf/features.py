"""What a transformers attention layer asks of its attention beyond causal softmax attention.

Note [Reading a layer's attention features]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' eager attention (the reference) applies a layer's sliding window and chunks through
the MASK its model builds for the layer's type (``causal_mask_mapping[config.layer_types[i]]``:
``create_sliding_window_causal_mask`` / ``create_chunked_causal_mask``), and soft-capping and
sinks only when the layer passes them to the attention function (``softcap=``, ``s_aux=``).
``"seqpar"``'s mask function returns None (the package's attention builds its own masks from the
global positions), so :func:`attention_features` reads them as the reference applies them:

* window: with ``config.layer_types``, a ``"sliding_attention"`` layer has one (the call's
  ``sliding_window`` kwarg, else the layer's attribute, else ``config.sliding_window``) and any
  other layer none, whatever its attributes say (EXAONE 4 keeps ``sliding_window`` on its full
  layers; Qwen2-MoE passes no kwarg and lets the mask apply it), except in MiniMax, whose model
  builds its "full_attention" masks with ``config.sliding_window``; without ``layer_types`` (Mistral),
  the kwarg, else the attribute, else ``config.sliding_window`` unless ``use_sliding_window`` is off;
* chunk: the kwarg, else ``config.attention_chunk_size`` on ``"chunked_attention"`` layers (Llama 4);
* softcap and sinks: the call's kwargs only (Gemma 3 keeps ``attn_logit_softcapping`` in its
  config and never applies it).

:func:`attention_kwargs` hands them to the package's ``Attention`` (Note [Attention variants] in
``lightning_seqpar.attention.variants``), which computes each of them exactly in every algorithm.
The support sweep (``lightning_seqpar.hf.support``) checks this reading against the unmodified
model for every architecture transformers registers. Semantics, as transformers'
masks (``masking_utils.sliding_window_overlay`` / ``chunked_overlay``):

* window ``w``: query ``i`` sees key ``j`` iff ``0 <= i - j < w``; over a sequence of ``S <= w``
  tokens it IS full causal attention;
* chunk ``c``: query ``i`` sees key ``j <= i`` iff ``i // c == j // c``; over ``S <= c`` tokens it
  is full causal attention;
* softcap ``s``: scores ``s * tanh(scores / s)`` before the softmax;
* sinks: one learned logit per head added to the softmax denominator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

__all__ = ["AttentionFeatures", "attention_features", "attention_kwargs", "is_attention_layer", "layer_name"]

_WINDOWED_LAYER_TYPES = ("sliding_attention",)
# model types whose model builds the mask of its "full_attention" layers with config.sliding_window (MiniMax:
# Mixtral's masking, create_sliding_window_causal_mask whenever the field is set; its layer_types only tell the
# lightning-attention layers from the softmax ones)
_FULL_LAYERS_WINDOWED_BY_CONFIG = frozenset({"minimax"})
_CHUNKED_LAYER_TYPES = ("chunked_attention",)


@dataclasses.dataclass(frozen=True)
class AttentionFeatures:
    """What a layer's attention does beyond plain causal softmax (None: not used).

    ``*_field``: the config field and value behind each feature (``"config.sliding_window=8 with
    config.layer_types[1]='sliding_attention'"``), for error messages.
    """

    window: int | None = None
    softcap: float | None = None
    sinks: Tensor | None = dataclasses.field(default=None, compare=False)
    chunk_size: int | None = None
    window_field: str = ""
    softcap_field: str = ""
    sinks_field: str = ""
    chunk_field: str = ""

    @property
    def plain(self) -> bool:
        """Plain causal attention: no window, chunk, soft-capping or sinks."""
        return self.window is None and self.softcap is None and self.sinks is None and self.chunk_size is None

    def covers(self, seq_len: int) -> bool:
        """Whether over ``seq_len`` tokens the window and the chunks make no difference (full causal attention)."""
        return (self.window is None or seq_len <= self.window) and (self.chunk_size is None or seq_len <= self.chunk_size)


def is_attention_layer(module: nn.Module) -> bool:
    """A transformers attention layer: it has a softmax ``scaling``, an ``is_causal`` flag and the model config."""
    scaling = getattr(module, "scaling", None)
    return (
        isinstance(scaling, (int, float))
        and not isinstance(scaling, bool)
        and hasattr(module, "is_causal")
        and hasattr(module, "config")
    )


def layer_name(module: nn.Module) -> str:
    """``"LlamaAttention (layer 3)"``."""
    layer_idx = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + (f" (layer {layer_idx})" if layer_idx is not None else "")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def layer_type_of(module: nn.Module) -> str | None:
    """``config.layer_types[module.layer_idx]``, or None (no such list, or no index in it)."""
    return _layer_type(module, fresh=True)[0]


def _layer_type(module: nn.Module, fresh: bool = False) -> tuple[str | None, str]:
    """(config.layer_types[layer_idx], its field name) or (None, ""). A layer that ``apply_hf_attention`` prepared
    answers from its ``seqpar_layer_type``, without reading its index (Note [One graph for every layer])."""
    if not fresh and hasattr(module, "seqpar_layer_type"):
        layer_type = module.seqpar_layer_type
        return layer_type, (f"this layer's entry of config.layer_types, {layer_type!r}" if layer_type is not None else "")
    config = getattr(module, "config", None)
    layer_idx = getattr(module, "layer_idx", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(layer_types):
        return None, ""
    return layer_types[layer_idx], f"config.layer_types[{layer_idx}]={layer_types[layer_idx]!r}"


def attention_features(module: nn.Module, kwargs: Mapping[str, Any] | None = None) -> AttentionFeatures:
    """The window, soft-capping, sinks and chunk size of a transformers attention layer
    (Note [Reading a layer's attention features]).

    Args:
        module: the transformers attention layer (``self`` of the attention interface call).
        kwargs: the kwargs of the attention interface call (None or {} at set-up: then the
            layer and its config only).

    Returns:
        An :class:`AttentionFeatures`; reads local metadata only (no communication).
    """
    kwargs = kwargs or {}
    config = getattr(module, "config", None)
    layer_type, type_field = _layer_type(module)

    window, window_field = None, ""
    # transformers applies windows through the mask its model builds for the layer's type
    # (causal_mask_mapping[config.layer_types[i]]), whatever the layer or the call says: a layer
    # typed "full_attention" is full even where it keeps a sliding_window attribute (EXAONE 4).
    candidates = (kwargs.get("sliding_window"), getattr(module, "sliding_window", None), getattr(config, "sliding_window", None))
    if layer_type is not None:
        if layer_type in _WINDOWED_LAYER_TYPES:
            window = next((int(w) for w in candidates if _positive(w)), None)
        elif layer_type == "full_attention" and getattr(config, "model_type", None) in _FULL_LAYERS_WINDOWED_BY_CONFIG:
            window = int(candidates[2]) if _positive(candidates[2]) else None
    elif _positive(candidates[0]):  # the field is named after the config, which is what users set
        window = int(candidates[0])
    elif _positive(candidates[1]):
        window = int(candidates[1])
    elif getattr(config, "use_sliding_window", True) and _positive(candidates[2]):
        window = int(candidates[2])
    if window is not None:
        window_field = f"config.sliding_window={window}" + (f" with {type_field}" if type_field else "")

    # soft-capping and sinks act only when the layer passes them to the attention function (as
    # transformers' eager_attention_forward takes them): a config field or a parameter that the
    # layer does not pass changes nothing (Gemma 3 keeps attn_logit_softcapping and never uses it)
    softcap, softcap_field = None, ""
    if _positive(kwargs.get("softcap")):
        softcap = float(kwargs["softcap"])
        softcap_field = f"the softcap kwarg of the attention call (config.attn_logit_softcapping={softcap})"

    sinks, sinks_field = None, ""
    for name in ("s_aux", "sinks"):
        if kwargs.get(name) is not None:
            sinks, sinks_field = kwargs[name], f"the {name} kwarg of the attention call"
            break

    chunk, chunk_field = None, ""
    if _positive(kwargs.get("attention_chunk_size")):
        chunk = int(kwargs["attention_chunk_size"])
    elif layer_type in _CHUNKED_LAYER_TYPES and _positive(getattr(config, "attention_chunk_size", None)):
        chunk = int(config.attention_chunk_size)
    if chunk is not None:
        chunk_field = f"config.attention_chunk_size={chunk}" + (f" with {type_field}" if type_field else "")

    return AttentionFeatures(window=window, softcap=softcap, sinks=sinks, chunk_size=chunk, window_field=window_field,
                             softcap_field=softcap_field, sinks_field=sinks_field, chunk_field=chunk_field)


def attention_kwargs(features: AttentionFeatures, *, seq_len: int) -> dict[str, Any]:
    """The keyword arguments of ``Attention.forward`` that apply ``features`` over a sequence of
    ``seq_len`` tokens (the GLOBAL length: local length x sequence-parallel size).

    A window or chunk that covers the whole sequence is full causal attention: it is dropped, so
    the dense kernels run. Soft-capping and sinks are always passed. Local metadata only.
    """
    window, chunk = features.window, features.chunk_size
    return {
        "window": window if window is not None and seq_len > window else None,
        "chunk_size": chunk if chunk is not None and seq_len > chunk else None,
        "softcap": features.softcap,
        "sinks": features.sinks,
    }

"""The ``"seqpar"`` attention implementation of transformers models: registration, the
``AttentionInterface`` entry and :func:`apply_hf_attention` (Note [Hugging Face models under the
strategy] in ``lightning_seqpar.hf``)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_seqpar.attention import Attention
from lightning_seqpar.hf.features import attention_features, attention_kwargs, is_attention_layer, layer_name, layer_type_of
from lightning_seqpar.hf.hybrid import HYBRID_MIXERS, apply_hf_hybrid, is_hybrid_twin
from lightning_seqpar.hf.rope import install_global_length_rotary
from lightning_seqpar.hf.support import check_sharded_layer, refuse_token_mixers, refuse_unseen_position_features
from lightning_seqpar.sharding.documents import current_documents

__all__ = [
    "ATTN_IMPLEMENTATION",
    "MIN_TRANSFORMERS_VERSION",
    "apply_hf_attention",
    "register_attention",
    "seqpar_attention_forward",
    "seqpar_attention_mask",
]

ATTN_IMPLEMENTATION = "seqpar"
"""The name under which the package's attention is registered with transformers."""

MIN_TRANSFORMERS_VERSION = "4.56"
"""Oldest transformers release supported (``AttentionInterface``, ``masking_utils``, ``set_attn_implementation``)."""

# kwargs of the attention interface that would change the result and that "seqpar" does not implement
_UNSUPPORTED_KWARGS: dict[str, str] = {
    "cu_seq_lens_q": "packed sequences given as cu_seq_lens_q (put document_ids, or position_ids restarting at 0, in the batch: "
                     "SequenceParallelStrategy then masks documents itself)",
    "cu_seq_lens_k": "packed sequences given as cu_seq_lens_k (put document_ids, or position_ids restarting at 0, in the batch: "
                     "SequenceParallelStrategy then masks documents itself)",
    "head_mask": "a head mask",
}


def require_transformers() -> Any:
    """The transformers module, or an ImportError saying how to install a supported version."""
    try:
        import transformers
    except ImportError as error:  # pragma: no cover - exercised only without transformers
        raise ImportError(
            "Hugging Face models need `transformers>=4.56`: pip install 'lightning-seqpar[hf]' "
            "(or pip install 'transformers>=4.56')"
        ) from error
    from packaging.version import Version

    if Version(transformers.__version__).release[:2] < Version(MIN_TRANSFORMERS_VERSION).release[:2]:
        raise ImportError(
            f"Hugging Face models need transformers>={MIN_TRANSFORMERS_VERSION} (AttentionInterface and masking_utils); "
            f"found {transformers.__version__}"
        )
    return transformers


# --------------------------------------------------------------------------------------------- registration


def register_attention() -> None:
    """Register ``"seqpar"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

    Idempotent. This is the only global state the package touches, and it lives in transformers'
    own registries, which exist for exactly this purpose.
    """
    transformers = require_transformers()
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, seqpar_attention_forward)
    from transformers.masking_utils import AttentionMaskInterface

    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, seqpar_attention_mask)


def seqpar_attention_mask(*args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> None:
    """``AttentionMaskInterface`` function of ``"seqpar"``: no mask (the attention is causal by construction).

    transformers calls it from ``create_causal_mask`` / ``create_sliding_window_causal_mask`` with
    the 2-D padding mask (if any) as a bool tensor. Never materialises a 4-D mask. Raises a
    ValueError for a mask with padding, which "seqpar" cannot apply (Note [Hugging Face models
    under the strategy]); sliding windows are checked by :func:`seqpar_attention_forward`.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} is causal over the whole sequence and cannot apply an "
            "attention_mask with padding: pad on the right, drop the attention_mask and set labels=-100 on the "
            "padding (exact under a causal mask); left padding and document masks are not supported"
        )
    return None


# Note [Value heads of another width]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-lite, LongCat, ...) has query /
# key heads of d_qk = nope + rope dims and value heads of d_v != d_qk. The package's attention takes
# one head width, so the narrower side is padded with zeros to max(d_qk, d_v): zero columns of q
# and k add nothing to q . k (the scale is the layer's own, passed explicitly), and zero columns of
# v give zero output columns, which are sliced off (their gradient is zero, so the pads' gradients
# vanish). Exact, at the cost of attending over the wider width.


# Note [One graph for every layer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Under torch.compile every decoder layer of a model is one code object, compiled once and reused, as long as
# nothing the layer's forward reads differs between layers: Dynamo guards on every constant it reads. A
# transformers attention layer's ``layer_idx`` differs in each, so reading it per call (to name the layer in an
# error, or to look up ``config.layer_types[layer_idx]``) recompiled the layer for each index, and past the
# recompile limit (8) the remaining layers ran eagerly: on Qwen3-8B at 64K on 2 x H200, ``compile=True`` left
# 1.25 s of un-fused element-wise kernels per step, as without it. So the forward reads ``seqpar_layer_type``
# (the layer's entry of ``config.layer_types``, set by ``apply_hf_attention``; the same string for layers of one
# type, so one graph per type) and formats the layer's name only into an error it raises.


class _LazyName:
    """``layer_name(module)``, formatted when an error message is: reading the index is off the traced path."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __format__(self, spec: str) -> str:
        return format(layer_name(self.module), spec)


def seqpar_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """``AttentionInterface`` function of ``"seqpar"``: the layer's ``seqpar_attention`` child on ``[B, S, H, D]``.

    Args:
        module: the transformers attention layer (its ``seqpar_attention`` is set by :func:`apply_hf_attention`).
        query: ``[B, H_q, S_local, D]``; key, value: ``[B, H_kv, S_local, D]`` (GQA: not repeated).
        attention_mask: must be None (see :func:`seqpar_attention_mask`).
        scaling: the softmax scale; must equal the one the ``Attention`` child was built with.
        dropout: must be 0.

    Returns:
        ``(attn_output [B, S_local, H_q, D], None)``: no attention weights.

    Raises:
        ValueError: anything "seqpar" cannot compute exactly (Note [Hugging Face models under the
        strategy]), from local metadata before any communication.
    """
    attention = getattr(module, "seqpar_attention", None)
    name = _LazyName(module)  # formatted only into an error (Note [One graph for every layer])
    if not isinstance(attention, Attention):
        raise ValueError(
            f"{name} runs attn_implementation={ATTN_IMPLEMENTATION!r} but has no `seqpar_attention` child: call "
            "lightning_seqpar.hf.apply_hf_attention(model) (or wrap it in lightning_seqpar.hf.HFCausalLM)"
        )
    if attention_mask is not None:
        raise ValueError(
            f"{name}: attn_implementation={ATTN_IMPLEMENTATION!r} takes no attention mask (got shape "
            f"{tuple(attention_mask.shape)}): it is causal over the whole sequence; pad on the right with labels=-100 "
            "instead of masking"
        )
    if dropout:
        raise ValueError(
            f"{name}: attention dropout {dropout} (config.attention_dropout) is not supported by "
            f"attn_implementation={ATTN_IMPLEMENTATION!r}; set config.attention_dropout=0.0 for training"
        )
    for key_name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(key_name) is not None:
            raise ValueError(f"{name}: {what} is not supported by attn_implementation={ATTN_IMPLEMENTATION!r}")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError(
            f"{name} is not causal (bidirectional attention, e.g. config.use_bidirectional_attention); "
            f"attn_implementation={ATTN_IMPLEMENTATION!r} is causal only"
        )
    if scaling is not None and attention.scale is not None and not math.isclose(scaling, attention.scale, rel_tol=1e-6):
        raise ValueError(
            f"{name} calls attention with scaling={scaling}, but its seqpar_attention was built with "
            f"scale={attention.scale}; call apply_hf_attention(model) again after changing the layer's scaling"
        )
    if query.shape[2] != key.shape[2]:
        raise ValueError(
            f"{name}: query length {query.shape[2]} != key length {key.shape[2]} (a KV cache?): attn_implementation="
            f"{ATTN_IMPLEMENTATION!r} is for training on whole sequences; generate with "
            "model.set_attn_implementation('sdpa') and use_cache as usual"
        )
    sp = 1 if attention.mesh is None else attention.mesh.size()
    packed = current_documents() is not None
    if sp > 1 or packed:
        check_sharded_layer(module, seq_len=query.shape[2] * sp, packed=packed)
    # windows and chunks are measured on the GLOBAL length; Note [Reading a layer's attention features]
    variant = attention_kwargs(attention_features(module, kwargs), seq_len=query.shape[2] * sp)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, H, S, D] -> [B, S, H, D]
    if not q.dtype == k.dtype == v.dtype:  # e.g. Bamba under autocast: rotary q, k in fp32, v in bf16
        device = q.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.promote_types(
            torch.promote_types(q.dtype, k.dtype), v.dtype)  # what the eager reference's matmuls compute in
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if d_qk != d_v:  # Note [Value heads of another width]
        width = max(d_qk, d_v)
        q, k, v = (F.pad(x, (0, width - x.shape[-1])) for x in (q, k, v))
    out = attention(q, k, v, **variant)  # (B, S_local, H_q, width)
    # [B, S, H, D_v], contiguous: some models .view() it (AFMoE, JetMoE); Ulysses returns a strided one
    return out[..., :d_v].contiguous(), None


# --------------------------------------------------------------------------------------------- applying it


def apply_hf_attention(model: nn.Module, *, max_seq_len: int | None = None) -> int:
    """Make a transformers ``PreTrainedModel`` run the package's attention (Note [Hugging Face models under the strategy]).

    Registers ``"seqpar"``, sets it with ``model.set_attn_implementation`` and gives every attention
    layer a child ``seqpar_attention = Attention(causal=True, scale=layer.scaling)`` (kept, with
    its mesh configuration, if already there). In place; returns the number of attention layers. Without a strategy the
    ``Attention`` children run local attention; the strategy's ``apply_attention`` configures them.
    Rotary embeddings whose frequencies read the sequence length get the hooks of Note
    [Length-dependent rotary embeddings] (``lightning_seqpar.hf.rope``); the recurrent mixers of
    hybrid models that the package makes exact are replaced by their sequence-parallel twins
    (``lightning_seqpar.hf.hybrid.apply_hf_hybrid``).

    Args:
        model: a transformers ``PreTrainedModel`` whose attention layers call ``AttentionInterface``.
        max_seq_len: the longest (global) sequence to be trained on. When given, layers whose
            sliding window or attention chunk is shorter raise here; in any case every forward
            checks them against the actual global length.

    Raises:
        ValueError: not a ``PreTrainedModel``, a token mixer other than attention
            (``lightning_seqpar.hf.support.refuse_token_mixers``; nothing is changed then), a
            model whose attention does not go through ``AttentionInterface``, no attention layer
            found, or a sliding window / attention chunk < ``max_seq_len``.
    """
    transformers = require_transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise ValueError(f"model must be a transformers.PreTrainedModel, got {type(model).__name__}")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1):
        raise ValueError(f"max_seq_len must be a positive int or None, got {max_seq_len!r}")
    refuse_token_mixers(model)  # Note [Exact or refused: position-dependent layers of Hugging Face models]
    refuse_unseen_position_features(model, max_seq_len=max_seq_len)  # what the support sweep found (Note [Silent mismatches the sweep found])
    register_attention()
    layers = [(name, m) for name, m in model.named_modules() if is_attention_layer(m)]
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    recurrent_only = not layers and any(type(m).__name__ in HYBRID_MIXERS or is_hybrid_twin(m) for m in model.modules())
    if model.config._attn_implementation != ATTN_IMPLEMENTATION or not (layers or recurrent_only):
        raise ValueError(
            f"{type(model).__name__} does not route its attention through transformers.AttentionInterface "
            f"(attn_implementation is {model.config._attn_implementation!r}, {len(layers)} attention layers found), "
            "so the sequence-parallel attention cannot be installed without patching it; supported: models whose "
            "attention layers call ALL_ATTENTION_FUNCTIONS.get_interface (Llama, Mistral, Qwen2/3, Gemma, ...)"
        )
    apply_hf_hybrid(model)  # Note [Hybrid models under the strategy]: the recurrent mixers' sequence-parallel twins
    for _, layer in layers:
        layer.seqpar_layer_type = layer_type_of(layer)  # read per call without the layer's index (Note [One graph for every layer])
        child = getattr(layer, "seqpar_attention", None)
        if isinstance(child, Attention):  # applied before: keep its mesh configuration, follow the layer's scale
            child.scale = float(layer.scaling)
        else:
            layer.seqpar_attention = Attention(causal=True, scale=float(layer.scaling))  # a registered child module
    install_global_length_rotary(model, [layer.seqpar_attention for _, layer in layers])  # Note [Length-dependent rotary embeddings]
    return len(layers)

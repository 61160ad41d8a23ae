"""The sizes of a decoder that the memory estimate and the step planner read (Note [Memory per token] in
``lightning_seqpar.planner.memory``, Note [Planning a step across nodes] in ``lightning_seqpar.planner.step_plan``).

:class:`TransformerShape` is what :func:`~lightning_seqpar.planner.memory.estimate_memory` takes, read from a Hugging Face
config or one of the package's (:meth:`TransformerShape.from_config`, which refuses by name the layers the estimate
does not model); :class:`ModelShape` is the same decoder as the step planner and ``seqpar plan`` name it, with its
FLOPs per token, and :data:`MODELS` the package's named shapes. No torch, no device: sizes only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from lightning_seqpar.models.fused import fused_kernels_on
from lightning_seqpar.models.registry import family_of

__all__ = ["MODELS", "QK_NORM_FIELDS", "QK_NORM_MODEL_TYPES", "ModelShape", "TransformerShape"]


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The sizes of a Llama-style decoder that the estimate needs (Note [Memory per token])."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    """SwiGLU (gate, up, down: Llama) or two matrices (GELU: GPT)."""
    qk_norm: bool = False
    """An RMSNorm of q and k inside the attention (Qwen3, OLMo2, Gemma3, ...): Note [Memory per token]."""
    fused_elementwise: bool = False
    """RMSNorm, RoPE and SwiGLU run as fused kernels that keep no fp32 copies (the package's Llama on a GPU with
    liger-kernel: Note [Fused element-wise kernels] in lightning_seqpar.models.fused; Note [Memory per token])."""
    compiled_transformers_layers: bool = False
    """A transformers model's decoder layers run compiled (``compile=True``): a Selective Checkpoint++ layer then keeps
    one more hidden state per token (Note [Memory per token])."""
    compiled_package_layers: bool = False
    """The package's own blocks run compiled (``compile=True``, or "auto" on a GPU): under the ring and all-gather a
    Selective Checkpoint++ layer whose checkpoint stays on the GPU then keeps one more hidden state per token too
    (Note [Memory per token])."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"TransformerShape.{f.name} must be a positive int, got {value!r}")

    @property
    def block_params(self) -> int:
        """Parameters of one block: attention projections, MLP, two norms."""
        d, D = self.hidden_size, self.head_dim
        attention = d * D * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = (3 if self.gated_mlp else 2) * d * self.intermediate_size
        return attention + mlp + 2 * d

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks: embeddings, output head (unless tied), final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2) + self.hidden_size

    @property
    def params(self) -> int:
        return self.num_layers * self.block_params + self.root_params

    @classmethod
    def from_config(cls, config: Any) -> TransformerShape:
        """The shape of a Hugging Face config (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``),
        a dict of those fields, or one of the package's Llama / GPT configs. Raises ``ValueError`` naming what is
        missing, and for a linear-attention (TransNormer) config, whose memory this module does not model."""
        family = family_of(config)
        if family is not None:
            if family.linear_attention:
                raise ValueError(f"{type(config).__name__} is a linear-attention model: its memory is not modelled "
                                 "(set offload_checkpoints / mlp_chunk_size / offload_params by hand)")
            return cls(hidden_size=config.n_embd, num_layers=config.n_layer, num_heads=config.n_head,
                       num_kv_heads=config.n_kv_head, head_dim=config.head_dim, intermediate_size=config.intermediate_size,
                       vocab_size=config.vocab_size, tied_embeddings=bool(config.tie_embeddings),
                       gated_mlp=family.name == "llama", fused_elementwise=family.name == "llama" and fused_kernels_on())
        transformers = sys.modules.get("transformers")
        if isinstance(config, Mapping):
            get = config.get
        elif transformers is not None and isinstance(config, transformers.PretrainedConfig):
            def get(key: str, default: Any = None) -> Any:
                try:
                    return getattr(config, key, default)
                except Exception:
                    return default
        else:
            raise ValueError(f"expected a Hugging Face config, a dict of its fields or a Llama / GPT config of the package, "
                             f"got {type(config).__name__}")
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
                   if not isinstance(get(k), int)]
        if missing:
            raise ValueError(f"the model config has no integer {missing}: its memory cannot be estimated")
        unmodelled = _unmodelled_layers(get)
        if unmodelled:
            raise ValueError(f"the model's {unmodelled}: the estimate models dense attention + MLP decoders only, so its "
                             "memory is not estimated (set offload_checkpoints / head_chunks / mlp_chunk_size / offload_params "
                             "by hand)")
        heads = get("num_attention_heads")
        head_dim = get("head_dim") if isinstance(get("head_dim"), int) else get("hidden_size") // heads
        kv = get("num_key_value_heads")
        return cls(hidden_size=get("hidden_size"), num_layers=get("num_hidden_layers"), num_heads=heads,
                   num_kv_heads=kv if isinstance(kv, int) and kv >= 1 else heads, head_dim=head_dim,
                   intermediate_size=get("intermediate_size"), vocab_size=get("vocab_size"),
                   tied_embeddings=bool(get("tie_word_embeddings", False)),
                   qk_norm=get("model_type") in QK_NORM_MODEL_TYPES or any(get(f) is True for f in QK_NORM_FIELDS),
                   fused_elementwise=fused_kernels_on() and get("model_type") in FUSED_MODEL_TYPES and get("hidden_act", "silu") == "silu")


QK_NORM_MODEL_TYPES = frozenset({
    "afmoe", "apertus", "chameleon", "dots1", "exaone4", "flex_olmo", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text",
    "gemma4", "gemma4_text", "glm4_moe", "minimax_m2", "olmo2", "olmo3", "olmoe", "qwen3", "qwen3_moe", "qwen3_next",
    "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_text", "doge", "lfm2"})
"""transformers model types whose attention normalises q and k (``self.q_norm`` / ``self.k_norm``): Note [Memory per token]."""
FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""transformers model types whose RMSNorms and SwiGLU MLPs run the fused kernels where they are on
(``lightning_seqpar.hf.fused``, Note [Fused kernels in transformers models]): ``TransformerShape.fused_elementwise``."""
QK_NORM_FIELDS = ("use_qk_norm", "qk_norm", "qk_layernorm")
"""Config switches that add the same q / k normalisation (Cohere, Llama 4, Persimmon / StableLM)."""


_DECODER_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp"})
_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
# fields of transformers configs that only hybrid / state-space / recurrent models have
_RECURRENT_FIELDS = ("mamba_d_state", "ssm_state_size", "state_size", "mamba_n_heads", "linear_num_value_heads", "conv_L_cache",
                     "block_types", "layers_block_type", "attn_layer_period", "attn_layer_indices", "hybrid_override_pattern",
                     "lru_width", "linear_attn_config")


def _unmodelled_layers(get: Callable[..., Any]) -> str | None:
    """What of a Hugging Face config the estimate does not model (experts, recurrent / convolution layers), or None."""
    for name in _EXPERT_FIELDS:
        if isinstance(get(name), int) and get(name) > 1:
            return f"mixture of experts (config.{name}={get(name)})"
    layer_types = get("layer_types")
    if isinstance(layer_types, (list, tuple)):
        other = sorted({t for t in layer_types if isinstance(t, str) and t not in _DECODER_LAYER_TYPES})
        if other:
            return f"layers of type {other} (config.layer_types)"
    for name in _RECURRENT_FIELDS:
        if get(name) is not None:
            return f"recurrent / state-space layers (config.{name})"
    return None


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a Llama-style decoder that the plan needs."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    """SwiGLU (gate, up, down) or two MLP matrices."""
    qk_norm: bool = False
    """q and k normalised inside the attention (Qwen3, OLMo2, Gemma 3): memory only (Note [Memory per token])."""

    @classmethod
    def from_transformer_shape(cls, name: str, shape: TransformerShape) -> ModelShape:
        """The same decoder as the memory estimate's :class:`~lightning_seqpar.planner.memory.TransformerShape`."""
        return cls(name=name, n_layer=shape.num_layers, d_model=shape.hidden_size, n_head=shape.num_heads,
                   n_kv_head=shape.num_kv_heads, head_dim=shape.head_dim, ffn=shape.intermediate_size, vocab=shape.vocab_size,
                   tied_embeddings=shape.tied_embeddings, gated_mlp=shape.gated_mlp, qk_norm=shape.qk_norm)

    @property
    def transformer_shape(self) -> TransformerShape:
        """This decoder as the memory estimate's :class:`~lightning_seqpar.planner.memory.TransformerShape`."""
        return TransformerShape(hidden_size=self.d_model, num_layers=self.n_layer, num_heads=self.n_head,
                                num_kv_heads=self.n_kv_head, head_dim=self.head_dim, intermediate_size=self.ffn,
                                vocab_size=self.vocab, tied_embeddings=self.tied_embeddings, gated_mlp=self.gated_mlp,
                                qk_norm=self.qk_norm)

    @property
    def matmul_params(self) -> int:
        """Weights used in matmuls per token (attention, MLP, output head)."""
        attn = self.d_model * self.head_dim * (2 * self.n_head + 2 * self.n_kv_head)
        return self.n_layer * (attn + (3 if self.gated_mlp else 2) * self.d_model * self.ffn) + self.vocab * self.d_model

    @property
    def params(self) -> int:
        return self.matmul_params + (0 if self.tied_embeddings else self.vocab * self.d_model)  # + the input embedding

    def flops_per_token(self, seq_len: int) -> float:
        return 6 * self.matmul_params + 6 * self.n_layer * seq_len * self.n_head * self.head_dim


MODELS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(name="llama3-8b", n_layer=32, d_model=4096, n_head=32, n_kv_head=8, head_dim=128, ffn=14336, vocab=128256),
    "llama-70b": ModelShape(name="llama-70b", n_layer=80, d_model=8192, n_head=64, n_kv_head=8, head_dim=128, ffn=28672, vocab=128256),
    "llama-33h": ModelShape(name="llama-33h", n_layer=32, d_model=4224, n_head=33, n_kv_head=33, head_dim=128, ffn=11008, vocab=32000),
    "llama-7b": ModelShape(name="llama-7b", n_layer=32, d_model=4096, n_head=32, n_kv_head=32, head_dim=128, ffn=11008, vocab=32000),
}
"""Llama-70B-shaped: 80 layers, d 8192, 64 query / 8 K/V heads, FFN 28672 (Llama 3 70B's sizes)."""

"""Llama: RMSNorm, rotary position embeddings (RoPE), SwiGLU MLP, pre-norm blocks.

Covers multi-head (MHA), grouped-query (GQA) and multi-query (MQA) attention and any head count
(the LightSeq variants Llama-33H, -16H, ..., -2H). The file imports nothing from
``torch.distributed``: every block calls one :class:`lightning_seqpar.attention.Attention`
module, which runs exact local attention until the strategy configures it for sequence
parallelism (``lightning_seqpar.parallel.parallelize.apply_attention``).

Shape legend:
    B: batch size                 S: sequence length (the local shard under sequence parallelism)
    d: model width (n_embd)       V: vocabulary size
    H: query heads (n_head)       H_kv: key/value heads (n_kv_head)
    D: head dimension (head_dim)  I: MLP width (intermediate_size)

Parameter names follow Hugging Face ``LlamaForCausalLM`` (``embed_tokens``, ``layers.N.self_attn.q_proj``,
``mlp.gate_proj``, ``norm``, ``lm_head``, ...) without the ``model.`` prefix, so converting a
checkpoint is a key rename.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch
from torch import nn

from lightning_seqpar.models import fused
from lightning_seqpar.checks import AT_LEAST_ONE, POSITIVE, Range, check_options, check_ranges, option_hints, option_values
from lightning_seqpar.models.common import CausalLM, global_positions

from lightning_seqpar.attention import Attention

__all__ = [
    "CONFIGS", "Llama", "LlamaAttention", "LlamaBlock", "LlamaConfig", "LlamaMLP", "RMSNorm", "apply_rope", "rope_freqs_cis",
]


@dataclass
class LlamaConfig:
    """Hyper-parameters of a :class:`Llama` model. ``LlamaConfig.from_name`` gives the named ones."""

    vocab_size: int = 32000
    """Number of token ids."""
    n_embd: int = 4096
    """Model width d (residual stream)."""
    n_layer: int = 32
    """Number of transformer blocks."""
    n_head: int = 32
    """Number of query heads H; need not divide anything (LightSeq's Llama-33H has 33)."""
    n_kv_head: int | None = None
    """Number of key/value heads H_kv: ``n_head`` (MHA, the default), a divisor of it (GQA) or 1 (MQA)."""
    head_dim: int | None = None
    """Head dimension D; defaults to ``n_embd // n_head``. May be set so that ``n_head * head_dim != n_embd``."""
    intermediate_size: int | None = None
    """SwiGLU MLP width I; defaults to Llama's rule: 2/3 * 4 * n_embd rounded up to a multiple of 256."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output head."""
    max_seq_len: int = 4096
    """Only a default for recipes and benchmarks: RoPE is computed from the position ids of each batch,
    so the model runs at any sequence length and holds no length-dependent buffer."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of embeddings and linear layers."""
    scale_residual_init: bool = True
    """Divide the init std of the residual output projections (``o_proj``, ``down_proj``) by
    sqrt(2 * n_layer) (GPT-2 / nanoGPT), so the residual stream keeps its scale at any depth."""

    option_ranges: ClassVar[dict[str, Range]] = {
        **{k: AT_LEAST_ONE for k in ("vocab_size", "n_embd", "n_layer", "n_head", "n_kv_head", "head_dim", "intermediate_size",
                                      "max_seq_len")},
        "rope_theta": POSITIVE, "norm_eps": POSITIVE, "init_std": POSITIVE,
    }
    """The numbers each field allows (Note [Checking options by their types] in ``lightning_seqpar.checks``)."""

    def __post_init__(self) -> None:
        check_options(option_values(self), option_hints(type(self)), owner="LlamaConfig")  # types and finite numbers first
        for name in ("vocab_size", "n_embd", "n_layer", "n_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(
                f"LlamaConfig.n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}): "
                f"use n_kv_head=n_head for MHA, a divisor of n_head for GQA, or 1 for MQA"
            )
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(
                    f"LlamaConfig.n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head}); "
                    f"set head_dim explicitly (e.g. head_dim=128 with n_head=33 for 33 * 128 = 4224)"
                )
            self.head_dim = self.n_embd // self.n_head
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be even and >= 2 for RoPE, got {self.head_dim}")
        if self.intermediate_size is None:
            self.intermediate_size = 256 * math.ceil(int(2 * 4 * self.n_embd / 3) / 256)
        if self.intermediate_size < 1:
            raise ValueError(f"LlamaConfig.intermediate_size must be >= 1, got {self.intermediate_size}")
        if self.rope_theta <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError(
                f"LlamaConfig.rope_theta ({self.rope_theta}), norm_eps ({self.norm_eps}) and init_std "
                f"({self.init_std}) must be > 0"
            )
        if self.max_seq_len < 1:
            raise ValueError(f"LlamaConfig.max_seq_len must be >= 1, got {self.max_seq_len}")
        check_ranges(option_values(self), self.option_ranges, owner="LlamaConfig")

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> LlamaConfig:
        """The named configuration ``name`` (see :data:`CONFIGS`), with fields replaced by ``overrides``."""
        if name not in CONFIGS:
            raise ValueError(f"unknown Llama config name={name!r}; expected one of {sorted(CONFIGS)}")
        return cls(**{**CONFIGS[name], **overrides})

    @property
    def attn_dim(self) -> int:
        """Width of the concatenated query heads, H * D (equals n_embd unless head_dim was set)."""
        return self.n_head * self.head_dim

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Parameter count from the shapes (no model is built).

        ``non_embedding=True`` leaves out the input embedding table (a lookup that costs no FLOPs),
        as nanoGPT and torchtitan do. An untied output head is counted; a tied one is the
        embedding table and is left out with it.
        """
        d, D = self.n_embd, self.head_dim
        attn = d * self.n_head * D + 2 * d * self.n_kv_head * D + self.n_head * D * d  # q, k, v, o
        mlp = 3 * d * self.intermediate_size  # gate, up, down
        blocks = self.n_layer * (attn + mlp + 2 * d)  # + two RMSNorm weights
        head = 0 if self.tie_embeddings else self.vocab_size * d
        total = self.vocab_size * d + blocks + d + head  # embedding, blocks, final norm, head
        return total - self.vocab_size * d if non_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at sequence length ``seq_len``, for MFU.

        Note [FLOPs per token]
        ~~~~~~~~~~~~~~~~~~~~~~
            flops_per_token = 6 * N_non_embedding + 6 * n_layer * seq_len * (n_head * head_dim)

        * 6 * N: every weight does one multiply-add (2 FLOPs) per token in the forward pass and two
          in the backward pass (grad of input, grad of weight). N counts the weights used in
          matmuls: ``num_params(non_embedding=True)``, plus the output head when it is tied to the
          embedding (it is still a V x d matmul). For untied models this is exactly 6 * N_non_embedding.
        * 6 * L * S * d: per layer and token, QK^T and PV cost 2 * 2 * S * d FLOPs forward, times 3
          for forward + backward = 12 * S * d; the causal mask halves it (PaLM, Appendix B, with
          the causal discount). d is the attention width H * D, which is n_embd for every named
          config. GQA does not change it (scores are computed per query head).
        Recomputation by activation checkpointing is not counted (model FLOPs, not hardware FLOPs).
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        n = self.num_params(non_embedding=True) + (self.vocab_size * self.n_embd if self.tie_embeddings else 0)
        return 6 * n + 6 * self.n_layer * seq_len * self.attn_dim


# Note [Named configurations]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# llama-7b / llama-7b-gqa / llama-33h / llama-16h ... llama-2h are the models of LightSeq §4
# ("Model setup"): Llama-7B, the same with 8 KV heads, and variants with a different head count
# that keep head_dim = 128 and the FFN width 11008.
# * llama-33h: "same as Llama-7B but with 33 heads", so 33 * 128 = 4224 wide and 32 layers like
#   Llama-7B (7.02B parameters, vs 6.74B).
# * llama-{16,8,4,2}h: width = 128 * H. Following Liu et al. (2021), as LightSeq does, the layer
#   count scales so that the total number of heads stays that of Llama-7B:
#       n_layer * n_head = 32 * 32 = 1024   ->   16H: 64 layers, 8H: 128, 4H: 256, 2H: 512.
#   16H with 64 layers is LightSeq's own example. With the FFN fixed at 11008 the parameter count
#   then shrinks slowly (16H 5.54B, 8H 4.93B, 4H 4.64B, 2H 4.47B): "comparable" sizes, not
#   equal ones. We keep the paper's rule rather than fitting n_layer to 6.7B so that the models
#   are the ones the paper measured.
_LLAMA_7B = dict(vocab_size=32000, n_embd=4096, n_layer=32, n_head=32, intermediate_size=11008, max_seq_len=4096)
_TINY = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, intermediate_size=128, max_seq_len=256)
_LIGHTSEQ_FEW_HEADS = {
    f"llama-{h}h": dict(_LLAMA_7B, n_embd=128 * h, n_head=h, n_layer=1024 // h) for h in (16, 8, 4, 2)
}
CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    name: MappingProxyType(fields) for name, fields in {
        "llama-7b": _LLAMA_7B,
        "llama-7b-gqa": dict(_LLAMA_7B, n_kv_head=8),
        "llama-33h": dict(_LLAMA_7B, n_embd=33 * 128, n_head=33),
        **_LIGHTSEQ_FEW_HEADS,
        "llama3-8b": dict(
            vocab_size=128256, n_embd=4096, n_layer=32, n_head=32, n_kv_head=8, intermediate_size=14336,
            rope_theta=500000.0, max_seq_len=8192,
        ),
        # Tiny models for CPU tests: GQA (tiny), MHA, MQA, and an odd head count like Llama-33H.
        "tiny": dict(_TINY, n_kv_head=2),
        "tiny-mha": dict(_TINY, n_kv_head=4),
        "tiny-mqa": dict(_TINY, n_kv_head=1),
        "tiny-3h": dict(_TINY, n_embd=48, n_head=3, n_kv_head=3),
    }.items()
})
"""Named configurations for :meth:`LlamaConfig.from_name` (read-only)."""


def rope_freqs_cis(position_ids: torch.Tensor, *, head_dim: int, theta: float) -> torch.Tensor:
    """Rotations e^(i * pos * theta^(-2j/D)) as complex64 (B, S, 1, D/2), from GLOBAL ``position_ids`` (B, S).

    Computed in fp32 from the positions of the batch, never from ``arange`` of the local length:
    under sequence parallelism a rank holds tokens from anywhere in the sequence.

    Note [RoPE as a complex tensor]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The rotations are computed once per forward and handed to every block as one complex tensor
    (as Meta's Llama and torchtitan do): FSDP2's ``MixedPrecisionPolicy`` casts floating-point
    block inputs to the parameter dtype, which would leave bf16 cos/sin; complex inputs are not
    cast. Blocks read ``.real`` (cos) and ``.imag`` (sin), views of the one shared tensor, so the
    autograd graph keeps one copy for all layers.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=position_ids.device, dtype=torch.float32) / head_dim)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # (B, S, D/2)
    return torch.complex(angles.cos(), angles.sin())[:, :, None, :]  # (B, S, 1, D/2)


def apply_rope(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, S, H, D) by :func:`rope_freqs_cis`, in fp32, in HF Llama's rotate-half convention:

        x * cat(cos, cos) + rotate_half(x) * cat(sin, sin),   rotate_half(x) = cat(-x2, x1)

    The torch ops; the model rotates q and k together through ``fused.rope`` (Note [Fused element-wise kernels]).
    """
    return fused.rope_torch(x, freqs_cis)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale; normalises in fp32."""

    def __init__(self, dim: int, *, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)  # Note [Fused element-wise kernels]

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class LlamaAttention(nn.Module):
    """Projections and RoPE around one :class:`~lightning_seqpar.attention.Attention` core.

    Note [GQA without repeating K/V]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    K and V keep their H_kv heads all the way into ``attn_core``; query head h reads K/V head
    h // (H / H_kv) (HF's ``repeat_kv`` order). Distributed cores send H_kv heads over the wire,
    H / H_kv times less than a repeated copy (LightSeq §4.1, GQA).
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.q_proj = nn.Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.n_embd, config.n_kv_head * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=False)
        self.attn_core = Attention(causal=True)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_head, self.head_dim)  # (B, S, H, D)
        k = self.k_proj(x).view(B, S, self.n_kv_head, self.head_dim)  # (B, S, H_kv, D)
        v = self.v_proj(x).view(B, S, self.n_kv_head, self.head_dim)  # (B, S, H_kv, D)
        q, k = fused.rope(q, k, freqs_cis)  # Note [Fused element-wise kernels]
        y = self.attn_core(q, k, v)  # (B, S, H, D)
        return self.o_proj(y.reshape(B, S, self.n_head * self.head_dim))  # (B, S, d)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_mul(self.gate_proj(x), self.up_proj(x)))  # (B, S, I) -> (B, S, d)


class LlamaBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)). The unit of FSDP and checkpointing."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), freqs_cis)  # (B, S, d)
        return x + self.mlp(self.post_attention_layernorm(x))  # (B, S, d)


class Llama(CausalLM):
    """Llama causal language model: ``forward(input_ids, position_ids) -> logits`` (B, S, V).

    Blocks live in ``self.layers`` (an ``nn.ModuleList`` of :class:`LlamaBlock`) so the strategy
    can wrap each one (FSDP2, activation checkpointing, compile). ``forward_hidden`` and
    ``lm_head`` let a chunked loss avoid the full (B, S, V) logits.
    """

    cudnn_attention_exact = True
    """RoPE over the whole head: cuDNN's attention backward is exact for it (Note [Choosing the local kernel])."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding table when ``config.tie_embeddings`` (again after ``to_empty``)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise every parameter: normal(0, init_std), residual projections scaled, norms at 1.

        Also the way to initialise a model built on the meta device after ``to_empty``.
        """
        self.tie_weights()
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layer) if self.config.scale_residual_init else std
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=std)
        # By module type and name, so wrappers (checkpointing, compile, FSDP2) do not get in the way.
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Linear) and not (module is self.lm_head and self.config.tie_embeddings):
                residual = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if residual else std)

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Number of parameters of this instance (shared tensors counted once); see ``LlamaConfig.num_params``."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        return n - self.embed_tokens.weight.numel() if non_embedding else n

    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final normed hidden states (B, S, d); ``position_ids`` (B, S) are global, ``arange(S)`` when None."""
        position_ids = global_positions(input_ids, position_ids)  # (B, S)
        freqs_cis = rope_freqs_cis(position_ids, head_dim=self.config.head_dim, theta=self.config.rope_theta)
        x = self.embed_tokens(input_ids)  # (B, S, d)
        for block in self.layers:
            x = block(x, freqs_cis)  # (B, S, d)
        return self.norm(x)  # (B, S, d)


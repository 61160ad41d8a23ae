"""TransNormerLLM (TNL): the linear-attention language model that LASP trains (LASP: Sun et al.,
arXiv:2404.02882, §4).

Pre-norm blocks ``x + token_mixer(norm(x))`` then ``x + channel_mixer(norm(x))``:

* token mixer (gated linear attention, "NormLinearAttention" in TNL's code): one projection to
  q, k, v, u; silu on q and k; LRPE on layer 0; causal linear attention with a per-head decay,
  no 1/sqrt(d) scale and no denominator; ``out_proj(u * SimpleRMSNorm(attn))``;
* channel mixer (SGLU): ``l3(l1(x) * l2(x))``, no activation;
* every norm is SimpleRMSNorm: RMS normalisation without a learned weight.

The file imports nothing from ``torch.distributed``: every block calls one
:class:`lightning_seqpar.attention.lasp.LinearAttention`, which runs local chunked linear
attention until the strategy configures it for LASP.

Shape legend:
    B: batch size                 S: sequence length (the local shard under sequence parallelism)
    d: model width (n_embd)       V: vocabulary size
    H: heads (n_head)             D: head dimension (n_embd // n_head)
    Dk: key/query head dimension (2D with LRPE, else D)
    G: channel-mixer width (glu_dim)

Parameter names follow TNL's Hugging Face code (``embed_tokens``, ``layers.N.token_mixer.qkvu_proj``,
``...token_mixer.out_proj``, ``...token_mixer.lrpe.theta``, ``layers.N.channel_mixer.l1/l2/l3``,
``lm_head``) without the ``model.`` prefix; only ``lrpe.theta`` changes shape, (H, 1, D) -> (H * D,).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from lightning_seqpar.checks import AT_LEAST_ONE, POSITIVE, Range, check_options, check_ranges, option_hints, option_values
from lightning_seqpar.models.common import CausalLM, global_positions

from lightning_seqpar.attention.lasp import LinearAttention

__all__ = [
    "CONFIGS", "LRPE", "SGLU", "SimpleRMSNorm", "TransNormer", "TransNormerBlock", "TransNormerConfig", "TransNormerTokenMixer",
    "alibi_slopes", "tnl_decay_log",
]


@dataclass(kw_only=True)
class TransNormerConfig:
    """Hyper-parameters of a :class:`TransNormer` model. ``TransNormerConfig.from_name`` gives the named ones."""

    vocab_size: int = 64000
    """Number of token ids (TNL's tokenizer: 64000)."""
    n_embd: int = 1024
    """Model width d; also the attention width (TNL's ``hidden_dim`` = ``decoder_embed_dim``)."""
    n_layer: int = 24
    """Number of blocks L; the decay of layer l is scaled by (1 - l / (L - 1) + 1e-5)."""
    n_head: int = 8
    """Heads H; head dimension D = n_embd // n_head. Decay slopes follow ALiBi's rule for any H."""
    glu_dim: int = 2816
    """Channel-mixer (SGLU) width G."""
    lrpe: bool = True
    """LRPE (linearized relative positional encoding) on the first layer (TNL's released models)."""
    lrpe_base: float = 10000.0
    """Initial LRPE frequencies base^(-2 i / (H * D)), i = 0 .. H * D - 1 (learned afterwards)."""
    scale_embedding: bool = True
    """Multiply token embeddings by sqrt(n_embd) (TNL's code default ``no_scale_embedding=False``)."""
    norm_eps: float = 1e-6
    """Epsilon of every SimpleRMSNorm."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output head. Assumed False; TNL's
    Hugging Face class ties them unless its config says ``tie_word_embeddings: false``."""
    chunk_size: int = 64
    """Chunk length of the torch linear-attention kernel (speed and memory only, not results)."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of embeddings and linear layers (TNL)."""
    max_seq_len: int = 8192
    """Only a default for recipes and benchmarks: nothing in the model depends on the length."""

    option_ranges: ClassVar[dict[str, Range]] = {
        **{k: AT_LEAST_ONE for k in ("vocab_size", "n_embd", "n_layer", "n_head", "glu_dim", "chunk_size", "max_seq_len")},
        "lrpe_base": POSITIVE, "norm_eps": POSITIVE, "init_std": POSITIVE,
    }
    """The numbers each field allows (Note [Checking options by their types] in ``lightning_seqpar.checks``)."""

    def __post_init__(self) -> None:
        check_options(option_values(self), option_hints(type(self)), owner="TransNormerConfig")  # types and finite numbers first
        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "glu_dim", "chunk_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TransNormerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"TransNormerConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.lrpe_base <= 0 or self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError(
                f"TransNormerConfig.lrpe_base ({self.lrpe_base}), norm_eps ({self.norm_eps}) and init_std ({self.init_std}) must be > 0"
            )
        check_ranges(option_values(self), self.option_ranges, owner="TransNormerConfig")

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> TransNormerConfig:
        """The named configuration ``name`` (see :data:`CONFIGS`), with fields replaced by ``overrides``."""
        if name not in CONFIGS:
            raise ValueError(f"unknown TransNormer config name={name!r}; expected one of {sorted(CONFIGS)}")
        return cls(**{**CONFIGS[name], **overrides})

    @property
    def head_dim(self) -> int:
        """Head dimension D = n_embd // n_head."""
        return self.n_embd // self.n_head

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Parameter count from the shapes (no model is built); as ``LlamaConfig.num_params``."""
        d = self.n_embd
        mixer = 4 * d * d + d * d  # qkvu_proj, out_proj
        glu = 3 * d * self.glu_dim  # l1, l2, l3
        blocks = self.n_layer * (mixer + glu) + (d if self.lrpe else 0)  # + LRPE theta (H * D) on layer 0
        head = 0 if self.tie_embeddings else self.vocab_size * d
        total = self.vocab_size * d + blocks + head  # no norm has a weight
        return total - self.vocab_size * d if non_embedding else total

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward), for MFU.

        Note [FLOPs of linear attention]
        ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
            flops_per_token = 6 * N_matmul + 12 * sum_layers H * Dk_l * D

        * 6 * N: as ``LlamaConfig.flops_per_token`` (N = non-embedding weights, plus a tied head).
        * linear attention, counted in its recurrent (right-product) form: per token and head,
          o = S^T q and S += k v^T cost 2 * Dk * D FLOPs each forward, times 3 for forward +
          backward. Dk = 2D on the LRPE layer. Independent of ``seq_len``: that is the point of
          linear attention (LASP §2.1). The chunked kernel's intra-chunk products (about c / d
          times more for chunk c) are implementation work, not model FLOPs, and are not counted.
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        n = self.num_params(non_embedding=True) + (self.vocab_size * self.n_embd if self.tie_embeddings else 0)
        n -= self.n_embd if self.lrpe else 0  # LRPE theta: elementwise, not a matmul weight
        D = self.head_dim
        attn = sum(self.n_head * (2 * D if (self.lrpe and layer == 0) else D) * D for layer in range(self.n_layer))
        return 6 * n + 12 * attn


# Note [Named configurations]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# * tnl-385m, tnl-1b: width, layers, heads, GLU width and vocabulary are those of TNL's public
#   code and configs (TransNormerLLM, Qin et al., arXiv:2307.14995); LASP §4 trains TNL-1B (Table 4, Fig. 3-4)
#   and a 0.4B TNL (Table 2).
# * tnl-7b: n_embd 4096, 30 layers, 32 heads are the 7B row of the TransNormerLLM paper's model
#   table (Qin et al., arXiv:2307.14995; not one of the papers in docs/references.md: check
#   against the released config).
#   glu_dim = 11008 is ASSUMED (Llama-7B's FFN width): 7.1B parameters with the untied head,
#   6.8B without the embedding.
# * Every named model: LRPE on layer 0, embeddings scaled by sqrt(d), untied head (assumed, see
#   ``tie_embeddings``), SimpleRMSNorm eps 1e-6, init std 0.02.
# * tnl-tiny, tnl-tiny-6h: CPU test models; tiny-6h has a head count that is not a power of two
#   (ALiBi's interleaved slopes) and three layers (three different decay scalings).
_TNL = dict(vocab_size=64000, max_seq_len=8192)
CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    name: MappingProxyType(fields) for name, fields in {
        "tnl-385m": dict(_TNL, n_embd=1024, n_layer=24, n_head=8, glu_dim=2816),
        "tnl-1b": dict(_TNL, n_embd=2048, n_layer=16, n_head=16, glu_dim=5632),
        "tnl-7b": dict(_TNL, n_embd=4096, n_layer=30, n_head=32, glu_dim=11008),
        "tnl-tiny": dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, glu_dim=128, max_seq_len=256),
        "tnl-tiny-6h": dict(vocab_size=256, n_embd=48, n_layer=3, n_head=6, glu_dim=96, max_seq_len=256),
    }.items()
})
"""Named configurations for :meth:`TransNormerConfig.from_name` (read-only)."""


def alibi_slopes(n_head: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """ALiBi slopes s_h (fp32, [H]) as TNL builds them: 2^(-8 (h+1) / H) when H is a power of two;
    otherwise those of the largest power of two c < H, then every other slope of 2c."""
    c = 2 ** math.floor(math.log2(n_head))
    h = torch.arange(c, device=device, dtype=torch.float32)
    slopes = torch.exp2(-8.0 * (h + 1) / c)
    if c == n_head:
        return slopes
    j = torch.arange(n_head - c, device=device, dtype=torch.float32)
    return torch.cat([slopes, torch.exp2(-8.0 * (2 * j + 1) / (2 * c))])


def tnl_decay_log(n_head: int, layer: int, n_layer: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """Log decay of each head of block ``layer`` (fp32, [H], < 0): -s_h * (1 - l / (L - 1) + 1e-5).

    Computed on ``device`` from the config at every call (no buffer: nothing to cast to bf16 or
    to re-initialise after ``to_empty``); a one-layer model uses the factor 1 + 1e-5.
    """
    ratio = layer / (n_layer - 1) if n_layer > 1 else 0.0
    return -alibi_slopes(n_head, device=device) * (1.0 - ratio + 1e-5)


class SimpleRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) over the last dim, in fp32; no weight (TNL)."""

    def __init__(self, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class LRPE(nn.Module):
    """Linearized relative positional encoding (TNL's ``Lrpe``): x -> [x cos(theta p), x sin(theta p)].

    With learned frequencies theta (H * D of them, head h using theta[h D : (h+1) D]),
    q_t . k_s of the encoded vectors is sum_i q_ti k_si cos(theta_i (t - s)): relative, and still
    a dot product, so linear attention applies. ``p`` is the GLOBAL position (``position_ids``),
    so the encoding is exact under sequence parallelism. Doubles the head dimension:
    (B, S, H, D) -> (B, S, H, 2D). theta is stored flat, (H * D,) — TNL's (H, 1, D) reshaped —
    so that, like norm weights and biases, it falls outside weight decay (``ndim < 2``).
    """

    def __init__(self, n_head: int, head_dim: int, *, base: float = 10000.0) -> None:
        super().__init__()
        self.n_head, self.head_dim, self.base = n_head, head_dim, base
        self.theta = nn.Parameter(torch.empty(n_head * head_dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        d = self.theta.numel()
        self.theta.copy_(self.base ** (-2.0 / d * torch.arange(d, dtype=torch.float32, device=self.theta.device)))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        theta = self.theta.float().view(self.n_head, self.head_dim)  # (H, D)
        angles = position_ids.to(torch.float32)[:, :, None, None] * theta  # (B, S, H, D), fp32
        xf = x.float()
        return torch.cat([xf * angles.cos(), xf * angles.sin()], dim=-1).to(x.dtype)  # (B, S, H, 2D)


class TransNormerTokenMixer(nn.Module):
    """Gated linear attention: ``out_proj(u * SimpleRMSNorm(LinearAttention(silu(q), silu(k), v)))``."""

    def __init__(self, config: TransNormerConfig, layer: int) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.layer, self.n_layer = layer, config.n_layer
        self.qkvu_proj = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.out_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.lrpe = LRPE(config.n_head, config.head_dim, base=config.lrpe_base) if (config.lrpe and layer == 0) else None
        self.norm = SimpleRMSNorm(eps=config.norm_eps)
        self.attn_core = LinearAttention(chunk_size=config.chunk_size)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v, u = self.qkvu_proj(x).chunk(4, dim=-1)  # 4 x (B, S, d)
        q = F.silu(q).view(B, S, self.n_head, self.head_dim)  # (B, S, H, D)
        k = F.silu(k).view(B, S, self.n_head, self.head_dim)  # (B, S, H, D)
        v = v.view(B, S, self.n_head, self.head_dim)  # (B, S, H, D)
        if self.lrpe is not None:
            q, k = self.lrpe(q, position_ids), self.lrpe(k, position_ids)  # (B, S, H, 2D)
        decay_log = tnl_decay_log(self.n_head, self.layer, self.n_layer, device=x.device)  # (H,)
        y = self.attn_core(q, k, v, decay_log)  # (B, S, H, D)
        y = self.norm(y.reshape(B, S, self.n_head * self.head_dim))  # (B, S, d)
        return self.out_proj(u * y)  # (B, S, d)


class SGLU(nn.Module):
    """TNL's simple GLU channel mixer: l3(l1(x) * l2(x)), no activation."""

    def __init__(self, config: TransNormerConfig) -> None:
        super().__init__()
        self.l1 = nn.Linear(config.n_embd, config.glu_dim, bias=False)
        self.l2 = nn.Linear(config.n_embd, config.glu_dim, bias=False)
        self.l3 = nn.Linear(config.glu_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.l1(x) * self.l2(x))  # (B, S, G) -> (B, S, d)


class TransNormerBlock(nn.Module):
    """Pre-norm block: x + token_mixer(norm(x)), then x + channel_mixer(norm(x)). The unit of FSDP and checkpointing."""

    def __init__(self, config: TransNormerConfig, layer: int) -> None:
        super().__init__()
        self.token_norm = SimpleRMSNorm(eps=config.norm_eps)
        self.token_mixer = TransNormerTokenMixer(config, layer)
        self.channel_norm = SimpleRMSNorm(eps=config.norm_eps)
        self.channel_mixer = SGLU(config)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mixer(self.token_norm(x), position_ids)  # (B, S, d)
        return x + self.channel_mixer(self.channel_norm(x))  # (B, S, d)


class TransNormer(CausalLM):
    """TransNormerLLM causal language model: ``forward(input_ids, position_ids) -> logits`` (B, S, V).

    Blocks live in ``self.layers`` (an ``nn.ModuleList`` of :class:`TransNormerBlock`) so the
    strategy can wrap each one; ``lm_head`` and ``output="hidden"`` serve a chunked loss.
    """

    def __init__(self, config: TransNormerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(TransNormerBlock(config, layer) for layer in range(config.n_layer))
        self.final_norm = SimpleRMSNorm(eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the embedding table when ``config.tie_embeddings`` (again after ``to_empty``)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise every parameter as TNL does: normal(0, init_std) for the embedding and
        every linear layer, LRPE frequencies at base^(-2i/(H D)). Also the way to initialise a model
        built on the meta device after ``to_empty``."""
        self.tie_weights()
        std = self.config.init_std
        nn.init.normal_(self.embed_tokens.weight, mean=0.0, std=std)
        for module in self.modules():  # by type, so wrappers (checkpointing, compile, FSDP2) do not get in the way
            if isinstance(module, LRPE):
                module.reset_parameters()
            elif isinstance(module, nn.Linear) and not (module is self.lm_head and self.config.tie_embeddings):
                nn.init.normal_(module.weight, mean=0.0, std=std)

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Number of parameters of this instance (shared tensors counted once)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed_tokens.weight.numel() if non_embedding else n

    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final normed hidden states (B, S, d); ``position_ids`` (B, S) are global, ``arange(S)`` when None."""
        position_ids = global_positions(input_ids, position_ids)  # (B, S)
        x = self.embed_tokens(input_ids)  # (B, S, d)
        if self.config.scale_embedding:
            x = x * math.sqrt(self.config.n_embd)
        for block in self.layers:
            x = block(x, position_ids)  # (B, S, d)
        return self.final_norm(x)  # (B, S, d)


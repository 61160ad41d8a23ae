"""GPT: the decoder-only model of the LSS Transformer experiments (Wang et al., arXiv:2311.02382,
§5).

Learned absolute position embeddings, pre-norm blocks with LayerNorm, causal multi-head
attention, a GELU MLP 4x wide, dropout, optionally tied input/output embeddings (GPT-2, nanoGPT).

The file imports nothing from ``torch.distributed``. Each block's attention is one
:class:`lightning_seqpar.attention.fused.FusedKVAttention`: local attention until the strategy
configures its inner :class:`~lightning_seqpar.attention.Attention` (``apply_attention``); then
the strategy's algorithm, or LSS's fused all-gather of the layer input (``GPTConfig.kv_comm``,
Note [Fused communication] in ``lightning_seqpar/attention/fused.py``).

Shape legend:
    B: batch size                 S: sequence length (the local shard under sequence parallelism)
    d: model width (n_embd)       V: vocabulary size (256 bytes for enwik8)
    H: query heads (n_head)       H_kv: key/value heads (n_kv_head; = H for GPT)
    D: head dimension (head_dim)  I: MLP width (intermediate_size, 4d)
    P: position-table rows (max_seq_len)

Parameter names follow nanoGPT (``wte``, ``wpe``, ``ln_1``, ``mlp.c_fc``, ``mlp.c_proj``, ``ln_f``,
``lm_head``), with the blocks in ``layers`` (the strategy's block container) and the attention
projections split as ``attn.q_proj`` / ``attn.kv_proj`` / ``attn.o_proj`` (the fused path projects
Q from the local x and K, V from the gathered x).
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

from lightning_seqpar.attention.fused import KV_COMMS, FusedKVAttention, KVComm

__all__ = ["CONFIGS", "GPT", "GPTAttention", "GPTBlock", "GPTConfig", "GPTMLP"]


@dataclass(kw_only=True)
class GPTConfig:
    """Hyper-parameters of a :class:`GPT` model. ``GPTConfig.from_name`` gives the named ones."""

    vocab_size: int = 256
    """Number of token ids; 256 for byte-level (character) text such as enwik8."""
    n_embd: int = 512
    """Model width d."""
    n_layer: int = 6
    """Number of transformer blocks."""
    n_head: int = 8
    """Number of query heads H."""
    n_kv_head: int | None = None
    """Key/value heads H_kv: ``n_head`` (multi-head attention, GPT's; the default) or a divisor of it."""
    head_dim: int | None = None
    """Head dimension D; defaults to ``n_embd // n_head``."""
    intermediate_size: int | None = None
    """MLP width I; defaults to ``4 * n_embd``."""
    max_seq_len: int = 1024
    """Rows P of the learned position table: positions 0 .. P-1, the longest trainable sequence
    (global length: under sequence parallelism a rank looks up the rows of its global positions)."""
    dropout: float = 0.0
    """Dropout after the embeddings, after the attention output projection and after the MLP (nanoGPT's
    places; the distributed attention kernels have no attention-probability dropout). 0 by default:
    with dropout the masks of a sharded run differ from one device's, so parity tests need 0."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms (GPT-2)."""
    norm_eps: float = 1e-5
    """Epsilon of every LayerNorm."""
    tie_embeddings: bool = True
    """Share one matrix between the token embedding and the output head (GPT-2)."""
    kv_comm: KVComm = "auto"
    """How K/V of the whole sequence reach every sequence-parallel rank: "kv" (the strategy's
    algorithm on the local K, V), "input" (LSS's fused all-gather of the layer input, then local
    K/V projection), "auto" ("input" under ``attention="allgather"`` when it moves fewer bytes:
    d < 2 * H_kv * D, always for multi-head attention). See Note [Fused communication]."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of embeddings and linear layers."""
    scale_residual_init: bool = True
    """Divide the init std of the residual output projections (``o_proj``, ``c_proj``) by sqrt(2 * n_layer) (GPT-2)."""

    option_ranges: ClassVar[dict[str, Range]] = {
        **{k: AT_LEAST_ONE for k in ("vocab_size", "n_embd", "n_layer", "n_head", "n_kv_head", "head_dim", "intermediate_size",
                                      "max_seq_len")},
        "dropout": Range(low=0, high=1, high_open=True), "norm_eps": POSITIVE, "init_std": POSITIVE,
    }
    """The numbers each field allows (Note [Checking options by their types] in ``lightning_seqpar.checks``)."""

    def __post_init__(self) -> None:
        check_options(option_values(self), option_hints(type(self)), owner="GPTConfig")  # types and finite numbers first
        for name in ("vocab_size", "n_embd", "n_layer", "n_head", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig.n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head}); set head_dim")
            self.head_dim = self.n_embd // self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        if self.head_dim < 1 or self.intermediate_size < 1:
            raise ValueError(
                f"GPTConfig.head_dim ({self.head_dim}) and intermediate_size ({self.intermediate_size}) must be >= 1"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.norm_eps <= 0 or self.init_std <= 0:
            raise ValueError(f"GPTConfig.norm_eps ({self.norm_eps}) and init_std ({self.init_std}) must be > 0")
        if self.kv_comm not in KV_COMMS:
            raise ValueError(f"GPTConfig.kv_comm={self.kv_comm!r} is not supported; expected one of {KV_COMMS}")
        check_ranges(option_values(self), self.option_ranges, owner="GPTConfig")

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        """The named configuration ``name`` (see :data:`CONFIGS`), with fields replaced by ``overrides``."""
        if name not in CONFIGS:
            raise ValueError(f"unknown GPT config name={name!r}; expected one of {sorted(CONFIGS)}")
        return cls(**{**CONFIGS[name], **overrides})

    @property
    def attn_dim(self) -> int:
        """Width of the concatenated query heads, H * D (equals n_embd unless head_dim was set)."""
        return self.n_head * self.head_dim  # type: ignore[operator]

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Parameter count from the shapes (no model is built).

        ``non_embedding=True`` leaves out both lookup tables, tokens (V x d) and positions (P x d),
        as nanoGPT does; a tied output head goes with the token table, an untied one is counted.
        """
        d, D, I, b = self.n_embd, self.head_dim, self.intermediate_size, int(self.bias)
        kv = 2 * self.n_kv_head * D  # type: ignore[operator]
        attn = d * self.attn_dim + d * kv + self.attn_dim * d + b * (self.attn_dim + kv + d)  # q, kv, o
        mlp = 2 * d * I + b * (I + d)  # type: ignore[operator]
        norm = (1 + b) * d
        blocks = self.n_layer * (attn + mlp + 2 * norm)
        head = 0 if self.tie_embeddings else self.vocab_size * d
        tables = self.vocab_size * d + self.max_seq_len * d
        return blocks + norm + head + (0 if non_embedding else tables)

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token (forward + backward) at sequence length ``seq_len``:
        ``6 * N + 6 * n_layer * seq_len * H * D`` as ``LlamaConfig.flops_per_token`` (Note [FLOPs
        per token] in ``llama.py``), N = ``num_params(non_embedding=True)`` plus a tied head.

        The fused all-gather (``kv_comm="input"``) projects K and V of the whole sequence on each
        of the W ranks: W - 1 extra copies of the K/V projection FLOPs that are not counted here
        (model FLOPs, not hardware FLOPs).
        """
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        n = self.num_params(non_embedding=True) + (self.vocab_size * self.n_embd if self.tie_embeddings else 0)
        return 6 * n + 6 * self.n_layer * seq_len * self.attn_dim


# Note [Named configurations]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# lss-gpt-small is the model of §5.2: "a decoder-only transformer (GPT) with a 512 embedding size,
# 6 attention layers and 8 multi-heads for a total of 20 million parameters", on enwik8 (bytes,
# V = 256), batch size 4. The blocks hold 18.9M parameters; the position table holds 512 per
# position, so the total depends on the sequence length: P = 2088, the §5.2 length at 36 GPUs
# (Table 3; 58 tokens per GPU, 348 ... 50112 from 6 to 864 GPUs), gives 20.1M with tied
# embeddings. Longer runs need ``max_seq_len`` raised (the 50112-token run of Table 3 has a 25.7M
# position table alone).
# lss-gpt-1.5b is the model of §5.3: 2048 wide, 24 layers, 16 heads, called "1.5-billion-parameter".
# With the 4x MLP the blocks hold 1.21B; V = 256 and P = 1512 (the longest length of Table 6) add
# 3.6M. The paper's 1.5B is not reached with any ordinary vocabulary (GPT-2's 50257, untied: 1.42B);
# we keep the paper's shape and enwik8's byte vocabulary.
_TINY = dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, max_seq_len=256)
CONFIGS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    name: MappingProxyType(fields) for name, fields in {
        "lss-gpt-small": dict(vocab_size=256, n_embd=512, n_layer=6, n_head=8, max_seq_len=2088),
        "lss-gpt-1.5b": dict(vocab_size=256, n_embd=2048, n_layer=24, n_head=16, max_seq_len=1512),
        # CPU tests and the tiny recipe: multi-head (auto -> fused input all-gather) and multi-query
        # (2 * H_kv * D = 32 < d = 64: auto -> gather K/V).
        "gpt-tiny": _TINY,
        "gpt-tiny-mqa": dict(_TINY, n_kv_head=1),
    }.items()
})
"""Named configurations for :meth:`GPTConfig.from_name` (read-only)."""


class GPTAttention(nn.Module):
    """Causal self-attention: Q from the local x, K/V through :class:`FusedKVAttention`, output projection, dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        kv_dim = 2 * config.n_kv_head * config.head_dim  # type: ignore[operator]
        self.q_proj = nn.Linear(config.n_embd, config.attn_dim, bias=config.bias)
        self.kv_proj = nn.Linear(config.n_embd, kv_dim, bias=config.bias)
        self.o_proj = nn.Linear(config.attn_dim, config.n_embd, bias=config.bias)
        self.attn_core = FusedKVAttention(n_embd=config.n_embd, n_kv_head=config.n_kv_head,  # type: ignore[arg-type]
                                          head_dim=config.head_dim, kv_comm=config.kv_comm)  # type: ignore[arg-type]
        self.resid_dropout = nn.Dropout(config.dropout)

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (B, S', H_kv, D) of x (B, S', d), for the local shard or the gathered sequence."""
        B, S, _ = x.shape
        k, v = self.kv_proj(x).view(B, S, 2, self.n_kv_head, self.head_dim).unbind(2)  # (B, S', H_kv, D) each
        return k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.n_head, self.head_dim)  # (B, S, H, D)
        y = self.attn_core(q, x, self.project_kv)  # (B, S, H, D)
        return self.resid_dropout(self.o_proj(y.reshape(B, S, self.n_head * self.head_dim)))  # (B, S, d)


class GPTMLP(nn.Module):
    """c_proj(gelu(c_fc(x))), then dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)  # type: ignore[arg-type]
        self.c_proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)  # type: ignore[arg-type]
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # (B, S, I) -> (B, S, d)


class GPTBlock(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)). The unit of FSDP and checkpointing."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
        self.attn = GPTAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, S, d)
        return x + self.mlp(self.ln_2(x))  # (B, S, d)


class GPT(CausalLM):
    """GPT causal language model: ``forward(input_ids, position_ids) -> logits`` (B, S, V).

    Blocks live in ``self.layers`` so the strategy can wrap each one (FSDP2, activation
    checkpointing, compile); ``output="hidden"`` and ``lm_head`` let a chunked loss avoid the full
    (B, S, V) logits, as for :class:`~lightning_seqpar.models.Llama`.

    Note [Sequence-distributed position embeddings]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    LSS Principle 2 (§3): the position table is a lookup, so a rank holding a segment of the
    sequence looks up only the rows of its tokens. Here a rank embeds ``wpe(position_ids)`` with
    the GLOBAL positions of its own tokens (the strategy shards ``position_ids`` with the batch,
    contiguous or zigzag): nothing else of the table is read, and row p receives gradient only on
    the one rank of the SP group that holds position p. The rows of other ranks' positions stay
    exactly zero in this rank's gradient, so summing the gradients over the SP group is a
    concatenation of row blocks: no row is ever added to another rank's row.

    Why that gradient is exact (§4, "double gradient averaging"): every rank's loss is its token
    losses over the GLOBAL token count (``lightning_seqpar.loss``, Note [Loss normalisation under
    sequence parallelism]), loss_r = sum_{t in r} l_t / N, so sum_r loss_r is the single-device
    mean and the exact gradient of any parameter is the SUM of the ranks' gradients, over SP and
    DP alike. The position table needs no special case: the strategy's FSDP2 sum-reduction gives
    row p its owner's gradient (SP) plus the other replicas' gradients for the same position (DP)
    — the paper's "horizontal" and "vertical" averaging in one reduction.

    Averaging the table's gradient over the SP group (the naive data-parallel habit) would be
    wrong: each row has a single owner, so the mean is the true row gradient divided by W. (If
    each rank's loss is instead the mean over its own segment, loss_r = sum_{t in r} l_t / (N / W),
    the reading of §3 Principle 4 under which an SP average of the gradients is right, then a row
    left out of that average, as §4 prescribes, keeps a factor W against one device: a constant
    per-tensor scale that Adam mostly absorbs. The global normalisation here has neither the
    special case nor the factor; tests/test_gpt.py checks both statements.)

    Memory: FSDP2 shards the table with all the other parameters (over DP x SP, finer than
    Principle 2's 1/W over SP) and gathers it for the lookup, P * d values per step.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.max_seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(GPTBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.init_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the token table when ``config.tie_embeddings`` (again after ``to_empty``)."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise every parameter: normal(0, init_std) weights, residual projections
        scaled, zero biases, LayerNorms at (1, 0). Also for a model built on the meta device."""
        self.tie_weights()
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layer) if self.config.scale_residual_init else std
        nn.init.normal_(self.wte.weight, mean=0.0, std=std)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=std)
        for name, module in self.named_modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif isinstance(module, nn.Linear) and not (module is self.lm_head and self.config.tie_embeddings):
                residual = name.endswith(("o_proj", "c_proj"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if residual else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Number of parameters of this instance (a tied tensor counted once); see ``GPTConfig.num_params``."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wte.weight.numel() - self.wpe.weight.numel() if non_embedding else n

    def forward_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final normed hidden states (B, S, d); ``position_ids`` (B, S) are global, ``arange(S)`` when None."""
        P = self.config.max_seq_len
        if position_ids is None and input_ids.ndim == 2 and input_ids.shape[1] > P:
            raise ValueError(f"input_ids has {input_ids.shape[1]} positions but GPTConfig.max_seq_len={P}; raise max_seq_len")
        explicit = position_ids is not None
        position_ids = global_positions(input_ids, position_ids)  # (B, S)
        if explicit:
            # One scalar read per forward: an out-of-range lookup is an opaque device assert on GPU.
            if not torch.compiler.is_compiling() and position_ids.numel() and int(position_ids.max()) >= P:
                raise ValueError(
                    f"position_ids reach {int(position_ids.max())} but the position table has GPTConfig.max_seq_len={P} "
                    "rows; raise max_seq_len to the global sequence length"
                )
        # Note [Sequence-distributed position embeddings]: only this rank's global positions.
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))  # (B, S, d)
        for block in self.layers:
            x = block(x)  # (B, S, d)
        return self.ln_f(x)  # (B, S, d)


"""The recurrent token mixers of transformers' hybrid models, made sequence-parallel.

Public names:

* :func:`apply_hf_hybrid` — replace every recurrent token mixer of a ``PreTrainedModel`` that the
  package makes exact (table below) by its sequence-parallel twin; returns how many.
* :func:`configure_recurrence` — give every :class:`~lightning_seqpar.attention.recurrent.Recurrence`
  of a model the sequence-parallel mesh and layout (what ``apply_attention`` does for ``Attention``).
* :data:`HYBRID_MIXERS` — the transformers classes replaced, and by what.

Note [Hybrid models under the strategy]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A shard that runs a recurrent layer alone starts from a zero state (and a zero convolution
history) in the middle of the sequence: wrong logits, silently. The attention layers of these
models are installed by ``apply_hf_attention`` like any other; their recurrent mixers are
replaced at set-up, once, by modules of this file (no transformers class is patched):

    transformers class                      replaced by            token mixing (Notes in attention/recurrent/)
    Qwen3NextGatedDeltaNet, Qwen3_5(Moe)-   SeqparGatedDeltaNet    causal conv (q|k|v) + gated delta rule
      GatedDeltaNet
    BambaMixer, GraniteMoeHybrid-           SeqparMamba2Mixer      causal conv (x|B|C) + SSD scan
      MambaLayer, NemotronHMamba2Mixer
    Lfm2ShortConv, Lfm2MoeShortConv,        SeqparShortConv        gated causal conv
      Lfm3ShortConv
    MambaMixer, FalconMambaMixer,           SeqparMambaMixer       causal conv (x) + Mamba1 selective scan
      JambaMambaMixer
    ZambaMambaMixer                         SeqparZambaMambaMixer  the same, multi-head (B, C per head)
    Mamba2Mixer, Zamba2MambaMixer           SeqparMamba2Mixer      as Bamba's (Zamba2: dt >= time_step_min)
    FalconH1Mixer                           SeqparFalconH1Mixer    as Bamba's, muP multipliers, optional norm
    OlmoHybridGatedDeltaNet                 SeqparOlmoHybrid-      causal conv (q|k|v) + gated delta rule
                                              GatedDeltaNet          (beta doubled with allow_neg_eigval)
    MiniMaxLightningAttention               SeqparLightning-       linear attention, fixed decay per head:
                                              Attention              the SSD scan with dt = 1, A = -slope
    KimiLinearDeltaAttention                SeqparKimiDelta-       causal conv (q|k|v) + delta rule with a
                                              Attention              decay per key dimension (KDA)
    RecurrentGemmaRecurrentBlock            SeqparRecurrentGemma-  causal conv (x) + RG-LRU (diagonal
                                              RecurrentBlock         recurrence; position-0 resets checked)

Only these classes, whose forward this file follows line by line (the support sweep checks each
architecture against the unmodified model); other recurrent mixers (RWKV, xLSTM, ...) stay
refused by name
(``lightning_seqpar.hf.support.refuse_token_mixers``). Where two classes share a forward up to a
detail, the twin is a subclass overriding a hook (``SeqparMamba2Mixer._in_projection`` /
``_dt_limit`` / ``_gated_norm``, ``SeqparGatedDeltaNet._project`` / ``_beta`` / ``_log_decay`` / ``_output``).

Where it happens: ``apply_hf_attention`` (and so ``HFCausalLM`` / ``CausalLMModule``) replaces
the mixers after its checks pass; the strategy's ``apply_attention`` gives every
``Recurrence`` the 1-D sequence-parallel mesh and the batch's layout (attention="2d" is refused
for such models: its head-parallel axis does not apply to a recurrence). Packed documents: each
twin reads the batch's documents (``current_documents()``) at forward time and passes them to its
recurrence, which resets the state and the convolution history at every document start (Note
[Documents in a recurrence] in ``lightning_seqpar.attention.recurrent``).

The twin takes over the original's submodules and parameters under the same names (so the
state dict, FSDP2 wrapping and ``save_pretrained`` see the same model), recomputes the layer's
forward with the same projections / norms / output projection, and runs its sequence mixing
through a parameter-free ``seqpar_recurrence`` child (:class:`Recurrence`), which
the strategy's ``apply_attention`` (or :func:`configure_recurrence`) points at the mesh. The forward follows transformers' torch path
(the reference); no cache: KV/state caches (generation) are refused by name, as are padding
masks and packed-document kwargs (``cu_seq_lens_*``, ``seq_idx``: the twins take documents from
the batch's ``document_ids`` / ``position_ids`` through ``current_documents()``, not from these).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.attention.recurrent import Recurrence
from lightning_seqpar.loss.head import is_plain
from lightning_seqpar.sharding.documents import current_documents

__all__ = ["HYBRID_MIXERS", "SeqparFalconH1Mixer", "SeqparGatedDeltaNet", "SeqparKimiDeltaAttention", "SeqparLightningAttention",
           "SeqparMamba2Mixer", "SeqparMambaMixer", "SeqparOlmoHybridGatedDeltaNet", "SeqparRecurrentGemmaRecurrentBlock",
           "SeqparShortConv", "SeqparZambaMambaMixer",
           "apply_hf_hybrid", "configure_recurrence", "decoder_layer_index", "is_hybrid_twin"]

_CACHE_KWARGS = ("cache", "cache_params", "past_key_values", "past_key_value")
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens", "seq_idx")


def _adopt(new: nn.Module, old: nn.Module, attributes: tuple[str, ...]) -> None:
    """Move ``old``'s children, parameters and buffers (same names) and the plain ``attributes`` onto ``new``."""
    for name, child in old.named_children():
        new.add_module(name, child)
    for name, p in old.named_parameters(recurse=False):
        new.register_parameter(name, p)
    for name, b in old.named_buffers(recurse=False):  # non-persistent ones (Falcon-H1's mup_vector) stay out of the state dict
        new.register_buffer(name, b, persistent=name not in old._non_persistent_buffers_set)
    for name in attributes:
        setattr(new, name, getattr(old, name))
    new.train(old.training)


def _check_call(module: nn.Module, attention_mask: Tensor | None, kwargs: dict[str, Any]) -> None:
    """Refuse, by name, what the sequence-parallel forms do not implement (local metadata only)."""
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    for name in _CACHE_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: a cache ({name}=...) is not supported by the sequence-parallel recurrent layers; "
                             "train / score without a cache (use_cache=False), generate with the unmodified model")
    for name in _PACKED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{where}: packed documents as {name}=... are not read by the sequence-parallel recurrent "
                             "layers; give them as the batch's document_ids (or position_ids restarting at 0) to "
                             "SequenceParallelStrategy / CausalLMModule, or wrap the call in "
                             "lightning_seqpar.sharding.documents.packed_documents(...)")
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError(f"{where}: an attention_mask with padding is not supported by the sequence-parallel recurrent "
                         "layers; pad on the right and set labels=-100 on the padding (exact for causal layers)")


def _direct(owner: nn.Module, name: str, cls: type[nn.Module] = nn.Conv1d) -> nn.Module:
    """``owner.<name>``, a submodule whose ``weight`` the twin reads directly (a convolution's kernel goes to the
    sequence-parallel conv, Mamba1's ``dt_proj`` is multiplied as transformers' kernel path does); refused by name
    when it is not a plain ``cls``: a wrapper's addition (peft's LoRA layer) would be left out, silently
    (Note [Hybrid models under the strategy])."""
    module = getattr(owner, name)
    if not is_plain(module, cls):
        raise ValueError(f"{type(owner).__name__} (layer {getattr(owner, 'layer_idx', '?')}): its {name} is a "
                         f"{type(module).__module__}.{type(module).__qualname__}, not a plain nn.{cls.__name__}; the sequence-parallel form reads "
                         f"{name}.weight directly and would leave out what the wrapper adds (a LoRA adapter): leave "
                         f"{name!r} out of target_modules (peft) or train the layer without the strategy")
    return module


class SeqparGatedDeltaNet(nn.Module):
    """Qwen3-Next's / Qwen3.5's gated DeltaNet layer with sequence-parallel conv and delta rule."""

    _DIRECT = (("conv1d", nn.Conv1d),)  # submodules whose weight forward reads (_direct)

    _ATTRIBUTES = ("hidden_size", "num_v_heads", "num_k_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim",
                   "conv_kernel_size", "layer_idx", "activation", "layer_norm_epsilon", "conv_dim", "layer_type")

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        _adopt(self, original, tuple(a for a in self._ATTRIBUTES if hasattr(original, a)))
        self.seqpar_recurrence = Recurrence()

    def _project(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """hidden [B, S, d] -> mixed q|k|v [B, S, conv_dim] (the conv's input), z [B, S, H_v, Dv], b, a [B, S, H_v].

        Qwen3-Next projects q, k, v, z with one head-interleaved ``in_proj_qkvz`` (and b, a with
        ``in_proj_ba``); Qwen3.5 with ``in_proj_qkv`` (already q|k|v), ``in_proj_z``, ``in_proj_b``, ``in_proj_a``.
        """
        B, S, _ = hidden_states.shape
        if hasattr(self, "in_proj_qkvz"):
            q, k, v, z, b, a = self._split(self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states))
            return torch.cat([x.reshape(B, S, -1) for x in (q, k, v)], dim=-1), z, b, a
        z = self.in_proj_z(hidden_states).reshape(B, S, -1, self.head_v_dim)
        return self.in_proj_qkv(hidden_states), z, self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)

    def _split(self, qkvz: Tensor, ba: Tensor) -> tuple[Tensor, ...]:
        """Qwen3-Next's head-interleaved layout -> q, k [B, S, H_k, Dk], v, z [B, S, H_v, Dv], b, a [B, S, H_v]."""
        B, S = qkvz.shape[:2]
        per = self.num_v_heads // self.num_k_heads
        qkvz = qkvz.view(B, S, self.num_k_heads, 2 * self.head_k_dim + 2 * per * self.head_v_dim)
        q, k, v, z = torch.split(qkvz, [self.head_k_dim, self.head_k_dim, per * self.head_v_dim, per * self.head_v_dim], dim=3)
        b, a = torch.split(ba.view(B, S, self.num_k_heads, 2 * per), [per, per], dim=3)
        return (q, k, v.reshape(B, S, -1, self.head_v_dim), z.reshape(B, S, -1, self.head_v_dim),
                b.reshape(B, S, self.num_v_heads), a.reshape(B, S, self.num_v_heads))

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        _check_call(self, attention_mask, kwargs)
        documents = current_documents()  # read at forward time (Note [Per-call state])
        B, S, _ = hidden_states.shape
        mixed, z, b, a = self._project(hidden_states)  # (B, S, conv_dim), (B, S, H_v, Dv), (B, S, H_v) x 2
        conv = _direct(self, "conv1d")
        mixed = self.seqpar_recurrence.conv(mixed, conv.weight[:, 0], conv.bias, self.activation, documents=documents)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, S, -1, self.head_k_dim)
        k = k.reshape(B, S, -1, self.head_k_dim)
        v = v.reshape(B, S, -1, self.head_v_dim)
        beta = self._beta(b)
        g = self._log_decay(hidden_states, a)
        out = self.seqpar_recurrence.delta_rule(q, k, v, g, beta, use_qk_l2norm=True, documents=documents)  # (B, S, H_v, Dv)
        return self._output(out, z)

    def _beta(self, b: Tensor) -> Tensor:
        return b.sigmoid()

    def _log_decay(self, hidden_states: Tensor, a: Tensor) -> Tensor:
        """g [B, S, H_v] (<= 0) from the a projection [B, S, H_v]."""
        return -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)

    def _output(self, out: Tensor, z: Tensor) -> Tensor:
        """out, z [B, S, H_v, Dv] -> the layer's output [B, S, d]: gated norm per head, output projection."""
        B, S = out.shape[:2]
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(B, S, -1))


class SeqparMamba2Mixer(nn.Module):
    """Bamba's Mamba2 mixer with sequence-parallel conv and SSD scan (transformers' torch path)."""

    _DIRECT = (("conv1d", nn.Conv1d),)  # submodules whose weight forward reads (_direct)

    _ATTRIBUTES = ("num_heads", "hidden_size", "ssm_state_size", "conv_kernel_size", "intermediate_size", "layer_idx",
                   "activation", "n_groups", "head_dim", "chunk_size", "time_step_limit", "time_step_min", "conv_dim",
                   "layer_type")

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        _adopt(self, original, tuple(a for a in self._ATTRIBUTES if hasattr(original, a)))
        self.seqpar_recurrence = Recurrence()

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        _check_call(self, attention_mask, kwargs)
        documents = current_documents()  # read at forward time (Note [Per-call state])
        Bsz, S, _ = hidden_states.shape
        dtype = hidden_states.dtype
        gate, xBC, dt = self._in_projection(hidden_states).split([self.intermediate_size, self.conv_dim, self.num_heads], dim=-1)
        conv = _direct(self, "conv1d")
        xBC = self.seqpar_recurrence.conv(xBC, conv.weight[:, 0], conv.bias, self.activation, documents=documents)
        x, Bm, C = torch.split(xBC, [self.intermediate_size, self.n_groups * self.ssm_state_size,
                                     self.n_groups * self.ssm_state_size], dim=-1)
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype))
        lo, hi = self._dt_limit()
        dt = torch.clamp(dt, min=lo, max=hi)
        A = -torch.exp(self.A_log.float())
        y = self.seqpar_recurrence.ssd(x.reshape(Bsz, S, self.num_heads, self.head_dim), dt, A,
                                       Bm.reshape(Bsz, S, self.n_groups, self.ssm_state_size),
                                       C.reshape(Bsz, S, self.n_groups, self.ssm_state_size), self.D, documents=documents)
        y = self._gated_norm(y.reshape(Bsz, S, -1), gate)
        return self.out_proj(y.to(dtype))

    # the hooks where the Mamba2 mixers of transformers differ (Falcon-H1: SeqparFalconH1Mixer)

    def _in_projection(self, hidden_states: Tensor) -> Tensor:
        """hidden [B, S, d] -> gate | x B C | dt [B, S, intermediate + conv_dim + H]."""
        return self.in_proj(hidden_states)

    def _dt_limit(self) -> tuple[float, float]:
        """(min, max) of dt after the softplus: ``time_step_limit`` (Bamba, Mamba2, Falcon-H1; Zamba2 since
        transformers 5.2x), else Zamba2's ``(time_step_min, inf)`` (older transformers), else no clamp."""
        limit = getattr(self, "time_step_limit", None)
        if limit is not None:
            return tuple(limit)  # type: ignore[return-value]
        return (getattr(self, "time_step_min", 0.0), float("inf"))

    def _gated_norm(self, y: Tensor, gate: Tensor) -> Tensor:
        """y (the scan's output) [B, S, intermediate] fp32, gate [B, S, intermediate] -> the out projection's input."""
        return self.norm(y, gate)


class SeqparFalconH1Mixer(SeqparMamba2Mixer):
    """Falcon-H1's Mamba2 mixer: Bamba's forward with muP multipliers on the input (``ssm_in_multiplier``) and on
    the in-projection (the ``mup_vector`` buffer, per block of gate | x | B | C | dt), and the gated RMS norm
    optional (``config.mamba_rms_norm``; without it the scan's output is gated by silu(gate) alone)."""

    _ATTRIBUTES = (*SeqparMamba2Mixer._ATTRIBUTES, "ssm_in_multiplier", "mamba_rms_norm", "groups_time_state_size",
                   "use_bias", "use_conv_bias")

    def _in_projection(self, hidden_states: Tensor) -> Tensor:
        return self.in_proj(hidden_states * self.ssm_in_multiplier) * self.mup_vector

    def _gated_norm(self, y: Tensor, gate: Tensor) -> Tensor:
        if self.mamba_rms_norm:
            return self.norm(y, gate)
        return y * F.silu(gate)


class SeqparOlmoHybridGatedDeltaNet(SeqparGatedDeltaNet):
    """OLMo-hybrid's gated DeltaNet: Qwen3-Next's recurrence with separate q / k / v / a / b projections, its own
    gate projection (``g_proj``), beta doubled when ``allow_neg_eigval`` (eigenvalues of the transition in
    (-1, 1): the chunked kernel takes any beta), and ``o_norm`` / ``o_proj`` for the output."""

    _ATTRIBUTES = (*SeqparGatedDeltaNet._ATTRIBUTES, "allow_neg_eigval", "eps")

    def _project(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        B, S, _ = hidden_states.shape
        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
        z = self.g_proj(hidden_states).reshape(B, S, -1, self.head_v_dim)
        return mixed, z, self.b_proj(hidden_states), self.a_proj(hidden_states)

    def _beta(self, b: Tensor) -> Tensor:
        beta = b.sigmoid()
        return beta * 2.0 if self.allow_neg_eigval else beta

    def _output(self, out: Tensor, z: Tensor) -> Tensor:
        B, S = out.shape[:2]
        out = self.o_norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.o_proj(out.reshape(B, S, -1))


class SeqparKimiDeltaAttention(SeqparOlmoHybridGatedDeltaNet):
    """Kimi Linear's KDA layer: OLMo-hybrid's layout (separate q / k / v projections, one causal conv over
    q|k|v, ``o_norm`` / ``o_proj``) with a decay per key dimension (``forget_gate``: g [B, S, H, Dk],
    Note [Chunked gated recurrences]), a low-rank output gate (``g_b_proj(g_a_proj(x))``, sigmoid in
    ``o_norm``) and beta = sigmoid(b) (no doubling)."""

    _ATTRIBUTES = ("hidden_size", "num_heads", "head_dim", "qkv_dim", "conv_kernel_size", "layer_idx", "activation",
                   "layer_norm_epsilon", "conv_dim", "layer_type")

    def __init__(self, original: nn.Module) -> None:
        super().__init__(original)
        self.head_k_dim = self.head_v_dim = self.head_dim
        self.key_dim = self.value_dim = self.qkv_dim

    def _project(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        B, S, _ = hidden_states.shape
        mixed = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)], dim=-1)
        z = self.g_b_proj(self.g_a_proj(hidden_states)).reshape(B, S, -1, self.head_v_dim)
        return mixed, z, self.b_proj(hidden_states), hidden_states  # (the decay is computed from the hidden states)

    def _beta(self, b: Tensor) -> Tensor:
        return b.sigmoid()

    def _log_decay(self, hidden_states: Tensor, a: Tensor) -> Tensor:
        return self.forget_gate(hidden_states)  # (B, S, H, Dk) fp32


class SeqparLightningAttention(nn.Module):
    """MiniMax's lightning attention (linear attention with a fixed decay per head) with a sequence-parallel scan.

    transformers computes it block by block (``block_size``); the recurrence it implements is
    ``S_t = exp(-s_h) S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t`` (no scaling of q; s_h the layer's
    ``slope_rate``), i.e. the scalar-decay scan of Mamba2 (SSD) with q = C, k = B, v = x, dt = 1 and
    A = -s_h, the block size only a schedule. Then RMS norm, sigmoid output gate, output projection.
    """

    _DIRECT = ()  # no submodule weight read directly

    _ATTRIBUTES = ("layer_idx", "head_dim", "num_attention_heads", "num_hidden_layers", "block_size", "act_fn",
                   "layer_type")

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        _adopt(self, original, tuple(a for a in self._ATTRIBUTES if hasattr(original, a)))
        self.seqpar_recurrence = Recurrence()

    def forward(self, hidden_states: Tensor, position_embeddings: Any = None, attention_mask: Tensor | None = None,
                **kwargs: Any) -> tuple[Tensor, None]:
        _check_call(self, attention_mask, kwargs)
        documents = current_documents()  # read at forward time (Note [Per-call state])
        B, S, _ = hidden_states.shape
        H, D = self.num_attention_heads, self.head_dim
        qkv = self.act_fn(self.qkv_proj(hidden_states)).reshape(B, S, H, 3 * D)
        q, k, v = torch.split(qkv, D, dim=3)  # (B, S, H, D) each
        decay = -self.slope_rate.float().reshape(H)  # log decay per head and token
        y = self.seqpar_recurrence.ssd(v, torch.ones(B, S, H, dtype=torch.float32, device=v.device), decay, k, q, None,
                                       documents=documents)  # (B, S, H, D) fp32
        y = self.norm(y.to(v.dtype).reshape(B, S, H * D))
        y = torch.sigmoid(self.output_gate(hidden_states)) * y
        return self.out_proj(y), None  # (out, attention weights): the state is not returned (no cache)


class SeqparShortConv(nn.Module):
    """LFM2's gated short convolution (B * x -> causal conv -> * C) with a sequence-parallel conv."""

    _DIRECT = (("conv", nn.Conv1d),)  # submodules whose weight forward reads (_direct)

    _ATTRIBUTES = ("config", "layer_idx", "conv_kernel_size", "bias", "layer_type")

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        _adopt(self, original, tuple(a for a in self._ATTRIBUTES if hasattr(original, a)))
        self.seqpar_recurrence = Recurrence()

    def forward(self, hidden_states: Tensor, *args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        if args and args[0] is not None:  # transformers < 5 passes the cache positionally
            kwargs = {**kwargs, "past_key_values": args[0]}
        _check_call(self, attention_mask, kwargs)
        B, C, x = self.in_proj(hidden_states).chunk(3, dim=-1)  # (B, S, H) each
        conv = _direct(self, "conv")
        y = self.seqpar_recurrence.conv(B * x, conv.weight[:, 0], conv.bias, None, documents=current_documents())
        return self.out_proj((C * y).contiguous())


def _check_silu(module: nn.Module) -> None:
    """Mamba1 mixers gate with SiLU whatever the config's activation (transformers' ``mamba_selective_scan``), and
    convolve with the config's; only SiLU, the one every released checkpoint uses, is followed here."""
    if getattr(module, "activation", "silu") not in ("silu", "swish"):
        raise ValueError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): activation "
                         f"{module.activation!r} (config.hidden_act / hidden_mamba_act) is not supported by the "
                         "sequence-parallel Mamba twin; expected 'silu'")


def _mixer_call(module: nn.Module, args: tuple, attention_mask: Tensor | None, kwargs: dict[str, Any]) -> None:
    """The Mamba1 mixers' call: ``(hidden_states, cache / cache_params, attention_mask)``; refuse what is not followed."""
    if len(args) > 1:
        raise ValueError(f"{type(module).__name__}: unexpected positional arguments after the cache ({len(args)} given); "
                         "pass attention_mask by keyword")
    if args and args[0] is not None:
        kwargs = {**kwargs, "cache": args[0]}
    _check_call(module, attention_mask, kwargs)


class SeqparMambaMixer(nn.Module):
    """Mamba's (and Jamba's, Falcon-Mamba's) Mamba1 mixer with a sequence-parallel conv and selective scan.

    transformers' torch path (``MambaMixer.forward`` without kernels): in_proj -> x | gate; causal conv (SiLU)
    over x; x_proj -> dt (rank R) | B | C, Jamba's RMS norms with weights and Falcon-Mamba's weightless ones on
    dt, B, C (``dt_layernorm``, ``b_layernorm``, ``c_layernorm`` when the mixer has them); dt = softplus(dt_proj(dt));
    the selective scan with D; times SiLU(gate); out_proj.
    """

    _DIRECT = (("conv1d", nn.Conv1d), ("dt_proj", nn.Linear))  # submodules whose weight forward reads (_direct)

    _ATTRIBUTES = ("config", "hidden_size", "ssm_state_size", "conv_kernel_size", "intermediate_size", "time_step_rank",
                   "layer_idx", "use_conv_bias", "activation", "use_bias", "layer_type", "rms_eps", "use_mambapy",
                   "use_associative_scan")

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        _adopt(self, original, tuple(a for a in self._ATTRIBUTES if hasattr(original, a)))
        _check_silu(self)
        self.seqpar_recurrence = Recurrence()

    def forward(self, hidden_states: Tensor, *args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        _mixer_call(self, args, attention_mask, kwargs)
        documents = current_documents()  # read at forward time (Note [Per-call state])
        dtype = hidden_states.dtype
        x, gate = self.in_proj(hidden_states).chunk(2, dim=-1)  # (B, S, E) each
        conv = _direct(self, "conv1d")
        x = self.seqpar_recurrence.conv(x, conv.weight[:, 0], conv.bias, self.activation, documents=documents)
        time_step, B, C = torch.split(self.x_proj(x), [self.time_step_rank, self.ssm_state_size, self.ssm_state_size], dim=-1)
        if hasattr(self, "b_layernorm"):  # Jamba, Falcon-Mamba
            time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
        dt_proj = _direct(self, "dt_proj", nn.Linear)
        dt = time_step @ dt_proj.weight.t()  # (B, S, E); the bias added in fp32 as transformers does
        dt = F.softplus(dt + dt_proj.bias.float().to(dt.dtype))
        A = -torch.exp(self.A_log.float())  # (E, N)
        y = self.seqpar_recurrence.selective(x, dt, A, B[:, :, None], C[:, :, None], self.D.float(), documents=documents)
        y = y * F.silu(gate)  # fp32 times the gate, as transformers (its scan output is fp32 after the D term)
        return self.out_proj(y.to(dtype))


class SeqparZambaMambaMixer(SeqparMambaMixer):
    """Zamba's multi-head Mamba1 mixer with a sequence-parallel conv and selective scan.

    transformers' torch path: in_proj's output interleaves x and gate per channel ([..., E, 2]); one causal conv
    over x; per Mamba head h (``n_mamba_heads``, E / H channels each) its own x_proj (``x_proj_weight[h]``) ->
    dt | B | C and dt_proj (``dt_proj_weight[h]``, ``dt_proj_bias[h]``): one selective scan whose B, C have one
    group per head; D; times SiLU(gate); out_proj over the heads in order.
    """

    _DIRECT = (("conv1d", nn.Conv1d),)  # submodules whose weight forward reads (_direct)

    _ATTRIBUTES = ("config", "hidden_size", "ssm_state_size", "conv_kernel_size", "intermediate_size", "time_step_rank",
                   "n_mamba_heads", "mamba_head_dim", "layer_idx", "use_conv_bias", "activation", "use_bias", "layer_type",
                   "use_associative_scan")

    def forward(self, hidden_states: Tensor, *args: Any, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor:
        _mixer_call(self, args, attention_mask, kwargs)
        documents = current_documents()  # read at forward time (Note [Per-call state])
        Bsz, S, _ = hidden_states.shape
        dtype = hidden_states.dtype
        H, P, R, N = self.n_mamba_heads, self.mamba_head_dim, self.time_step_rank, self.ssm_state_size
        x, gate = self.in_proj(hidden_states).view(Bsz, S, -1, 2).unbind(-1)  # (B, S, E) each: channels interleave x, gate
        conv = _direct(self, "conv1d")
        x = self.seqpar_recurrence.conv(x.contiguous(), conv.weight[:, 0], conv.bias, self.activation, documents=documents)
        params = torch.einsum("bshp,hkp->bshk", x.reshape(Bsz, S, H, P), self.x_proj_weight)  # (B, S, H, R + 2N)
        time_step, B, C = torch.split(params, [R, N, N], dim=-1)
        dt = torch.einsum("bshr,hpr->bshp", time_step, self.dt_proj_weight)  # (B, S, H, P)
        dt = F.softplus(dt + self.dt_proj_bias.float().to(dt.dtype)).reshape(Bsz, S, H * P)
        A = -torch.exp(self.A_log.float()).reshape(H * P, N)
        y = self.seqpar_recurrence.selective(x, dt, A, B, C, self.D.float().reshape(H * P), documents=documents)
        y = y * F.silu(gate)  # fp32 times the gate, as transformers (its scan output is fp32 after the D term)
        return self.out_proj(y.to(dtype))


class _SqrtClippedGradient(torch.autograd.Function):
    """sqrt(x) whose derivative 1 / (2 sqrt(x)) is bounded by ``_MAX_SQRT_GRADIENT`` (RecurrentGemma's RG-LRU: the
    gradient of sqrt(1 - a^2) as a -> 1 would overflow in bf16; transformers and Griffin's reference clip it so)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.sqrt(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad / torch.sqrt(torch.clip(4.0 * x, min=1.0 / _MAX_SQRT_GRADIENT ** 2))


_MAX_SQRT_GRADIENT = 1000.0


class SeqparRecurrentGemmaRecurrentBlock(nn.Module):
    """RecurrentGemma's (Griffin's) recurrent block with a sequence-parallel conv and RG-LRU.

    transformers' torch path (``RecurrentGemmaRecurrentBlock.forward`` without a cache, ``RecurrentGemmaRglru``):
    y = act(linear_y(x)); causal depthwise conv (``conv_1d``, width ``conv1d_width``, bias, no activation) over
    linear_x(x); the RG-LRU over it: input gate i and recurrence gate r from block-diagonal weights per head,
    log a = -8 r softplus(recurrent_param), h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t) (the square root's
    gradient clipped), reset where position_ids == 0 (a_t -> 0, multiplier 1); times y; linear_out. The reset
    is checked against the zero-state starts of the chain (Note [Diagonal linear recurrences under sequence
    sharding]); the RG-LRU's parameters stay on its ``rg_lru`` child (same state dict), whose forward is not called.
    """

    _DIRECT = (("conv_1d", nn.Conv1d),)  # submodules whose weight forward reads (_direct)

    _ATTRIBUTES = ("lru_width", "hidden_size", "conv1d_width", "act_fn", "layer_idx")

    def __init__(self, original: nn.Module) -> None:
        super().__init__()
        _adopt(self, original, tuple(a for a in self._ATTRIBUTES if hasattr(original, a)))
        self.seqpar_recurrence = Recurrence()

    def forward(self, input_states: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                use_cache: bool | None = None, **kwargs: Any) -> tuple[Tensor, None]:
        _check_call(self, attention_mask, kwargs)
        documents = current_documents()  # read at forward time (Note [Per-call state])
        B, T, _ = input_states.shape
        reset = self._reset(position_ids, B, T, documents)  # (B, T, 1)
        y_branch = self.act_fn(self.linear_y(input_states))
        conv = _direct(self, "conv_1d")
        x = self.seqpar_recurrence.conv(self.linear_x(input_states), conv.weight[:, 0], conv.bias, None, documents=documents)
        x = self._rg_lru(x, reset, documents)  # (B, T, E)
        return self.linear_out(x * y_branch), None

    def _reset(self, position_ids: Tensor | None, B: int, T: int, documents: Any) -> Tensor:
        """position_ids == 0 [B, T, 1], after checking that these are exactly the tokens where the chain's state is
        zero (the first token of the sequence, or of every document); ValueError naming position_ids otherwise."""
        where = f"{type(self).__name__} (layer {getattr(self, 'layer_idx', '?')})"
        if not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.shape[1] != T:
            raise ValueError(f"{where}: position_ids [B, {T}] (the GLOBAL positions of the local tokens, 0 at every "
                             f"document start) are required: the RG-LRU resets its state where position_ids == 0; "
                             f"got {getattr(position_ids, 'shape', position_ids)}")
        reset = (position_ids == 0).expand(B, T)
        starts = self.seqpar_recurrence.starts(B, T, documents=documents)
        if not torch.equal(reset.cpu(), starts):
            raise ValueError(
                f"{where}: position_ids == 0 (where the RG-LRU resets its state) at other tokens than the starts of the "
                "sequence and of the batch's packed documents: a reset there is not carried between ranks. Give packed "
                "documents as the batch's document_ids or position_ids restarting at 0 (SequenceParallelStrategy / "
                "CausalLMModule), or wrap the call in lightning_seqpar.sharding.documents.packed_documents("
                "PackedDocuments.from_position_ids(position_ids, world=...)); pass the global positions of the shard")
        return reset[:, :, None]

    def _rg_lru(self, x: Tensor, reset: Tensor, documents: Any) -> Tensor:
        """The RG-LRU (transformers' ``RecurrentGemmaRglru.forward``) over x [B, T, E] -> [B, T, E] in x's dtype."""
        lru = self.rg_lru
        B, T, E = x.shape
        H = lru.num_attention_heads
        per_head = x.reshape(B * T, H, E // H).permute(1, 0, 2)  # (H, B T, E / H)

        def gate(weight: Tensor, bias: Tensor) -> Tensor:  # block-diagonal linear per head, sigmoid: (B, T, E)
            return torch.sigmoid(torch.baddbmm(bias[:, None, :], per_head, weight).transpose(0, 1).reshape(B, T, E))

        input_gate = gate(lru.input_gate_weight, lru.input_gate_bias)
        recurrent_gate = gate(lru.recurrent_gate_weight, lru.recurrent_gate_bias)
        log_a = -8.0 * recurrent_gate * F.softplus(lru.recurrent_param)  # (B, T, E) <= 0
        multiplier = _SqrtClippedGradient.apply(1 - torch.exp(2 * log_a))
        multiplier = reset + ~reset * multiplier  # 1 at a reset (h_t = i_t x_t there)
        u = x * input_gate * multiplier.type(x.dtype)
        h = self.seqpar_recurrence.diagonal(log_a, u, documents=documents)  # (B, T, E) fp32
        return h.to(x.dtype)


HYBRID_MIXERS: dict[str, type[nn.Module]] = {
    "Qwen3NextGatedDeltaNet": SeqparGatedDeltaNet,
    "Qwen3_5GatedDeltaNet": SeqparGatedDeltaNet,
    "Qwen3_5MoeGatedDeltaNet": SeqparGatedDeltaNet,
    "BambaMixer": SeqparMamba2Mixer,
    "GraniteMoeHybridMambaLayer": SeqparMamba2Mixer,  # Bamba's mixer under another name (same __init__ and forward)
    "NemotronHMamba2Mixer": SeqparMamba2Mixer,  # Bamba's forward; its __init__ reads other config names
    "Lfm2ShortConv": SeqparShortConv,
    "Lfm2MoeShortConv": SeqparShortConv,
    "Lfm3ShortConv": SeqparShortConv,
    "MambaMixer": SeqparMambaMixer,
    "JambaMambaMixer": SeqparMambaMixer,  # Mamba's forward with RMS norms (weights) on dt, B, C
    "FalconMambaMixer": SeqparMambaMixer,  # Mamba's forward with weightless RMS norms on dt, B, C
    "ZambaMambaMixer": SeqparZambaMambaMixer,
    "Mamba2Mixer": SeqparMamba2Mixer,  # Bamba's forward (Mamba2 models)
    "Zamba2MambaMixer": SeqparMamba2Mixer,  # Bamba's forward; dt clamped below at time_step_min
    "FalconH1Mixer": SeqparFalconH1Mixer,
    "OlmoHybridGatedDeltaNet": SeqparOlmoHybridGatedDeltaNet,
    "MiniMaxLightningAttention": SeqparLightningAttention,
    "KimiLinearDeltaAttention": SeqparKimiDeltaAttention,
    "RecurrentGemmaRecurrentBlock": SeqparRecurrentGemmaRecurrentBlock,
}
"""transformers class name -> its sequence-parallel twin (Note [Hybrid models under the strategy])."""


def is_hybrid_twin(module: nn.Module) -> bool:
    """Whether ``module`` is one of this file's sequence-parallel twins (it calls a ``Recurrence``)."""
    return isinstance(getattr(module, "seqpar_recurrence", None), Recurrence)


def apply_hf_hybrid(model: nn.Module) -> int:
    """Replace every recurrent mixer of ``model`` listed in :data:`HYBRID_MIXERS` by its twin; idempotent.

    Returns how many were replaced. The twins are local until :func:`configure_recurrence`.
    """
    replaced = 0
    for path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            twin = HYBRID_MIXERS.get(type(child).__name__)
            if twin is not None:
                new = twin(child)
                if getattr(new, "layer_idx", None) is None:  # RecurrentGemma's block does not keep its index
                    new.layer_idx = decoder_layer_index(f"{path}.{name}")
                for attr, cls in new._DIRECT:  # refused at set-up, before any collective
                    _direct(new, attr, cls)
                setattr(parent, name, new)
                replaced += 1
    return replaced


def decoder_layer_index(path: str) -> int | None:
    """The decoder layer index in a module path (the last integer component: ``model.layers.3.temporal_block`` -> 3)."""
    numbers = [int(part) for part in path.split(".") if part.isdigit()]
    return numbers[-1] if numbers else None


def configure_recurrence(model: nn.Module, mesh: DeviceMesh | None, *,
                         layout: Literal["zigzag", "contiguous"] = "zigzag") -> int:
    """Point every :class:`Recurrence` of ``model`` at ``mesh`` (None or one rank: local); returns how many."""
    modules = [m for m in model.modules() if isinstance(m, Recurrence)]
    for m in modules:
        m.configure(mesh=mesh, layout=layout)
    return len(modules)

"""A transformers causal LM behind the interface of the package's models: building, :class:`HFCausalLM`, saving."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from lightning_seqpar.attention import Attention
from lightning_seqpar.sharding.documents import current_documents, documents_error
from lightning_seqpar.loss.head import head_operands, logits_head
from lightning_seqpar.hf.attention import apply_hf_attention, require_transformers
from lightning_seqpar.hf.config import HFConfigSpec, is_hf_source, load_hf_config
from lightning_seqpar.hf.fused import apply_hf_fused_kernels
from lightning_seqpar.hf.moe import RouterAux, RouterStats, router_aux, router_aux_loss_share, router_stats
from lightning_seqpar.hf.hybrid import is_hybrid_twin
from lightning_seqpar.hf.lora import PEFT_HEAD, is_peft_model
from lightning_seqpar.hf.support import check_sharded_layer
from lightning_seqpar.models.registry import rotates_whole_head
from lightning_seqpar.parallel.parallelize import config_value

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = ["HFCausalLM", "HFConfigSpec", "build_hf_causal_lm", "is_hf_source", "load_hf_config", "save_hf_pretrained"]

# config fields that change the logits after ``lm_head`` (the chunked loss computes hidden @ W^T only)
# (final_logit_softcapping is applied by the chunked loss itself: HFCausalLM.logit_softcap)
_LOGIT_TRANSFORMS: tuple[tuple[str, object], ...] = (
    ("logit_scale", 1.0),  # Cohere
    ("logits_scaling", 1.0),  # Granite
    ("lm_head_multiplier", 1.0),  # Falcon-H1
    ("output_multiplier", 1.0),  # MuseGlimmer / MuseSpark (before their soft-cap)
)

CHUNKED_LOSS_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text",
    "gemma", "gemma2", "gemma3_text", "gpt_oss", "olmoe", "phi3", "lfm2", "bamba", "jamba",
})
"""The transformers model types whose ``ForCausalLM`` computes its logits as ``lm_head(decoder(x))`` (Gemma 2 / 3 soft-capped
by ``final_logit_softcapping``, which the chunked loss applies), each checked chunked against the full logits
(tests/test_head.py): where ``CausalLMModule(loss_chunk_size="auto")`` chunks (Note [The loss chunk by default])."""


def chunked_loss_serves(config: Any) -> bool:
    """Whether ``loss_chunk_size="auto"`` chunks this transformers model's loss: a model type of
    :data:`CHUNKED_LOSS_MODEL_TYPES` without a logit transform (:func:`logit_transform`)."""
    return getattr(config, "model_type", None) in CHUNKED_LOSS_MODEL_TYPES and logit_transform(config) is None


def logit_transform(config: Any) -> str | None:
    """The config field (``"name=value"``) by which the model changes its logits after ``lm_head`` beyond what the
    chunked cross entropy applies itself, or None (the chunked loss computes exactly the model's logits)."""
    for field, neutral in _LOGIT_TRANSFORMS:
        value = getattr(config, field, neutral)
        if value is not None and value != neutral:
            return f"{field}={value}"
    return None


# --------------------------------------------------------------------------------------------- building


def build_hf_causal_lm(source: Any, *, dtype: torch.dtype | None = None,
                       config_overrides: Mapping[str, Any] | None = None) -> PreTrainedModel:
    """A transformers causal LM: ``from_pretrained`` of a local folder (weights included), or ``from_config``
    (random init, from the current torch random state) of a config or a dict with ``"model_type"``.

    ``config_overrides``: fields changed in the config before the model is built (Note [Config overrides] in
    ``lightning_seqpar.hf.config``; a folder's weights are loaded into the model of the overridden config).
    Refused for a ``PreTrainedModel`` (already built). Built on the current default device (the strategy's
    ``tensor_init_context`` sets it) in ``dtype`` (default: ``torch.get_default_dtype()``, which Lightning's
    precision plugin sets).
    """
    transformers = require_transformers()
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if isinstance(source, transformers.PreTrainedModel):
        load_hf_config(source, config_overrides=config_overrides)  # refuses overrides, with its message
        return source
    if isinstance(source, (str, os.PathLike)):
        config = load_hf_config(source, config_overrides=config_overrides)  # the folder check, with its error message
        kwargs = {"config": config} if config_overrides else {}
        return transformers.AutoModelForCausalLM.from_pretrained(os.fspath(source), dtype=dtype, local_files_only=True, **kwargs)
    # the model owns its config: set_attn_implementation changes it (load_hf_config copies when it overrides)
    config = load_hf_config(source, config_overrides=config_overrides)
    return transformers.AutoModelForCausalLM.from_config(config if config_overrides else copy.deepcopy(config), dtype=dtype)


# --------------------------------------------------------------------------------------------- the model


def _full_rotary(model: nn.Module) -> bool:
    """A transformers model whose every attention layer rotates the whole head (what cuDNN's backward was measured
    exact on: Note [Choosing the local kernel]): a rotary embedding module exists and the config says the whole head
    (:func:`lightning_seqpar.models.registry.rotates_whole_head`)."""
    if not any("Rotary" in type(m).__name__ for m in model.modules()):
        return False  # learned or no positions: not what was measured
    return rotates_whole_head(model.config)


class HFCausalLM(nn.Module):
    """A transformers causal LM with the interface of the package's models (what ``CausalLMModule`` calls).

    ``forward(input_ids, position_ids)`` -> logits ``(B, S, V)``; ``output="hidden"`` -> the final
    hidden states ``(B, S, d)`` for the chunked loss over ``lm_head.weight``. The transformers model
    is the child ``hf`` (parameter names ``hf.<transformers name>``); its decoder layers
    (``hf.model.layers``) are the blocks that the strategy checkpoints and shards.

    Args:
        model: a transformers ``PreTrainedModel`` for causal LM (:func:`apply_hf_attention` is applied),
            or a ``peft.PeftModel`` wrapping one (``lightning_seqpar.hf.lora``).
        max_seq_len: see :func:`apply_hf_attention`.
    """

    def __init__(self, model: PreTrainedModel, *, max_seq_len: int | None = None) -> None:
        super().__init__()
        # a peft.PeftModel (LoRA): the attention layers are its base model's (Note [LoRA under the strategy])
        base = model.get_base_model() if is_peft_model(model) else model
        apply_hf_attention(base, max_seq_len=max_seq_len)
        apply_hf_fused_kernels(base)  # Note [Fused kernels in transformers models]
        self._router_aux = router_aux(base)  # refuses an auxiliary loss it cannot compute exactly
        self._router_stats: RouterStats | None = None
        self.hf = model
        # tuples, not lists of modules: not registered twice (they are children of the model)
        self._attention_modules = tuple(m for m in model.modules() if isinstance(m, Attention))
        self._attention_layers = tuple(m for m in model.modules() if isinstance(getattr(m, "seqpar_attention", None), Attention))
        self._recurrent_mixers = tuple(type(m).__name__ for m in model.modules() if is_hybrid_twin(m))
        config = model.config
        head = model.get_output_embeddings()
        embedding = model.get_input_embeddings()
        tied = head is not None and embedding is not None and head.weight is embedding.weight
        excluded = None if embedding is None or tied else embedding.weight  # the input embedding: a lookup, not a matmul
        n = sum(p.numel() for p in model.parameters()) - (0 if excluded is None else excluded.numel())
        # frozen weights (LoRA's base) cost forward + input gradient (4 per weight), no weight gradient
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and p is not excluded)
        if self._attention_layers:
            heads = config.num_attention_heads
            head_dim = (config_value(config, "head_dim") or next((layer.head_dim for layer in self._attention_layers
                                                                  if isinstance(getattr(layer, "head_dim", None), int)), None)
                        or config.hidden_size // heads)
            self._attn_width = heads * head_dim
        else:  # no attention layer (Mamba, Falcon-Mamba: no num_attention_heads either): no attention-score FLOPs
            self._attn_width = 0
        self._matmul_params = n
        self._frozen_params = frozen
        self._n_layers = config.num_hidden_layers
        self._cudnn_exact = _full_rotary(base) and not self._recurrent_mixers

    @property
    def config(self) -> PretrainedConfig:
        """The transformers config."""
        return self.hf.config

    @property
    def cudnn_attention_exact(self) -> bool:
        """Whether cuDNN's attention backward is exact for this model, so that ``attention_backend="auto"`` may take
        it (Note [Choosing the local kernel]): a rotary embedding over the whole head on every attention layer and no
        recurrent layers. Partial rotary (Qwen3-Next, Bamba, Phi, GLM, ...), latent attention, NoPE layers, learned
        or no positions and hybrid models keep flash-attention-2."""
        return self._cudnn_exact

    @property
    def router_aux_loss_config(self) -> RouterAux | None:
        """The router auxiliary loss the model adds (``config.output_router_logits=True``), or None."""
        return self._router_aux

    @property
    def logit_softcap(self) -> float | None:
        """``config.final_logit_softcapping`` (Gemma 2): the chunked loss caps the logits as the model does."""
        cap = getattr(self.hf.config, "final_logit_softcapping", None)
        return float(cap) if cap else None

    @property
    def lm_head(self) -> nn.Module:
        """The output projection (``weight`` (V, d)), as the package's models have it."""
        return self.hf.get_output_embeddings()

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, output: Literal["logits", "hidden"] = "logits") -> Tensor:
        """Logits ``(B, S, V)`` or, with ``output="hidden"``, the final (normed) hidden states ``(B, S, d)``.

        ``position_ids``: the GLOBAL positions ``(B or 1, S)`` (the strategy's batch hook shards
        them); required under sequence parallelism.
        """
        if position_ids is None and any(m.mesh is not None for m in self._attention_modules):
            raise ValueError(
                "HFCausalLM: position_ids (global positions) are required under sequence parallelism: without them the "
                "model would give each shard positions 0..S_local-1 (SequenceParallelStrategy adds them to the batch)"
            )
        # Note [Exact or refused: position-dependent layers of Hugging Face models]: local metadata, before any communication
        sp = max((m.mesh.size() for m in self._attention_modules if m.mesh is not None), default=1)
        # recurrent mixers: their twins reset the state at every document start (Note [Documents in a recurrence]);
        # mixers without a twin were refused at construction (refuse_token_mixers)
        if current_documents() is not None and getattr(self.hf, "is_gradient_checkpointing", False) and torch.is_grad_enabled():
            raise documents_error(  # Note [Per-call state]: its recomputation in backward would not see them
                f"HFCausalLM ({type(self.hf).__name__})",
                "which the model's own gradient checkpointing would recompute without (backward may run in another thread): "
                "call gradient_checkpointing_disable() and use SequenceParallelStrategy(activation_checkpointing=...)")
        packed = current_documents() is not None
        if sp > 1 or packed:
            for layer in self._attention_layers:
                check_sharded_layer(layer, seq_len=input_ids.shape[1] * sp, packed=packed)
        if output not in ("logits", "hidden"):
            raise ValueError(f"output={output!r} is not supported; expected 'logits' or 'hidden'")
        kwargs: dict[str, Any] = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
        if self._router_aux is not None:
            kwargs["output_router_logits"] = True
        self._router_stats = None
        if output == "hidden":
            self.check_chunked_head()
            out = self.hf.get_decoder()(**kwargs)  # the model without its head (LlamaModel in LlamaForCausalLM)
        else:
            out = self.hf(**kwargs)
        if self._router_aux is not None:
            self._router_stats = router_stats(out.router_logits, self._router_aux)
        return out.last_hidden_state if output == "hidden" else out.logits

    def router_aux_loss(self, mesh: DeviceMesh | None = None) -> Tensor | None:
        """This rank's share of ``router_aux_loss_coef * load_balancing_loss`` of the last forward's global batch,
        to add to the loss (Note [Router auxiliary loss under sequence parallelism] in ``lightning_seqpar.hf.moe``);
        None when the model adds no router loss. ``mesh``: every SP x DP rank (one all-reduce of E + 1 numbers)
        or None (this rank's batch is the whole batch). Consumes the statistics of the last forward."""
        stats, self._router_stats = self._router_stats, None
        if self._router_aux is None:
            return None
        if stats is None:
            raise ValueError("HFCausalLM.router_aux_loss: no forward since the last call (the router statistics are per forward)")
        return router_aux_loss_share(stats, self._router_aux, mesh)

    def check_chunked_head(self) -> None:
        """``output="hidden"`` serves the chunked loss ``hidden @ lm_head.weight^T``: refuse models whose logits are more."""
        transform = logit_transform(self.hf.config)
        if transform is not None:
            raise ValueError(f"{type(self.hf).__name__} transforms its logits after lm_head (config.{transform}), which the "
                             "chunked cross entropy does not: use loss_chunk_size=None")
        logits_head(self.lm_head, type(self.hf).__name__, adapters=(PEFT_HEAD,))  # a plain head, or one peft wraps (Note [An adapted output head])
        if self.hf.get_decoder() is self.hf:
            raise ValueError(f"{type(self.hf).__name__}: found no decoder without the head (get_decoder()); use loss_chunk_size=None")

    def head_operands(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """``(h, W)`` whose product ``h @ W^T`` is the logits of the final hidden states ``hidden`` ``(B, S, d)``: what
        the chunked loss multiplies (``lm_head.weight`` for a plain head; Note [An adapted output head] for peft's)."""
        return head_operands(self.lm_head, hidden, type(self.hf).__name__, adapters=(PEFT_HEAD,))

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at sequence length ``seq_len`` (Note [FLOPs per token] in
        ``lightning_seqpar.models.llama``): ``6 * N + 6 * n_layers * seq_len * (H * D)``, N the matmul
        weights (all parameters but the input embedding, the output head counted even when tied);
        frozen weights (a LoRA base) count 4, not 6: no weight gradient is computed for them."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        trained = self._matmul_params - self._frozen_params
        return 6 * trained + 4 * self._frozen_params + 6 * self._n_layers * seq_len * self._attn_width


# --------------------------------------------------------------------------------------------- saving


def save_hf_pretrained(model: HFCausalLM, save_directory: str | os.PathLike) -> None:
    """Write ``model.hf`` as one consolidated Hugging Face folder (``save_pretrained``: config + safetensors).

    Collective when ``torch.distributed`` is initialised: EVERY rank must call it. The FSDP2 shards
    are gathered with ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (full tensors
    on rank 0's CPU only) and rank 0 writes; a barrier follows. The folder loads with
    ``AutoModelForCausalLM.from_pretrained(save_directory)`` with no trace of this package (the
    attention implementation is not saved in the config).
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not isinstance(model, HFCausalLM):
        raise ValueError(f"save_hf_pretrained needs an HFCausalLM (a CausalLMModule built from a Hugging Face model), got {type(model).__name__}")
    distributed = dist.is_available() and dist.is_initialized()
    if distributed:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if not distributed or dist.get_rank() == 0:
        prefix = "hf."
        hf_state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        assert len(hf_state) == len(state), f"unexpected keys outside 'hf.': {sorted(set(state) - {prefix + k for k in hf_state})[:5]}"
        model.hf.save_pretrained(os.fspath(save_directory), state_dict=hf_state)
    if distributed:
        dist.barrier()

"""Hugging Face ``transformers`` causal LMs under the package's attention (and so under the strategy).

Public names:

* :data:`ATTN_IMPLEMENTATION` (``"seqpar"``), :func:`register_attention` — the name and the
  registration of :func:`seqpar_attention_forward` / :func:`seqpar_attention_mask` with
  transformers' own ``AttentionInterface`` / ``AttentionMaskInterface``.
* :func:`apply_hf_attention` — switch a ``PreTrainedModel`` to ``"seqpar"`` and give each of its
  attention layers a parameter-free :class:`lightning_seqpar.attention.Attention` child.
* :class:`HFCausalLM` — a transformers causal LM behind the interface of the package's models
  (``forward(input_ids, position_ids, output=...)``, ``lm_head``, ``flops_per_token``).
* :func:`is_hf_source`, :func:`load_hf_config`, :func:`build_hf_causal_lm` — a model from a local
  folder, a ``PretrainedConfig`` or a dict with ``"model_type"``.
* :func:`save_hf_pretrained` — a consolidated ``save_pretrained`` folder of an FSDP2-sharded model.

Note [Hugging Face models under the strategy]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every attention layer of a modern transformers model (Llama, Mistral, Qwen2/3, Gemma, ...) calls

    ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, ...)(
        self, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)

with ``query`` ``[B, H_q, S, D]`` and ``key``/``value`` ``[B, H_kv, S, D]`` (after RoPE). Nothing
of the model class is patched. :func:`apply_hf_attention`

1. registers ``"seqpar"`` with ``AttentionInterface`` (-> :func:`seqpar_attention_forward`) and
   with ``AttentionMaskInterface`` (-> :func:`seqpar_attention_mask`, which returns None: the
   attention is causal by construction, so no 4-D mask is ever materialised, whatever the length);
2. sets ``"seqpar"`` with the model's public ``set_attn_implementation``;
3. gives every attention layer a child ``seqpar_attention = Attention(causal=True, scale=layer.scaling)``.

The strategy's ``apply_attention`` finds those ``Attention`` children like the ones of the
package's own models and configures them with the sequence-parallel mesh (no global state: the
mesh lives on the module). :func:`seqpar_attention_forward` transposes to ``[B, S, H, D]`` and
calls ``layer.seqpar_attention(q, k, v)``: K/V keep their H_kv heads (GQA/MQA are never repeated,
neither in memory nor in communication).

Positions: the strategy's batch hook shards ``position_ids`` (the GLOBAL positions) with the
batch; :class:`HFCausalLM` passes them to the model, whose rotary embedding then sees each token's
position in the whole sequence. Without them a shard would get positions ``0..S_local-1``, so
:class:`HFCausalLM` refuses to run sequence-parallel without ``position_ids``.

What is rejected, with a ``ValueError`` naming the layer and the config field, before any
communication (every check reads only local metadata that is equal on all ranks):

* sliding-window layers (``config.sliding_window`` for Mistral; ``config.layer_types[i] ==
  "sliding_attention"`` for Qwen2/3 with ``use_sliding_window``, Gemma2/3 local layers) when the
  window is shorter than the sequence: window w lets query i see keys j with ``i - j < w``, so for
  a global length ``S <= w`` it IS full causal attention and runs exactly; for ``S > w`` it is
  refused, never silently turned into full attention. Checked at every call against the global
  length (local length x sequence-parallel size), and by :func:`apply_hf_attention` against
  ``max_seq_len`` when that is given;
* attention dropout > 0 in training (``config.attention_dropout``), logit soft-capping
  (``config.attn_logit_softcapping``, Gemma2), attention sinks, non-causal layers, padding or
  custom masks (a 2-D ``attention_mask`` with zeros, any 4-D mask), packed-sequence kwargs
  (``cu_seq_lens_*``: document masking is not implemented yet), and a query length different from
  the key length (KV-cache decoding: generate with ``model.set_attn_implementation("sdpa")``).

Right padding is exact without a mask (a causal token never attends to later ones): pad on the
right and set the labels of the padding to -100, as ``SequenceParallelStrategy`` checks.
"""

from __future__ import annotations

import copy
import math
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from lightning_seqpar.attention import Attention

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HFCausalLM",
    "MIN_TRANSFORMERS_VERSION",
    "apply_hf_attention",
    "build_hf_causal_lm",
    "is_hf_source",
    "load_hf_config",
    "register_attention",
    "save_hf_pretrained",
    "seqpar_attention_forward",
    "seqpar_attention_mask",
]

ATTN_IMPLEMENTATION = "seqpar"
"""The name under which the package's attention is registered with transformers."""

MIN_TRANSFORMERS_VERSION = "4.56"
"""Oldest transformers release supported (``AttentionInterface``, ``masking_utils``, ``set_attn_implementation``)."""

# kwargs of the attention interface that would change the result and that "seqpar" does not implement
_UNSUPPORTED_KWARGS: dict[str, str] = {
    "softcap": "attention logit soft-capping (config.attn_logit_softcapping)",
    "s_aux": "attention sinks",
    "sinks": "attention sinks",
    "cu_seq_lens_q": "packed sequences given as cu_seq_lens_q (put document_ids, or position_ids restarting at 0, in the batch: "
                     "SequenceParallelStrategy then masks documents itself)",
    "cu_seq_lens_k": "packed sequences given as cu_seq_lens_k (put document_ids, or position_ids restarting at 0, in the batch: "
                     "SequenceParallelStrategy then masks documents itself)",
    "head_mask": "a head mask",
}

# config fields that change the logits after ``lm_head`` (the chunked loss computes hidden @ W^T only)
_LOGIT_TRANSFORMS: tuple[tuple[str, object], ...] = (
    ("final_logit_softcapping", None),
    ("logit_scale", 1.0),
    ("logits_scaling", 1.0),
)


def _transformers() -> Any:
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
    transformers = _transformers()
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


def _layer_name(module: nn.Module) -> str:
    layer_idx = getattr(module, "layer_idx", None)
    return f"{type(module).__name__}" + (f" (layer {layer_idx})" if layer_idx is not None else "")


def _window_field(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    layer_idx = getattr(module, "layer_idx", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_idx is not None and layer_idx < len(layer_types):
        return f"config.sliding_window with config.layer_types[{layer_idx}]={layer_types[layer_idx]!r}"
    return "config.sliding_window"


def _sliding_window_error(module: nn.Module, window: int, seq_len: int, what: str, where: str = "") -> ValueError:
    return ValueError(
        f"{_layer_name(module)}{where} uses sliding-window attention ({_window_field(module)}={window}) and the {what} is "
        f"{seq_len} > {window}: attn_implementation={ATTN_IMPLEMENTATION!r} has no sliding window and would "
        f"silently give full attention. Train with sequences of at most {window} tokens (then the window covers "
        "everything and full causal attention is exact), or use a model / config without sliding-window layers "
        "(e.g. Qwen2 with use_sliding_window=False)"
    )


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
    name = _layer_name(module)
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
    window = kwargs.get("sliding_window")
    if window is not None:
        sp = 1 if attention.mesh is None else attention.mesh.size()
        seq_len = query.shape[2] * sp
        if seq_len > window:
            raise _sliding_window_error(module, window, seq_len, "sequence length" + (f" (local {query.shape[2]} x {sp} ranks)" if sp > 1 else ""))
    # [B, H, S, D] -> [B, S, H, D], the layout of the package's attention (and HF's expected output)
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    return out, None


# --------------------------------------------------------------------------------------------- applying it


def _is_attention_layer(module: nn.Module) -> bool:
    """A transformers attention layer: it has a softmax ``scaling``, an ``is_causal`` flag and the model config."""
    scaling = getattr(module, "scaling", None)
    return (
        isinstance(scaling, (int, float))
        and not isinstance(scaling, bool)
        and hasattr(module, "is_causal")
        and hasattr(module, "config")
    )


def _sliding_window(module: nn.Module) -> int | None:
    """The layer's sliding window: its own ``sliding_window`` (Qwen2/3, Gemma) or the config's (Mistral)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(module.config, "sliding_window", None)


def apply_hf_attention(model: nn.Module, *, max_seq_len: int | None = None) -> int:
    """Make a transformers ``PreTrainedModel`` run the package's attention (Note [Hugging Face models under the strategy]).

    Registers ``"seqpar"``, sets it with ``model.set_attn_implementation`` and gives every attention
    layer a child ``seqpar_attention = Attention(causal=True, scale=layer.scaling)`` (kept, with
    its mesh configuration, if already there). In place; returns the number of attention layers. Without a strategy the
    ``Attention`` children run local attention; the strategy's ``apply_attention`` configures them.

    Args:
        model: a transformers ``PreTrainedModel`` whose attention layers call ``AttentionInterface``.
        max_seq_len: the longest (global) sequence to be trained on. When given, sliding-window
            layers whose window is shorter raise here; in any case every call checks the window
            against the actual length.

    Raises:
        ValueError: not a ``PreTrainedModel``, a model whose attention does not go through
            ``AttentionInterface``, no attention layer found, or a sliding window < ``max_seq_len``.
    """
    transformers = _transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise ValueError(f"model must be a transformers.PreTrainedModel, got {type(model).__name__}")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1):
        raise ValueError(f"max_seq_len must be a positive int or None, got {max_seq_len!r}")
    register_attention()
    layers = [(name, m) for name, m in model.named_modules() if _is_attention_layer(m)]
    if max_seq_len is not None:
        for name, layer in layers:
            window = _sliding_window(layer)
            if window is not None and window < max_seq_len:
                raise _sliding_window_error(layer, window, max_seq_len, "max_seq_len", where=f" at {name!r}")
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION or not layers:
        raise ValueError(
            f"{type(model).__name__} does not route its attention through transformers.AttentionInterface "
            f"(attn_implementation is {model.config._attn_implementation!r}, {len(layers)} attention layers found), "
            "so the sequence-parallel attention cannot be installed without patching it; supported: models whose "
            "attention layers call ALL_ATTENTION_FUNCTIONS.get_interface (Llama, Mistral, Qwen2/3, Gemma, ...)"
        )
    for _, layer in layers:
        child = getattr(layer, "seqpar_attention", None)
        if isinstance(child, Attention):  # applied before: keep its mesh configuration, follow the layer's scale
            child.scale = float(layer.scaling)
        else:
            layer.seqpar_attention = Attention(causal=True, scale=float(layer.scaling))  # a registered child module
    return len(layers)


# --------------------------------------------------------------------------------------------- building


def is_hf_source(model: object) -> bool:
    """Whether ``model`` designates a transformers causal LM: a local folder with ``config.json``, a
    ``PretrainedConfig``, a ``PreTrainedModel`` or a mapping with a ``"model_type"`` key."""
    if isinstance(model, (str, os.PathLike)):
        return os.path.isfile(os.path.join(os.fspath(model), "config.json"))
    if isinstance(model, Mapping):
        return "model_type" in model
    transformers = sys.modules.get("transformers")  # an object of transformers exists only once it is imported
    return transformers is not None and isinstance(model, (transformers.PretrainedConfig, transformers.PreTrainedModel))


def load_hf_config(source: Any) -> PretrainedConfig:
    """The ``PretrainedConfig`` of an :func:`is_hf_source` ``source`` (a folder is read, nothing is downloaded)."""
    transformers = _transformers()
    if isinstance(source, transformers.PreTrainedModel):
        return source.config
    if isinstance(source, transformers.PretrainedConfig):
        return source
    if isinstance(source, Mapping):
        fields = dict(source)
        return transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model={path!r} is not a local Hugging Face model folder (no config.json)")
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    raise ValueError(
        f"model must be a local Hugging Face model folder, a transformers.PretrainedConfig, a PreTrainedModel or a dict "
        f"with 'model_type'; got {type(source).__name__}"
    )


def build_hf_causal_lm(source: Any, *, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A transformers causal LM: ``from_pretrained`` of a local folder (weights included), or ``from_config``
    (random init, from the current torch random state) of a config or a dict with ``"model_type"``.

    Built on the current default device (the strategy's ``tensor_init_context`` sets it) in ``dtype``
    (default: ``torch.get_default_dtype()``, which Lightning's precision plugin sets).
    """
    transformers = _transformers()
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if isinstance(source, transformers.PreTrainedModel):
        return source
    if isinstance(source, (str, os.PathLike)):
        load_hf_config(source)  # the folder check, with its error message
        return transformers.AutoModelForCausalLM.from_pretrained(os.fspath(source), dtype=dtype, local_files_only=True)
    config = copy.deepcopy(load_hf_config(source))  # the model owns its config: set_attn_implementation changes it
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


# --------------------------------------------------------------------------------------------- the model


def _is_peft_model(model: object) -> bool:
    peft = sys.modules.get("peft")  # a PeftModel exists only once peft is imported
    return peft is not None and isinstance(model, peft.PeftModel)


class HFCausalLM(nn.Module):
    """A transformers causal LM with the interface of the package's models (what ``CausalLMModule`` calls).

    ``forward(input_ids, position_ids)`` -> logits ``(B, S, V)``; ``output="hidden"`` -> the final
    hidden states ``(B, S, d)`` for the chunked loss over ``lm_head.weight``. The transformers model
    is the child ``hf`` (parameter names ``hf.<transformers name>``); its decoder layers
    (``hf.model.layers``) are the blocks that the strategy checkpoints and shards.

    Args:
        model: a transformers ``PreTrainedModel`` for causal LM (:func:`apply_hf_attention` is applied),
            or a ``peft.PeftModel`` wrapping one (``lightning_seqpar.lora``).
        max_seq_len: see :func:`apply_hf_attention`.
    """

    def __init__(self, model: PreTrainedModel, *, max_seq_len: int | None = None) -> None:
        super().__init__()
        # a peft.PeftModel (LoRA): the attention layers are its base model's (Note [LoRA under the strategy])
        base = model.get_base_model() if _is_peft_model(model) else model
        apply_hf_attention(base, max_seq_len=max_seq_len)
        self.hf = model
        # tuple, not a list of modules: not registered twice (they are children of the layers)
        self._attention_modules = tuple(m for m in model.modules() if isinstance(m, Attention))
        config = model.config
        head = model.get_output_embeddings()
        embedding = model.get_input_embeddings()
        tied = head is not None and embedding is not None and head.weight is embedding.weight
        excluded = None if embedding is None or tied else embedding.weight  # the input embedding: a lookup, not a matmul
        n = sum(p.numel() for p in model.parameters()) - (0 if excluded is None else excluded.numel())
        # frozen weights (LoRA's base) cost forward + input gradient (4 per weight), no weight gradient
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad and p is not excluded)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self._matmul_params = n
        self._frozen_params = frozen
        self._attn_width = heads * head_dim
        self._n_layers = config.num_hidden_layers

    @property
    def config(self) -> PretrainedConfig:
        """The transformers config."""
        return self.hf.config

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
        if output == "hidden":
            self._check_plain_head()
            decoder = self.hf.get_decoder()  # the model without its head (LlamaModel in LlamaForCausalLM)
            if decoder is self.hf:
                raise ValueError(f"{type(self.hf).__name__}: found no decoder without the head (get_decoder()); use loss_chunk_size=None")
            return decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        if output != "logits":
            raise ValueError(f"output={output!r} is not supported; expected 'logits' or 'hidden'")
        return self.hf(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits

    def _check_plain_head(self) -> None:
        """``output="hidden"`` serves the chunked loss ``hidden @ lm_head.weight^T``: refuse models whose logits are more."""
        config = self.hf.config
        for field, neutral in _LOGIT_TRANSFORMS:
            value = getattr(config, field, neutral)
            if value is not None and value != neutral:
                raise ValueError(
                    f"{type(self.hf).__name__} transforms its logits after lm_head (config.{field}={value}), which the "
                    "chunked cross entropy does not: use loss_chunk_size=None"
                )
        head = self.lm_head
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"{type(self.hf).__name__}'s lm_head has a bias, which the chunked cross entropy ignores: use loss_chunk_size=None")

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

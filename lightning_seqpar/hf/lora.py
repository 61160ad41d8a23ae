"""LoRA fine-tuning of Hugging Face causal LMs through ``peft``, under the strategy or on one device.

Public names:

* :func:`lora_config` — a ``peft.LoraConfig`` from a dict of its fields (what a recipe gives) or a
  ``LoraConfig``; :func:`lora_hparams` — the inverse, as plain values a checkpoint can hold.
* :func:`apply_lora` — ``peft.get_peft_model`` over a transformers model (adapters in fp32).
* :func:`is_peft_model`, :func:`upcast_trainable` — what the strategy and ``CausalLMModule`` use.
* :func:`adapter_state_dict`, :func:`save_lora_pretrained` — the adapter folder of a (sharded) model.
* :data:`PEFT_HEAD` (:class:`PeftHead`) — peft's output head for ``lightning_seqpar.loss.head``: what the chunked
  loss multiplies by when the output head is wrapped by peft (Note [An adapted output head]).

Note [Adapters in bf16]
~~~~~~~~~~~~~~~~~~~~~~~
peft's ``lora.Linear`` casts its input to the adapter's dtype (``x.to(lora_A.weight.dtype)``) and
``lora_A`` keeps that cast for its backward: with fp32 adapters over a bf16 base, every adapted layer
holds an fp32 copy of its input through the block's backward, one per layer even where q, k and v
read the same tensor, plus the fp32 sum of base and adapter outputs. On the Llama-3-8B shape with
every linear layer adapted that is ~96 KB per token and layer at the block's peak against the 8 KB
of the block's own input (the planner's estimate for the options measured on one H200 at 256K, 112.5 GB
peak: 126.4 GB with the copies, 104.9 GB without). ``SequenceParallelStrategy(bf16_adapters=True)``
gives FSDP2 ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: the adapters' shards stay
fp32 (and their AdamW state), the gathered adapters that the forward and backward use are bf16, and
their gradients are reduce-scattered in fp32 into fp32 shards. ``lora_A.weight.dtype`` is then bf16,
peft's cast is a no-op, and ``lora_A`` saves the input tensor itself, shared by the layers that read
it (measured here on CPU with saved-tensor hooks, a d = 256 Llama layer: 15,352 -> 9,096 bytes per token).
The adapter path computes in bf16 (the matmuls accumulate in fp32), what ``torch.autocast`` does in
Hugging Face training with fp32 adapters; the frozen base is bf16 either way. Off by default (the
adapters then compute in fp32, as peft's own model does); ``memory="auto"`` turns it on first when
memory binds, since it costs no time.

Note [LoRA under the strategy]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
LoRA (Hu et al., 2021) is peft's: ``get_peft_model`` wraps the transformers model

    PeftModelForCausalLM -> LoraModel -> LlamaForCausalLM -> LlamaModel -> layers[i] -> q_proj: lora.Linear
                                                                                          base_layer (frozen)
                                                                                          lora_A / lora_B (trained)

and nothing of it is rewritten here. ``HFCausalLM`` holds the ``PeftModel`` as ``hf``;
``apply_hf_attention`` runs on its base model (the ``PreTrainedModel``), and the strategy finds
the decoder layers (``hf.base_model.model.model.layers``, an ``nn.ModuleList`` named ``layers``),
checkpoints and shards them as for any Hugging Face model. The loss and its normalisation do not
change (Note [Loss under sequence parallelism] in ``lightning_seqpar.training.module``): an adapter's
gradient is the sum of the per-rank gradients, as for any parameter.

Precision. The frozen base is held in the Trainer's precision (bf16 with ``precision="bf16-true"``:
Lightning's ``convert_module`` casts the whole module), and the strategy then puts the trainable
parameters (the adapters) back in fp32 (:func:`upcast_trainable`), before FSDP2 shards anything:
their AdamW state is fp32 too. peft's ``lora.Linear`` casts its input to the adapter's dtype and
the adapter's output back to the base's, so the adapter path computes in fp32.

FSDP2 with two dtypes in one block. ``fully_shard(block)`` puts all parameters of the block in
one ``FSDPParamGroup``. It requires ONE dtype only among the parameters that require gradients
(``FSDPParamGroup._init_mp_dtypes``: "FSDP expects uniform original parameter dtype" is checked
over ``requires_grad`` parameters, and the reduce-scatter over their gradients), and it
all-gathers a group of mixed dtypes as bytes (``_get_all_gather_input_metadatas`` switches the
all-gather buffer to uint8). So the one ``fully_shard`` per block that the strategy applies works
as it is, with bf16 frozen weights and fp32 adapters (both behaviours read in torch 2.13's FSDP2
code and in older releases'; run here on 2.13 CPU/gloo, and by ``tests/test_lora_gpu.py`` on the
GPU image's 2.11); frozen parameters get no gradient and no reduce-scatter. No
``MixedPrecisionPolicy`` is needed with "bf16-true". With "bf16-mixed" the base stays fp32 and is
gathered in bf16 (more memory; use "bf16-true" for LoRA).

Optimizer and checkpoints. ``CausalLMModule.configure_optimizers`` takes the parameters that
require gradients only, so the base has no optimizer state. The strategy's checkpoints hold the
WHOLE module state (frozen base included) and the adapters' optimizer state: resuming is exact
and needs nothing but the checkpoint, at the cost of writing the base with every checkpoint.

Export. :func:`save_lora_pretrained` (``CausalLMModule.save_hf_pretrained``, ``hf_save_dir``)
gathers the adapters' FSDP2 shards to rank 0 and writes ``PeftModel.save_pretrained``'s folder
(``adapter_config.json``, ``adapter_model.safetensors``); ``PeftModel.from_pretrained(base,
folder)`` loads it. ``lightning_seqpar.hf.export.export_lora`` (``seqpar export CKPT OUT --format lora [--merged DIR]``)
does the same from a checkpoint in one process and, with ``merged``, writes
``merge_and_unload()`` of the model as a plain transformers folder.

Note [An adapted output head]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The chunked cross entropy (``loss_chunk_size``) never forms the full logits: it multiplies the final
hidden states by ``lm_head.weight`` one chunk at a time. When peft wraps the head, ``lm_head.weight``
is no longer what the head computes with: a LoRA layer's ``weight`` is its frozen base weight (the
adapters would be left out of the loss and get no gradient: a silent wrong answer, found by an
independent check with ``target_modules=["q_proj", "lm_head"]``), and a ``TrainableTokensWrapper``
changes some rows. So the head is resolved first (``lightning_seqpar.loss.head.logits_head`` with
:data:`PEFT_HEAD`): a plain ``nn.Linear`` without bias is used as it is; ``ModulesToSaveWrapper``
(``modules_to_save=["lm_head"]``) by its active copy; a LoRA layer is written as ONE matrix product over r more columns per adapter,

    head(h) = h W^T + sum_a s_a (dropout_a(h) A_a^T) B_a^T = [h | u_1 | ... ] @ [W | s_1 B_1 | ... ]^T,
    u_a = dropout_a(h) A_a^T (N, r_a), computed once for all tokens as peft does (fp32 adapters),

so the chunked loss runs unchanged on the widened operands (:meth:`PeftHead.operands`) and A, B get
their gradients through it. The price: a copy of the hidden states and of W widened by r columns,
and W's part of the fp32 weight gradient that the chunked loss forms once the concatenated weight
needs a gradient (the planner counts them). u and s B enter the product in the hidden states'
dtype (bf16 under "bf16-true"), where peft adds the adapter's fp32 output to the bf16 base output:
the same up to the rounding of the adapter's term. Anything else is refused by name before the
model runs: a DoRA or other LoRA variant on the head, ``lora_bias``, ``fan_in_fan_out``, adapters
merged into a disabled layer, trainable tokens on the head, another peft tuner, a head that is
not an ``nn.Linear``.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightning_seqpar.loss.head import USE_FULL_LOGITS, is_plain_linear, logits_head

if TYPE_CHECKING:
    from peft import LoraConfig, PeftModel

__all__ = [
    "PEFT_HEAD",
    "PeftHead",
    "adapter_state_dict",
    "apply_lora",
    "is_peft_model",
    "lora_config",
    "lora_hparams",
    "save_lora_pretrained",
    "upcast_trainable",
]

_CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper prefix, not in state_dict names
_HF_PREFIX = "hf."  # HFCausalLM's child
# LoraConfig fields that describe the run, not the adapters (peft fills them in)
_BOOKKEEPING = ("peft_type", "task_type", "peft_version", "auto_mapping", "base_model_name_or_path", "revision")


def _peft() -> Any:
    """The peft module, or an ImportError saying how to install it."""
    try:
        import peft
    except ImportError as error:
        raise ImportError("LoRA fine-tuning needs `peft`: pip install 'lightning-seqpar[lora]' (or pip install 'peft>=0.13')") from error
    return peft


def is_peft_model(model: object) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (False when peft is not imported: then none can exist)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def lora_config(spec: Mapping[str, Any] | LoraConfig) -> LoraConfig:
    """A ``peft.LoraConfig`` for a causal LM (``task_type="CAUSAL_LM"``) from ``spec``.

    Args:
        spec: a ``LoraConfig`` (copied), or a mapping of its fields, e.g.
            ``{"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}`` (a recipe's ``lora:``).

    Raises:
        ValueError: another peft method, a task other than causal LM, or an unknown field.
    """
    peft = _peft()
    if isinstance(spec, peft.PeftConfig):
        if not isinstance(spec, peft.LoraConfig):
            raise ValueError(f"lora: only LoRA is supported (peft.LoraConfig), got {type(spec).__name__}")
        config = copy.deepcopy(spec)
    elif isinstance(spec, Mapping):
        fields = dict(spec)
        unknown = sorted(set(fields) - set(peft.LoraConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"lora: {unknown} are not fields of peft.LoraConfig (e.g. r, lora_alpha, lora_dropout, target_modules)")
        fields.setdefault("task_type", "CAUSAL_LM")
        config = peft.LoraConfig(**fields)
    else:
        raise ValueError(f"lora must be a dict of peft.LoraConfig fields or a peft.LoraConfig, got {type(spec).__name__}")
    task = config.task_type
    if task is not None and str(getattr(task, "value", task)) != "CAUSAL_LM":
        raise ValueError(f"lora: task_type={task!r}; CausalLMModule trains causal LMs (task_type='CAUSAL_LM')")
    config.task_type = "CAUSAL_LM"
    if config.target_modules is None and not config.target_parameters:
        raise ValueError("lora: set target_modules (e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj'] or 'all-linear')")
    return config


def _plain(value: Any) -> Any:
    """A value as plain Python (sets -> sorted lists, enums -> their value) for checkpoints and YAML."""
    if isinstance(value, (set, frozenset)):
        return sorted(_plain(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    enum_value = getattr(value, "value", None)
    return enum_value if enum_value is not None and type(value).__module__.startswith("peft") else value


def lora_hparams(config: LoraConfig) -> dict[str, Any]:
    """Every field of ``config`` (defaults included, so that another peft version's defaults cannot change
    the adapters), as plain values: ``lora_config`` of the result gives the same adapters (what
    ``CausalLMModule`` keeps in its hyper-parameters, and ``export_lora`` rebuilds the model from)."""
    return {k: _plain(v) for k, v in config.to_dict().items() if k not in _BOOKKEEPING}


def apply_lora(model: nn.Module, config: Mapping[str, Any] | LoraConfig) -> PeftModel:
    """``peft.get_peft_model(model, config)``: the base frozen, the adapters trainable and in fp32.

    ``model`` is a transformers ``PreTrainedModel`` (not yet wrapped by peft); it is modified in
    place (peft replaces the targeted layers). The adapters are initialised from the current torch
    random state (``CausalLMModule`` forks it with ``init_seed``).
    """
    peft = _peft()
    if is_peft_model(model):
        raise ValueError("apply_lora: the model is already a peft.PeftModel; pass it as the model without a lora config")
    config = lora_config(config)
    # autocast_adapter_dtype: peft creates fp16 / bf16 adapters in fp32 (its default, said here)
    peft_model = peft.get_peft_model(model, copy.deepcopy(config), autocast_adapter_dtype=True)
    upcast_trainable(peft_model)
    return peft_model


def upcast_trainable(module: nn.Module, dtype: torch.dtype = torch.float32) -> int:
    """Put the trainable floating-point parameters of every ``PeftModel`` inside ``module`` in ``dtype``.

    The strategy calls it after Lightning's ``convert_module`` ("bf16-true" casts every parameter),
    before FSDP2 (Note [LoRA under the strategy]). Frozen parameters keep their dtype. In place;
    returns how many parameters were cast (0 without a peft model).
    """
    cast = 0
    for model in [m for m in module.modules() if is_peft_model(m)]:
        for param in model.parameters():
            if param.requires_grad and param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
                cast += 1
    return cast


def _peft_model(model: nn.Module) -> PeftModel:
    """The ``PeftModel`` of an ``HFCausalLM`` (its ``hf``), or a ValueError."""
    inner = getattr(model, "hf", model)
    if not is_peft_model(inner):
        raise ValueError(f"expected an HFCausalLM holding a peft.PeftModel (CausalLMModule with lora=...), got {type(inner).__name__}")
    return inner


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full trainable parameters of ``model`` (the adapters) on the CPU, under ``model``'s own names
    without activation-checkpoint wrappers (``hf.base_model.model....lora_A.default.weight`` for an HFCausalLM).

    Collective when ``model`` is sharded by FSDP2: every rank must call it (each parameter's shards
    are all-gathered, in the same order on every rank); every rank gets the result.
    """
    from torch.distributed.tensor import DTensor

    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            out[name.replace(_CHECKPOINT_WRAPPER, "")] = full.detach().to("cpu", copy=True)
    return out


def save_lora_pretrained(model: nn.Module, save_directory: str | os.PathLike) -> None:
    """Write the adapters of an ``HFCausalLM`` holding a ``PeftModel`` as ``PeftModel.save_pretrained``'s
    folder (``adapter_config.json``, ``adapter_model.safetensors``); rank 0 writes.

    Collective when ``torch.distributed`` is initialised: every rank must call it (only the
    adapters are gathered, not the base). ``PeftModel.from_pretrained(base_model, save_directory)``
    loads it onto a fresh copy of the base model.
    """
    import torch.distributed as dist

    peft_model = _peft_model(model)
    distributed = dist.is_available() and dist.is_initialized()
    state = adapter_state_dict(model)
    if not distributed or dist.get_rank() == 0:
        prefix = _HF_PREFIX if peft_model is not model else ""
        peft_state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        assert len(peft_state) == len(state), f"trainable parameters outside {prefix!r}: {sorted(state)[:5]}"
        _skeleton(peft_model).save_pretrained(os.fspath(save_directory), state_dict=peft_state)
    if distributed:
        dist.barrier()


def _skeleton(peft_model: PeftModel) -> PeftModel:
    """The same peft model on the meta device, without the strategy's wrappers: what ``save_pretrained`` walks.

    peft finds the adapter entries of a state dict by the names of the model's LoRA layers, and
    under activation checkpointing those names hold the wrapper (``layers.0._checkpoint_wrapped_module.
    self_attn``); the skeleton has the plain names of the state dict. No weight is allocated.
    """
    import transformers

    peft = _peft()
    base = peft_model.get_base_model()
    config = copy.deepcopy(peft_model.peft_config[peft_model.active_adapter])
    layout = copy.deepcopy(config)
    layout.init_lora_weights = True  # data-dependent initialisations (PiSSA, ...) cannot run on meta; the weights come from the state dict
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(base.config))
        skeleton = peft.get_peft_model(skeleton, layout, adapter_name=peft_model.active_adapter, autocast_adapter_dtype=False)
    skeleton.peft_config[skeleton.active_adapter] = config  # the adapter_config.json of the trained adapters
    return skeleton


# --------------------------------------------------------------------------------------------- the output head


class PeftHead:
    """peft's wrappers of an output head, for the head interface (:class:`lightning_seqpar.loss.head.HeadAdapter`;
    Note [An adapted output head]): a LoRA layer over a plain ``nn.Linear`` without bias is written as one product
    over widened operands; ``ModulesToSaveWrapper`` resolves to its active copy; what the chunked loss would get
    wrong is refused by name. Nothing is resolved while peft is not imported (then no peft wrapper can exist)."""

    def resolve(self, head: nn.Module, owner: str) -> nn.Module | None:
        """The module whose product the chunked loss forms for a peft wrapper ``head``; None when ``head`` is none.

        Raises:
            ValueError: naming ``owner`` (the model) and what the head is, for anything the chunked loss would get wrong.
        """
        peft = sys.modules.get("peft")
        if peft is None:
            return None
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils import other

        ModulesToSaveWrapper = other.ModulesToSaveWrapper
        TrainableTokensWrapper = getattr(other, "TrainableTokensWrapper", ())  # peft >= 0.15
        if isinstance(head, ModulesToSaveWrapper):
            active = [a for a in head.active_adapters if a in head.modules_to_save] if not head.disable_adapters else []
            if len(active) > 1:
                raise ValueError(f"{owner}: lm_head has {len(active)} active modules_to_save copies {active}; activate one")
            return logits_head(head.modules_to_save[active[0]] if active else head.original_module, owner, adapters=(self,))
        if isinstance(head, TrainableTokensWrapper):
            if head.disable_adapters or not head.active_adapters:
                return logits_head(head.original_module, owner, adapters=(self,))
            raise ValueError(f"{owner}: lm_head carries peft trainable tokens (trainable_token_indices with tied "
                             f"embeddings), whose rows the chunked cross entropy would not see: {USE_FULL_LOGITS}")
        if isinstance(head, LoraLayer):
            base = head.get_base_layer()
            if not is_plain_linear(base):
                raise ValueError(f"{owner}: lm_head is a LoRA layer over a {type(base).__name__}, not a plain nn.Linear "
                                 f"without bias: {USE_FULL_LOGITS}")
            if head.fan_in_fan_out:
                raise ValueError(f"{owner}: lm_head's LoRA layer has fan_in_fan_out=True: {USE_FULL_LOGITS}")
            if head.merged and head.disable_adapters:
                raise ValueError(f"{owner}: lm_head's adapters are merged into its weight but disabled: unmerge them first")
            if not head.merged and not head.disable_adapters:
                for a in head.active_adapters:
                    if a not in head.lora_A:
                        continue
                    if a in getattr(head, "lora_variant", {}) or getattr(head, "use_dora", {}).get(a):
                        raise ValueError(f"{owner}: lm_head's adapter {a!r} is a LoRA variant (DoRA or another "
                                         f"use_* option of LoraConfig): {USE_FULL_LOGITS}, or leave lm_head out of target_modules")
                    if head.lora_B[a].bias is not None:
                        raise ValueError(f"{owner}: lm_head's adapter {a!r} has lora_bias=True: {USE_FULL_LOGITS}")
            return head
        if isinstance(head, BaseTunerLayer):
            raise ValueError(f"{owner}: lm_head is a peft {type(head).__name__} (only LoRA is supported on the head): {USE_FULL_LOGITS}")
        return None

    def operands(self, layer: nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, W)`` with ``h @ W^T`` the logits ``layer(hidden)`` of a LoRA head (Note [An adapted output head]):
        ``hidden`` widened by each active adapter's ``dropout(hidden) A^T`` and the base weight by its
        ``scaling x B``; a merged or disabled head is its base weight. ``hidden``: ``(..., d)``."""
        base = layer.get_base_layer()
        if layer.merged or layer.disable_adapters:
            return hidden, base.weight
        xs, ws = [hidden], [base.weight]
        for a in layer.active_adapters:
            if a not in layer.lora_A:
                continue
            lora_a = layer.lora_A[a]
            u = lora_a(layer.lora_dropout[a](hidden.to(lora_a.weight.dtype)))  # (..., r): peft's fp32 adapter path
            xs.append(u.to(hidden.dtype))
            ws.append((layer.lora_B[a].weight * layer.scaling[a]).to(base.weight.dtype))  # (V, r)
        if len(xs) == 1:
            return hidden, base.weight
        return torch.cat(xs, dim=-1), torch.cat(ws, dim=-1)


PEFT_HEAD = PeftHead()
"""The head adapter that ``HFCausalLM`` hands to ``lightning_seqpar.loss.head`` (Note [An adapted output head])."""

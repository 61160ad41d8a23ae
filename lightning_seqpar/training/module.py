"""``CausalLMModule``: next-token training of a causal LM, on one device or under the strategy.

Note [Loss under sequence parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under ``SequenceParallelStrategy`` each rank holds a shard of the sequences of its data-parallel
slice. ``training_step`` returns this rank's share of the global mean (its token-loss sum over
the number of valid tokens of ALL ranks, ``lightning_seqpar.loss.global_mean_loss``); the shares
add up to the single-device loss, and FSDP2 sums the gradients (Note [Gradient reduction] in
``lightning_seqpar.parallel.parallelize``). The logged ``train/loss`` is that sum, so it equals the
single-device loss of the same batch. Without the strategy (one device, or DDP) the loss is the
plain per-rank token mean.

A Hugging Face MoE model with ``config.output_router_logits=True`` adds, as transformers does,
``router_aux_loss_coef`` x the router load-balancing loss of the whole (global) batch: each rank
adds its share, which sum to it (Note [Router auxiliary loss under sequence parallelism] in
``lightning_seqpar.hf.moe``), so ``train/loss`` is transformers' own loss of the batch.
Validation logs the cross entropy only.

Note [Loss under gradient accumulation]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``Trainer(accumulate_grad_batches=k)`` one optimizer step sums the gradients of k micro-batches,
each of whose losses Lightning divides by k. Normalising each micro-batch by its own token count
would weigh a token of a short-answer micro-batch more than one of a long answer (chat data with
assistant-only labels: counts differ by orders of magnitude), so the step would not be the
gradient of the mean over the step's trained tokens (the gradient-accumulation defect transformers
fixed in 2024 with ``num_items_in_batch``). The exact step needs the count of the whole window,
known only after its last micro-batch; so under accumulation micro-batch i returns

    (S_i + N_i x aux_i) / N_ref          S_i: this rank's token-loss sum, N_i: the micro-batch's global count,
                                         N_ref: the window's first global count (>= 1), aux_i: the router share

and after the window's last backward (``on_after_backward``, before any ``on_before_optimizer_step``
hook and before gradient clipping) every gradient is multiplied by ``k x N_ref / sum_i N_i``: the
gradient is then ``sum_i (dS_i + N_i daux_i) / sum_i N_i``, that of the mean over every trained token
of the window (a MoE router loss weighted by its micro-batch's share of the tokens; 0 when no token
of the window is trained). Exact for a partial last window too (Lightning divides by k there as
well). The logged ``train/loss`` stays each micro-batch's own mean.

Note [The loss chunk by default]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The full logits are the largest tensors of a long step: 32K tokens per rank x Qwen3's 151,936
vocabulary hold 70 GB at the loss (bf16 logits, their fp32 copy, softmax and gradient), against
~9 GB per 8,192-token chunk of the chunked cross entropy (Note [Chunked cross entropy] in
``lightning_seqpar.loss.cross_entropy``), which costs the same three matmuls per token and gives the same loss and
gradients. TRL chunks its NLL by default too. So ``loss_chunk_size="auto"`` (the default) is
:data:`LOSS_CHUNK_AUTO` wherever the chunked loss is known to compute the model's own logits -- the
package's models, and the transformers model types of ``hf.CHUNKED_LOSS_MODEL_TYPES``, whose
``ForCausalLM`` computes ``lm_head(decoder(x))`` (Gemma 2 / 3 soft-capped, which the chunked loss
applies itself), each checked chunked against the full logits in tests/test_head.py -- and the full
logits for every other model: a wrong logit is a silent wrong gradient, and transformers' causal LMs
change their logits after the head in ways a config field does not always name (Cohere's
``logit_scale``, Granite's ``logits_scaling``, Falcon-H1's ``lm_head_multiplier``, soft-caps under
other names, vocabulary slicing). A listed model whose head is not a plain linear layer (peft's
adapted head is) falls back too, when the model is built (logged). An int or None chosen by the user is
kept (an int refused, by name, for a model it cannot serve). Before this default, a Llama-3.2-1B
model at 128K on one GPU needed ``loss_chunk_size`` set or ran out of memory in its loss.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any, ClassVar, Literal

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from torch.distributed.device_mesh import DeviceMesh
from torchmetrics.aggregation import MeanMetric
from typing_extensions import override

from lightning_seqpar import hf
from lightning_seqpar.hf import lora as lora_module
from lightning_seqpar.attention import Attention
from lightning_seqpar.checks import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, Range, check_options, option_hints
from lightning_seqpar.data.chars import BitsPerCharacter
from lightning_seqpar.sharding.documents import batch_documents, documents_error, set_current_documents
from lightning_seqpar.loss.cross_entropy import IGNORE_INDEX, chunked_cross_entropy_sum, global_token_count, token_cross_entropy_sum
from lightning_seqpar.parallel.mesh import MESH_AXES
from lightning_seqpar.models.gpt import GPT, GPTConfig
from lightning_seqpar.models.llama import Llama, LlamaConfig
from lightning_seqpar.models.registry import build_model, family_of, is_named_config, resolve_config
from lightning_seqpar.models.transnormer import TransNormer, TransNormerConfig
from lightning_seqpar.parallel.parallelize import uses_linear_attention
from lightning_seqpar.strategy import SequenceParallelStrategy

__all__ = ["LOSS_CHUNK_AUTO", "CausalLMModule", "batch_samples", "batch_tokens"]

LOSS_CHUNK_AUTO = 8192
"""``loss_chunk_size="auto"``: the tokens per chunk of the chunked cross entropy (Note [The loss chunk by default])."""


class CausalLMModule(L.LightningModule):
    """A causal LM (Llama, TransNormerLLM, the LSS GPT or a Hugging Face model) with AdamW and a warmup-cosine schedule.

    Args:
        model: a :class:`~lightning_seqpar.models.LlamaConfig`,
            :class:`~lightning_seqpar.models.TransNormerConfig` or
            :class:`~lightning_seqpar.models.GPTConfig`, or the name of one
            (``LlamaConfig.from_name``: "tiny", "llama-7b", "llama-7b-gqa", "llama-33h", "llama3-8b", ...;
            ``TransNormerConfig.from_name``: "tnl-tiny", "tnl-385m", "tnl-1b", "tnl-7b";
            ``GPTConfig.from_name``: "lss-gpt-small", "lss-gpt-1.5b", "gpt-tiny", "gpt-tiny-mqa").
            A dict of its fields is accepted too (the config class that has all of its keys as
            fields, Note [The model registry] in ``lightning_seqpar.models.registry``):
            checkpoints store the config that way, so that ``torch.load(weights_only=True)`` reads
            them (the annotation leaves it out so that the CLI checks the keys of a config given in
            YAML against the config classes).
            A Hugging Face causal LM (``lightning_seqpar.hf``, needs ``transformers``): the path of a
            local model folder (``from_pretrained``, weights included), a ``transformers.PretrainedConfig``
            or a dict with ``"model_type"`` or an :class:`~lightning_seqpar.hf.HFConfigSpec` (its form in a
            recipe) (``from_config``, random init from ``init_seed``), or a
            ``PreTrainedModel``. It runs unchanged with the package's attention
            (Note [Hugging Face models under the strategy] in ``lightning_seqpar.hf``); ``self.model`` is
            then an :class:`~lightning_seqpar.hf.HFCausalLM` holding it as ``self.model.hf``.
        lr: peak learning rate, reached after ``warmup_steps``.
        weight_decay: AdamW weight decay of the matrices (norm weights are not decayed).
        betas: AdamW betas.
        eps: AdamW epsilon.
        warmup_steps: linear warmup from ``lr / warmup_steps`` to ``lr``.
        max_steps: end of the cosine decay; None: the Trainer's ``estimated_stepping_batches``.
        min_lr_ratio: the cosine decays to ``min_lr_ratio * lr``.
        loss_chunk_size: an int runs the chunked cross entropy that holds the logits of at most this
            many tokens at a time; None computes the full (B, S, V) logits; "auto" (default)
            :data:`LOSS_CHUNK_AUTO` tokens wherever the chunked loss computes the model's own logits
            (the package's models and the transformers model types of
            ``hf.CHUNKED_LOSS_MODEL_TYPES``), else the full logits (Note [The loss chunk by default]).
        init_seed: seed of the weight initialisation, so that every rank (and a single-device run)
            builds the same initial model whatever the global random state.
        bits_per_character: also log ``val/bpc`` and ``test/bpc``: the cross entropy over every
            token of every rank / ln 2 (:class:`~lightning_seqpar.data.BitsPerCharacter`), for
            byte-level models such as the enwik8 GPT.
        hf_save_dir: Hugging Face models only: at the end of training write the trained model there
            as one consolidated ``save_pretrained`` folder (:meth:`save_hf_pretrained`).
        lora: LoRA fine-tuning of a Hugging Face model through ``peft`` (Note [LoRA under the strategy]
            in ``lightning_seqpar.hf.lora``): a dict of ``peft.LoraConfig`` fields (e.g. ``{"r": 16,
            "lora_alpha": 32, "target_modules": "all-linear"}``) or a ``peft.LoraConfig``. The base is
            frozen (in the Trainer's precision), only the adapters are trained, in fp32, and only they
            have optimizer state; ``hf_save_dir`` then receives the adapter folder. A ``peft.PeftModel``
            given as ``model`` is used as it is (with ``lora=None``).
        config_overrides: Hugging Face models given as a folder or a config only: fields of the transformers
            config changed BEFORE the model is built, e.g. a context extension's ``{"rope_parameters":
            {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192},
            "max_position_embeddings": 65536}`` (:func:`lightning_seqpar.hf.rope_extension` computes it).
            A dict given for a dict-valued field is merged into it; unknown keys and values that
            transformers rejects raise a ValueError naming the key, here, before any process group
            exists (Note [Config overrides] in ``lightning_seqpar.hf.config``). Checkpoints keep it
            with the model, so a checkpoint rebuilds the overridden model.
        fused_optimizer: AdamW's implementation: True the fused kernels (``fused=True``, one launch
            per step for all parameters; DTensor parameters of FSDP2 included), False torch's default
            (``foreach``); None (default) fused when every parameter is on a CUDA device, or in host
            memory with ``offload_params`` (torch's fused CPU kernel).
    """

    option_ranges: ClassVar[dict[str, Range]] = {
        "lr": POSITIVE, "weight_decay": NON_NEGATIVE, "betas": Range(low=0, high=1, high_open=True), "eps": POSITIVE,
        "warmup_steps": NON_NEGATIVE, "max_steps": AT_LEAST_ONE, "min_lr_ratio": FRACTION, "loss_chunk_size": AT_LEAST_ONE,
        "init_seed": Range(low=-(2**63), high=2**64 - 1),  # what torch.manual_seed takes
    }
    """The numbers each option allows (Note [Checking options by their types] in ``lightning_seqpar.checks``): every
    option but ``model`` / ``lora`` / ``config_overrides`` (checked by their own rules) is checked from its annotation
    first, so that a NaN or inf learning rate or a string for a bool is refused by name, never trained."""

    def __init__(
        self,
        model: LlamaConfig | TransNormerConfig | GPTConfig | str | hf.HFConfigSpec = "tiny",
        *,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 100,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        loss_chunk_size: int | Literal["auto"] | None = "auto",
        init_seed: int = 0,
        bits_per_character: bool = False,
        hf_save_dir: str | None = None,
        fused_optimizer: bool | None = None,
        lora: dict[str, Any] | None = None,
        config_overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        hints = option_hints(CausalLMModule)  # every argument but those with rules of their own
        options = {k: v for k, v in locals().items() if k in hints and k not in ("model", "lora", "config_overrides")}
        check_options(options, option_hints(CausalLMModule), owner=name, ranges=self.option_ranges)
        original = model
        self._window: list[torch.Tensor] | None = None  # (N_ref, the count so far): Note [Loss under gradient accumulation]
        # LoRA (lightning_seqpar.hf.lora): a peft config, or a PeftModel given as the model
        self._lora_config: Any = None
        peft_given = model if lora_module.is_peft_model(model) else None
        if peft_given is not None:
            if lora is not None:
                raise ValueError(f"{name}: model is already a peft.PeftModel; pass lora=None (its adapters are used as they are)")
            self._lora_config = peft_given.peft_config[peft_given.active_adapter]
            model = peft_given.get_base_model()  # the transformers model: its config is read below
        elif lora is not None:
            self._lora_config = lora_module.lora_config(lora)
        # A Hugging Face model: a local folder, a transformers config / model, or a dict with "model_type".
        self._hf_source: Any = None
        given = None  # a transformers model instance, used as it is
        if config_overrides is not None and not isinstance(config_overrides, Mapping):
            raise ValueError(f"{name}: config_overrides must be a dict of transformers config fields or None, got {config_overrides!r}")
        self._config_overrides = dict(config_overrides) if config_overrides else None
        if not (isinstance(model, str) and is_named_config(model)) and hf.is_hf_source(model):
            if self._config_overrides and (peft_given is not None or isinstance(model, torch.nn.Module)):
                raise ValueError(
                    f"{name}: config_overrides cannot change a model that is already built ({type(original).__name__}): its "
                    "layers were made from its config. Give the model as its local folder or its transformers config "
                    "(with lora=... for adapters) so that the overridden config builds it"
                )
            base = hf.load_hf_config(model)
            # checked here, before any process group exists (Note [Config overrides]); the model is built from it later
            config = hf.apply_config_overrides(base, self._config_overrides) if self._config_overrides else base
            given = model if isinstance(model, torch.nn.Module) else None
            self._hf_source = config if given is not None else model  # never an nn.Module attribute here
            model = config
            # the folder, or the config before the overrides (the hyper-parameters keep config_overrides apart)
            original = str(original) if isinstance(original, (str, os.PathLike)) else base.to_dict()
        elif hf_save_dir is not None:
            raise ValueError(f"{name}: hf_save_dir is only for Hugging Face models (model={original!r})")
        elif self._config_overrides:
            raise ValueError(f"{name}: config_overrides is for Hugging Face models (a local folder or a transformers config); "
                             f"the package's own model={original!r} takes its fields in the config itself")
        if self._lora_config is not None and self._hf_source is None:
            raise ValueError(f"{name}: lora is for Hugging Face models (a local folder, a transformers config or model); got model={original!r}")
        if peft_given is not None:
            given = peft_given
        if isinstance(model, str):  # (a Hugging Face config is neither a str nor a Mapping)
            if not is_named_config(model) and (os.sep in model or os.path.exists(model)):
                raise ValueError(
                    f"{name}: model={model!r} is neither a named config nor a local Hugging Face model folder "
                    "(a folder with config.json)"
                )
            model = resolve_config(model, owner=name)  # Note [The model registry]
        elif isinstance(model, Mapping):
            model = resolve_config(model, owner=name)
        if self._hf_source is None and family_of(model) is None:
            raise ValueError(
                f"{name}: model must be a LlamaConfig, TransNormerConfig or GPTConfig, the name of one or a dict of its fields, "
                f"or a Hugging Face model (local folder, transformers config, or dict with 'model_type'); got {type(model).__name__}"
            )
        if not lr > 0:
            raise ValueError(f"{name}: lr must be > 0, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay}")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"{name}: betas must be two numbers in [0, 1), got {betas}")
        if warmup_steps < 0:
            raise ValueError(f"{name}: warmup_steps must be >= 0, got {warmup_steps}")
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"{name}: max_steps must be >= 1 or None, got {max_steps}")
        if not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"{name}: min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        chunk, self._auto_loss_chunk = loss_chunk_size, False  # "auto" that chunks: may still fall back (the head's type)
        if loss_chunk_size == "auto":  # Note [The loss chunk by default]
            serves = self._hf_source is None or hf.chunked_loss_serves(model)
            chunk = LOSS_CHUNK_AUTO if serves else None
            self._auto_loss_chunk = serves
        elif loss_chunk_size is not None and (isinstance(loss_chunk_size, bool) or not isinstance(loss_chunk_size, int)
                                              or loss_chunk_size < 1):
            raise ValueError(f"{name}: loss_chunk_size must be an int >= 1, 'auto' or None, got {loss_chunk_size!r}")
        if fused_optimizer is not None and not isinstance(fused_optimizer, bool):
            raise ValueError(f"{name}: fused_optimizer must be True, False or None (fused on CUDA), got {fused_optimizer!r}")
        # Checkpoints hold the config as plain values (torch.load(weights_only=True) loads them).
        self.save_hyperparameters(ignore=["model", "lora"])
        self.hparams["lora"] = None if self._lora_config is None else lora_module.lora_hparams(self._lora_config)
        if self._hf_source is not None:
            self.hparams["model"] = original  # the folder, or the transformers config as a dict with "model_type"
        else:
            self.hparams["model"] = original if isinstance(original, str) else dataclasses.asdict(model)
        self.config = model
        self.lr, self.weight_decay, self.betas, self.eps = lr, weight_decay, tuple(betas), eps
        self.warmup_steps, self.max_steps, self.min_lr_ratio = warmup_steps, max_steps, min_lr_ratio
        self.loss_chunk_size: int | None = chunk  # type: ignore[assignment]  # "auto" resolved
        self.init_seed = init_seed
        self.hf_save_dir = hf_save_dir
        self.fused_optimizer = fused_optimizer
        self.model: Llama | TransNormer | GPT | hf.HFCausalLM | None = None if given is None else hf.HFCausalLM(given)
        if self.model is not None and self.loss_chunk_size is not None:  # a built model: its head checked now
            self._check_chunked_head(self.model)
        self.val_loss = TokenMean()
        self._vocabulary_checked: set[str | None] = set()  # the stages whose first batch was checked (_check_vocabulary)
        self.val_bpc = BitsPerCharacter() if bits_per_character else None
        self.flops_per_batch = 0
        """Model FLOPs of this rank's share of the last training batch (read by Lightning's ThroughputMonitor):
        ``flops_per_token(global sequence length) x local tokens``."""

    # ----------------------------------------------------------------------------------------- model

    @override
    def configure_model(self) -> None:
        """Build the model (once) on the current device; the strategy parallelizes it afterwards."""
        if self.model is not None:
            return
        device = torch.empty(0).device  # the strategy's tensor_init_context sets the device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.init_seed)
            if self._hf_source is not None:
                model = hf.build_hf_causal_lm(self._hf_source, config_overrides=self._config_overrides)
                if self._lora_config is not None:  # the adapters are drawn from init_seed too
                    model = lora_module.apply_lora(model, self._lora_config)
                self.model = hf.HFCausalLM(model)
                if self.loss_chunk_size is not None:  # refused here, before the strategy's first collective
                    self._check_chunked_head(self.model)
            else:
                self.model = build_model(self.config)  # type: ignore[assignment]

    def _check_chunked_head(self, model: hf.HFCausalLM) -> None:
        """The chunked loss needs the model's logits to be ``hidden @ W^T``: refused for a loss_chunk_size the user
        set, the full logits for "auto" (Note [The loss chunk by default])."""
        try:
            model.check_chunked_head()
        except ValueError as error:
            if not self._auto_loss_chunk:
                raise
            self.loss_chunk_size = None
            rank_zero_info(f"{type(self).__name__}: loss_chunk_size='auto' computes the full logits: {error}")

    def _require_model(self) -> Llama | TransNormer | GPT | hf.HFCausalLM:
        if self.model is None:
            self.configure_model()
        assert self.model is not None
        return self.model

    def _mesh(self) -> DeviceMesh | None:
        mesh = self.device_mesh
        if mesh is not None and tuple(mesh.mesh_dim_names or ()) == MESH_AXES and mesh.size() > 1:
            return mesh
        return None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, S, V)."""
        return self._require_model()(input_ids, position_ids)

    def loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of this rank's token losses, number of its valid tokens) for a (sharded) batch."""
        model = self._require_model()
        input_ids, labels, position_ids = batch["input_ids"], batch["labels"], batch.get("position_ids")
        if self.loss_chunk_size is None:
            return token_cross_entropy_sum(model(input_ids, position_ids), labels)
        hidden, weight = model.head_operands(model(input_ids, position_ids, output="hidden"))  # (B, S, d'), (V, d')
        return chunked_cross_entropy_sum(hidden, weight, labels, chunk_size=self.loss_chunk_size,
                                         softcap=getattr(model, "logit_softcap", None))

    def token_losses(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The cross entropy of every token of a (sharded) batch, ``(B, S_local)`` fp32, 0 where the label is
        ignored (-100): what validation reduces to ``val/loss`` and gives callbacks (``token_losses`` in its
        output, e.g. :class:`~lightning_seqpar.training.metrics.LossByPosition`). With ``loss_chunk_size`` the logits of
        at most that many tokens exist at a time."""
        labels = batch["labels"]
        pieces, losses, start = self.logit_pieces(batch), [], 0
        for logits in pieces:  # (B, n, V) each
            y = labels[:, start : start + logits.shape[1]]  # (B, n)
            losses.append(F.cross_entropy(logits.float().transpose(1, 2), y, ignore_index=IGNORE_INDEX, reduction="none"))
            start += logits.shape[1]
        return torch.cat(losses, dim=1)  # (B, S_local)

    def logit_pieces(self, batch: dict[str, torch.Tensor]) -> Any:
        """The logits of a (sharded) batch: one (B, S, V) piece, or with ``loss_chunk_size`` pieces of that many
        tokens computed one at a time (soft-capped as the chunked loss caps them)."""
        model = self._require_model()
        input_ids, position_ids = batch["input_ids"], batch.get("position_ids")
        if self.loss_chunk_size is None:
            return [model(input_ids, position_ids)]  # (B, S, V)
        hidden, weight = model.head_operands(model(input_ids, position_ids, output="hidden"))  # (B, S, d'), (V, d')
        step = self.loss_chunk_size
        cap = getattr(model, "logit_softcap", None)
        pieces = ((hidden[:, i : i + step] @ weight.T).float() for i in range(0, hidden.shape[1], step))  # (B, n, V) each
        return (cap * torch.tanh(p / cap) for p in pieces) if cap else pieces

    # ----------------------------------------------------------------------------------------- batches

    @override
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Packed documents without ``SequenceParallelStrategy`` (one device, DDP, ...): what the
        strategy's batch hook does for them (Note [Packed documents and per-document zigzag]) with
        whole sequences: the batch's documents (``document_ids``, or ``position_ids`` restarting
        at 0) become current for attention and the positions restart at every document, so that a
        batch gives the same loss with and without the strategy."""
        batch = super().on_after_batch_transfer(batch, dataloader_idx)
        if isinstance(batch, Mapping) and "input_ids" in batch:
            self._check_vocabulary(batch)
        if _under_sequence_parallel_strategy(self) or not isinstance(batch, Mapping) or "input_ids" not in batch:
            return batch
        documents = batch_documents(batch, world=1)
        if documents is not None:
            model = self._require_model()
            name = type(self).__name__
            if uses_linear_attention(model):
                raise documents_error(name, "which linear attention does not mask; drop document_ids and use plain position_ids")
            if not any(isinstance(m, Attention) for m in model.modules()):
                raise documents_error(name, "which only the package's attention masks, and this model runs its own (a Hugging Face "
                                      "model outside SequenceParallelStrategy); train under SequenceParallelStrategy (devices=1 works)")
        set_current_documents(documents)
        self._documents_set = True
        if documents is None:
            return batch
        return {**batch, "position_ids": documents.position_ids(batch["input_ids"].device)}

    def _vocabulary_size(self) -> int | None:
        """The model's number of token ids: its config's ``vocab_size``, a transformers model's input embedding rows."""
        model = self._require_model()
        if not isinstance(model, hf.HFCausalLM):
            return int(self.config.vocab_size)
        embeddings = model.hf.get_input_embeddings()
        rows = getattr(embeddings, "num_embeddings", None)
        if isinstance(rows, int):
            return rows
        config = model.hf.config
        vocab = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "vocab_size", None)
        return vocab if isinstance(vocab, int) else None

    def _check_vocabulary(self, batch: Mapping[str, Any]) -> None:
        """The first batch of each stage (fit, validate, test, predict): its ids and labels (-100 aside) are ids of the
        model's vocabulary, else a ValueError naming the datamodule, the largest id and the vocabulary size -- where an
        embedding lookup would fail deep in the model (``index out of range in self``), or a GPU read out of bounds.
        On the full batch, before the strategy shards it: every rank of a sequence-parallel group raises alike."""
        stage = str(getattr(getattr(self._trainer, "state", None), "stage", None)) if self._trainer is not None else None
        checked = self._vocabulary_checked
        if stage in checked:
            return
        vocab = self._vocabulary_size()
        if vocab is None:
            return
        source = "the dataloader"
        if self._trainer is not None and getattr(self.trainer, "datamodule", None) is not None:
            source = type(self.trainer.datamodule).__name__
        for key in ("input_ids", "labels"):
            ids = batch.get(key)
            if not isinstance(ids, torch.Tensor) or ids.numel() == 0 or ids.is_floating_point():
                continue
            kept = ids[ids != IGNORE_INDEX] if key == "labels" else ids
            if kept.numel() == 0:
                continue
            low, high = int(kept.min()), int(kept.max())
            if low < 0 or high >= vocab:
                bad = high if high >= vocab else low
                raise ValueError(
                    f"{type(self).__name__}: the first batch from {source} holds {key} id {bad} (largest {high}), but the "
                    f"model's vocabulary has {vocab} ids (0..{vocab - 1}): the data was tokenized for another vocabulary, or "
                    "a token file was read with another dtype (TokenFileDataModule(dtype=...)). Use the model's tokenizer, "
                    "or a model whose vocab_size covers the data"
                )
        checked.add(stage)

    def _micro_batches(self) -> int:
        """``Trainer(accumulate_grad_batches=k)``'s k (1 without a trainer)."""
        return int(getattr(self._trainer, "accumulate_grad_batches", 1) or 1) if self._trainer is not None else 1

    @override
    def on_train_epoch_start(self) -> None:
        self._window = None  # a window never spans epochs (Lightning steps on an epoch's last batch) nor fits

    @override
    def on_after_backward(self) -> None:
        """The end of an accumulation window: the gradients of the mean over the window's tokens (Note [Loss under
        gradient accumulation])."""
        if self._window is None or self.trainer.fit_loop._should_accumulate():
            return
        reference, total = self._window
        self._window = None
        scale = float(self._micro_batches() * reference / total) if int(total) > 0 else 0.0
        with torch.no_grad():
            for param in self.parameters():
                if param.grad is not None:
                    param.grad.mul_(scale)

    @override
    def teardown(self, stage: str) -> None:
        if getattr(self, "_documents_set", False):
            set_current_documents(None)
            self._documents_set = False

    # ----------------------------------------------------------------------------------------- steps

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        model = self._require_model()
        if isinstance(model, hf.HFCausalLM):
            self._check_router_padding(model)
        loss_sum, n_valid = self.loss_sum(batch)
        mesh = self._mesh()
        count = global_token_count(n_valid, mesh, loss_sum.device)  # of all ranks (Note [Loss under sequence parallelism])
        loss = loss_sum / count.clamp(min=1).to(loss_sum.dtype)  # this rank's share of the global mean
        aux = model.router_aux_loss(mesh) if isinstance(model, hf.HFCausalLM) else None  # MoE: this rank's share
        if aux is not None:  # Note [Router auxiliary loss under sequence parallelism]
            aux = aux.to(loss.dtype)
            loss = loss + aux
        reported = loss.detach().clone()
        if self._micro_batches() > 1:  # Note [Loss under gradient accumulation]
            if self._window is None:
                self._window = [count.clamp(min=1).to(torch.float64), torch.zeros_like(count)]
            reference, total = self._window
            total += count
            loss = (loss_sum if aux is None else loss_sum + aux * count.to(aux.dtype)) / reference.to(loss_sum.dtype)
        if mesh is not None:
            dist.all_reduce(reported, op=dist.ReduceOp.SUM)  # the mesh spans all ranks
        self.log("train/loss", reported, prog_bar=True)
        self.log("train/ppl", reported.exp())
        self._count_flops(batch, mesh)
        return loss

    def _check_router_padding(self, model: hf.HFCausalLM) -> None:
        """Padding added by ``pad_to_multiple`` would be routed and counted in a MoE router's auxiliary loss."""
        if self._trainer is None or model.router_aux_loss_config is None:
            return
        if getattr(self.trainer.strategy, "pad_to_multiple", False):
            raise ValueError(
                f"{type(self).__name__}: {type(model.hf).__name__} adds its router auxiliary loss (config.output_router_logits=True), "
                "which counts every token, padding included: pad_to_multiple=True would change it. Choose seq_len as a multiple "
                "of the layout's chunk count and pad_to_multiple=False, or set config.output_router_logits=False"
            )

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        """Updates ``val/loss`` (and ``val/bpc``); returns ``{"token_losses": (B, S_local)}`` (:meth:`token_losses`)
        for callbacks (``on_validation_batch_end``'s ``outputs``)."""
        losses = self.token_losses(batch)  # (B, S_local) fp32, 0 where ignored
        n_valid = (batch["labels"] != IGNORE_INDEX).sum()
        loss_sum = losses.sum()
        # A token-weighted mean; torchmetrics sums value * weight and weight over all ranks.
        self.val_loss.update(loss_sum / n_valid.clamp(min=1), weight=n_valid)
        if self.val_bpc is not None:  # token-loss sums and counts; summed over every rank on compute
            self.val_bpc.update(loss_sum, n_valid)
        return {"token_losses": losses.detach()}

    @override
    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        # the value is already global (torchmetrics synced it): sync_dist only averages equal numbers
        self.log_dict({"val/loss": loss, "val/ppl": loss.exp(), **self._bits_per_character("val")}, prog_bar=True, sync_dist=True)

    @override
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return self.validation_step(batch, batch_idx)

    @override
    def on_test_epoch_end(self) -> None:
        loss = self.val_loss.compute()
        self.val_loss.reset()
        self.log_dict({"test/loss": loss, "test/ppl": loss.exp(), **self._bits_per_character("test")}, sync_dist=True)

    @override
    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        """Per-token outputs of the whole sequences (on every rank under the strategy):

        * ``predictions`` (B, S) int64: the most likely next token after each position;
        * ``token_logprobs`` (B, S) fp32, when the batch has ``labels``: log p(label) at each
          position, 0 where the label is ignored (-100). Their sum over a sample is its log-likelihood.

        With ``loss_chunk_size`` the logits of at most that many tokens exist at a time. Under
        ``SequenceParallelStrategy`` each rank computes its shard and the pieces are put back in
        sequence order (``SequenceParallelStrategy.gather_sequence``); padding from
        ``pad_to_multiple`` stays at the end.
        """
        labels = batch.get("labels")
        predictions, logprobs = [], []
        start = 0
        for logits in self.logit_pieces(batch):
            logits = logits.float()
            predictions.append(logits.argmax(-1))
            if labels is not None:
                y = labels[:, start : start + logits.shape[1]]
                valid = y != IGNORE_INDEX
                picked = logits.gather(-1, torch.where(valid, y, 0).unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
                logprobs.append(torch.where(valid, picked, 0.0))
            start += logits.shape[1]
        out = {"predictions": torch.cat(predictions, dim=1)}
        if labels is not None:
            out["token_logprobs"] = torch.cat(logprobs, dim=1)
        gather = getattr(self.trainer.strategy, "gather_sequence", None) if self._trainer is not None else None
        return {k: gather(v) for k, v in out.items()} if gather is not None else out

    def _bits_per_character(self, stage: str) -> dict[str, torch.Tensor]:
        """``{"<stage>/bpc": value}`` from the metric (then reset), or nothing without ``bits_per_character``."""
        if self.val_bpc is None:
            return {}
        bpc = self.val_bpc.compute().float()
        self.val_bpc.reset()
        return {f"{stage}/bpc": bpc}

    def _count_flops(self, batch: dict[str, torch.Tensor], mesh: DeviceMesh | None) -> None:
        # Lightning's Throughput wants the FLOPs of THIS device (it multiplies by the world size).
        local_batch, local_len = batch["input_ids"].shape
        sp = mesh.size(MESH_AXES.index("hp")) * mesh.size(MESH_AXES.index("cp")) if mesh is not None else 1
        counter = self.model if isinstance(self.model, hf.HFCausalLM) else self.config
        self.flops_per_batch = counter.flops_per_token(local_len * sp) * local_batch * local_len

    # ----------------------------------------------------------------------------------------- Hugging Face export

    @override
    def on_train_end(self) -> None:
        if self.hf_save_dir is not None:
            self.save_hf_pretrained(self.hf_save_dir)

    def save_hf_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write the Hugging Face model as one consolidated ``save_pretrained`` folder (rank 0 writes).

        Collective under the strategy: every rank calls it (``on_train_end`` does, with ``hf_save_dir``).
        See :func:`lightning_seqpar.hf.save_hf_pretrained`.
        """
        model = self._require_model()
        if not isinstance(model, hf.HFCausalLM):
            raise ValueError(
                f"{type(self).__name__}.save_hf_pretrained is for Hugging Face models; export the package's Llama "
                "with `seqpar export CHECKPOINT OUTPUT --format hf`"
            )
        if lora_module.is_peft_model(model.hf):  # LoRA: the adapter folder (the merged model: `seqpar export --format lora --merged`)
            lora_module.save_lora_pretrained(model, save_directory)
            return
        hf.save_hf_pretrained(model, save_directory)

    # ----------------------------------------------------------------------------------------- optimizer

    def _parameters_offloaded(self, model: torch.nn.Module) -> bool:
        """Every parameter in host memory while the run computes on CUDA (``offload_params``): the
        AdamW step runs on the CPU, where torch's fused kernel is ~6x faster than its default
        (Note [Offloading parameters to host memory]; ``benchmarks/train.py host-adamw``)."""
        trainer = self._trainer
        root = getattr(trainer.strategy, "root_device", None) if trainer is not None else None
        return root is not None and root.type == "cuda" and all(p.device.type == "cpu" for p in model.parameters())

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        model = self._require_model()
        trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only, no state for the frozen base
        decay = [p for p in trained if p.ndim >= 2]
        no_decay = [p for p in trained if p.ndim < 2]
        fused = self.fused_optimizer
        if fused is None:  # torch's default is foreach; fused is one kernel per step (torchtitan's default too)
            fused = all(p.device.type == "cuda" for p in model.parameters()) or self._parameters_offloaded(model)
        optimizer = torch.optim.AdamW(
            [group for group in ({"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
             if group["params"]],
            lr=self.lr,
            betas=self.betas,
            eps=self.eps,
            fused=fused or None,
        )
        max_steps = self.max_steps
        if max_steps is None:
            max_steps = int(self.trainer.estimated_stepping_batches)
        if self.warmup_steps > max_steps:  # configure_optimizers runs once per fit: one warning
            rank_zero_warn(f"{type(self).__name__}: warmup_steps={self.warmup_steps} is longer than the run ({max_steps} optimizer "
                           f"steps): the learning rate never reaches lr={self.lr} (it ends at {max_steps / self.warmup_steps:.1%} of "
                           "it). Lower warmup_steps or train longer")
        schedule = warmup_cosine(warmup_steps=self.warmup_steps, max_steps=max_steps, min_lr_ratio=self.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TokenMean(MeanMetric):
    """The token-weighted mean of ``val/loss`` (and ``test/loss``): 0 where no token of any rank has a label, as
    ``train/loss`` logs such a batch (never 0/0 = NaN)."""

    def compute(self) -> torch.Tensor:
        if not bool(self.weight > 0):
            return torch.zeros_like(self.mean_value)
        return self.mean_value / self.weight


def _under_sequence_parallel_strategy(module: L.LightningModule) -> bool:
    return module._trainer is not None and isinstance(module.trainer.strategy, SequenceParallelStrategy)


def warmup_cosine(*, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> Any:
    """LR multiplier at step t: (t+1)/warmup during warmup, then cosine from 1 to ``min_lr_ratio`` at ``max_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def batch_samples(batch: dict[str, torch.Tensor]) -> int:
    """Samples in a batch (``ThroughputMonitor(batch_size_fn=...)``); a rank's shard counts its samples."""
    return int(batch["input_ids"].shape[0])


def batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Tokens this rank processes in a batch (``ThroughputMonitor(length_fn=...)``): items/s = tokens/s."""
    return int(batch["input_ids"].numel())

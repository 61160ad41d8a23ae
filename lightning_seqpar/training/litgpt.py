"""LitGPT's ``GPT`` under the strategy, unchanged: ``LitGPTModule`` and the LitGPT checkpoint in and out.

Note [LitGPT under the strategy]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
LitGPT (Lightning's own LLM library) has no sequence parallelism. Its ``GPT`` computes attention
with ``F.scaled_dot_product_attention`` in every ``Block`` (``self.transformer.h``) and slices its
RoPE caches by the input's length (``self.cos[:T]``): the routed SDPA and the position tables of
``lightning_seqpar.routing.sdpa`` make it exact under the split with no change to LitGPT's code
(Note [Routing a model's own SDPA calls], Note [Position tables under the split]). GQA (K/V
repeated by LitGPT) and sliding windows (read from the layer's config) included. This module only
adds what a recipe needs around it: the model by LitGPT config name with overrides (random init) or
from a LitGPT checkpoint (``lit_model.pth``), the package's exact loss (``global_mean_loss``:
exact for any split), AdamW with warm-up and cosine, and ``save_litgpt`` writing the weights back
as a folder ``litgpt generate`` reads (``lit_model.pth``, ``model_config.yaml``, and the tokenizer
files of the checkpoint it started from). ``export_litgpt`` (``seqpar export CKPT OUT --format litgpt``)
does the same from a checkpoint the strategy saved (a folder of shards or one file), in one process:
the LitGPT config is rebuilt from the module's saved hyper-parameters (``model``, ``config_overrides``).

litgpt is optional: ``pip install --no-deps litgpt==0.5.13`` (its pins of ``huggingface_hub<1.4``
and ``jsonargparse<=4.41`` conflict with transformers 5 and the package's CLI; its imports work
with the newer versions).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, ClassVar

import lightning as L
import torch
from torch import nn

from lightning_seqpar.checks import AT_LEAST_ONE, FRACTION, NON_NEGATIVE, POSITIVE, Range, check_options, option_hints
from lightning_seqpar.loss.cross_entropy import chunked_cross_entropy_sum, global_mean_loss, token_cross_entropy_sum
from lightning_seqpar.parallel import checkpoint_io
from lightning_seqpar.training.module import warmup_cosine

__all__ = ["LitGPTModule", "export_litgpt", "save_litgpt"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json", "config.json")


def _litgpt() -> Any:
    try:
        import litgpt  # noqa: F401
        from litgpt import Config
        from litgpt.model import GPT
    except ImportError as e:
        raise ImportError("LitGPTModule needs litgpt: pip install --no-deps litgpt==0.5.13 (Note [LitGPT under the "
                          "strategy] says why --no-deps)") from e
    return Config, GPT


class LitGPTModule(L.LightningModule):
    """A causal LM of LitGPT's, trained with the package's loss.

    Args:
        model: a LitGPT config name (``litgpt.Config.from_name``: "Llama-3.2-1B", "Qwen2.5-7B", ...), or the
            folder of a LitGPT checkpoint (``lit_model.pth`` and ``model_config.yaml``).
        config_overrides: fields of the LitGPT config to change (``{"n_layer": 2, "block_size": 131072}``).
        lr, weight_decay, betas, warmup_steps, max_steps, min_lr_ratio: AdamW with linear warm-up and cosine decay.
        init_seed: the seed of the random initialization (a config name).
        loss_chunk_size: tokens per chunk of the output head and cross entropy (the full logits never exist:
            ``lightning_seqpar.loss.chunked_cross_entropy_sum``); None: LitGPT's full logits.
    """

    option_ranges: ClassVar[dict[str, Range]] = {
        "lr": POSITIVE, "weight_decay": NON_NEGATIVE, "betas": Range(low=0, high=1, high_open=True), "warmup_steps": NON_NEGATIVE,
        "max_steps": AT_LEAST_ONE, "min_lr_ratio": FRACTION, "init_seed": Range(low=-(2**63), high=2**64 - 1),
        "loss_chunk_size": AT_LEAST_ONE,
    }
    """The numbers each option allows (Note [Checking options by their types] in ``lightning_seqpar.checks``)."""

    def __init__(self, model: str = "Llama-3.2-1B", *, config_overrides: dict[str, Any] | None = None, lr: float = 3e-4,
                 weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 0,
                 max_steps: int | None = None, min_lr_ratio: float = 0.1, init_seed: int = 0,
                 loss_chunk_size: int | None = 8192) -> None:
        super().__init__()
        hints = option_hints(LitGPTModule)
        check_options({k: v for k, v in locals().items() if k in hints}, hints, owner="LitGPTModule", ranges=self.option_ranges)
        self.save_hyperparameters()
        Config, _ = _litgpt()
        folder = Path(model)
        self.source = folder if (folder / "model_config.yaml").is_file() else None
        if self.source is not None:
            self.litgpt_config = Config.from_file(folder / "model_config.yaml", **(config_overrides or {}))
        else:
            try:
                self.litgpt_config = Config.from_name(model, **(config_overrides or {}))
            except ValueError as e:
                raise ValueError(f"LitGPTModule: model={model!r} is neither a LitGPT config name nor a folder with "
                                 f"model_config.yaml ({e})") from None
        self.gpt: nn.Module | None = None
        self.loss_chunk_size = loss_chunk_size  # read by the strategy's memory planner, as CausalLMModule's
        self.config = planner_fields(self.litgpt_config)
        """The sizes the strategy's memory planner reads (``memory="auto"``), in transformers' names; None where the
        planner does not model the layers (a mixture of experts, a non-Llama MLP)."""

    def configure_model(self) -> None:
        if self.gpt is not None:
            return
        _, GPT = _litgpt()
        torch.manual_seed(self.hparams.init_seed)
        gpt = GPT(self.litgpt_config)
        if self.source is not None:
            weights = self.source / "lit_model.pth"
            if not weights.is_file():
                raise ValueError(f"LitGPTModule: {self.source} has model_config.yaml but no lit_model.pth")
            state = torch.load(weights, map_location="cpu", weights_only=True)
            gpt.load_state_dict(state.get("model", state), strict=True)
        gpt.cudnn_attention_exact = self.cudnn_attention_exact
        self.gpt = gpt

    @property
    def cudnn_attention_exact(self) -> bool:
        """Whether ``attention_backend="auto"`` may run cuDNN for this GPT (Note [Choosing the local kernel]: its backward is
        exact for a rotary embedding over the whole head), read from the config, so that the planner knows before the
        model is built (``registry.cudnn_attention_exact``)."""
        return self.litgpt_config.rotary_percentage == 1.0 and getattr(self.litgpt_config, "n_expert", 0) == 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.gpt is not None
        return self.gpt(input_ids)  # (B, S_local, V): LitGPT's own forward

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        gpt = self.gpt
        assert gpt is not None
        head = gpt.lm_head
        full = self.litgpt_config.final_logit_softcapping is not None or head.bias is not None  # LitGPT applies them after the head
        if self.hparams.loss_chunk_size is None or full:
            loss_sum, n_valid = token_cross_entropy_sum(self(batch["input_ids"]), batch["labels"])
        else:  # LitGPT's forward with the head set aside returns its final hidden states; the head runs chunked
            gpt.lm_head = nn.Identity()
            try:
                hidden = gpt(batch["input_ids"])  # (B, S_local, d)
            finally:
                gpt.lm_head = head
            loss_sum, n_valid = chunked_cross_entropy_sum(hidden, head.weight, batch["labels"], chunk_size=self.hparams.loss_chunk_size)
        return global_mean_loss(loss_sum, n_valid, self.device_mesh)  # this rank's share of the global mean

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss.detach(), sync_dist=True, reduce_fx="sum", prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True, reduce_fx="sum")

    def configure_optimizers(self) -> Any:
        assert self.gpt is not None
        trained = [p for p in self.gpt.parameters() if p.requires_grad]
        decay, no_decay = [p for p in trained if p.ndim >= 2], [p for p in trained if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": self.hparams.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=self.hparams.lr, betas=self.hparams.betas)
        max_steps = self.hparams.max_steps or int(self.trainer.estimated_stepping_batches)
        schedule = warmup_cosine(warmup_steps=self.hparams.warmup_steps, max_steps=max_steps, min_lr_ratio=self.hparams.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
                                                         "interval": "step"}}


def planner_fields(config: Any) -> dict[str, Any] | None:
    """A LitGPT config as the fields of a transformers config that ``model_shape.TransformerShape`` reads; None for
    layers it does not model."""
    if config.mlp_class_name != "LLaMAMLP" or getattr(config, "n_expert", 0):
        return None
    return {"model_type": "litgpt", "hidden_size": config.n_embd, "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head, "num_key_value_heads": config.n_query_groups, "head_dim": config.head_size,
            "intermediate_size": config.intermediate_size, "vocab_size": config.padded_vocab_size, "tie_word_embeddings": False}


def save_litgpt(state_dict: dict[str, torch.Tensor], config: Any, out: str | Path, *, source: str | Path | None = None) -> Path:
    """Write a LitGPT checkpoint folder: ``lit_model.pth`` (the GPT's weights), ``model_config.yaml``, and the tokenizer
    files of ``source`` (the checkpoint training started from), so that ``litgpt generate OUT`` reads it. Refuses a
    folder that already holds weights."""
    from litgpt.utils import save_config

    out = Path(out)
    if (out / "lit_model.pth").exists():
        raise ValueError(f"save_litgpt: {out} already holds lit_model.pth; choose an empty folder")
    out.mkdir(parents=True, exist_ok=True)
    state = {k.removeprefix("gpt."): v.detach().cpu() for k, v in state_dict.items() if not k.endswith(("cos", "sin"))}
    torch.save(state, out / "lit_model.pth")
    save_config(config, out)
    for name in TOKENIZER_FILES if source is not None else ():
        if (Path(source) / name).is_file():
            shutil.copy2(Path(source) / name, out / name)
    return out


def export_litgpt(checkpoint: str | Path, output: str | Path, *, tokenizer: str | Path | None = None,
                  dtype: torch.dtype | None = None) -> Path:
    """Write a checkpoint of ``LitGPTModule`` (what the strategy saved: a folder of shards or one file) as a LitGPT
    folder ``litgpt generate OUTPUT`` reads: ``lit_model.pth``, ``model_config.yaml`` (the config the module was built
    with: its ``model`` and ``config_overrides``) and the tokenizer files of ``tokenizer`` (a folder), else of the
    LitGPT folder training started from. One process, no GPU."""
    Config, _ = _litgpt()
    meta = checkpoint_io.load_meta(checkpoint)
    hparams = meta.get("hyper_parameters") if isinstance(meta, dict) else None
    if not isinstance(hparams, dict) or "model" not in hparams:
        raise ValueError(f"export --format litgpt: {str(checkpoint)!r} has no hyper_parameters['model']: it is not a "
                         "checkpoint of LitGPTModule")
    state = checkpoint_io.load_model_state_dict(checkpoint)
    outside = sorted(k for k in state if not k.startswith("gpt."))
    if outside:
        raise ValueError(f"export --format litgpt: {str(checkpoint)!r} holds weights outside LitGPTModule's 'gpt.' "
                         f"({outside[:3]}): export a checkpoint of LitGPTModule (--format hf for CausalLMModule)")
    source = Path(hparams["model"])
    overrides = hparams.get("config_overrides") or {}
    if (source / "model_config.yaml").is_file():
        config = Config.from_file(source / "model_config.yaml", **overrides)
    else:
        config = Config.from_name(hparams["model"], **overrides)
        source = None
    if tokenizer is not None:
        if not Path(tokenizer).is_dir() or not any((Path(tokenizer) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
            raise ValueError(f"export --format litgpt: --tokenizer {str(tokenizer)!r} is not a folder with tokenizer.json "
                             "or tokenizer.model")
        source = Path(tokenizer)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    return save_litgpt(state, config, output, source=source)

"""Precision plugins of ``SequenceParallelStrategy``, the dtypes FSDP2 gathers and reduces in under them, and the
autograd mode of the evaluation loops.

Note [Evaluation without inference mode]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Lightning runs ``validate`` / ``test`` / ``predict`` under ``torch.inference_mode`` unless the
backend is gloo or the strategy is its own ``FSDPStrategy`` (pytorch#95957), and this strategy is
neither. FSDP2's first gather of a run then happens inside inference mode: its unsharded
parameters are inference tensors, and ``wait_for_unshard`` fails ("Inference tensors do not track
version counter"). So every ``trainer.validate`` or ``seqpar validate`` of a model that no ``fit``
had gathered before failed on a GPU (found on one H200 evaluating a saved model with
``LongContextEval``), while the CPU tests (gloo: ``no_grad``) passed. The strategy sets its
trainer's evaluation loops to ``torch.no_grad``, as Lightning does for FSDP.

Note [Clipping with fused optimizers under bf16-mixed]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Lightning's ``MixedPrecision.clip_gradients`` refuses every optimizer that can unscale gradients
inside its ``step`` (``_step_supports_amp_scaling``: fused AdamW), because under fp16 a
``GradScaler`` would leave the gradients scaled when clipping runs, and the clip would use the
wrong norm. bf16-mixed has no scaler: the gradients are never scaled, so clipping before a fused
step is exactly clipping before an unfused one. ``CausalLMModule`` picks fused AdamW whenever its
parameters are on CUDA, and clipping is standard in LLM training, so the strategy swaps
Lightning's plugin for ``ScalerFreeMixedPrecision``: the same plugin, which skips that refusal
only while it has no scaler (fp16-mixed keeps Lightning's check).

Note [Rotary frequencies under bf16-true]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers builds every rotary embedding's ``inv_freq`` (and ``original_inv_freq``) in fp32
whatever the model's dtype (``torch.arange(..., dtype=torch.int64).float()``), and its ``forward``
multiplies the positions by it in fp32: ``from_pretrained(dtype=torch.bfloat16)`` keeps them fp32.
Lightning's ``"bf16-true"`` casts the whole module with ``module.to(torch.bfloat16)``
(``Precision.convert_module``), buffers included: ``inv_freq`` loses all but 8 bits, and the angle
``position * inv_freq`` is off by up to ``position * 2**-9`` radians, several radians at position
8K: every query and key is rotated wrongly, while the loss of a random model hardly moves (measured
on one H200: LoRA adapter gradients 0.19 from fp32 where peft's own bf16 model is 0.017). So the
strategy converts the module as Lightning does, then puts back the floating-point buffers of the
modules that hold an ``inv_freq`` buffer (the rotary embeddings) as they were built.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override


class ScalerFreeMixedPrecision(MixedPrecision):
    """``MixedPrecision`` that clips gradients for fused optimizers when no ``GradScaler`` exists."""

    @classmethod
    def from_plugin(cls, plugin: MixedPrecision) -> ScalerFreeMixedPrecision:
        """The same plugin (precision, device, scaler) as this class; state is shared, not copied."""
        swapped = cls.__new__(cls)
        swapped.__dict__.update(plugin.__dict__)
        return swapped

    @override
    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        if self.scaler is not None:  # fp16: the gradients may be scaled; Lightning's check stands
            return super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)
        return None


def evaluate_without_inference_mode(trainer: Any) -> None:
    """The trainer's validate / test / predict loops under ``torch.no_grad`` (Note [Evaluation without inference mode])."""
    for loop in (getattr(trainer, name, None) for name in ("validate_loop", "test_loop", "predict_loop")):
        if loop is not None and hasattr(loop, "inference_mode"):
            loop.inference_mode = False


def scaler_free(plugin: Any) -> Any:
    """``plugin`` as a ``ScalerFreeMixedPrecision`` when it is Lightning's own ``MixedPrecision``; else itself."""
    if type(plugin) is MixedPrecision:
        return ScalerFreeMixedPrecision.from_plugin(plugin)
    return plugin


def convert_module_keeping_rotary(plugin: Precision, module: nn.Module) -> nn.Module:
    """``plugin.convert_module(module)`` with the floating-point buffers of rotary embeddings (modules
    holding an ``inv_freq`` buffer) kept as they were built (Note [Rotary frequencies under bf16-true])."""
    kept = [
        (owner, name, buffer)
        for owner in module.modules()
        if isinstance(owner._buffers.get("inv_freq"), Tensor)
        for name, buffer in owner._buffers.items()
        if isinstance(buffer, Tensor) and buffer.is_floating_point()
    ]
    converted = plugin.convert_module(module)
    for owner, name, buffer in kept:
        owner._buffers[name] = buffer
    return converted


def fsdp_dtypes(plugin: Precision, *, bf16_adapters: bool, fp32_adapters: bool,
                owner: str) -> tuple[torch.dtype | None, torch.dtype | None]:
    """FSDP2's ``(param_dtype, reduce_dtype)`` under ``plugin``: "bf16-true" / "16-true" keep the parameters that
    ``convert_module`` made low precision (None, None); "bf16-mixed" gathers fp32 parameters in bf16 for compute and
    reduces the gradients in fp32; so does ``bf16_adapters`` for LoRA's fp32 adapters under "bf16-true" (Note
    [Adapters in bf16] in ``lightning_seqpar.hf.lora``), which needs them (``fp32_adapters``)."""
    param_dtype = reduce_dtype = None
    if isinstance(plugin, MixedPrecision) and plugin.precision == "bf16-mixed":
        param_dtype, reduce_dtype = torch.bfloat16, torch.float32
    if bf16_adapters:
        precision = getattr(plugin, "precision", None)
        if precision != "bf16-true" or not fp32_adapters:
            raise ValueError(f"{owner}: bf16_adapters=True gathers fp32 LoRA adapters in bf16; it needs "
                             f"precision='bf16-true' and a LoRA model (CausalLMModule(lora=...)), got precision={precision!r}"
                             + ("" if fp32_adapters else " and no fp32 trainable parameters"))
        param_dtype, reduce_dtype = torch.bfloat16, torch.float32
    return param_dtype, reduce_dtype

"""Precision plugins of ``SequenceParallelStrategy``.

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
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType
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


def scaler_free(plugin: Any) -> Any:
    """``plugin`` as a ``ScalerFreeMixedPrecision`` when it is Lightning's own ``MixedPrecision``; else itself."""
    if type(plugin) is MixedPrecision:
        return ScalerFreeMixedPrecision.from_plugin(plugin)
    return plugin

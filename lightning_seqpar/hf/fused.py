"""The fused element-wise kernels in transformers models: their RMSNorms and SwiGLU MLPs.

Note [Fused kernels in transformers models]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The package's Llama runs RMSNorm, RoPE and SwiGLU through ``lightning_seqpar.models.fused`` (Note [Fused
element-wise kernels]). A transformers model gets the same for the layers whose forward is, op for op, the
one those kernels compute: the RMSNorm of Llama, Mistral, Qwen2 and Qwen3 (the variance and the scale in fp32,
the row cast back, then times the weight; Qwen3's q / k norms are the same class) and their MLP
``down(silu(gate(x)) * up(x))`` with ``hidden_act="silu"``. :func:`apply_hf_fused_kernels` gives each such
instance (by its class, from its own transformers module) a forward that calls those entry points; nothing
else changes (the class, the parameters and their names, ``save_pretrained``). Elsewhere they are the torch
ops, the very ops transformers runs, so on the CPU, in ``torch.compile`` and with SEQPAR_FUSED_KERNELS=0 the
model computes what the unmodified model does, bitwise. Other models' norms (Gemma's ``1 + weight`` in fp32,
OLMo's, Cohere's LayerNorm) and activations keep their own forward. RoPE stays transformers' own
(``apply_rotary_pos_emb`` is a function of the modeling module, shared by every instance).
"""

from __future__ import annotations

import types

from torch import Tensor, nn

from lightning_seqpar.models import fused
from lightning_seqpar.planner.model_shape import FUSED_MODEL_TYPES

__all__ = ["FUSED_MODEL_TYPES", "apply_hf_fused_kernels"]

# by the class's own module, so that a subclass elsewhere (another model's norm built on Llama's) is not taken
_NORMS = {f"transformers.models.{t}.modeling_{t}": f"{name}RMSNorm"
          for t, name in (("llama", "Llama"), ("mistral", "Mistral"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3"))}
_MLPS = {module: cls.replace("RMSNorm", "MLP") for module, cls in _NORMS.items()}


class _FusedNorm:  # the instance's forward: named "forward", so a pickled module unpickles with its class's own
    def forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
        return fused.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class _FusedMLP:
    def forward(self: nn.Module, x: Tensor) -> Tensor:
        return self.down_proj(fused.silu_mul(self.gate_proj(x), self.up_proj(x)))


def _is(module: nn.Module, table: dict[str, str]) -> bool:
    cls = type(module)
    return table.get(cls.__module__) == cls.__name__


def apply_hf_fused_kernels(model: nn.Module) -> int:
    """Give the RMSNorm and SwiGLU MLP instances of ``model`` the fused forward (Note [Fused kernels in transformers
    models]); returns how many. The MLP only where its activation is SiLU (``nn.SiLU`` or transformers' own)."""
    count = 0
    for module in model.modules():
        if _is(module, _NORMS) and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_FusedNorm.forward, module)
            count += 1
        elif _is(module, _MLPS) and type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"):
            module.forward = types.MethodType(_FusedMLP.forward, module)
            count += 1
    return count

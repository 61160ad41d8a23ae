"""Rotary embeddings of transformers models whose frequencies depend on the sequence length, made global.

Note [Length-dependent rotary embeddings]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' ``dynamic_rope_update`` (the decorator of the rotary embeddings' ``forward``)
recomputes ``inv_freq`` from ``seq_len = max(position_ids) + 1`` over the whole tensor it is
given, for ``rope_type`` "dynamic" (NTK: a larger base once ``seq_len`` exceeds
``max_position_embeddings``) and "longrope" (Phi-3: the long factors once ``seq_len`` exceeds
``original_max_position_embeddings``, the short ones otherwise). Under sequence parallelism each
rank gives it only its shard's global positions, so ranks could rotate with different frequencies.

The fix needs no patch of the model. A forward pre-hook on each such rotary module appends ONE
column to ``position_ids`` holding the largest position of the whole sequence (an all-reduce MAX
over the sequence-parallel ranks of the rank's maximum; positions are global, so this is the
single-device maximum), and a forward hook drops that column from the outputs (``cos``/``sin``, or
Llama 4's complex ``freqs_cis``: the position dimension is the second last). The update then reads
the same ``seq_len`` on every rank as on one device, so the frequencies, the ``attention_scaling``
and the module's cached state (``max_seq_len_cached``, ``long_inv_freq``) are the single-device
ones, and each remaining column is computed elementwise exactly as before. The extra column costs
one position's cos/sin. Rotary types that read no length are left alone (no hook, no
communication). The all-reduce runs once per forward, outside the decoder layers (so activation
checkpointing never recomputes it), identically on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_seqpar.attention import Attention

__all__ = ["GlobalLengthRotary", "install_global_length_rotary", "reads_sequence_length"]


def reads_sequence_length(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers rotary embedding whose frequencies depend on the sequence
    length (``rope_type`` "dynamic" / "longrope", as transformers' ``dynamic_rope_update`` tests it)."""
    rope_type = getattr(module, "rope_type", None)
    kinds = list(rope_type.values()) if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(kind, str) and ("dynamic" in kind or kind == "longrope") for kind in kinds)


class GlobalLengthRotary:
    """The pre-hook / hook pair of Note [Length-dependent rotary embeddings] for one rotary module.

    ``attention``: the model's ``Attention`` modules; the sequence-parallel mesh is read from them at
    every call (None: one rank, nothing to do). Held by the hooks, so ``copy.deepcopy`` of the
    model maps it onto the copy's modules.
    """

    def __init__(self, attention: Sequence[Attention]) -> None:
        self.attention = tuple(attention)
        self.active = False

    def _mesh(self) -> Any:
        return next((m.mesh for m in self.attention if m.mesh is not None and m.mesh.size() > 1), None)

    def pre_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        mesh = self._mesh()
        self.active = mesh is not None
        if not self.active:
            return None
        in_args = len(args) > 1
        position_ids = args[1] if in_args else kwargs.get("position_ids")
        if not isinstance(position_ids, Tensor):
            raise ValueError(
                f"{type(module).__name__}: a length-dependent rotary embedding (rope_type={module.rope_type!r}) under "
                "sequence parallelism needs position_ids (the global positions)"
            )
        top = position_ids.max().reshape(1).to(torch.int64)  # (1,)
        for group in mesh.get_all_groups():
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        extra = top.to(position_ids.dtype).expand(*position_ids.shape[:-1], 1)  # (..., 1)
        position_ids = torch.cat([position_ids, extra], dim=-1)  # (..., S_local + 1)
        if in_args:
            return (args[0], position_ids, *args[2:]), kwargs
        return args, {**kwargs, "position_ids": position_ids}

    def hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not self.active:
            return None
        self.active = False

        def drop(t: Any) -> Any:
            if not isinstance(t, Tensor) or t.ndim < 2:
                raise ValueError(f"{type(module).__name__} returned {type(t).__name__}; expected (..., S, D) tensors")
            return t[..., :-1, :]  # (..., S_local, D): the extra position's column removed

        return tuple(drop(t) for t in output) if isinstance(output, tuple) else drop(output)


def install_global_length_rotary(model: nn.Module, attention: Sequence[Attention]) -> int:
    """Hook every length-dependent rotary embedding of ``model`` (Note [Length-dependent rotary
    embeddings]); returns how many are hooked. Idempotent: a module hooked before keeps its hooks,
    with ``attention`` as the modules to read the mesh from."""
    count = 0
    for module in model.modules():
        if not reads_sequence_length(module):
            continue
        count += 1
        existing = [h for h in module._forward_pre_hooks.values() if isinstance(getattr(h, "__self__", None), GlobalLengthRotary)]
        if existing:
            existing[0].__self__.attention = tuple(attention)
            continue
        state = GlobalLengthRotary(attention)
        module.register_forward_pre_hook(state.pre_hook, with_kwargs=True)
        module.register_forward_hook(state.hook, with_kwargs=True)
    return count

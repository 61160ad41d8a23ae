"""An SDPA call outside the package's attention modules, in a model that has them, refused on its first step.

Note [SDPA outside the package's attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A model whose attention runs through the package's modules (``Attention``, ``LinearAttention``,
``Recurrence``: the package's models, transformers models under ``"seqpar"``, a model of the user's
own that adopted them) is not routed (Note [Routing a model's own SDPA calls]): those modules are
its sequence-parallel attention. If the same model also calls ``F.scaled_dot_product_attention``
somewhere else (a pooling layer, an extra head, a layer of remote code), that call sees only the
rank's shard of the sequence and attends within it: a silent wrong answer under the split. So on
the model's first step with more than one sequence-parallel rank a ``TorchFunctionMode`` watches
every SDPA call; one made while none of the package's attention modules is running (their own
kernels call SDPA) is refused with the module that holds it in mind: compute it with an
``Attention`` module, or drop the package's modules so the strategy routes every call.

One step only (the same forward runs every step; per-op dispatch costs Python time), and not under
``compile`` (a mode active while Dynamo traces would make the second step compile again).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_seqpar.attention import Attention, LinearAttention
from lightning_seqpar.attention.recurrent import Recurrence

_SDPA = F.scaled_dot_product_attention
_ATTENTION = (Attention, LinearAttention, Recurrence)


class OutsideAttentionGuard:
    """Watches the first step of ``roots`` (models with the package's attention modules, split over ``sp`` ranks)."""

    def __init__(self, roots: Sequence[nn.Module], *, sp: int, owner: str) -> None:
        self.owner, self.sp, self.inside = owner, sp, 0
        self.armed = sp > 1
        self._handles: list[Any] = []
        modules = [m for root in roots for m in root.modules() if isinstance(m, _ATTENTION)] if self.armed else []
        for m in modules:
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._leave, always_call=True))
        self.armed = bool(modules)
        self.names = sorted({type(m).__name__ for m in modules})

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.inside += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self.inside -= 1

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self.armed = [], False

    @contextmanager
    def step(self) -> Iterator[None]:
        """The first step under watch; every later one runs as it is."""
        if not self.armed:
            yield
            return
        with _Watch(self):
            yield
        self.disarm()  # a step that completed: its forward made no such call

    def refuse(self) -> None:
        raise ValueError(
            f"{self.owner}: F.scaled_dot_product_attention was called outside the package's attention modules "
            f"({', '.join(self.names)}) of a model that computes its attention with them, on a sequence split over "
            f"{self.sp} ranks: that call would attend only within each rank's shard. Compute it with a "
            "lightning_seqpar.attention.Attention module, or use F.scaled_dot_product_attention everywhere (no package "
            "attention modules) so that the strategy routes every call (docs/own_model.md)")


class _Watch(TorchFunctionMode):
    def __init__(self, guard: OutsideAttentionGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _SDPA and not self.guard.inside:
            self.guard.refuse()
        return func(*args, **(kwargs or {}))

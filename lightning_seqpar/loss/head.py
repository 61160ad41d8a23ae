"""The output head's operands: what the chunked cross entropy multiplies to get a model's logits.

The chunked loss (``loss_chunk_size``; Note [Chunked cross entropy] in ``cross_entropy.py``) never forms the
full logits: it multiplies the final hidden states by one weight, ``logits = h @ W^T``, a chunk of tokens at a time.
Every model hands it ``(h, W)`` through this module (its ``head_operands(hidden)``):

* a plain ``nn.Linear`` head without bias: ``(hidden, head.weight)``;
* a head that a library wraps (peft's LoRA layer, ...), whose ``weight`` is not what it computes with: the
  library hands in a :class:`HeadAdapter` that resolves the wrapper and writes it as one product over widened
  operands (``lightning_seqpar.hf.lora.PEFT_HEAD``: Note [An adapted output head] there), so that neither this
  module nor the models nor the loss import that library;
* anything else is refused by name (the chunked loss would compute ``hidden @ head.weight^T`` only: a silent
  wrong answer), pointing at ``loss_chunk_size=None`` (the full logits through the head's own forward).

Public names: :func:`head_operands`, :func:`logits_head`, :class:`HeadAdapter`, :func:`is_plain`,
:func:`is_plain_linear`, :data:`USE_FULL_LOGITS`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor, nn

__all__ = ["USE_FULL_LOGITS", "HeadAdapter", "head_operands", "is_plain", "is_plain_linear", "logits_head"]

USE_FULL_LOGITS = "use loss_chunk_size=None (the full logits through the head's own forward)"
"""What every refusal of a head tells the user to do instead."""


class HeadAdapter(Protocol):
    """How a library that wraps linear layers writes a wrapped output head as one matrix product."""

    def resolve(self, head: nn.Module, owner: str) -> nn.Module | None:
        """None when ``head`` is none of the library's wrappers; else the module whose product the chunked loss
        forms: ``head`` itself (written by :meth:`operands`) or the plain layer a wrapper stands for. Raises a
        ValueError naming ``owner`` (the model) for a wrapper the chunked loss would get wrong."""
        ...

    def operands(self, layer: nn.Module, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """``(h, W)`` with ``h @ W^T`` the logits ``layer(hidden)``, for a ``layer`` that :meth:`resolve` returned
        and that is not a plain linear head."""
        ...


def is_plain(module: nn.Module, cls: type[nn.Module]) -> bool:
    """Whether ``module`` computes as ``cls`` does from its ``weight``: an instance whose class keeps ``cls``'s forward
    (peft's LoRA layers and other wrappers are not; what reads ``module.weight`` directly is exact only then)."""
    return isinstance(module, cls) and type(module).forward is cls.forward


def is_plain_linear(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` without bias: its logits are ``hidden @ module.weight^T``."""
    return is_plain(module, nn.Linear) and module.bias is None


def _resolve(head: nn.Module, owner: str, adapters: Sequence[HeadAdapter]) -> tuple[nn.Module, HeadAdapter | None]:
    """The module whose product the chunked loss forms for ``head``, and the adapter that resolved it (None: ``head``
    is a plain linear head)."""
    for adapter in adapters:
        layer = adapter.resolve(head, owner)
        if layer is not None:
            return layer, adapter
    if not is_plain_linear(head):
        what = type(head).__name__ + (" with a bias" if getattr(head, "bias", None) is not None else "")
        raise ValueError(f"{owner}: lm_head is a {what}, not a plain nn.Linear without bias; the chunked cross entropy "
                         f"computes hidden @ lm_head.weight^T only: {USE_FULL_LOGITS}")
    return head, None


def logits_head(head: nn.Module, owner: str, *, adapters: Sequence[HeadAdapter] = ()) -> nn.Module:
    """The module whose product the chunked loss may form for ``head``: a plain ``nn.Linear`` without bias, or what
    one of ``adapters`` resolves ``head`` to.

    Raises:
        ValueError: naming ``owner`` (the model) and what the head is, for anything the chunked loss would get wrong.
    """
    return _resolve(head, owner, adapters)[0]


def head_operands(head: nn.Module, hidden: Tensor, owner: str = "the model", *,
                  adapters: Sequence[HeadAdapter] = ()) -> tuple[Tensor, Tensor]:
    """``(h, W)`` with ``h @ W^T`` the logits ``head(hidden)``: ``(hidden, head.weight)`` for a plain head; for a
    head one of ``adapters`` resolves, that adapter's operands. ``hidden``: ``(..., d)``.

    Raises:
        ValueError: as :func:`logits_head`.
    """
    layer, adapter = _resolve(head, owner, adapters)
    if adapter is None or is_plain_linear(layer):
        return hidden, layer.weight
    return adapter.operands(layer, hidden)

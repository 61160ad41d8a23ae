"""Deprecated path: LoRA through peft is :mod:`lightning_seqpar.hf.lora`, the LoRA export
:func:`lightning_seqpar.hf.export.export_lora`, and the output head's operands :mod:`lightning_seqpar.head`.

This module only re-exports the public names, for one release, with a ``DeprecationWarning``. ``logits_head`` and
``head_operands`` keep their old signatures here: ``lightning_seqpar.head``'s with peft's adapter
(``adapters=(lightning_seqpar.hf.lora.PEFT_HEAD,)``).
"""

from __future__ import annotations

import warnings

from torch import Tensor, nn

from lightning_seqpar import head as head_interface
from lightning_seqpar.head import is_plain
from lightning_seqpar.hf.export import export_lora
from lightning_seqpar.hf.lora import (
    PEFT_HEAD,
    adapter_state_dict,
    apply_lora,
    is_peft_model,
    lora_config,
    lora_hparams,
    save_lora_pretrained,
    upcast_trainable,
)

__all__ = ["adapter_state_dict", "apply_lora", "export_lora", "head_operands", "is_peft_model", "is_plain", "logits_head",
           "lora_config", "lora_hparams", "save_lora_pretrained", "upcast_trainable"]


def logits_head(head: nn.Module, owner: str) -> nn.Module:
    """``lightning_seqpar.head.logits_head(head, owner, adapters=(PEFT_HEAD,))``."""
    return head_interface.logits_head(head, owner, adapters=(PEFT_HEAD,))


def head_operands(head: nn.Module, hidden: Tensor, owner: str = "the model") -> tuple[Tensor, Tensor]:
    """``lightning_seqpar.head.head_operands(head, hidden, owner, adapters=(PEFT_HEAD,))``."""
    return head_interface.head_operands(head, hidden, owner, adapters=(PEFT_HEAD,))


warnings.warn("lightning_seqpar.lora is deprecated: import from lightning_seqpar.hf.lora instead (export_lora: "
              "lightning_seqpar.hf.export; head_operands / logits_head: lightning_seqpar.head with adapters=(PEFT_HEAD,)); "
              "the old path will be removed in the next release", DeprecationWarning, stacklevel=2)

"""Model architectures. Model files import nothing from ``torch.distributed``."""

from __future__ import annotations

from lightning_seqpar.models.llama import CONFIGS as LLAMA_CONFIGS
from lightning_seqpar.models.llama import Llama, LlamaBlock, LlamaConfig

__all__ = ["LLAMA_CONFIGS", "Llama", "LlamaBlock", "LlamaConfig"]

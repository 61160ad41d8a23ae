"""Model architectures. Model files import nothing from ``torch.distributed``."""

from __future__ import annotations

from lightning_seqpar.models.gpt import CONFIGS as GPT_CONFIGS
from lightning_seqpar.models.gpt import GPT, GPTBlock, GPTConfig
from lightning_seqpar.models.llama import CONFIGS as LLAMA_CONFIGS
from lightning_seqpar.models.llama import Llama, LlamaBlock, LlamaConfig
from lightning_seqpar.models.transnormer import CONFIGS as TNL_CONFIGS
from lightning_seqpar.models.transnormer import TransNormer, TransNormerBlock, TransNormerConfig

__all__ = [
    "GPT", "GPTBlock", "GPTConfig", "GPT_CONFIGS",
    "LLAMA_CONFIGS", "Llama", "LlamaBlock", "LlamaConfig", "TNL_CONFIGS", "TransNormer", "TransNormerBlock", "TransNormerConfig",
]

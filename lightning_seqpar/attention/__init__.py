"""Exact attention over sequence shards.

Public names:

* :func:`sequence_parallel_attention` — the functional API (DESIGN.md "The public functional API").
* :func:`local_attention` — the same contract on one device (no mesh): what models run without
  the strategy.
* :class:`Attention` — a parameter-free module that models call; ``configure`` (used by
  ``lightning_seqpar.parallelize.apply_attention``) switches it from local to distributed.
* :data:`ATTENTION_OPS` — the custom ops whose outputs Selective Checkpoint++ saves.
* :class:`LinearAttention`, :func:`lasp_attention`, :func:`linear_attention`,
  :func:`linear_attention_chunked`, :data:`LASP_OPS` — linear attention with decay and LASP
  (``lightning_seqpar.attention.lasp``).
"""

from __future__ import annotations

from lightning_seqpar.attention.api import (
    ALGORITHMS,
    ATTENTION_OPS,
    Attention,
    gathered_kv_attention,
    local_attention,
    sequence_parallel_attention,
)
from lightning_seqpar.attention.lasp import (
    LASP_OPS,
    LASP_VARIANTS,
    LinearAttention,
    lasp_attention,
    linear_attention,
    linear_attention_chunked,
)
from lightning_seqpar.attention.local import BACKENDS, available_backends

__all__ = [
    "ALGORITHMS",
    "ATTENTION_OPS",
    "Attention",
    "BACKENDS",
    "LASP_OPS",
    "LASP_VARIANTS",
    "LinearAttention",
    "lasp_attention",
    "linear_attention",
    "linear_attention_chunked",
    "available_backends",
    "gathered_kv_attention",
    "local_attention",
    "sequence_parallel_attention",
]

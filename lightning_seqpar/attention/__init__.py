"""Exact attention over sequence shards.

Public names:

* :func:`sequence_parallel_attention` — the functional API.
* :func:`local_attention` — the same contract on one device (no mesh): what models run without
  the strategy.
* :class:`Attention` — a parameter-free module that models call; ``configure`` (used by
  ``lightning_seqpar.parallel.parallelize.apply_attention``) switches it from local to distributed.
* :class:`AttentionSpec`, :func:`attention_op` — what one call of the attention op runs, and the call.
* :data:`ATTENTION_OPS` — the custom ops whose outputs Selective Checkpoint++ saves.
* :class:`LinearAttention`, :func:`lasp_attention`, :func:`linear_attention`,
  :func:`linear_attention_chunked`, :data:`LASP_OPS` — linear attention with decay and LASP
  (``lightning_seqpar.attention.lasp``).
* :data:`ALGORITHMS` / :data:`Algorithm` — the algorithm names; :data:`OP_KINDS` / :data:`OpKind` — what
  one call of the attention op runs (``lightning_seqpar.attention.algorithms``).
"""

from __future__ import annotations

from lightning_seqpar.attention.algorithms import ALGORITHMS, OP_KINDS, Algorithm, OpKind
from lightning_seqpar.attention.api import (
    ATTENTION_OPS,
    Attention,
    AttentionSpec,
    attention_op,
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
    "Algorithm",
    "Attention",
    "AttentionSpec",
    "BACKENDS",
    "LASP_OPS",
    "LASP_VARIANTS",
    "LinearAttention",
    "OP_KINDS",
    "OpKind",
    "lasp_attention",
    "linear_attention",
    "linear_attention_chunked",
    "attention_op",
    "available_backends",
    "gathered_kv_attention",
    "local_attention",
    "sequence_parallel_attention",
]

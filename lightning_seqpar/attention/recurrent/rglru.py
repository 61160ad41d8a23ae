"""A diagonal linear recurrence over sequence shards: RecurrentGemma's RG-LRU (Griffin: De et al. 2024, §2.4), run
by Mamba1's chunked kernel (``selective.py``) with one state entry per channel, and where its state starts from
zero (:func:`sequence_starts`). Note [Diagonal linear recurrences under sequence sharding].
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.attention.recurrent.base import check_documents, check_mesh_layout, check_tokens, in_fp32, pieces_of, state_chain
from lightning_seqpar.attention.recurrent.selective import diagonal_in_parallel, diagonal_map, parallel_diagonal, selective_kernel
from lightning_seqpar.sharding.documents import PackedDocuments


# a diagonal linear recurrence (RecurrentGemma's RG-LRU)
#
# Note [Diagonal linear recurrences under sequence sharding]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Griffin's RG-LRU (De et al. 2024, §2.4; transformers' RecurrentGemmaRglru) keeps one number per
# channel and decays each by its own gate:
#
#     h_t = a_t * h_{t-1} + u_t,    a_t = exp(log_a_t) in (0, 1],    u_t = sqrt(1 - a_t^2) (i_t * x_t)
#
# (the input term is the caller's). It is Mamba1's selective scan (Note [Mamba1's selective scan
# under sequence sharding]) with one state entry per channel (N = 1), the decay log_a_t itself
# (rather than dt_t A) and the write u_t itself (rather than dt_t x_t B_t) — so the same chunked
# kernel and the same chain run it, with B = C = 1 and a [B, E] state per hop ([B, docs, E] with
# documents), and no division by dt: expressing it through selective_scan's arguments would need
# x = u / dt, which is neither exact nor defined at dt = 0.
#
# The RG-LRU also RESETS: where position_ids == 0 it multiplies a_t by 0 (h_t = u_t). Under
# sharding a reset in the middle of a piece cannot be applied to a state that another rank holds
# implicitly, but it need not be: the state is zero at every document's first token (Note
# [Documents in a recurrence]) and at the sequence's first, so a reset there changes nothing
# (and the gradient of a_t at such a token is zero either way: it multiplies a zero state).
# :func:`sequence_starts` gives, per local token, whether it is such a start; the caller checks
# that its resets are exactly those (and refuses by name where they are not, e.g. positions that
# restart at 0 without the batch's documents), so no reset is silently dropped.


def _diagonal_kernel(g: Tensor, u: Tensor, s_in: Tensor | None, *, piece: int, chunk_size: int,
                     pieces: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One piece of the chain: g, u [Bsz, T, E]; s_in [Bsz, (docs,) E] or None -> (h [Bsz, T, E], the leaving state(s))."""
    ones = g.new_ones(*g.shape[:2], 1, 1)  # B = C = 1 (one group, N = 1): the write is u, the read is h
    y, s_out = selective_kernel(g[..., None], u, ones, ones, None if s_in is None else s_in[..., None], piece=piece,
                                 chunk_size=chunk_size, pieces=pieces)
    return y, s_out[..., 0]


@in_fp32
def diagonal_recurrence(log_a: Tensor, u: Tensor, *, mesh: DeviceMesh | None = None,
                        layout: Literal["zigzag", "contiguous"] = "zigzag", chunk_size: int = 16,
                        documents: PackedDocuments | None = None) -> Tensor:
    """``h_t = exp(log_a_t) * h_{t-1} + u_t`` per channel over sequence shards, h zero before the first token
    (and, with ``documents``, before every document's first token): Note [Diagonal linear recurrences under
    sequence sharding].

    log_a, u: ``[B, T_local, E]`` (log_a <= 0 and finite). Returns h ``[B, T_local, E]`` fp32; differentiable in both.
    """
    check_mesh_layout(mesh, layout)
    if not isinstance(u, Tensor) or u.dim() != 3 or not u.is_floating_point():
        raise ValueError(f"u must be a floating-point tensor [B, T, E], got {getattr(u, 'shape', type(u).__name__)}")
    Bsz, T, E = u.shape
    check_tokens("log_a", log_a, (Bsz, T, E))
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    pieces_of(T, mesh, layout)
    pieces = check_documents(documents, Bsz, T, mesh, layout)
    fn = functools.partial(_diagonal_kernel, chunk_size=chunk_size, pieces=pieces)
    docs = () if pieces is None else (pieces.shape[1],)  # a state per document
    if diagonal_in_parallel(mesh, pieces):
        def map_of(g: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:  # N = 1, B = 1: the write is u
            decay, s = diagonal_map(g[..., None], w, g.new_ones(*g.shape[:2], 1, 1))
            return decay[..., 0], s[..., 0]

        return parallel_diagonal(fn, [log_a.float(), u.float()], map_of, mesh, layout)  # type: ignore[arg-type]
    return state_chain(fn, [log_a.float(), u.float()], (Bsz, *docs, E), mesh, layout)


def sequence_starts(batch: int, local_len: int, *, mesh: DeviceMesh | None = None,
                    layout: Literal["zigzag", "contiguous"] = "zigzag", documents: PackedDocuments | None = None) -> Tensor:
    """bool ``[B, T_local]`` (CPU): which of this rank's tokens start a recurrence from a zero state — the first
    token of every document (``documents``), else the sequence's first token (rank 0's first, in both layouts)."""
    check_mesh_layout(mesh, layout)
    pieces_of(local_len, mesh, layout)
    world = 1 if mesh is None else mesh.size()
    rank = 0 if world == 1 else mesh.get_local_rank()  # type: ignore[union-attr]
    if check_documents(documents, batch, local_len, mesh, layout) is not None:
        positions = documents.position_ids()  # type: ignore[union-attr]  # (B, S): 0 at every document start
        return (positions if world == 1 else documents.shard(positions, rank)) == 0  # type: ignore[union-attr]
    starts = torch.zeros(batch, local_len, dtype=torch.bool)
    if rank == 0 and local_len:
        starts[:, 0] = True
    return starts


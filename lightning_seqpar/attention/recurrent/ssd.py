"""Mamba2's selective scan over sequence shards: the state-space duality (SSD) form (Dao & Gu 2024, §3),

    S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T,               y_t = S_t^T C_t + D x_t

i.e. scalar-gated linear attention with q = C, k = B, v = dt x, g = dt A. MiniMax's lightning attention (a fixed
decay per head) runs through it as well, with dt = 1 and A = -slope. Across the ranks: Note [Linear recurrences
under sequence sharding] (``base.py``); the kernel: Note [Chunked gated recurrences] (``chunked.py``).
"""

from __future__ import annotations

import functools
from typing import Literal

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.attention.recurrent.base import (Kernel, check_documents, check_mesh_layout, check_tokens, in_fp32, pieces_of,
                                                       state_chain)
from lightning_seqpar.attention.recurrent.chunked import check_scan, gated_scan, parallel_scan, piece_scan, resolve_kernel, state_passing
from lightning_seqpar.sharding.documents import PackedDocuments


def ssd_scan_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, initial_state: Tensor | None = None,
                     chunk_size: int = 64, kernel: Kernel = "auto") -> tuple[Tensor, Tensor]:
    """Scalar-gated linear attention on one device (Mamba2 SSD with q = C, k = B, v = dt x, g = dt A)."""
    return gated_scan(q, k, v, g, None, initial_state, chunk_size, resolve_kernel(kernel, q.device))


def _ssd_kernel(q, k, v, g, s_in, *, piece, chunk_size, kernel, pieces=None):
    return piece_scan(q, k, v, g, None, s_in, piece=piece, chunk_size=chunk_size, kernel=kernel, pieces=pieces)


@in_fp32
def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *, mesh: DeviceMesh | None = None,
             layout: Literal["zigzag", "contiguous"] = "zigzag", chunk_size: int = 64, kernel: Kernel = "auto",
             documents: PackedDocuments | None = None) -> Tensor:
    """Mamba2's selective scan over sequence shards (Note [Linear recurrences under sequence sharding]).

    Conventions of transformers' Mamba2 / Bamba chunked scan, after the discretisation of dt
    (softplus, bias and clamp are the caller's): x ``[B, T, H, P]``, dt ``[B, T, H]``, A ``[H]``
    (negative), B and C ``[B, T, G, N]`` with H a multiple of G (group g serves H / G consecutive
    heads), D ``[H]`` or None. ``y_t = sum_{s<=t} exp(sum_{s<u<=t} dt_u A) (C_t . B_s) dt_s x_s + D x_t``.

    ``documents``: as for :func:`gated_delta_rule` (the state is zero at every document's first token).

    Returns ``[B, T_local, H, P]`` fp32; differentiable in every input.
    """
    check_mesh_layout(mesh, layout)
    Bsz, T, H, P = x.shape
    if B.dim() != 4 or C.shape != B.shape or B.shape[:2] != (Bsz, T) or H % B.shape[2]:
        raise ValueError(f"B and C must be [B, T, G, N] with G dividing the {H} heads of x; got x={tuple(x.shape)}, "
                         f"B={tuple(B.shape)}, C={tuple(C.shape)}")
    check_tokens("dt", dt, (Bsz, T, H))
    if A.shape != (H,):
        raise ValueError(f"A must have shape [H] = ({H},), got {tuple(A.shape)}")
    rep = H // B.shape[2]
    q = C.float().repeat_interleave(rep, dim=2)
    k = B.float().repeat_interleave(rep, dim=2)
    v = x.float() * dt.float()[..., None]
    g = dt.float() * A.float()
    check_scan(q, k, v, g, None, chunk_size)
    pieces_of(T, mesh, layout)
    pieces = check_documents(documents, Bsz, T, mesh, layout)
    ker = resolve_kernel(kernel, x.device, pieces is not None)
    fn = functools.partial(_ssd_kernel, chunk_size=chunk_size, kernel=ker, pieces=pieces)
    docs = () if pieces is None else (pieces.shape[1],)  # a state per document
    if state_passing(mesh, ker):
        y = parallel_scan(q, k, v, g, None, chunk_size, mesh, layout, pieces)  # type: ignore[arg-type]
    else:
        y = state_chain(fn, [q, k, v, g], (Bsz, *docs, H, k.shape[-1], P), mesh, layout)
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y



"""The gated delta rule over sequence shards: gated DeltaNet (Yang et al., Gated Delta Networks, Eq. 10;
transformers' Qwen3-Next) and, with a decay per key dimension, Kimi Delta Attention (Kimi Linear §2):

    S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,     o_t = S_t^T q_t

Across the ranks: Note [Linear recurrences under sequence sharding] (``base.py``); the kernel: Note [Chunked
gated recurrences] (``chunked.py``).
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.attention.recurrent.base import Kernel, check_documents, check_mesh_layout, in_fp32, pieces_of, state_chain
from lightning_seqpar.attention.recurrent.chunked import check_scan, gated_scan, parallel_scan, piece_scan, resolve_kernel, state_passing
from lightning_seqpar.sharding.documents import PackedDocuments


def gated_delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, initial_state: Tensor | None = None,
                             chunk_size: int = 64, kernel: Kernel = "auto") -> tuple[Tensor, Tensor]:
    """The gated delta rule on one device (Note [Chunked gated recurrences]); q already normalised and scaled.

    q, k ``[B, T, H, Dk]``, v ``[B, T, H, Dv]``, g (log decay, <= 0) and beta ``[B, T, H]``;
    initial_state ``[B, H, Dk, Dv]`` or None. Returns ``(out [B, T, H, Dv] fp32, final state fp32)``.
    """
    return gated_scan(q, k, v, g, beta, initial_state, chunk_size, resolve_kernel(kernel, q.device))


@in_fp32
def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                     use_qk_l2norm: bool = True, mesh: DeviceMesh | None = None,
                     layout: Literal["zigzag", "contiguous"] = "zigzag", chunk_size: int = 64,
                     kernel: Kernel = "auto", documents: PackedDocuments | None = None) -> Tensor:
    """The gated delta rule over sequence shards (Note [Linear recurrences under sequence sharding]).

    Conventions of transformers' Qwen3-Next and fla's ``chunk_gated_delta_rule``: q, k ``[B, T, H_k, Dk]``,
    v ``[B, T, H_v, Dv]`` with H_v a multiple of H_k (each q/k head serves H_v / H_k consecutive
    value heads), g ``[B, T, H_v]`` (log decay) or ``[B, T, H_v, Dk]`` (a log decay per key
    dimension: Kimi Delta Attention, Note [Chunked gated recurrences]; the torch kernels run,
    kernel="fla" is refused), beta ``[B, T, H_v]``; q and k l2-normalised in fp32
    (eps 1e-6 inside the square root) when ``use_qk_l2norm``, then q scaled by ``scale`` (default Dk^-1/2).

    ``documents``: packed documents (built with ``world`` = the mesh size; the inputs sharded by
    ``PackedDocuments.shard``, layout "zigzag"): the state is zero at every document's first token
    (Note [Documents in a recurrence]); the torch kernels run (kernel="fla" is refused).

    Returns ``[B, T_local, H_v, Dv]`` in q's dtype; differentiable in q, k, v, g, beta.
    """
    check_mesh_layout(mesh, layout)
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"q, k must be [B, T, H_k, Dk] and v [B, T, H_v, Dv] with H_v a multiple of H_k; got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}, v={tuple(v.shape)}")
    dtype = q.dtype
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    if v.shape[2] != q.shape[2]:
        q, k = (x.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for x in (q, k))
    check_scan(q, k, v, g, beta, chunk_size)
    pieces_of(q.shape[1], mesh, layout)
    pieces = check_documents(documents, q.shape[0], q.shape[1], mesh, layout)
    if g.dim() == 4 and kernel == "fla":
        raise ValueError("kernel='fla' does not take a decay per key dimension (g of shape [B, T, H, Dk]; fla-core's "
                         "chunk_kda is not wired): use kernel='torch' or 'auto' (which runs the torch kernels for it)")
    ker = resolve_kernel(kernel, q.device, pieces is not None or g.dim() == 4)
    fn = functools.partial(piece_scan, chunk_size=chunk_size, kernel=ker, pieces=pieces)
    B, _, H, Dk = q.shape
    docs = () if pieces is None else (pieces.shape[1],)  # a state per document
    if state_passing(mesh, ker):
        out = parallel_scan(q, k, v.float(), g.float(), beta.float(), chunk_size, mesh, layout, pieces)  # type: ignore[arg-type]
    else:
        out = state_chain(fn, [q, k, v.float(), g.float(), beta.float()], (B, *docs, H, Dk, v.shape[-1]), mesh, layout)
    return out.to(dtype)


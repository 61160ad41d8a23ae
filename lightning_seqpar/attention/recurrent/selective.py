"""Mamba1's selective scan over sequence shards (Mamba: Gu & Dao 2023, §3.2 and Alg. 2): a diagonal decay per
channel and state index. Also the chunked kernel of a diagonal recurrence and the parallel passing of its states,
which the RG-LRU (``rglru.py``) runs on too. Note [Mamba1's selective scan under sequence sharding], Note [Parallel
state passing for diagonal recurrences].
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from lightning_seqpar.attention.comm import AllGatherStacked
from lightning_seqpar.attention.recurrent.base import (chain_forced, check_documents, check_mesh_layout, check_tokens, in_fp32, pieces_of,
                                                       segment_layout, state_chain)
from lightning_seqpar.sharding.documents import PackedDocuments
from lightning_seqpar.sharding.layouts import chunk_ids, in_global_order


# Mamba1's selective scan
#
# Note [Mamba1's selective scan under sequence sharding]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Mamba (Gu & Dao 2023, §3.2 and Alg. 2; transformers' MambaMixer / JambaMambaMixer /
# FalconMambaMixer / ZambaMambaMixer, the torch path of ``mamba_selective_scan``) keeps, per
# channel e of the d_inner channels, a state h[e, :] of N entries, each with its own decay:
#
#     h_t[e, n] = exp(dt_t[e] A[e, n]) h_{t-1}[e, n] + dt_t[e] x_t[e] B_t[n],
#     y_t[e]    = sum_n h_t[e, n] C_t[n] + D[e] x_t[e]
#
# (B_t, C_t shared by the channels of a group: one group for Mamba / Jamba / Falcon-Mamba, one per
# Mamba head for Zamba). It is the SSD recurrence of Note [Linear recurrences under sequence
# sharding] with the scalar decay replaced by a diagonal one: still affine in the state, so the
# same chain carries it, one [B, d_inner, N] state per hop (per document: [B, docs, d_inner, N]),
# contiguous or zigzag (Note [State chain under the zigzag layout]), with the document resets of
# Note [Documents in a recurrence].
#
# The local kernel is chunked (the diagonal-decay form of Note [Chunked gated recurrences]): in a
# chunk of c tokens entering with state S_0 and G_t = sum_{u<=t} dt_u A (per e, n),
#
#     h_t = e^{G_t} S_0 + sum_{s<=t} e^{G_t - G_s} (dt_s x_s B_s),     y_t = <h_t, C_t>,
#
# the decays e^{G_t - G_s} formed only for s <= t (masked before exp: at most 1, no overflow), a
# [c, c, E, N] workspace per chunk; the chunks (of every sample, one sample after the other) run
# in sequence (B T / c steps instead of T), each under activation checkpointing, so autograd keeps one chunk's workspace at a time and O(T E N)
# inputs (transformers' torch path keeps its T per-token states as well). Every segment of a
# piece (a document's tokens, or the whole piece) starts a fresh chunk, padded at its end with
# no-op tokens (dt = 0: no decay, no write), as Note [Documents in a recurrence] does for the
# chunked SSD: no chunk holds a document start, and the state after a segment's last chunk is its
# document's leaving state (an empty segment passes its entering state through). Pure torch, fp32:
# exact (tested against a float64 token loop), not a fused kernel (mamba_ssm's selective scan with
# an initial state would be the fast path; not wired).


def _selective_chunk(G: Tensor, w: Tensor, C: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk: G [c, E, N] cumulative log decays, w [c, E, N] writes (dt x B), C [c, E, N], state [E, N]
    entering -> (y [c, E], state after the chunk)."""
    c = G.shape[0]
    tri = torch.ones(c, c, dtype=torch.bool, device=G.device).tril()[:, :, None, None]
    decay = (G[:, None] - G[None, :]).masked_fill(~tri, float("-inf")).exp()  # (t, s, E, N): e^{G_t - G_s}, s <= t
    h = G.exp() * state + torch.einsum("tsen,sen->ten", decay, w)  # (c, E, N): the state after each token
    return (h * C).sum(-1), h[-1]


def selective_kernel(g: Tensor, u: Tensor, B: Tensor, C: Tensor, s_in: Tensor | None, *, piece: int,
                     chunk_size: int, pieces: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One piece of the chain (Note [Mamba1's selective scan under sequence sharding]).

    g: [Bsz, T, E, N] log decays (dt A); u: [Bsz, T, E] written values (dt x); B, C: [Bsz, T, G, N];
    s_in: [Bsz, E, N] (with documents [Bsz, docs, E, N]) or None (zero). Returns (y [Bsz, T, E] without
    the D term, the leaving state(s) shaped as s_in), fp32.
    """
    Bsz, T, E, N = g.shape
    G, c = B.shape[2], chunk_size
    lengths = torch.full((Bsz, 1), T, dtype=torch.int64) if pieces is None else pieces[:, :, piece]
    docs = lengths.shape[1]
    lay = {name: x.to(g.device) for name, x in segment_layout(lengths, T, c).items()}

    def padded(x: Tensor) -> Tensor:  # [Bsz, T, *D] -> [chunks, c, *D], each segment starting a chunk, zeros between
        x = x.float().reshape(Bsz * T, *x.shape[2:])
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[lay["gather"]]
        return x.reshape(-1, c, *x.shape[1:])

    Gc = padded(g).cumsum(1)  # (chunks, c, E, N); padding: g = 0 (no decay), u = 0 (no write)
    w = (padded(u).reshape(-1, c, G, E // G, 1) * padded(B)[:, :, :, None, :]).reshape(-1, c, E, N)
    Cc = padded(C).repeat_interleave(E // G, dim=2)  # (chunks, c, E, N)
    init = g.new_zeros(Bsz * docs, E, N) if s_in is None else s_in.float().reshape(Bsz * docs, E, N)
    finals = list(init.unbind(0))
    seg, first, last = lay["seg"].tolist(), lay["first"].tolist(), lay["last"].tolist()
    ys, state = [], init[0]
    for j in range(len(seg)):  # the recurrence over chunks; a segment's first chunk starts from its document's state
        if first[j]:
            state = init[seg[j]]
        # recomputed in backward: autograd keeps one chunk's [c, c, E, N] decays at a time, not every chunk's
        y, state = checkpoint(_selective_chunk, Gc[j], w[j], Cc[j], state, use_reentrant=False)
        ys.append(y)
        if last[j]:
            finals[seg[j]] = state
    y = torch.cat(ys)[lay["scatter"]].reshape(Bsz, T, E)
    leaving = torch.stack(finals).reshape(Bsz, docs, E, N)
    return y, (leaving[:, 0] if pieces is None else leaving)


# Note [Parallel state passing for diagonal recurrences]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Mamba1's selective scan and the RG-LRU have a diagonal transition, so a piece maps the state that
# enters it elementwise:
#
#     S_out = exp(G) * S_in + s,   G = the sum of the piece's log decays (per e, n),
#     s = sum_t exp(G_after_t) * w_t,   G_after_t = the sum of the log decays after token t,
#
# w_t the write (dt_t x_t B_t; the RG-LRU's u_t). (exp G, s) costs O(T E N) elementwise, with no
# [c, c] workspace: a few percent of the kernel. Without documents, every rank computes its pieces'
# maps (autograd on, 256 tokens at a time under activation checkpointing); one all-gather, whose
# backward is a reduce-scatter, gives every rank every piece's. Each rank folds them in sequence
# order (S_in[p + 1] = exp(G_p) S_in[p] + s_p) and runs its pieces' kernel from the exact
# entering states. The backward is autograd's:
#
#   - the kernel's gradient of its entering state flows through the fold into the gathered maps;
#   - the reduce-scatter hands every rank the gradient of its own pieces' maps;
#   - the per-piece sums carry it to the inputs.
#
# No rank waits for another's kernel: the chain's critical path was 2W pieces, now it is the rank's
# own 2. With documents the per-document states still go down the chain (Note [Documents in a
# recurrence]); SEQPAR_STATE_CHAIN=1 sends these down the chain too.

_MAP_CHUNK = 256  # tokens per step of a piece's map: a [Bsz, 256, E, N] workspace


def _map_chunk(g: Tensor, u: Tensor, B: Tensor, s: Tensor) -> Tensor:
    """s after a chunk: g [Bsz, c, E, N] log decays, u [Bsz, c, E], B [Bsz, c, G, N], s [Bsz, E, N] (the zero-entering
    state before it)."""
    Bsz, c, E, N = g.shape
    G = B.shape[2]
    after = g.flip(1).cumsum(1).flip(1) - g  # the log decays after each token, within the chunk (<= 0)
    w = (u.reshape(Bsz, c, G, E // G, 1) * B[:, :, :, None, :]).reshape(Bsz, c, E, N)
    return g.sum(1).exp() * s + (after.exp() * w).sum(1)


def diagonal_map(g: Tensor, u: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """(exp G, s) of one piece: its leaving state is exp(G) * S_in + s (Note [Parallel state passing for diagonal
    recurrences]); [Bsz, E, N] each, differentiable."""
    s = g.new_zeros(g.shape[0], *g.shape[2:])
    for t in range(0, g.shape[1], _MAP_CHUNK):
        s = checkpoint(_map_chunk, g[:, t:t + _MAP_CHUNK], u[:, t:t + _MAP_CHUNK], B[:, t:t + _MAP_CHUNK], s,
                       use_reentrant=False)
    return g.sum(1).exp(), s


def parallel_diagonal(kernel, inputs: list[Tensor], map_of, mesh: DeviceMesh, layout: str) -> Tensor:
    """The pieces of a diagonal recurrence with their states passed in parallel (Note [Parallel state passing for diagonal
    recurrences]). ``kernel(*piece_inputs, s_in, piece=)`` -> (out, leaving); ``map_of(*piece_inputs)`` -> (exp G, s)
    shaped as the state."""
    rank, world = mesh.get_local_rank(), mesh.size()
    ids = chunk_ids(rank, world, layout)
    split = [x.chunk(len(ids), dim=1) for x in inputs]
    local = torch.stack([torch.stack(map_of(*(x[i] for x in split))) for i in range(len(ids))])  # [P, 2, *state]
    maps = in_global_order(AllGatherStacked.apply(local, mesh.get_group().group_name), world, layout)  # [2, *state] each
    # the first piece enters with a zero state that is still the gather's output: every rank's backward then reaches
    # the gather's reduce-scatter (rank 0's pieces may need no other piece's map: the contiguous layout)
    state, entering = maps[0][1] * 0, []
    for m in maps:
        entering.append(state)
        state = m[0] * state + m[1]
    return torch.cat([kernel(*(x[i] for x in split), entering[p], piece=p)[0] for i, p in enumerate(ids)], dim=1)


def diagonal_in_parallel(mesh: DeviceMesh | None, pieces: Tensor | None) -> bool:
    """Whether a diagonal recurrence passes its states in parallel (Note [Parallel state passing for diagonal
    recurrences]): several ranks, no documents, SEQPAR_STATE_CHAIN unset."""
    return mesh is not None and mesh.size() > 1 and pieces is None and not chain_forced()


@in_fp32
def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                   mesh: DeviceMesh | None = None, layout: Literal["zigzag", "contiguous"] = "zigzag",
                   chunk_size: int = 16, documents: PackedDocuments | None = None) -> Tensor:
    """Mamba1's selective scan over sequence shards (Note [Mamba1's selective scan under sequence sharding]).

    After the discretisation of dt (softplus and bias are the caller's): x and dt ``[B, T, E]``
    (E = d_inner channels), A ``[E, N]`` (negative), B and C ``[B, T, G, N]`` with G dividing E
    (group g serves the E / G consecutive channels g E/G ...), D ``[E]`` or None.
    ``y_t[e] = sum_n h_t[e, n] C_t[n] + D[e] x_t[e]`` with
    ``h_t[e, n] = exp(dt_t[e] A[e, n]) h_{t-1}[e, n] + dt_t[e] x_t[e] B_t[n]``, h zero before the first token.

    ``documents``: as for :func:`gated_delta_rule` (the state is zero at every document's first token).
    ``chunk_size``: tokens per chunk of the local kernel (its workspace is [c, c, E, N] per sample).

    Returns ``[B, T_local, E]`` fp32 (without the gate); differentiable in every input.
    """
    check_mesh_layout(mesh, layout)
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, E], got {tuple(x.shape)}")
    Bsz, T, E = x.shape
    check_tokens("dt", dt, (Bsz, T, E))
    if A.dim() != 2 or A.shape[0] != E:
        raise ValueError(f"A must have shape [E, N] = ({E}, N), got {tuple(A.shape)}")
    N = A.shape[1]
    if B.dim() != 4 or C.shape != B.shape or B.shape[:2] != (Bsz, T) or B.shape[3] != N or E % B.shape[2]:
        raise ValueError(f"B and C must be [B, T, G, N] with G dividing the {E} channels of x and N = {N} (A's); "
                         f"got x={tuple(x.shape)}, B={tuple(B.shape)}, C={tuple(C.shape)}")
    if D is not None and tuple(D.shape) != (E,):
        raise ValueError(f"D must have shape [E] = ({E},) or be None, got {tuple(D.shape)}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    pieces_of(T, mesh, layout)
    pieces = check_documents(documents, Bsz, T, mesh, layout)
    g = dt.float()[..., None] * A.float()  # (B, T, E, N) log decays
    u = dt.float() * x.float()  # (B, T, E)
    fn = functools.partial(selective_kernel, chunk_size=chunk_size, pieces=pieces)
    docs = () if pieces is None else (pieces.shape[1],)  # a state per document
    if diagonal_in_parallel(mesh, pieces):
        y = parallel_diagonal(fn, [g, u, B.float(), C.float()], lambda g, u, B, C: diagonal_map(g, u, B), mesh, layout)  # type: ignore[arg-type]
    else:
        y = state_chain(fn, [g, u, B.float(), C.float()], (Bsz, *docs, E, N), mesh, layout)
    if D is not None:
        y = y + D.float() * x.float()
    return y



"""The chunk-to-chunk state recurrence of the gated linear recurrences (gated delta rule, Kimi's
per-dimension decay, Mamba2's SSD), in parallel over chunks and over the sequence-parallel ranks.

Public names: :func:`affine_scan` and :func:`segment_scan` (used by :mod:`lightning_seqpar.attention.recurrent`).

Note [Blocked affine scan]
~~~~~~~~~~~~~~~~~~~~~~~~~~
After the per-chunk terms of Note [Chunked gated recurrences] (all chunks at once), one thing is
left sequential: the state entering each chunk. With c tokens per chunk and, for chunk j,
e_j = e^{G_c} (a scalar per head, or a diagonal per key dimension), K_j = k_out and W_j = wk
([c, Dk]; absent for SSD) and u_j the chunk's values:

    h_{j+1} = e_j h_j + K_j^T (u_j - W_j h_j) = A_j h_j + b_j,    A_j = e_j - K_j^T W_j,  b_j = K_j^T u_j

an affine map of the [Dk, Dv] state. Run chunk by chunk it is N steps of small matmuls (launch-
bound on a GPU: 2,048 steps per layer at 128K tokens, chunk 64). Affine maps compose, so it is
run blocked instead, with L = ceil(sqrt(N)) chunks per group and G = ceil(N / L) groups:

  1. every group's composite, all groups at once: M_g = A_{last} ... A_{first} and s_g (the state
     after the group from a zero state), L batched steps on the [Dk, Dk + Dv] matrix [M | s];
  2. the states entering the groups: H_{g+1} = M_g H_g + s_g, G small steps;
  3. the state entering every chunk, all groups at once from their H_g: L batched steps.

About 3 sqrt(N) launches of batched matmuls instead of N small ones; the FLOPs of step 1 are
about twice those of the plain state pass (which are small next to the chunk terms'). For SSD
(no K, W) A_j is the scalar e_j and M_g a product of scalars.

Backward: the same recurrence transposed. dH_j (the gradient of the state entering chunk j) is
dh_j + A_j^T dH_{j+1}, where dh_j is what the chunk's outputs send back; step 1 gives every
group's r_g (the gradient at its start from its own chunks, zero at its end; the composite is
M_g^T, kept from the forward), step 2 the gradient at every group's end, step 3 every dH_{j+1},
and then, at every chunk at once,

    de_j = <h_j, dH_{j+1}>,  db_j = dH_{j+1},  dK_j = -(W_j h_j) dH_{j+1}^T,  dW_j = -(K_j dH_{j+1}) h_j^T.

Saved: the entering states h_j (the outputs need them anyway) and the group composites.

Note [Parallel state passing across ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Under sequence parallelism every rank holds pieces of the sequence (one with the contiguous
layout, two with zigzag: Note [State chain under the zigzag layout]). A piece p is itself an
affine map of the state that enters it, S_out[p] = M_p S_in[p] + s_p (steps 1 and 2 from zero).
So, instead of a chain in which each rank waits for its entering state (2W - 2 hops with zigzag),
every rank computes its pieces' (M_p, s_p) at once, one all-gather gives every rank every
piece's, each rank folds them in sequence order (S_in[p + 1] = M_p S_in[p] + s_p: 2W small
steps, the same on every rank) and runs steps 2 and 3 from its pieces' S_in. LASP (§2.2-2.3)
passes TNL's KV state the same way; here the transition is a full Dk x Dk matrix (the delta
rule's I - b k k^T), so M_p travels with s_p.

Backward: each piece's r_p (the gradient at its start from its own outputs, zero at its end)
needs no other rank; one all-gather of the r_p, the reverse fold dS_in[p] = M_p^T dS_in[p + 1] +
r_p (M_p kept from the forward's all-gather) gives every piece the gradient at its end, and the
piece's backward runs from it. No gradient flows through M_p or s_p themselves: they only
compute S_in and dS_out faster; the gradients are those of the piece's own recurrence with its
exact entering state and exact end gradient.

Traffic per layer: forward W x P x [B, H, Dk, Dk + Dv], backward W x P x [B, H, Dk, Dv] (fp32),
independent of the sequence length; every rank works at once.
Note [Parallel state passing with packed documents]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With packed documents (per-document zigzag: global piece p is piece p of every document, Note
[Documents in a recurrence] in ``recurrent/base.py``) a rank's piece is a run of segments, one per
document, and every document has its own state chain through the 2W global pieces. A segment
(b, n, p) is an affine map of its document's state, S_out = M S_in + s, so the parallel scheme
above carries over with one map per segment instead of one per piece:

  1. Composites (no autograd): one masked scan of the wide state [M | s] ([Dk, Dk + Dv]; SSD's
     scalar transition: [Dk, 1 + Dv], whose first column is the product of the decays) over every
     chunk of every local segment, reset to [I | 0] at each segment's first chunk; a segment's
     composite is its last chunk's (unmasked) transition applied to the wide state entering that
     chunk. An empty segment is (I, 0): its document's state passes through.
  2. One all-gather of every segment's [M | s] ([P, B, N, H, Dk, Dk + Dv]); every rank folds each
     document down the 2W pieces (S_in[n, p + 1] = M S_in[n, p] + s, batched over documents and
     heads) and keeps its segments' entering states.
  3. The states entering every chunk: the masked scan of Note [Documents in a recurrence] (A_j = 0
     where chunk j + 1 starts a segment, b_j = that segment's entering state), from the exact
     entering states.

Backward, with dh the gradient of the state entering every chunk: (a) the masked reverse scan of
dh alone gives every segment's start gradient r from its own chunks (zero end gradient: the mask
cuts every segment's end); (b) one all-gather of the r and the reverse fold per document,
dS_in[n, p] = M^T dS_in[n, p + 1] + r[n, p], give every segment E, the gradient of the state after
it from the later pieces; (c) E enters at each segment's last chunk through that chunk's unmasked
transition (dh_last += A_last^T E), the masked reverse scan runs again, and the gradient of the
state after chunk j is E at a segment's last chunk and the scan's elsewhere; de, dK, dW, db follow
as in Note [Blocked affine scan]. As there, no gradient flows through the composites.

Traffic per layer: forward W x [P, B, N, H, Dk, Dk + Dv], backward W x [P, B, N, H, Dk, Dv] (fp32):
independent of S, linear in the documents of the widest sample; every rank works at once, where
the chain (2W - 2 hops each way) made each rank wait for the pieces before it.
"""


from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_seqpar.attention.comm import gather_stacked, process_group
from lightning_seqpar.sharding.layouts import chunk_ids, in_global_order

__all__ = ["affine_scan", "segment_scan"]


# ---------------------------------------------------------------------------------------------
# the transition A = e - K^T W and its transpose, on a batch of chunks


def _apply(e: Tensor, K: Tensor | None, W: Tensor | None, X: Tensor) -> Tensor:
    """A X for A = e - K^T W: e [..., d, 1] (d = 1 or Dk), K, W [..., c, Dk], X [..., Dk, n]."""
    Y = e * X
    return Y if W is None else Y - K.mT @ (W @ X)


def _apply_t(e: Tensor, K: Tensor | None, W: Tensor | None, Y: Tensor) -> Tensor:
    """A^T Y."""
    Z = e * Y
    return Z if W is None else Z - W.mT @ (K @ Y)


def _at(x: Tensor | None, l: int) -> Tensor | None:
    return None if x is None else x[l]


def _mat(M: Tensor, X: Tensor, dense: bool) -> Tensor:
    """A composite M (dense [.., Dk, Dk], else e-shaped) applied to X."""
    return M @ X if dense else M * X


def _mat_t(M: Tensor, X: Tensor, dense: bool) -> Tensor:
    return M.mT @ X if dense else M * X


# ---------------------------------------------------------------------------------------------
# the three steps of Note [Blocked affine scan]; tensors [*lead, G, L, ...] with the chunk axis moved
# first ([L, *lead, G, ...]) so that one step reads a view


def _composites(e, K, W, b, Dk: int) -> tuple[Tensor, Tensor]:
    """Step 1: (M_g, s_g) of every group. e [L, ..., d, 1], K/W [L, ..., c, Dk] or None, b [L, ..., Dk, Dv]."""
    L = b.shape[0]
    s = torch.zeros_like(b[0])
    if W is None:
        M = torch.ones_like(e[0])
        for l in range(L):
            M, s = e[l] * M, e[l] * s + b[l]
        return M, s
    eye = torch.eye(Dk, dtype=b.dtype, device=b.device)
    X = torch.cat([eye.expand(*b.shape[1:-1], Dk), s], dim=-1)  # [M | s]
    for l in range(L):
        X = _apply(e[l], K[l], W[l], X)  # dense: K and W are given
        X[..., Dk:] += b[l]
    return X[..., :Dk], X[..., Dk:]


def _group_states(M: Tensor, s: Tensor, h0: Tensor, dense: bool) -> tuple[Tensor, Tensor]:
    """Step 2: the state entering every group ([..., G, Dk, Dv]) and the state after the last, from h0 [..., Dk, Dv]."""
    H, h = [], h0
    for g in range(s.shape[-3]):
        H.append(h)
        h = _mat(M[..., g, :, :], h, dense) + s[..., g, :, :]
    return torch.stack(H, dim=-3), h


def _piece_composite(M: Tensor, s: Tensor, dense: bool) -> tuple[Tensor, Tensor]:
    """The composite of all groups of a piece (from a zero state): (M_p, s_p)."""
    Mp, sp = M[..., 0, :, :], s[..., 0, :, :]
    for g in range(1, s.shape[-3]):
        Mg = M[..., g, :, :]
        Mp, sp = _mat(Mg, Mp, dense), _mat(Mg, sp, dense) + s[..., g, :, :]
    return Mp, sp


def _chunk_states(e, K, W, b, H: Tensor) -> Tensor:
    """Step 3: the state entering every chunk, [L, ..., G, Dk, Dv], from the groups' entering states H."""
    out, h = [], H
    for l in range(b.shape[0]):
        out.append(h)
        h = _apply(e[l], _at(K, l), _at(W, l), h) + b[l]
    return torch.stack(out)


def _reverse_starts(e, K, W, dh: Tensor) -> Tensor:
    """Backward step 1: every group's r_g (gradient at its start from its own chunks' dh, zero at its end)."""
    d = torch.zeros_like(dh[0])
    for l in reversed(range(dh.shape[0])):
        d = dh[l] + _apply_t(e[l], _at(K, l), _at(W, l), d)
    return d


def _group_ends(M: Tensor, r: Tensor, end: Tensor, dense: bool) -> tuple[Tensor, Tensor]:
    """Backward step 2: the gradient at every group's end ([..., G, Dk, Dv]) and at the piece's start."""
    D, d = [], end
    for g in reversed(range(r.shape[-3])):
        D.append(d)
        d = _mat_t(M[..., g, :, :], d, dense) + r[..., g, :, :]
    return torch.stack(D[::-1], dim=-3), d


def _chunk_ends(e, K, W, dh: Tensor, D: Tensor) -> Tensor:
    """Backward step 3: the gradient of the state after every chunk, [L, ..., G, Dk, Dv]."""
    out, d = [], D
    for l in reversed(range(dh.shape[0])):
        out.append(d)
        d = dh[l] + _apply_t(e[l], _at(K, l), _at(W, l), d)
    return torch.stack(out[::-1])


# ---------------------------------------------------------------------------------------------
# the autograd Function


def _transition_grads(e: Tensor, K: Tensor | None, W: Tensor | None, h: Tensor, dnext: Tensor
                      ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(de, dK, dW) of every chunk's transition from the state entering it (h) and the gradient of the state after it
    (dnext): Note [Blocked affine scan]'s last line (db = dnext)."""
    de = (h * dnext).sum(-1, keepdim=True)
    if e.shape[-2] == 1:
        de = de.sum(-2, keepdim=True)
    if W is None:
        return de, None, None
    return de, -(W @ h) @ dnext.mT, -(K @ dnext) @ h.mT


def _blocked(x: Tensor | None, L: int, G: int, fill: float) -> Tensor | None:
    """[P, B, H, N, ...] -> [L, P, B, H, G, ...], the chunk axis padded to G L with ``fill`` (identity chunks)."""
    if x is None:
        return None
    N = x.shape[3]
    if G * L != N:
        pad = x.new_full((*x.shape[:3], G * L - N, *x.shape[4:]), fill)
        x = torch.cat([x, pad], dim=3)
    return x.reshape(*x.shape[:3], G, L, *x.shape[4:]).movedim(4, 0)


def _block_sizes(N: int) -> tuple[int, int]:
    """(L chunks per group, G groups) of Note [Blocked affine scan] for N chunks."""
    L = max(1, math.isqrt(N - 1) + 1) if N > 1 else 1
    return L, -(-N // L)


def _unblocked(x: Tensor, N: int) -> Tensor:
    """[L, P, B, H, G, ...] -> [P, B, H, N, ...]."""
    x = x.movedim(0, 4)
    return x.reshape(*x.shape[:3], -1, *x.shape[5:])[:, :, :, :N]


class _AffineScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, K, W, b, h0, group_name, layout):
        P, Bsz, H, N, Dk, Dv = b.shape
        dense = W is not None
        L, G = _block_sizes(N)
        eb, Kb, Wb, bb = _blocked(e, L, G, 1.0), _blocked(K, L, G, 0.0), _blocked(W, L, G, 0.0), _blocked(b, L, G, 0.0)
        M, s = _composites(eb, Kb, Wb, bb, Dk)  # [P, B, H, G, ...]
        zero = b.new_zeros(P, Bsz, H, Dk, Dv)
        M_all = None
        if group_name is None:
            s_in = zero if h0 is None else h0.expand(P, *h0.shape)
        else:  # Note [Parallel state passing across ranks]
            group = process_group(group_name)
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            Mp, sp = _piece_composite(M, s, dense)  # [P, B, H, Dk, Dk | d, 1], [P, B, H, Dk, Dv]
            m_numel = Mp[0].numel()
            flat = torch.cat([Mp.reshape(P, -1), sp.reshape(P, -1)], dim=1)
            pieces = in_global_order(gather_stacked(flat, group), world, layout)
            M_all = torch.stack([f[:m_numel].reshape(Mp.shape[1:]) for f in pieces])  # [n, B, H, ...]
            state, entering = zero[0], []
            for p, f in enumerate(pieces):
                entering.append(state)
                state = _mat(M_all[p], state, dense) + f[m_numel:].reshape(sp.shape[1:])
            s_in = torch.stack([entering[p] for p in chunk_ids(rank, world, layout)])
        Hg, h_out = _group_states(M, s, s_in, dense)
        h_all = _chunk_states(eb, Kb, Wb, bb, Hg)
        h_all = _unblocked(h_all, N)
        ctx.save_for_backward(e, K, W, h_all, M, M_all)
        ctx.args = (group_name, layout, h0 is not None, L, G, dense)
        return h_all, h_out

    @staticmethod
    def backward(ctx, dh_all, dh_out):
        e, K, W, h_all, M, M_all = ctx.saved_tensors
        group_name, layout, has_h0, L, G, dense = ctx.args
        P, Bsz, H, N, Dk, Dv = h_all.shape
        dh_all = torch.zeros_like(h_all) if dh_all is None else dh_all
        end = h_all.new_zeros(P, Bsz, H, Dk, Dv) if dh_out is None else dh_out
        eb, Kb, Wb, dhb = _blocked(e, L, G, 1.0), _blocked(K, L, G, 0.0), _blocked(W, L, G, 0.0), _blocked(dh_all, L, G, 0.0)
        r = _reverse_starts(eb, Kb, Wb, dhb)  # [P, B, H, G, Dk, Dv]
        _, d_start = _group_ends(M, r, end, dense)  # each piece's start, from its own outputs and its own end gradient
        dh0 = None
        if group_name is not None:  # Note [Parallel state passing across ranks]: the reverse fold
            group = process_group(group_name)
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            starts = in_global_order(gather_stacked(d_start, group), world, layout)
            d, incoming = M_all.new_zeros(Bsz, H, Dk, Dv), [None] * len(starts)  # nothing after the last piece
            for p in reversed(range(len(starts))):
                incoming[p] = d  # the gradient reaching piece p's end from the pieces after it
                d = _mat_t(M_all[p], d, dense) + starts[p]
            end = end + torch.stack([incoming[p] for p in chunk_ids(rank, world, layout)])
            D, _ = _group_ends(M, r, end, dense)
        else:
            D, dstart = _group_ends(M, r, end, dense)
            if has_h0:
                dh0 = dstart.sum(0)
        dnext = _unblocked(_chunk_ends(eb, Kb, Wb, dhb, D), N)  # gradient of the state after every chunk
        return (*_transition_grads(e, K, W, h_all, dnext), dnext, dh0, None, None)


def affine_scan(e: Tensor, K: Tensor | None, W: Tensor | None, b: Tensor, h0: Tensor | None = None, *,
                group_name: str | None = None, layout: str = "zigzag") -> tuple[Tensor, Tensor]:
    """The state entering every chunk of ``h_{j+1} = (e_j - K_j^T W_j) h_j + b_j`` (Note [Blocked affine scan]).

    e ``[P, B, H, N, d, 1]`` (d = 1 or Dk), K and W ``[P, B, H, N, c, Dk]`` (both or neither), b ``[P, B, H, N, Dk,
    Dv]`` fp32: N chunks of each of this rank's P pieces (in local order). ``h0`` ``[B, H, Dk, Dv]``: the state entering
    the sequence (zero if None; one device only). ``group_name``: the sequence-parallel group (its pieces as
    ``lightning_seqpar.sharding.layouts.chunk_ids`` lays them out), or None: the P pieces follow each other on this device
    (P = 1). Returns (the state entering every chunk ``[P, B, H, N, Dk, Dv]``, the state after every piece
    ``[P, B, H, Dk, Dv]``); differentiable in e, K, W, b and h0.
    """
    if (K is None) != (W is None):
        raise ValueError("K and W come together (the delta rule's transition e - K^T W) or not at all (SSD)")
    if group_name is None and b.shape[0] != 1:
        raise ValueError(f"without a group the pieces must be one (P = 1), got P={b.shape[0]}")
    if group_name is not None and h0 is not None:
        raise ValueError("an initial state h0 is for one device only (the sequence's first piece starts from zero)")
    return _AffineScan.apply(e, K, W, b, h0, group_name, layout)


# ---------------------------------------------------------------------------------------------
# packed documents: Note [Parallel state passing with packed documents]


class Segments:
    """Where the local segments' chunks sit in one chunk list (every segment starts a fresh chunk).

    ``seg`` [NC] the flat segment (p, b, n) of every chunk; ``first`` / ``last`` the chunk indices of every
    non-empty segment's first / last chunk (CPU, int64); ``shape`` (P, B, N): local pieces, samples, documents
    (flat segment (p B + b) N + n).
    """

    def __init__(self, seg: Tensor, first: Tensor, last: Tensor, shape: tuple[int, int, int], device: torch.device) -> None:
        self.shape, self.n_chunks = shape, int(seg.numel())
        self.seg, self.first, self.last = (x.to(device) for x in (seg, first, last))
        self.first_seg, self.last_seg = self.seg[self.first], self.seg[self.last]
        n_seg = shape[0] * shape[1] * shape[2]
        # the segment starting after each last chunk (segments run in order); n_seg after the final one: a zero row
        self.next_seg = torch.cat([seg[first[1:]], torch.tensor([n_seg])]).to(device)
        L, _ = _block_sizes(self.n_chunks)
        self.last_at = []  # per position l in a group: (groups, rows) of the last chunks there (Note [Blocked affine scan])
        for l in range(L):
            rows = (last % L == l).nonzero()[:, 0]
            self.last_at.append(None if rows.numel() == 0 else ((last[rows] // L).to(device), rows.to(device)))


def _lead(x: Tensor | None, L: int, G: int, fill: float) -> Tensor | None:
    """(H, NC, ...) -> the blocked [L, 1, 1, H, G, ...] of Note [Blocked affine scan]."""
    return None if x is None else _blocked(x[None, None], L, G, fill)


def _forward_states(e, K, W, b, h0: Tensor) -> tuple[Tensor, Tensor]:
    """States entering every chunk (H, NC, Dk, n) of h_{j+1} = A_j h_j + b_j from h0 (H, Dk, n), and the group composites."""
    NC, Dk, dense = b.shape[1], b.shape[2], W is not None
    L, G = _block_sizes(NC)
    eb, Kb, Wb, bb = _lead(e, L, G, 1.0), _lead(K, L, G, 0.0), _lead(W, L, G, 0.0), _lead(b, L, G, 0.0)
    M, s = _composites(eb, Kb, Wb, bb, Dk)
    Hg, _ = _group_states(M, s, h0[None, None], dense)
    return _unblocked(_chunk_states(eb, Kb, Wb, bb, Hg), NC)[0, 0], M


def _states_at_last(e, K, W, b, h0: Tensor, segs: Segments) -> Tensor:
    """The states entering every segment's last chunk only, (H, n_last, Dk, n): the wide scan keeps no other."""
    NC, Dk, dense = b.shape[1], b.shape[2], W is not None
    L, G = _block_sizes(NC)
    eb, Kb, Wb, bb = _lead(e, L, G, 1.0), _lead(K, L, G, 0.0), _lead(W, L, G, 0.0), _lead(b, L, G, 0.0)
    M, s = _composites(eb, Kb, Wb, bb, Dk)
    h, _ = _group_states(M, s, h0[None, None], dense)  # [1, 1, H, G, Dk, n]
    out = b.new_empty(b.shape[0], segs.last.numel(), *b.shape[2:])
    for l in range(L):
        if segs.last_at[l] is not None:
            groups, rows = segs.last_at[l]
            out[:, rows] = h[0, 0][:, groups]
        if l < L - 1:
            h = _apply(eb[l], _at(Kb, l), _at(Wb, l), h) + bb[l]
    return out


def _reverse_states(e, K, W, dh: Tensor, M: Tensor) -> Tensor:
    """The gradient of the state after every chunk (H, NC, Dk, Dv) from dh (the states' own gradients), none after the last."""
    NC, dense = dh.shape[1], W is not None
    L, G = _block_sizes(NC)
    eb, Kb, Wb, dhb = _lead(e, L, G, 1.0), _lead(K, L, G, 0.0), _lead(W, L, G, 0.0), _lead(dh, L, G, 0.0)
    r = _reverse_starts(eb, Kb, Wb, dhb)
    D, _ = _group_ends(M, r, dh.new_zeros(1, 1, *dh.shape[:1], *dh.shape[2:]), dense)
    return _unblocked(_chunk_ends(eb, Kb, Wb, dhb, D), NC)[0, 0]


def _masked(e: Tensor, K: Tensor | None, segs: Segments) -> tuple[Tensor, Tensor | None]:
    """e and K with every segment's last chunk zeroed: the transition out of it is cut (A = 0)."""
    em = e.clone()
    em[:, segs.last] = 0
    if K is None:
        return em, None
    Km = K.clone()
    Km[:, segs.last] = 0
    return em, Km


def _per_segment(x: Tensor, shape: tuple[int, int, int]) -> Tensor:
    """(H, S, ...) -> [P, B, N, H, ...]."""
    return x.transpose(0, 1).reshape(*shape, x.shape[0], *x.shape[2:])


def _per_chunk_list(x: Tensor) -> Tensor:
    """[P, B, N, H, ...] -> (H, S, ...)."""
    return x.reshape(-1, *x.shape[3:]).transpose(0, 1)


class _SegmentScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, K, W, b, segs: Segments, group_name: str, layout: str):
        H, NC, Dk, Dv = b.shape
        dense = W is not None
        P, Bsz, N = segs.shape
        em, Km = _masked(e, K, segs)
        li = segs.last
        # 1. every segment's composite [M | s] from the wide scan (no autograd)
        w = Dk if dense else 1
        reset = torch.cat([torch.eye(Dk, dtype=b.dtype, device=b.device) if dense else b.new_ones(Dk, 1),
                           b.new_zeros(Dk, Dv)], dim=-1)  # [I | 0] (SSD: [1 | 0])
        bw = b.new_zeros(H, NC, Dk, w + Dv)  # [0 | b], and [I | 0] where the next chunk starts a segment
        bw[..., w:] = b
        bw[:, li] = reset
        X = _states_at_last(em, Km, W, bw, reset.expand(H, Dk, w + Dv), segs)
        del bw
        C = _apply(e[:, li], _take(K, li), _take(W, li), X)
        C[..., w:] += b[:, li]
        comp = reset.expand(H, P * Bsz * N, Dk, w + Dv).clone().index_copy_(1, segs.last_seg, C)
        m = Dk * w if dense else 1
        Mloc = comp[..., :w] if dense else comp[..., :1, :1]
        flat = torch.cat([_per_segment(Mloc, segs.shape).reshape(P, Bsz, N, H, -1),
                          _per_segment(comp[..., w:], segs.shape).reshape(P, Bsz, N, H, -1)], dim=-1)
        # 2. one all-gather, the fold per document
        group = process_group(group_name)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        pieces = in_global_order(gather_stacked(flat.reshape(P, -1), group), world, layout)
        Mshape = (Dk, Dk) if dense else (1, 1)
        M_all = torch.stack([f.reshape(Bsz, N, H, -1)[..., :m].reshape(Bsz, N, H, *Mshape) for f in pieces])
        state, entering = b.new_zeros(Bsz, N, H, Dk, Dv), []
        for p, f in enumerate(pieces):
            entering.append(state)
            state = _mat(M_all[p], state, dense) + f.reshape(Bsz, N, H, -1)[..., m:].reshape(Bsz, N, H, Dk, Dv)
        enter = _per_chunk_list(torch.stack([entering[p] for p in chunk_ids(rank, world, layout)]))  # (H, S, Dk, Dv)
        # 3. the states entering every chunk, every segment from its exact entering state
        bm = b.clone()  # b, and the next segment's entering state where the next chunk starts a segment
        bm[:, li] = torch.cat([enter, enter.new_zeros(H, 1, Dk, Dv)], dim=1)[:, segs.next_seg]
        h_all, Mg = _forward_states(em, Km, W, bm, enter[:, segs.seg[0]])
        del bm
        ctx.save_for_backward(e, K, W, h_all, Mg, M_all)
        ctx.args = (segs, group_name, layout)
        return h_all

    @staticmethod
    def backward(ctx, dh):
        e, K, W, h_all, Mg, M_all = ctx.saved_tensors
        segs, group_name, layout = ctx.args
        H, NC, Dk, Dv = h_all.shape
        dense = W is not None
        P, Bsz, N = segs.shape
        em, Km = _masked(e, K, segs)
        # (a) every segment's start gradient from its own chunks
        dn = _reverse_states(em, Km, W, dh, Mg)
        fi = segs.first
        r = dh.new_zeros(H, P * Bsz * N, Dk, Dv).index_copy_(
            1, segs.first_seg, dh[:, fi] + _apply_t(em[:, fi], _take(Km, fi), _take(W, fi), dn[:, fi]))
        # (b) one all-gather, the reverse fold per document
        group = process_group(group_name)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        starts = in_global_order(gather_stacked(_per_segment(r, segs.shape), group), world, layout)
        d, incoming = dh.new_zeros(Bsz, N, H, Dk, Dv), [None] * len(starts)  # nothing after the last piece
        for p in reversed(range(len(starts))):
            incoming[p] = d
            d = _mat_t(M_all[p], d, dense) + starts[p]
        E = _per_chunk_list(torch.stack([incoming[p] for p in chunk_ids(rank, world, layout)]))[:, segs.last_seg]
        # (c) E enters at every segment's last chunk; the masked reverse scan again
        li = segs.last
        dh = dh.index_add(1, li, _apply_t(e[:, li], _take(K, li), _take(W, li), E))
        D = _reverse_states(em, Km, W, dh, Mg).index_copy_(1, li, E)  # the gradient of the state after every chunk
        return (*_transition_grads(e, K, W, h_all, D), D, None, None, None)


def _take(x: Tensor | None, idx: Tensor) -> Tensor | None:
    return None if x is None else x[:, idx]


def segment_scan(e: Tensor, K: Tensor | None, W: Tensor | None, b: Tensor, segments: Segments, *, group_name: str,
                 layout: str = "zigzag") -> Tensor:
    """The state entering every chunk of packed documents' segments across the ranks (Note [Parallel state passing with
    packed documents]): e ``(H, NC, d, 1)``, K and W ``(H, NC, c, Dk)`` (both or neither), b ``(H, NC, Dk, Dv)`` fp32
    over the chunk list of ``segments`` (every local segment's chunks, in flat segment order); every document's state
    is zero before its first token. Returns ``(H, NC, Dk, Dv)``; differentiable in e, K, W and b.
    """
    if (K is None) != (W is None):
        raise ValueError("K and W come together (the delta rule's transition e - K^T W) or not at all (SSD)")
    if b.shape[1] != segments.n_chunks:
        raise ValueError(f"b holds {b.shape[1]} chunks, the segments {segments.n_chunks}")
    return _SegmentScan.apply(e, K, W, b, segments, group_name, layout)

"""Ring attention: LightSeq's DistAttn (Li et al., arXiv:2310.03294, §3.1-3.2, appendix Alg. 1),
with LoongTrain's double ring (Gu et al., arXiv:2406.18485, §4.3).

Note [Ring attention]
~~~~~~~~~~~~~~~~~~~~~
Each of the W ranks holds the queries and keys/values of its shard. Keys/values travel around the
ring; at step i rank r holds the K/V of rank (r - i) mod W, attends its queries to them and merges
the partial result (Note [Merging partial attention]). The next K/V transfer is posted before the
current block is computed, so communication hides behind compute (asynchronous P2P; on GPU NCCL
runs it on its own stream).

    step 0        step 1        step 2        step 3          (W = 4, K/V moving to r+1)
    r0: kv0       r0: kv3       r0: kv2       r0: kv1
    r1: kv1       r1: kv0       r1: kv3       r1: kv2
    ...

K and V travel as one [2, B, S, H_kv, D] buffer: one send per hop, and only the H_kv heads —
GQA/MQA groups are formed locally, never before the transfer.

Backward: dq stays home; dK/dV accumulators (fp32) travel with their K/V block and are summed
into by every rank the block visits; one last hop brings each back to its owner. A rank computes
its block's gradients first and only then waits for the accumulator (which travelled meanwhile),
so two fp32 dK/dV buffers are live, not four.

Causal load balance (zigzag layout, rank r holds chunks r and 2W-1-r) — with K/V from rank s:
    s == r : causal attention of the local shard to itself (chunk r precedes chunk 2W-1-r)
    s <  r : all local queries see chunk s only          -> half a block, no mask
    s >  r : only chunk 2W-1-r sees both chunks of s     -> half a block, no mask
so every rank computes the same amount at every step and no fully masked block is computed.
Contiguous layout: s < r full, s == r causal, s > r skipped (unbalanced: the last rank works
W times more; offered for non-causal attention and comparison).

Double ring (LoongTrain §4.3): the W ranks form G = W / w inner rings of w consecutive ranks.
Within an outer step the K/V blocks rotate in the inner ring (w steps); meanwhile each rank
fetches the block its outer neighbour started with, which starts the next outer step. With w
set to the ranks of one node, inner hops use NVLink and only the outer hops cross nodes, and each
outer hop is hidden behind w inner steps. rank = g * w + j (g: inner ring, j: position in it);
at outer step o, inner step t, rank (g, j) holds the block of rank ((g - o) mod G, (j - t) mod w).
Backward: the dK/dV accumulator rides with its block through the inner ring, makes one more inner
hop back to the rank that started the outer step with it, then an outer hop along with the next
block; after the last outer step one outer hop delivers it home. w = W is the plain ring.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_seqpar.attention.comm import P2P
from lightning_seqpar.attention.varlen import Block, DocSegments, ring_doc_plan
from lightning_seqpar.attention.local import acc_dtype, block_backward, block_forward
from lightning_seqpar.attention.masked import variant_block_backward, variant_block_forward
from lightning_seqpar.attention.merge import merge_, new_accumulators
from lightning_seqpar.attention.variants import Variant, VariantPlan


def block_plan(rank: int, src: int, causal: bool, layout: str, s_local: int, docs: DocSegments | None = None) -> list[Block]:
    """Which (query rows, key rows, causal, segments) blocks rank ``rank`` computes against K/V of ``src``.

    With packed documents ``docs`` the blocks are varlen (``lightning_seqpar.attention.varlen``).
    """
    if docs is not None:
        return ring_doc_plan(rank, src, causal, s_local, docs)
    every = slice(None)
    if not causal:
        return [(every, every, False, None)]
    if src == rank:
        return [(every, every, True, None)]
    if layout == "contiguous":
        return [(every, every, False, None)] if src < rank else []
    half = s_local // 2
    if src < rank:
        return [(every, slice(0, half), False, None)]
    return [(slice(half, None), every, False, None)]


def _plan(plan: VariantPlan | None, rank: int, src: int, causal: bool, layout: str, s_local: int, seg: DocSegments | None):
    """(query rows, key rows, causal, segments, Mask) of every block: the variant plan's when there is one."""
    if plan is not None:
        return [(rows, cols, False, None, mask) for rows, cols, mask in plan.blocks(rank, src)]
    return [(rows, cols, c, vl, None) for rows, cols, c, vl in block_plan(rank, src, causal, layout, s_local, seg)]


def block_fwd(q, k, v, is_causal, vl, mask, scale, backend):
    if mask is not None:
        return variant_block_forward(q, k, v, mask, scale=scale, backend=backend)
    return block_forward(q, k, v, causal=is_causal, scale=scale, backend=backend, varlen=vl)


def block_bwd(dout, q, k, v, out, lse, is_causal, vl, mask, scale, backend):
    if mask is not None:
        return variant_block_backward(dout, q, k, v, out, lse, mask, scale=scale, backend=backend)
    return block_backward(dout, q, k, v, out, lse, causal=is_causal, scale=scale, backend=backend, varlen=vl)


def _steps(plan: VariantPlan | None, G: int, w: int) -> int:
    """Ring steps to run: all w, or (one ring with a variant plan) only as far as any rank needs."""
    return plan.steps if plan is not None and G == 1 else w


def _geometry(rank: int, world: int, inner: int | None) -> tuple[int, int, int, int]:
    w = world if inner is None else inner
    return world // w, w, rank // w, rank % w


def ring_forward(q, k, v, *, group: dist.ProcessGroup, causal: bool, layout: str, scale: float,
                 backend: str, inner: int | None = None, docs: torch.Tensor | None = None,
                 variant: Variant | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention forward: ``(out [B,S,Hq,D] in q.dtype, lse [B,Hq,S] fp32)``; ``docs``: piece lengths of packed documents;
    ``variant``: window / chunk / softcap (Note [Attention variants])."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seg = DocSegments(docs, q.device) if docs is not None and variant is None else None
    plan = VariantPlan(world, layout, q.shape[1], docs, variant, q.device) if variant is not None else None
    G, w, g, j = _geometry(rank, world, inner)
    T = _steps(plan, G, w)
    comm = P2P(group)
    s_local = q.shape[1]
    out, lse = new_accumulators(q, v.shape[-1])
    home = torch.stack([k, v])  # (2, B, S, Hkv, D): one buffer, one send per hop
    for o in range(G):
        outer_works, outer_next = [], None
        if o < G - 1:  # fetch the block that starts the next outer step (hidden behind w inner steps)
            outer_next = torch.empty_like(home)
            outer_works = comm.post([(home, ((g + 1) % G) * w + j)], [(outer_next, ((g - 1) % G) * w + j)])
        cur = home
        for t in range(T):
            works, nxt = [], None
            if t < T - 1:
                nxt = torch.empty_like(cur)
                works = comm.post([(cur, g * w + (j + 1) % w)], [(nxt, g * w + (j - 1) % w)])
            src = ((g - o) % G) * w + (j - t) % w
            for rows, cols, is_causal, vl, mask in _plan(plan, rank, src, causal, layout, s_local, seg):
                blk_out, blk_lse = block_fwd(q[:, rows], cur[0][:, cols], cur[1][:, cols], is_causal, vl, mask, scale, backend)
                merge_(out, lse, blk_out, blk_lse, rows)
            comm.wait(works)
            cur = nxt if nxt is not None else cur
        comm.wait(outer_works)
        if outer_next is not None:
            home = outer_next
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, *, group: dist.ProcessGroup, causal: bool, layout: str,
                  scale: float, backend: str, inner: int | None = None, docs: torch.Tensor | None = None,
                  variant: Variant | None = None):
    """Ring attention backward: ``(dq, dk, dv)`` of this rank's shard (see Note [Ring attention])."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    seg = DocSegments(docs, q.device) if docs is not None and variant is None else None
    plan = VariantPlan(world, layout, q.shape[1], docs, variant, q.device) if variant is not None else None
    G, w, g, j = _geometry(rank, world, inner)
    T = _steps(plan, G, w)
    comm = P2P(group)
    s_local = q.shape[1]
    inner_next, inner_prev = g * w + (j + 1) % w, g * w + (j - 1) % w
    outer_next, outer_prev = ((g + 1) % G) * w + j, ((g - 1) % G) * w + j
    acc = acc_dtype(q.dtype, q.device)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    home = torch.stack([k, v])
    dkv_home = torch.zeros(home.shape, dtype=acc, device=q.device)  # partial dK/dV of `home`
    for o in range(G):
        kv_outer_works, kv_outer_next = [], None
        if o < G - 1:
            kv_outer_next = torch.empty_like(home)
            kv_outer_works = comm.post([(home, outer_next)], [(kv_outer_next, outer_prev)])
        cur, dkv_works, dkv_in = home, [], None
        for t in range(T):
            kv_works, nxt = [], None
            if t < T - 1:
                nxt = torch.empty_like(cur)
                kv_works = comm.post([(cur, inner_next)], [(nxt, inner_prev)])
            src = ((g - o) % G) * w + (j - t) % w
            grads = []  # this block's (cols, dk, dv), in the kernel's dtype, until the accumulator arrives
            for rows, cols, is_causal, vl, mask in _plan(plan, rank, src, causal, layout, s_local, seg):
                dq_b, dk_b, dv_b = block_bwd(dout[:, rows], q[:, rows], cur[0][:, cols], cur[1][:, cols], out[:, rows], lse[:, :, rows],
                                             is_causal, vl, mask, scale, backend)
                dq[:, rows] += dq_b
                grads.append((cols, dk_b, dv_b))
            # Note [Two dK/dV buffers]: the accumulator of this block is dkv_home (t == 0) or the one that
            # arrived while the block was computed; the block's gradients go into it, then it travels on.
            # Live fp32 dK/dV buffers: the one in flight out and the one in flight in.
            if t == 0:
                acc, dkv_home = dkv_home, None
            else:
                comm.wait(dkv_works)
                acc = dkv_in
            for cols, dk_b, dv_b in grads:
                acc[0][:, cols] += dk_b
                acc[1][:, cols] += dv_b
            del grads
            # pass the accumulator on with (t < T-1) or after (t == T-1: back to the step's starter) its block;
            # a ring cut short (T < w, Note [Windows, zigzag and the ring]) sends it home in one direct hop
            if T > 1:
                dkv_in = torch.empty_like(acc)
                to, frm = (inner_next, inner_prev) if t < T - 1 else (g * w + (j - t) % w, g * w + (j + t) % w)
                dkv_works = comm.post([(acc, to)], [(dkv_in, frm)])
            else:
                dkv_in = acc
            comm.wait(kv_works)
            cur = nxt if nxt is not None else cur
        comm.wait(dkv_works)
        del acc
        # dkv_in: dK/dV of `home` summed over this inner ring; send it on with the block's next visit
        comm.wait(kv_outer_works)
        if G > 1:
            dkv_home = torch.empty_like(dkv_in)
            comm.wait(comm.post([(dkv_in, outer_next)], [(dkv_home, outer_prev)]))
        else:
            dkv_home = dkv_in
        if kv_outer_next is not None:
            home = kv_outer_next
    return dq.to(q.dtype), dkv_home[0].to(k.dtype), dkv_home[1].to(v.dtype)

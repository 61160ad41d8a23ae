"""All-gather attention: the LSS Transformer's fused communication (Wang et al.,
arXiv:2311.02382, Principle 3), the scheme torch-native context parallel and Llama 3 also use.

Note [All-gather attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
One all-gather moves every rank's K and V (one [2, B, S_local, H_kv, D] buffer: only the K/V
heads, never the query-head repeat) to every rank. The gathered keys are put in global order;
each local query chunk c (global chunk index) then attends

    keys of chunks < c   -> one unmasked block
    keys of chunk c      -> one causal (diagonal) block

and the two partial results are merged (Note [Merging partial attention]). Non-causal attention
is one block against all keys. Under zigzag every rank attends to the same number of keys.

Backward all-gathers K/V again (nothing of size S is kept between forward and backward), computes
dQ and the full dK/dV, and reduce-scatters dK/dV back to their owners (fp32 sums).

Packed documents: each local half gathers, with one index, the keys of its documents' earlier
pieces from the rank-ordered buffer and runs one varlen call (``lightning_seqpar.attention.varlen``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_seqpar.attention.varlen import DocSegments, gathered_doc_plan
from lightning_seqpar.attention.local import acc_dtype, block_backward, block_forward
from lightning_seqpar.attention.comm import all_gather_into, reduce_scatter_into
from lightning_seqpar.attention.masked import variant_block_backward, variant_block_forward
from lightning_seqpar.attention.merge import merge_, new_accumulators
from lightning_seqpar.attention.variants import Variant, VariantPlan
from lightning_seqpar.sharding.layouts import chunk_ids, num_chunks



def global_order(world: int, layout: str, s_local: int, device) -> torch.Tensor:
    """Index that puts the rank-ordered gathered sequence into global order."""
    per = len(chunk_ids(0, world, layout))
    c = s_local // per
    pos = torch.cat([torch.arange(cid * c, (cid + 1) * c, device=device) for r in range(world) for cid in chunk_ids(r, world, layout)])
    order = torch.empty_like(pos)
    order[pos] = torch.arange(pos.numel(), device=device)
    return order


def _gather_kv(k, v, group):
    world = dist.get_world_size(group)
    kv = torch.stack([k, v])  # (2, B, S, Hkv, D)
    full = torch.empty((world * 2, *kv.shape[1:]), dtype=kv.dtype, device=kv.device)
    all_gather_into(full, kv, group=group)
    return full.view(world, *kv.shape)  # (W, 2, B, S, Hkv, D) in group-rank order


def _blocks(rank: int, world: int, causal: bool, layout: str, s_local: int):
    """(query rows, key range in global order, causal) blocks of this rank."""
    S = s_local * world
    if not causal:
        return [(slice(None), slice(0, S), False)]
    c = S // num_chunks(world, layout)
    out = []
    for i, cid in enumerate(chunk_ids(rank, world, layout)):
        rows = slice(i * c, (i + 1) * c)
        if cid > 0:
            out.append((rows, slice(0, cid * c), False))
        out.append((rows, slice(cid * c, (cid + 1) * c), True))
    return out


def _ordered(full: torch.Tensor, world: int, layout: str, s_local: int) -> torch.Tensor:
    """(W, 2, B, S, H, D) rank-ordered -> (2, B, W*S, H, D) in global sequence order."""
    return _rank_ordered(full).index_select(2, global_order(world, layout, s_local, full.device))


def gathered_forward(q, kv, *, rank: int, world: int, causal: bool, layout: str, scale: float, backend: str):
    """Local queries over the whole sequence's K/V ``kv`` = (2, B, S, H, D) in global order."""
    s_local = q.shape[1]
    out, lse = new_accumulators(q, kv.shape[-1])
    for rows, cols, is_causal in _blocks(rank, world, causal, layout, s_local):
        o, l = block_forward(q[:, rows], kv[0][:, cols], kv[1][:, cols], causal=is_causal, scale=scale, backend=backend)
        merge_(out, lse, o, l, rows)
    return out.to(q.dtype), lse


def gathered_backward(dout, q, kv, out, lse, *, rank: int, world: int, causal: bool, layout: str, scale: float, backend: str):
    """``(dq, dkv)`` of :func:`gathered_forward`; dkv (fp32) in global order, summed over local queries only."""
    s_local = q.shape[1]
    dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype, q.device), device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc_dtype(q.dtype, q.device), device=q.device)
    for rows, cols, is_causal in _blocks(rank, world, causal, layout, s_local):
        dq_b, dk_b, dv_b = block_backward(dout[:, rows], q[:, rows], kv[0][:, cols], kv[1][:, cols], out[:, rows], lse[:, :, rows],
                                          causal=is_causal, scale=scale, backend=backend)
        dq[:, rows] += dq_b
        dkv[0][:, cols] += dk_b
        dkv[1][:, cols] += dv_b
    return dq, dkv


def doc_gathered_forward(q, kv, *, rank: int, world: int, causal: bool, scale: float, backend: str, docs: torch.Tensor):
    """Packed documents: local queries over the whole sequence's K/V ``kv`` = (2, B, W*S, H, D) in RANK order."""
    s_local = q.shape[1]
    out, lse = new_accumulators(q, kv.shape[-1])
    flat = kv.reshape(2, -1, *kv.shape[3:])  # (2, B*W*S, H, D)
    for rows, index, is_causal, vl in gathered_doc_plan(rank, world, causal, s_local, DocSegments(docs, q.device)):
        o, l = block_forward(q[:, rows], flat[0].index_select(0, index)[None], flat[1].index_select(0, index)[None],
                             causal=is_causal, scale=scale, backend=backend, varlen=vl)
        out[:, rows] = o  # every query row belongs to exactly one call: nothing to merge
        lse[:, :, rows] = l
    return out.to(q.dtype), lse


def doc_gathered_backward(dout, q, kv, out, lse, *, rank: int, world: int, causal: bool, scale: float, backend: str, docs: torch.Tensor):
    """``(dq, dkv)`` of :func:`doc_gathered_forward`; dkv (fp32) in rank order like ``kv``."""
    s_local = q.shape[1]
    dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype, q.device), device=q.device)
    flat = kv.reshape(2, -1, *kv.shape[3:])
    dkv = torch.zeros(flat.shape, dtype=acc_dtype(q.dtype, q.device), device=q.device)
    for rows, index, is_causal, vl in gathered_doc_plan(rank, world, causal, s_local, DocSegments(docs, q.device)):
        dq_b, dk_b, dv_b = block_backward(dout[:, rows], q[:, rows], flat[0].index_select(0, index)[None], flat[1].index_select(0, index)[None],
                                          out[:, rows], lse[:, :, rows], causal=is_causal, scale=scale, backend=backend, varlen=vl)
        dq[:, rows] += dq_b
        dkv[0].index_add_(0, index, dk_b[0].to(dkv.dtype))
        dkv[1].index_add_(0, index, dv_b[0].to(dkv.dtype))
    return dq, dkv.view(kv.shape)


def to_rank_order(x: torch.Tensor, world: int, layout: str, s_local: int, dim: int) -> torch.Tensor:
    """Inverse of the global reordering along ``dim``: global order -> rank order."""
    order = global_order(world, layout, s_local, x.device)
    return torch.empty_like(x).index_copy_(dim, order, x)


def _rank_ordered(full: torch.Tensor) -> torch.Tensor:
    """(W, 2, B, S, H, D) -> (2, B, W*S, H, D), still in rank order."""
    W, two, B, S, H, D = full.shape
    return full.permute(1, 2, 0, 3, 4, 5).reshape(two, B, W * S, H, D)


def _reduce_scatter_kv(dkv_rank_order: torch.Tensor, world: int, s_local: int, group) -> torch.Tensor:
    """(2, B, W*S, H, D) rank-ordered dK/dV sums of this rank -> (2, B, S, H, D) summed over ranks for this rank's rows."""
    two, B, _, H, D = dkv_rank_order.shape
    ranked = dkv_rank_order.reshape(two, B, world, s_local, H, D).permute(2, 0, 1, 3, 4, 5).reshape(world * two, B, s_local, H, D)
    mine = torch.empty((two, B, s_local, H, D), dtype=ranked.dtype, device=ranked.device)
    reduce_scatter_into(mine, ranked, group=group)
    return mine


def _shift(cols: slice, offset: int, s_local: int) -> slice:
    return slice(offset + (cols.start or 0), offset + (s_local if cols.stop is None else cols.stop))


def _variant_blocks(plan: VariantPlan, rank: int, world: int, s_local: int):
    """(query rows, key rows of the rank-ordered gathered K/V, Mask) of every non-skipped block."""
    return [(rows, _shift(cols, src * s_local, s_local), mask) for src in range(world) for rows, cols, mask in plan.blocks(rank, src)]


def variant_gathered_forward(q, kv, *, rank: int, world: int, layout: str, scale: float, backend: str, docs, variant: Variant):
    """Window / chunk / softcap (Note [Attention variants]): local queries over ``kv`` = (2, B, W*S, H, D) in RANK order,
    one block per (local half, source half) pair that the variant does not mask wholly."""
    s_local = q.shape[1]
    plan = VariantPlan(world, layout, s_local, docs, variant, q.device)
    out, lse = new_accumulators(q, kv.shape[-1])
    for rows, cols, mask in _variant_blocks(plan, rank, world, s_local):
        o, l = variant_block_forward(q[:, rows], kv[0][:, cols], kv[1][:, cols], mask, scale=scale, backend=backend)
        merge_(out, lse, o, l, rows)
    return out.to(q.dtype), lse


def variant_gathered_backward(dout, q, kv, out, lse, *, rank: int, world: int, layout: str, scale: float, backend: str, docs,
                              variant: Variant):
    """``(dq, dkv)`` of :func:`variant_gathered_forward`; dkv (fp32) in rank order like ``kv``."""
    s_local = q.shape[1]
    plan = VariantPlan(world, layout, s_local, docs, variant, q.device)
    acc = acc_dtype(q.dtype, q.device)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
    for rows, cols, mask in _variant_blocks(plan, rank, world, s_local):
        dq_b, dk_b, dv_b = variant_block_backward(dout[:, rows], q[:, rows], kv[0][:, cols], kv[1][:, cols], out[:, rows], lse[:, :, rows],
                                                  mask, scale=scale, backend=backend)
        dq[:, rows] += dq_b
        dkv[0][:, cols] += dk_b
        dkv[1][:, cols] += dv_b
    return dq, dkv


def allgather_forward(q, k, v, *, group, causal: bool, layout: str, scale: float, backend: str, docs: torch.Tensor | None = None,
                      variant: Variant | None = None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if variant is not None:
        kv = _rank_ordered(_gather_kv(k, v, group))
        return variant_gathered_forward(q, kv, rank=rank, world=world, layout=layout, scale=scale, backend=backend, docs=docs, variant=variant)
    if docs is not None:
        kv = _rank_ordered(_gather_kv(k, v, group))
        return doc_gathered_forward(q, kv, rank=rank, world=world, causal=causal, scale=scale, backend=backend, docs=docs)
    kv = _ordered(_gather_kv(k, v, group), world, layout, q.shape[1])
    return gathered_forward(q, kv, rank=rank, world=world, causal=causal, layout=layout, scale=scale, backend=backend)


def allgather_backward(dout, q, k, v, out, lse, *, group, causal: bool, layout: str, scale: float, backend: str,
                       docs: torch.Tensor | None = None, variant: Variant | None = None):
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    s_local = q.shape[1]
    if variant is not None:
        kv = _rank_ordered(_gather_kv(k, v, group))
        dq, ranked = variant_gathered_backward(dout, q, kv, out, lse, rank=rank, world=world, layout=layout, scale=scale, backend=backend,
                                               docs=docs, variant=variant)
    elif docs is not None:
        kv = _rank_ordered(_gather_kv(k, v, group))
        dq, ranked = doc_gathered_backward(dout, q, kv, out, lse, rank=rank, world=world, causal=causal, scale=scale, backend=backend, docs=docs)
    else:
        kv = _ordered(_gather_kv(k, v, group), world, layout, s_local)
        dq, dkv = gathered_backward(dout, q, kv, out, lse, rank=rank, world=world, causal=causal, layout=layout, scale=scale, backend=backend)
        ranked = to_rank_order(dkv, world, layout, s_local, dim=2)
    # reduce-scatter the rank-ordered sums: rank r receives the sum of its rows
    mine = _reduce_scatter_kv(ranked, world, s_local, group)
    return dq.to(q.dtype), mine[0].to(k.dtype), mine[1].to(v.dtype)

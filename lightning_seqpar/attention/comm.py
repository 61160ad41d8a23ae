"""The communication helpers the attention algorithms share: process groups by name, batched
point-to-point exchanges (the ring, LASP's state chain, the recurrences' state chain), the
single-tensor all-gather / reduce-scatter pair (all-gather attention, LASP's all-gather variant; stacked
per rank, and under autograd, for the recurrences' parallel state passing)
and the K/V head repeat that lets head-parallel ranks split the key/value heads (Ulysses, 2D, the
cost model). Collectives only: no attention math here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["AllGatherStacked", "P2P", "all_gather_into", "gather_stacked", "kv_repeat", "process_group", "reduce_scatter_into"]


def process_group(name: str) -> dist.ProcessGroup:
    """The process group registered as ``name`` (``ProcessGroup.group_name``): groups cross the custom ops'
    boundary by name (Note [Custom ops] in ``lightning_seqpar.attention.api``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group  # torch's own registry of named groups

    return _resolve_process_group(name)


class P2P:
    """Posts a batch of sends/receives on ``group`` (group-local ranks) and waits for it later."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)

    def post(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]):
        ops = [dist.P2POp(dist.isend, t, self.ranks[p], self.group) for t, p in sends]
        ops += [dist.P2POp(dist.irecv, t, self.ranks[p], self.group) for t, p in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    @staticmethod
    def wait(works) -> None:
        for w in works:
            w.wait()


def all_gather_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``out`` (world x ``inp`` along dim 0) <- every rank's ``inp`` in group-rank order."""
    # torch 2.13 renamed the single-tensor collectives; 2.11 has only the old names.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``out`` <- this rank's slice (dim 0) of ``inp`` summed over the ranks: the all-gather's backward."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def gather_stacked(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` on every rank -> ``[W, *x.shape]`` in group-rank order (not differentiable)."""
    world = dist.get_world_size(group)
    out = x.new_empty(world * x.shape[0], *x.shape[1:])
    all_gather_into(out, x.contiguous(), group)
    return out.reshape(world, *x.shape)


class AllGatherStacked(torch.autograd.Function):
    """:func:`gather_stacked` under autograd: the backward reduce-scatters, each rank getting its own slice of the
    gradient summed over the ranks. ``AllGatherStacked.apply(x, group_name)``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group_name: str) -> torch.Tensor:
        ctx.group_name = group_name
        return gather_stacked(x, process_group(group_name))

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        out = dout.new_empty(dout.shape[1:])
        reduce_scatter_into(out, dout.contiguous().reshape(-1, *dout.shape[2:]), process_group(ctx.group_name))
        return out, None


def kv_repeat(h_q: int, h_kv: int, degree: int) -> int | None:
    """Smallest repeat r of the K/V heads that lets ``degree`` head-parallel ranks split them (LoongTrain §4.2);
    None when none does."""
    groups = h_q // h_kv
    for r in range(1, groups + 1):
        if groups % r == 0 and (h_kv * r) % degree == 0:
            return r
    return None

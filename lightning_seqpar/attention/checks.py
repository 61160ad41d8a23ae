"""Input checks shared by the attention entry points: local metadata first, so they run before
any collective and every rank fails the same way; then one small check that the ranks agree."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def check_qkv_tensors(q, k, v) -> None:
    """q, k, v are 4-D floating-point tensors [B, S, H, D] of one dtype on one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must have 4 dims [batch, seq_local, heads, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.shape[2] == 0 or t.shape[3] == 0:
            raise ValueError(f"{name} must have at least one head and head_dim >= 1, got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype; got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device; got q={q.device}, k={k.device}, v={v.device}")


# Note [Inputs that differ across ranks]: the checks above read this rank's tensors only. Ranks that
# disagree — a sequence cut unevenly with torch.chunk, another head count, causal on one rank only —
# would send and receive blocks of different sizes: gloo aborts, NCCL may hang or read past a
# buffer. So the first call on a mesh gathers every rank's signature (shapes, dtype, options: a few
# numbers, all-gathered along mesh dimension 0, then that block along dimension 1, ..., so every
# rank ends with the whole mesh's through the same collectives whatever it holds), and every rank
# raises the same ValueError if they differ. Once per mesh and process, until a call agrees: later
# calls are not checked, since a rank cannot know without communicating whether the others' shapes
# changed with its own (checking each new signature would let one rank check while another skips,
# and hang). A rank that fails a local check while the others pass is not caught either (they wait
# in the gather until the process group's timeout). shard_sequence and the strategy's batch hook
# always give every rank the same shapes. Nothing runs while torch.compile traces (the check is for
# the eager first call), and none on a one-rank mesh.
_AGREED: set[tuple] = set()


def check_ranks_agree(mesh, fields: dict[str, float], device: torch.device, what: str) -> None:
    """Every rank of ``mesh`` passed the same ``fields`` (name -> number), or the same ValueError on all of them;
    checked until the first call on ``mesh`` that agrees (Note [Inputs that differ across ranks])."""
    if mesh.size() == 1 or torch.compiler.is_compiling():
        return
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    key = tuple(g.group_name for g in groups)
    if key in _AGREED:
        return
    names = list(fields)
    if mesh.device_type != device.type:
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    table = torch.tensor([float(fields[n]) for n in names], dtype=torch.float64, device=device)
    for group in groups:  # table: (size_{i-1}, ..., size_0, fields) after dimension i - 1
        rows = [torch.empty_like(table) for _ in range(dist.get_world_size(group))]
        dist.all_gather(rows, table.contiguous(), group=group)
        table = torch.stack(rows)
    table = table.permute(*reversed(range(mesh.ndim)), mesh.ndim).reshape(-1, len(names)).cpu()  # mesh order
    differ = [i for i in range(len(names)) if not bool((table[:, i] == table[0, i]).all())]
    if differ:
        ranks = mesh.mesh.flatten().tolist()
        per_rank = {names[i]: {r: _num(x) for r, x in sorted(zip(ranks, table[:, i].tolist()))} for i in differ}
        raise ValueError(
            f"{what}: the ranks of the mesh passed different inputs: {per_rank} (rank: value); every rank must pass "
            "tensors of the same shape and the same options — shard the full tensors with "
            "lightning_seqpar.sharding.shard_sequence (pad the sequence to a multiple of 2 * sequence-parallel size "
            "for the zigzag layout)"
        )
    _AGREED.add(key)


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x

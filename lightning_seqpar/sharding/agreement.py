"""One check that needs communication: the ranks of a mesh passed the same inputs
(Note [Inputs that differ across ranks]). Used by ``sequence_parallel_attention`` and ``unshard_sequence``."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

# Note [Inputs that differ across ranks]: input checks read this rank's tensors only. Ranks that
# disagree — a sequence cut unevenly with torch.chunk, another head count, causal on one rank only —
# would send and receive blocks of different sizes: gloo aborts, NCCL may hang or read past a
# buffer. So the first call on a mesh gathers every rank's signature (shapes, dtype, options: a few
# numbers, all-gathered along mesh dimension 0, then that block along dimension 1, ..., so every
# rank ends with the whole mesh's through the same collectives whatever it holds), and every rank
# raises the same ValueError if they differ. A caller that calls again and again (an ``Attention``
# module: ``apply_attention`` gives all of a model's modules one) keeps a ``RankAgreement``: with
# it, the check runs on a mesh until a call agrees and not after; without one, on every call. Later
# calls are not checked, since a rank cannot know without communicating whether the others' shapes
# changed with its own (checking each new signature would let one rank check while another skips,
# and hang). A rank that fails a local check while the others pass is not caught either (they wait
# in the gather until the process group's timeout). shard_sequence and the strategy's batch hook
# always give every rank the same shapes. Each entry point (``what``) has its own first call and a
# fixed set of fields (the gathered tensors must have one size on every rank). Nothing runs while
# torch.compile traces (the check is for the eager first call), and none on a one-rank mesh.


class RankAgreement:
    """The (entry point, mesh) pairs whose ranks agreed (Note [Inputs that differ across ranks]): owned by the
    caller that calls on one mesh again and again (an ``Attention`` module), so that only its first calls
    communicate; the state lives as long as that caller."""

    def __init__(self) -> None:
        self._agreed: set[tuple[str, ...]] = set()

    def __contains__(self, key: tuple[str, ...]) -> bool:
        return key in self._agreed

    def add(self, key: tuple[str, ...]) -> None:
        self._agreed.add(key)


def check_ranks_agree(mesh, fields: Callable[[], dict[str, float]], device: torch.device, what: str,
                      agreement: RankAgreement | None = None) -> None:
    """Every rank of ``mesh`` passed the same ``fields()`` (name -> number), or the same ValueError on all of them
    (Note [Inputs that differ across ranks]). With ``agreement``: checked until the first call on ``mesh`` that
    agrees, and not after (``fields`` is a callable so that those later calls, hot paths, build nothing);
    without: on this call."""
    if mesh.size() == 1 or torch.compiler.is_compiling():
        return
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    key = (what, *(g.group_name for g in groups))
    if agreement is not None and key in agreement:
        return
    values = fields()
    names = list(values)
    if mesh.device_type != device.type:
        device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    table = torch.tensor([float(values[n]) for n in names], dtype=torch.float64, device=device)
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
    if agreement is not None:
        agreement.add(key)


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else x

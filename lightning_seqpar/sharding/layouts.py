"""Split a full sequence across sequence-parallel ranks, and put it back together.

Note [Sequence layouts]
~~~~~~~~~~~~~~~~~~~~~~~
With W context-parallel ranks, a sequence of S tokens is cut into chunks:

    contiguous (W chunks of S/W):      rank r holds chunk r
        | r0 | r1 | r2 | r3 |
    zigzag (2W chunks of S/(2W)):      rank r holds chunks r and 2W-1-r   (LightSeq §3.2)
        | r0 | r1 | r2 | r3 | r3 | r2 | r1 | r0 |

Under a causal mask, token t attends to t+1 keys, so the contiguous layout gives the last rank
W times the work of the first; zigzag pairs an early chunk with a late one and every rank gets
the same number of (query, key) pairs.

On a 2-D mesh with axes ("hp", "cp") (LoongTrain 2D attention), the sequence is first split
over "cp" with the chosen layout, and each cp shard is then split contiguously over "hp". The
head-parallel all-to-all inside an hp group gathers exactly the cp shard back, so the ring over
"cp" sees the 1-D layout. How ranks are placed on devices (head-first or context-first) is
decided by the order of the mesh dimensions and does not change what a rank holds.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.sharding.agreement import RankAgreement, check_ranks_agree

Layout = Literal["zigzag", "contiguous"]
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; expected one of {LAYOUTS}")


def mesh_sizes(mesh: DeviceMesh) -> tuple[int, int, int, int]:
    """(hp_size, hp_rank, cp_size, cp_rank) of this rank for a 1-D mesh or a 2-D ("hp", "cp") mesh."""
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return 1, 0, mesh.size(), mesh.get_local_rank()
    names = mesh.mesh_dim_names or ()
    if mesh.ndim == 2 and set(names) == {"hp", "cp"}:
        return mesh.size(names.index("hp")), mesh.get_local_rank("hp"), mesh.size(names.index("cp")), mesh.get_local_rank("cp")
    raise ValueError(
        f"mesh must be 1-D (the sequence-parallel ranks) or 2-D with dimension names ('hp', 'cp'); "
        f"got ndim={mesh.ndim}, mesh_dim_names={names}"
    )


def num_chunks(world: int, layout: str) -> int:
    """How many equal chunks the sequence is cut into for ``world`` context-parallel ranks."""
    _check_layout(layout)
    return 2 * world if layout == "zigzag" else world


def chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """Global chunk indices held by ``rank``, in local order."""
    _check_layout(layout)
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def in_global_order(per_rank: torch.Tensor, world: int, layout: str) -> list[torch.Tensor]:
    """``[W, P, ...]`` (every rank's local chunks, in rank order) -> a list of the chunks indexed by their global index."""
    out: list[torch.Tensor] = [per_rank[0, 0]] * num_chunks(world, layout)
    for r in range(world):
        for i, p in enumerate(chunk_ids(r, world, layout)):
            out[p] = per_rank[r, i]
    return out


def required_multiple(mesh: DeviceMesh, layout: str) -> int:
    """The global sequence length must be a multiple of this number (with one cp rank both layouts
    are the identity: only the hp split remains)."""
    hp, _, cp, _ = mesh_sizes(mesh)
    return (num_chunks(cp, layout) if cp > 1 else 1) * hp


def _check_length(seq_len: int, mesh: DeviceMesh, layout: str, what: str) -> None:
    m = required_multiple(mesh, layout)
    if seq_len % m:
        hp, _, cp, _ = mesh_sizes(mesh)
        detail = f"2 * cp_size ({cp}) * hp_size ({hp})" if layout == "zigzag" and cp > 1 else f"cp_size ({cp}) * hp_size ({hp})"
        raise ValueError(
            f"{what}={seq_len} must be divisible by {m} = {detail} for layout={layout!r}; "
            f"pad the sequence (labels ignored) to a multiple of {m}"
        )


def sequence_index(seq_len: int, mesh: DeviceMesh, layout: Layout = "zigzag", device: torch.device | str | None = None) -> torch.Tensor:
    """Global positions (0..seq_len-1) of this rank's local tokens, in local order. Shape [seq_len / world]."""
    _check_layout(layout)
    _check_length(seq_len, mesh, layout, "seq_len")
    hp, hp_rank, cp, cp_rank = mesh_sizes(mesh)
    if cp == 1:
        return torch.arange(seq_len, device=device).chunk(hp)[hp_rank]
    chunk = seq_len // num_chunks(cp, layout)
    cp_index = torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in chunk_ids(cp_rank, cp, layout)])
    return cp_index.chunk(hp)[hp_rank]


def _check_dim(x: torch.Tensor, dim: int) -> int:
    """``dim`` of ``x`` as a non-negative index, or a ValueError naming it."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a tensor, got {type(x).__name__}")
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim={dim!r} is out of range for x of shape {tuple(x.shape)} (expected an int in [{-x.ndim}, {x.ndim - 1}])")
    return dim % x.ndim


def shard_sequence(x: torch.Tensor, mesh: DeviceMesh, dim: int = 1, layout: Layout = "zigzag") -> torch.Tensor:
    """This rank's shard of a full tensor ``x`` along ``dim`` (a view-free gather; differentiable)."""
    _check_layout(layout)
    dim = _check_dim(x, dim)
    _check_length(x.shape[dim], mesh, layout, f"x.shape[{dim}]")
    idx = sequence_index(x.shape[dim], mesh, layout, device=x.device)
    return x.index_select(dim, idx)


def unshard_sequence(x: torch.Tensor, mesh: DeviceMesh, dim: int = 1, layout: Layout = "zigzag", *,
                     agreement: RankAgreement | None = None) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: every rank gets the full tensor (all-gather over the mesh).

    Differentiable: the gradient of the full tensor is summed over ranks and each rank keeps the
    rows of its own shard (the all-gather / reduce-scatter pair). ``agreement``: see
    :func:`lightning_seqpar.sharding.agreement.check_ranks_agree` (None: the ranks' inputs are compared on every call).
    """
    _check_layout(layout)
    dim = _check_dim(x, dim)
    hp, _, cp, _ = mesh_sizes(mesh)
    _check_length(x.shape[dim] * hp * cp, mesh, layout, f"the global length (x.shape[{dim}]={x.shape[dim]} x {hp * cp} ranks)")  # before the all-gather
    check_ranks_agree(mesh, lambda: _signature(x, dim, layout), x.device, "unshard_sequence", agreement)  # Note [Inputs that differ across ranks]
    if mesh.ndim == 2 and hp > 1:  # the hp split of a cp shard is contiguous: gathering restores it
        x = gather_along(x, mesh.get_group("hp"), dim)
    if cp == 1:
        return x
    x = gather_along(x, mesh.get_group("cp") if mesh.ndim == 2 else mesh.get_group(), dim)
    full_len = x.shape[dim]
    chunk = full_len // num_chunks(cp, layout)
    local = torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=x.device) for r in range(cp) for c in chunk_ids(r, cp, layout)])
    order = torch.empty_like(local)
    order[local] = torch.arange(full_len, device=x.device)
    return x.index_select(dim, order)


def _signature(x: torch.Tensor, dim: int, layout: str) -> dict[str, float]:
    """What every rank's ``unshard_sequence`` input must share: ndim, dim, layout, dtype and the sizes
    of the first 8 dims (-1 past ndim; a fixed number of fields) and the element count."""
    sizes = {f"shape[{i}]": float(x.shape[i]) if i < x.ndim else -1.0 for i in range(8)}
    return dict(ndim=x.ndim, dim=dim, layout=LAYOUTS.index(layout), dtype_bytes=x.element_size(),
                floating=int(x.is_floating_point()), numel=x.numel(), **sizes)


def gather_along(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """The ranks' ``x`` concatenated along ``dim`` in group-rank order (differentiable all-gather)."""
    import torch.distributed._functional_collectives as fc

    gather = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd  # renamed after torch 2.11
    out = gather(x.movedim(dim, 0).contiguous(), gather_dim=0, group=group)
    if isinstance(out, fc.AsyncCollectiveTensor):  # wait here: a caller may keep the result without computing on it
        out = out.trigger_wait()
    return out.movedim(0, dim)

"""How the ranks are split: data-parallel replicas x data-parallel shards x sequence parallel.

Note [The device mesh]
~~~~~~~~~~~~~~~~~~~~~~
Every run has one 4-D :class:`~torch.distributed.device_mesh.DeviceMesh` with named axes::

    ("dp_replicate", "dp_shard", "hp", "cp")       sizes may be 1

* ``dp_replicate`` x ``dp_shard``: data parallel. Ranks that differ here see different samples.
  ``dp_replicate`` > 1 gives HSDP (FSDP2 replicas, each one sharding over the rest).
* ``hp`` x ``cp``: sequence parallel (sp = hp x cp). Ranks that differ only here see the same
  sample, each its own piece of the sequence. ``hp`` is head parallel (Ulysses all-to-all, or the
  head axis of LoongTrain 2D attention); ``cp`` is context parallel (ring / all-gather).

With the default placement the last axis varies fastest, so the ranks of one ``cp`` ring are
neighbours (same node first), then ``hp``, then the data-parallel axes: sequence-parallel
traffic, the heaviest, stays inside a node whenever sp <= devices per node (Note [Node-aware
placement] for the other order and for groups larger than a node). Example, 8 ranks, dp_shard=2, hp=2, cp=2::

    dp_shard 0:   hp 0: [0 1]   hp 1: [2 3]        cp rings:  {0,1} {2,3} {4,5} {6,7}
    dp_shard 1:   hp 0: [4 5]   hp 1: [6 7]        hp groups: {0,2} {1,3} {4,6} {5,7}

Model states are sharded by FSDP2 over dp_shard x hp x cp (LoongTrain §4.3: ZeRO over DP x SP,
so sequence parallelism also divides the memory of parameters, gradients and optimizer states)
and replicated over dp_replicate.

Note [Node-aware placement]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Launchers number the ranks node by node: global rank = node rank x ranks per node + local rank
(torchrun, and SLURM's default block distribution). Which mesh coordinates land on one node is
therefore decided by the order of the ranks in the mesh tensor; DeviceMesh takes any tensor of
global ranks (``DeviceMesh(device_type, mesh=tensor, ...)``; ``init_device_mesh`` only takes
shapes). LoongTrain (Gu et al., arXiv:2406.18485, §4.4) names the two orders for 2D attention:

* ``"context-first"`` (the default): cp varies fastest, so the ranks of a cp ring are
  neighbours and fill a node before the ring leaves it; the hp groups have stride cp. The inner
  rings of a double ring (§4.3, ``inner_ring_size`` = w) are w consecutive cp ranks: inside one
  node when w divides the node size, and the outer hops, one per inner-ring rank, use every NIC.
* ``"head-first"``: hp varies fastest, so the all-to-alls of an hp group stay on NVLink; the cp
  ranks have stride hp, and an inner ring of w spans w x hp consecutive ranks.

The data-parallel axes stay outermost in both (a sequence-parallel group is a block of sp
consecutive ranks), so only the order inside a block changes: 8 ranks, hp = 2, cp = 4::

    context-first:  hp 0: [0 1 2 3]  hp 1: [4 5 6 7]     cp rings {0,1,2,3} {4,5,6,7}, hp {0,4} ...
    head-first:     hp 0: [0 2 4 6]  hp 1: [1 3 5 7]     cp rings {0,2,4,6} {1,3,5,7}, hp {0,1} ...

With hp = 1 or cp = 1 both orders are the same. Along every axis the ranks increase, so the
rank of a process inside a group (``dist.get_rank(group)``, which follows the sorted global ranks
that ``new_group`` keeps) is its mesh coordinate: the ring's neighbours and the all-to-all's
chunk order are the mesh's. Given the node size (``node_size``: the launcher's
LOCAL_WORLD_SIZE, Lightning's devices per node), ParallelDims refuses a placement whose group
would straddle nodes without need: the group it places (hp head-first, cp context-first) must
divide the node size or be a multiple of it, and :meth:`ParallelDims.check_inner_ring` refuses
inner rings that leave a node.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "hp", "cp")
"""Names of the axes of the device mesh, outermost first."""

Placement = Literal["context-first", "head-first"]
PLACEMENTS: tuple[str, ...] = ("context-first", "head-first")
"""Orders of the ranks of a sequence-parallel group (Note [Node-aware placement])."""

FSDP_SHARD_AXIS = "dp_shard_sp"
"""Name of the axis FSDP2 shards over (dp_shard x hp x cp, flattened)."""


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of the four mesh axes. Their product is the world size.

    Args:
        dp_replicate: FSDP2 replicas (HSDP); each replica holds a full copy of the sharded states.
        dp_shard: data-parallel ranks inside a replica; model states are sharded over
            dp_shard x hp x cp.
        hp: head-parallel ranks inside one sequence-parallel group.
        cp: context-parallel ranks inside one sequence-parallel group.
        world_size: total number of ranks.
        placement: which group of a sequence-parallel block gets adjacent ranks (the same node):
            "context-first" (cp) or "head-first" (hp); Note [Node-aware placement].
        node_size: ranks per node (the launcher's LOCAL_WORLD_SIZE); must divide world_size.
            None: unknown (one node); placements are then not checked against nodes.
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    hp: int = 1
    cp: int = 1
    world_size: int
    placement: Placement = "context-first"
    node_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "hp", "cp", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelDims: {name} must be a positive int, got {value!r}")
        product = self.dp_replicate * self.dp_shard * self.hp * self.cp
        if product != self.world_size:
            raise ValueError(
                f"ParallelDims: dp_replicate ({self.dp_replicate}) x dp_shard ({self.dp_shard}) x hp ({self.hp}) "
                f"x cp ({self.cp}) = {product} must equal world_size ({self.world_size})"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(f"ParallelDims: placement={self.placement!r} is not supported; expected one of {PLACEMENTS}")
        if self.node_size is not None:
            n = self.node_size
            if isinstance(n, bool) or not isinstance(n, int) or n < 1 or self.world_size % n:
                raise ValueError(f"ParallelDims: node_size={n!r} (ranks per node) must be a positive int dividing "
                                 f"world_size={self.world_size}")
            axis, size = ("hp", self.hp) if self.placement == "head-first" else ("cp", self.cp)
            if size > 1 and size % n and n % size:
                fits = [d for d in range(2, n + 1) if n % d == 0]
                raise ValueError(
                    f"ParallelDims: placement={self.placement!r} puts the {size} ranks of each {axis} group next to "
                    f"each other, but with {n} ranks per node {size} is neither a divisor nor a multiple of {n}: its "
                    f"groups would straddle nodes. Choose {axis} from {fits} or a multiple of {n}, or the other placement"
                )

    @classmethod
    def from_sizes(
        cls,
        *,
        world_size: int,
        sequence_parallel_size: int,
        head_parallel_size: int = 1,
        data_parallel_replicate_size: int = 1,
        placement: Placement = "context-first",
        node_size: int | None = None,
        owner: str = "SequenceParallelStrategy",
    ) -> ParallelDims:
        """Resolve the sizes the way the strategy's arguments state them (dp_shard is what remains).

        Errors name the argument of ``owner`` that is wrong.
        """
        if node_size is not None and (isinstance(node_size, bool) or not isinstance(node_size, int)
                                      or node_size < 1 or world_size % node_size):
            raise ValueError(f"{owner}: the node size ({node_size!r} ranks per node) must be a positive int "
                             f"dividing the world size {world_size}")
        for name, value in (
            ("sequence_parallel_size", sequence_parallel_size),
            ("head_parallel_size", head_parallel_size),
            ("data_parallel_replicate_size", data_parallel_replicate_size),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
        if world_size % sequence_parallel_size:
            raise ValueError(
                f"{owner}: sequence_parallel_size={sequence_parallel_size} must divide the world size "
                f"{world_size} (devices x num_nodes)"
            )
        if sequence_parallel_size % head_parallel_size:
            raise ValueError(
                f"{owner}: head_parallel_size={head_parallel_size} must divide "
                f"sequence_parallel_size={sequence_parallel_size} (sp = hp x cp)"
            )
        dp = world_size // sequence_parallel_size
        if dp % data_parallel_replicate_size:
            raise ValueError(
                f"{owner}: data_parallel_replicate_size={data_parallel_replicate_size} must divide the "
                f"data-parallel size {dp} = world size {world_size} / sequence_parallel_size {sequence_parallel_size}"
            )
        return cls(
            dp_replicate=data_parallel_replicate_size,
            dp_shard=dp // data_parallel_replicate_size,
            hp=head_parallel_size,
            cp=sequence_parallel_size // head_parallel_size,
            world_size=world_size,
            placement=placement,
            node_size=node_size,
        )

    @property
    def sp(self) -> int:
        """Sequence-parallel size (hp x cp): ranks that share one sample."""
        return self.hp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel size (dp_replicate x dp_shard): how many different samples a step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks each model state is sharded over (dp_shard x hp x cp)."""
        return self.dp_shard * self.sp

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """Axis sizes in the order of :data:`MESH_AXES`."""
        return (self.dp_replicate, self.dp_shard, self.hp, self.cp)

    def rank_layout(self) -> torch.Tensor:
        """The global rank at every mesh coordinate: an int tensor of shape :attr:`sizes`
        (Note [Node-aware placement]). No communication."""
        if self.placement == "head-first":  # hp fastest inside each sequence-parallel block
            return torch.arange(self.world_size).view(self.dp_replicate, self.dp_shard, self.cp, self.hp).transpose(2, 3).contiguous()
        return torch.arange(self.world_size).view(self.sizes)

    def groups(self, axis: str) -> list[list[int]]:
        """The global ranks of every group along mesh axis ``axis`` (one of :data:`MESH_AXES`, or
        "sp" for hp x cp), each in the order of its coordinate (= its rank inside the group)."""
        layout = self.rank_layout()
        if axis == "sp":
            return layout.reshape(-1, self.sp).tolist()
        if axis not in MESH_AXES:
            raise ValueError(f"ParallelDims.groups: axis={axis!r} must be one of {MESH_AXES} or 'sp'")
        dim = MESH_AXES.index(axis)
        return layout.movedim(dim, -1).reshape(-1, self.sizes[dim]).tolist()

    def inner_rings(self, inner_ring_size: int) -> list[list[int]]:
        """The global ranks of every inner ring of a double ring (``inner_ring_size`` consecutive ranks of a cp group)."""
        if self.cp % inner_ring_size:
            raise ValueError(f"ParallelDims.inner_rings: inner_ring_size={inner_ring_size} must divide cp={self.cp}")
        return [ring[i:i + inner_ring_size] for ring in self.groups("cp") for i in range(0, self.cp, inner_ring_size)]

    def nodes_of(self, ranks: list[int]) -> list[int]:
        """The nodes (``rank // node_size``) that ``ranks`` live on, in order of first appearance."""
        if self.node_size is None:
            return [0]
        return list(dict.fromkeys(r // self.node_size for r in ranks))

    def check_inner_ring(self, inner_ring_size: int | None, *, owner: str = "SequenceParallelStrategy") -> None:
        """Refuse an inner ring that would leave a node (Note [Node-aware placement]); before any collective.

        An inner ring exists to keep its hops on NVLink while the outer hops cross nodes
        (LoongTrain §4.3), so each one must lie inside one node.
        """
        if inner_ring_size is None:
            return
        if self.cp % inner_ring_size:
            raise ValueError(f"{owner}: inner_ring_size={inner_ring_size} must divide the context-parallel size "
                             f"(sequence_parallel_size / head_parallel_size = {self.cp})")
        if self.node_size is None or inner_ring_size in (1, self.cp):
            return
        stride = self.hp if self.placement == "head-first" else 1
        span, n = inner_ring_size * stride, self.node_size
        if span > n or n % span:
            fits = [w for w in range(2, self.cp) if self.cp % w == 0 and n % (w * stride) == 0]
            raise ValueError(
                f"{owner}: inner_ring_size={inner_ring_size} with placement={self.placement!r} spreads each inner ring "
                f"over {span} consecutive ranks{f' (stride hp={self.hp})' if stride > 1 else ''}, which does not fit "
                f"inside a node of {n} ranks: its hops would cross nodes. Use an inner_ring_size from {fits or 'none'}"
                f"{', or placement=' + repr('context-first') if self.placement == 'head-first' else ''}"
            )

    def build_mesh(self, device_type: str, *, timeout: timedelta | None = None) -> DeviceMesh:
        """The 4-D mesh with axes :data:`MESH_AXES` and this placement's rank order (collective:
        every rank must call it).

        ``timeout``: the timeout of every process group of the mesh (Note [Timeouts of the mesh
        groups]); None keeps torch's defaults.
        """
        layout = self.rank_layout()
        if torch.equal(layout, torch.arange(self.world_size).view(self.sizes)):
            return _init_mesh(device_type, self.sizes, MESH_AXES, timeout)
        return _init_mesh_from_ranks(device_type, layout, MESH_AXES, timeout)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, *, node_size: int | None = None) -> ParallelDims:
        """Read the sizes and placement back from a mesh built by :meth:`build_mesh`."""
        _check_axes(mesh)
        ranks = mesh.mesh.cpu()
        for placement in PLACEMENTS:
            dims = cls(**dict(zip(MESH_AXES, mesh.shape)), world_size=mesh.size(), placement=placement)  # type: ignore[arg-type]
            if torch.equal(ranks, dims.rank_layout().to(ranks.dtype)):
                return dims if node_size is None else replace(dims, node_size=node_size)
        raise ValueError(f"the mesh's rank order matches no placement of {PLACEMENTS}: build it with ParallelDims.build_mesh")

    @staticmethod
    def node_size_from_env(default: int | None = None) -> int | None:
        """Ranks per node as the launcher states it: ``LOCAL_WORLD_SIZE`` (torchrun; Lightning's
        launchers set it too), else ``default``."""
        value = os.environ.get("LOCAL_WORLD_SIZE")
        if value is None:
            return default
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE={value!r} must be a positive int (ranks per node)")
        return int(value)


# Note [Timeouts of the mesh groups]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``init_process_group(timeout=...)`` sets the timeout of the default group only. The groups of a
# DeviceMesh are new groups, created with torch's default timeout (30 minutes on gloo, 10 on
# NCCL) unless ``init_device_mesh(backend_override=...)`` hands each mesh axis options that carry
# one. We give every axis options with the strategy's timeout, so that a rank that stalls inside
# an attention ring, an FSDP2 all-gather or the loss all-reduce makes the others fail after that
# timeout, not after torch's default. The options are built as torch builds its own defaults:
# ``ProcessGroupNCCL.Options`` (``is_high_priority_stream=False``) on NCCL, the generic
# ``Backend.Options`` on gloo (gloo takes only the timeout from them). Other backends (e.g. the
# composite "cpu:gloo,cuda:nccl") keep torch's defaults.


def _group_options(timeout: timedelta) -> tuple[str, object]:
    """``(backend, options)`` for ``init_device_mesh(backend_override=...)`` with this timeout."""
    backend = dist.get_backend()
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = timeout  # the attribute DeviceMesh reads the timeout from
        return backend, options
    from torch._C._distributed_c10d import Backend  # the Options type backend_override takes (DeviceMesh imports it so)

    return backend, Backend.Options(backend, timeout)


# Note [Mesh groups without ncclCommSplit]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# When the default NCCL group is bound to a device (``init_process_group(device_id=...)``, as
# Lightning does), DeviceMesh creates each dimension's groups with ``split_group``
# (``ncclCommSplit`` of the default communicator). In torch 2.11 that split dereferences an empty
# rank list whenever the default group is not the first NCCL group the process ever built
# (``ProcessGroupNCCL::groupRanks`` keys "the world group" on a process-wide counter; fixed
# upstream in pytorch/pytorch#192109): the second fit in one process, after the first one
# released its groups (Note [What a run releases]), died with SIGSEGV in ``split_group`` (seen on
# one H100, torch 2.11). So the meshes are built with the default group's ``bound_device_id``
# cleared for the duration: DeviceMesh then takes its other path, one ``new_group`` per group,
# each communicator created on its first collective. The groups and their ranks are the same;
# only the communicators' creation differs (their own bootstrap instead of a split), a cost paid
# once per run.


@contextmanager
def _groups_without_split() -> Iterator[None]:
    """Clear the default group's ``bound_device_id`` while the meshes' groups are created (Note [Mesh groups without ncclCommSplit])."""
    if not dist.is_initialized():
        yield
        return
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    if bound is None:
        yield
        return
    default.bound_device_id = None
    try:
        yield
    finally:
        default.bound_device_id = bound


def _init_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...], timeout: timedelta | None) -> DeviceMesh:
    # Other backends (e.g. "cpu:gloo,cuda:nccl") keep torch's default timeouts for the mesh groups.
    with _groups_without_split():
        if timeout is None or not dist.is_initialized() or dist.get_backend() not in ("gloo", "nccl"):
            return init_device_mesh(device_type, shape, mesh_dim_names=names)
        override = {name: _group_options(timeout) for name in names}
        return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)


def _init_mesh_from_ranks(device_type: str, ranks: torch.Tensor, names: tuple[str, ...], timeout: timedelta | None) -> DeviceMesh:
    """A DeviceMesh over an explicit tensor of global ranks (a placement other than row-major)."""
    with _groups_without_split():
        if timeout is None or not dist.is_initialized() or dist.get_backend() not in ("gloo", "nccl"):
            return DeviceMesh(device_type, ranks, mesh_dim_names=names)
        override = tuple(_group_options(timeout) for _ in names)
        return DeviceMesh(device_type, ranks, mesh_dim_names=names, backend_override=override)


def _check_axes(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh) or tuple(mesh.mesh_dim_names or ()) != MESH_AXES:
        names = getattr(mesh, "mesh_dim_names", None)
        raise ValueError(f"mesh must be a DeviceMesh with mesh_dim_names={MESH_AXES}, got {names}")


def sp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sequence-parallel sub-mesh: 1-D ``"cp"`` when hp == 1, else 2-D ``("hp", "cp")``.

    This is the ``mesh`` argument of ``lightning_seqpar.sharding`` and ``lightning_seqpar.attention``.
    """
    _check_axes(mesh)
    return mesh["cp"] if mesh.size(MESH_AXES.index("hp")) == 1 else mesh["hp", "cp"]


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D data-parallel sub-mesh ``("dp_replicate", "dp_shard")``."""
    _check_axes(mesh)
    return mesh["dp_replicate", "dp_shard"]


def dp_rank_and_size(mesh: DeviceMesh) -> tuple[int, int]:
    """(rank, size) of this process among the data-parallel ranks: the sampler's ``rank`` / ``num_replicas``."""
    _check_axes(mesh)
    n_shard = mesh.size(MESH_AXES.index("dp_shard"))
    rank = mesh.get_local_rank("dp_replicate") * n_shard + mesh.get_local_rank("dp_shard")
    return rank, mesh.size(MESH_AXES.index("dp_replicate")) * n_shard


def fsdp_mesh(mesh: DeviceMesh, *, timeout: timedelta | None = None) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D ``(dp_shard_sp,)``, or 2-D ``("dp_replicate", "dp_shard_sp")`` for HSDP.

    ``dp_shard_sp`` is dp_shard x hp x cp flattened. PyTorch's way of flattening axes of a mesh,
    ``DeviceMesh._flatten``, is private; we build the same groups as a separate mesh through the
    public ``init_device_mesh`` instead: row-major ``arange(world).view(dp_replicate, -1)``. Every
    placement keeps the data-parallel axes outermost (Note [Node-aware placement]), so each
    replica is the same block of consecutive ranks in both meshes; with "context-first" shard
    ``i`` of ``dp_shard_sp`` is also ``(dp_shard, hp, cp)`` index ``i``, with "head-first" the
    order inside a block differs, which FSDP2 does not mind (nothing pairs a parameter shard
    with a piece of the sequence). Collective: every rank must call it (it creates groups).
    ``timeout``: as :meth:`ParallelDims.build_mesh`.
    """
    _check_axes(mesh)
    try:
        dims = ParallelDims.from_mesh(mesh)
    except ValueError as error:
        raise ValueError(f"fsdp_mesh needs a mesh built by ParallelDims.build_mesh: {error}") from error
    if dims.dp_replicate == 1:
        return _init_mesh(mesh.device_type, (dims.fsdp_shard,), (FSDP_SHARD_AXIS,), timeout)
    return _init_mesh(mesh.device_type, (dims.dp_replicate, dims.fsdp_shard), ("dp_replicate", FSDP_SHARD_AXIS), timeout)


# Note [Releasing the groups of a mesh]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every ``init_device_mesh`` call creates one process group per axis (``new_group`` for each set
# of ranks along it; this rank keeps the one it belongs to), also for axes of size 1. A group is
# a communicator with threads of its own (gloo: 2 ``pt_gloo_runloop`` + 1 ``gloo_tcp_loop``
# each; NCCL: a communicator, its proxy thread and GPU memory), and torch keeps it until
# ``destroy_process_group(group)``: dropping the mesh does not free it. A fit builds two meshes
# (the 4-D one and FSDP's), five groups at every world size; without this a process that runs
# ten fits holds fifty. Sub-meshes (``mesh["cp"]``, ``mesh["hp", "cp"]``) reuse their parent's
# groups, so releasing the meshes ``build_mesh`` and ``fsdp_mesh`` returned releases everything.
# The default group is never destroyed here (a 1-D mesh over the whole world without a timeout
# may *be* the default group): it belongs to whoever called ``init_process_group``.
#
# DTensor caches plans by mesh *equality* (same ranks, layout, axis names), and the cached plans
# hold the mesh they were made for: the next run's equal mesh would get the old one back, whose
# groups are destroyed ("Could not resolve the process group registered under the name 8"). So
# releasing also clears those caches (:func:`forget_cached_meshes`).


def release_mesh_groups(*meshes: DeviceMesh | None) -> int:
    """Destroy the process groups of ``meshes`` (Note [Releasing the groups of a mesh]); return how many.

    Local (no collective): every rank of the meshes should call it, as every rank built them. The
    default group and groups already destroyed are left alone; None entries are skipped. The meshes
    (and any sub-mesh or module that holds their groups) must not be used afterwards.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    default = dist.group.WORLD
    default_name = default.group_name if default is not None else None
    released: set[str] = set()
    for mesh in meshes:
        if mesh is None:
            continue
        try:
            groups = mesh.get_all_groups()
        except RuntimeError:  # its groups went with an earlier default group (destroy_process_group()): nothing to free
            continue
        for group in groups:
            name = group.group_name
            if name == default_name or name in released or not _registered(group):
                continue
            dist.destroy_process_group(group)
            released.add(name)
    if released:
        forget_cached_meshes()
    return len(released)


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether torch still knows ``group`` (``destroy_process_group()`` without a group destroys them all)."""
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):
        return False
    return True


def forget_cached_meshes() -> None:
    """Clear DTensor's caches that hold meshes (Note [Releasing the groups of a mesh]): the sharding
    propagation caches and the redistribution planner caches. They refill on use."""
    import torch
    from torch.distributed.tensor import DTensor, _collective_utils, _redistribute, debug

    clear_sharding = getattr(debug, "_clear_sharding_prop_cache", None)  # torch's own "clear all" for debugging
    if clear_sharding is not None:
        clear_sharding()
    # the same caches by their own handles (a release whose debug helper misses one), and MeshTopoInfo's lru_cache, which
    # kept the last fit's FSDP mesh and its gloo group alive (torch 2.13: 2 live meshes after a fit, now 1). Open: on torch
    # 2.11 (the GPU image) each fit still leaves its FSDP mesh in cached OpStrategy / OpSpec objects held outside Python's
    # view (likely DTensor's C++ sharding-propagation cache): +2 pt_gloo_runloop threads per fit in one process.
    propagate = getattr(getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None), "propagate_op_sharding", None)
    if hasattr(propagate, "cache_clear"):
        propagate.cache_clear()
    clear_fast_path = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_fast_path is not None:
        clear_fast_path()
    topology = getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)  # an lru_cache keyed by mesh
    if hasattr(topology, "cache_clear"):
        topology.cache_clear()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)  # torch >= 2.10
    if clear_planners is not None:
        clear_planners()
    transform_infos = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(transform_infos, "cache_clear"):
        transform_infos.cache_clear()


def warn_if_ranks_not_by_node(global_rank: int, node_rank: int, local_rank: int, per_node: int) -> None:
    """Note [Node-aware placement] assumes global rank = node rank x devices per node + local rank
    (torchrun; SLURM's block distribution). A launcher that numbers ranks otherwise keeps results
    exact but puts the groups on other links than planned: say so on the rank that sees it."""
    if global_rank != node_rank * per_node + local_rank:
        warnings.warn(
            f"SequenceParallelStrategy: global rank {global_rank} is not node_rank ({node_rank}) x devices per node "
            f"({per_node}) + local_rank ({local_rank}); the mesh's node-aware placement assumes ranks numbered node by "
            "node (torchrun, srun --distribution=block): its groups may cross nodes other than planned",
            stacklevel=2,
        )

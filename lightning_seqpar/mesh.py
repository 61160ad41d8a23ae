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

The last axis varies fastest, so the ranks of one ``cp`` ring are neighbours (same node first),
then ``hp``, then the data-parallel axes: sequence-parallel traffic, the heaviest, stays inside a
node whenever sp <= devices per node. Example, 8 ranks, dp_shard=2, hp=2, cp=2::

    dp_shard 0:   hp 0: [0 1]   hp 1: [2 3]        cp rings:  {0,1} {2,3} {4,5} {6,7}
    dp_shard 1:   hp 0: [4 5]   hp 1: [6 7]        hp groups: {0,2} {1,3} {4,6} {5,7}

Model states are sharded by FSDP2 over dp_shard x hp x cp (LoongTrain §4.3: ZeRO over DP x SP,
so sequence parallelism also divides the memory of parameters, gradients and optimizer states)
and replicated over dp_replicate.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_AXES: tuple[str, ...] = ("dp_replicate", "dp_shard", "hp", "cp")
"""Names of the axes of the device mesh, outermost first."""

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
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    hp: int = 1
    cp: int = 1
    world_size: int

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

    @classmethod
    def from_sizes(
        cls,
        *,
        world_size: int,
        sequence_parallel_size: int,
        head_parallel_size: int = 1,
        data_parallel_replicate_size: int = 1,
        owner: str = "SequenceParallelStrategy",
    ) -> ParallelDims:
        """Resolve the sizes the way the strategy's arguments state them (dp_shard is what remains).

        Errors name the argument of ``owner`` that is wrong.
        """
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

    def build_mesh(self, device_type: str, *, timeout: timedelta | None = None) -> DeviceMesh:
        """The 4-D mesh with axes :data:`MESH_AXES` (collective: every rank must call it).

        ``timeout``: the timeout of every process group of the mesh (Note [Timeouts of the mesh
        groups]); None keeps torch's defaults.
        """
        return _init_mesh(device_type, self.sizes, MESH_AXES, timeout)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh) -> ParallelDims:
        """Read the sizes back from a mesh built by :meth:`build_mesh`."""
        _check_axes(mesh)
        return cls(**dict(zip(MESH_AXES, mesh.shape)), world_size=mesh.size())


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


def _init_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...], timeout: timedelta | None) -> DeviceMesh:
    # Other backends (e.g. "cpu:gloo,cuda:nccl") keep torch's default timeouts for the mesh groups.
    if timeout is None or not dist.is_initialized() or dist.get_backend() not in ("gloo", "nccl"):
        return init_device_mesh(device_type, shape, mesh_dim_names=names)
    override = {name: _group_options(timeout) for name in names}
    return init_device_mesh(device_type, shape, mesh_dim_names=names, backend_override=override)


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
    ``DeviceMesh._flatten``, is private; we build the same layout as a separate mesh through the
    public ``init_device_mesh`` instead. Its rank layout equals the 4-D mesh's (row-major
    ``arange(world).view(...)`` in both), so shard ``i`` of ``dp_shard_sp`` is the same rank as
    ``(dp_shard, hp, cp)`` index ``i``. Collective: every rank must call it (it creates groups).
    ``timeout``: as :meth:`ParallelDims.build_mesh`.
    """
    _check_axes(mesh)
    dims = ParallelDims.from_mesh(mesh)
    expected = torch.arange(dims.world_size).view(dims.sizes)
    if not torch.equal(mesh.mesh.cpu(), expected):
        raise ValueError("fsdp_mesh needs a mesh built by ParallelDims.build_mesh (ranks in row-major order)")
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
        for group in mesh.get_all_groups():
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
    from torch.distributed.tensor import _redistribute, debug

    clear_sharding = getattr(debug, "_clear_sharding_prop_cache", None)  # torch's own "clear all" for debugging
    if clear_sharding is not None:
        clear_sharding()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)  # torch >= 2.10
    if clear_planners is not None:
        clear_planners()
    transform_infos = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(transform_infos, "cache_clear"):
        transform_infos.cache_clear()

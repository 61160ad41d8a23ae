"""Node-aware placement (issue #24 item 1): ranks -> groups for 2 to 64 nodes of 8 GPUs, the
clear errors for groups that cannot be placed, and the mesh built from a permuted rank tensor."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from lightning_seqpar.parallel.mesh import MESH_AXES, ParallelDims

GPN = 8


def _node(rank: int) -> int:
    return rank // GPN


def _layouts():
    for nodes in (2, 4, 8, 16, 32, 64):
        world = nodes * GPN
        for sp in (8, 16, 64, 512):
            if sp > world:
                continue
            for hp in (1, 2, 4, 8, 16, 32):
                if sp % hp == 0 and hp < sp:
                    yield nodes, world, sp, hp


@pytest.mark.parametrize("placement", ["context-first", "head-first"])
def test_groups_partition_the_world_and_sit_where_the_placement_says(placement):
    checked = 0
    for nodes, world, sp, hp in _layouts():
        try:
            dims = ParallelDims.from_sizes(world_size=world, sequence_parallel_size=sp, head_parallel_size=hp,
                                           placement=placement, node_size=GPN)
        except ValueError:
            placed = hp if placement == "head-first" else sp // hp
            assert placed % GPN and GPN % placed  # refused only when the placed group would straddle nodes
            continue
        checked += 1
        layout = dims.rank_layout()
        assert sorted(layout.flatten().tolist()) == list(range(world))  # a permutation of the ranks
        # data-parallel axes outermost: each sequence-parallel group is a block of sp consecutive ranks
        for g in dims.groups("sp"):
            assert sorted(g) == list(range(g[0] // sp * sp, g[0] // sp * sp + sp))
        for axis in MESH_AXES:  # every axis: ranks increase along it (group rank = mesh coordinate)
            for g in dims.groups(axis):
                assert g == sorted(g)
        hp_groups, cp_groups = dims.groups("hp"), dims.groups("cp")
        placed, other = (hp_groups, cp_groups) if placement == "head-first" else (cp_groups, hp_groups)
        size = len(placed[0])
        for g in placed:  # the placed group: on as few nodes as possible, each node fully its own
            assert len(dims.nodes_of(g)) == max(1, size // GPN)
            assert g == list(range(g[0], g[0] + size)) or size == 1
        if len(other[0]) > 1 and size >= GPN:  # the other group then has one member per node
            for g in other:
                assert len(dims.nodes_of(g)) == len(g)
    assert checked > 20


def test_examples_of_the_note():
    cf = ParallelDims(hp=2, cp=4, world_size=8)
    hf = ParallelDims(hp=2, cp=4, world_size=8, placement="head-first")
    assert cf.groups("cp") == [[0, 1, 2, 3], [4, 5, 6, 7]] and cf.groups("hp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hf.groups("cp") == [[0, 2, 4, 6], [1, 3, 5, 7]] and hf.groups("hp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # hp = 1 or cp = 1: the two placements are the same mesh
    for hp, cp in ((1, 8), (8, 1)):
        a = ParallelDims(hp=hp, cp=cp, world_size=8).rank_layout()
        assert torch.equal(a, ParallelDims(hp=hp, cp=cp, world_size=8, placement="head-first").rank_layout())


@pytest.mark.parametrize("nodes", [2, 4, 8, 16, 32, 64])
def test_double_ring_inner_rings_stay_in_a_node_outer_hops_cross(nodes):
    world = nodes * GPN
    dims = ParallelDims(cp=world, world_size=world, node_size=GPN)  # one ring over every GPU, inner = node
    rings = dims.inner_rings(GPN)
    assert len(rings) == nodes
    for ring in rings:
        assert dims.nodes_of(ring) == [_node(ring[0])]
    # 2D, hp=2, head-first: an inner ring of 4 spans 4 x 2 = 8 ranks = one node
    dims = ParallelDims(hp=2, cp=world // 2, world_size=world, node_size=GPN, placement="head-first")
    for ring in dims.inner_rings(4):
        assert len(dims.nodes_of(ring)) == 1
    dims.check_inner_ring(4)
    if world // 2 == 8:  # inner_ring_size = cp is the plain ring: nothing to check
        return
    with pytest.raises(ValueError, match=r"inner_ring_size=8 with placement='head-first' spreads each inner ring over 16"):
        dims.check_inner_ring(8)


def test_unplaceable_groups_are_refused_by_name():
    with pytest.raises(ValueError, match=r"placement='head-first' puts the 3 ranks of each hp group .* straddle nodes"):
        ParallelDims.from_sizes(world_size=48, sequence_parallel_size=24, head_parallel_size=3, placement="head-first", node_size=8)
    with pytest.raises(ValueError, match=r"placement='context-first' puts the 12 ranks of each cp group"):
        ParallelDims.from_sizes(world_size=48, sequence_parallel_size=24, head_parallel_size=2, node_size=8)
    with pytest.raises(ValueError, match=r"node size \(3 ranks per node\) must be a positive int dividing the world size 16"):
        ParallelDims.from_sizes(world_size=16, sequence_parallel_size=16, node_size=3)
    with pytest.raises(ValueError, match=r"placement='diagonal' is not supported"):
        ParallelDims(world_size=2, cp=2, placement="diagonal")  # type: ignore[arg-type]
    dims = ParallelDims(cp=32, world_size=32, node_size=8)
    with pytest.raises(ValueError, match=r"inner_ring_size=16 .* not fit inside a node of 8 ranks.* from \[2, 4, 8\]"):
        dims.check_inner_ring(16)
    with pytest.raises(ValueError, match=r"inner_ring_size=3 must divide the context-parallel size"):
        dims.check_inner_ring(3)
    ParallelDims(cp=32, world_size=32).check_inner_ring(16)  # node size unknown: not checked


def test_node_size_from_env(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert ParallelDims.node_size_from_env() == 8
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ParallelDims.node_size_from_env(4) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        ParallelDims.node_size_from_env()


def _mesh_groups(rank: int, world_size: int, placement: str):
    import torch.distributed as dist

    from lightning_seqpar.parallel.mesh import fsdp_mesh

    dims = ParallelDims(dp_shard=2, hp=2, cp=2, world_size=8, placement=placement, node_size=4)  # type: ignore[arg-type]
    mesh = dims.build_mesh("cpu")
    got = {axis: dist.get_process_group_ranks(mesh.get_group(axis)) for axis in MESH_AXES if mesh[axis].size() > 1}
    coords = {axis: mesh.get_local_rank(axis) for axis in ("hp", "cp")}
    ranks = {axis: dist.get_rank(mesh.get_group(axis)) for axis in ("hp", "cp")}
    assert ParallelDims.from_mesh(mesh).placement == placement
    fsdp = fsdp_mesh(mesh)  # the FSDP group: dp_shard x hp x cp
    return got, coords, ranks, dist.get_process_group_ranks(fsdp.get_group())


@pytest.mark.parametrize("placement", ["context-first", "head-first"])
def test_build_mesh_from_permuted_ranks(placement):
    dims = ParallelDims(dp_shard=2, hp=2, cp=2, world_size=8, placement=placement, node_size=4)  # type: ignore[arg-type]
    results = run_distributed(_mesh_groups, 8, placement, timeout=300)
    for rank, (got, coords, ranks, fsdp) in enumerate(results):
        for axis, group in got.items():
            assert group in dims.groups(axis), (rank, axis, group)
        assert coords == ranks  # the group rank is the mesh coordinate (the ring and the all-to-all rely on it)
        assert fsdp == list(range(8))  # dp_shard x hp x cp: every rank (the data-parallel axes are outermost)


def test_meshes_are_built_without_nccl_split_and_the_binding_is_restored(monkeypatch):
    """Note [Mesh groups without ncclCommSplit]: while the meshes' groups are created the default group's
    ``bound_device_id`` is None (DeviceMesh then uses new_group, not the split that crashes torch 2.11 in a
    second fit), and afterwards, also after an error, it is the device it was."""
    import torch.distributed as dist

    from lightning_seqpar.parallel import mesh as mesh_module
    class Default:
        bound_device_id = torch.device("cuda", 3)

    default = Default()
    seen = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_group", lambda: default)
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: "nccl")

    def fake_init(device_type, shape, mesh_dim_names=None, backend_override=None):
        seen.append(default.bound_device_id)
        if shape == (0,):
            raise RuntimeError("boom")
        return (device_type, shape, mesh_dim_names)

    monkeypatch.setattr(mesh_module, "init_device_mesh", fake_init)
    assert mesh_module._init_mesh("cuda", (2, 2), ("dp", "sp"), None) == ("cuda", (2, 2), ("dp", "sp"))
    assert seen == [None] and default.bound_device_id == torch.device("cuda", 3)
    with pytest.raises(RuntimeError, match="boom"):
        mesh_module._init_mesh("cuda", (0,), ("sp",), None)
    assert seen == [None, None] and default.bound_device_id == torch.device("cuda", 3)

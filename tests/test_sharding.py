"""shard_sequence / unshard_sequence / sequence_index on 1-D meshes (W=1..4) and 2-D (hp, cp) meshes.

The expected positions come from the layout rules (seqpar_testing.expected_index), not from
the code under test.
"""

from __future__ import annotations

import re

import pytest
import torch

from dist_utils import run_distributed
from seqpar_testing import LAYOUTS, expected_index_on, make_mesh, mesh_coords

SEQ_LEN = 48  # divisible by 2 * W for W = 1..4 and by 2 * cp * hp = 8

MESHES = [
    pytest.param(("1d", 1), id="W1"),
    pytest.param(("1d", 2), id="W2"),
    pytest.param(("1d", 3), id="W3"),
    pytest.param(("1d", 4), id="W4"),
    pytest.param(("2d", ("hp", "cp"), (2, 2)), id="hp2xcp2"),
    pytest.param(("2d", ("cp", "hp"), (2, 2)), id="cp2xhp2"),
]


def _world(spec: tuple) -> int:
    return spec[1] if spec[0] == "1d" else spec[2][0] * spec[2][1]


def _full_tensor(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _round_trip_worker(rank: int, world_size: int, spec: tuple) -> dict[str, list[int]]:
    from lightning_seqpar.sharding import sequence_index, shard_sequence, unshard_sequence

    mesh = make_mesh(spec)
    positions: dict[str, list[int]] = {}
    for layout in LAYOUTS:
        idx = sequence_index(SEQ_LEN, mesh, layout)
        expected = expected_index_on(mesh, SEQ_LEN, layout)
        assert idx.dtype == torch.long, f"{layout}: sequence_index dtype {idx.dtype}"
        assert idx.tolist() == expected.tolist(), f"{layout}: sequence_index {idx.tolist()} != {expected.tolist()}"
        positions[layout] = idx.tolist()

        # dim=1 (the default), dim=0 and a negative dim, on tensors of different ranks.
        for shape, dim in (((2, SEQ_LEN, 3, 4), 1), ((SEQ_LEN, 5), 0), ((3, 2, SEQ_LEN), -1)):
            x = _full_tensor(shape, seed=len(shape))
            local = shard_sequence(x, mesh, dim=dim, layout=layout)
            assert local.shape[dim] == SEQ_LEN // world_size, f"{layout}: local shape {tuple(local.shape)}"
            torch.testing.assert_close(local, x.index_select(dim, idx), rtol=0, atol=0)
            torch.testing.assert_close(local, x.index_select(dim, expected), rtol=0, atol=0)
            full = unshard_sequence(local, mesh, dim=dim, layout=layout)
            torch.testing.assert_close(full, x, rtol=0, atol=0, msg=lambda m: f"{layout} dim={dim}: round trip\n{m}")
    return positions


@pytest.mark.parametrize("spec", MESHES)
def test_round_trip_and_index(spec):
    world = _world(spec)
    results = run_distributed(_round_trip_worker, world, spec)
    for layout in LAYOUTS:
        every = sorted(p for r in results for p in r[layout])
        assert every == list(range(SEQ_LEN)), f"{layout}: positions are not covered exactly once: {every}"


def _layout_order_worker(rank: int, world_size: int) -> None:
    """The local order is the chunk order of the layout: zigzag = chunk r then chunk 2W-1-r."""
    from lightning_seqpar.sharding import sequence_index

    mesh = make_mesh(("1d", world_size))
    chunk = SEQ_LEN // (2 * world_size)
    zigzag = sequence_index(SEQ_LEN, mesh, "zigzag").tolist()
    first, second = zigzag[:chunk], zigzag[chunk:]
    assert first == list(range(rank * chunk, (rank + 1) * chunk)), zigzag
    mirror = 2 * world_size - 1 - rank
    assert second == list(range(mirror * chunk, (mirror + 1) * chunk)), zigzag
    contiguous = sequence_index(SEQ_LEN, mesh, "contiguous").tolist()
    per_rank = SEQ_LEN // world_size
    assert contiguous == list(range(rank * per_rank, (rank + 1) * per_rank)), contiguous


def test_layout_order_w4():
    run_distributed(_layout_order_worker, 4)


def _unshard_grad_worker(rank: int, world_size: int, spec: tuple) -> None:
    """grad of unshard = sum over ranks of the full upstream gradients, restricted to this shard."""
    from lightning_seqpar.sharding import shard_sequence, unshard_sequence

    mesh = make_mesh(spec)
    for layout in LAYOUTS:
        x = _full_tensor((2, SEQ_LEN, 3), seed=7)
        local = shard_sequence(x, mesh, dim=1, layout=layout).detach().requires_grad_()
        full = unshard_sequence(local, mesh, dim=1, layout=layout)
        assert full.requires_grad, f"{layout}: unshard_sequence output does not require grad"
        weights = [_full_tensor(x.shape, seed=100 + r) for r in range(world_size)]
        (full * weights[rank]).sum().backward()
        expected = torch.stack(weights).sum(0).index_select(1, expected_index_on(mesh, SEQ_LEN, layout))
        torch.testing.assert_close(local.grad, expected, atol=1e-6, rtol=1e-6, msg=lambda m: f"{layout}: unshard grad\n{m}")

        # shard_sequence is differentiable too (a gather): the gradient lands on this rank's rows.
        x_leaf = x.clone().requires_grad_()
        shard_sequence(x_leaf, mesh, dim=1, layout=layout).sum().backward()
        mask = torch.zeros(SEQ_LEN)
        mask[expected_index_on(mesh, SEQ_LEN, layout)] = 1
        torch.testing.assert_close(x_leaf.grad, mask.view(1, SEQ_LEN, 1).expand_as(x), rtol=0, atol=0)


@pytest.mark.parametrize("spec", [MESHES[1], MESHES[2], MESHES[3], MESHES[4], MESHES[5]])
def test_unshard_is_differentiable(spec):
    run_distributed(_unshard_grad_worker, _world(spec), spec)


def _errors_worker(rank: int, world_size: int, spec: tuple) -> None:
    from lightning_seqpar.sharding import sequence_index, shard_sequence, unshard_sequence

    mesh = make_mesh(spec)
    hp, _, cp, _ = mesh_coords(mesh)
    bad_zigzag = 2 * cp * hp * 3 + cp * hp  # divisible by cp*hp but not by 2*cp*hp
    bad_contiguous = cp * hp * 3 + 1
    for layout, bad in (("zigzag", bad_zigzag), ("contiguous", bad_contiguous)):
        x = torch.zeros(2, bad, 3)
        with pytest.raises(ValueError, match=rf"{bad}"):
            shard_sequence(x, mesh, dim=1, layout=layout)
        with pytest.raises(ValueError, match=rf"{bad}"):
            sequence_index(bad, mesh, layout)
    for fn, arg in ((shard_sequence, torch.zeros(2, SEQ_LEN)), (unshard_sequence, torch.zeros(2, SEQ_LEN // world_size))):
        with pytest.raises(ValueError, match="layout"):
            fn(arg, mesh, dim=1, layout="striped")
    with pytest.raises(ValueError, match="layout"):
        sequence_index(SEQ_LEN, mesh, "striped")
    from seqpar_testing import no_collectives

    with no_collectives():  # wrong dims and local lengths are refused before the all-gather
        for dim in (3, -4, 1.0, True):
            with pytest.raises(ValueError, match=rf"dim={dim!r} is out of range"):
                shard_sequence(torch.zeros(2, SEQ_LEN, 3), mesh, dim=dim)
            with pytest.raises(ValueError, match=rf"dim={dim!r} is out of range"):
                unshard_sequence(torch.zeros(2, SEQ_LEN // world_size, 3), mesh, dim=dim)
        with pytest.raises(ValueError, match="out of range"):
            shard_sequence(torch.tensor(1.0), mesh, dim=0)
        with pytest.raises(ValueError, match=rf"global length \(x.shape\[1\]=3 x {world_size} ranks\)"):
            unshard_sequence(torch.zeros(2, 3), mesh, dim=1, layout="zigzag")  # odd: 2 * cp chunks do not fit
        with pytest.raises(ValueError, match="must be divisible"):
            shard_sequence(torch.zeros(2, 3 * world_size + 1), mesh, dim=1, layout="contiguous")


@pytest.mark.parametrize("spec", [MESHES[1], MESHES[2], MESHES[4]])
def test_errors(spec):
    run_distributed(_errors_worker, _world(spec), spec)


def _one_cp_rank_worker(rank: int, world_size: int, spec: tuple) -> None:
    """With one rank in the layout's dimension (W = 1, or a 2-D mesh with cp = 1) zigzag is the identity:
    any length the hp split allows is sharded, and the attention on it is exact."""
    from lightning_seqpar.attention import sequence_parallel_attention
    from lightning_seqpar.sharding import shard_sequence, unshard_sequence
    from seqpar_testing import compare_to_reference, make_case

    mesh = make_mesh(spec)
    hp, _, cp, _ = mesh_coords(mesh)
    seq = 3 * hp  # odd local length 3
    x = _full_tensor((2, seq, 5), 0)
    local = shard_sequence(x, mesh, dim=1, layout="zigzag")
    assert local.shape[1] == 3
    torch.testing.assert_close(unshard_sequence(local, mesh, dim=1, layout="zigzag"), x, rtol=0, atol=0)
    index = expected_index_on(mesh, seq, "contiguous")  # the identity layout
    torch.testing.assert_close(local, x[:, index], rtol=0, atol=0)
    case = make_case(2, seq, 2 * hp, hp, 8, causal=True, seed=1)
    algorithm = "2d" if spec[0] == "2d" else "ring"
    q, k, v = (shard_sequence(t, mesh, dim=1).detach().requires_grad_() for t in (case.q, case.k, case.v))
    out = sequence_parallel_attention(q, k, v, mesh=mesh, algorithm=algorithm, layout="zigzag")
    out.backward(shard_sequence(case.grad_out, mesh, dim=1))
    compare_to_reference({"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}, case, index, f"{spec} zigzag S={seq}")


@pytest.mark.parametrize("spec", [MESHES[0], pytest.param(("2d", ("hp", "cp"), (2, 1)), id="hp2xcp1")])
def test_zigzag_is_the_identity_on_one_cp_rank(spec):
    run_distributed(_one_cp_rank_worker, _world(spec), spec)


def _unshard_disagree_worker(rank: int, world_size: int) -> list[str]:
    """Note [Inputs that differ across ranks]: local shards of other lengths, widths, dtypes or ndim on
    some ranks get one ValueError on every rank, naming what differs, instead of a gloo abort."""
    from lightning_seqpar.sharding import unshard_sequence

    mesh = make_mesh(("1d", world_size))
    odd = rank == world_size - 1
    cases = [
        ("length", torch.zeros(2, 6 if odd else 4, 3), "shape[1]"),
        ("width", torch.zeros(2, 4, 5 if odd else 3), "shape[2]"),
        ("dtype", torch.zeros(2, 4, 3, dtype=torch.float64 if odd else torch.float32), "dtype_bytes"),
        ("ndim", torch.zeros(2, 4, 3, 1) if odd else torch.zeros(2, 4, 3), "ndim"),
    ]
    messages = []
    for label, x, field in cases:
        with pytest.raises(ValueError, match=rf"unshard_sequence: the ranks of the mesh passed different inputs: .*'{re.escape(field)}'"):
            unshard_sequence(x, mesh, dim=1, layout="contiguous")
        messages.append(label)
    full = unshard_sequence(torch.full((2, 4, 3), float(rank)), mesh, dim=1, layout="contiguous")  # still in step
    assert full.shape == (2, 4 * world_size, 3) and full[0, :, 0].tolist() == [float(r) for r in range(world_size) for _ in range(4)]
    return messages


@pytest.mark.parametrize("world", [2, 3])
def test_unshard_inputs_that_differ_across_ranks(world):
    results = run_distributed(_unshard_disagree_worker, world)
    assert all(r == ["length", "width", "dtype", "ndim"] for r in results)

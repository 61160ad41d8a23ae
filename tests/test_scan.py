"""The blocked affine scan (lightning_seqpar.attention.scan, Note [Blocked affine scan] and Note
[Parallel state passing across ranks]) against the chunk-by-chunk recurrence it replaces, float64:
the entering states, the leaving states and the gradients of e, K, W, b and h0 — for chunk counts
around the block size (1, 2, 5, 9, 10, 17: padded groups), the delta rule's dense transition with a
scalar or a per-dimension decay and SSD's scalar one, on one device and over 2-3 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from seqpar_testing import mesh_1d

from lightning_seqpar.attention.scan import affine_scan
from lightning_seqpar.sharding.layouts import chunk_ids, num_chunks

B, H, C, DK, DV = 2, 3, 4, 5, 3


def _inputs(P: int, N: int, kind: str, seed: int) -> dict[str, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    d = DK if kind == "per-dim" else 1
    e = torch.rand(P, B, H, N, d, 1, generator=gen, dtype=torch.float64) * 0.5 + 0.5
    K = W = None
    if kind != "ssd":  # small enough that A = e - K^T W stays a contraction
        K = torch.randn(P, B, H, N, C, DK, generator=gen, dtype=torch.float64) * 0.3
        W = torch.randn(P, B, H, N, C, DK, generator=gen, dtype=torch.float64) * 0.3
    b = torch.randn(P, B, H, N, DK, DV, generator=gen, dtype=torch.float64)
    return {"e": e, "K": K, "W": W, "b": b}


def _sequential(e, K, W, b, h0):
    """The chunk-by-chunk recurrence over the P pieces end to end: (entering states, state after every piece)."""
    h = torch.zeros(B, H, DK, DV, dtype=torch.float64) if h0 is None else h0
    entering, leaving = [], []
    for p in range(b.shape[0]):
        states = []
        for j in range(b.shape[3]):
            states.append(h)
            Ah = e[p, :, :, j] * h
            if W is not None:
                Ah = Ah - K[p, :, :, j].mT @ (W[p, :, :, j] @ h)
            h = Ah + b[p, :, :, j]
        entering.append(torch.stack(states, dim=2))
        leaving.append(h)
    return torch.stack(entering), torch.stack(leaving)


def _grads(fn, tensors: dict, seeds: tuple[torch.Tensor, torch.Tensor]):
    leaves = {n: (None if t is None else t.clone().requires_grad_()) for n, t in tensors.items()}
    h_all, h_out = fn(**leaves)
    torch.autograd.backward([h_all, h_out], list(seeds))
    return h_all.detach(), h_out.detach(), {n: t.grad for n, t in leaves.items() if t is not None}


@pytest.mark.parametrize("kind", ["scalar", "per-dim", "ssd"])
@pytest.mark.parametrize("N", [1, 2, 5, 9, 10, 17])
def test_blocked_scan_matches_the_recurrence_on_one_device(N, kind):
    x = _inputs(1, N, kind, seed=N)
    gen = torch.Generator().manual_seed(100 + N)
    x["h0"] = torch.randn(B, H, DK, DV, generator=gen, dtype=torch.float64)
    seeds = (torch.randn(1, B, H, N, DK, DV, generator=gen, dtype=torch.float64),
             torch.randn(1, B, H, DK, DV, generator=gen, dtype=torch.float64))
    got = _grads(lambda e, K, W, b, h0: affine_scan(e, K, W, b, h0), x, seeds)
    want = _grads(_sequential, x, seeds)
    for name, a, r in [("entering", got[0], want[0]), ("leaving", got[1], want[1]),
                       *((f"d{n}", got[2][n], want[2][n]) for n in want[2])]:
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=lambda m, name=name: f"{kind} N={N} {name}: {m}")


def _ranks_worker(rank: int, world: int, layout: str, N: int, kind: str) -> int:
    mesh = mesh_1d(world)
    n = num_chunks(world, layout)
    x = _inputs(n, N, kind, seed=7 * N + world)  # every global piece's chunks, in sequence order
    gen = torch.Generator().manual_seed(N)
    seeds = (torch.randn(n, B, H, N, DK, DV, generator=gen, dtype=torch.float64),
             torch.randn(n, B, H, DK, DV, generator=gen, dtype=torch.float64))
    want = _grads(lambda e, K, W, b: _sequential(e, K, W, b, None), x, seeds)
    mine = list(chunk_ids(rank, world, layout))
    local = {k: (None if t is None else t[mine]) for k, t in x.items()}
    got = _grads(lambda e, K, W, b: affine_scan(e, K, W, b, group_name=mesh.get_group().group_name, layout=layout),
                 local, (seeds[0][mine], seeds[1][mine]))
    for name, a, r in [("entering", got[0], want[0][mine]), ("leaving", got[1], want[1][mine]),
                       *((f"d{k}", got[2][k], want[2][k][mine]) for k in want[2])]:
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10,
                                   msg=lambda m, name=name: f"W={world} {layout} {kind} N={N} rank {rank} {name}: {m}")
    return 1


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 3])
def test_state_passing_across_ranks_matches_the_recurrence(world, layout):
    """Every piece's entering states and gradients (the leaving states' gradients seeded on every piece, so the
    reverse fold carries external end gradients as well as the later pieces')."""
    for kind, N in (("scalar", 5), ("per-dim", 2), ("ssd", 10)):
        assert run_distributed(_ranks_worker, world, layout, N, kind) == [1] * world


def test_errors_name_the_argument():
    x = _inputs(2, 3, "scalar", seed=0)
    with pytest.raises(ValueError, match="P = 1"):
        affine_scan(x["e"], x["K"], x["W"], x["b"])
    x = _inputs(1, 3, "scalar", seed=0)
    with pytest.raises(ValueError, match="K and W"):
        affine_scan(x["e"], x["K"], None, x["b"])
    with pytest.raises(ValueError, match="h0"):
        affine_scan(x["e"], x["K"], x["W"], x["b"], torch.zeros(B, H, DK, DV, dtype=torch.float64), group_name="g")

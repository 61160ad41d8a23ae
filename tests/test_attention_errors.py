"""Malformed calls raise ValueError naming the argument, before any collective runs.

Inside the workers every collective entry point is replaced by one raising
RuntimeError("collective ran") (seqpar_testing.no_collectives), so a check that comes after a
collective fails the test with that RuntimeError instead of the ValueError.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from seqpar_testing import make_mesh, no_collectives

B, S_LOCAL, H, D = 1, 4, 4, 4

# what each message must name (the argument or the quantity at fault)
LENGTH = r"(?i)sequence length|seq_len|S_local|shape\[1\]"
HEADS = r"(?i)head|H_q|H_kv"
K_AND_V = r"(?i)\bk\b.*\bv\b"
MESH = r"(?i)mesh"


def _qkv(s_q=S_LOCAL, h_q=H, h_k=H, h_v=None, s_kv=None, d_k=D, dtype_k=torch.float32, b_k=B):
    s_kv = s_q if s_kv is None else s_kv
    h_v = h_k if h_v is None else h_v
    q = torch.randn(B, s_q, h_q, D)
    k = torch.randn(b_k, s_kv, h_k, d_k, dtype=dtype_k)
    v = torch.randn(b_k, s_kv, h_v, d_k, dtype=dtype_k)
    return q, k, v


def _check_all(cases: list[tuple[str, tuple, dict, str]]) -> int:
    """Run every (label, (q, k, v), kwargs, match) under no_collectives; each must raise ValueError."""
    from lightning_seqpar.attention import sequence_parallel_attention

    originals = {name: getattr(dist, name) for name in ("batch_isend_irecv", "all_gather_into_tensor", "all_to_all_single")}
    failures = []
    for label, (q, k, v), kwargs, match in cases:
        with no_collectives():
            try:
                with pytest.raises(ValueError, match=match):
                    sequence_parallel_attention(q, k, v, **kwargs)
            except Exception as err:  # noqa: BLE001 - collect every failing case with its label
                failures.append(f"case {label!r}: {type(err).__name__}: {err}")
            except pytest.fail.Exception as err:  # pytest.raises saw no exception
                failures.append(f"case {label!r}: {err}")
    assert not failures, f"{len(failures)} of {len(cases)} malformed calls were not rejected as expected:\n" + "\n".join(failures)
    for name, fn in originals.items():
        assert getattr(dist, name) is fn, f"torch.distributed.{name} was not restored"
    return len(cases)


def _sanity_call(mesh, algorithm: str, h_q: int = H, h_kv: int = H) -> None:
    """A valid call after the error cases: the ranks are still in step and nothing is left patched."""
    from lightning_seqpar.attention import sequence_parallel_attention

    q, k, v = _qkv(h_q=h_q, h_k=h_kv)
    out = sequence_parallel_attention(q, k, v, mesh=mesh, algorithm=algorithm)
    assert out.shape == q.shape


def _errors_w2_worker(rank: int, world_size: int) -> int:
    mesh = make_mesh(("1d", world_size))
    base = dict(mesh=mesh, algorithm="ring", causal=True, layout="zigzag")

    def kw(**overrides):
        return {**base, **overrides}

    from torch.distributed.device_mesh import init_device_mesh

    mesh_ab = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("a", "b"))
    mesh_3d = init_device_mesh("cpu", (1, 1, world_size), mesh_dim_names=("x", "hp", "cp"))

    cases = [
        # global length S = S_local * W must be divisible by 2W for zigzag: S_local odd is not
        *[(f"zigzag odd S_local, {a}", _qkv(s_q=3), kw(algorithm=a), LENGTH) for a in ("ring", "allgather", "ulysses")],
        ("ulysses H_q % W", _qkv(h_q=3, h_k=3), kw(algorithm="ulysses"), HEADS),
        ("ulysses H_q % W, GQA", _qkv(h_q=3, h_k=1), kw(algorithm="ulysses"), HEADS),
        ("2d on a 1-D mesh", _qkv(), kw(algorithm="2d"), MESH),
        ("2d on a mesh without hp/cp", _qkv(), kw(algorithm="2d", mesh=mesh_ab), MESH),
        ("ring on a 2-D mesh with other dim names", _qkv(), kw(mesh=mesh_ab), MESH),
        ("ring on a 3-D mesh", _qkv(), kw(mesh=mesh_3d), MESH),
        ("2d on a 3-D mesh", _qkv(), kw(algorithm="2d", mesh=mesh_3d), MESH),
        ("mesh=None", _qkv(), kw(mesh=None), MESH),
        ("dtype mismatch", _qkv(dtype_k=torch.float64), kw(), r"(?i)dtype"),
        ("k/v head mismatch", _qkv(h_k=1, h_v=2), kw(), K_AND_V),
        ("k/v length mismatch", (torch.randn(B, 4, H, D), torch.randn(B, 4, H, D), torch.randn(B, 6, H, D)), kw(), K_AND_V),
        ("H_q % H_kv", _qkv(h_q=4, h_k=3), kw(), HEADS),
        ("q/k different S_local", _qkv(s_q=4, s_kv=6), kw(), LENGTH),
        ("q/k different batch", _qkv(b_k=2), kw(), r"(?i)batch|shape\[0\]"),
        ("q/k different head_dim", _qkv(d_k=8), kw(), r"(?i)head_dim|shape\[3\]"),
        ("q 3-D", (torch.randn(B, S_LOCAL, H * D),) + _qkv()[1:], kw(), r"(?i)\bq\b.*(ndim|dim|4-D)"),
        ("k 5-D", (_qkv()[0], torch.randn(B, S_LOCAL, H, D, 1), _qkv()[2]), kw(), r"(?i)\bk\b.*(ndim|dim|4-D)"),
        ("unknown algorithm", _qkv(), kw(algorithm="tree"), r"algorithm"),
        ("unknown layout", _qkv(), kw(layout="striped"), r"layout"),
        ("unknown layout, ulysses", _qkv(), kw(algorithm="ulysses", layout="striped"), r"layout"),
        ("unknown backend", _qkv(), kw(backend="turbo"), r"backend"),
        ("backend flash_attn (unknown name)", _qkv(), kw(backend="flash_attn"), r"flash_attn"),
        ("backend fa4 on CPU", _qkv(), kw(backend="fa4"), r"fa4.*flash-attn-4"),
        ("head_chunks=0", _qkv(), kw(head_chunks=0), r"head_chunks"),
        ("head_chunks not dividing H_kv", _qkv(h_q=4, h_k=2), kw(head_chunks=4), r"head_chunks=4 must divide"),
        ("head_chunks with ulysses", _qkv(), kw(algorithm="ulysses", head_chunks=2), r"head_chunks"),
        ("backend flash on CPU", _qkv(), kw(backend="flash"), r"backend"),
        ("inner_ring_size not dividing W", _qkv(), kw(inner_ring_size=3), r"inner_ring_size"),
        ("inner_ring_size=0", _qkv(), kw(inner_ring_size=0), r"inner_ring_size"),
        ("inner_ring_size with ulysses", _qkv(), kw(algorithm="ulysses", inner_ring_size=1), r"inner_ring_size"),
        ("inner_ring_size with allgather", _qkv(), kw(algorithm="allgather", inner_ring_size=1), r"inner_ring_size"),
        ("inner_ring_size=True", _qkv(), kw(inner_ring_size=True), r"inner_ring_size=True"),
        ("no K/V heads", _qkv(h_k=0), kw(), r"\bk must have at least one head"),
        ("head_dim 0", (torch.randn(B, S_LOCAL, H, 0),) * 3, kw(), r"head_dim >= 1"),
        *[(f"scale={bad!r}", _qkv(), kw(scale=bad), r"scale must be None or a finite Python number")
          for bad in ("x", float("nan"), float("inf"), torch.tensor(0.5), True)],
    ]
    n = _check_all(cases)
    _sanity_call(mesh, "ring")
    return n


def _empty_worker(rank: int, world_size: int) -> list[str]:
    """No tokens (S_local = 0) or no samples (B = 0): an empty output and empty gradients, as SDPA gives."""
    from lightning_seqpar.attention import sequence_parallel_attention

    mesh = make_mesh(("1d", world_size))
    done = []
    for shape in ((1, 0, H, D), (0, S_LOCAL, H, D)):
        for algorithm in ("ring", "allgather", "ulysses"):
            q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
            out = sequence_parallel_attention(q, k, v, mesh=mesh, algorithm=algorithm)
            out.backward(torch.ones_like(out))
            assert out.shape == shape and all(t.grad is not None and t.grad.shape == shape for t in (q, k, v))
            done.append(f"{shape}-{algorithm}")
    return done


def test_empty_inputs_w2():
    a, b = run_distributed(_empty_worker, 2)
    assert a == b and len(a) == 6


def test_errors_w2():
    counts = run_distributed(_errors_w2_worker, 2)
    assert counts[0] > 0


def _errors_w3_worker(rank: int, world_size: int) -> int:
    mesh = make_mesh(("1d", world_size))
    base = dict(mesh=mesh, causal=True, layout="zigzag")
    cases = [
        ("zigzag S % 2W at W=3, ring", _qkv(s_q=3), {**base, "algorithm": "ring"}, LENGTH),
        ("zigzag S % 2W at W=3, allgather", _qkv(s_q=5), {**base, "algorithm": "allgather"}, LENGTH),
        ("ulysses H_q=4 % W=3", _qkv(h_q=4, h_k=2), {**base, "algorithm": "ulysses"}, HEADS),
        ("inner_ring_size=2 at W=3", _qkv(), {**base, "algorithm": "ring", "inner_ring_size": 2}, r"inner_ring_size"),
    ]
    n = _check_all(cases)
    _sanity_call(mesh, "ulysses", h_q=6, h_kv=3)
    return n


def test_errors_w3():
    run_distributed(_errors_w3_worker, 3)


def _errors_2d_worker(rank: int, world_size: int, dim_names: tuple[str, str]) -> int:
    mesh = make_mesh(("2d", dim_names, (2, 2)))
    base = dict(mesh=mesh, algorithm="2d", causal=True, layout="zigzag")
    cases = [
        ("2d H_q % hp", _qkv(h_q=3, h_k=3), base, HEADS),
        ("2d H_q % hp, 33 heads", _qkv(h_q=33, h_k=33), base, HEADS),
        ("2d inner_ring_size not dividing cp", _qkv(), {**base, "inner_ring_size": 3}, r"inner_ring_size"),
        ("2d inner_ring_size=4 > cp", _qkv(), {**base, "inner_ring_size": 4}, r"inner_ring_size"),
        ("2d H_q % H_kv", _qkv(h_q=4, h_k=3), base, HEADS),
    ]
    n = _check_all(cases)
    _sanity_call(mesh, "2d")
    return n


@pytest.mark.parametrize("dim_names", [("hp", "cp"), ("cp", "hp")], ids=["hp-cp", "cp-hp"])
def test_errors_2d(dim_names):
    run_distributed(_errors_2d_worker, 4, dim_names)


def _disagree_worker(rank: int, world_size: int) -> list[str]:
    """Note [Inputs that differ across ranks]: inputs that pass every local check but differ between
    ranks get the same ValueError on every rank (naming what differs), not a hang or an abort."""
    from lightning_seqpar.sharding import agreement
    from lightning_seqpar.attention import sequence_parallel_attention

    mesh = make_mesh(("1d", world_size))
    mesh_2d = make_mesh(("2d", ("hp", "cp"), (2, world_size // 2))) if world_size == 4 else None
    r = rank % 2  # ranks 0, 2 / 1, 3 differ
    cases = [  # (label, (q, k, v), kwargs, the field that must be named)
        *[(f"uneven S_local, {a} {lay}", _qkv(s_q=(4, 6)[r]), dict(mesh=mesh, algorithm=a, layout=lay), "seq_local")
          for a in ("ring", "allgather", "ulysses") for lay in ("zigzag", "contiguous")],
        ("ulysses, other head counts", _qkv(h_q=(2, 1)[r] * world_size, h_k=(2, 1)[r] * world_size), dict(mesh=mesh, algorithm="ulysses"), "heads_q"),
        ("ring, GQA on one rank", _qkv(h_k=(4, 2)[r]), dict(mesh=mesh, algorithm="ring"), "heads_kv"),
        ("ring, causal on one rank", _qkv(), dict(mesh=mesh, algorithm="ring", causal=(True, False)[r]), "causal"),
        ("allgather, other scale", _qkv(), dict(mesh=mesh, algorithm="allgather", scale=(0.5, 0.25)[r]), "scale"),
        ("ring vs allgather", _qkv(), dict(mesh=mesh, algorithm=("ring", "allgather")[r]), "algorithm"),
        ("other dtype", tuple(t.to((torch.float32, torch.float64)[r]) for t in _qkv()), dict(mesh=mesh), "dtype"),
    ]
    if mesh_2d is not None:  # only rank 3 differs: caught along both of its mesh dimensions
        cases.append(("2d, one rank longer", _qkv(s_q=6 if rank == 3 else 4), dict(mesh=mesh_2d, algorithm="2d"), "seq_local"))
    messages = []
    for label, (q, k, v), kwargs, field in cases:
        with pytest.raises(ValueError, match=rf"passed different inputs: .*'{field}'") as info:
            sequence_parallel_attention(q, k, v, **kwargs)
        messages.append(f"{label}: {info.value}")
    # the ranks are still in step, and once a call on the mesh agreed, later calls with the same agreement are not checked
    agreed = agreement.RankAgreement()
    calls = []
    gather = agreement.dist.all_gather

    def counting(*args, **kwargs):
        calls.append(1)
        return gather(*args, **kwargs)

    agreement.dist.all_gather = counting
    try:
        for _ in range(3):
            out = sequence_parallel_attention(*_qkv(s_q=8), mesh=mesh, algorithm="ring", agreement=agreed)
        out = sequence_parallel_attention(*_qkv(s_q=6), mesh=mesh, algorithm="allgather", agreement=agreed)
        sequence_parallel_attention(*_qkv(s_q=6), mesh=mesh, algorithm="allgather")  # no agreement: checked again
    finally:
        agreement.dist.all_gather = gather
    assert out.shape == (B, 6, H, D) and len(calls) == 2, calls
    return messages


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_that_disagree_get_one_error(world):
    messages = run_distributed(_disagree_worker, world)
    assert all(m == messages[0] for m in messages), "every rank must raise the same error"
    assert len(messages[0]) == 12 + (world == 4)
    assert "'seq_local': {0: 4, 1: 6}" in messages[0][0] if world == 2 else "'seq_local': {0: 4, 1: 6, 2: 4, 3: 6}" in messages[0][0]
    if world == 4:  # the 2-D mesh's table, gathered along hp then cp, is mapped back to global ranks
        assert "'seq_local': {0: 4, 1: 4, 2: 4, 3: 6}" in messages[0][-1], messages[0][-1]

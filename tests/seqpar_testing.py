"""Shared helpers for the sequence-parallel attention tests.

Everything here is independent of the code under test: the expected shard positions are
computed from the layout rules of docs/attention.md (not from ``lightning_seqpar.sharding``), and the
reference attention is an explicit softmax on the full sequence, so a bug in the sharding
helpers cannot hide a bug in the attention (or the other way round).

Layouts (W context-parallel ranks, S tokens):

    contiguous: W chunks, rank r holds chunk r
    zigzag:     2W chunks, rank r holds chunks r and 2W-1-r, in that order

On a 2-D ("hp", "cp") mesh the sequence is split over cp with the layout, then each cp shard
is split contiguously into hp pieces (hp rank h gets piece h).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

# Attention inputs: (H_q, H_kv, D). MHA, GQA, MQA, a head count dividing nothing, the
# LightSeq "33 heads" case (small D to stay cheap), and a GQA whose H_kv is odd.
HEAD_CONFIGS: tuple[tuple[int, int, int], ...] = (
    (4, 4, 8),
    (4, 2, 8),
    (4, 1, 8),
    (3, 3, 8),
    (33, 33, 4),
    (6, 3, 8),
)
LAYOUTS: tuple[str, ...] = ("zigzag", "contiguous")


# ----------------------------------------------------------------------------------------------
# Meshes and expected shard positions
# ----------------------------------------------------------------------------------------------


def mesh_1d(world_size: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("sp",))


def mesh_2d(dim_names: tuple[str, str] = ("hp", "cp"), shape: tuple[int, int] = (2, 2)):
    """A 2-D mesh over all ranks; ``dim_names`` is ("hp", "cp") or ("cp", "hp") (device placement)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=dim_names)


def make_mesh(spec: tuple):
    """``("1d", W)`` or ``("2d", dim_names, shape)``."""
    if spec[0] == "1d":
        return mesh_1d(spec[1])
    return mesh_2d(spec[1], spec[2])


def mesh_coords(mesh) -> tuple[int, int, int, int]:
    """(hp_size, hp_rank, cp_size, cp_rank) of this rank, read off the mesh itself."""
    if mesh.ndim == 1:
        return 1, 0, mesh.size(), mesh.get_local_rank()
    names = mesh.mesh_dim_names
    return (
        mesh.size(names.index("hp")),
        mesh.get_local_rank("hp"),
        mesh.size(names.index("cp")),
        mesh.get_local_rank("cp"),
    )


def expected_index(seq_len: int, layout: str, cp: int, cp_rank: int, hp: int = 1, hp_rank: int = 0) -> torch.Tensor:
    """Global positions held by (cp_rank, hp_rank), in local order, from the layout rules."""
    if layout == "zigzag":
        chunk = seq_len // (2 * cp)
        chunks = (cp_rank, 2 * cp - 1 - cp_rank)
    elif layout == "contiguous":
        chunk = seq_len // cp
        chunks = (cp_rank,)
    else:
        raise AssertionError(f"unknown layout {layout!r} in the test helper")
    positions = [p for c in chunks for p in range(c * chunk, (c + 1) * chunk)]
    piece = len(positions) // hp
    return torch.tensor(positions[hp_rank * piece : (hp_rank + 1) * piece], dtype=torch.long)


def expected_index_on(mesh, seq_len: int, layout: str) -> torch.Tensor:
    hp, hp_rank, cp, cp_rank = mesh_coords(mesh)
    return expected_index(seq_len, layout, cp, cp_rank, hp, hp_rank)


def take(x: torch.Tensor, index: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The rows ``index`` of ``x`` along ``dim`` (the reference sharding)."""
    return x.index_select(dim, index.to(x.device))


# ----------------------------------------------------------------------------------------------
# Reference attention
# ----------------------------------------------------------------------------------------------


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None) -> torch.Tensor:
    """Explicit softmax attention on the full sequence, in q's dtype.

    q [B, S_q, H_q, D], k/v [B, S_k, H_kv, D]; K/V heads are repeated for GQA/MQA (query head h
    uses K/V head h // (H_q / H_kv)); the causal mask is over global positions (query i sees
    keys 0..i).
    """
    h_q, h_kv = q.shape[2], k.shape[2]
    groups = h_q // h_kv
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        s_q, s_k = q.shape[1], k.shape[1]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


@dataclass
class AttentionCase:
    """Full-sequence inputs, upstream gradient and float64 reference outputs/gradients."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    out: torch.Tensor = field(init=False)
    dq: torch.Tensor = field(init=False)
    dk: torch.Tensor = field(init=False)
    dv: torch.Tensor = field(init=False)


def make_case(
    batch: int,
    seq_len: int,
    h_q: int,
    h_kv: int,
    head_dim: int,
    *,
    causal: bool,
    scale: float | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> AttentionCase:
    """Seeded full q, k, v, grad_out (identical on every rank) plus the float64 reference."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    case = AttentionCase(
        q=randn(batch, seq_len, h_q, head_dim),
        k=randn(batch, seq_len, h_kv, head_dim),
        v=randn(batch, seq_len, h_kv, head_dim),
        grad_out=randn(batch, seq_len, h_q, head_dim),
    )
    q, k, v = (t.detach().double().requires_grad_() for t in (case.q, case.k, case.v))
    out = reference_attention(q, k, v, causal=causal, scale=scale)
    out.backward(case.grad_out.double())
    case.out, case.dq, case.dk, case.dv = out.detach(), q.grad, k.grad, v.grad
    return case


def run_sharded(attn, case: AttentionCase, index: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
    """Run ``attn`` on this rank's shards and backprop the sharded upstream gradient.

    Returns the local output and the gradients of the local q, k, v shards.
    """
    q, k, v = (take(t, index).detach().requires_grad_() for t in (case.q, case.k, case.v))
    out = attn(q, k, v, **kwargs)
    out.backward(take(case.grad_out, index))
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def compare_to_reference(
    got: dict[str, torch.Tensor],
    case: AttentionCase,
    index: torch.Tensor,
    label: str,
    *,
    atol: float = 2e-6,
    rtol: float = 1e-5,
) -> None:
    """assert_close of out, dq, dk, dv against the sharded reference (cast to the result's dtype)."""
    for name in ("out", "dq", "dk", "dv"):
        actual = got[name]
        assert actual is not None, f"{label}: {name} is None (no gradient reached the input)"
        assert torch.isfinite(actual).all(), f"{label}: {name} has non-finite values"
        expected = take(getattr(case, name), index).to(device=actual.device, dtype=actual.dtype)
        torch.testing.assert_close(
            actual, expected, atol=atol, rtol=rtol, msg=lambda m, n=name: f"{label}: {n} differs from the reference\n{m}"
        )


# ----------------------------------------------------------------------------------------------
# Watching the communication
# ----------------------------------------------------------------------------------------------

_DIST_COLLECTIVES = (
    "batch_isend_irecv",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_to_all_single",
    "all_to_all",
    "all_gather",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "reduce_scatter",
    "broadcast",
    "all_reduce",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
)
_FUNCOL_COLLECTIVES = (
    "all_gather_tensor",
    "all_to_all_single",
    "all_gather_tensor_autograd",
    "all_gather_single_autograd",
    "all_to_all_single_autograd",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd",
    "all_reduce",
)
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


class _CollectiveGuard(TorchDispatchMode):
    """Raises on any c10d / functional-collective op dispatched at the top level."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _COMM_NAMESPACES:
            raise RuntimeError(f"collective ran: {func}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_collectives() -> Iterator[None]:
    """Every collective entry point raises RuntimeError("collective ran") inside this block.

    Patches the ``torch.distributed`` and ``torch.distributed._functional_collectives`` functions
    (looked up by attribute at call time) and, for code that bound them at import time, also
    refuses c10d ops at the dispatcher. Everything is restored on exit.
    """
    import torch.distributed._functional_collectives as funcol

    def refuse(name):
        def _refuse(*args, **kwargs):
            raise RuntimeError(f"collective ran: {name}")

        return _refuse

    saved = []
    for module, names in ((dist, _DIST_COLLECTIVES), (funcol, _FUNCOL_COLLECTIVES)):
        for name in names:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, refuse(f"{module.__name__}.{name}"))
    try:
        with _CollectiveGuard():
            yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


@dataclass
class P2PRecord:
    sent: list[torch.Size] = field(default_factory=list)
    received: list[torch.Size] = field(default_factory=list)
    calls: int = 0

    @property
    def sent_numel(self) -> list[int]:
        return [math.prod(s) for s in self.sent]

    @property
    def received_numel(self) -> list[int]:
        return [math.prod(s) for s in self.received]


class _CommOpRecorder(TorchDispatchMode):
    """Records the names of top-level c10d / functional-collective ops."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in _COMM_NAMESPACES:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_p2p() -> Iterator[tuple[P2PRecord, _CommOpRecorder]]:
    """Wrap ``torch.distributed.batch_isend_irecv`` and record the shapes it sends/receives.

    Also yields a dispatcher-level recorder of the c10d ops seen (to catch communication that
    bypasses ``batch_isend_irecv``).
    """
    record = P2PRecord()
    original = dist.batch_isend_irecv

    def recording(p2p_op_list):
        record.calls += 1
        for op in p2p_op_list:
            name = getattr(op.op, "__name__", str(op.op))
            if name in ("isend", "send"):
                record.sent.append(op.tensor.shape)
            else:
                record.received.append(op.tensor.shape)
        return original(p2p_op_list)

    dist.batch_isend_irecv = recording
    try:
        with _CommOpRecorder() as ops:
            yield record, ops
    finally:
        dist.batch_isend_irecv = original

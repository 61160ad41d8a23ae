"""Linear attention with decay and LASP (Sun et al., arXiv:2404.02882, Alg. 2-3) against a naive
reference.

The reference is the quadratic formula on the full sequence in float64,

    o_t = sum_{s <= t} lambda^(t-s) (q_t . k_s) v_s  (+ lambda^(t+1) q_t^T S_0),

written here without any code of the package. Every check: outputs and gradients in fp32,
atol 1e-5 / rtol 1e-5 (the issue's acceptance); distributed runs use gloo on CPU (W = 1..4),
shards cut by the contiguous layout rules of seqpar_testing (not by lightning_seqpar.sharding).
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from seqpar_testing import expected_index, mesh_1d, no_collectives, record_p2p, take

ATOL, RTOL = 1e-5, 1e-5
# per-head log decays: no decay, TNL-like slow ones, a fast one
DECAY_LOG = (0.0, -0.05, -0.4, -2.5)


# ----------------------------------------------------------------------------------------------
# the naive reference


def naive_linear_attention(q, k, v, decay_log, initial_state=None):
    """(out [B, T, H, Dv], final state [B, H, Dk, Dv]) by the quadratic formula, in q's dtype."""
    T = q.shape[1]
    g = decay_log.to(q.dtype)
    t = torch.arange(T, dtype=q.dtype)
    diff = t[:, None] - t[None, :]
    decay = torch.where(diff >= 0, torch.exp(g[:, None, None] * diff.clamp(min=0)), torch.zeros((), dtype=q.dtype))  # (H, T, T)
    scores = torch.einsum("bthd,bshd->bhts", q, k) * decay
    out = torch.einsum("bhts,bshe->bthe", scores, v)
    final = torch.einsum("bshd,bshe,hs->bhde", k, v, torch.exp(g[:, None] * (T - 1 - t)[None, :]))
    if initial_state is not None:
        out = out + torch.einsum("bthd,bhde,th->bthe", q, initial_state, torch.exp((t + 1)[:, None] * g[None, :]))
        final = final + torch.exp(g * T)[None, :, None, None] * initial_state
    return out, final


def make_inputs(batch, seq_len, heads, dk, dv, *, seed=0, scale=0.5):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen) * scale

    return dict(q=randn(batch, seq_len, heads, dk), k=randn(batch, seq_len, heads, dk), v=randn(batch, seq_len, heads, dv),
                dout=randn(batch, seq_len, heads, dv), s0=randn(batch, heads, dk, dv), dfinal=randn(batch, heads, dk, dv),
                decay_log=torch.tensor(DECAY_LOG[:heads]) if heads <= len(DECAY_LOG) else -torch.rand(heads, generator=gen))


def reference_grads(x, *, with_state: bool):
    """float64 (out, final, dq, dk, dv, ds0) of the naive formula for upstream (dout, dfinal)."""
    q, k, v, s0 = (x[n].double().requires_grad_() for n in ("q", "k", "v", "s0"))
    out, final = naive_linear_attention(q, k, v, x["decay_log"].double(), s0 if with_state else None)
    loss = (out * x["dout"].double()).sum() + ((final * x["dfinal"].double()).sum() if with_state else 0)
    loss.backward()
    return dict(out=out.detach(), final=final.detach(), dq=q.grad, dk=k.grad, dv=v.grad, ds0=s0.grad if with_state else None)


def close(actual, expected, label):
    torch.testing.assert_close(actual, expected.to(actual.dtype), atol=ATOL, rtol=RTOL, msg=lambda m: f"{label}\n{m}")


# ----------------------------------------------------------------------------------------------
# one device: the chunked kernel


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 64])
@pytest.mark.parametrize(("dk", "dv"), [(8, 8), (8, 4)], ids=["Dk=Dv", "Dk=2Dv"])
def test_chunked_matches_naive(chunk_size, dk, dv):
    """T = 37 is a multiple of no chunk size but 1: the last chunk is short."""
    from lightning_seqpar.attention.lasp import linear_attention_chunked, linear_attention_chunked_backward

    x = make_inputs(2, 37, 4, dk, dv, seed=chunk_size)
    ref = reference_grads(x, with_state=True)
    label = f"chunk_size={chunk_size} Dk={dk} Dv={dv}"

    # forward values and autograd through the torch ops
    q, k, v, s0 = (x[n].clone().requires_grad_() for n in ("q", "k", "v", "s0"))
    out, final = linear_attention_chunked(q, k, v, x["decay_log"], chunk_size=chunk_size, initial_state=s0, kernel="torch")
    assert out.dtype == torch.float32 and final.dtype == torch.float32
    ((out * x["dout"]).sum() + (final * x["dfinal"]).sum()).backward()
    for name, got in (("out", out), ("final", final), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad), ("ds0", s0.grad)):
        close(got.detach(), ref[name], f"{label} autograd {name}")

    # the explicit backward the custom ops run
    dq, dk_, dv_, ds0 = linear_attention_chunked_backward(x["dout"], x["q"], x["k"], x["v"], x["decay_log"], chunk_size=chunk_size,
                                                          initial_state=x["s0"], d_final_state=x["dfinal"])
    for name, got in (("dq", dq), ("dk", dk_), ("dv", dv_), ("ds0", ds0)):
        close(got, ref[name], f"{label} explicit backward {name}")


def test_chunked_without_state_and_final_state_flag():
    from lightning_seqpar.attention.lasp import linear_attention_chunked

    x = make_inputs(1, 20, 3, 4, 4, seed=3)
    ref = reference_grads(x, with_state=False)
    out, final = linear_attention_chunked(x["q"], x["k"], x["v"], x["decay_log"], chunk_size=6, output_final_state=False)
    assert final is None
    close(out, ref["out"], "no initial state")
    _, final = linear_attention_chunked(x["q"], x["k"], x["v"], x["decay_log"], chunk_size=6)
    close(final, ref["final"], "final state from a zero state")


def test_chunked_bf16_inputs_accumulate_in_fp32():
    from lightning_seqpar.attention.lasp import linear_attention_chunked

    x = make_inputs(1, 33, 2, 8, 8, seed=4)
    q, k, v = (x[n].bfloat16() for n in ("q", "k", "v"))
    out, final = linear_attention_chunked(q, k, v, x["decay_log"][:2], chunk_size=8)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    expected, _ = naive_linear_attention(q.double(), k.double(), v.double(), x["decay_log"][:2].double())
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=1e-2)


def test_linear_attention_op_matches_naive():
    """The custom-op path (explicit backward) that models run without sequence parallelism."""
    from lightning_seqpar.attention.lasp import LinearAttention, linear_attention

    x = make_inputs(2, 29, 4, 8, 4, seed=5)
    ref = reference_grads(x, with_state=False)
    for fn in (lambda *a: linear_attention(*a, chunk_size=5), LinearAttention(chunk_size=7)):
        q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
        out = fn(q, k, v, x["decay_log"])
        out.backward(x["dout"])
        for name, got in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            close(got, ref[name], f"op {name}")


def test_custom_ops_pass_opcheck_and_compile_without_graph_breaks():
    from lightning_seqpar.attention.lasp import linear_attention

    x = make_inputs(1, 12, 2, 4, 4, seed=6)
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    g = x["decay_log"][:2]
    torch.library.opcheck(torch.ops.seqpar.linear_attn_fwd.default, (q, k, v, g, 4))
    compiled = torch.compile(lambda a, b, c: linear_attention(a, b, c, g, chunk_size=4, kernel="torch"), backend="aot_eager",
                             fullgraph=True)
    out = compiled(q, k, v)
    out.backward(x["dout"][:, :, :2])
    ref = reference_grads({**x, "q": x["q"][:, :, :2], "k": x["k"][:, :, :2], "v": x["v"][:, :, :2],
                           "dout": x["dout"][:, :, :2], "decay_log": g}, with_state=False)
    close(out.detach(), ref["out"], "compiled out")
    close(q.grad, ref["dq"], "compiled dq")


def _opcheck_worker(rank: int, world_size: int, variant: str) -> None:
    """opcheck of the state-exchange op runs it several times, identically on every rank."""
    import lightning_seqpar.attention.lasp  # noqa: F401 - registers the ops
    x = make_inputs(1, 8, 2, 4, 3, seed=7)
    q = x["q"].clone().requires_grad_()
    state = torch.randn(1, 2, 4, 3, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    group = mesh_1d(world_size).get_group().group_name
    torch.library.opcheck(torch.ops.seqpar.lasp_fwd.default, (q, state, x["decay_log"][:2], variant, group))
    # and LASP compiles as one graph (the ops are opaque nodes), with the eager result
    from lightning_seqpar.attention.lasp import lasp_attention

    mesh, g = mesh_1d(world_size), x["decay_log"][:2]
    eager = lasp_attention(q, x["k"], x["v"], g, mesh=mesh, variant=variant, chunk_size=3)
    compiled = torch.compile(lambda a, b, c: lasp_attention(a, b, c, g, mesh=mesh, variant=variant, chunk_size=3),
                             backend="aot_eager", fullgraph=True)(q, x["k"], x["v"])
    torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("variant", ["p2p", "allgather"])
def test_state_exchange_op_passes_opcheck_and_compiles(variant):
    run_distributed(_opcheck_worker, 2, variant)


def test_local_errors_name_the_argument():
    from lightning_seqpar.attention.lasp import LinearAttention, linear_attention, linear_attention_chunked

    x = make_inputs(1, 8, 2, 4, 4)
    q, k, v, g = x["q"], x["k"], x["v"], x["decay_log"][:2]
    cases = [
        (lambda: linear_attention(q[0], k, v, g), r"\bq\b.*4 dims"),
        (lambda: linear_attention(q, k.double(), v, g), "dtype"),
        (lambda: linear_attention(q.int(), k.int(), v.int(), g), "floating"),
        (lambda: linear_attention(q, k[:, :, :1], v, g), r"\bk\b"),
        (lambda: linear_attention(q, k, v[:, :4], g), r"\bv\b"),
        (lambda: linear_attention(q, k, v, g[:1]), "decay_log"),
        (lambda: linear_attention(q, k, v, g.clone().requires_grad_()), "decay_log.*grad"),
        (lambda: linear_attention(q, k, v, [0.0, 0.0]), "decay_log"),
        (lambda: linear_attention(q, k, v, g, chunk_size=0), "chunk_size"),
        (lambda: linear_attention(q, k, v, g, kernel="triton"), "kernel"),
        (lambda: linear_attention(q, k, v, g, kernel="fla"), "kernel='fla'"),
        (lambda: linear_attention_chunked(q, k, v, g, initial_state=torch.zeros(1, 2, 4)), "initial_state"),
        (lambda: LinearAttention(chunk_size=-1), "chunk_size"),
        (lambda: LinearAttention().configure(mesh=None, algorithm="ring"), "algorithm"),
        (lambda: LinearAttention().configure(mesh=None, variant="tree"), "variant"),
        (lambda: LinearAttention().configure(mesh=None, layout="zigzag"), "contiguous"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


# ----------------------------------------------------------------------------------------------
# LASP on W gloo ranks


BATCH, SEQ_LEN = 2, 36  # divisible by W = 1, 2, 3, 4; local lengths 36, 18, 12, 9
LASP_CASES = (  # (heads, Dk, Dv, chunk_size)
    (4, 8, 8, 4),
    (4, 8, 4, 5),  # Dk = 2 Dv (LRPE layer); chunk_size divides no local length
    (3, 4, 6, 64),  # one chunk per rank
)


def _lasp_worker(rank: int, world_size: int, variant: str) -> int:
    from lightning_seqpar.attention.lasp import lasp_attention

    mesh = mesh_1d(world_size)
    index = expected_index(SEQ_LEN, "contiguous", world_size, rank)
    failures = []
    for seed, (heads, dk, dv, chunk_size) in enumerate(LASP_CASES):
        x = make_inputs(BATCH, SEQ_LEN, heads, dk, dv, seed=seed)
        ref = reference_grads(x, with_state=False)
        q, k, v = (take(x[n], index).requires_grad_() for n in ("q", "k", "v"))
        out = lasp_attention(q, k, v, x["decay_log"], mesh=mesh, variant=variant, chunk_size=chunk_size)
        out.backward(take(x["dout"], index))
        label = f"LASP {variant} W={world_size} rank={rank} H={heads} Dk={dk} Dv={dv} chunk={chunk_size}"
        assert out.shape == (BATCH, SEQ_LEN // world_size, heads, dv) and out.dtype == torch.float32, label
        for name, got in (("out", out.detach()), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            try:  # every collective has run: keep going and report all
                close(got, take(ref[name], index), f"{label}: {name}")
            except AssertionError as err:
                failures.append(str(err))
    assert not failures, "\n".join(failures)
    return len(LASP_CASES)


@pytest.mark.parametrize("variant", ["p2p", "allgather"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_lasp_matches_full_sequence(world_size, variant):
    assert run_distributed(_lasp_worker, world_size, variant) == [len(LASP_CASES)] * world_size


# ----------------------------------------------------------------------------------------------
# communication volume: independent of the sequence length


@contextlib.contextmanager
def record_all_gathers():
    """Wrap the single-tensor all-gather entry points of torch.distributed; yield the input shapes."""
    shapes: list[torch.Size] = []
    saved = [(name, getattr(dist, name)) for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)]

    def wrap(fn):
        def recording(output, input, *args, **kwargs):
            shapes.append(input.shape)
            return fn(output, input, *args, **kwargs)

        return recording

    for name, fn in saved:
        setattr(dist, name, wrap(fn))
    try:
        yield shapes
    finally:
        for name, fn in saved:
            setattr(dist, name, fn)


def _traffic_worker(rank: int, world_size: int, variant: str) -> dict:
    from lightning_seqpar.attention.lasp import lasp_attention

    mesh = mesh_1d(world_size)
    heads, dk, dv = 2, 8, 4
    state = (BATCH, heads, dk, dv)
    per_length = {}
    for seq_len in (16, 64):
        x = make_inputs(BATCH, seq_len, heads, dk, dv, seed=seq_len)
        index = expected_index(seq_len, "contiguous", world_size, rank)
        q, k, v = (take(x[n], index).requires_grad_() for n in ("q", "k", "v"))
        with record_p2p() as (fwd, _), record_all_gathers() as fwd_gathers:
            out = lasp_attention(q, k, v, x["decay_log"], mesh=mesh, variant=variant, chunk_size=4)
        with record_p2p() as (bwd, _), record_all_gathers() as bwd_gathers:
            out.backward(take(x["dout"], index))
        label = f"{variant} W={world_size} rank={rank} T={seq_len}"
        if variant == "p2p":
            assert not fwd_gathers and not bwd_gathers, f"{label}: p2p ran an all-gather"
            # forward: receive from r-1, send to r+1; backward: the other way round
            assert fwd.sent == ([torch.Size(state)] if rank < world_size - 1 else []), f"{label}: forward sent {fwd.sent}"
            assert fwd.received == ([torch.Size(state)] if rank > 0 else []), f"{label}: forward received {fwd.received}"
            assert bwd.sent == ([torch.Size(state)] if rank > 0 else []), f"{label}: backward sent {bwd.sent}"
            assert bwd.received == ([torch.Size(state)] if rank < world_size - 1 else []), f"{label}: backward received {bwd.received}"
        else:
            assert fwd.calls == bwd.calls == 0, f"{label}: allgather ran P2P"
            assert fwd_gathers == [torch.Size(state)] and bwd_gathers == [torch.Size(state)], (
                f"{label}: expected one all-gather of one [B, H, Dk, Dv] state per direction, got {fwd_gathers} / {bwd_gathers}"
            )
        per_length[seq_len] = (fwd.sent_numel, bwd.sent_numel, [math.prod(s) for s in fwd_gathers + bwd_gathers])
    assert per_length[16] == per_length[64], f"rank {rank}: traffic depends on the sequence length: {per_length}"
    return per_length[16]


@pytest.mark.parametrize("variant", ["p2p", "allgather"])
def test_lasp_communication_is_one_state_per_hop_whatever_the_length(variant):
    results = run_distributed(_traffic_worker, 4, variant)
    state_numel = BATCH * 2 * 8 * 4
    total_sent = sum(sum(f) + sum(b) for f, b, _ in results)
    if variant == "p2p":
        assert total_sent == 2 * 3 * state_numel  # W - 1 hops each way
    else:
        assert all(g == [state_numel, state_numel] for _, _, g in results)


# ----------------------------------------------------------------------------------------------
# errors: ValueError naming the argument, before any collective


def _errors_worker(rank: int, world_size: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_seqpar.attention.lasp import LinearAttention, lasp_attention

    mesh = mesh_1d(world_size)
    mesh_2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("hp", "cp"))
    x = make_inputs(1, 8, 2, 4, 4)
    q, k, v, g = x["q"], x["k"], x["v"], x["decay_log"][:2]
    cases = [
        ("q 3-D", (q[0], k, v, g), {}, r"\bq\b"),
        ("k heads", (q, k[:, :, :1], v, g), {}, r"\bk\b"),
        ("v length", (q, k, v[:, :4], g), {}, r"\bv\b"),
        ("dtype", (q, k, v.double(), g), {}, "dtype"),
        ("decay shape", (q, k, v, g[:1]), {}, "decay_log"),
        ("decay grad", (q, k, v, g.clone().requires_grad_()), {}, "decay_log"),
        ("variant", (q, k, v, g), {"variant": "ring"}, "variant"),
        ("layout", (q, k, v, g), {"layout": "zigzag"}, "contiguous"),
        ("mesh 2-D", (q, k, v, g), {"mesh": mesh_2d}, "mesh"),
        ("mesh type", (q, k, v, g), {"mesh": "sp"}, "mesh"),
        ("chunk_size", (q, k, v, g), {"chunk_size": 0}, "chunk_size"),
        ("kernel", (q, k, v, g), {"kernel": "fla"}, "kernel"),
    ]
    failures = []
    for label, args, kwargs, match in cases:
        with no_collectives():
            try:
                with pytest.raises(ValueError, match=match):
                    lasp_attention(*args, **{"mesh": mesh, **kwargs})
            except (Exception, pytest.fail.Exception) as err:  # noqa: BLE001 - collect every failing case
                failures.append(f"{label}: {type(err).__name__}: {err}")
    configure_cases = (({"mesh": mesh_2d}, "mesh"), ({"mesh": mesh, "layout": "zigzag"}, "contiguous"))
    for kwargs, match in configure_cases:
        with no_collectives(), pytest.raises(ValueError, match=match):
            LinearAttention().configure(**kwargs)
    assert not failures, "\n".join(failures)
    # the ranks are still in step
    out = lasp_attention(q, k, v, g, mesh=mesh)
    assert out.shape == v.shape
    return len(cases)


def test_lasp_errors_before_any_collective():
    run_distributed(_errors_worker, 2)

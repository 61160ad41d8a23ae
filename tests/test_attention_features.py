"""Sliding-window, chunked, soft-capped and sink attention (Note [Attention variants]) in every
algorithm and layout, with packed documents and head chunks, against an explicit fp64 softmax
on the full sequence: outputs and gradients of q, k, v and the sinks."""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from seqpar_testing import expected_index_on, make_mesh, mesh_coords

B, HQ, HKV, D = 2, 4, 2, 8
ATOL, RTOL = 2e-6, 1e-5

# documents: lengths per sample (S = 32)
CASES = (
    dict(window=5),
    dict(window=11, softcap=2.0, sinks=True),
    dict(chunk_size=6),
    dict(chunk_size=6, documents=((13, 3, 16), (32,))),  # chunks from each document's start: 16 = 6 + 6 + 4, not 2 + 6 + 6 + 2
    dict(window=3, chunk_size=6, documents=((1, 7, 9, 15), (11, 21)), sinks=True),  # both bite inside documents
    dict(softcap=1.5, causal=False),
    dict(chunk_size=10, causal=False, sinks=True),
)


def reference(q, k, v, *, causal=True, window=None, chunk_size=None, softcap=None, sinks=None, doc_ids=None):
    """Explicit softmax over the full sequence (fp64 in, fp64 out): positions 0..S-1, or with ``doc_ids`` the
    positions inside each document (every document masked as if alone: its chunks start at its first token)."""
    S = q.shape[1]
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    x = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if softcap:
        x = softcap * torch.tanh(x / softcap)
    pos = torch.arange(S).expand(q.shape[0], S)
    if doc_ids is not None:  # position inside the document: index minus the index of the document's first token
        first = torch.cat([torch.ones_like(doc_ids[:, :1], dtype=torch.bool), doc_ids[:, 1:] != doc_ids[:, :-1]], 1)
        pos = pos - torch.cummax(torch.where(first, pos, 0), dim=1).values
    i, j = pos[:, :, None], pos[:, None, :]
    ok = torch.ones(q.shape[0], S, S, dtype=torch.bool)
    if causal:
        ok &= j <= i
    if window:
        ok &= j > i - window
    if chunk_size:
        ok &= i // chunk_size == j // chunk_size
    if doc_ids is not None:
        ok = ok & (doc_ids[:, :, None] == doc_ids[:, None, :])
    x = x.masked_fill(~ok[:, None], float("-inf"))
    if sinks is not None:
        col = sinks.view(1, -1, 1, 1).expand(x.shape[0], -1, S, 1)
        p = torch.softmax(torch.cat([x, col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(x, -1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _doc_ids(lengths):
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])


def _full_case(case, S, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (HQ, HKV, HKV))
    q = q * 2  # scores of a few units: softcap and window both matter
    dout = torch.randn(B, S, HQ, D, generator=g, dtype=torch.float64)
    sinks = torch.randn(HQ, generator=g, dtype=torch.float64) if case.get("sinks") else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None else [])
    docs = case.get("documents")
    out = reference(*leaves[:3], causal=case.get("causal", True), window=case.get("window"), chunk_size=case.get("chunk_size"),
                    softcap=case.get("softcap"), sinks=leaves[3] if sinks is not None else None,
                    doc_ids=_doc_ids(docs) if docs else None)
    grads = torch.autograd.grad(out, leaves, dout)
    return (q, k, v, dout, sinks), out.detach(), grads


def _close(got, want, what):
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _run_case(mesh, algorithm, layout, case, S, seed, **extra):
    from lightning_seqpar.attention import sequence_parallel_attention
    from lightning_seqpar.sharding.documents import PackedDocuments

    (q, k, v, dout, sinks), out_ref, grads_ref = _full_case(case, S, seed)
    hp, hp_rank, cp, cp_rank = mesh_coords(mesh)
    documents = None
    if case.get("documents"):
        world = hp * cp if algorithm == "ulysses" else cp
        documents = PackedDocuments.from_lengths(case["documents"], world=world)
        if algorithm == "ulysses":
            index = documents.index(mesh.get_local_rank())
        else:
            index = documents.index(cp_rank).chunk(hp, dim=1)[hp_rank]
        take = lambda x: torch.gather(x, 1, index.view(B, -1, 1, 1).expand(-1, -1, *x.shape[2:]))  # noqa: E731
    else:
        index = expected_index_on(mesh, S, layout)
        take = lambda x: x.index_select(1, index)  # noqa: E731
    ql, kl, vl = (take(t).float().requires_grad_() for t in (q, k, v))
    sl = sinks.float().requires_grad_() if sinks is not None else None
    out = sequence_parallel_attention(ql, kl, vl, mesh=mesh, algorithm=algorithm, layout=layout, causal=case.get("causal", True),
                                      window=case.get("window"), chunk_size=case.get("chunk_size"), softcap=case.get("softcap"),
                                      sinks=sl, documents=documents, **extra)
    out.backward(take(dout).float())
    what = f"{algorithm} {layout} {case} {extra} rank {dist.get_rank()}"
    _close(out, take(out_ref), what + " out")
    for name, t, want in zip("qkv", (ql, kl, vl), grads_ref):
        _close(t.grad, take(want), f"{what} d{name}")
    if sl is not None:
        ds = sl.grad.double()
        dist.all_reduce(ds)  # each rank's share: the sinks' gradient over its rows (and heads)
        _close(ds, grads_ref[3], what + " dsinks")


def _algorithm_worker(rank, world, algorithm, mesh_spec, extras):
    mesh = make_mesh(mesh_spec)
    n = 0
    for layout in ("zigzag", "contiguous"):
        for i, case in enumerate(CASES):
            if case.get("documents") and layout != "zigzag":
                continue  # documents are sharded with the per-document zigzag
            for extra in extras:
                _run_case(mesh, algorithm, layout, case, 32, seed=100 + i, **extra)
                n += 1
    return n


@pytest.mark.parametrize(
    "algorithm, mesh_spec, extras",
    [
        ("ring", ("1d", 2), ({}, {"head_chunks": 2})),
        ("ring", ("1d", 4), ({}, {"inner_ring_size": 2})),
        ("allgather", ("1d", 4), ({}, {"head_chunks": 2})),
        ("ulysses", ("1d", 2), ({},)),
        ("2d", ("2d", ("hp", "cp"), (2, 2)), ({},)),
    ],
    ids=["ring-w2", "ring-w4-double", "allgather-w4", "ulysses-w2", "2d-2x2"],
)
def test_variants_match_reference(algorithm, mesh_spec, extras):
    world = mesh_spec[1] if mesh_spec[0] == "1d" else mesh_spec[2][0] * mesh_spec[2][1]
    counts = run_distributed(_algorithm_worker, world, algorithm, mesh_spec, extras)
    assert all(c == counts[0] and c > 0 for c in counts)


def test_local_attention_variants():
    from lightning_seqpar.attention import Attention, local_attention
    from lightning_seqpar.sharding.documents import PackedDocuments

    for i, case in enumerate(CASES):
        (q, k, v, dout, sinks), out_ref, grads_ref = _full_case(case, 32, seed=7 + i)
        ql, kl, vl = (t.float().requires_grad_() for t in (q, k, v))
        sl = sinks.float().requires_grad_() if sinks is not None else None
        docs = PackedDocuments.from_lengths(case["documents"]) if case.get("documents") else None
        kw = dict(window=case.get("window"), chunk_size=case.get("chunk_size"), softcap=case.get("softcap"), sinks=sl)
        if i % 2:
            out = local_attention(ql, kl, vl, causal=case.get("causal", True), documents=docs, **kw)
        else:
            out = Attention(causal=case.get("causal", True))(ql, kl, vl, docs, **kw)
        out.backward(dout.float())
        _close(out, out_ref, f"{case} out")
        for name, t, want in zip("qkv", (ql, kl, vl), grads_ref):
            _close(t.grad, want, f"{case} d{name}")
        if sl is not None:
            _close(sl.grad, grads_ref[3], f"{case} dsinks")


def test_sink_gradient_formula():
    """d s_h = -sum over rows of exp(s_h - lse') * (dout . out'), against autograd of an explicit softmax."""
    from lightning_seqpar.attention.variants import fold_sinks, sinks_grad

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, 7, generator=g, dtype=torch.float64)  # (B, H, S, Sk) scores
    vv = torch.randn(2, 7, 3, 4, generator=g, dtype=torch.float64)
    s = torch.randn(3, generator=g, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64)
    p = torch.softmax(torch.cat([x, s.view(1, -1, 1, 1).expand(2, -1, 5, 1)], -1), -1)[..., :-1]
    ref = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    (want,) = torch.autograd.grad(ref, s, dout)
    lse = torch.logsumexp(x, -1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(x, -1), vv)
    out2, lse2 = fold_sinks(out, lse, s)
    torch.testing.assert_close(out2, ref.detach())
    torch.testing.assert_close(sinks_grad(dout, out2, lse2, s), want)


def test_windowed_plan_skips_blocks():
    """With a window no wider than a chunk each chunk sees only itself and its predecessor; the
    contiguous ring stops after one hop, zigzag's needs every hop (Note [Windows, zigzag and the ring])."""
    from lightning_seqpar.attention.variants import Variant, VariantPlan

    W, s_local = 4, 64
    cpu = torch.device("cpu")
    for layout in ("zigzag", "contiguous"):
        full = VariantPlan(W, layout, s_local, None, Variant(True, 0, 0, 1.0), cpu)  # softcap only: every causal block
        win = VariantPlan(W, layout, s_local, None, Variant(True, 16), cpu)
        assert full.count() == (W * (2 * W + 1) if layout == "zigzag" else W * (W + 1) // 2)
        assert win.count() == (4 * W - 1 if layout == "zigzag" else 2 * W - 1)
        assert win.steps == (W if layout == "zigzag" else 2)
        assert full.steps == W
        huge = VariantPlan(W, layout, s_local, None, Variant(True, 10_000), cpu)
        assert huge.count() == full.count() and huge.steps == W


def _count_worker(rank, world, layout):
    from lightning_seqpar.attention import ring as ring_mod
    from lightning_seqpar.attention import sequence_parallel_attention
    from seqpar_testing import mesh_1d

    mesh = mesh_1d(world)
    q = torch.randn(1, 64 // world, 2, 8, requires_grad=True)
    calls = {}
    for name, window in (("causal-softcap", None), ("window", 8)):
        with mock.patch.object(ring_mod, "variant_block_forward", wraps=ring_mod.variant_block_forward) as fwd, \
                mock.patch.object(ring_mod, "variant_block_backward", wraps=ring_mod.variant_block_backward) as bwd:
            out = sequence_parallel_attention(q, q, q, mesh=mesh, layout=layout, window=window, softcap=30.0)
            out.sum().backward()
        calls[name] = (fwd.call_count, bwd.call_count)
    return calls


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_windowed_ring_calls_fewer_kernels(layout):
    W = 4
    per_rank = run_distributed(_count_worker, W, layout)
    full = sum(c["causal-softcap"][0] for c in per_rank)
    win = sum(c["window"][0] for c in per_rank)
    # S = 64: chunks of 8 (zigzag) or 16 (contiguous) >= window 8: each chunk sees itself and its predecessor
    assert win == (4 * W - 1 if layout == "zigzag" else 2 * W - 1), per_rank
    assert full == (W * (2 * W + 1) if layout == "zigzag" else W * (W + 1) // 2), per_rank
    assert all(c[name][0] == c[name][1] for c in per_rank for name in c)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(window=0), "window"),
        (dict(window=2.5), "window"),
        (dict(window=4, causal=False), "window"),
        (dict(softcap=0.0), "softcap"),
        (dict(softcap=float("inf")), "softcap"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(sinks=torch.zeros(3)), "sinks"),
        (dict(sinks=torch.zeros(4, 1)), "sinks"),
    ],
)
def test_bad_variant_arguments(kwargs, match):
    from lightning_seqpar.attention import local_attention

    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match=match):
        local_attention(q, q, q, **kwargs)


def _disagree(rank, world):
    from lightning_seqpar.attention import sequence_parallel_attention
    from seqpar_testing import mesh_1d

    q = torch.randn(1, 8, 2, 8)
    with pytest.raises(ValueError, match="different inputs: .*'window'"):
        sequence_parallel_attention(q, q, q, mesh=mesh_1d(world), window=3 + rank)
    return True


def test_ranks_must_agree_on_window():
    assert all(run_distributed(_disagree, 2))



@torch.library.custom_op("seqpar_test::grad_in_op", mutates_args=())
def _grad_in_op(x: torch.Tensor, lifted: bool) -> torch.Tensor:
    from lightning_seqpar.attention.masked import _autograd_below_dispatch

    with _autograd_below_dispatch() if lifted else torch.enable_grad():
        xr = x.detach().requires_grad_()
        return torch.autograd.grad((xr.sin() * 2).sum(), xr)[0]


def test_autograd_runs_inside_a_custom_op():
    """The GPU path differentiates FlexAttention (masked.flex_backward) inside ``seqpar::attn_bwd``,
    below the Autograd dispatch key, where ``torch.enable_grad`` alone records nothing (FlexAttention
    has no CPU backward, so the guard is tested on its own here and with FlexAttention in
    tests/test_attention_features_gpu.py)."""
    x = torch.randn(5, requires_grad=True)
    with pytest.raises(RuntimeError, match="does not require grad"):
        _grad_in_op(x, False)
    torch.testing.assert_close(_grad_in_op(x, True), 2 * x.detach().cos())


@torch.library.custom_op("seqpar_test::block_mask_in_op", mutates_args=())
def _block_mask_in_op(x: torch.Tensor, lifted: bool) -> torch.Tensor:
    from torch.nn.attention.flex_attention import BlockMask

    from lightning_seqpar.attention.masked import _functorch_usable

    kv_num = torch.ones(1, 1, 4, dtype=torch.int32)
    kv_idx = torch.arange(4, dtype=torch.int32).repeat(4, 1)[None, None].contiguous()
    with _functorch_usable() if lifted else contextlib.nullcontext():
        mask = BlockMask.from_kv_blocks(kv_num, kv_idx, None, None, 128, seq_lengths=(512, 512))
    return x + mask.q_num_blocks.sum()


def test_block_mask_builds_inside_the_op_under_selective_checkpointing():
    """Note [vmap inside the attention op]: under Selective Checkpoint++ the checkpoint's dispatch mode runs the
    attention op with functorch's keys excluded, and BlockMask's vmap failed there (4 x H200, gpt-oss shape)."""
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    op = torch.ops.seqpar_test.block_mask_in_op.default

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func == op else CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.ones(2, requires_grad=True)
    run = lambda lifted: checkpoint(lambda t: op(t * 2, lifted), x, use_reentrant=False,  # noqa: E731
                                    context_fn=partial(create_selective_checkpoint_contexts, policy))
    with pytest.raises(NotImplementedError, match="BatchedTensorImpl"):
        run(False)
    assert run(True).tolist() == [6.0, 6.0]  # 2 + 4 query blocks, one key block each

"""Sequence-parallel recurrent token mixers (lightning_seqpar.attention.recurrent): the one-device
chunked kernels against token-by-token recurrences, and the conv halo / state chains over W gloo
ranks (contiguous and zigzag) against the full sequence: outputs and every gradient."""

from __future__ import annotations

import functools

import pytest
import torch

from dist_utils import run_distributed
from seqpar_testing import expected_index, mesh_1d, record_p2p, take

from lightning_seqpar.attention.recurrent import (
    Recurrence,
    causal_conv1d,
    diagonal_recurrence,
    gated_delta_rule,
    gated_delta_rule_chunked,
    selective_scan,
    sequence_starts,
    ssd_scan,
)

ATOL, RTOL = 2e-6, 1e-5


# ----------------------------------------------------------------------------------------------
# token-by-token references (float64), written from the recurrences (Note [Linear recurrences ...])


def naive_delta(q, k, v, g, beta, scale=None):
    """S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, o_t = S_t^T q_t; l2-normalised q, k; GVA."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    B, T, H, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64)
    eye = torch.eye(Dk, dtype=torch.float64)
    outs = []
    for t in range(T):
        kt, bt = k[:, t], beta[:, t][..., None, None]
        A = g[:, t].exp()[..., None, None] * (eye - bt * kt[..., :, None] * kt[..., None, :])
        S = A @ S + bt * kt[..., :, None] * v[:, t][..., None, :]
        outs.append((S * q[:, t][..., :, None]).sum(-2))
    return torch.stack(outs, 1)


def naive_ssd(x, dt, A, Bm, C, D):
    x, dt, A, Bm, C, D = (t.double() for t in (x, dt, A, Bm, C, D))
    rep = x.shape[2] // Bm.shape[2]
    Bm, C = Bm.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)
    Bsz, T, H, P = x.shape
    S = torch.zeros(Bsz, H, Bm.shape[-1], P, dtype=torch.float64)
    outs = []
    for t in range(T):
        S = (dt[:, t] * A).exp()[..., None, None] * S + Bm[:, t][..., :, None] * (dt[:, t][..., None] * x[:, t])[..., None, :]
        outs.append((S * C[:, t][..., :, None]).sum(-2) + D[:, None] * x[:, t])
    return torch.stack(outs, 1)


def naive_conv(x, w, b, act):
    k = w.shape[1]
    xp = torch.nn.functional.pad(x.double(), (0, 0, k - 1, 0))
    out = sum(w[:, j].double() * xp[:, j:j + x.shape[1]] for j in range(k)) + (0 if b is None else b.double())
    return torch.nn.functional.silu(out) if act == "silu" else out


def delta_inputs(B=2, T=24, Hk=2, Hv=4, Dk=8, Dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(B, T, Hk, Dk), k=r(B, T, Hk, Dk), v=r(B, T, Hv, Dv), g=-torch.rand(B, T, Hv, generator=gen),
                beta=torch.rand(B, T, Hv, generator=gen))


def ssd_inputs(B=2, T=24, H=4, P=6, G=2, N=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(B, T, H, P), dt=torch.rand(B, T, H, generator=gen), A=-torch.rand(H, generator=gen) - 0.1,
                Bm=r(B, T, G, N), C=r(B, T, G, N), D=r(H))


def conv_inputs(B=2, T=24, C=6, k=4, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return dict(x=torch.randn(B, T, C, generator=gen), w=torch.randn(C, k, generator=gen), b=torch.randn(C, generator=gen))


def close(a, b, label):
    torch.testing.assert_close(a.double(), b.double(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{label}: {m}")


# ----------------------------------------------------------------------------------------------
# one device


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_delta_rule_matches_token_recurrence(chunk_size):
    x = delta_inputs(T=23)
    out = gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk_size)
    close(out, naive_delta(**x), f"chunk={chunk_size}")


def test_delta_rule_matches_transformers_qwen3_next():
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    x = delta_inputs(T=23)
    ref, _ = qn.torch_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=True)
    close(gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=8), ref, "vs transformers")


def test_delta_rule_state_in_and_out_compose():
    """Two halves with the state handed over give the whole sequence (the chain's invariant)."""
    x = delta_inputs(Hk=4, Hv=4, T=20)
    q = torch.nn.functional.normalize(x["q"], dim=-1, eps=0) * 8 ** -0.5
    k = torch.nn.functional.normalize(x["k"], dim=-1, eps=0)
    full, s_full = gated_delta_rule_chunked(q, k, x["v"], x["g"], x["beta"], chunk_size=6, kernel="torch")
    a, s_a = gated_delta_rule_chunked(q[:, :9], k[:, :9], x["v"][:, :9], x["g"][:, :9], x["beta"][:, :9], chunk_size=4)
    b, s_b = gated_delta_rule_chunked(q[:, 9:], k[:, 9:], x["v"][:, 9:], x["g"][:, 9:], x["beta"][:, 9:], initial_state=s_a,
                                      chunk_size=4)
    close(torch.cat([a, b], 1), full, "out")
    close(s_b, s_full, "final state")


@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_ssd_matches_token_recurrence(chunk_size):
    x = ssd_inputs(T=23)
    close(ssd_scan(x["x"], x["dt"], x["A"], x["Bm"], x["C"], x["D"], chunk_size=chunk_size), naive_ssd(**x), f"chunk={chunk_size}")


def test_ssd_matches_transformers_mamba2_scan():
    bamba = pytest.importorskip("transformers.models.bamba.modeling_bamba")
    x = ssd_inputs(T=23)
    ref = bamba.mamba2_chunk_scan(x["x"], x["dt"], x["A"], x["Bm"], x["C"], chunk_size=8, D=x["D"])
    close(ssd_scan(x["x"], x["dt"], x["A"], x["Bm"], x["C"], x["D"], chunk_size=8), ref, "vs transformers")


def test_conv_matches_reference():
    x = conv_inputs()
    close(causal_conv1d(x["x"], x["w"], x["b"], activation="silu"), naive_conv(x["x"], x["w"], x["b"], "silu"), "conv")


def test_kernels_do_not_depend_on_the_default_dtype():
    """torch.set_default_dtype(torch.float64) does not leak into the fp32 kernels (a float64 eye met fp32 tensors)."""
    d = delta_inputs()
    want = gated_delta_rule(**d, chunk_size=4)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        got = gated_delta_rule(**{n: t.double() for n, t in d.items()}, chunk_size=4)
    finally:
        torch.set_default_dtype(previous)
    torch.testing.assert_close(got.float(), want, atol=0, rtol=0)


def test_errors_name_the_argument():
    x = delta_inputs()
    cases = [
        (lambda: gated_delta_rule(x["q"], x["k"], x["v"][:, :, :3], x["g"], x["beta"]), "H_v a multiple of H_k"),
        (lambda: gated_delta_rule(x["q"], x["k"], x["v"], x["g"][..., :2], x["beta"]), "g must be"),
        (lambda: gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], layout="ring"), "layout="),
        (lambda: gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], kernel="cuda"), "kernel="),
        (lambda: causal_conv1d(torch.randn(1, 4, 3), torch.randn(2, 4)), "weight"),
        (lambda: causal_conv1d(torch.randn(1, 4, 3), torch.randn(3, 4), activation="gelu"), "activation="),
        (lambda: Recurrence(kernel="triton"), "kernel="),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


# ----------------------------------------------------------------------------------------------
# W gloo ranks, contiguous and zigzag


def _grads_of(fn, inputs, dout):
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items()}
    out = fn(**leaves)
    out.backward(dout.to(out.dtype))
    return out.detach(), {n: t.grad for n, t in leaves.items()}


def _check(label, local_fn, full_fn, inputs, token_inputs, dout, index, world_size, failures):
    ref_out, ref_grads = _grads_of(full_fn, inputs, dout)
    local = {n: (take(t, index) if n in token_inputs else t) for n, t in inputs.items()}
    out, grads = _grads_of(local_fn, local, take(dout, index))
    checks = [("out", out, take(ref_out, index))]
    for n, gr in grads.items():
        if n in token_inputs:
            checks.append((f"d{n}", gr, take(ref_grads[n], index)))
        else:  # parameters: per-rank gradients add up to the full one
            total = gr.clone()
            torch.distributed.all_reduce(total)
            checks.append((f"d{n}", total, ref_grads[n]))
    for name, got, want in checks:
        try:
            close(got, want, f"{label} {name}")
        except AssertionError as err:
            failures.append(str(err))


def _chain_worker(rank: int, world_size: int, layout: str) -> int:
    mesh = mesh_1d(world_size)
    T = 24
    index = expected_index(T, layout, world_size, rank)
    failures: list[str] = []
    d = delta_inputs(T=T)
    dout = torch.randn(2, T, 4, 6, generator=torch.Generator().manual_seed(5))
    for chunk in (4,):
        _check(f"delta W={world_size} {layout} chunk={chunk}",
               lambda **a: gated_delta_rule(**a, mesh=mesh, layout=layout, chunk_size=chunk),
               lambda **a: gated_delta_rule(**a, chunk_size=chunk), d, set(d), dout, index, world_size, failures)
    s = ssd_inputs(T=T)
    dout = torch.randn(2, T, 4, 6, generator=torch.Generator().manual_seed(6))
    _check(f"ssd W={world_size} {layout}",
           lambda x, dt, A, Bm, C, D: ssd_scan(x, dt, A, Bm, C, D, mesh=mesh, layout=layout, chunk_size=4),
           lambda x, dt, A, Bm, C, D: ssd_scan(x, dt, A, Bm, C, D, chunk_size=4), s, {"x", "dt", "Bm", "C"}, dout, index,
           world_size, failures)
    c = conv_inputs(T=T)
    dout = torch.randn(2, T, 6, generator=torch.Generator().manual_seed(7))
    _check(f"conv W={world_size} {layout}",
           lambda x, w, b: causal_conv1d(x, w, b, activation="silu", mesh=mesh, layout=layout),
           lambda x, w, b: causal_conv1d(x, w, b, activation="silu"), c, {"x"}, dout, index, world_size, failures)
    assert not failures, "\n".join(failures)
    return 3


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_chains_match_full_sequence(world_size, layout):
    assert run_distributed(_chain_worker, world_size, layout) == [3] * world_size


def _traffic_worker(rank: int, world_size: int, layout: str) -> list:
    import lightning_seqpar.attention.comm as comm

    mesh = mesh_1d(world_size)
    shapes = []
    original = comm.all_gather_into
    for T in (32, 64):
        d = {n: take(t, expected_index(T, layout, world_size, rank)).requires_grad_() for n, t in delta_inputs(T=T).items()}
        c = conv_inputs(T=T)
        x = take(c["x"], expected_index(T, layout, world_size, rank)).requires_grad_()
        gathers: list[tuple] = []
        comm.all_gather_into = lambda out, inp, group: (gathers.append(tuple(inp.shape)), original(out, inp, group))[1]
        try:
            with record_p2p() as (rec, ops):
                out = gated_delta_rule(**d, mesh=mesh, layout=layout, chunk_size=4)
                out.sum().backward()
                causal_conv1d(x, c["w"], c["b"], mesh=mesh, layout=layout).sum().backward()
        finally:
            comm.all_gather_into = original
        shapes.append((sorted(map(tuple, rec.sent)), sorted(map(tuple, rec.received)), gathers,
                       sorted(op for op in ops.ops if "send" not in op and "recv" not in op)))
    return shapes


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_communication_is_independent_of_the_sequence_length(layout):
    """The delta rule's states pass in one all-gather each way (Note [Parallel state passing across ranks]):
    every piece's [M | s] forward ([B, H_v, Dk, Dk + Dv] flattened), every piece's start gradient backward; the
    convolution's halos go point to point. Nothing depends on S."""
    W = 4
    results = run_distributed(_traffic_worker, W, layout)
    B, H, Dk, Dv = 2, 4, 8, 6
    P = 1 if layout == "contiguous" else 2
    halo = (2, 3, 6)  # [B, k-1, C]
    n_halo = W - 1 if layout == "contiguous" else 2 * W - 2  # pieces with a predecessor on another rank
    sent = [s for rank in results for s in rank[0][0]]
    assert sent.count(halo) == 2 * n_halo and len(sent) == 2 * n_halo  # forward halos + their gradients, nothing else
    for rank in results:
        assert rank[0][2] == [(P, B * H * Dk * (Dk + Dv)), (P, B, H, Dk, Dv)]  # forward [M | s], backward start gradients
        assert len(rank[0][3]) == 2, rank[0][3]  # the two all-gathers are the only collectives
        assert rank[0] == rank[1], "the communication at S=32 and S=64 differs"


# ----------------------------------------------------------------------------------------------
# packed documents (Note [Documents in a recurrence]): every document alone, concatenated


DOC_LENGTHS = [[5, 1, 11, 7], [2, 22]]  # S = 24: short documents leave pieces empty at W = 3, 4 (2W pieces each)


def _per_document(fn, token_names):
    """fn over every document of DOC_LENGTHS alone (no documents argument), outputs concatenated in place."""
    def full(**args):
        rows = []
        for b, lengths in enumerate(DOC_LENGTHS):
            outs, start = [], 0
            for n in lengths:
                part = {k: (t[b:b + 1, start:start + n] if k in token_names else t) for k, t in args.items()}
                outs.append(fn(**part))
                start += n
            rows.append(torch.cat(outs, dim=1))
        return torch.cat(rows)
    return full


def _check_documents(label, local_fn, full_fn, inputs, token_inputs, dout, documents, rank, failures):
    ref_out, ref_grads = _grads_of(full_fn, inputs, dout)
    local = {n: (documents.shard(t, rank) if n in token_inputs else t) for n, t in inputs.items()}
    out, grads = _grads_of(local_fn, local, documents.shard(dout, rank))
    checks = [("out", out, documents.shard(ref_out, rank))]
    for n, gr in grads.items():
        if n in token_inputs:
            checks.append((f"d{n}", gr, documents.shard(ref_grads[n], rank)))
        else:  # parameters: per-rank gradients add up to the full one
            total = gr.clone()
            torch.distributed.all_reduce(total)
            checks.append((f"d{n}", total, ref_grads[n]))
    for name, got, want in checks:
        # atol relative to the tensor's largest entry: the chunks (and so the fp32 rounding) of a document cut into
        # pieces are not those of the document alone (dt's gradient reaches 50 here; the reference's own chunkings
        # differ by 1e-5 among themselves)
        scale = max(1.0, float(want.abs().max()))
        try:
            torch.testing.assert_close(got.double(), want.double(), atol=ATOL * scale, rtol=RTOL,
                                       msg=lambda m, name=name: f"{label} {name}: {m}")
        except AssertionError as err:
            failures.append(str(err))


def _documents_worker(rank: int, world_size: int) -> int:
    from lightning_seqpar.sharding.documents import PackedDocuments

    mesh, layout, T = mesh_1d(world_size), "zigzag", 24
    docs = PackedDocuments.from_lengths(DOC_LENGTHS, world=world_size)
    failures: list[str] = []
    d = delta_inputs(T=T)
    dout = torch.randn(2, T, 4, 6, generator=torch.Generator().manual_seed(5))
    _check_documents(f"delta W={world_size}",
                     lambda **a: gated_delta_rule(**a, mesh=mesh, layout=layout, chunk_size=4, documents=docs),
                     _per_document(lambda **a: gated_delta_rule(**a, chunk_size=4), set(d)), d, set(d), dout, docs, rank,
                     failures)
    s = ssd_inputs(T=T)
    dout = torch.randn(2, T, 4, 6, generator=torch.Generator().manual_seed(6))
    tokens = {"x", "dt", "Bm", "C"}
    _check_documents(f"ssd W={world_size}",
                     lambda x, dt, A, Bm, C, D: ssd_scan(x, dt, A, Bm, C, D, mesh=mesh, layout=layout, chunk_size=4,
                                                         documents=docs),
                     _per_document(lambda x, dt, A, Bm, C, D: ssd_scan(x, dt, A, Bm, C, D, chunk_size=4), tokens), s, tokens,
                     dout, docs, rank, failures)
    c = conv_inputs(T=T)
    dout = torch.randn(2, T, 6, generator=torch.Generator().manual_seed(7))
    _check_documents(f"conv W={world_size}",
                     lambda x, w, b: causal_conv1d(x, w, b, activation="silu", mesh=mesh, layout=layout, documents=docs),
                     _per_document(lambda x, w, b: causal_conv1d(x, w, b, activation="silu"), {"x"}), c, {"x"}, dout, docs,
                     rank, failures)
    if world_size > 1:  # documents are sharded per document (zigzag); refused before any communication
        with pytest.raises(ValueError, match="layout='contiguous' must be 'zigzag'"):
            gated_delta_rule(**{n: docs.shard(t, rank) for n, t in d.items()}, mesh=mesh, layout="contiguous", documents=docs)
    assert not failures, "\n".join(failures)
    return 3


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_documents_reset_the_state_at_every_boundary(world_size):
    """Packed documents (per-document zigzag, the strategy's sharding): outputs and every gradient equal every
    document run alone, for the delta rule, the SSD scan and the conv; documents shorter than the 2W pieces too."""
    assert run_distributed(_documents_worker, world_size) == [3] * world_size


def test_documents_match_the_token_recurrence_on_one_device():
    """One device, one chunk holding several documents and a chunk boundary inside one: the float64 token loop."""
    from lightning_seqpar.sharding.documents import PackedDocuments

    docs = PackedDocuments.from_lengths(DOC_LENGTHS)
    d = delta_inputs(T=24)
    want = _per_document(naive_delta, set(d))(**d)
    for chunk in (1, 5, 64):
        close(gated_delta_rule(**d, chunk_size=chunk, documents=docs), want, f"delta chunk={chunk}")
    s = ssd_inputs(T=24)
    close(ssd_scan(s["x"], s["dt"], s["A"], s["Bm"], s["C"], s["D"], chunk_size=5, documents=docs),
          _per_document(naive_ssd, {"x", "dt", "Bm", "C"})(**s), "ssd")
    c = conv_inputs(T=24)
    close(causal_conv1d(c["x"], c["w"], c["b"], activation="silu", documents=docs),
          _per_document(lambda x, w, b: naive_conv(x, w, b, "silu"), {"x"})(**c), "conv")


def test_documents_errors_name_the_argument():
    from lightning_seqpar.sharding.documents import PackedDocuments

    d = delta_inputs(T=24)
    docs = PackedDocuments.from_lengths(DOC_LENGTHS)
    with pytest.raises(ValueError, match="kernel='fla' does not take packed documents"):
        gated_delta_rule(**d, kernel="fla", documents=docs)
    with pytest.raises(ValueError, match="documents were split for"):
        gated_delta_rule(**{n: t[:1] for n, t in d.items()}, documents=docs)
    with pytest.raises(ValueError, match="documents must be"):
        causal_conv1d(torch.randn(2, 24, 3), torch.randn(3, 4), documents=[[24], [24]])


def _documents_traffic_worker(rank: int, world_size: int) -> list:
    import lightning_seqpar.attention.comm as comm
    from lightning_seqpar.sharding.documents import PackedDocuments

    mesh = mesh_1d(world_size)
    shapes = []
    original = comm.all_gather_into
    for T in (32, 64):  # the same documents, twice as long
        docs = PackedDocuments.from_lengths([[T // 4, T // 2, T // 4], [T // 8, 7 * T // 8]], world=world_size)
        d = {n: docs.shard(t, rank).requires_grad_() for n, t in delta_inputs(T=T).items()}
        c = conv_inputs(T=T)
        x = docs.shard(c["x"], rank).requires_grad_()
        gathers: list[tuple] = []
        comm.all_gather_into = lambda out, inp, group: (gathers.append(tuple(inp.shape)), original(out, inp, group))[1]
        try:
            with record_p2p() as (rec, _):
                gated_delta_rule(**d, mesh=mesh, chunk_size=4, documents=docs).sum().backward()
                causal_conv1d(x, c["w"], c["b"], mesh=mesh, documents=docs).sum().backward()
        finally:
            comm.all_gather_into = original
        shapes.append((sorted(map(tuple, rec.sent)), sorted(map(tuple, rec.received)), gathers))
    return shapes


def test_documents_communication_is_one_state_per_document_and_independent_of_the_length():
    """Note [Parallel state passing with packed documents]: the delta rule's per-document states pass in one
    all-gather each way (every segment's [M | s] forward, its start gradient backward); the convolution's per-document
    histories go down the chain. Nothing depends on S."""
    W = 4
    results = run_distributed(_documents_traffic_worker, W)
    B, N, H, Dk, Dv = 2, 3, 4, 8, 6
    history = (B, N, 3, 6)  # [B, N, k-1, C]
    n = 2 * W - 2  # messages per direction along the zigzag chain
    sent = [s for rank in results for s in rank[0][0]]
    assert sum(s == history for s in sent) == 2 * n  # forward histories + their gradients
    assert len(sent) == 2 * n  # nothing else point to point
    for rank in results:
        # forward: every local segment's [M | s] (P = 2 pieces, flattened); backward: every segment's start gradient
        assert rank[0][2] == [(2, B * N * H * Dk * (Dk + Dv)), (2, B, N, H, Dk, Dv)], rank[0][2]
        assert rank[0] == rank[1], "the communication at S=32 and S=64 differs"


def _chain_switch_worker(rank: int, world_size: int) -> int:
    """SEQPAR_STATE_CHAIN=1 (the states down the chain, for comparisons) gives what the parallel forms give: the delta
    rule with packed documents, Mamba1's selective scan without."""
    import os

    from lightning_seqpar.sharding.documents import PackedDocuments

    mesh = mesh_1d(world_size)
    docs = PackedDocuments.from_lengths(DOC_LENGTHS, world=world_size)
    results = []
    for chain in ("0", "1"):
        os.environ["SEQPAR_STATE_CHAIN"] = chain
        try:
            got = []
            d = {n: docs.shard(t, rank).requires_grad_() for n, t in delta_inputs(T=24).items()}
            s = {n: (take(t, expected_index(24, "zigzag", world_size, rank)) if n in SELECTIVE_TOKENS else t).requires_grad_()
                 for n, t in selective_inputs(T=24).items()}
            for out, x in ((gated_delta_rule(**d, mesh=mesh, chunk_size=4, documents=docs), d), (_selective(mesh)(**s), s)):
                (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
                got += [out.detach()] + [x[n].grad for n in sorted(x)]
            results.append(got)
        finally:
            os.environ.pop("SEQPAR_STATE_CHAIN")
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    return 1


def _autocast_worker(rank: int, world_size: int) -> int:
    """Note [Recurrences in fp32 under autocast]: under torch.autocast (bf16) the recurrences give exactly what they
    give without it (fp32 inside), with packed documents and without, in parallel and down the chain."""
    from lightning_seqpar.sharding.documents import PackedDocuments

    mesh = mesh_1d(world_size) if world_size > 1 else None
    docs = PackedDocuments.from_lengths(DOC_LENGTHS, world=world_size)
    s = selective_inputs(T=24)
    calls = {
        "delta": (lambda d, **kw: gated_delta_rule(**d, mesh=mesh, chunk_size=4, **kw), delta_inputs(T=24)),
        "ssd": (lambda d, **kw: ssd_scan(d["x"], d["dt"], d["A"], d["Bm"], d["C"], d["D"], mesh=mesh, chunk_size=4, **kw),
                ssd_inputs(T=24)),
        "selective": (lambda d, **kw: _selective(mesh, "zigzag", kw.get("documents"))(**d), s),
    }
    for name, (fn, inputs) in calls.items():
        for kw in ({}, {"documents": docs}):
            got = []
            for autocast in (False, True):
                token = {n for n, t in inputs.items() if t.dim() >= 2 and t.shape[1] == 24}
                shard = (lambda t: docs.shard(t, rank)) if kw else (lambda t: take(t, expected_index(24, "zigzag", world_size, rank)))
                d = {n: (shard(t) if n in token else t).clone().requires_grad_() for n, t in inputs.items()}
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    out = fn(d, **kw)
                (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
                got.append([out.detach()] + [d[n].grad for n in sorted(d)])
            for a, b in zip(*got):
                torch.testing.assert_close(a, b, atol=0, rtol=0, msg=lambda m: f"{name} {sorted(kw)}: {m}")
    return 1


@pytest.mark.parametrize("world_size", [1, 2])
def test_recurrences_are_fp32_under_autocast(world_size):
    assert run_distributed(_autocast_worker, world_size) == [1] * world_size


def test_state_chain_switch_gives_the_same_results():
    assert run_distributed(_chain_switch_worker, 3) == [1] * 3


# ----------------------------------------------------------------------------------------------
# Mamba1's selective scan (Note [Mamba1's selective scan under sequence sharding])


def naive_selective(x, dt, A, Bm, C, D):
    """h_t = exp(dt_t A) h_{t-1} + (dt_t x_t) B_t per channel and state index, y_t = <h_t, C_t> + D x_t (float64)."""
    x, dt, A, Bm, C, D = (t.double() for t in (x, dt, A, Bm, C, D))
    rep = x.shape[2] // Bm.shape[2]
    Bm, C = Bm.repeat_interleave(rep, 2), C.repeat_interleave(rep, 2)  # (B, T, E, N)
    h = torch.zeros(x.shape[0], *A.shape, dtype=torch.float64)
    outs = []
    for t in range(x.shape[1]):
        h = (dt[:, t, :, None] * A).exp() * h + (dt[:, t] * x[:, t])[..., None] * Bm[:, t]
        outs.append((h * C[:, t]).sum(-1) + D * x[:, t])
    return torch.stack(outs, 1)


def selective_inputs(B=2, T=24, E=8, G=2, N=5, seed=3):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(B, T, E), dt=torch.rand(B, T, E, generator=gen), A=-torch.rand(E, N, generator=gen) * 2 - 0.1,
                Bm=r(B, T, G, N), C=r(B, T, G, N), D=r(E))


def _selective(mesh=None, layout="zigzag", documents=None, chunk_size=4):
    return lambda x, dt, A, Bm, C, D: selective_scan(x, dt, A, Bm, C, D, mesh=mesh, layout=layout, documents=documents,
                                                     chunk_size=chunk_size)


SELECTIVE_TOKENS = {"x", "dt", "Bm", "C"}


def test_selective_scan_matches_token_recurrence_and_transformers():
    s = selective_inputs(T=23)
    for chunk in (1, 5, 16, 64):
        close(_selective(chunk_size=chunk)(**s), naive_selective(**s), f"vs float64 recurrence, chunk={chunk}")
    mamba = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    one = selective_inputs(T=23, G=1)  # transformers' layout: x, dt [B, E, T], B, C [B, N, T]
    ref = mamba.mamba_selective_scan(one["x"].transpose(1, 2), one["dt"].transpose(1, 2), one["A"],
                                     one["Bm"][:, :, 0].transpose(1, 2), one["C"][:, :, 0].transpose(1, 2), D=one["D"])
    close(_selective()(**one), ref.transpose(1, 2), "vs transformers' mamba_selective_scan")


def test_selective_scan_errors_name_the_argument():
    s = selective_inputs()
    cases = [
        (lambda: selective_scan(s["x"], s["dt"][..., :3], s["A"], s["Bm"], s["C"]), "dt must be"),
        (lambda: selective_scan(s["x"], s["dt"], s["A"][:3], s["Bm"], s["C"]), "A must have shape"),
        (lambda: selective_scan(s["x"], s["dt"], s["A"], s["Bm"][:, :, :, :2], s["C"][:, :, :, :2]), "B and C must be"),
        (lambda: selective_scan(s["x"], s["dt"], s["A"], s["Bm"], s["C"], s["D"][:3]), "D must have shape"),
        (lambda: selective_scan(s["x"], s["dt"], s["A"], s["Bm"], s["C"], layout="ring"), "layout="),
        (lambda: selective_scan(s["x"], s["dt"], s["A"], s["Bm"], s["C"], chunk_size=0), "chunk_size must be"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def _selective_worker(rank: int, world_size: int) -> int:
    from lightning_seqpar.sharding.documents import PackedDocuments

    mesh, T = mesh_1d(world_size), 24
    failures: list[str] = []
    s = selective_inputs(T=T)
    dout = torch.randn(2, T, 8, generator=torch.Generator().manual_seed(8))
    for layout in ("contiguous", "zigzag"):
        _check(f"selective W={world_size} {layout}", _selective(mesh, layout), _selective(), s, SELECTIVE_TOKENS, dout,
               expected_index(T, layout, world_size, rank), world_size, failures)
    docs = PackedDocuments.from_lengths(DOC_LENGTHS, world=world_size)
    _check_documents(f"selective W={world_size} documents", _selective(mesh, "zigzag", docs),
                     _per_document(_selective(), SELECTIVE_TOKENS), s, SELECTIVE_TOKENS, dout, docs, rank, failures)
    assert not failures, "\n".join(failures)
    return 3


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_selective_scan_chains_match_full_sequence(world_size):
    """Contiguous, zigzag and packed documents (per-document zigzag; documents shorter than a piece): the output
    and the gradient of every input (x, dt, A, B, C, D) against the whole sequence on one device."""
    assert run_distributed(_selective_worker, world_size) == [3] * world_size


def test_selective_scan_documents_match_the_token_recurrence_on_one_device():
    from lightning_seqpar.sharding.documents import PackedDocuments

    s = selective_inputs(T=24)
    docs = PackedDocuments.from_lengths(DOC_LENGTHS)
    for chunk in (1, 5, 64):  # chunks holding several documents, documents spanning chunks
        close(_selective(documents=docs, chunk_size=chunk)(**s), _per_document(naive_selective, SELECTIVE_TOKENS)(**s),
              f"documents, chunk={chunk}")


def _selective_traffic_worker(rank: int, world_size: int) -> list:
    import lightning_seqpar.attention.comm as comm
    from lightning_seqpar.sharding.documents import PackedDocuments

    mesh = mesh_1d(world_size)
    shapes = []
    gather, scatter = comm.all_gather_into, comm.reduce_scatter_into
    for T in (36, 72):  # divisible by 2W = 6 (documents)
        docs = PackedDocuments.from_lengths([[T // 4, 3 * T // 4], [T]], world=world_size)
        plain = {n: (take(t, expected_index(T, "zigzag", world_size, rank)) if n in SELECTIVE_TOKENS else t).requires_grad_()
                 for n, t in selective_inputs(T=T).items()}
        packed = {n: (docs.shard(t, rank) if n in SELECTIVE_TOKENS else t).requires_grad_() for n, t in selective_inputs(T=T).items()}
        collectives: list[tuple] = []
        comm.all_gather_into = lambda out, inp, group: (collectives.append(("gather", tuple(inp.shape))), gather(out, inp, group))[1]
        comm.reduce_scatter_into = lambda out, inp, group: (collectives.append(("scatter", tuple(out.shape))),
                                                                 scatter(out, inp, group))[1]
        try:
            with record_p2p() as (plain_rec, _):
                _selective(mesh)(**plain).sum().backward()
            with record_p2p() as (packed_rec, _):
                _selective(mesh, documents=docs)(**packed).sum().backward()
        finally:
            comm.all_gather_into, comm.reduce_scatter_into = gather, scatter
        shapes.append((sorted(map(tuple, plain_rec.sent)), collectives, sorted(map(tuple, packed_rec.sent))))
    return shapes


def test_selective_scan_communication_is_one_state_per_hop():
    """Without documents (Note [Parallel state passing for diagonal recurrences]): every piece's (exp G, s) in one
    all-gather forward ([P, 2, B, E, N]), their gradients in one reduce-scatter backward, nothing point to point; with
    documents one [B, N, E, N] state per hop down the chain, 2W - 2 hops a direction (zigzag). Nothing depends on S."""
    W = 3
    results = run_distributed(_selective_traffic_worker, W)
    for rank in results:
        plain_sent, collectives, packed_sent = rank[0]
        assert plain_sent == []
        assert collectives == [("gather", (2, 2, 2, 8, 5)), ("scatter", (2, 2, 2, 8, 5))], collectives
        assert rank[0] == rank[1], "the communication at S=36 and S=72 differs"
    sent = [s for rank in results for s in rank[0][2]]
    assert sent == [(2, 2, 8, 5)] * (2 * (2 * W - 2))  # [B, docs, E, N] states


# a decay per key dimension (Kimi Delta Attention; Note [Chunked gated recurrences])


def naive_kda(q, k, v, g, beta):
    """S_t = Diag(exp(g_t)) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T (g_t in R^Dk), o_t = S_t^T q_t (float64)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    B, T, H, Dk = q.shape
    S = torch.zeros(B, H, Dk, v.shape[-1], dtype=torch.float64)
    outs = []
    for t in range(T):
        S = g[:, t].exp()[..., None] * S  # decay row d of the state by exp(g_t[d])
        S = S + beta[:, t][..., None, None] * k[:, t][..., :, None] * (v[:, t] - (S * k[:, t][..., :, None]).sum(-2))[..., None, :]
        outs.append((S * q[:, t][..., :, None]).sum(-2))
    return torch.stack(outs, 1)


def kda_inputs(B=2, T=24, H=3, Dk=8, Dv=6, seed=3):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(q=r(B, T, H, Dk), k=r(B, T, H, Dk), v=r(B, T, H, Dv), g=-torch.rand(B, T, H, Dk, generator=gen),
                beta=torch.rand(B, T, H, generator=gen))


@pytest.mark.parametrize("chunk_size", [1, 5, 64])
def test_per_dimension_decay_matches_token_recurrence(chunk_size):
    x = kda_inputs(T=23)
    close(gated_delta_rule(**x, chunk_size=chunk_size), naive_kda(**x), f"chunk={chunk_size}")
    from lightning_seqpar.sharding.documents import PackedDocuments

    docs = PackedDocuments.from_lengths(DOC_LENGTHS)
    x = kda_inputs(T=24)
    close(gated_delta_rule(**x, chunk_size=chunk_size, documents=docs), _per_document(naive_kda, set(x))(**x),
          f"documents chunk={chunk_size}")


def test_per_dimension_decay_matches_transformers_kimi_linear():
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    x = kda_inputs(T=23)
    ref, _ = kimi.recurrent_kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], None, False,
                                                 use_qk_l2norm_in_kernel=True)
    close(gated_delta_rule(**x, chunk_size=8), ref, "vs transformers")
    with pytest.raises(ValueError, match=r"kernel='fla' does not take a decay per key dimension"):
        gated_delta_rule(**x, kernel="fla")
    with pytest.raises(ValueError, match=r"g must be a floating-point tensor of shape \(2, 23, 3, 8\)"):
        gated_delta_rule(**{**x, "g": x["g"][..., :4]})


def _kda_worker(rank: int, world_size: int) -> int:
    from lightning_seqpar.sharding.documents import PackedDocuments

    mesh, T = mesh_1d(world_size), 24
    failures: list[str] = []
    x = kda_inputs(T=T)
    dout = torch.randn(2, T, 3, 6, generator=torch.Generator().manual_seed(8))
    _check(f"kda W={world_size} contiguous", lambda **a: gated_delta_rule(**a, mesh=mesh, layout="contiguous", chunk_size=4),
           lambda **a: gated_delta_rule(**a, chunk_size=4), x, set(x), dout, expected_index(T, "contiguous", world_size, rank),
           world_size, failures)
    docs = PackedDocuments.from_lengths(DOC_LENGTHS, world=world_size)
    _check_documents(f"kda W={world_size} documents",
                     lambda **a: gated_delta_rule(**a, mesh=mesh, layout="zigzag", chunk_size=4, documents=docs),
                     _per_document(lambda **a: gated_delta_rule(**a, chunk_size=4), set(x)), x, set(x), dout, docs, rank,
                     failures)
    assert not failures, "\n".join(failures)
    return 2


@pytest.mark.parametrize("world_size", [2, 3])
def test_per_dimension_decay_chain_matches_full_sequence(world_size):
    """The state chain with a decay per key dimension: contiguous, and packed documents (zigzag), outputs and every
    gradient against the full sequence / every document alone."""
    assert run_distributed(_kda_worker, world_size) == [2] * world_size


# ----------------------------------------------------------------------------------------------
# a diagonal linear recurrence (RecurrentGemma's RG-LRU; Note [Diagonal linear recurrences under sequence sharding])


def naive_diagonal(log_a, u):
    """h_t = exp(log_a_t) h_{t-1} + u_t per channel (float64)."""
    h, outs = torch.zeros(u.shape[0], u.shape[2], dtype=torch.float64), []
    for t in range(u.shape[1]):
        h = log_a[:, t].double().exp() * h + u[:, t].double()
        outs.append(h)
    return torch.stack(outs, 1)


def diagonal_inputs(B=2, T=24, E=6, seed=4):
    gen = torch.Generator().manual_seed(seed)
    return dict(log_a=-torch.rand(B, T, E, generator=gen) * 0.9, u=torch.randn(B, T, E, generator=gen))


def test_diagonal_recurrence_matches_token_recurrence_and_transformers_rnn_scan():
    x = diagonal_inputs(T=23)
    for chunk in (1, 5, 16, 64):
        close(diagonal_recurrence(**x, chunk_size=chunk), naive_diagonal(**x), f"chunk={chunk}")
    from lightning_seqpar.sharding.documents import PackedDocuments

    docs = PackedDocuments.from_lengths(DOC_LENGTHS)
    x = diagonal_inputs(T=24)
    close(diagonal_recurrence(**x, chunk_size=5, documents=docs), _per_document(naive_diagonal, set(x))(**x), "documents")
    rg = pytest.importorskip("transformers.models.recurrent_gemma.modeling_recurrent_gemma")
    reset = torch.zeros(2, 24, 1, dtype=torch.bool)
    reset[:, 0] = True
    ref, _ = rg.RecurrentGemmaRglru._rnn_scan(None, x["u"], x["log_a"].exp(), reset, None)
    close(diagonal_recurrence(**x), ref, "vs transformers' _rnn_scan")
    with pytest.raises(ValueError, match=r"log_a must be a floating-point tensor of shape \(2, 24, 6\)"):
        diagonal_recurrence(x["log_a"][:, :3], x["u"])
    with pytest.raises(ValueError, match="chunk_size must be"):
        diagonal_recurrence(**x, chunk_size=0)


def _diagonal_worker(rank: int, world_size: int) -> int:
    from lightning_seqpar.sharding.documents import PackedDocuments

    mesh, T = mesh_1d(world_size), 24
    failures: list[str] = []
    x = diagonal_inputs(T=T)
    dout = torch.randn(2, T, 6, generator=torch.Generator().manual_seed(9))
    for layout in ("contiguous", "zigzag"):
        local = functools.partial(diagonal_recurrence, mesh=mesh, layout=layout, chunk_size=4)
        _check(f"diagonal W={world_size} {layout}", local,
               lambda **a: diagonal_recurrence(**a, chunk_size=4), x, set(x), dout, expected_index(T, layout, world_size, rank),
               world_size, failures)
        starts = sequence_starts(2, T // world_size, mesh=mesh, layout=layout)
        assert starts.sum() == (2 if rank == 0 else 0) and bool(starts[:, 0].all()) == (rank == 0)
    docs = PackedDocuments.from_lengths(DOC_LENGTHS, world=world_size)
    _check_documents(f"diagonal W={world_size} documents",
                     lambda **a: diagonal_recurrence(**a, mesh=mesh, layout="zigzag", documents=docs),
                     _per_document(lambda **a: diagonal_recurrence(**a), set(x)), x, set(x), dout, docs, rank, failures)
    want = docs.shard(docs.position_ids(), rank) == 0  # the documents' first tokens held here
    assert torch.equal(sequence_starts(2, T // world_size, mesh=mesh, documents=docs), want)
    assert not failures, "\n".join(failures)
    return 3


@pytest.mark.parametrize("world_size", [2, 3])
def test_diagonal_recurrence_chains_match_full_sequence(world_size):
    """Contiguous, zigzag and packed documents: the output and both gradients against the whole sequence / every
    document alone; sequence_starts marks the zero-state tokens held by each rank."""
    assert run_distributed(_diagonal_worker, world_size) == [3] * world_size

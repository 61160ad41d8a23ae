"""Packed documents: attention never crosses a document boundary, and ranks get equal work.

The reference runs every document ALONE (float64 explicit softmax on that document's q, k, v
only) and concatenates; gradients are those of the sum over documents. Every algorithm (ring,
double ring, all-gather, Ulysses, 2D, and the gathered-K/V entry point), causal and not, MHA /
GQA / MQA / 3 heads, must match it on every rank's shard in fp32 (atol 2e-6, rtol 1e-5) for
documents shorter than a shard piece, spanning several ranks, and one token long — with no
NaN anywhere.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from seqpar_testing import make_mesh, mesh_coords, reference_attention

SEQ_LEN = 48  # divisible by 2 * W for W = 1..4
# per sample: document lengths summing to SEQ_LEN
LENGTHS = (
    (5, 1, 30, 1, 11),  # one-token documents, one spanning every rank, short ones
    (2, 3, 1, 1, 17, 24),
)
ONE_TOKEN = ((1,) * SEQ_LEN, (48,))  # all one-token documents; one document (= plain causal attention)
HEADS = ((4, 4, 8), (4, 2, 8), (4, 1, 8), (3, 3, 4))


def _per_document_reference(q, k, v, grad_out, lengths, causal: bool, scale=None):
    """Each document alone (float64): out and dq/dk/dv of the full sequence."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    outs = []
    for b, lens in enumerate(lengths):
        start, pieces = 0, []
        for n in lens:
            sl = slice(start, start + n)
            pieces.append(reference_attention(q[b : b + 1, sl], k[b : b + 1, sl], v[b : b + 1, sl], causal=causal, scale=scale))
            start += n
        outs.append(torch.cat(pieces, dim=1))
    out = torch.cat(outs)
    out.backward(grad_out.double())
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _case(lengths, h_q, h_kv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    B = len(lengths)
    q, k, v, g = (torch.randn(B, SEQ_LEN, h, d, generator=gen) for h in (h_q, h_kv, h_kv, h_q))
    return q, k, v, g


def _doc_worker(rank: int, world_size: int, algorithm: str, spec: tuple, inner: int | None, lengths_sets: tuple, entry: str) -> int:
    from lightning_seqpar.attention import gathered_kv_attention, sequence_parallel_attention
    from lightning_seqpar.sharding.documents import PackedDocuments

    mesh = make_mesh(spec)
    hp, hp_rank, cp, cp_rank = mesh_coords(mesh)
    if algorithm == "ulysses":  # 1-D mesh: documents split over all its ranks
        doc_world, doc_rank, hp_split, hp_at = mesh.size(), mesh.get_local_rank(), 1, 0
    else:
        doc_world, doc_rank, hp_split, hp_at = cp, cp_rank, hp, hp_rank
    failures, checked = [], 0
    for lengths in lengths_sets:
        docs = PackedDocuments.from_lengths(lengths, world=doc_world)
        for causal in (True, False):
            for seed, (h_q, h_kv, d) in enumerate(HEADS):
                if algorithm in ("ulysses", "2d") and h_q % (mesh.size() if algorithm == "ulysses" else hp):
                    continue
                q, k, v, g = _case(lengths, h_q, h_kv, d, seed)
                ref = _per_document_reference(q, k, v, g, lengths, causal)

                def shard(x):
                    return docs.shard(x, doc_rank, hp=hp_split, hp_rank=hp_at)

                ql, kl, vl = (shard(t).requires_grad_() for t in (q, k, v))
                if entry == "gathered":  # K/V of the whole sequence in rank order, as an all-gather gives
                    kf, vf = (torch.cat([docs.shard(t, r) for r in range(doc_world)], dim=1).requires_grad_() for t in (k, v))
                    out = gathered_kv_attention(ql, kf, vf, mesh=mesh, causal=causal, documents=docs)
                    out.backward(shard(g))
                    dk_sum, dv_sum = kf.grad.clone(), vf.grad.clone()  # each shard's gradient: summed over ranks' queries
                    torch.distributed.all_reduce(dk_sum)
                    torch.distributed.all_reduce(dv_sum)
                    got_dk, got_dv = dk_sum.chunk(doc_world, dim=1)[doc_rank], dv_sum.chunk(doc_world, dim=1)[doc_rank]
                    got = {"out": out, "dq": ql.grad, "dk": got_dk, "dv": got_dv}
                else:
                    out = sequence_parallel_attention(ql, kl, vl, mesh=mesh, algorithm=algorithm, causal=causal, documents=docs,
                                                      inner_ring_size=inner)
                    out.backward(shard(g))
                    got = {"out": out, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
                label = f"{algorithm}/{entry} mesh={spec} inner={inner} rank={rank} lengths={lengths} causal={causal} heads={h_q}/{h_kv}"
                for name, value in got.items():
                    value = value.detach()
                    if not torch.isfinite(value).all():
                        failures.append(f"{label}: {name} not finite")
                        continue
                    try:
                        torch.testing.assert_close(value, shard(ref[name]).to(value.dtype), atol=2e-6, rtol=1e-5)
                    except AssertionError as err:
                        failures.append(f"{label}: {name}: {str(err).splitlines()[:4]}")
                checked += 1
    assert not failures, "\n".join(failures[:20])
    return checked


CONFIGS = [
    ("ring", ("1d", 1), None, "op"),
    ("ring", ("1d", 2), None, "op"),
    ("ring", ("1d", 3), None, "op"),
    ("ring", ("1d", 4), None, "op"),
    ("ring", ("1d", 4), 2, "op"),  # double ring
    ("allgather", ("1d", 2), None, "op"),
    ("allgather", ("1d", 3), None, "op"),
    ("allgather", ("1d", 4), None, "op"),
    ("allgather", ("1d", 2), None, "gathered"),
    ("allgather", ("1d", 4), None, "gathered"),
    ("ulysses", ("1d", 2), None, "op"),
    ("ulysses", ("1d", 4), None, "op"),
    ("2d", ("2d", ("hp", "cp"), (2, 2)), None, "op"),
    ("2d", ("2d", ("cp", "hp"), (2, 2)), 1, "op"),
    ("2d", ("2d", ("hp", "cp"), (4, 1)), None, "op"),  # pure head parallelism on a 2-D mesh
]


@pytest.mark.parametrize("algorithm,spec,inner,entry", CONFIGS, ids=[f"{a}-{s}-{i}-{e}" for a, s, i, e in CONFIGS])
def test_documents_match_each_document_alone(algorithm, spec, inner, entry):
    world = spec[1] if spec[0] == "1d" else 4
    checked = run_distributed(_doc_worker, world, algorithm, spec, inner, (LENGTHS,), entry)
    assert min(checked) > 0


def test_one_token_documents_and_single_document():
    """All one-token documents (each token sees only itself) and one document (= plain causal attention)."""
    checked = run_distributed(_doc_worker, 4, "ring", ("1d", 4), None, (ONE_TOKEN,), "op")
    assert min(checked) > 0


def test_local_attention_documents():
    from lightning_seqpar.attention import local_attention
    from lightning_seqpar.sharding.documents import PackedDocuments

    docs = PackedDocuments.from_lengths(LENGTHS)
    for causal in (True, False):
        q, k, v, g = _case(LENGTHS, 4, 2, 8, 0)
        ref = _per_document_reference(q, k, v, g, LENGTHS, causal)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = local_attention(q, k, v, causal=causal, documents=docs)
        out.backward(g)
        for name, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
            torch.testing.assert_close(got.detach(), ref[name].float(), atol=2e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------------------------------------- sharding


def _causal_pairs(index: torch.Tensor, lengths) -> int:
    """(query, key) pairs a rank computes: sum over its tokens of (position in document + 1)."""
    starts = torch.cumsum(torch.tensor((0, *lengths[:-1])), 0)
    doc = torch.searchsorted(torch.cumsum(torch.tensor(lengths), 0), index, right=True)
    return int((index - starts[doc] + 1).sum())


@pytest.mark.parametrize("world", [2, 3, 4])
def test_per_document_zigzag_balances_work(world):
    """Per-document zigzag: every rank computes the same causal work (up to piece rounding), where
    the plain zigzag of the packed sequence is far off on a skewed mix of documents."""
    from lightning_seqpar.sharding.documents import PackedDocuments

    S = 2 * world * 256
    lengths = (S // 2, *([16] * (S // 2 // 16)))  # one long document, then many short ones
    docs = PackedDocuments.from_lengths([lengths], world=world)
    ours = [_causal_pairs(docs.index(r)[0], lengths) for r in range(world)]
    chunk = S // (2 * world)
    plain = [_causal_pairs(torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (r, 2 * world - 1 - r)]), lengths)
             for r in range(world)]
    assert max(ours) / min(ours) < 1.01, ours
    assert max(plain) / min(plain) > 2.0, plain  # what per-document balance fixes


def test_sharding_is_a_partition_with_equal_halves():
    from lightning_seqpar.sharding.documents import PackedDocuments

    for world in (1, 2, 3, 4):
        docs = PackedDocuments.from_lengths(LENGTHS, world=world)
        idx = [docs.index(r) for r in range(world)]
        for b in range(len(LENGTHS)):
            allpos = torch.cat([i[b] for i in idx])
            assert torch.equal(allpos.sort().values, torch.arange(SEQ_LEN))
        assert all(i.shape == (len(LENGTHS), SEQ_LEN // world) for i in idx)
        assert (docs.pieces.sum(1) == SEQ_LEN // docs.num_pieces).all()  # every piece index gets S / P tokens per sample
        x = torch.randn(len(LENGTHS), SEQ_LEN, 3)
        assert torch.equal(docs.unshard([docs.shard(x, r) for r in range(world)]), x)


def test_from_document_ids_and_position_ids():
    from lightning_seqpar.sharding.documents import PackedDocuments

    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [7, 7, 7, 7, 7, 7, 7, 7]])
    a = PackedDocuments.from_document_ids(ids, world=2)
    assert a.lengths.tolist() == [[3, 2, 3], [8, 0, 0]]
    pos = a.position_ids()
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], list(range(8))]
    b = PackedDocuments.from_position_ids(pos, world=2)
    assert torch.equal(a.pieces, b.pieces)


@pytest.mark.parametrize("bad,match", [
    (dict(lengths=[[3, 4]], world=2), "divisible by 2 \\* world"),
    (dict(lengths=[[4, 4], [7, 2]], world=1), "sum to the same"),
    (dict(lengths=[[4, -4, 8]], world=1), ">= 0"),
    (dict(lengths=[[4]], world=0), "world must be a positive int"),
])
def test_bad_lengths_raise(bad, match):
    from lightning_seqpar.sharding.documents import PackedDocuments

    with pytest.raises(ValueError, match=match):
        PackedDocuments.from_lengths(bad["lengths"], world=bad["world"])


def test_documents_that_do_not_fit_raise_before_communication():
    from lightning_seqpar.attention import local_attention
    from lightning_seqpar.sharding.documents import PackedDocuments

    q = torch.randn(2, SEQ_LEN, 4, 8)
    with pytest.raises(ValueError, match="were split for"):
        local_attention(q, q, q, documents=PackedDocuments.from_lengths(LENGTHS, world=2))
    with pytest.raises(ValueError, match="PackedDocuments"):
        local_attention(q, q, q, documents=torch.ones(3))


# ------------------------------------------------------------------------------------------ Note [Per-call state]


class _Block(torch.nn.Module):
    """q, k, v projections around an ``Attention`` module: a block for activation checkpointing."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        from lightning_seqpar.attention import Attention

        self.qkv, self.heads, self.attention = torch.nn.Linear(d, 3 * d), heads, Attention(causal=True)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, self.heads, -1)).unbind(2)  # (B, S, H, D) each
        return self.attention(q, k, v).flatten(2)


@pytest.mark.parametrize("mode", ["full", "selective++"])
def test_checkpoint_recomputes_with_the_forwards_documents(mode):
    """The recomputation of a checkpointed block masks by the documents of its forward even when backward
    runs in another thread (a GPU's autograd threads), where the context has no documents."""
    import threading

    from lightning_seqpar.parallel.activation_checkpointing import checkpoint_block
    from lightning_seqpar.sharding.documents import PackedDocuments, current_documents, packed_documents

    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(2, 16, 8)
    documents = PackedDocuments.from_lengths([[3, 13], [7, 9]])

    def grads(model, backward_in_thread: bool):
        model.zero_grad()
        with packed_documents(documents):
            out = model(x)
        assert current_documents() is None  # restored on exit
        loss = (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()
        if backward_in_thread:
            thread = threading.Thread(target=loss.backward)
            thread.start()
            thread.join()
        else:
            loss.backward()
        return out.detach(), [p.grad.clone() for p in model.parameters()]

    ref_out, ref_grads = grads(block, False)
    checkpointed = checkpoint_block(block, mode)
    for in_thread in (False, True):
        out, got = grads(checkpointed, in_thread)
        torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-5)
        for g, r in zip(got, ref_grads):
            torch.testing.assert_close(g, r, atol=2e-6, rtol=1e-5)
    # the test sees the difference: torch's plain checkpoint recomputes without the documents in that thread
    from torch.utils.checkpoint import checkpoint

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = block

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    _, plain = grads(Plain(), True)
    assert not all(torch.allclose(g, r, atol=1e-4) for g, r in zip(plain, ref_grads))


def test_documents_are_per_thread_and_scoped():
    import threading

    from lightning_seqpar.sharding.documents import PackedDocuments, current_documents, packed_documents, set_current_documents

    mine, theirs = PackedDocuments.from_lengths([[4, 4]]), PackedDocuments.from_lengths([[2, 6]])
    seen: dict[str, object] = {}
    ready, done = threading.Event(), threading.Event()

    def other():
        with packed_documents(theirs):
            ready.set()
            done.wait(10)
            seen["inside"] = current_documents()
        seen["after"] = current_documents()

    thread = threading.Thread(target=other)
    with packed_documents(mine):
        thread.start()
        ready.wait(10)
        seen["main"] = current_documents()  # the other thread's documents are not ours
        done.set()
        thread.join()
        with packed_documents(None):
            assert current_documents() is None
        assert current_documents() is mine
    assert seen == {"inside": theirs, "after": None, "main": mine}
    assert current_documents() is None
    set_current_documents(mine)
    assert current_documents() is mine
    set_current_documents(None)
    with pytest.raises(ValueError, match="PackedDocuments or None"):
        set_current_documents([[4, 4]])  # type: ignore[arg-type]

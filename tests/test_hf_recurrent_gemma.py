"""transformers' RecurrentGemma (Griffin: RG-LRU recurrent blocks + local attention; a tiny fp32 config) with its
recurrent blocks replaced by lightning_seqpar.hf.hybrid's SeqparRecurrentGemmaRecurrentBlock and its attention by
"seqpar" (ring), sharded over W gloo ranks: logits, loss and every gradient against the unmodified model on one
device; packed documents against every document alone (Note [Diagonal linear recurrences under sequence sharding])."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_distributed
from hf_testing import (
    build_eager,
    run_unmodified,
    shard_case,
    sharded_failures,
    with_twins,
)
from seqpar_testing import mesh_1d

transformers = pytest.importorskip("transformers")

SEQ, BATCH, VOCAB = 24, 2, 61
ATOL = 1e-5
LENGTHS = ((5, 1, 11, 7), (2, 22))  # packed documents of SEQ tokens: some shorter than a piece at W = 4


def build():
    """Two RG-LRU blocks and one local-attention layer (window 6 < SEQ), every parameter non-trivial."""
    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, lru_width=32, attention_window_size=6, conv1d_width=4,
        block_types=["recurrent", "attention", "recurrent"], logits_soft_cap=30.0)
    return build_eager(config)


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def test_replacement_keeps_the_state_dict_and_is_exact_on_one_device():
    from lightning_seqpar.hf.support import find_token_mixers
    from lightning_seqpar.hf.hybrid import (
        SeqparRecurrentGemmaRecurrentBlock,
        apply_hf_hybrid,
    )

    model = build()
    assert find_token_mixers(model) == []  # the recurrent blocks have a twin; the Mlp / DecoderLayer names are no mixers
    ids, labels = data()
    twin = copy.deepcopy(model)  # before the reference runs: transformers' RG-LRU keeps its last state on the module
    ref_logits, _, ref_grads = run_unmodified(model, ids, labels)
    assert apply_hf_hybrid(twin) == 2
    blocks = [m for m in twin.modules() if isinstance(m, SeqparRecurrentGemmaRecurrentBlock)]
    assert [b.layer_idx for b in blocks] == [0, 2]  # from the module path (the transformers block keeps no index)
    assert list(twin.state_dict()) == list(model.state_dict())
    assert find_token_mixers(twin) == []
    logits, _, grads = run_unmodified(twin, ids, labels)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=1e-5)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, atol=ATOL, rtol=1e-5, msg=lambda m, n=n: f"d{n}: {m}")


def test_resets_caches_and_packed_kwargs_are_refused_by_name():
    """position_ids restarting at 0 without the batch's documents (transformers would reset the RG-LRU there, the
    chain would not), a cache, packed-document kwargs and padding: ValueError naming each."""
    from lightning_seqpar.sharding.documents import PackedDocuments, packed_documents
    from lightning_seqpar.hf.hybrid import apply_hf_hybrid

    model = build()
    apply_hf_hybrid(model)
    block = model.model.layers[0].temporal_block
    x = torch.randn(1, 8, 32)
    restart = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    with pytest.raises(ValueError, match=r"layer 0\).*position_ids == 0 .* not carried between ranks.*document_ids"):
        block(x, position_ids=restart)
    # documents that do not start where the positions restart
    with pytest.raises(ValueError, match=r"position_ids == 0"), packed_documents(PackedDocuments.from_lengths([[4, 4]])):
        block(x, position_ids=restart)
    with pytest.raises(ValueError, match=r"position_ids \[B, 8\] .* are required"):
        block(x, position_ids=None)
    with pytest.raises(ValueError, match="cache"):
        block(x, position_ids=torch.arange(8)[None], cache=object())
    with pytest.raises(ValueError, match="cu_seq_lens_q=.*document_ids"):
        block(x, position_ids=torch.arange(8)[None], cu_seq_lens_q=torch.tensor([0, 3, 8]))
    with pytest.raises(ValueError, match="padding"):
        block(x, position_ids=torch.arange(8)[None], attention_mask=torch.tensor([[1] * 6 + [0] * 2]))
    with packed_documents(PackedDocuments.from_position_ids(restart)):  # the same positions with their documents: exact
        out, _ = block(x, position_ids=restart)
    ref = torch.cat([block(part, position_ids=torch.arange(part.shape[1])[None])[0] for part in x.split([3, 5], dim=1)], 1)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


def _worker(rank: int, world_size: int, layout: str, cases: tuple[bool, ...]) -> int:
    from lightning_seqpar.attention.recurrent import Recurrence

    mesh = mesh_1d(world_size)
    failures = []
    for packed in cases:
        ids, labels = data()
        shard, positions, labels, docs = shard_case(ids, labels, lengths=LENGTHS if packed else None, layout=layout,
                                                    world=world_size, rank=rank)
        model = build()
        reference = run_unmodified(copy.deepcopy(model), ids, labels, LENGTHS if packed else None)
        sp = with_twins(model, mesh, layout)  # what HFCausalLM and the strategy do
        assert sum(isinstance(m, Recurrence) and m.mesh is mesh for m in sp.modules()) == 2
        failures += sharded_failures(sp, reference, ids, labels, positions, shard, docs,
                                     tag=f"W={world_size} {layout} packed={packed}", atol=ATOL)
    assert not failures, "\n".join(failures)
    return len(cases)


@pytest.mark.parametrize(("world_size", "layout", "cases"),
                         [(2, "zigzag", (False, True)), (3, "contiguous", (False,)), (4, "zigzag", (True,))])
def test_recurrent_gemma_matches_the_unmodified_model(world_size, layout, cases):
    """Plain batches (zigzag at sp 2, contiguous at sp 3) and packed documents (sp 2 and 4, per-document zigzag;
    documents of 1 token, shorter than a piece): logits, loss and every gradient."""
    assert run_distributed(_worker, world_size, layout, cases) == [len(cases)] * world_size

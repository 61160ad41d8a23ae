"""transformers' Mamba1 models (Mamba, Falcon-Mamba, Jamba, Zamba; tiny fp32 configs of the support sweep) with
their mixers replaced by lightning_seqpar.hf.hybrid's SeqparMambaMixer / SeqparZambaMambaMixer and their attention
by "seqpar" (ring), sharded over W gloo ranks: logits, loss and every gradient against the unmodified model on one
device; packed documents against every document alone (Note [Mamba1's selective scan under sequence sharding])."""

from __future__ import annotations

import copy

import pytest
import torch
from dist_utils import run_distributed
from hf_testing import (
    assert_trained_like,
    build_eager,
    run_unmodified,
    shard_case,
    sharded_failures,
    with_twins,
)
from seqpar_testing import mesh_1d

transformers = pytest.importorskip("transformers")

SEQ, BATCH = 24, 2
ATOL = 1e-5
KINDS = ("mamba", "falcon_mamba", "jamba", "zamba")
LENGTHS = ((5, 1, 11, 7), (2, 22))  # packed documents of SEQ tokens: some shorter than a piece at W = 4


def build(kind: str):
    from lightning_seqpar.hf import support as hf_support

    return build_eager(hf_support.tiny_config(kind))


def data(seed: int = 0):
    from lightning_seqpar.hf import support as hf_support

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, hf_support.VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def test_replacement_keeps_the_state_dict_and_is_exact_on_one_device():
    from lightning_seqpar.hf.hybrid import (
        SeqparMambaMixer,
        SeqparZambaMambaMixer,
        apply_hf_hybrid,
    )

    ids, labels = data()
    for kind in KINDS:
        model = build(kind)
        ref_logits, _, ref_grads = run_unmodified(model, ids, labels)
        twin = copy.deepcopy(model)
        twin.zero_grad()
        mixers = sum(type(m).__name__ in ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer", "ZambaMambaMixer")
                     for m in model.modules())
        assert mixers >= 1 and apply_hf_hybrid(twin) == mixers, kind
        assert all(isinstance(m, (SeqparMambaMixer, SeqparZambaMambaMixer)) for m in twin.modules() if "Mixer" in type(m).__name__)
        assert list(twin.state_dict()) == list(model.state_dict()), kind
        logits, _, grads = run_unmodified(twin, ids, labels)
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=1e-5, msg=lambda m, k=kind: f"{k} logits: {m}")
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, atol=ATOL, rtol=1e-5, msg=lambda m, k=kind, n=n: f"{k} d{n}: {m}")


def test_cache_and_packed_kwargs_and_other_activations_are_refused_by_name():
    from lightning_seqpar.hf.hybrid import SeqparMambaMixer, apply_hf_hybrid

    model = build("mamba")
    apply_hf_hybrid(model)
    mixer = model.backbone.layers[0].mixer
    x = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="cache"):
        mixer(x, object())
    with pytest.raises(ValueError, match="cache"):
        mixer(x, cache_params=object())
    with pytest.raises(ValueError, match="seq_idx=.*document_ids"):
        mixer(x, seq_idx=torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="padding"):
        mixer(x, attention_mask=torch.tensor([[1, 1, 0, 0]]))
    original = build("mamba").backbone.layers[0].mixer
    original.activation = "gelu"
    with pytest.raises(ValueError, match=r"activation 'gelu' \(config.hidden_act"):
        SeqparMambaMixer(original)


def _worker(rank: int, world_size: int, layout: str, packed: bool) -> int:
    mesh = mesh_1d(world_size)
    ids, labels = data()
    shard, positions, labels, docs = shard_case(ids, labels, lengths=LENGTHS if packed else None, layout=layout,
                                                world=world_size, rank=rank)
    failures = []
    for kind in KINDS:
        model = build(kind)
        reference = run_unmodified(copy.deepcopy(model), ids, labels, LENGTHS if packed else None)
        failures += sharded_failures(with_twins(model, mesh, layout), reference, ids, labels, positions, shard, docs,
                                     tag=f"{kind} W={world_size} {layout} packed={packed}", atol=ATOL)
    assert not failures, "\n".join(failures)
    return len(KINDS)


@pytest.mark.parametrize(("world_size", "layout", "packed"),
                         [(2, "zigzag", False), (3, "contiguous", False), (4, "zigzag", False), (4, "zigzag", True)])
def test_mamba1_models_match_the_unmodified_model(world_size, layout, packed):
    assert run_distributed(_worker, world_size, layout, packed) == [len(KINDS)] * world_size


# ------------------------------------------------------------------------------------- under the strategy


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: (folder, reference logits, loss, gradients)} of the support sweep's tiny Mamba1 models, one batch."""
    from hf_testing import batch, reference

    root, data, refs = tmp_path_factory.mktemp("hf-mamba1"), batch(), {}
    for kind in KINDS:
        path = str(root / kind)
        build(kind).save_pretrained(path)
        refs[kind] = (path, *reference(path, data))
    return refs, data


def test_mamba1_models_train_exactly_under_the_strategy(saved):
    """Trainer + SequenceParallelStrategy (sp 2, ring, zigzag) + CausalLMModule(<folder>), one step with the default
    activation checkpointing (the state chain also runs in the recomputation): logits, logged loss, every gradient."""
    from hf_testing import train_each

    refs, data = saved
    results = run_distributed(train_each, 2, [refs[k][0] for k in KINDS], data, timeout=300,
                              strategy_kwargs={"attention": "ring"})[0]
    assert_trained_like(KINDS, results, refs, atol=ATOL)


def test_blocks_that_share_parameters_form_one_fsdp_group():
    """Zamba ties the shared attention block of its hybrid layers (FSDP2 refuses a parameter in two groups)."""
    from lightning_seqpar.parallel.parallelize import _blocks, _sharing_groups

    model = build("zamba")
    blocks = _blocks(model, None)
    assert [len(g) for g in _sharing_groups(blocks)] == [1, 2]  # layer 0 (Mamba), layers 1 and 2 (hybrid, tied)
    assert [[blocks.index(b) for b in g] for g in _sharing_groups(blocks)] == [[0], [1, 2]]
    lone = [torch.nn.Linear(2, 2) for _ in range(3)]
    assert _sharing_groups(lone) == [[m] for m in lone]

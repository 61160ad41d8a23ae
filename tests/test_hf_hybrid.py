"""transformers' hybrid models (Qwen3-Next, Bamba, LFM2; tiny fp32 configs) with their recurrent
mixers replaced by lightning_seqpar.hf.hybrid and their attention by "seqpar" (ring), sharded
over W gloo ranks: logits, loss and every gradient against the unmodified model on one device."""

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

SEQ, BATCH, VOCAB = 24, 2, 61
ATOL = 1e-5


def tiny(kind: str):
    if kind == "qwen3_next":  # layers: linear, full; MoE off (dense MLP)
        return transformers.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=0, layer_types=["linear_attention", "full_attention"],
            max_position_embeddings=64)
    if kind == "bamba":
        return transformers.BambaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, max_position_embeddings=64)
    if kind == "lfm2":
        return transformers.Lfm2Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["conv", "full_attention"], conv_L_cache=3, max_position_embeddings=64)
    raise ValueError(kind)


KINDS = ("qwen3_next", "bamba", "lfm2")


def build(kind: str, seed: int = 0):
    return build_eager(tiny(kind), seed)


def data(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def test_replacement_keeps_the_state_dict_and_is_exact_on_one_device():
    from lightning_seqpar.hf.hybrid import apply_hf_hybrid

    for kind in KINDS:
        model = build(kind)
        ids, labels = data()
        ref_logits, ref_loss, ref_grads = run_unmodified(model, ids, labels)
        twin = copy.deepcopy(model)
        twin.zero_grad()
        assert apply_hf_hybrid(twin) == 1
        assert list(twin.state_dict()) == list(model.state_dict()), kind
        logits, loss, grads = run_unmodified(twin, ids, labels)
        torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=1e-5, msg=lambda m: f"{kind} logits: {m}")
        for n, g in ref_grads.items():
            torch.testing.assert_close(grads[n], g, atol=ATOL, rtol=1e-5, msg=lambda m, n=n: f"{kind} d{n}: {m}")


def test_cache_padding_and_packed_kwargs_are_refused_by_name():
    from lightning_seqpar.hf.hybrid import apply_hf_hybrid

    model = build("lfm2")
    apply_hf_hybrid(model)
    mixer = model.model.layers[0].conv
    x = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="cache"):
        mixer(x, cache=object())
    with pytest.raises(ValueError, match="cu_seq_lens_q=.*document_ids"):
        mixer(x, cu_seq_lens_q=torch.tensor([0, 2, 4]))
    with pytest.raises(ValueError, match="padding"):
        mixer(x, attention_mask=torch.tensor([[1, 1, 0, 0]]))


def test_lora_on_what_the_twins_read_directly_is_refused_and_elsewhere_exact():
    """A twin reads its convolution's kernel (and Mamba1's dt_proj.weight) directly: with peft's LoRA layer there the
    adapter would be left out (transformers' RecurrentGemma calls its conv_1d, so the adapter counts there: a silent
    wrong answer before). Refused by name when the mixers are replaced; LoRA on the projections the twins call stays
    exact on one device (the adapters change the logits: the comparison bites)."""
    peft = pytest.importorskip("peft")
    from lightning_seqpar.hf import support as hf_support
    from lightning_seqpar.hf.hybrid import apply_hf_hybrid

    def adapted(config, targets):
        model = build_eager(config)
        # peft adapts a depthwise conv only with a rank divisible by its groups
        r = max([m.groups for n, m in model.named_modules() if isinstance(m, torch.nn.Conv1d) and n.endswith(tuple(targets))],
                default=2)
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=r, lora_alpha=4, target_modules=targets,
                                                          init_lora_weights=False)).get_base_model()

    for config, name in [(tiny("qwen3_next"), "conv1d"), (tiny("bamba"), "conv1d"),
                         (hf_support.tiny_config("recurrent_gemma"), "conv_1d"), (hf_support.tiny_config("falcon_mamba"), "dt_proj")]:
        with pytest.raises(ValueError, match=f"its {name} is a peft.*not a plain nn.*leave '{name}' out of target_modules"):
            apply_hf_hybrid(adapted(config, [name]))
    ids, labels = data()
    for kind in KINDS:
        model = adapted(tiny(kind), "all-linear")
        plain = run_unmodified(build(kind), ids, labels)[0]
        reference = run_unmodified(copy.deepcopy(model), ids, labels)
        assert (reference[0] - plain).abs().max() > 1e-3, kind  # the adapters count
        assert apply_hf_hybrid(model) == 1
        logits, loss, grads = run_unmodified(model, ids, labels)
        torch.testing.assert_close(logits, reference[0], atol=ATOL, rtol=1e-5, msg=lambda m: f"{kind} logits: {m}")
        assert grads.keys() == reference[2].keys() and any(".lora_A." in n for n in grads)
        for n, g in reference[2].items():
            torch.testing.assert_close(grads[n], g, atol=ATOL, rtol=1e-5, msg=lambda m, n=n: f"{kind} d{n}: {m}")


def _hf_worker(rank: int, world_size: int, layout: str) -> int:

    mesh = mesh_1d(world_size)
    failures = []
    for kind in KINDS:
        model = build(kind)
        ids, labels = data()
        shard, positions, labels, docs = shard_case(ids, labels, lengths=None, layout=layout, world=world_size, rank=rank)
        reference = run_unmodified(copy.deepcopy(model), ids, labels)
        failures += sharded_failures(with_twins(model, mesh, layout), reference, ids, labels, positions, shard, docs,
                                     tag=f"{kind} W={world_size} {layout}", atol=ATOL)
    assert not failures, "\n".join(failures)
    return len(KINDS)


@pytest.mark.parametrize(("world_size", "layout"), [(2, "zigzag"), (4, "zigzag"), (3, "contiguous")])
def test_hybrid_models_match_the_unmodified_model(world_size, layout):
    assert run_distributed(_hf_worker, world_size, layout) == [len(KINDS)] * world_size


# ------------------------------------------------------------------------------------- under the strategy


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """``folder(kind)``: tests/hf_testing.py's tiny model of ``kind`` saved once for every fixture below that reads it."""
    from hf_testing import save_tiny_model

    root, paths = tmp_path_factory.mktemp("hf-hybrid"), {}

    def get(kind: str) -> str:
        if kind not in paths:
            paths[kind] = save_tiny_model(kind, str(root / kind))
        return paths[kind]

    return get


@pytest.fixture(scope="module")
def saved(folder):
    """{kind: (folder, reference logits, loss, gradients)} of tests/hf_testing.py's tiny hybrids, one batch."""
    from hf_testing import batch, reference

    data = batch()
    return {kind: (path, *reference(path, data)) for kind in STRATEGY_KINDS for path in [folder(kind)]}, data


STRATEGY_KINDS = ("lfm2", "bamba", "qwen3_next", "qwen3_5")


@pytest.mark.parametrize("world,attention,layout", [(2, "ring", "zigzag"), (4, "allgather", "contiguous")])
def test_hybrid_models_train_exactly_under_the_strategy(world, attention, layout, saved):
    """Trainer + SequenceParallelStrategy + CausalLMModule(<folder>), one step (default checkpointing, so the
    state chain also runs in the recomputation): logits, logged loss and every gradient of the unmodified model."""
    from hf_testing import train_each

    refs, data = saved
    results = run_distributed(train_each, world, [refs[k][0] for k in STRATEGY_KINDS], data, timeout=300,
                              strategy_kwargs={"attention": attention, "load_balance": layout})[0]
    assert_trained_like(STRATEGY_KINDS, results, refs, atol=ATOL)


def test_hybrid_models_train_exactly_with_data_parallelism(saved):
    """sp = 2 x dp = 2 (4 ranks, FSDP2 over both axes): each data-parallel pair runs its half of the batch with the
    states passed in parallel over its two sequence ranks; the logged loss and every gradient are the whole
    batch's, the logits rank 0's half."""
    from hf_testing import train_each

    refs, data = saved
    kinds = ("qwen3_next", "bamba")  # the gated delta rule and the SSD scan
    results = run_distributed(train_each, 4, [refs[k][0] for k in kinds], data, timeout=300,
                              strategy_kwargs={"attention": "ring", "sequence_parallel_size": 2})[0]
    for kind, result in zip(kinds, results):
        _, logits, loss, grads = refs[kind]
        assert result["losses"][0] == pytest.approx(float(loss), rel=1e-6), kind
        torch.testing.assert_close(result["logits"], logits[: result["logits"].shape[0]], rtol=0, atol=ATOL,
                                   msg=lambda m, k=kind: f"{k} logits: {m}")
        assert result["logits"].shape[0] < logits.shape[0], "the batch was not split over the data-parallel ranks"
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=lambda m, k=kind, n=name: f"{k} {n}: {m}")


def test_two_d_attention_is_refused_by_name():
    """Before any communication: a 2-D (hp x cp) mesh (its head-parallel axis does not apply to a recurrence)."""
    import types

    from hf_testing import tiny_config

    from lightning_seqpar.hf import HFCausalLM
    from lightning_seqpar.parallel.parallelize import apply_attention

    torch.manual_seed(0)
    wrapped = HFCausalLM(transformers.AutoModelForCausalLM.from_config(tiny_config("lfm2"), dtype=torch.float32))
    fake = types.SimpleNamespace(ndim=2, size=lambda *a: 4, mesh_dim_names=("hp", "cp"),
                                 get_group=lambda *a: pytest.fail("communicated"))
    with pytest.raises(ValueError, match=r"recurrent token mixers .* attention='2d' over a 2-D mesh .* head_parallel_size=1"):
        apply_attention(wrapped, fake, attention="2d")


# ------------------------------------------------------------------------------------- packed documents


def test_packed_documents_reset_the_state_on_one_device():
    """HFCausalLM with the batch's documents current (no strategy, one device): every hybrid's logits and
    gradients equal each document run alone through the unmodified model (Note [Documents in a recurrence])."""
    from hf_testing import tiny_config
    from test_hf_documents import LENGTHS

    from lightning_seqpar.hf import HFCausalLM
    from lightning_seqpar.sharding.documents import PackedDocuments, packed_documents

    lengths = LENGTHS[1]  # one sample: documents of 1, 2, 3 and 16 tokens
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    documents = PackedDocuments.from_lengths([lengths])
    for kind in STRATEGY_KINDS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation="eager",
                                                              dtype=torch.float32).train()
        reference = copy.deepcopy(model)
        ref = torch.cat([reference(input_ids=part, position_ids=torch.arange(part.shape[1])[None], use_cache=False).logits
                         for part in ids.split(list(lengths), dim=1)], dim=1)
        (ref * ref.detach().sin()).sum().backward()
        wrapped = HFCausalLM(model)
        with packed_documents(documents):
            logits = wrapped(ids, documents.position_ids())
        (logits * logits.detach().sin()).sum().backward()
        torch.testing.assert_close(logits, ref, rtol=0, atol=ATOL, msg=lambda m, k=kind: f"{k} logits: {m}")
        grads = dict(reference.named_parameters())
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=0, atol=ATOL, msg=lambda m, k=kind, n=name: f"{k} {n}: {m}")


@pytest.fixture(scope="module")
def packed(folder):
    """{kind: (folder, per-document reference logits, loss, gradients)} and the packed batch of tests/test_hf_documents.py."""
    from test_hf_documents import packed_batch, per_document_reference

    data = packed_batch()
    return {kind: (path, *per_document_reference(path, data)) for kind in STRATEGY_KINDS for path in [folder(kind)]}, data


@pytest.mark.parametrize("world,attention", [(2, "ring"), (4, "allgather")])
def test_packed_documents_train_exactly_under_the_strategy(world, attention, packed):
    """Trainer + strategy on a batch of packed documents (document_ids; documents of 1 token, shorter than a piece,
    and spanning every rank): logits, loss and every gradient equal each document alone in the unmodified model."""
    from hf_testing import train_each

    refs, data = packed
    results = run_distributed(train_each, world, [refs[k][0] for k in STRATEGY_KINDS], data, timeout=300,
                              strategy_kwargs={"attention": attention})[0]
    assert_trained_like(STRATEGY_KINDS, results, refs, atol=ATOL)


PACKED_36 = ((1, 6, 17, 12), (3, 1, 1, 31))  # S = 36: divisible by 2 x 3 (zigzag over 3 ranks)


@pytest.fixture(scope="module")
def saved_36(folder):
    """A plain and a packed batch of 36 tokens, with the references of every hybrid (sp = 3 needs 6 | S)."""
    from hf_testing import reference

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 97, (2, 37), generator=g)
    plain = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "position_ids": torch.arange(36).expand(2, 36).contiguous()}
    doc = torch.stack([torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in PACKED_36])
    labels = torch.where(doc[:, 1:] == doc[:, :-1], plain["input_ids"][:, 1:], -100)
    packed = {"input_ids": plain["input_ids"], "labels": torch.cat([labels, torch.full((2, 1), -100)], dim=1),
              "document_ids": doc, "position_ids": plain["position_ids"]}
    kinds = (*STRATEGY_KINDS, *MORE_KINDS)
    paths = {kind: folder(kind) for kind in kinds}
    refs_plain = {kind: reference(paths[kind], plain) for kind in STRATEGY_KINDS}
    refs_packed = {kind: _per_document_reference(paths[kind], packed, PACKED_36) for kind in kinds}
    return paths, (plain, refs_plain), (packed, refs_packed)


def _per_document_reference(path, data, lengths):
    """Every document alone through the unmodified model: full logits, mean loss over the batch's labels, gradients."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).train()
    logits = torch.cat([torch.cat([model(input_ids=part, position_ids=torch.arange(part.shape[1])[None], use_cache=False).logits
                                   for part in data["input_ids"][b:b + 1].split(list(lens), dim=1)], dim=1)
                        for b, lens in enumerate(lengths)])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("case,group", [("plain", "first"), ("packed", "first"), ("packed", "more")])
def test_hybrid_models_train_exactly_at_sp_3(case, group, saved_36):
    """sp = 3 (ring, zigzag: the state chain 0 -> 1 -> 2 -> 2 -> 1 -> 0), a plain batch and packed documents; "more":
    the Mamba2 / linear-attention families (MORE_KINDS) with packed documents."""
    from hf_testing import train_each

    paths, plain, packed = saved_36
    data, refs = plain if case == "plain" else packed
    kinds = STRATEGY_KINDS if group == "first" else MORE_KINDS
    results = run_distributed(train_each, 3, [paths[k] for k in kinds], data, timeout=300,
                              strategy_kwargs={"attention": "ring"})[0]
    assert_trained_like(kinds, results, refs, atol=ATOL, same_keys=False)


# ------------------------------------------------------------------- more Mamba2 / linear-attention families (#23)

MORE_KINDS = ("mamba2", "zamba2", "falcon_h1", "olmo_hybrid", "minimax", "kimi_linear")


def test_more_families_are_replaced_and_reset_at_documents_on_one_device():
    """Mamba2, Zamba2, Falcon-H1 (muP multipliers, gated norm), OLMo-hybrid (beta in (0, 2)), MiniMax (lightning
    attention), Kimi Linear (KDA): the twins keep the state dict, and with packed documents every document equals
    it alone."""
    from hf_testing import tiny_config
    from test_hf_documents import LENGTHS

    from lightning_seqpar.hf import HFCausalLM
    from lightning_seqpar.hf.hybrid import HYBRID_MIXERS
    from lightning_seqpar.sharding.documents import PackedDocuments, packed_documents

    lengths = LENGTHS[1]  # documents of 2, 3, 1, 1, 9 and 16 tokens
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    documents = PackedDocuments.from_lengths([lengths])
    for kind in MORE_KINDS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(kind), attn_implementation="eager",
                                                              dtype=torch.float32).train()
        mixers = [name for name, m in model.named_modules() if type(m).__name__ in HYBRID_MIXERS]
        reference = copy.deepcopy(model)
        ref = torch.cat([reference(input_ids=part, position_ids=torch.arange(part.shape[1])[None], use_cache=False).logits
                         for part in ids.split(list(lengths), dim=1)], dim=1)
        (ref * ref.detach().sin()).sum().backward()
        wrapped = HFCausalLM(model)
        assert mixers and all(type(model.get_submodule(n)).__name__.startswith("Seqpar") for n in mixers), kind
        assert list(model.state_dict()) == list(reference.state_dict()), kind
        with packed_documents(documents):
            logits = wrapped(ids, documents.position_ids())
        (logits * logits.detach().sin()).sum().backward()
        torch.testing.assert_close(logits, ref, rtol=0, atol=ATOL, msg=lambda m, k=kind: f"{k} logits: {m}")
        grads = dict(reference.named_parameters())
        for name, p in model.named_parameters():  # gradients up to ~1e2 here: atol + 1e-5 of the tensor's largest entry
            want = grads[name].grad
            err = float((p.grad - want).abs().max())
            assert err <= ATOL + 1e-5 * float(want.abs().max()), f"{kind} {name}: off by {err:.2e} (largest {float(want.abs().max()):.2e})"


@pytest.fixture(scope="module")
def more_saved(folder):
    """The tiny models of MORE_KINDS saved, with the references of a plain and of a packed batch."""
    from hf_testing import batch, reference
    from test_hf_documents import packed_batch, per_document_reference

    paths = {kind: folder(kind) for kind in MORE_KINDS}
    plain, packed = batch(), packed_batch()
    return paths, {"plain": (plain, {k: reference(p, plain) for k, p in paths.items()}),
                   "packed": (packed, {k: per_document_reference(p, packed) for k, p in paths.items()})}


@pytest.mark.parametrize("world,attention,layout,case", [(2, "ring", "zigzag", "plain"), (4, "ring", "zigzag", "packed")])
def test_more_families_train_exactly_under_the_strategy(world, attention, layout, case, more_saved):
    """Trainer + SequenceParallelStrategy + CausalLMModule(<folder>), one step: logits, logged loss and every gradient
    of the unmodified model (packed: of every document alone)."""
    from hf_testing import train_each

    paths, cases = more_saved
    data, refs = cases[case]
    results = run_distributed(train_each, world, [paths[k] for k in MORE_KINDS], data, timeout=300,
                              strategy_kwargs={"attention": attention, "load_balance": layout})[0]
    assert_trained_like(MORE_KINDS, results, refs, atol=ATOL)

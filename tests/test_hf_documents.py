"""Packed documents through a Hugging Face model under SequenceParallelStrategy (CPU, gloo, fp32).

A batch of packed documents (``document_ids``) trains one step under the strategy; the full
logits, the loss and every parameter gradient must equal the UNMODIFIED transformers model (eager
attention, one device) run on every document ALONE (positions from 0, loss averaged over all
labelled tokens of the batch). Documents: one token long, shorter than a shard piece, and
spanning all ranks; sp = 2 and 4, ring and all-gather (Ulysses at sp = 2), and sp = 1 (the
strategy on one device, local attention with documents).

Position-dependent features with packed documents (issue #41; Note [Packed documents] in the
DESIGN): Llama 4's chunked attention (chunks counted from each document's start, documents longer
and shorter than a chunk), dynamic-NTK RoPE and LongRoPE (each document reads ITS length:
documents longer and shorter than the original context, two long ones of different lengths),
against every document alone through a FRESH copy of the unmodified model (the dynamic rotary
embedding caches the longest length it saw).
"""

from __future__ import annotations


import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402
from hf_testing import BATCH, SEQ_LEN, VOCAB, each_document_alone, save_tiny_model, summed_grads, train_each, train_under_strategy  # noqa: E402

KINDS = ("llama", "qwen2")
LENGTHS = ((5, 1, 14, 1, 11), (2, 3, 1, 1, 9, 16))  # each sums to SEQ_LEN
ATOL = 1e-5
TIMEOUT = 300


def packed_batch(seed: int = 0, lengths=LENGTHS, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """Random tokens in documents of ``lengths``; labels: next token of the same document, -100 at each document's end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (BATCH, SEQ_LEN), generator=g)
    doc = torch.stack([torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in lengths])
    labels = torch.full_like(ids, -100)
    same = doc[:, 1:] == doc[:, :-1]
    labels[:, :-1] = torch.where(same, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    return {"input_ids": ids, "labels": labels, "document_ids": doc,
            "position_ids": torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN).contiguous()}


def per_document_reference(path, data: dict[str, torch.Tensor], lengths=LENGTHS):
    """Every document alone through a fresh copy of the unmodified model (a folder or a model): full logits, mean loss
    over the batch's labels, gradients (summed over the copies)."""
    if isinstance(path, str):
        path = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    logits, copies, _ = each_document_alone(path, data["input_ids"], lengths)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    loss.backward()
    return logits.detach(), loss.detach(), summed_grads(path, copies)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-doc-models")
    data = packed_batch()
    return {kind: (path := save_tiny_model(kind, str(root / kind)), *per_document_reference(path, data)) for kind in KINDS}, data


# all-gather with documents at 4 ranks: tests/test_documents.py (the op) and test_hf_hybrid.py (packed, 4-allgather)
@pytest.mark.parametrize("world,attention", [(1, "ring"), (2, "ring"), (2, "allgather"), (2, "ulysses"), (4, "ring")])
def test_packed_documents_match_each_document_alone(world, attention, models):
    refs, data = models
    results = run_distributed(train_each, world, [refs[k][0] for k in KINDS], data,
                              strategy_kwargs={"attention": attention}, timeout=TIMEOUT)[0]
    for kind, result in zip(KINDS, results):
        _, logits, loss, grads = refs[kind]
        assert torch.isfinite(result["logits"]).all()
        torch.testing.assert_close(result["logits"], logits, rtol=0, atol=ATOL, msg=lambda m: f"{kind} logits: {m}")
        assert result["losses"][0] == pytest.approx(float(loss), rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=lambda m, n=name: f"{kind} {n}: {m}")


def test_position_ids_restarting_at_zero_are_packed_documents(models):
    """The Hugging Face packing convention (DataCollatorWithFlattening: no document ids, positions restart at 0)."""
    refs, data = models
    pos = torch.cat([torch.cat([torch.arange(n) for n in lens])[None] for lens in LENGTHS])
    hf_style = {"input_ids": data["input_ids"], "labels": data["labels"], "position_ids": pos}
    result = run_distributed(train_each, 2, [refs["llama"][0]], hf_style, strategy_kwargs={"attention": "ring"}, timeout=TIMEOUT)[0][0]
    torch.testing.assert_close(result["logits"], refs["llama"][1], rtol=0, atol=ATOL)


# --------------------------------------------------------------------------------------------- position-dependent features

# documents longer and shorter than Llama 4's chunk (8), than the original context (24) of dynamic NTK / LongRoPE, and
# two long ones of different lengths (26, 27: each reads its own frequencies; the packed batch's maximum is 27)
FEATURE_LENGTHS = ((26, 3, 1, 2), (5, 27))


def _feature_models():
    """(name, model, lengths): Llama 4 with chunked attention (and its temperature tuning, exact below floor_scale),
    Llama with dynamic NTK, Phi-3 with LongRoPE."""
    from hf_testing import tiny_config

    from lightning_seqpar.hf import support as hf_support

    llama4 = hf_support.build_tiny_model("llama4_text", "chunked")  # chunk 8, layers: chunked (RoPE) + full (NoPE)
    assert llama4.config.attention_chunk_size == 8 and llama4.config.attn_temperature_tuning
    out = [("llama4-chunked", llama4, LENGTHS)]
    dynamic = {"rope_parameters": {"rope_type": "dynamic", "factor": 16.0, "rope_theta": 10000.0}}  # a base far from 26's at 27
    for kind, overrides in (("llama-dynamic", dynamic), ("phi3-longrope", {})):
        torch.manual_seed(0)
        config = tiny_config(kind, **overrides)
        out.append((kind, transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32), FEATURE_LENGTHS))
    return out


def _train_cases(rank, world_size, cases, strategy_kwargs):
    return [train_under_strategy(rank, world_size, model, data, strategy_kwargs=strategy_kwargs) for model, data in cases]


@pytest.fixture(scope="module")
def feature_cases():
    out = []
    for name, model, lengths in _feature_models():
        data = packed_batch(seed=1, lengths=lengths, vocab=model.config.vocab_size)
        out.append((name, model, data, per_document_reference(model, data, lengths)))
    return out


def _check(name, result, ref, tag):
    logits, loss, grads = ref
    torch.testing.assert_close(result["logits"], logits, rtol=0, atol=ATOL, msg=lambda m: f"{name} {tag} logits: {m}")
    assert result["losses"][0] == pytest.approx(float(loss), rel=1e-6), f"{name} {tag}"
    for n, g in grads.items():
        torch.testing.assert_close(result["grads"][n], g, rtol=0, atol=ATOL, msg=lambda m, n=n: f"{name} {tag} {n}: {m}")


# (every architecture x feature x algorithm with packed documents: the support sweep, tests/test_hf_support.py)
@pytest.mark.parametrize("world,attention,hf_style", [(1, "ring", False), (2, "ring", False), (2, "ulysses", True),
                                                       (4, "2d", True)])
def test_position_dependent_features_per_document(world, attention, hf_style, feature_cases):
    """Chunked attention, dynamic NTK and LongRoPE with packed documents equal every document alone (the three cases
    were silently wrong: chunks counted from the packed row's start, one rotary length for the whole row)."""
    cases = []
    for _, model, data, _ in feature_cases:
        if hf_style:  # the Hugging Face packing convention: no document ids, positions restarting at 0
            data = {"input_ids": data["input_ids"], "labels": data["labels"],
                    "position_ids": _restarting(data["document_ids"])}
        cases.append((model, data))
    kwargs = {"attention": attention} | ({"head_parallel_size": 2} if attention == "2d" else {})
    results = run_distributed(_train_cases, world, cases, kwargs, timeout=TIMEOUT)[0]
    for (name, _, _, ref), result in zip(feature_cases, results):
        _check(name, result, ref, f"sp{world}/{attention}")


def _restarting(document_ids: torch.Tensor) -> torch.Tensor:
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    index = torch.arange(document_ids.shape[1]).expand_as(document_ids)
    return index - torch.cummax(torch.where(starts, index, 0), dim=1).values


def test_temperature_tuning_is_refused_with_packed_documents_from_floor_scale_on():
    """Llama 4's attention temperature tuning reads the token index in the packed row (arange over the row), not in
    the document: refused by name once the row reaches config.floor_scale, before any collective, at sp 1 too."""
    from lightning_seqpar.hf import support as hf_support
    from lightning_seqpar.sharding.documents import PackedDocuments, packed_documents
    from lightning_seqpar.hf import HFCausalLM

    config = hf_support.tiny_config("llama4_text", "chunked")
    config.floor_scale = 16  # the row (32) reaches it; each document of LENGTHS is shorter
    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    data = packed_batch(lengths=LENGTHS, vocab=config.vocab_size)
    with packed_documents(PackedDocuments.from_document_ids(data["document_ids"])):
        with pytest.raises(ValueError, match=r"attention temperature tuning .*floor_scale=16.*packed row.*packed documents"):
            model(data["input_ids"], _restarting(data["document_ids"]))
    model(data["input_ids"], data["position_ids"])  # whole sequences on one rank: the index is the position

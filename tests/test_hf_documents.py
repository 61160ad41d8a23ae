"""Packed documents through a Hugging Face model under SequenceParallelStrategy (CPU, gloo, fp32).

A batch of packed documents (``document_ids``) trains one step under the strategy; the full
logits, the loss and every parameter gradient must equal the UNMODIFIED transformers model (eager
attention, one device) run on every document ALONE (positions from 0, loss averaged over all
labelled tokens of the batch). Documents: one token long, shorter than a shard piece, and
spanning all ranks; sp = 2 and 4, ring and all-gather (Ulysses at sp = 2), and sp = 1 (the
strategy on one device, local attention with documents).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402
from hf_testing import BATCH, SEQ_LEN, VOCAB, save_tiny_model, train_each  # noqa: E402

KINDS = ("llama", "qwen2")
LENGTHS = ((5, 1, 14, 1, 11), (2, 3, 1, 1, 9, 16))  # each sums to SEQ_LEN
ATOL = 1e-5
TIMEOUT = 300


def packed_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tokens in documents of LENGTHS; labels: next token of the same document, -100 at each document's end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=g)
    doc = torch.stack([torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)) for lens in LENGTHS])
    labels = torch.full_like(ids, -100)
    same = doc[:, 1:] == doc[:, :-1]
    labels[:, :-1] = torch.where(same, ids[:, 1:], torch.full_like(ids[:, 1:], -100))
    return {"input_ids": ids, "labels": labels, "document_ids": doc,
            "position_ids": torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN).contiguous()}


def per_document_reference(path: str, data: dict[str, torch.Tensor]):
    """Every document alone through the unmodified model: full logits, mean loss over the batch's labels, gradients."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    model.train()
    rows = []
    for b, lens in enumerate(LENGTHS):
        start, parts = 0, []
        for n in lens:
            ids = data["input_ids"][b : b + 1, start : start + n]
            parts.append(model(input_ids=ids, position_ids=torch.arange(n)[None], use_cache=False).logits)
            start += n
        rows.append(torch.cat(parts, dim=1))
    logits = torch.cat(rows)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    loss.backward()
    return logits.detach(), loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


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

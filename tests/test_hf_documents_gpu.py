"""Position-dependent features with packed documents on one GPU (issue #41); skipped on CPU.

    python -m pytest -q -s tests/test_hf_documents_gpu.py

The CPU tests (tests/test_hf_documents.py, the support sweep) run the pure-torch kernels; on a GPU
the chunk and document masks go through FlexAttention and the per-document rotary groups index CUDA
tensors. Llama 4 with chunked attention, dynamic-NTK Llama and LongRoPE Phi-3 (tiny, fp32, TF32
off), packed documents longer and shorter than the chunk and the original context, through
``HFCausalLM`` with the documents current: logits and every gradient against every document alone
through a fresh copy of the unmodified model on the same GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

LENGTHS = ((26, 3, 1, 2), (5, 27))
ATOL = 1e-4


def _models():
    from hf_testing import tiny_config

    from lightning_seqpar.hf import support as hf_support

    config = hf_support.tiny_config("llama4_text", "chunked")
    config.head_dim = 16  # FlexAttention (the chunk mask on a GPU) takes head dims >= 16
    torch.manual_seed(0)
    yield "llama4-chunked", transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    dynamic = {"rope_parameters": {"rope_type": "dynamic", "factor": 16.0, "rope_theta": 10000.0}}
    for kind, overrides in (("llama-dynamic", dynamic), ("phi3-longrope", {})):
        torch.manual_seed(0)
        yield kind, transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama4-chunked", "llama-dynamic", "phi3-longrope"])
def test_features_per_document_on_the_gpu(name, monkeypatch):
    from lightning_seqpar.hf import HFCausalLM
    from lightning_seqpar.sharding.documents import PackedDocuments, packed_documents

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    model = dict(_models())[name].cuda().train()
    dev = torch.device("cuda")
    docs = PackedDocuments.from_lengths(LENGTHS)
    ids = torch.randint(0, model.config.vocab_size - 8, (2, docs.seq_len), generator=torch.Generator().manual_seed(1)).to(dev)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    rows, copies = [], []
    for b, lengths in enumerate(LENGTHS):
        parts = []
        for part in ids[b:b + 1].split(list(lengths), dim=1):
            alone = copy.deepcopy(reference)
            parts.append(alone(input_ids=part, position_ids=torch.arange(part.shape[1], device=dev)[None], use_cache=False).logits)
            copies.append(alone)
        rows.append(torch.cat(parts, dim=1))
    want = torch.cat(rows)
    want.square().mean().backward()
    ours = HFCausalLM(model)
    with packed_documents(docs):
        got = ours(ids, docs.position_ids(dev))
        got.square().mean().backward()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=ATOL)
    for n, p in model.named_parameters():
        g = sum(dict(c.named_parameters())[n].grad for c in copies if dict(c.named_parameters())[n].grad is not None)
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=ATOL, msg=lambda m, n=n: f"{name} d{n}: {m}")
    print(f"{name}: logits max err {float((got - want).detach().abs().max()):.2e}")

"""Windowed, chunked, soft-capped and sink attention kernels on one GPU in bf16 against an fp32
reference (outputs, LSE, gradients of q, k, v, sinks), head dims 64, 128 and 256; skipped on CPU.

    python -m pytest -q -s tests/test_attention_features_gpu.py

Kernels (``lightning_seqpar.attention.masked``): a window alone takes torch's flash-attention-2
sliding-window kernel, everything else FlexAttention. The reference is the pure-torch masked
kernel in fp32 on the same bf16 inputs (its own masks built from global positions, checked
against an explicit softmax on the CPU by tests/test_attention_features.py).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

CASES = (
    dict(window=256),
    dict(window=300, softcap=20.0),
    dict(window=256, sinks=True),
    dict(softcap=30.0, sinks=True),
    dict(chunk_size=384),
    dict(window=200, documents=((700, 300, 1048),)),
    dict(chunk_size=384, documents=((700, 300, 1048),)),  # chunks from each document's start (#41)
)


@pytest.fixture(autouse=True)
def _many_compiles(monkeypatch):
    import torch._dynamo.config as cfg

    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(cfg, name, 256)  # one FlexAttention compilation per mask / shape in this file


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    return ((a - b)[fin].norm() / b[fin].norm().clamp_min(1e-6)).item()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}" for k in c))
def test_variant_kernels_bf16(case, head_dim):
    from lightning_seqpar.attention.local import resolve_backend
    from lightning_seqpar.sharding.documents import PackedDocuments

    B, S, HQ, HKV = (1, 2048, 8, 2) if head_dim < 256 else (1, 2048, 4, 2)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(head_dim)
    q, k, v, do = (torch.randn(B, S, h, head_dim, device=dev, generator=g, dtype=torch.bfloat16) for h in (HQ, HKV, HKV, HQ))
    sinks = torch.randn(HQ, device=dev, generator=g) if case.get("sinks") else None
    docs = PackedDocuments.from_lengths(case["documents"]).pieces if case.get("documents") else None
    opts = (case.get("window", 0), case.get("chunk_size", 0), float(case.get("softcap", 0.0)))
    scale = head_dim**-0.5
    results = {}
    for name, dtype, backend in (("gpu", torch.bfloat16, resolve_backend("auto", dev, torch.bfloat16, head_dim)),
                                 ("ref", torch.float32, "math")):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if sinks is not None else [])
        out, lse = torch.ops.seqpar.attn_fwd(*leaves[:3], "local", "", True, "zigzag", scale, backend, 0, docs, 1, *opts,
                                             leaves[3] if sinks is not None else None)
        grads = torch.autograd.grad(out, leaves, do.to(dtype))
        results[name] = (out, lse, *grads)
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    errs = {n: _rel(a, b) for n, a, b in zip(names, results["gpu"], results["ref"])}
    print(f"D={head_dim} {case}: " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e < (2e-3 if n == "lse" else 1.5e-2), (n, e, errs)  # dsinks is built from the bf16 out / dout, as dq, dk, dv

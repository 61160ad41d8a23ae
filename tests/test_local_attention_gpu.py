"""The package's attention on ONE GPU (no mesh: what sequence_parallel_size=1 and every Hugging Face
model at sp = 1 run), bf16, GQA, against an fp32 SDPA reference on the same inputs: out, dq, dk, dv
within 2x (+ 2e-3) of torch SDPA's own bf16 error on those inputs, for every backend this GPU runs;
and a Llama-shaped transformers model through HFCausalLM against the unmodified model (bf16
autocast both, fp32 reference): every gradient within 2x (+ 2e-3) of the unmodified bf16 model's
error. Skipped without CUDA.

    pytest -s tests/test_local_attention_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _sdpa(q, k, v, dout):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in leaves), is_causal=True, enable_gqa=True).transpose(1, 2)
    out.backward(dout.to(out.dtype))
    return [out.detach(), *(x.grad for x in leaves)]


@pytest.mark.parametrize("shape", [(1, 4096, 8, 2, 64), (1, 8192, 32, 8, 128)])
def test_local_attention_backends_match_fp32(shape):
    from lightning_seqpar.attention import Attention
    from lightning_seqpar.attention.local import available_backends

    B, S, Hq, Hkv, D = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(B, S, h, D, device="cuda", generator=g, dtype=torch.bfloat16) for h in (Hq, Hkv, Hkv, Hq))
    ref = _sdpa(q.float(), k.float(), v.float(), dout.float())
    base = _sdpa(q, k, v, dout)
    base_err = [_rel(a, r) for a, r in zip(base, ref)]
    failures = []
    for backend in available_backends(torch.device("cuda"), torch.bfloat16, D):
        attention = Attention(causal=True, scale=D ** -0.5)
        attention.backend = backend
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = attention(*leaves)
        out.backward(dout)
        got = [out.detach(), *(x.grad for x in leaves)]
        errs = [_rel(a, r) for a, r in zip(got, ref)]
        print(f"[local-attention-gpu] {shape} {backend}: " + ", ".join(
            f"{n} {e:.2e} (sdpa {b:.2e})" for n, e, b in zip(("out", "dq", "dk", "dv"), errs, base_err)))
        failures += [f"{backend} {n}: {e:.2e} > 2 x {b:.2e} + 2e-3" for n, e, b in zip(("out", "dq", "dk", "dv"), errs, base_err)
                     if e > 2 * b + 2e-3]
    assert not failures, failures


def test_hf_model_gradients_match_the_unmodified_model():
    transformers = pytest.importorskip("transformers")
    from lightning_seqpar.hf import HFCausalLM

    S, V = 4096, 1024
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=S)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").cuda()
    ids = torch.randint(0, V, (1, S), device="cuda")
    pos = torch.arange(S, device="cuda")[None]

    def run(model, wrapped, autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids, pos) if wrapped else model(input_ids=ids, position_ids=pos, use_cache=False).logits
        F.cross_entropy(logits.float()[0, :-1], ids[0, 1:]).backward()
        params = model.hf.named_parameters() if wrapped else model.named_parameters()
        return {n: p.grad.float() for n, p in params}

    ref = run(copy.deepcopy(base), False, False)
    plain = run(copy.deepcopy(base), False, True)
    ours = run(HFCausalLM(copy.deepcopy(base)), True, True)
    failures = []
    for name, r in ref.items():
        e, b = _rel(ours[name], r), _rel(plain[name], r)
        print(f"[hf-grad-gpu] {name}: ours {e:.2e}, transformers bf16 {b:.2e}")
        if e > 2 * b + 2e-3:
            failures.append(f"{name}: {e:.2e} > 2 x {b:.2e} + 2e-3")
    assert not failures, failures

"""The fused element-wise kernels (Note [Fused element-wise kernels] in lightning_seqpar.models.fused) on ONE GPU,
against the torch path on the same bf16 inputs and an fp64 reference: outputs and every gradient within 2x (+ 1e-3)
of the torch path's own bf16 error; RoPE leaves its inputs untouched; a Llama block under Selective Checkpoint++
with the fused kernels gives its uncheckpointed gradients bitwise. Skipped without CUDA or liger-kernel.

    pytest -s tests/test_fused_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_seqpar.models import fused

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not fused.fused_kernels_available(), reason="needs liger-kernel"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run(fn, inputs, dout, *, fused_on: bool):
    import os

    os.environ["SEQPAR_FUSED_KERNELS"] = "1" if fused_on else "0"
    try:
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward(outs, [d.to(o.dtype) for o, d in zip(outs, dout)])
        return [o.detach() for o in outs] + [x.grad for x in leaves if x.requires_grad]
    finally:
        os.environ.pop("SEQPAR_FUSED_KERNELS", None)


def _check(fn, inputs, dout):
    ref = _run(fn, [x.double() if x.is_floating_point() else x for x in inputs], [d.double() for d in dout], fused_on=False)
    torch_path = _run(fn, inputs, dout, fused_on=False)
    fused_path = _run(fn, inputs, dout, fused_on=True)
    assert len(ref) == len(torch_path) == len(fused_path)
    for r, t, f in zip(ref, torch_path, fused_path):
        assert f.dtype == t.dtype and f.shape == t.shape
        assert _rel(f, r) <= 2 * _rel(t, r) + 1e-3, (_rel(f, r), _rel(t, r))


@pytest.mark.parametrize("shape", [(2, 1000, 4096), (1, 4096, 576)])
def test_rms_norm_matches_torch(shape):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda", generator=g)).bfloat16()
    dy = torch.randn(*shape, device="cuda", generator=g)
    _check(lambda x, w: fused.rms_norm(x, w, 1e-5), [x, w], [dy])


@pytest.mark.parametrize("shape", [(1, 2048, 32, 8, 128), (2, 500, 8, 1, 64)])
def test_rope_matches_torch_and_leaves_its_inputs(shape):
    from lightning_seqpar.models.llama import rope_freqs_cis

    B, S, H, Hkv, D = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, S, H, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device="cuda", generator=g, dtype=torch.bfloat16)
    positions = torch.randint(0, 100_000, (B, S), device="cuda", generator=g)  # a shard's global positions
    freqs = rope_freqs_cis(positions, head_dim=D, theta=500000.0)
    dq, dk = torch.randn_like(q, dtype=torch.float32), torch.randn_like(k, dtype=torch.float32)

    def rotate(q, k):
        return fused.rope(q, k, freqs.to(torch.complex128) if q.dtype == torch.float64 else freqs)

    _check(rotate, [q, k], [dq, dk])
    q0, k0 = q.clone(), k.clone()
    fused.rope(q, k, freqs)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_silu_mul_matches_torch():
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(1, 3000, 14336, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    _check(fused.silu_mul, [a, b], [torch.randn(1, 3000, 14336, device="cuda", generator=g)])


@pytest.mark.parametrize("fused_on", [True, False])
def test_checkpointed_block_is_bitwise_uncheckpointed(fused_on, monkeypatch):
    """Selective Checkpoint++ (and the same keeping the matmuls' outputs) recomputes the fused kernels to the bit:
    the block's gradients equal its uncheckpointed ones (torch's math attention: a deterministic backward)."""
    from lightning_seqpar.models.llama import LlamaBlock, LlamaConfig, rope_freqs_cis
    from lightning_seqpar.parallel.activation_checkpointing import SAVE_OPS, checkpoint_block

    monkeypatch.setenv("SEQPAR_FUSED_KERNELS", "1" if fused_on else "0")
    config = LlamaConfig(vocab_size=256, n_embd=512, n_layer=1, n_head=8, n_kv_head=2, intermediate_size=1408,
                         max_seq_len=4096)
    torch.manual_seed(0)
    block = LlamaBlock(config).cuda().bfloat16()
    block.self_attn.attn_core.backend = "math"
    x = torch.randn(1, 1024, 512, device="cuda", dtype=torch.bfloat16)
    freqs = rope_freqs_cis(torch.arange(1024, device="cuda")[None], head_dim=config.head_dim, theta=config.rope_theta)
    dy = torch.randn_like(x)

    def grads(module):
        leaf = x.clone().requires_grad_()
        module(leaf, freqs).backward(dy)
        return [leaf.grad, *(p.grad for p in module.parameters())]

    plain = grads(block)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads(_fresh(block))))  # the reference is deterministic
    for save_ops in (SAVE_OPS, (*SAVE_OPS, torch.ops.aten.mm.default)):
        checkpointed = checkpoint_block(_fresh(block), "selective++", save_ops=save_ops)
        again = grads(checkpointed)
        differ = [(i, (a.float() - b.float()).abs().max().item()) for i, (a, b) in enumerate(zip(plain, again))
                  if not torch.equal(a, b)]
        assert not differ, (len(save_ops), differ)


def _fresh(block):
    clone = copy.deepcopy(block)
    clone.zero_grad(set_to_none=True)
    return clone


def test_transformers_model_with_fused_kernels_matches_the_unmodified_model():
    """Note [Fused kernels in transformers models]: a Qwen3-shaped transformers model (q / k norms) in bf16 with the
    fused kernels against the unmodified bf16 model, both against the fp32 model: logits and every gradient within
    2x (+ 1e-3) of the unmodified model's own error."""
    transformers = pytest.importorskip("transformers")
    from lightning_seqpar.hf.fused import apply_hf_fused_kernels

    config = transformers.Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).cuda()
    plain = copy.deepcopy(reference).bfloat16()
    fast = copy.deepcopy(plain)
    assert apply_hf_fused_kernels(fast) == 2 * 5 + 1
    ids = torch.randint(0, 512, (1, 2048), device="cuda")

    def run(model):
        model.zero_grad()
        logits = model(ids).logits
        logits.float().square().mean().backward()
        return [logits.detach(), *(p.grad for p in model.parameters())]

    ref, slow, quick = run(reference), run(plain), run(fast)
    for r, s, q in zip(ref, slow, quick):
        assert _rel(q, r) <= 2 * _rel(s, r) + 1e-3, (_rel(q, r), _rel(s, r))

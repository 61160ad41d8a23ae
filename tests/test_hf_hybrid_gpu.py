"""The hybrid models' sequence-parallel twins on one GPU with fla-core's kernels (kernel="fla") against
the unmodified transformers model, and with the package's torch kernels against it: a
Qwen3-Next-shaped and a Bamba-shaped model (a few layers), bf16 autocast, S = 4096; skipped without
CUDA; the fla-core kernels only where fla-core is installed and runs on the GPU (it refuses Hopper
with Triton < 3.7.1, see lightning_seqpar.attention.recurrent._fla_unusable).

    pytest -s tests/test_hf_hybrid_gpu.py
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _kernels() -> list[str]:
    """The package's torch kernels always; fla-core's where it is installed and usable on this GPU."""
    from lightning_seqpar.attention.recurrent import _fla_unusable

    if importlib.util.find_spec("fla") is None:
        return ["torch"]
    why = _fla_unusable(torch.cuda.current_device())
    if why is not None:
        print(f"[hf-hybrid-gpu] fla-core not tested: {why}")
        return ["torch"]
    return ["torch", "fla"]

S, VOCAB = 4096, 1024


def _config(kind: str):
    common = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=S, attention_dropout=0.0)
    if kind == "qwen3_next":
        return transformers.Qwen3NextConfig(**common, head_dim=64, num_experts=0, linear_num_key_heads=4,
                                            linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                            linear_conv_kernel_dim=4,
                                            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"])
    return transformers.BambaConfig(**common, attn_layer_indices=[3], mamba_n_heads=8, mamba_d_head=64, mamba_n_groups=1,
                                    mamba_d_state=64, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=64)


def _step(model, ids, wrapped: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if wrapped:
            logits = model(ids, torch.arange(S, device="cuda")[None])
        else:
            logits = model(input_ids=ids, position_ids=torch.arange(S, device="cuda")[None], use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1)[:-1], ids.flatten()[1:])
    loss.backward()
    params = model.hf.named_parameters() if wrapped else model.named_parameters()
    return logits.float(), loss.detach(), {n.removeprefix("base_model.model."): p.grad.float() for n, p in params}


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("kind", ["qwen3_next", "bamba"])
def test_fla_twins_match_torch_twins_and_transformers(kind):
    from lightning_seqpar.attention.recurrent import Recurrence
    from lightning_seqpar.hf import HFCausalLM

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32).cuda().train()
    ids = torch.randint(0, VOCAB, (1, S), device="cuda")
    ref_logits, ref_loss, ref_grads = _step(copy.deepcopy(base), ids, wrapped=False)
    results = {}
    for kernel in _kernels():
        model = HFCausalLM(copy.deepcopy(base))
        for m in model.modules():
            if isinstance(m, Recurrence):
                m.configure(mesh=None, kernel=kernel)
        results[kernel] = _step(model, ids, wrapped=True)
    for kernel, (logits, loss, grads) in results.items():
        errs = {"logits": _rel(logits, ref_logits), "loss": abs(loss.item() - ref_loss.item())}
        errs.update({f"d{n}": _rel(grads[n], g) for n, g in ref_grads.items() if g is not None})
        worst = max(((k, v) for k, v in errs.items() if k != "loss"), key=lambda kv: kv[1])
        print(f"[hf-hybrid-gpu] {kind} kernel={kernel}: logits {errs['logits']:.2e}, |dloss| {errs['loss']:.2e}, "
              f"worst grad {worst[0]} {worst[1]:.2e}")
        assert errs["logits"] < 2e-2 and errs["loss"] < 2e-2, (kind, kernel, errs)  # bf16 autocast on both sides
        assert worst[1] < 5e-2, (kind, kernel, worst)

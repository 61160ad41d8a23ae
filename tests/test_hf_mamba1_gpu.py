"""Mamba1's selective scan and the Mamba1 twins on one GPU (fp32): the chunked kernel against a float64 token
recurrence, and Mamba- / Jamba-shaped models (a few layers, S = 2048) with their mixers replaced against the
unmodified transformers model (its torch path): logits and every gradient. Skipped without CUDA.

    pytest -s tests/test_hf_mamba1_gpu.py
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

S, VOCAB = 2048, 1024


def test_selective_scan_on_the_gpu_matches_a_float64_recurrence():
    from test_recurrent import naive_selective, selective_inputs

    from lightning_seqpar.attention.recurrent import selective_scan

    s = selective_inputs(B=1, T=512, E=64, G=1, N=16)
    want = naive_selective(**s)
    for chunk in (8, 16, 32):
        got = selective_scan(*(t.cuda() for t in (s["x"], s["dt"], s["A"], s["Bm"], s["C"], s["D"])), chunk_size=chunk)
        torch.testing.assert_close(got.cpu().double(), want, atol=1e-4, rtol=1e-4, msg=lambda m, c=chunk: f"chunk={c}: {m}")


def _config(kind: str):
    if kind == "mamba":
        return transformers.MambaConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, state_size=16,
                                        expand=2, conv_kernel=4, time_step_rank=16)
    return transformers.JambaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                                    expert_layer_period=2, expert_layer_offset=1, num_experts=2, mamba_d_state=16,
                                    mamba_dt_rank=16, max_position_embeddings=S)


@pytest.mark.parametrize("kind", ["mamba", "jamba"])
def test_twins_match_the_unmodified_model_on_the_gpu(kind):
    from lightning_seqpar.hf.hybrid import apply_hf_hybrid

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(kind), attn_implementation="eager",
                                                          dtype=torch.float32).cuda().train()
    twin = copy.deepcopy(model)
    assert apply_hf_hybrid(twin) >= 1
    ids = torch.randint(0, VOCAB, (1, S), device="cuda")
    outs = []
    for m in (model, twin):
        logits = m(input_ids=ids, use_cache=False).logits
        torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (ref, ref_grads), (got, grads) = outs
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    for name, g in ref_grads.items():
        err = float((grads[name] - g).abs().max())
        assert err <= 1e-3 * max(float(g.abs().max()), 1e-6), f"{kind} {name}: max error {err:.3g}, max |grad| {float(g.abs().max()):.3g}"

"""Note [Fused kernels in transformers models] on the CPU: which layers get the fused forward, that the model then
computes what the unmodified model does bitwise (the torch path), that saving and loading are unchanged, and that
the memory planner counts them. The fused kernels themselves: tests/test_fused_gpu.py.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_testing import tiny_config


@pytest.mark.parametrize("kind, norms_per_layer", [("llama", 2), ("qwen3", 4), ("mistral", 2)])
def test_fused_layers_compute_the_unmodified_model_bitwise(kind, norms_per_layer):
    from lightning_seqpar.hf.fused import apply_hf_fused_kernels

    torch.manual_seed(0)
    config = tiny_config(kind)
    model = transformers.AutoModelForCausalLM.from_config(config)
    patched = copy.deepcopy(model)
    layers = config.num_hidden_layers
    assert apply_hf_fused_kernels(patched) == layers * (norms_per_layer + 1) + 1  # + the MLPs, + the final norm
    assert "forward" in vars(patched.model.norm) and "forward" in vars(patched.model.layers[0].mlp)
    assert patched.state_dict().keys() == model.state_dict().keys()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    outs = []
    for m in (model, patched):
        m.zero_grad()
        logits = m(ids).logits
        logits.square().mean().backward()
        outs.append([logits, *(p.grad for p in m.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    buffer = io.BytesIO()  # a pickled module unpickles (with its class's own forward: the same results)
    torch.save(patched.model.layers[0], buffer)
    buffer.seek(0)
    layer = torch.load(buffer, weights_only=False)
    assert "forward" not in vars(layer.mlp) or layer.mlp.forward.__self__ is layer.mlp


def test_other_models_keep_their_own_forward():
    from lightning_seqpar.hf.fused import apply_hf_fused_kernels

    gemma = transformers.AutoModelForCausalLM.from_config(tiny_config("gemma"))  # 1 + weight, gelu MLP
    assert apply_hf_fused_kernels(gemma) == 0
    gelu = transformers.AutoModelForCausalLM.from_config(tiny_config("llama", hidden_act="gelu"))
    assert apply_hf_fused_kernels(gelu) == 2 * gelu.config.num_hidden_layers + 1  # the norms only


def test_hf_causal_lm_applies_them_and_the_planner_counts_them(monkeypatch):
    from lightning_seqpar.hf import HFCausalLM
    from lightning_seqpar.models import fused
    from lightning_seqpar.planner.model_shape import TransformerShape

    model = HFCausalLM(transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3")))
    assert "forward" in vars(model.hf.model.layers[0].self_attn.q_norm)
    monkeypatch.setattr(fused, "fused_kernels_available", lambda: True)
    assert TransformerShape.from_config(tiny_config("qwen3")).fused_elementwise
    assert not TransformerShape.from_config(tiny_config("gemma")).fused_elementwise
    assert not TransformerShape.from_config(tiny_config("llama", hidden_act="gelu")).fused_elementwise
    monkeypatch.setenv("SEQPAR_FUSED_KERNELS", "0")
    assert not TransformerShape.from_config(tiny_config("qwen3")).fused_elementwise

"""Hugging Face causal LMs under SequenceParallelStrategy (CPU, gloo, fp32).

Tiny random-weight Llama, Qwen2 (tied embeddings, q/k/v biases) and Mistral (sliding window ==
sequence length) configs from transformers, GQA (4 query heads, 2 KV heads): the full logits,
the logged loss and every parameter gradient of a training step under the strategy equal the
UNMODIFIED transformers model (eager attention) on one device, for sp = 2 and 4, ring and
all-gather (and Ulysses at sp = 2); the consolidated save_pretrained folder written at the end
of training loads back with from_pretrained and reproduces the trained weights.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402
from hf_testing import BATCH, SEQ_LEN, batch, reference, save_tiny_model, tiny_config, train_each  # noqa: E402

KINDS = ("llama", "qwen2", "mistral")
TIMEOUT = 300
ATOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{kind: (folder, reference logits, loss, gradients)} for one batch."""
    root = tmp_path_factory.mktemp("hf-models")
    data = batch()
    out = {}
    for kind in KINDS:
        path = save_tiny_model(kind, str(root / kind))
        out[kind] = (path, *reference(path, data))
    return out, data


def _check(result, ref) -> None:
    _, logits, loss, grads = ref
    torch.testing.assert_close(result["logits"], logits, rtol=0, atol=ATOL)
    assert result["losses"][0] == pytest.approx(float(loss), rel=1e-6)
    assert result["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=name)


# all-gather at 4 ranks: tests/test_attention.py and the hybrid / LoRA tests (it took 9 s here)
@pytest.mark.parametrize("world,attention", [(2, "ring"), (2, "allgather"), (4, "ring"), (2, "ulysses")])
def test_hf_models_match_the_unmodified_model(world, attention, models):
    refs, data = models
    results = run_distributed(train_each, world, [refs[k][0] for k in KINDS], data,
                              strategy_kwargs={"attention": attention}, timeout=TIMEOUT)[0]
    for kind, result in zip(KINDS, results):
        assert result["logits"].shape == (BATCH, SEQ_LEN, tiny_config(kind).vocab_size)
        _check(result, refs[kind])


def test_chunked_loss_and_no_checkpointing(models):
    """loss_chunk_size (hidden states @ lm_head.weight outside the model's forward) with tied (Qwen2) and untied heads."""
    refs, data = models
    kinds = ("llama", "qwen2")
    results = run_distributed(train_each, 2, [refs[k][0] for k in kinds], data, loss_chunk_size=24,
                              strategy_kwargs={"attention": "ring", "activation_checkpointing": None}, timeout=TIMEOUT)[0]
    for kind, result in zip(kinds, results):
        ref = refs[kind]
        assert result["losses"][0] == pytest.approx(float(ref[2]), rel=1e-6)
        for name, grad in ref[3].items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=name)


def test_offloaded_checkpoints_and_mlp_slices(models):
    """offload_checkpoints and mlp_chunk_size on Hugging Face decoder layers (their ``mlp`` child;
    RoPE cos/sin and masks need no gradient and stay on the device)."""
    refs, data = models
    results = run_distributed(train_each, 2, [refs[k][0] for k in KINDS], data, timeout=TIMEOUT,
                              strategy_kwargs={"attention": "ring", "offload_checkpoints": True, "mlp_chunk_size": 5})[0]
    for kind, result in zip(KINDS, results):
        _check(result, refs[kind])


def test_offloaded_parameters(models):
    """offload_params (FSDP2's CPUOffloadPolicy) on Hugging Face models, Qwen2's tied embedding and head included."""
    refs, data = models
    results = run_distributed(train_each, 2, [refs[k][0] for k in KINDS], data, timeout=TIMEOUT,
                              strategy_kwargs={"attention": "ring", "offload_params": True})[0]
    for kind, result in zip(KINDS, results):
        _check(result, refs[kind])


def test_save_pretrained_round_trip(models, tmp_path):
    """hf_save_dir: the folder written after 2 steps under the strategy is a plain transformers model with the trained weights."""
    refs, data = models
    out = tmp_path / "trained"
    result = run_distributed(train_each, 2, [refs["qwen2"][0]], data, steps=2, hf_save_dir=str(out), full_state=True,
                             strategy_kwargs={"attention": "ring"}, timeout=TIMEOUT)[0][0]
    assert len(result["losses"]) == 2
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    assert loaded.config._attn_implementation != "seqpar"  # nothing of the package is saved
    state = loaded.state_dict()
    assert state.keys() == result["state"].keys()
    for name, value in result["state"].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    initial = transformers.AutoModelForCausalLM.from_pretrained(refs["qwen2"][0], dtype=torch.float32).state_dict()
    assert not torch.equal(initial["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.q_proj.weight"])
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied

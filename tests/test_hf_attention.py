"""lightning_seqpar.hf on one process: registration, no 4-D mask, exactness, and the clear errors."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_testing import SEQ_LEN, batch, save_tiny_model, tiny_config  # noqa: E402

from lightning_seqpar import CausalLMModule  # noqa: E402
from lightning_seqpar.attention import Attention  # noqa: E402
from lightning_seqpar.hf import (  # noqa: E402
    ATTN_IMPLEMENTATION,
    HFCausalLM,
    apply_hf_attention,
    seqpar_attention_forward,
)


def _model(kind: str = "llama", **overrides):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)


def _unmodified(model):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    return ref


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral", "qwen3", "gemma", "gemma3"])
def test_local_run_equals_the_unmodified_model(kind):
    model = _model(kind)
    ref = _unmodified(model)
    wrapped = HFCausalLM(model)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert ref.config._attn_implementation == "eager"
    data = batch()
    expected = ref(input_ids=data["input_ids"], position_ids=data["position_ids"]).logits
    torch.testing.assert_close(wrapped(data["input_ids"], data["position_ids"]), expected, rtol=0, atol=1e-5)
    hidden = wrapped(data["input_ids"], data["position_ids"], output="hidden")
    torch.testing.assert_close(hidden @ wrapped.lm_head.weight.T, expected, rtol=0, atol=1e-5)


def test_apply_hf_attention_adds_parameter_free_children():
    model = _model("llama")
    keys = set(model.state_dict())
    assert apply_hf_attention(model) == 2
    children = [layer.self_attn.seqpar_attention for layer in model.model.layers]
    assert all(isinstance(c, Attention) and c.mesh is None and c.causal for c in children)
    assert children[0].scale == pytest.approx(model.model.layers[0].self_attn.scaling)
    assert set(model.state_dict()) == keys  # no parameters, no buffers
    assert apply_hf_attention(model) == 2  # idempotent: the same children
    assert model.model.layers[0].self_attn.seqpar_attention is children[0]


def test_no_4d_mask_is_materialised():
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    import inspect

    model = _model("mistral")
    apply_hf_attention(model)
    n = 8192
    for make in (create_causal_mask, create_sliding_window_causal_mask):
        params = inspect.signature(make).parameters
        kwargs = {"config": model.config, "attention_mask": None, "past_key_values": None,
                  "position_ids": torch.arange(n).unsqueeze(0)}
        kwargs["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = torch.zeros(1, n, 4, device="meta")
        if "cache_position" in params:  # transformers 4.x
            kwargs["cache_position"] = torch.arange(n)
        assert make(**kwargs) is None


def test_gqa_keys_and_values_keep_their_heads():
    model = _model("llama")
    apply_hf_attention(model)
    seen = []
    layer = model.model.layers[0].self_attn
    layer.seqpar_attention.register_forward_pre_hook(lambda m, args: seen.append([a.shape for a in args]))
    data = batch()
    model(input_ids=data["input_ids"], position_ids=data["position_ids"])
    (q, k, v), = seen
    assert q == (2, SEQ_LEN, 4, 8) and k == v == (2, SEQ_LEN, 2, 8)  # [B, S, H, D]: 2 KV heads, not repeated


@pytest.mark.parametrize("kind, overrides", [
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("gemma2", {}),  # attention logit soft-capping 50
])
def test_windows_and_soft_capping_run_exactly(kind, overrides):
    """Sliding windows shorter than the sequence and soft-capped scores are computed, not refused
    (Note [Reading a layer's attention features])."""
    model = _model(kind, **overrides)
    ref = _unmodified(model)
    wrapped = HFCausalLM(model, max_seq_len=SEQ_LEN)
    data = batch()
    expected = ref(input_ids=data["input_ids"], position_ids=data["position_ids"]).logits
    torch.testing.assert_close(wrapped(data["input_ids"], data["position_ids"]), expected, rtol=0, atol=1e-5)


def test_dropout_in_training_is_rejected():
    model = HFCausalLM(_model("llama", attention_dropout=0.1))
    data = batch()
    model.eval()
    model(data["input_ids"], data["position_ids"])  # no dropout in eval
    model.train()
    with pytest.raises(ValueError, match="config.attention_dropout"):
        model(data["input_ids"], data["position_ids"])


def test_padding_mask_is_rejected_and_a_full_mask_accepted():
    model = _model("llama")
    apply_hf_attention(model)
    data = batch()
    ones = torch.ones_like(data["input_ids"])
    model(input_ids=data["input_ids"], attention_mask=ones)
    ones[1, -4:] = 0
    with pytest.raises(ValueError, match="attention_mask with padding"):
        model(input_ids=data["input_ids"], attention_mask=ones)


def test_other_unsupported_inputs_are_rejected():
    model = _model("llama")
    apply_hf_attention(model)
    layer = model.model.layers[0].self_attn
    q, kv = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    out, weights = seqpar_attention_forward(layer, q, kv, kv, None, scaling=layer.scaling)
    assert out.shape == (1, 8, 4, 8) and weights is None
    capped, _ = seqpar_attention_forward(layer, q, kv, kv, None, scaling=layer.scaling, softcap=0.5)  # a kwarg reaches the kernel
    assert not torch.allclose(capped, out)
    with pytest.raises(ValueError, match="sinks must have one logit per query head"):
        seqpar_attention_forward(layer, q, kv, kv, None, scaling=layer.scaling, s_aux=torch.zeros(3))
    with pytest.raises(ValueError, match="put document_ids"):
        seqpar_attention_forward(layer, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 8]))
    with pytest.raises(ValueError, match="takes no attention mask"):
        seqpar_attention_forward(layer, q, kv, kv, torch.zeros(1, 1, 8, 8))
    with pytest.raises(ValueError, match="query length 1 != key length 8"):
        seqpar_attention_forward(layer, q[:, :, :1], kv, kv, None)
    with pytest.raises(ValueError, match="is not causal"):
        seqpar_attention_forward(layer, q, kv, kv, None, is_causal=False)
    with pytest.raises(ValueError, match="scaling=0.5"):
        seqpar_attention_forward(layer, q, kv, kv, None, scaling=0.5)
    bare = _model("llama").model.layers[0].self_attn
    with pytest.raises(ValueError, match="no `seqpar_attention` child.*apply_hf_attention"):
        seqpar_attention_forward(bare, q, kv, kv, None)
    with pytest.raises(ValueError, match="must be a transformers.PreTrainedModel"):
        apply_hf_attention(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="max_seq_len"):
        apply_hf_attention(model, max_seq_len=0)


def test_position_ids_are_required_under_sequence_parallelism():
    wrapped = HFCausalLM(_model("llama"))
    wrapped.hf.model.layers[0].self_attn.seqpar_attention.mesh = object()  # as if configured by the strategy
    with pytest.raises(ValueError, match="position_ids"):
        wrapped(batch()["input_ids"])


def test_chunked_loss_refuses_transformed_logits():
    wrapped = HFCausalLM(_model("llama"))
    wrapped.hf.config.logit_scale = 0.5
    data = batch()
    with pytest.raises(ValueError, match="logit_scale=0.5.*loss_chunk_size=None"):
        wrapped(data["input_ids"], data["position_ids"], output="hidden")
    wrapped.hf.config.logit_scale = 1.0
    wrapped.hf.config.final_logit_softcapping = 30.0  # applied by the chunked loss itself
    wrapped(data["input_ids"], data["position_ids"], output="hidden")
    assert wrapped.logit_softcap == 30.0


# --------------------------------------------------------------------------------------------- CausalLMModule


def test_module_accepts_a_folder_a_config_a_dict_and_a_model(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "llama"))
    data = batch()
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    expected = ref(input_ids=data["input_ids"], position_ids=data["position_ids"]).logits

    from_folder = CausalLMModule(path)
    assert from_folder.hparams["model"] == path and from_folder.config.model_type == "llama"
    from_folder.configure_model()
    assert isinstance(from_folder.model, HFCausalLM)
    torch.testing.assert_close(from_folder(data["input_ids"], data["position_ids"]), expected, rtol=0, atol=1e-5)
    loss, n = from_folder.loss_sum(data)
    assert int(n) == SEQ_LEN * 2 - 1
    chunked = CausalLMModule(path, loss_chunk_size=7)
    chunked.configure_model()
    torch.testing.assert_close(chunked.loss_sum(data)[0], loss, rtol=1e-6, atol=0)

    config = tiny_config("qwen2")
    for source in (config, config.to_dict()):
        module = CausalLMModule(source, init_seed=3)
        assert module.hparams["model"]["model_type"] == "qwen2"
        module.configure_model()
        assert type(module.model.hf).__name__ == "Qwen2ForCausalLM"
    assert config._attn_implementation != ATTN_IMPLEMENTATION  # the caller's config is not changed
    again = CausalLMModule(**{**module.hparams})  # what load_from_checkpoint does
    again.configure_model()
    for (name, a), b in zip(module.model.state_dict().items(), again.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)  # same init_seed, same weights

    given = CausalLMModule(ref)
    assert given.model.hf is ref and ref.config._attn_implementation == ATTN_IMPLEMENTATION
    given.configure_model()  # keeps the given model
    assert given.model.hf is ref and [n for n, _ in given.named_children()] == ["model", "val_loss"]
    assert given.hparams["model"]["model_type"] == "llama"

    module._count_flops(data, None)
    assert module.flops_per_batch == module.model.flops_per_token(SEQ_LEN) * 2 * SEQ_LEN > 0


def test_module_saves_a_hugging_face_folder_without_a_process_group(tmp_path):
    module = CausalLMModule(tiny_config("mistral"), hf_save_dir=str(tmp_path / "out"))
    module.configure_model()
    module.on_train_end()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32)
    for name, value in module.model.hf.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], value, rtol=0, atol=0, msg=name)
    data = batch()
    torch.testing.assert_close(loaded(input_ids=data["input_ids"]).logits, module(data["input_ids"], data["position_ids"]),
                               rtol=0, atol=1e-5)


def test_module_errors_name_the_argument(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="hf_save_dir is only for Hugging Face models"):
        CausalLMModule("tiny", hf_save_dir=str(tmp_path))
    with pytest.raises(ValueError, match="save_hf_pretrained is for Hugging Face models"):
        CausalLMModule("tiny").save_hf_pretrained(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text('{"model_type": "llama"}')
    assert CausalLMModule("tiny").hparams["model"] == "tiny"  # a named config wins over a folder of that name
    assert CausalLMModule("./tiny").config.model_type == "llama"
    with pytest.raises(ValueError, match="neither a named config nor a local Hugging Face model folder"):
        CausalLMModule(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match="unknown Llama config"):
        CausalLMModule("llama-1t")

"""Position-dependent features of Hugging Face models: exact under sharding, or refused by name (issue #21).

Note [Exact or refused: position-dependent layers of Hugging Face models] in lightning_seqpar.hf.support.
Exact (CPU, gloo, fp32; full logits, logged loss and every gradient of a training step under the
strategy vs the UNMODIFIED transformers model on one process, atol 1e-5): dynamic-NTK Llama and
LongRoPE Phi-3 beyond their length thresholds, MoE router auxiliary losses (Mixtral, Qwen2-MoE,
with sp = 1 against transformers' own loss for Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE), windows and
chunks that cover the sequence. Refused with a ValueError naming the layer and the config field,
before any communication (a stand-in mesh that cannot communicate proves it): shorter windows
read from the layer (Qwen2-MoE) or the config, Llama 4 chunks, Llama 4 temperature tuning when
sharded from config.floor_scale tokens on, convolution / SSM / linear-attention layers (LFM2, Bamba, Qwen3-Next).
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dist_utils import run_distributed  # noqa: E402
from hf_testing import BATCH, SEQ_LEN, batch, reference, save_tiny_model, tiny_config, train_each  # noqa: E402

from lightning_seqpar.hf import HFCausalLM, apply_hf_attention  # noqa: E402
from lightning_seqpar.hf.features import attention_features, attention_kwargs  # noqa: E402
from lightning_seqpar.hf.moe import router_aux  # noqa: E402
from lightning_seqpar.hf.rope import GlobalLengthRotary, reads_sequence_length  # noqa: E402
from lightning_seqpar.hf.support import find_token_mixers  # noqa: E402
from lightning_seqpar.loss import chunked_cross_entropy_sum, token_cross_entropy_sum  # noqa: E402

ATOL = 1e-5
TIMEOUT = 300


def _model(kind: str, **overrides):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), dtype=torch.float32)


def _as_if_sharded(wrapped: HFCausalLM, sp: int) -> None:
    """Give the Attention children a stand-in mesh of ``sp`` ranks that cannot communicate: whatever
    raises with it raised before any collective."""
    fake = types.SimpleNamespace(size=lambda *a: sp, get_all_groups=lambda: pytest.fail("communicated"))
    for m in wrapped._attention_modules:
        m.mesh = fake


def _local_loss_and_grads(wrapped: HFCausalLM, data, output: str = "logits"):
    wrapped.zero_grad()
    out = wrapped(data["input_ids"], data["position_ids"], output=output)
    if output == "logits":
        loss_sum, n = token_cross_entropy_sum(out, data["labels"])
    else:
        loss_sum, n = chunked_cross_entropy_sum(out, wrapped.lm_head.weight, data["labels"], chunk_size=7,
                                                softcap=wrapped.logit_softcap)
    loss = loss_sum / n
    aux = wrapped.router_aux_loss(None)
    if aux is not None:
        loss = loss + aux
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in wrapped.hf.named_parameters()}


def _unmodified_loss_and_grads(model, data):
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    out = ref(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=False)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), data["labels"].flatten(), ignore_index=-100)
    if getattr(ref.config, "output_router_logits", False):
        loss = loss + ref.router_aux_loss_coef * out.aux_loss  # transformers' own auxiliary loss
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in ref.named_parameters()}, out.logits.detach()


# --------------------------------------------------------------------------------------------- one process


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe"])
def test_router_aux_loss_equals_transformers_own_at_sp1(kind):
    model = _model(kind)
    expected, grads, _ = _unmodified_loss_and_grads(model, batch())
    wrapped = HFCausalLM(model)
    assert router_aux(model).coef == pytest.approx(0.1)
    for output in ("logits", "hidden"):
        loss, got = _local_loss_and_grads(wrapped, batch(), output)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
        assert got.keys() == grads.keys()
        for name, grad in grads.items():
            if grad is None:  # an expert no token was routed to
                assert got[name] is None or not got[name].any(), name
                continue
            torch.testing.assert_close(got[name], grad, rtol=0, atol=ATOL, msg=name)
    gate = [n for n in grads if n.endswith(".gate.weight")][0]  # the router
    without = _model(kind, output_router_logits=False)  # the auxiliary loss does move the router's gradient
    _, plain = _local_loss_and_grads(HFCausalLM(without), batch())
    assert not torch.allclose(plain[gate], grads[gate], atol=1e-6)


def test_router_aux_loss_of_another_family_is_refused():
    config = transformers.PhimoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                       output_router_logits=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"PhimoeForCausalLM \(model_type='phimoe'\).*output_router_logits=True"):
        HFCausalLM(model)
    model.config.output_router_logits = False
    HFCausalLM(model)


def test_router_aux_loss_refuses_padding_from_the_strategy():
    from lightning_seqpar import CausalLMModule

    module = CausalLMModule(tiny_config("mixtral"))
    module.configure_model()
    module._trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(pad_to_multiple=True))
    with pytest.raises(ValueError, match="router auxiliary loss.*pad_to_multiple=True"):
        module.training_step(batch(), 0)


@pytest.mark.parametrize("kind", ["llama-dynamic", "phi3-longrope"])
def test_length_dependent_rope_is_hooked_and_exact_on_one_rank(kind):
    model = _model(kind)
    rotary = model.model.rotary_emb
    assert reads_sequence_length(rotary)
    assert not reads_sequence_length(_model("llama").model.rotary_emb)
    expected, grads, logits = _unmodified_loss_and_grads(model, batch())
    wrapped = HFCausalLM(model)
    HFCausalLM(model)  # applied twice: one pair of hooks
    ours = [h for h in rotary._forward_pre_hooks.values() if isinstance(getattr(h, "__self__", None), GlobalLengthRotary)]
    assert len(ours) == 1
    torch.testing.assert_close(wrapped(batch()["input_ids"], batch()["position_ids"]), logits, rtol=0, atol=ATOL)
    loss, got = _local_loss_and_grads(wrapped, batch())
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


def _assert_exact(model, data, output: str = "logits") -> None:
    """HFCausalLM on one process equals the unmodified model: logits, loss, every gradient."""
    expected, ref_grads, logits = _unmodified_loss_and_grads(model, data)
    wrapped = HFCausalLM(copy.deepcopy(model))
    if output == "logits":
        torch.testing.assert_close(wrapped(data["input_ids"], data["position_ids"]), logits, rtol=0, atol=ATOL)
    loss, grads = _local_loss_and_grads(wrapped, data, output)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=ATOL)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=ATOL, msg=lambda m: f"{name}: {m}")


def test_qwen2_moe_window_is_read_from_the_layer():
    """Qwen2-MoE keeps its window in ``self.sliding_window`` and never passes it to the attention call:
    read from the layer, and computed (window 8 < S = 32)."""
    model = _model("qwen2_moe", output_router_logits=False, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    features = attention_features(model.model.layers[0].self_attn, {})
    assert features.window == 8 and features.window_field == "config.sliding_window=8 with config.layer_types[0]='sliding_attention'"
    assert attention_features(model.model.layers[1].self_attn, {}).plain  # a full-attention layer
    assert attention_kwargs(features, seq_len=SEQ_LEN)["window"] == 8
    assert attention_kwargs(features, seq_len=8)["window"] is None  # covers the sequence: the dense kernels run
    _assert_exact(model, batch())


@pytest.mark.parametrize("kind, overrides, output", [
    ("mistral", {"sliding_window": 8}, "logits"),
    ("gemma2", {"sliding_window": 8}, "logits"),  # soft-capped attention on every layer, a window on the sliding ones
    ("gemma2", {"sliding_window": 8}, "hidden"),  # + final_logit_softcapping in the chunked loss
    ("gpt_oss", {"sliding_window": 8}, "logits"),  # sinks on every layer, a window on the sliding ones
])
def test_windows_softcaps_and_sinks_are_exact(kind, overrides, output):
    model = _model(kind, **overrides)
    if kind == "gemma2":
        assert model.config.attn_logit_softcapping and model.config.final_logit_softcapping
    if kind == "gpt_oss":
        assert isinstance(model.model.layers[0].self_attn.sinks, torch.nn.Parameter)
        torch.nn.init.normal_(model.model.layers[0].self_attn.sinks)  # zeros at init: make them bite
    _assert_exact(model, batch(), output)


def test_window_from_the_config_alone():
    """A layer with neither a kwarg nor an attribute: config.layer_types / config.sliding_window decide."""
    layer = types.SimpleNamespace(layer_idx=1, config=types.SimpleNamespace(layer_types=["full_attention", "sliding_attention"],
                                                                             sliding_window=16))
    assert attention_features(layer).window == 16
    layer.layer_idx = 0
    assert attention_features(layer).window is None
    mistral_like = types.SimpleNamespace(config=types.SimpleNamespace(sliding_window=12))
    assert attention_features(mistral_like).window == 12
    assert attention_features(types.SimpleNamespace(config=types.SimpleNamespace(sliding_window=12, use_sliding_window=False))).window is None
    assert attention_features(mistral_like, {"sliding_window": 4}).window == 4  # the call's kwarg first


def test_llama4_chunked_attention():
    model = _model("llama4", attention_chunk_size=8)
    features = attention_features(model.model.layers[0].self_attn)
    assert features.chunk_size == 8 and attention_features(model.model.layers[1].self_attn).chunk_size is None
    assert features.chunk_field == "config.attention_chunk_size=8 with config.layer_types[0]='chunked_attention'"
    _assert_exact(model, batch())  # chunks of 8 < S = 32
    _assert_exact(_model("llama4"), batch())  # chunk = SEQ_LEN: one chunk covers the sequence


def test_llama4_temperature_tuning_exact_on_one_rank_refused_when_sharded():
    model = _model("llama4", attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1)
    data = batch()
    _, _, logits = _unmodified_loss_and_grads(model, data)
    wrapped = HFCausalLM(model)
    torch.testing.assert_close(wrapped(data["input_ids"], data["position_ids"]), logits, rtol=0, atol=ATOL)
    _as_if_sharded(wrapped, 2)
    with pytest.raises(ValueError, match=r"Llama4TextAttention \(layer 1\) scales its queries with attention temperature tuning "
                                         r"\(config.attn_temperature_tuning=True on a NoPE layer, config.no_rope_layers\[1\]=0, "
                                         r"config.floor_scale=4\).*seq_len=32 >= floor_scale with sequence parallelism"):
        wrapped(data["input_ids"][:, :16], data["position_ids"][:, :16])


def test_mixers_the_package_cannot_shard_are_refused_by_name():
    from lightning_seqpar.hf import support as hf_support

    model = hf_support.build_tiny_model("rwkv")  # RWKV's time mixing: no sequence-parallel twin
    found = " ".join(find_token_mixers(model))
    assert "'rwkv.blocks.0' (RwkvBlock)" in found, found
    with pytest.raises(ValueError, match=r"mixes tokens with layers other than attention.*RwkvBlock.*only for "
                                         r"BambaMixer, FalconH1Mixer, FalconMambaMixer, GraniteMoeHybridMambaLayer"):
        HFCausalLM(model)
    assert getattr(model.config, "_attn_implementation", None) != "seqpar"  # refused before anything changed


@pytest.mark.parametrize("kind,twin", [("lfm2", "SeqparShortConv"), ("bamba", "SeqparMamba2Mixer"),
                                       ("qwen3_next", "SeqparGatedDeltaNet"), ("qwen3_5", "SeqparGatedDeltaNet")])
def test_hybrid_mixers_get_sequence_parallel_twins_and_stay_exact(kind, twin):
    """Note [Hybrid models under the strategy]: HFCausalLM replaces the mixer, on one rank the result
    is the unmodified model's (the sharded runs: tests/test_hf_hybrid.py)."""
    model = _model(kind)
    assert find_token_mixers(model) == [], kind
    wrapped = HFCausalLM(copy.deepcopy(model))
    assert wrapped._recurrent_mixers == (twin,)
    assert list(wrapped.hf.state_dict()) == list(model.state_dict())
    _assert_exact(model, batch())


def test_plain_models_have_no_token_mixers():
    for kind in ("llama", "qwen2", "mixtral", "llama4"):
        assert find_token_mixers(_model(kind)) == [], kind


# --------------------------------------------------------------------------------------------- under the strategy

EXACT = ("llama-dynamic", "phi3-longrope", "qwen2_moe-window")  # mixtral: below, with the chunked loss and dp = 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{kind: (folder, reference logits, loss, gradients)} for one batch."""
    root = tmp_path_factory.mktemp("hf-exact")
    data = batch()
    out = {}
    for kind in (*EXACT, "mixtral"):
        overrides = {}
        if kind == "qwen2_moe-window":  # a sliding layer whose window covers the sequence; router loss on
            kind_, overrides = "qwen2_moe", {"use_sliding_window": True, "sliding_window": SEQ_LEN, "max_window_layers": 2}
        else:
            kind_ = kind
        path = save_tiny_model(kind_, str(root / kind), **overrides)
        out[kind] = (path, *reference(path, data))
    return out, data


def _check(result, ref) -> None:
    _, logits, loss, grads = ref
    torch.testing.assert_close(result["logits"], logits, rtol=0, atol=ATOL)
    assert result["losses"][0] == pytest.approx(float(loss), rel=1e-6)
    assert result["grads"].keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=name)


@pytest.mark.parametrize("world,attention,layout", [(2, "ring", "zigzag"), (2, "ulysses", "contiguous"), (4, "ring", "contiguous")])
def test_exact_under_the_strategy(world, attention, layout, models):
    """Length-dependent RoPE beyond its threshold; a MoE router loss with a window covering the sequence."""
    refs, data = models
    results = run_distributed(train_each, world, [refs[k][0] for k in EXACT], data, timeout=TIMEOUT,
                              strategy_kwargs={"attention": attention, "load_balance": layout})[0]
    for kind, result in zip(EXACT, results):
        assert result["logits"].shape == (BATCH, SEQ_LEN, tiny_config("llama").vocab_size), kind
        _check(result, refs[kind])


def test_router_aux_loss_with_the_chunked_loss_and_data_parallelism(models):
    """output="hidden" (loss_chunk_size) at sp = 2; and sp = 2 x dp = 2, where the router statistics are
    reduced over the data-parallel ranks too (the logged loss and gradients are those of the whole batch)."""
    refs, data = models
    kinds = ("mixtral", "qwen2_moe-window")
    results = run_distributed(train_each, 2, [refs[k][0] for k in kinds], data, loss_chunk_size=24, timeout=TIMEOUT,
                              strategy_kwargs={"attention": "ring"})[0]
    for kind, result in zip(kinds, results):  # the forward's output is the hidden states: loss and gradients
        _, _, loss, grads = refs[kind]
        assert result["losses"][0] == pytest.approx(float(loss), rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=name)
    result = run_distributed(train_each, 4, [refs["mixtral"][0]], data, timeout=TIMEOUT,
                             strategy_kwargs={"attention": "ring", "sequence_parallel_size": 2})[0][0]
    _, logits, loss, grads = refs["mixtral"]
    assert result["losses"][0] == pytest.approx(float(loss), rel=1e-6)
    torch.testing.assert_close(result["logits"], logits[: result["logits"].shape[0]], rtol=0, atol=ATOL)
    for name, grad in grads.items():
        torch.testing.assert_close(result["grads"][name], grad, rtol=0, atol=ATOL, msg=name)

"""Llama: shapes, GQA/MQA/odd heads against a naive reference, RoPE from global positions, configs."""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
import types

import pytest
import torch
from torch import nn


def _naive_attention(q, k, v, *, causal: bool = True, scale: float | None = None) -> torch.Tensor:
    """Reference: repeat K/V heads (HF order), materialise scores and mask. (B, S, H, D) layout."""
    B, S, H, D = q.shape
    rep = H // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * (scale if scale is not None else D**-0.5)
    if causal:
        scores = scores.masked_fill(~torch.ones(S, k.shape[1], dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.double()).to(q.dtype)


class _NaiveAttention(nn.Module):
    def __init__(self, *, causal: bool = True, scale: float | None = None) -> None:
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q, k, v):
        return _naive_attention(q, k, v, causal=self.causal, scale=self.scale)


@pytest.fixture(scope="module")
def llama():
    """``lightning_seqpar.models.llama``; with a private stand-in for ``Attention`` only while the
    attention package does not import yet (the stand-in never leaves this module's tests)."""
    try:
        importlib.import_module("lightning_seqpar.attention")
        yield importlib.import_module("lightning_seqpar.models.llama")
        return
    except ImportError:
        pass
    with pytest.MonkeyPatch.context() as mp:
        fake = types.ModuleType("lightning_seqpar.attention")
        fake.Attention = _NaiveAttention
        mp.setitem(sys.modules, "lightning_seqpar.attention", fake)
        for name in ("lightning_seqpar.models", "lightning_seqpar.models.llama"):
            mp.delitem(sys.modules, name, raising=False)
        yield importlib.import_module("lightning_seqpar.models.llama")
        for name in ("lightning_seqpar.models", "lightning_seqpar.models.llama"):
            sys.modules.pop(name, None)


TINY = ["tiny", "tiny-mha", "tiny-mqa", "tiny-3h"]


def _model(llama, name: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return llama.Llama(llama.LlamaConfig.from_name(name, **overrides))


def _ids(cfg, B: int = 2, S: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", TINY)
def test_forward_backward_shapes(llama, name):
    model = _model(llama, name)
    cfg = model.config
    ids = _ids(cfg)
    logits = model(ids)
    assert logits.shape == (2, 12, cfg.vocab_size) and logits.dtype == torch.float32
    hidden = model(ids, output="hidden")
    assert hidden.shape == (2, 12, cfg.n_embd)
    torch.testing.assert_close(model.lm_head(hidden), logits)
    torch.testing.assert_close(model.forward_hidden(ids), hidden)
    logits.float().logsumexp(-1).sum().backward()
    for name_, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name_
    assert isinstance(model.layers, nn.ModuleList) and all(type(b).__name__ == "LlamaBlock" for b in model.layers)


@pytest.mark.parametrize("name", ["tiny", "tiny-mqa", "tiny-3h"])
def test_matches_naive_attention_reference(llama, name):
    """The model's attention core (GQA/MQA without K/V repeat, odd head count) equals a naive
    repeat-K/V attention swapped into the same weights."""
    model = _model(llama, name)
    ids = _ids(model.config)
    out = model(ids)
    for block in model.layers:
        block.self_attn.attn_core = _NaiveAttention(causal=True)
    torch.testing.assert_close(out, model(ids), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_gqa_equals_mha_with_repeated_kv_weights(llama, n_kv_head):
    gqa = _model(llama, "tiny", n_kv_head=n_kv_head)
    mha = _model(llama, "tiny-mha", seed=1)
    cfg = gqa.config
    rep = cfg.n_head // n_kv_head
    state = {}
    for key, value in gqa.state_dict().items():
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            value = value.view(n_kv_head, cfg.head_dim, cfg.n_embd).repeat_interleave(rep, dim=0)
            value = value.reshape(-1, cfg.n_embd)
        state[key] = value
    mha.load_state_dict(state)
    ids = _ids(cfg)
    torch.testing.assert_close(gqa(ids), mha(ids), atol=2e-6, rtol=1e-5)


def test_default_positions_are_arange(llama):
    model = _model(llama, "tiny")
    ids = _ids(model.config)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    torch.testing.assert_close(model(ids), model(ids, pos), atol=0, rtol=0)
    torch.testing.assert_close(model(ids), model(ids, pos[:1]), atol=0, rtol=0)  # (1, S) broadcasts


def test_rope_is_relative(llama):
    """RoPE is the only position signal and is relative: shifting every position by c keeps the logits."""
    model = _model(llama, "tiny-3h")
    ids = _ids(model.config)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    torch.testing.assert_close(model(ids, pos + 1000), model(ids, pos), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(model(ids, pos.flip(-1)), model(ids, pos), atol=1e-3)


def test_rope_uses_global_position_ids(llama):
    """The rotation of a token comes from its position id, not its index in the (local) tensor:
    a zigzag shard's positions give the rows of the full table."""
    D, theta = 16, 10000.0
    full = llama.rope_freqs_cis(torch.arange(16)[None], head_dim=D, theta=theta)
    pos = torch.tensor([[0, 1, 2, 3, 12, 13, 14, 15]])  # rank 0 of a zigzag split over 2 ranks
    freqs_cis = llama.rope_freqs_cis(pos, head_dim=D, theta=theta)
    assert freqs_cis.shape == (1, 8, 1, D // 2) and freqs_cis.dtype == torch.complex64
    torch.testing.assert_close(freqs_cis, full[:, pos[0]], atol=0, rtol=0)
    # HF rotate-half convention: x * cos + rotate_half(x) * sin, angle = pos * theta^(-2i/D).
    x = torch.randn(1, 8, 3, D)
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos[0].double()[:, None] * torch.cat([inv, inv])  # (S, D)
    rot = torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1).double()
    ref = x.double() * ang.cos()[None, :, None] + rot * ang.sin()[None, :, None]
    torch.testing.assert_close(llama.apply_rope(x, freqs_cis).double(), ref, atol=1e-5, rtol=1e-5)
    assert llama.apply_rope(x.bfloat16(), freqs_cis).dtype == torch.bfloat16


def test_fused_entry_points_take_the_torch_path_on_the_cpu(llama, monkeypatch):
    """Note [Fused element-wise kernels]: on the CPU (and with SEQPAR_FUSED_KERNELS=0) the model's rope / rms_norm /
    silu_mul are the torch ops, bitwise."""
    import torch.nn.functional as F

    from lightning_seqpar.models import fused

    x, q, k = torch.randn(2, 8, 32), torch.randn(2, 8, 4, 16), torch.randn(2, 8, 2, 16)
    freqs = llama.rope_freqs_cis(torch.arange(8).expand(2, 8), head_dim=16, theta=10000.0)
    assert not fused.use_fused(x)
    monkeypatch.setenv("SEQPAR_FUSED_KERNELS", "0")
    assert not fused.use_fused(x)
    rq, rk = fused.rope(q, k, freqs)
    assert torch.equal(rq, llama.apply_rope(q, freqs)) and torch.equal(rk, llama.apply_rope(k, freqs))
    norm = llama.RMSNorm(32)
    xf = x.float()
    assert torch.equal(norm(x), norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)))
    assert torch.equal(fused.silu_mul(x, x + 1), F.silu(x) * (x + 1))


def test_bf16_forward(llama):
    model = _model(llama, "tiny").to(torch.bfloat16)
    logits = model(_ids(model.config))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_tied_embeddings_and_meta_init(llama):
    cfg = llama.LlamaConfig.from_name("tiny", tie_embeddings=True)
    with torch.device("meta"):
        model = llama.Llama(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.num_params() == cfg.num_params()
    assert model.num_params(non_embedding=True) == cfg.num_params(non_embedding=True)
    assert torch.isfinite(model(_ids(cfg))).all()
    std = model.embed_tokens.weight.std().item()
    assert abs(std - cfg.init_std) < 0.2 * cfg.init_std


def test_init_scales_residual_projections(llama):
    model = _model(llama, "tiny", n_layer=8)
    std, residual = 0.02, 0.02 / 4  # init_std / sqrt(2 * n_layer)
    for name, p in model.named_parameters():
        expected = 1.0 if "norm" in name else residual if name.endswith(("o_proj.weight", "down_proj.weight")) else std
        measured = p.mean().item() if "norm" in name else p.std().item()
        assert abs(measured - expected) < 0.1 * expected, name
    unscaled = _model(llama, "tiny", n_layer=8, scale_residual_init=False)
    assert abs(unscaled.layers[0].mlp.down_proj.weight.std().item() - std) < 0.1 * std


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("tie", [False, True])
def test_num_params_formula_matches_model(llama, name, tie):
    model = _model(llama, name, tie_embeddings=tie)
    cfg = model.config
    assert model.num_params() == cfg.num_params()
    assert model.num_params(non_embedding=True) == cfg.num_params(non_embedding=True)


def test_named_configs(llama):
    names = set(llama.CONFIGS)
    assert {"llama-7b", "llama-7b-gqa", "llama-33h", "llama-16h", "llama-8h", "llama-4h", "llama-2h", "llama3-8b",
            "tiny", "tiny-mha", "tiny-mqa", "tiny-3h"} <= names
    for name in names:
        cfg = llama.LlamaConfig.from_name(name)
        assert cfg.n_head % cfg.n_kv_head == 0 and cfg.head_dim % 2 == 0
    c7 = llama.LlamaConfig.from_name("llama-7b")
    assert (c7.n_embd, c7.n_layer, c7.n_head, c7.n_kv_head, c7.intermediate_size) == (4096, 32, 32, 32, 11008)
    assert c7.num_params() == 6_738_415_616  # Llama-2-7B
    assert llama.LlamaConfig.from_name("llama-7b-gqa").n_kv_head == 8
    c33 = llama.LlamaConfig.from_name("llama-33h")
    assert (c33.n_head, c33.head_dim, c33.n_embd, c33.intermediate_size) == (33, 128, 4224, 11008)
    for h in (16, 8, 4, 2):
        c = llama.LlamaConfig.from_name(f"llama-{h}h")
        assert (c.n_head, c.head_dim, c.n_embd, c.intermediate_size) == (h, 128, 128 * h, 11008)
        assert c.n_layer * c.n_head == 1024
        assert 4.4e9 < c.num_params() < 7.1e9
    assert llama.LlamaConfig.from_name("llama-16h").n_layer == 64  # LightSeq §4
    c3 = llama.LlamaConfig.from_name("llama3-8b")
    assert (c3.vocab_size, c3.n_kv_head, c3.intermediate_size, c3.rope_theta) == (128256, 8, 14336, 500000.0)
    assert c3.num_params() == 8_030_261_248  # Llama-3-8B
    assert llama.LlamaConfig.from_name("tiny", n_layer=3).n_layer == 3
    with pytest.raises(ValueError, match="unknown Llama config name='llama-13b'.*llama-7b"):
        llama.LlamaConfig.from_name("llama-13b")


def test_flops_per_token(llama):
    cfg = llama.LlamaConfig.from_name("llama-7b")
    n = cfg.num_params(non_embedding=True)
    assert n == cfg.num_params() - 32000 * 4096
    assert cfg.flops_per_token(4096) == 6 * n + 6 * 32 * 4096 * 4096
    tied = llama.LlamaConfig.from_name("tiny", tie_embeddings=True)
    untied = llama.LlamaConfig.from_name("tiny")
    assert tied.flops_per_token(64) == untied.flops_per_token(64)  # the head matmul is counted either way
    with pytest.raises(ValueError, match="seq_len"):
        cfg.flops_per_token(0)


def test_config_validation(llama):
    C = llama.LlamaConfig
    with pytest.raises(ValueError, match="n_head .6. must be a multiple of n_kv_head .4."):
        C(n_embd=96, n_head=6, n_kv_head=4)
    with pytest.raises(ValueError, match="set head_dim explicitly"):
        C(n_embd=100, n_head=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        C(n_embd=64, n_head=4, head_dim=15)
    cfg = C(vocab_size=64, n_embd=64, n_layer=1, n_head=3, head_dim=16, intermediate_size=32)  # H * D != d
    assert cfg.attn_dim == 48
    assert C(n_embd=4096, n_head=32).intermediate_size == 11008  # Llama's default rule


def test_explicit_head_dim_model_runs(llama):
    cfg = llama.LlamaConfig(
        vocab_size=64, n_embd=64, n_layer=1, n_head=3, n_kv_head=1, head_dim=16, intermediate_size=32
    )
    model = llama.Llama(cfg)
    assert model.layers[0].self_attn.q_proj.weight.shape == (48, 64)
    assert model(_ids(cfg, S=5)).shape == (2, 5, 64)


def test_bad_position_ids(llama):
    model = _model(llama, "tiny")
    ids = _ids(model.config)
    with pytest.raises(ValueError, match="position_ids must have the shape of input_ids"):
        model(ids, torch.arange(ids.shape[1] - 1)[None])
    with pytest.raises(ValueError, match="output='probs'"):
        model(ids, output="probs")


def test_model_file_does_not_import_torch_distributed(llama):
    tree = ast.parse(inspect.getsource(llama))
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith("torch.distributed")]
    assert "lightning_seqpar.attention" in imported

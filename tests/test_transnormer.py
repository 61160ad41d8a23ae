"""TransNormerLLM: the architecture against a naive float64 re-implementation, configs, decay
slopes, LRPE on global positions; under LASP (gloo, W = 2 and 4, both variants) the logits and
the gradient of every parameter equal the single-device model, and 5 training steps give the
same losses."""

from __future__ import annotations

import ast
import copy
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from dist_utils import run_distributed
from seqpar_testing import expected_index, mesh_1d, take
from test_lasp import naive_linear_attention

TINY = ("tnl-tiny", "tnl-tiny-6h")


def _model(name: str, seed: int = 0, **overrides):
    from lightning_seqpar.models import TransNormer, TransNormerConfig

    torch.manual_seed(seed)
    return TransNormer(TransNormerConfig.from_name(name, **overrides))


def _tnl_slopes(n: int) -> list[float]:
    """TNL's ``_build_slope_tensor`` (ALiBi), written out with math only."""
    def power_of_2(m):
        start = 2 ** (-(2 ** -(math.log2(m) - 3)))
        return [start * start**i for i in range(m)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    c = 2 ** math.floor(math.log2(n))
    return power_of_2(c) + _tnl_slopes(2 * c)[0::2][: n - c]


def _rms(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def naive_logits(model, input_ids, position_ids):
    """TNL's forward from the model's weights, in float64, with the quadratic attention formula."""
    cfg = model.config
    p = {n: t.detach().double() for n, t in model.named_parameters()}
    B, S = input_ids.shape
    H, D, L, eps = cfg.n_head, cfg.n_embd // cfg.n_head, cfg.n_layer, cfg.norm_eps
    slopes = torch.tensor(_tnl_slopes(H), dtype=torch.float64)
    x = p["embed_tokens.weight"][input_ids] * (math.sqrt(cfg.n_embd) if cfg.scale_embedding else 1.0)
    for layer in range(L):
        pre = f"layers.{layer}."
        h = _rms(x, eps)
        q, k, v, u = (h @ p[pre + "token_mixer.qkvu_proj.weight"].T).chunk(4, dim=-1)
        q, k, v = F.silu(q).view(B, S, H, D), F.silu(k).view(B, S, H, D), v.view(B, S, H, D)
        if layer == 0 and cfg.lrpe:
            angle = position_ids.double()[:, :, None, None] * p[pre + "token_mixer.lrpe.theta"].view(H, D)
            q = torch.cat([q * angle.cos(), q * angle.sin()], -1)
            k = torch.cat([k * angle.cos(), k * angle.sin()], -1)
        decay_log = -slopes * (1 - layer / (L - 1) + 1e-5)
        o, _ = naive_linear_attention(q, k, v, decay_log)
        x = x + (u * _rms(o.reshape(B, S, H * D), eps)) @ p[pre + "token_mixer.out_proj.weight"].T
        h = _rms(x, eps)
        glu = (h @ p[pre + "channel_mixer.l1.weight"].T) * (h @ p[pre + "channel_mixer.l2.weight"].T)  # no activation
        x = x + glu @ p[pre + "channel_mixer.l3.weight"].T
    return _rms(x, eps) @ p["lm_head.weight"].T


# ----------------------------------------------------------------------------------------------
# one device


@pytest.mark.parametrize("name", TINY)
def test_matches_naive_tnl(name):
    model = _model(name, chunk_size=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(19).expand(2, 19)
    logits = model(ids, pos)
    assert logits.shape == (2, 19, model.config.vocab_size) and logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), naive_logits(model, ids, pos), atol=1e-5, rtol=1e-5)
    assert model(ids, output="hidden").shape == (2, 19, model.config.n_embd)
    torch.testing.assert_close(model(ids), logits)  # position_ids default to arange(S)


def test_structure_follows_tnl():
    from lightning_seqpar.attention.lasp import LinearAttention
    from lightning_seqpar.models.transnormer import LRPE, SimpleRMSNorm

    model = _model("tnl-tiny-6h")
    names = {n for n, _ in model.named_parameters()}
    assert "layers.0.token_mixer.lrpe.theta" in names
    assert not any("lrpe" in n for n in names if not n.startswith("layers.0.")), "LRPE only on layer 0"
    assert not any("norm" in n for n in names), "SimpleRMSNorm has no weight"
    assert not any(n.endswith("bias") for n in names), "TNL has no biases"
    assert sum(isinstance(m, LinearAttention) for m in model.modules()) == model.config.n_layer
    assert sum(isinstance(m, LRPE) for m in model.modules()) == 1
    assert all(not list(m.parameters()) for m in model.modules() if isinstance(m, (SimpleRMSNorm, LinearAttention)))
    assert model.num_params() == model.config.num_params()
    assert model.num_params(non_embedding=True) == model.config.num_params(non_embedding=True)


def test_lrpe_and_decay_are_relative_in_global_positions():
    """Decay and LRPE depend on position differences only: shifting every position id by the
    same amount leaves the logits unchanged; the positions do reach the model."""
    model = _model("tnl-tiny")
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(16)[None]
    base = model(ids, pos)
    torch.testing.assert_close(model(ids, pos + 5), base, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(model(ids, pos * 2), base, atol=1e-3)


def test_decay_slopes():
    from lightning_seqpar.models.transnormer import alibi_slopes, tnl_decay_log

    for h in (1, 4, 6, 8, 12, 16, 33):
        torch.testing.assert_close(alibi_slopes(h), torch.tensor(_tnl_slopes(h), dtype=torch.float32))
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2 ** (-8 * (i + 1) / 8) for i in range(8)]))
    for layer in range(4):
        torch.testing.assert_close(tnl_decay_log(8, layer, 4), -alibi_slopes(8) * (1 - layer / 3 + 1e-5))
    assert (tnl_decay_log(8, 3, 4) < 0).all()  # the last layer still decays (the + 1e-5)
    torch.testing.assert_close(tnl_decay_log(4, 0, 1), -alibi_slopes(4) * (1 + 1e-5))


def test_named_configs():
    from lightning_seqpar.models import TNL_CONFIGS, TransNormerConfig

    assert {"tnl-385m", "tnl-1b", "tnl-7b", "tnl-tiny", "tnl-tiny-6h"} <= set(TNL_CONFIGS)
    c = TransNormerConfig.from_name("tnl-385m")
    assert (c.n_embd, c.n_layer, c.n_head, c.glu_dim, c.vocab_size) == (1024, 24, 8, 2816, 64000)
    c = TransNormerConfig.from_name("tnl-1b")
    assert (c.n_embd, c.n_layer, c.n_head, c.glu_dim, c.vocab_size) == (2048, 16, 16, 5632, 64000)
    assert 0.95e9 < c.num_params(non_embedding=True) < 1.1e9
    with pytest.raises(ValueError, match="name"):
        TransNormerConfig.from_name("tnl-3b")
    with pytest.raises(ValueError, match="n_head"):
        TransNormerConfig(n_embd=64, n_head=3)
    with pytest.raises(ValueError, match="glu_dim"):
        TransNormerConfig(glu_dim=0)
    with pytest.raises(TypeError):
        TransNormerConfig(64000)  # keyword-only


def test_flops_per_token():
    from lightning_seqpar.models import TransNormerConfig

    c = TransNormerConfig.from_name("tnl-1b")
    d, D, H = 2048, 128, 16
    matmul = 16 * (5 * d * d + 3 * d * 5632) + 64000 * d  # blocks + head
    attn = 12 * (H * 2 * D * D + 15 * H * D * D)  # layer 0 has Dk = 2D (LRPE)
    assert c.flops_per_token(1024) == 6 * matmul + attn
    assert c.flops_per_token(1) == c.flops_per_token(1 << 20)  # linear attention: no length term
    with pytest.raises(ValueError, match="seq_len"):
        c.flops_per_token(0)


def test_meta_init_and_model_file_imports():
    from lightning_seqpar.models import TransNormer, TransNormerConfig
    from lightning_seqpar.models import transnormer

    cfg = TransNormerConfig.from_name("tnl-tiny")
    with torch.device("meta"):
        model = TransNormer(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    ref = _model("tnl-tiny")
    torch.testing.assert_close(model.layers[0].token_mixer.lrpe.theta, ref.layers[0].token_mixer.lrpe.theta)
    assert torch.isfinite(model(torch.zeros(1, 8, dtype=torch.long))).all()
    tied = TransNormer(TransNormerConfig.from_name("tnl-tiny", tie_embeddings=True))
    assert tied.lm_head.weight is tied.embed_tokens.weight
    assert tied.num_params() == tied.config.num_params()
    tree = ast.parse(inspect.getsource(transnormer))
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    imported += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m.startswith("torch.distributed")], imported


def test_bad_inputs():
    model = _model("tnl-tiny")
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="output"):
        model(torch.zeros(2, 8, dtype=torch.long), output="loss")


# ----------------------------------------------------------------------------------------------
# LASP: the model sharded over W ranks


SEQ_LEN = 32  # local 16 (W=2) or 8 (W=4); chunk_size 3 leaves a short last chunk


def _configure(model, mesh, variant):
    from lightning_seqpar.attention.lasp import LinearAttention

    n = 0
    for m in model.modules():
        if isinstance(m, LinearAttention):
            m.configure(mesh=mesh, algorithm="lasp", variant=variant)
            n += 1
    return n


def _model_parity_worker(rank: int, world_size: int, variant: str) -> int:
    import torch.distributed as dist

    from lightning_seqpar.sharding import shard_sequence

    mesh = mesh_1d(world_size)
    index = expected_index(SEQ_LEN, "contiguous", world_size, rank)
    checked = 0
    for name in TINY:
        ref = _model(name, chunk_size=3)
        sp = copy.deepcopy(ref)
        assert _configure(sp, mesh, variant) == ref.config.n_layer
        gen = torch.Generator().manual_seed(3)
        ids = torch.randint(0, ref.config.vocab_size, (2, SEQ_LEN), generator=gen)
        pos = torch.arange(SEQ_LEN).expand(2, SEQ_LEN)
        weight = torch.randn(2, SEQ_LEN, ref.config.vocab_size, generator=gen)
        ref_logits = ref(ids, pos)
        (ref_logits * weight).sum().backward()

        ids_l = shard_sequence(ids, mesh, dim=1, layout="contiguous")
        pos_l = shard_sequence(pos, mesh, dim=1, layout="contiguous")
        assert torch.equal(pos_l, take(pos, index)), "shard_sequence disagrees with the contiguous layout rule"
        logits = sp(ids_l, pos_l)
        (logits * take(weight, index)).sum().backward()
        label = f"{name} LASP {variant} W={world_size} rank={rank}"
        torch.testing.assert_close(logits, take(ref_logits, index), atol=1e-5, rtol=1e-5, msg=lambda m: f"{label}: logits\n{m}")
        for (pname, p), (_, p_ref) in zip(sp.named_parameters(), ref.named_parameters()):
            grad = p.grad.clone()
            dist.all_reduce(grad)  # each rank holds the gradient of its tokens' terms
            torch.testing.assert_close(grad, p_ref.grad, atol=1e-5, rtol=1e-5, msg=lambda m, n=pname: f"{label}: grad of {n}\n{m}")
            checked += 1
    return checked


@pytest.mark.parametrize("variant", ["p2p", "allgather"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_lasp_model_logits_and_every_gradient_match_one_device(world_size, variant):
    counts = run_distributed(_model_parity_worker, world_size, variant)
    assert counts[0] > 0 and len(set(counts)) == 1


def _training_worker(rank: int, world_size: int, variant: str, steps: int) -> list[float]:
    import torch.distributed as dist

    mesh = mesh_1d(world_size)
    index = expected_index(SEQ_LEN, "contiguous", world_size, rank)
    ref = _model("tnl-tiny", chunk_size=4)
    sp = copy.deepcopy(ref)
    _configure(sp, mesh, variant)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3)
    opt_sp = torch.optim.AdamW(sp.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(4)
    losses = []
    for step in range(steps):
        tokens = torch.randint(0, 256, (2, SEQ_LEN + 1), generator=gen)
        ids, labels = tokens[:, :-1], tokens[:, 1:]  # shifted on the full sequence, then sharded
        pos = torch.arange(SEQ_LEN).expand(2, SEQ_LEN)
        loss_ref = F.cross_entropy(ref(ids, pos).flatten(0, 1), labels.flatten())
        opt_ref.zero_grad()
        loss_ref.backward()
        opt_ref.step()

        logits = sp(take(ids, index), take(pos, index))
        local = F.cross_entropy(logits.flatten(0, 1), take(labels, index).flatten(), reduction="sum") / labels.numel()
        opt_sp.zero_grad()
        local.backward()
        for p in sp.parameters():
            dist.all_reduce(p.grad)
        opt_sp.step()
        loss = local.detach().clone()
        dist.all_reduce(loss)
        assert abs(loss.item() - loss_ref.item()) < 1e-5, f"step {step}: LASP loss {loss.item()} vs one device {loss_ref.item()}"
        losses.append(loss.item())
    # Adam divides each gradient entry by its own running magnitude, so fp32 rounding noise in
    # near-zero entries becomes a step of up to lr in either direction: parameters are compared
    # at a tenth of lr (5e-5 seen), the losses (above) and gradients (previous test) at 1e-5.
    for (n, p), p_ref in zip(sp.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, p_ref, atol=3e-4, rtol=0, msg=lambda m, n=n: f"after {steps} steps, {n}\n{m}")
    return losses


def test_lasp_training_parity_five_steps():
    losses = run_distributed(_training_worker, 2, "p2p", 5)
    assert losses[0] == losses[1] and len(losses[0]) == 5
    assert losses[0][-1] < losses[0][0]  # it trains


def _checkpoint_worker(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    """Selective Checkpoint++ with the LASP op in the whitelist: backward recomputes the blocks but
    neither re-runs linear attention nor its forward state hops; full checkpointing re-runs both."""
    from lightning_seqpar.attention import ATTENTION_OPS
    from lightning_seqpar.attention.lasp import LASP_OPS
    from lightning_seqpar.parallel.activation_checkpointing import checkpoint_block
    from seqpar_testing import record_p2p

    mesh = mesh_1d(world_size)
    index = expected_index(SEQ_LEN, "contiguous", world_size, rank)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (2, SEQ_LEN), generator=gen)
    pos = torch.arange(SEQ_LEN).expand(2, SEQ_LEN)
    plain = _model("tnl-tiny", chunk_size=4)
    _configure(plain, mesh, "p2p")
    plain(take(ids, index), take(pos, index)).square().mean().backward()
    n_layer = plain.config.n_layer
    hops = {}
    for mode in ("selective++", "full"):
        model = _model("tnl-tiny", chunk_size=4)
        _configure(model, mesh, "p2p")
        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_block(block, mode, save_ops=(*ATTENTION_OPS, *LASP_OPS))
        loss = model(take(ids, index), take(pos, index)).square().mean()
        with record_p2p() as (bwd, _):
            loss.backward()
        hops[mode] = (len(bwd.sent), len(bwd.received))
        for (n, p), p_ref in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-6, rtol=1e-6, msg=lambda m, n=n: f"{mode}: grad of {n}\n{m}")
    last = rank == world_size - 1
    # backward of LASP: one dS hop per layer (send to r-1 unless rank 0, receive from r+1 unless last)
    assert hops["selective++"] == (n_layer * (rank > 0), n_layer * (not last)), hops
    # full checkpointing also repeats the forward hops (send to r+1, receive from r-1) per layer
    assert hops["full"] == (n_layer * ((rank > 0) + (not last)), n_layer * ((not last) + (rank > 0))), hops
    return hops


def test_selective_checkpointing_keeps_the_lasp_state():
    run_distributed(_checkpoint_worker, 2)


@pytest.mark.parametrize(("world", "sp", "attention", "memory"), [(2, 2, "lasp", False), (4, 2, "auto", False), (2, 2, "lasp", True)])
def test_strategy_training_parity(world, sp, attention, memory):
    """5 Lightning steps (FSDP2, Selective Checkpoint++) of tnl-tiny under the strategy == devices=1;
    ``memory``: block inputs and parameters offloaded and the channel mixer over 5-token slices as well."""
    from strategy_testing import train_reference, train_strategy

    ref_losses, ref_weights = train_reference("tnl-tiny")
    kwargs = dict(sequence_parallel_size=sp, attention=attention)
    if memory:
        kwargs.update(offload_checkpoints=True, mlp_chunk_size=5, offload_params=True)
    results = run_distributed(train_strategy, world, kwargs, "tnl-tiny", timeout=300)
    for losses, _ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(results[0][1][name], ref, rtol=0, atol=1e-5, msg=name)

"""Offloading checkpointed block inputs and the sequence-tiled MLP, on one CPU process.

What they keep is counted with saved-tensor hooks (``HostOffload.packed_bytes``) and by the
tensors autograd saves; their results equal the unwrapped block's (fp32, atol 2e-6).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_seqpar.models import GPT, GPTConfig, Llama, LlamaConfig, TransNormer, TransNormerConfig
from lightning_seqpar.models.llama import rope_freqs_cis
from lightning_seqpar.parallel.activation_checkpointing import HostOffload, checkpoint_block, tile_mlp
from lightning_seqpar.parallel.parallelize import apply_ac, apply_mlp_tiles

B, S, D = 2, 13, 32


def _model() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, n_embd=D, n_layer=3, n_head=4, n_kv_head=2, intermediate_size=80, max_seq_len=64))


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(ids).float().square().mean()
    loss.backward()
    return loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b) -> None:
    torch.testing.assert_close(a[0], b[0], atol=2e-6, rtol=1e-5)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], atol=2e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mode", ["selective++", "full"])
@pytest.mark.parametrize("chunk", [None, 1, 4, 13, 100])
@pytest.mark.parametrize("offload", [False, True])
def test_offload_and_tiles_match_the_plain_model(mode, chunk, offload):
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    plain = _model()
    expected = _loss_and_grads(plain, ids)
    model = copy.deepcopy(plain)
    assert apply_mlp_tiles(model, chunk) == (0 if chunk is None else 3)
    assert apply_ac(model, mode, offload_checkpoints=offload, uncheckpointed_blocks=1) == 2
    assert set(model.state_dict()) == set(plain.state_dict())  # names unchanged by the wrappers
    _assert_same(_loss_and_grads(model, ids), expected)
    _assert_same(_loss_and_grads(model, ids), expected)  # a second step through the same wrappers


def test_offload_packs_exactly_the_block_input():
    """Under full checkpointing and Selective Checkpoint++ the hooks copy only the block's input
    (not its RoPE table, which needs no gradient and is shared by the blocks)."""
    torch.manual_seed(0)
    block = _model().layers[0]
    x = torch.randn(B, S, D, requires_grad=True)
    freqs = rope_freqs_cis(torch.arange(S)[None], head_dim=D // 4, theta=10000.0)
    block(x, freqs).sum().backward()
    grad_of_plain, x.grad = x.grad.clone(), None
    for mode, piece_bytes in (("full", 1 << 28), ("selective++", 1 << 28), ("full", 64), ("selective++", 256)):
        host = HostOffload(piece_bytes)
        wrapped = checkpoint_block(copy.deepcopy(block), mode, offload=host)
        out = wrapped(x, freqs)
        out.sum().backward()
        assert host.packed_bytes == x.numel() * x.element_size(), mode
        torch.testing.assert_close(x.grad, grad_of_plain, atol=2e-6, rtol=1e-5)  # pieces put back in order
        x.grad = None


@pytest.mark.parametrize("bad", [0, 3, 100, -8])
def test_host_offload_pieces_are_powers_of_two(bad):
    with pytest.raises(ValueError, match="piece_bytes must be a power of two"):
        HostOffload(bad)


def test_tiled_mlp_keeps_only_slice_inputs():
    """What autograd saves for a tiled MLP is its input slices, not its (B, S, I) intermediates."""
    torch.manual_seed(0)
    mlp = _model().layers[0].mlp
    x = torch.randn(B, S, D, requires_grad=True)

    def saved_numel(module: nn.Module) -> int:
        sizes: list[int] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            module(x).sum().backward()
        return sum(sizes)

    plain, tiled = saved_numel(mlp), saved_numel(tile_mlp(copy.deepcopy(mlp), 4))
    assert tiled == x.numel()  # the four slices' inputs (4 + 4 + 4 + 1 tokens)
    assert plain >= 3 * B * S * 80  # gate, up, activation outputs at least


def test_tiled_mlp_without_grad_and_on_2d_input():
    torch.manual_seed(0)
    mlp = _model().layers[0].mlp
    tiled = tile_mlp(copy.deepcopy(mlp), 3)
    x = torch.randn(B, S, D)
    with torch.no_grad():
        torch.testing.assert_close(tiled(x), mlp(x), atol=2e-6, rtol=1e-5)
    flat = torch.randn(7, D, requires_grad=True)
    torch.testing.assert_close(tiled(flat), mlp(flat), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_bad_mlp_chunk_size(bad):
    with pytest.raises(ValueError, match="mlp_chunk_size"):
        apply_mlp_tiles(_model(), bad)


def test_mlp_tiles_need_an_mlp_child():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block()])

    with pytest.raises(ValueError, match="no MLP child named one of"):
        apply_mlp_tiles(Model(), 4)


def test_offload_needs_checkpointing():
    with pytest.raises(ValueError, match="needs activation_checkpointing"):
        apply_ac(_model(), None, offload_checkpoints=True)


@pytest.mark.parametrize("build", [
    lambda: GPT(GPTConfig.from_name("gpt-tiny")),
    lambda: TransNormer(TransNormerConfig.from_name("tnl-tiny")),
], ids=["gpt", "tnl"])
def test_other_models_tile_and_offload(build):
    """GPT's ``mlp`` and TNL's ``channel_mixer`` are tiled; both models equal their plain selves."""
    torch.manual_seed(0)
    plain = build()
    ids = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(1))
    expected = _loss_and_grads(plain, ids)
    model = copy.deepcopy(plain)
    assert apply_mlp_tiles(model, 4) == 2
    assert apply_ac(model, "selective++", offload_checkpoints=True) == 2
    _assert_same(_loss_and_grads(model, ids), expected)


def test_offload_params_needs_fsdp():
    """offload_params is FSDP2's CPUOffloadPolicy: without an FSDP mesh there is nothing to offload."""
    from lightning_seqpar.parallel.parallelize import parallelize

    with pytest.raises(ValueError, match="offload_params=True offloads FSDP2's parameter shards; it needs an fsdp_mesh"):
        parallelize(_model(), sp_mesh=None, fsdp_mesh=None, offload_params=True)


def test_tiled_mlp_needs_one_tensor_per_token():
    class RouterMLP(nn.Module):  # returns (hidden, router logits), as some mixture-of-experts blocks do
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(D, D)

        def forward(self, x):
            return self.proj(x), x.mean(dim=-1)

    with pytest.raises(ValueError, match="must be position-wise and return one tensor"):
        tile_mlp(RouterMLP(), 4)(torch.randn(B, S, D, requires_grad=True))

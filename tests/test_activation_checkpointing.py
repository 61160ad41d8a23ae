"""Selective Checkpoint++ and full checkpointing: what runs again in backward, and exact gradients."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import run_distributed
from lightning_seqpar.attention import ATTENTION_OPS
from lightning_seqpar.parallel.activation_checkpointing import AC_MODES, SAVE_OPS, checkpoint_block, selective_checkpoint_policy
from lightning_seqpar.models import Llama, LlamaConfig
from lightning_seqpar.parallel.parallelize import apply_ac, apply_attention, find_blocks

ATTN_FWD = torch.ops.seqpar.attn_fwd.default
ATTN_BWD = torch.ops.seqpar.attn_bwd.default
SEQ_LEN = 16


class OpCounter(TorchDispatchMode):
    """Counts the ops dispatched, separately for forward and backward (``phase``)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.counts: dict[str, Counter] = {"forward": Counter(), "backward": Counter()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[self.phase][func] += 1
        return func(*args, **(kwargs or {}))


def _model(n_layer: int = 2) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_name("tiny", n_layer=n_layer))


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (2, SEQ_LEN), generator=g)
    return ids, torch.arange(SEQ_LEN).expand(2, SEQ_LEN)


def _run(model: Llama, ids: torch.Tensor, pos: torch.Tensor) -> tuple[OpCounter, dict[str, torch.Tensor]]:
    counter = OpCounter()
    with counter:
        loss = model(ids, pos).float().square().mean()
        counter.phase = "backward"
        loss.backward()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return counter, grads


def test_whitelist_is_the_attention_ops():
    assert SAVE_OPS == tuple(ATTENTION_OPS)
    assert ATTN_FWD in SAVE_OPS
    policy = selective_checkpoint_policy()
    assert policy(None, ATTN_FWD).name == "MUST_SAVE"
    assert policy(None, torch.ops.aten.mm.default).name == "PREFER_RECOMPUTE"


@pytest.mark.parametrize("mode", [None, *AC_MODES])
def test_attention_runs_once_under_selective_plus_plus(mode):
    n_layer = 2
    ids, pos = _batch()
    ref_counts, ref_grads = _run(_model(n_layer), ids, pos)
    model = _model(n_layer)
    assert apply_ac(model, mode) == (0 if mode is None else n_layer)
    counts, grads = _run(model, ids, pos)

    assert counts.counts["forward"][ATTN_FWD] == n_layer
    assert counts.counts["backward"][ATTN_BWD] == n_layer
    expected_reruns = {None: 0, "selective++": 0, "full": n_layer}[mode]
    assert counts.counts["backward"][ATTN_FWD] == expected_reruns
    if mode is not None:  # the rest of the block is recomputed: its matmuls run again in backward
        recomputed_mm = counts.counts["backward"][torch.ops.aten.mm.default] - ref_counts.counts["backward"][torch.ops.aten.mm.default]
        assert recomputed_mm >= n_layer * 5  # q, k, v, gate, up at least (o_proj and down as well)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)


def test_state_dict_keys_unchanged_by_checkpointing():
    plain = _model()
    wrapped = copy.deepcopy(plain)
    apply_ac(wrapped, "selective++")
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    assert len(find_blocks(wrapped)) == len(find_blocks(plain)) == 2


def test_activation_checkpointing_errors_name_the_argument():
    with pytest.raises(ValueError, match="activation_checkpointing='partial'"):
        checkpoint_block(torch.nn.Linear(2, 2), "partial")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="activation_checkpointing='full'.*no transformer blocks"):
        apply_ac(torch.nn.Sequential(torch.nn.Linear(2, 2)), "full")


# ---------------------------------------------------------------------------------------------- ring


def _distributed_counts(rank: int, world_size: int, mode: str | None, algorithm: str) -> tuple[dict, dict]:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_seqpar.sharding import shard_sequence

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    model = _model()
    apply_attention(model, mesh, attention=algorithm, layout="zigzag")
    apply_ac(model, mode)
    ids, pos = _batch()
    ids, pos = shard_sequence(ids, mesh), shard_sequence(pos, mesh)
    counter, grads = _run(model, ids, pos)
    summary = {
        phase: {str(op): counter.counts[phase][op] for op in (ATTN_FWD, ATTN_BWD, *ATTENTION_OPS)}
        for phase in ("forward", "backward")
    }
    return summary, grads


@pytest.mark.parametrize("algorithm", ["ring", "ulysses"])
def test_selective_plus_plus_no_attention_recompute_distributed(algorithm):
    world = 2
    base = run_distributed(_distributed_counts, world, None, algorithm, timeout=120)
    sel = run_distributed(_distributed_counts, world, "selective++", algorithm, timeout=120)
    full = run_distributed(_distributed_counts, world, "full", algorithm, timeout=120)
    for rank in range(world):
        (b, b_grads), (s, s_grads), (f, _) = base[rank], sel[rank], full[rank]
        # Selective Checkpoint++: no attention op (and no head all-to-all) runs again in backward.
        assert s["backward"] == b["backward"], (s, b)
        # Full checkpointing re-runs the attention forward (and its communication; Ulysses' all-to-alls
        # are inside its own op, Note [Overlapped Ulysses]).
        op = str(torch.ops.seqpar.ulysses_fwd.default if algorithm == "ulysses" else ATTN_FWD)
        assert f["backward"][op] == b["forward"][op] > 0
        for name in b_grads:
            torch.testing.assert_close(s_grads[name], b_grads[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("skip", [1, 3, 5])
def test_uncheckpointed_blocks_keep_their_activations(skip):
    """The last ``skip`` blocks are not wrapped: they re-run nothing in backward; gradients stay exact."""
    n_layer = 3
    ids, pos = _batch()
    ref_counts, ref_grads = _run(_model(n_layer), ids, pos)
    model = _model(n_layer)
    wrapped = apply_ac(model, "full", uncheckpointed_blocks=skip)
    assert wrapped == max(n_layer - skip, 0)
    counts, grads = _run(model, ids, pos)
    assert counts.counts["backward"][ATTN_FWD] == wrapped  # only wrapped blocks recompute their attention
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="uncheckpointed_blocks"):
        apply_ac(_model(1), "full", uncheckpointed_blocks=-1)


def test_offload_checkpoints_n_offloads_the_first_n_blocks():
    """offload_checkpoints=k: the first k checkpointed blocks keep their inputs on the host (one HostOffload), the
    others on the device; the gradients are those of the unwrapped model."""
    n_layer = 3
    ids, pos = _batch()
    _, ref_grads = _run(_model(n_layer), ids, pos)
    model = _model(n_layer)
    assert apply_ac(model, "full", offload_checkpoints=2) == n_layer
    offloads = [block.checkpoint_fn.keywords["offload"] for block in model.layers]
    assert offloads[0] is not None and offloads[1] is offloads[0] and offloads[2] is None
    _, grads = _run(model, ids, pos)
    assert offloads[0].packed_bytes > 0
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0, msg=name)
    every = _model(n_layer)
    apply_ac(every, "full", offload_checkpoints=True)
    assert all(block.checkpoint_fn.keywords["offload"] is not None for block in every.layers)
    _run(every, ids, pos)
    assert 3 * offloads[0].packed_bytes == 2 * every.layers[0].checkpoint_fn.keywords["offload"].packed_bytes


@pytest.mark.parametrize("wrap", ["block", "tile"])
def test_recomputation_runs_under_the_forward_default_dtype(wrap):
    """Note [Recomputing under the forward's default dtype]: "bf16-true" sets the default dtype to bf16 for
    the forward only; a tensor the forward makes from the default dtype (here a scale factor that the
    multiplication saves for backward) must come back the same when a checkpoint recomputes it in backward
    (it was a CheckpointError on GPUs with mlp_chunk_size)."""
    from lightning_seqpar.parallel.activation_checkpointing import tile_mlp

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8, dtype=torch.bfloat16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x) * torch.full((8,), 0.5)  # the default dtype

    torch.manual_seed(0)
    plain = Scaled()
    wrapped = tile_mlp(copy.deepcopy(plain), 3) if wrap == "tile" else checkpoint_block(copy.deepcopy(plain), "full")
    x = torch.randn(2, 7, 8, dtype=torch.bfloat16)
    grads = []
    for module in (plain, wrapped):
        leaf = x.clone().requires_grad_()
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)  # as Lightning's forward_context does
        try:
            out = module(leaf)
        finally:
            torch.set_default_dtype(previous)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()  # outside it, with fp32 as the default
        grads.append(leaf.grad)
    if wrap == "block":
        torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    else:  # slices of 3 tokens: other matmul shapes, so bf16 rounding may differ in the last bit
        torch.testing.assert_close(grads[1], grads[0], rtol=1.6e-2, atol=2e-3)  # one bf16 ulp at |x| ~ 0.25-0.5
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize(("mode", "tiles"), [("selective++", None), ("full", None), ("selective++", 16)])
def test_norms_are_checkpointed_and_exact(mode, tiles):
    """Note [Checkpointed norms]: each norm of a checkpointed block (Hugging Face's LlamaRMSNorm here) runs under its
    own checkpoint, tiled with the MLP; parameter names and every gradient bitwise unchanged (with MLP tiles: to
    rounding, the tiles' matmuls sum in another order)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    from lightning_seqpar.parallel.parallelize import apply_mlp_tiles

    torch.manual_seed(0)
    config = HFLlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=64, attn_implementation="eager")
    plain = LlamaForCausalLM(config)
    model = copy.deepcopy(plain)
    apply_mlp_tiles(model, tiles)
    assert apply_ac(model, mode) == 2
    for layer in model.model.layers:
        for name in ("input_layernorm", "post_attention_layernorm"):
            assert isinstance(getattr(layer._checkpoint_wrapped_module, name), CheckpointWrapper)
    assert not isinstance(model.model.norm, CheckpointWrapper)  # outside the blocks: the loss phase's
    assert list(model.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 64, (1, 48))
    for m in (model, plain):
        m(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = dict(plain.named_parameters())
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        if tiles:
            torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(p.grad, grads[name].grad), name

"""Training parity: N optimizer steps under SequenceParallelStrategy == the same steps on one device.

Tiny GQA Llama (4 query heads, 2 KV heads), fp32 on CPU gloo, 3 AdamW steps (``STEPS``): the logged
per-step losses match the single-device run at rtol 1e-5 and the final weights at atol 1e-5
(up to one element in a thousand of a tensor within the AdamW bound below),
for every (dp_shard, sp, hp) layout of 2 and 4 ranks (and three of 8) and each activation-checkpointing mode.

The weight tolerance, derived
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Sharding sums every gradient in another order (over ranks, over sequence pieces), so gradients
differ from the single-device ones by fp32 rounding: about 1e-7 of the magnitude of the terms
summed, not of the sum. AdamW moves a weight by ``lr_t * m_t / (sqrt(v_t) + eps)``, a step of
about ``lr_t`` whatever the gradient's size. Where the terms of a gradient element nearly cancel
(a sum ~1e-9 of terms ~1e-3), the rounding changes that element's gradient relatively a lot,
possibly its sign, and with it the direction of its step: the weight can then move by up to
``2 * lr_t`` per step differently, ``2 * sum(lr_t) <= 2 * LR * STEPS = 6e-3`` over the run
(``ADAM_BOUND``). Every other element follows the gradient smoothly and stays within 1e-5
(``|m / sqrt(v)|`` changes by the relative gradient difference, ~1e-6, times ``lr``). So the
check is: every element within ``weight_atol`` (1e-5) except at most one in a thousand per tensor
(``OUTLIERS``: a full run of 4 ranks, 5 steps once found 1 of 8,192 of
``layers.1.mlp.gate_proj`` at 1.075e-5), and those within ``ADAM_BOUND``. A wrong result moves
the losses (rtol 1e-5, checked first) and far more than one element in a thousand.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from strategy_testing import LR, train_reference, train_strategy

# (world, dp_shard, sp, hp, attention)
LAYOUTS = [
    (2, 1, 2, 1, "ring"),
    (2, 2, 1, 1, "ring"),
    (2, 1, 2, 2, "2d"),
    (4, 1, 4, 1, "ring"),
    (4, 2, 2, 1, "ring"),
    (4, 1, 4, 2, "2d"),
    (4, 2, 2, 2, "2d"),
    (8, 1, 8, 1, "ring"),  # one 8-GPU node's layouts (issue #9)
    (8, 2, 4, 2, "2d"),
    (8, 1, 8, 4, "2d"),
]
TIMEOUT = 300
# 3 steps of strategy_testing's 5-step run (its data and learning-rate schedule): AdamW's moments carry over two
# updates. 5 steps cost 40% more time here for no other check; a sign flip of a near-zero gradient (the outliers
# below) can fall on any step count.
STEPS = 3
ADAM_BOUND = 2 * LR * STEPS  # the most AdamW can move a weight differently (module docstring)
OUTLIERS = 1e-3  # the share of a tensor's elements that may exceed weight_atol (within ADAM_BOUND)
AOT_EAGER = {"backend": "aot_eager"}  # Dynamo and AOTAutograd, no Inductor C++ build (as tests/test_checkpoint_compile.py)


def _train(rank: int, world_size: int, strategy_kwargs: dict, **kwargs):
    """``train_strategy`` for this file's ``STEPS``."""
    return train_strategy(rank, world_size, strategy_kwargs, steps=STEPS, **kwargs)


@pytest.fixture(scope="module")
def reference():
    return train_reference(steps=STEPS)


def _check(results, reference, weight_atol: float = 1e-5) -> None:
    ref_losses, ref_weights = reference
    losses = [r[0] for r in results]
    for rank_losses in losses:  # every rank logs the same global loss
        assert rank_losses == losses[0]
    torch.testing.assert_close(torch.tensor(losses[0]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    weights = results[0][1]
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        assert weights[name].shape == ref.shape and weights[name].dtype == ref.dtype, name
        diff = (weights[name] - ref).abs()
        over = int((diff > weight_atol).sum())
        allowed = max(1, int(OUTLIERS * ref.numel()))
        assert over <= allowed, (f"{name}: {over} of {ref.numel()} elements differ by more than {weight_atol} "
                                 f"(max {diff.max().item():.3g}); at most {allowed} may (module docstring)")
        assert diff.max().item() <= ADAM_BOUND, f"{name}: an element differs by {diff.max().item():.3g} > {ADAM_BOUND}"


def _id(layout) -> str:
    world, dp, sp, hp, attention = layout
    return f"w{world}-dp{dp}-sp{sp}-hp{hp}-{attention}"


# "full" on one layout of each kind (sp, dp x sp, 2d with dp): its recompute is layout-independent, and the offload /
# tiles / offload_params tests below run it too (a third of this file's time went to the other seven)
FULL_AC = (LAYOUTS[0], LAYOUTS[4], LAYOUTS[6])


@pytest.mark.parametrize(("layout", "ac"), [(layout, "selective++") for layout in LAYOUTS] + [(layout, "full") for layout in FULL_AC],
                         ids=[f"{_id(layout)}-selective++" for layout in LAYOUTS] + [f"{_id(layout)}-full" for layout in FULL_AC])
def test_training_parity(layout, ac, reference):
    world, dp, sp, hp, attention = layout
    kwargs = dict(sequence_parallel_size=sp, head_parallel_size=hp, attention=attention, activation_checkpointing=ac)
    _check(run_distributed(_train, world, kwargs, timeout=TIMEOUT), reference)


@pytest.mark.parametrize(
    "world,sp,attention,load_balance",
    [(2, 2, "allgather", True), (4, 4, "ulysses", True), (2, 2, "ring", "contiguous"), (4, 4, "allgather", False)],
)
def test_training_parity_other_algorithms(world, sp, attention, load_balance, reference):
    kwargs = dict(sequence_parallel_size=sp, attention=attention, load_balance=load_balance, activation_checkpointing=None)
    _check(run_distributed(_train, world, kwargs, timeout=TIMEOUT), reference)


def test_training_parity_double_ring(reference):
    """inner_ring_size=2 over sp=4 (LoongTrain's double ring: 2 inner rings of 2) through the strategy."""
    kwargs = dict(sequence_parallel_size=4, attention="ring", inner_ring_size=2)
    _check(run_distributed(_train, 4, kwargs, timeout=TIMEOUT), reference)


def test_training_parity_head_chunks_and_uncheckpointed_blocks(reference):
    """head_chunks=2 (ring over K/V head groups in turn) and one block left unwrapped, through the strategy."""
    kwargs = dict(sequence_parallel_size=2, attention="ring", head_chunks=2, uncheckpointed_blocks=1)
    _check(run_distributed(_train, 2, kwargs, timeout=TIMEOUT), reference)


@pytest.mark.parametrize("ac", ["selective++", "full"])
def test_training_parity_offload_and_mlp_tiles(ac, reference):
    """Checkpointed block inputs offloaded to host memory and the MLP over 5-token slices (16 local
    tokens: slices of 5, 5, 5, 1), one block left unwrapped (its MLP tiled as well)."""
    kwargs = dict(sequence_parallel_size=2, attention="ring", activation_checkpointing=ac, offload_checkpoints=True,
                  mlp_chunk_size=5, uncheckpointed_blocks=1)
    _check(run_distributed(_train, 2, kwargs, timeout=TIMEOUT), reference)


def test_training_parity_offload_of_the_first_blocks(reference):
    """offload_checkpoints=1: the first block's input on the host, the second's on the device (what memory="auto"
    picks where the host binds)."""
    kwargs = dict(sequence_parallel_size=2, attention="ring", activation_checkpointing="full", offload_checkpoints=1)
    _check(run_distributed(_train, 2, kwargs, timeout=TIMEOUT), reference)


def _train_offloaded(rank: int, world_size: int, strategy_kwargs: dict, **kwargs):
    """``train_strategy`` with ``offload_params=True``, plus what reached FSDP2 and the optimizer: on CPU
    the host is the compute device, so the parity alone would not show that the option was applied."""
    import lightning as L
    from torch.distributed.fsdp import FSDPModule

    seen: dict = {}

    class Inspect(L.Callback):
        def on_train_end(self, trainer, pl_module):
            groups = [m._get_fsdp_state()._fsdp_param_group for m in pl_module.modules() if isinstance(m, FSDPModule)]
            fsdp_params = [p for g in groups if g is not None for p in g.fsdp_params]
            seen["offloaded"] = [p.offload_to_cpu for p in fsdp_params]
            seen["pinned"] = [p.pin_memory for p in fsdp_params]  # pinned only for a CUDA mesh
            seen["parameters"] = len(list(pl_module.parameters()))
            seen["devices"] = {p.device.type for p in pl_module.parameters()}
            seen["fused"] = [o.defaults.get("fused") for o in trainer.optimizers]
            seen["backend"] = trainer.strategy.process_group_backend

    losses, weights = _train(rank, world_size, {**strategy_kwargs, "offload_params": True}, callbacks=[Inspect()], **kwargs)
    return losses, weights, seen


def _check_offloaded(results) -> None:
    for _, _, seen in results:
        assert len(seen["offloaded"]) == seen["parameters"] > 0 and all(seen["offloaded"]), seen
        assert not any(seen["pinned"]) and seen["devices"] == {"cpu"}, seen
        assert seen["fused"] == [None], seen  # CausalLMModule: AdamW's default (not fused) off CUDA
        assert seen["backend"] == "gloo", seen  # the CPU default stays; "cpu:gloo,cuda:nccl" is for CUDA


@pytest.mark.parametrize(
    "options",
    [dict(activation_checkpointing="selective++"), dict(activation_checkpointing="full"),
     dict(activation_checkpointing="selective++", offload_checkpoints=True, mlp_chunk_size=5)],
    ids=["selective++", "full", "selective++-offload_checkpoints-mlp_tiles"],
)
def test_training_parity_offload_params(options, reference):
    """offload_params=True (FSDP2's CPUOffloadPolicy on every block and the root) trains as one device,
    also with the checkpointed block inputs offloaded and the MLP over slices (the 1M-token settings)."""
    kwargs = dict(sequence_parallel_size=2, attention="ring", **options)
    results = run_distributed(_train_offloaded, 2, kwargs, timeout=TIMEOUT)
    _check(results, reference)
    _check_offloaded(results)


@pytest.mark.parametrize("replicas", [1, 2], ids=["dp_shard2-sp2", "hsdp2-sp2"])
def test_training_parity_offload_params_with_dp_and_clipping(replicas):
    """offload_params=True over dp x sp (FSDP2 shards over 4 ranks, or HSDP: 2 replicas of 2) with
    gradient clipping, whose global norm is reduced over the offloaded (CPU) gradients."""
    clip = {"gradient_clip_val": 0.05}  # small enough to clip every step
    reference = train_reference(steps=STEPS, trainer_kwargs=clip)
    kwargs = dict(sequence_parallel_size=2, data_parallel_replicate_size=replicas, attention="ring")
    results = run_distributed(_train_offloaded, 4, kwargs, trainer_kwargs=clip, timeout=TIMEOUT)
    _check(results, reference)
    _check_offloaded(results)


def test_training_parity_offload_params_compiled(reference):
    """offload_params=True with compile: FSDP2's copies and gathers stay outside the compiled blocks.

    Where the graph breaks is Dynamo's (and AOTAutograd's) doing, so this compiles with ``backend="aot_eager"``
    (no Inductor C++ build, which an empty cache pays on every CPU run) and checks eager's tolerance; Inductor's
    own kernels under the strategy are test_training_parity_compile's."""
    kwargs = dict(sequence_parallel_size=2, attention="ring", compile=dict(AOT_EAGER))
    results = run_distributed(_train_offloaded, 2, kwargs, timeout=600, pool="compile")
    _check(results, reference)
    _check_offloaded(results)


def _offload_precision_run(rank: int, world_size: int, precision: str):
    kwargs = dict(sequence_parallel_size=2, attention="ring")
    trainer_kwargs = {"precision": precision}
    return _train(rank, world_size, kwargs, trainer_kwargs=trainer_kwargs), \
        _train_offloaded(rank, world_size, kwargs, trainer_kwargs=trainer_kwargs)


@pytest.fixture(scope="module")
def low_precision_runs():
    """``runs(precision)``: rank 0's (run, offloaded run) of ``_offload_precision_run``, one pool call per precision
    for the two tests that read it (the offloaded run against the plain one, the plain one against fp32)."""
    runs: dict = {}

    def get(precision: str):
        if precision not in runs:
            runs[precision] = run_distributed(_offload_precision_run, 2, precision, timeout=TIMEOUT)[0]
        return runs[precision]

    return get


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_offload_params_under_low_precision_changes_nothing(precision, low_precision_runs):
    """bf16-mixed (fp32 shards on the host, gathered in bf16) and bf16-true (bf16 shards on the host, a
    bf16 optimizer step on the CPU): the same losses and weights as without offloading."""
    (losses, weights), (off_losses, off_weights, seen) = low_precision_runs(precision)
    assert off_losses == losses
    assert off_weights.keys() == weights.keys()
    for name, value in weights.items():
        assert off_weights[name].dtype == value.dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
        torch.testing.assert_close(off_weights[name], value, rtol=0, atol=0, msg=name)
    assert all(seen["offloaded"])


def test_training_parity_mlp_tiles_compiled_without_checkpointing(reference):
    """The tiled MLP under torch.compile (per block) and with activation_checkpointing=None, sp2 (FSDP2 shards
    over both ranks: its gathers run around the compiled blocks). Two ranks, not dp2 x sp2: every rank
    compiles the same graphs, so four ranks cost twice the CPU for no other compiled code path.

    The checkpointed slices inside the compiled block are traced by Dynamo and split by AOTAutograd, so this compiles
    with ``backend="aot_eager"`` (an Inductor build of these graphs took 30 s of a cold CPU run) and checks eager's
    tolerance. Inductor's kernels under the strategy: test_training_parity_compile (with the measured differences:
    Inductor's fused fp32 kernels moved the weights by up to 1e-5 over 5 steps with 3-token slices, 5-6e-6 without).
    """
    kwargs = dict(sequence_parallel_size=2, attention="ring", activation_checkpointing=None, mlp_chunk_size=3,
                  compile=dict(AOT_EAGER))
    _check(run_distributed(_train, 2, kwargs, timeout=600, pool="compile"), reference)


def _bad_inner_ring(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError) as info:
        train_strategy(rank, world_size, dict(sequence_parallel_size=4, attention="ring", inner_ring_size=3))
    return str(info.value)


def test_inner_ring_size_must_divide_cp():
    messages = run_distributed(_bad_inner_ring, 4, timeout=TIMEOUT)
    assert all("inner_ring_size=3 must divide the context-parallel size" in m for m in messages)


def _bad_head_chunks(rank: int, world_size: int) -> str:
    with pytest.raises(ValueError) as info:  # "tiny" has 2 K/V heads
        train_strategy(rank, world_size, dict(sequence_parallel_size=2, attention="ring", head_chunks=3))
    return str(info.value)


def test_head_chunks_must_divide_the_kv_heads():
    messages = run_distributed(_bad_head_chunks, 2, timeout=TIMEOUT)
    assert all("SequenceParallelStrategy: head_chunks=3 must divide the model's key/value heads (2); choose one of [1, 2]" in m
               for m in messages), messages


def test_training_parity_hsdp(reference):
    """dp_replicate=2 x sp=2: HSDP replicas, gradients all-reduced across them."""
    kwargs = dict(sequence_parallel_size=2, data_parallel_replicate_size=2, attention="ring")
    _check(run_distributed(_train, 4, kwargs, timeout=TIMEOUT), reference)


def test_training_parity_compile(reference):
    """torch.compile per block (after Selective Checkpoint++, before FSDP2) equals eager: Inductor, the default
    backend, builds and runs the blocks' kernels (the one parity test that builds them; the other compiled ones
    check Dynamo's graphs with aot_eager)."""
    kwargs = dict(sequence_parallel_size=2, attention="ring", activation_checkpointing="selective++", compile=True)
    _check(run_distributed(_train, 2, kwargs, timeout=600, pool="compile"), reference)


@pytest.mark.parametrize("offload_params", [False, True])
def test_training_parity_chunked_loss(offload_params):
    """The chunked cross entropy over ``lm_head.weight`` (outside the model's forward) under FSDP2
    (with offload_params: the gathered weight, not the host shard)."""
    reference = train_reference(steps=STEPS, loss_chunk_size=24)
    kwargs = dict(sequence_parallel_size=2, attention="ring", offload_params=offload_params)
    _check(run_distributed(_train, 4, kwargs, loss_chunk_size=24, timeout=TIMEOUT), reference)


@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", torch.float32), ("bf16-true", torch.bfloat16)])
def test_low_precision_trains_close_to_fp32(precision, dtype, reference, low_precision_runs):
    """bf16-mixed: fp32 parameters, FSDP2 gathers them in bf16; bf16-true: bf16 parameters (the run without
    offloading of test_offload_params_under_low_precision_changes_nothing)."""
    (losses, weights), _ = low_precision_runs(precision)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference[0]), rtol=1e-2, atol=0)
    assert {v.dtype for v in weights.values()} == {dtype}


def test_training_parity_gradient_clipping():
    """Lightning's gradient_clip_val on FSDP2 (DTensor) gradients: the global norm, as on one device."""
    clip = {"gradient_clip_val": 0.05}  # small enough to clip every step
    reference = train_reference(steps=STEPS, trainer_kwargs=clip)
    kwargs = dict(sequence_parallel_size=2, attention="ring")
    _check(run_distributed(_train, 4, kwargs, trainer_kwargs=clip, timeout=TIMEOUT), reference)


def test_training_parity_fused_optimizer():
    """AdamW(fused=True) over FSDP2's DTensor parameters (the default on CUDA) equals the fused single-device run."""
    reference = train_reference(steps=STEPS, fused_optimizer=True)
    kwargs = dict(sequence_parallel_size=2, attention="ring")
    _check(run_distributed(_train, 2, kwargs, fused_optimizer=True, timeout=TIMEOUT), reference)

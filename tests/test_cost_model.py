"""The attention cost model (lightning_seqpar.attention.cost) and attention="auto" in the strategy.

Pure arithmetic: no process group, no GPU. The model's absolute numbers are checked against GPU
measurements by benchmarks/attention.py (predicted_ms next to time_ms); here we check that its
choices follow from its structure (Note [Choosing the attention algorithm]).
"""

from __future__ import annotations

import pytest

from lightning_seqpar.attention.ulysses import ulysses_stages
import torch

from lightning_seqpar import SequenceParallelStrategy
from lightning_seqpar.attention.cost import (
    DeviceProfile,
    causal_flops,
    choose_attention,
    estimate_attention,
    kv_repeat,
)
from lightning_seqpar.parallel.mesh import ParallelDims

H200 = DeviceProfile.h200()
SHAPE = dict(num_heads=32, num_kv_heads=8, head_dim=128)


def _labels(plan):
    return {c.label for c in plan.candidates}


# ---------------------------------------------------------------------------------------------- the choice


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("seq_len", [32768, 131072, 524288, 1048576])
@pytest.mark.parametrize("heads", [(32, 32), (32, 8), (33, 33), (32, 1)])
def test_the_pick_is_within_the_tie_tolerance_of_the_fastest(world, seq_len, heads):
    plan = choose_attention(seq_len=seq_len, num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, world_size=world)
    fastest = min(c.est_time_s for c in plan.candidates)
    assert plan.est_time_s <= fastest * 1.01
    assert plan.candidates[0].label == plan.label
    rest = [c.est_time_s for c in plan.candidates[1:]]
    assert rest == sorted(rest)
    # every estimate is at least the compute of a perfectly balanced kernel at its fastest (unmasked) rate
    bound = causal_flops(batch=1, seq_len=seq_len, num_heads=heads[0], head_dim=128) / world / (H200.attention_flops * H200.full_block_speedup)
    assert all(c.est_time_s >= bound for c in plan.candidates)


def test_the_grid_of_candidates():
    plan = choose_attention(seq_len=131072, world_size=8, **SHAPE)
    assert _labels(plan) == {"ring", "ring:inner2", "ring:inner4", "allgather", "ulysses", "2d:2x4", "2d:2x4:inner2", "2d:4x2"}
    assert not plan.skipped
    assert "ring:inner2" not in _labels(choose_attention(seq_len=131072, world_size=8, double_ring=False, **SHAPE))


def test_33_heads_never_split_over_heads():
    plan = choose_attention(seq_len=131072, num_heads=33, num_kv_heads=33, head_dim=128, world_size=4)
    assert _labels(plan) == {"ring", "ring:inner2", "allgather"}
    assert plan.algorithm in ("ring", "allgather")
    assert dict(plan.skipped) == {"ulysses": "4 head-parallel ranks do not divide num_heads=33",
                                  "2d:2x2": "2 head-parallel ranks do not divide num_heads=33"}
    # 3 divides 33: 2D with hp = 3 over 6 ranks is a candidate, hp = 2 and Ulysses over 6 are not
    six = choose_attention(seq_len=131072, num_heads=33, num_kv_heads=33, head_dim=128, world_size=6)
    assert "2d:3x2" in _labels(six) and {"ulysses", "2d:2x3"} <= {label for label, _ in six.skipped}


def test_mqa_counts_the_repeated_kv_heads():
    # MQA over 4 head-parallel ranks repeats the one K/V head 4 times (the rule Ulysses and 2D run: comm.kv_repeat)
    assert kv_repeat(32, 1, 4) == 4
    assert kv_repeat(32, 8, 4) == 1 and kv_repeat(32, 2, 4) == 2 and kv_repeat(33, 33, 2) is None
    kw = dict(algorithm="ulysses", seq_len=131072, num_heads=32, head_dim=128, world_size=4)
    mqa, four = estimate_attention(num_kv_heads=1, **kw), estimate_attention(num_kv_heads=4, **kw)
    assert mqa.kv_repeat == 4 and four.kv_repeat == 1
    # after the repeat MQA moves as many K/V bytes as 4 K/V heads, and copies the repeat on top
    assert mqa.communication_s == pytest.approx(four.communication_s)
    assert mqa.elementwise_s > four.elementwise_s
    # the ring never repeats: MQA's K/V hops are 4x smaller than H_kv = 4
    ring_mqa = estimate_attention(**{**kw, "algorithm": "ring"}, num_kv_heads=1)
    assert ring_mqa.kv_repeat == 1 and ring_mqa.peak_memory_bytes < estimate_attention(**{**kw, "algorithm": "ring"}, num_kv_heads=4).peak_memory_bytes
    # 2D at hp = 2: one K/V head repeated twice
    assert estimate_attention(algorithm="2d", hp=2, seq_len=131072, num_heads=32, num_kv_heads=1, head_dim=128, world_size=4).kv_repeat == 2


def test_long_sequences_on_nvlink_hide_the_communication():
    for world in (4, 8):
        plan = choose_attention(seq_len=1048576, world_size=world, **SHAPE)
        bound = causal_flops(batch=1, seq_len=1048576, head_dim=128, num_heads=32) / world / H200.attention_flops
        assert plan.est_time_s < 1.03 * bound
        ring = next(c for c in plan.candidates if c.label == "ring")
        assert ring.communication_s < 0.01 * ring.est_time_s  # every hop hides behind its block


def test_slow_links_expose_the_ring_at_short_sequences_only():
    pcie = DeviceProfile.h200(intra_node_p2p_bandwidth=20e9, intra_node_collective_bandwidth=20e9)
    short = estimate_attention(algorithm="ring", seq_len=32768, world_size=8, profile=pcie, **SHAPE)
    long = estimate_attention(algorithm="ring", seq_len=1048576, world_size=8, profile=pcie, **SHAPE)
    assert short.communication_s > 0.3 * short.est_time_s
    assert long.communication_s < 0.01 * long.est_time_s


def test_double_ring_pays_off_across_nodes():
    # 16 ranks on two 8-GPU nodes: a plain ring waits for an inter-node hop at every step; inner
    # rings of one node (LoongTrain §4.5: w = NICs per node) hide the outer hop behind 8 steps
    slow_nics = DeviceProfile.h200(inter_node_bandwidth=12.5e9)
    kw = dict(algorithm="ring", seq_len=131072, world_size=16, profile=slow_nics, **SHAPE)
    plain, inner8, inner2 = (estimate_attention(inner_ring_size=w, **kw) for w in (None, 8, 2))
    assert inner8.est_time_s < inner2.est_time_s < plain.est_time_s
    assert plain.communication_s > 5 * inner8.communication_s
    # inside one node the double ring only adds steps
    one_node = dict(kw, world_size=8, profile=H200)
    assert estimate_attention(inner_ring_size=2, **one_node).est_time_s > estimate_attention(**one_node).est_time_s


def test_contiguous_causal_layout_prefers_head_parallel():
    # the contiguous layout gives the last rank of a ring (2W - 1) / W times the balanced work
    # (1.75 at W = 4), most of it in unmasked blocks (full_block_speedup: 1.75 / 1.05 = 1.67 the
    # time); Ulysses gathers the whole sequence and does not care
    plan = choose_attention(seq_len=131072, world_size=4, layout="contiguous", **SHAPE)
    assert plan.algorithm == "ulysses"
    ring = next(c for c in plan.candidates if c.label == "ring")
    assert ring.compute_s > 1.65 * next(c for c in plan.candidates if c.label == "ulysses").compute_s


def test_allgather_memory_grows_with_the_world():
    kw = dict(seq_len=524288, **SHAPE)
    ag4 = estimate_attention(algorithm="allgather", world_size=4, **kw)
    ring4 = estimate_attention(algorithm="ring", world_size=4, **kw)
    assert ag4.peak_memory_bytes > 1.5 * ring4.peak_memory_bytes
    # a sequence whose gathered K/V and fp32 dK/dV cannot fit is skipped with the reason
    plan = choose_attention(seq_len=2 * 1048576, num_heads=32, num_kv_heads=32, head_dim=128, world_size=4)
    assert "allgather" in dict(plan.skipped) and "GB" in dict(plan.skipped)["allgather"] and "ring" in _labels(plan)


def test_fixed_head_parallel_size():
    plan = choose_attention(seq_len=131072, world_size=8, head_parallel_size=2, **SHAPE)
    assert _labels(plan) == {"2d:2x4", "2d:2x4:inner2"}
    assert (plan.algorithm, plan.hp, plan.cp, plan.head_parallel_size) == ("2d", 2, 4, 2)
    one = choose_attention(seq_len=131072, world_size=8, head_parallel_size=1, **SHAPE)
    assert {c.algorithm for c in one.candidates} == {"ring", "allgather", "ulysses"}
    assert one.head_parallel_size == 1  # Ulysses runs on the strategy's 1-D mesh


def test_one_rank_is_local_attention():
    plan = choose_attention(seq_len=8192, world_size=1, **SHAPE)
    assert (plan.algorithm, plan.hp, plan.cp) == ("ring", 1, 1) and len(plan.candidates) == 1
    assert plan.candidates[0].communication_s == 0


# measured on 4 / 2 x H200 (benchmarks/results/20261122-nvidia-h200-x4.json): peak GB of one forward + backward
@pytest.mark.parametrize(
    "algorithm,seq_len,world,heads,chunks,measured_gb",
    [
        ("allgather", 1048576, 4, (33, 33), 3, 67.2),
        ("allgather", 1048576, 4, (32, 32), 4, 53.2),
        ("ring", 1048576, 4, (32, 32), 4, 32.3),
        ("ring", 1048576, 4, (33, 33), 3, 38.5),
        ("allgather", 524288, 2, (33, 33), 3, 46.6),
        ("ring", 1048576, 2, (32, 32), 4, 62.4),
    ],
)
def test_head_chunks_in_the_memory_estimate(algorithm, seq_len, world, heads, chunks, measured_gb):
    kw = dict(algorithm=algorithm, seq_len=seq_len, num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, world_size=world)
    plain, chunked = estimate_attention(**kw), estimate_attention(head_chunks=chunks, **kw)
    assert chunked.peak_memory_bytes < plain.peak_memory_bytes
    assert chunked.est_time_s == plain.est_time_s  # the same kernels, one group of heads after another
    assert abs(chunked.peak_memory_bytes / 1e9 / measured_gb - 1) < 0.1


def test_head_chunks_let_the_allgather_fit_at_1m():
    # without chunks the all-gather of 33 MHA heads at 1M on 4 GPUs needs ~168 GB (skipped); with 3 it ran in 67.2 GB
    kw = dict(seq_len=1048576, num_heads=33, num_kv_heads=33, head_dim=128, world_size=4, algorithms=("allgather",))
    with pytest.raises(ValueError, match=r"allgather: needs ~168 GB"):
        choose_attention(**kw)
    assert choose_attention(head_chunks=3, **kw).algorithm == "allgather"
    # only the ring and all-gather run in head chunks: Ulysses' estimate is the same with or without
    both = choose_attention(seq_len=1048576, num_heads=32, num_kv_heads=8, head_dim=128, world_size=4, head_chunks=4)
    plain = choose_attention(seq_len=1048576, num_heads=32, num_kv_heads=8, head_dim=128, world_size=4)
    mem = lambda plan, label: next(c.peak_memory_bytes for c in plan.candidates if c.label == label)  # noqa: E731
    assert mem(both, "ulysses") == mem(plain, "ulysses") and mem(both, "ring") < mem(plain, "ring")


def test_strategy_auto_plans_with_its_head_chunks():
    # fp32 (the strategy's default precision): the all-gather of 33 MHA heads at 1M on 4 ranks needs ~221 GB, ~100 GB in 3 chunks
    plain = _strategy(4, ParallelDims(cp=4, world_size=4), expected_seq_len=1048576)
    plain._resolve_auto_attention([_llama(33, 33)])
    assert "allgather" in {label for label, _ in plain.attention_plan.skipped}
    strategy = _strategy(4, ParallelDims(cp=4, world_size=4), expected_seq_len=1048576, head_chunks=3)
    strategy._resolve_auto_attention([_llama(33, 33)])
    assert strategy.attention in ("ring", "allgather")
    assert "allgather" in {c.algorithm for c in strategy.attention_plan.candidates}  # fits: the plan knows the chunks


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seq_len=0), "seq_len must be an int >= 1"),
        (dict(num_heads=32, num_kv_heads=5), r"num_heads \(32\) must be a multiple of num_kv_heads \(5\)"),
        (dict(head_dim=12.5), "head_dim must be an int"),
        (dict(world_size=True), "world_size must be an int"),
        (dict(seq_len=2, world_size=4), r"seq_len \(2\) must be at least world_size \(4\)"),
        (dict(layout="striped"), "layout='striped' is not supported"),
        (dict(causal="yes"), "causal must be a bool"),
        (dict(algorithms=("flash",)), "algorithms=.*must be a non-empty subset"),
        (dict(head_parallel_size=3), "head_parallel_size=3 must divide world_size=4"),
        (dict(tie_tolerance=2), "tie_tolerance must be in"),
        (dict(num_heads=33, num_kv_heads=33, algorithms=("ulysses",)), "no algorithm can run num_heads=33 on world_size=4"),
        (dict(head_chunks=3), "head_chunks=3 must divide num_kv_heads=8"),
        (dict(head_chunks=0), "head_chunks must be an int >= 1"),
    ],
)
def test_choose_errors_name_the_argument(kwargs, match):
    args = dict(seq_len=131072, num_heads=32, num_kv_heads=8, head_dim=128, world_size=4)
    with pytest.raises(ValueError, match=match):
        choose_attention(**{**args, **kwargs})


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(algorithm="2d", hp=3), r"algorithm='2d' needs hp, a divisor of world_size \(4\) from 1 to 4, got hp=3"),
        (dict(algorithm="2d", hp=8), r"algorithm='2d' needs hp, a divisor of world_size \(4\) from 1 to 4, got hp=8"),
        (dict(algorithm="2d"), r"algorithm='2d' needs hp, .* got hp=None"),
        (dict(algorithm="ulysses", num_heads=33, num_kv_heads=33), "4 must divide num_heads"),
        (dict(algorithm="allgather", inner_ring_size=2), "inner_ring_size is only used by 'ring' or '2d'"),
        (dict(algorithm="ring", inner_ring_size=3), "inner_ring_size=3 must be a positive int dividing"),
        (dict(algorithm="flash"), "algorithm='flash' is not supported"),
        (dict(algorithm="ulysses", head_chunks=2), "head_chunks=2 needs algorithm 'ring' or 'allgather'"),
        (dict(algorithm="ring", head_chunks=3), "head_chunks=3 needs .* must divide num_kv_heads=8"),
    ],
)
def test_estimate_errors_name_the_argument(kwargs, match):
    args = dict(seq_len=131072, num_heads=32, num_kv_heads=8, head_dim=128, world_size=4)
    with pytest.raises(ValueError, match=match):
        estimate_attention(**{**args, **kwargs})


@pytest.mark.parametrize("heads", [(32, 32), (32, 8)])
def test_2d_at_its_extremes(heads):
    """2D at hp = 1 is the ring over every rank (the attention runs exactly that); at hp = W it is
    Ulysses' head parallelism with the functional all-to-alls, none of which overlaps: Ulysses'
    own op hides all but its first and last stage (Note [Overlapped Ulysses])."""
    args = dict(seq_len=131072, num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, world_size=8)
    ring, ulysses = estimate_attention(algorithm="ring", **args), estimate_attention(algorithm="ulysses", **args)
    one = estimate_attention(algorithm="2d", hp=1, **args)
    assert (one.hp, one.cp) == (1, 8)
    assert one.est_time_s == ring.est_time_s and one.peak_memory_bytes == ring.peak_memory_bytes
    eight = estimate_attention(algorithm="2d", hp=8, **args)
    assert (eight.hp, eight.cp) == (8, 1) and eight.peak_memory_bytes == ulysses.peak_memory_bytes
    assert eight.compute_s == ulysses.compute_s
    stages = ulysses_stages(heads[1] // 8) if heads[1] >= 8 else 1
    if stages > 1:
        assert ulysses.communication_s < eight.communication_s
    else:  # one stage: nothing to overlap; one all-to-all for q, k, v together
        assert ulysses.communication_s <= eight.communication_s


def test_profile_validation_and_lookup():
    with pytest.raises(ValueError, match="DeviceProfile.gpus_per_node must be a positive int"):
        DeviceProfile.h200(gpus_per_node=0)
    with pytest.raises(ValueError, match="DeviceProfile.attention_flops must be positive"):
        DeviceProfile.h200(attention_flops=0)
    assert DeviceProfile.for_device("NVIDIA H100 80GB HBM3").name == "H100"
    assert DeviceProfile.for_device("NVIDIA H200", gpus_per_node=4).gpus_per_node == 4


# ---------------------------------------------------------------------------------------------- the strategy


def _llama(n_head: int, n_kv_head: int):
    from lightning_seqpar.models import Llama, LlamaConfig

    with torch.device("meta"):
        return Llama(LlamaConfig(vocab_size=64, n_embd=n_head * 16, n_layer=1, n_head=n_head, n_kv_head=n_kv_head, head_dim=128))


def _strategy(devices: int, dims: ParallelDims | None = None, **kwargs) -> SequenceParallelStrategy:
    strategy = SequenceParallelStrategy(**kwargs)
    strategy.parallel_devices = [torch.device("cpu")] * devices
    strategy._parallel_dims = dims  # what setup_environment sets, without a process group
    return strategy


@pytest.mark.parametrize("heads", [(32, 8), (33, 33), (32, 1)])
def test_strategy_auto_resolves_to_the_cost_models_plan(heads):
    model = _llama(*heads)
    strategy = _strategy(4, ParallelDims(cp=4, world_size=4), expected_seq_len=131072)
    strategy._resolve_auto_attention([model])
    # the strategy's default precision is "32-true": 4-byte q, k, v
    expected = choose_attention(seq_len=131072, num_heads=heads[0], num_kv_heads=heads[1], head_dim=128, world_size=4, dtype_bytes=4,
                                head_parallel_size=1, double_ring=False, profile=DeviceProfile.h200(gpus_per_node=4))
    assert strategy.attention == expected.algorithm
    assert strategy.attention_plan is not None and strategy.attention_plan.label == expected.label
    if heads[0] == 33:
        assert strategy.attention in ("ring", "allgather")


def test_strategy_auto_keeps_a_fixed_head_parallel_size():
    strategy = _strategy(4, ParallelDims(hp=2, cp=2, world_size=4), head_parallel_size=2, expected_seq_len=131072)
    assert strategy.attention == "2d"
    strategy._resolve_auto_attention([_llama(32, 8)])
    assert strategy.attention == "2d" and strategy.attention_plan.hp == 2
    with pytest.raises(ValueError, match="SequenceParallelStrategy: attention='auto' with expected_seq_len=131072.*num_heads=33"):
        _strategy(4, ParallelDims(hp=2, cp=2, world_size=4), head_parallel_size=2, expected_seq_len=131072)._resolve_auto_attention([_llama(33, 33)])


@pytest.mark.parametrize("option,allowed", [(dict(head_chunks=2), ("ring", "allgather")), (dict(inner_ring_size=2), ("ring", "2d"))])
def test_strategy_auto_picks_among_algorithms_that_take_the_users_options(option, allowed):
    # unrestricted, the plan for 32/8 heads on 4 ranks at 32K is Ulysses, which takes neither option
    kw = dict(seq_len=32768, num_heads=32, num_kv_heads=8, head_dim=128, world_size=4, dtype_bytes=4, double_ring=False,
              profile=DeviceProfile.h200(gpus_per_node=4))
    assert choose_attention(head_parallel_size=1, **kw).algorithm == "ulysses"
    strategy = _strategy(4, ParallelDims(cp=4, world_size=4), expected_seq_len=32768, **option)
    strategy._resolve_auto_attention([_llama(32, 8)])
    strategy._check_options_against_model([_llama(32, 8)])  # what setup() runs next: no error
    assert strategy.attention in allowed
    assert strategy.attention_plan.label == choose_attention(head_parallel_size=1, algorithms=allowed, **kw).label


def test_strategy_auto_without_expected_seq_len_is_unchanged():
    strategy = _strategy(4, ParallelDims(cp=4, world_size=4))
    strategy._resolve_auto_attention([_llama(32, 8)])
    assert (strategy.attention, strategy.attention_plan) == ("ring", None)
    fixed = _strategy(4, ParallelDims(cp=4, world_size=4), attention="allgather", expected_seq_len=131072)
    fixed._resolve_auto_attention([_llama(32, 8)])
    assert fixed.attention == "allgather" and fixed.attention_plan is None


def test_strategy_auto_head_parallel_size_from_the_module_config():
    from lightning_seqpar import CausalLMModule
    from lightning_seqpar.models import LlamaConfig

    config = LlamaConfig(vocab_size=64, n_embd=512, n_layer=1, n_head=32, n_kv_head=8, head_dim=128)
    strategy = _strategy(4, head_parallel_size="auto", sequence_parallel_size=4, expected_seq_len=131072)
    strategy.connect(CausalLMModule(config))
    plan = choose_attention(seq_len=131072, world_size=4, double_ring=False, dtype_bytes=4, profile=DeviceProfile.h200(gpus_per_node=4),
                            **SHAPE)
    assert strategy.resolve_parallel_dims().hp == plan.head_parallel_size
    # no config to read: hp = 1; a linear-attention model: hp = 1 (LASP)
    bare = _strategy(4, head_parallel_size="auto", expected_seq_len=131072)
    assert bare.resolve_parallel_dims().hp == 1
    from lightning_seqpar.models import TransNormerConfig

    tnl = _strategy(4, head_parallel_size="auto", expected_seq_len=131072)
    tnl.connect(CausalLMModule(TransNormerConfig(vocab_size=64, n_embd=64, n_layer=1, n_head=4)))
    assert tnl.resolve_parallel_dims().hp == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(head_parallel_size="many"), "head_parallel_size must be a positive int or 'auto'"),
        (dict(head_parallel_size="auto", attention="ring"), "head_parallel_size='auto' is chosen together with the algorithm"),
        (dict(expected_seq_len=0), "expected_seq_len must be a positive int"),
        (dict(head_chunks=2, head_parallel_size=2), "head_chunks=2 is for attention='ring' or 'allgather' .*head_parallel_size=2 means 2D"),
    ],
)
def test_strategy_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        SequenceParallelStrategy(**kwargs)
    assert "SequenceParallelStrategy" in str(info.value)


def test_auto_is_within_5_percent_of_the_measured_best_on_every_recorded_point():
    """Issue #7 item 4, replayed on every attention measurement in benchmarks/results (2 and 4 x
    H200, cuDNN and flash-attention 4): among the algorithms measured at a point, the model's pick
    runs within 5% of the fastest."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from report import auto_points, evaluate, records

    decided, errors = evaluate(auto_points(records()))
    assert len(decided) >= 20 and {d["backend"] for d in decided} == {"cudnn", "fa4"}
    misses = [d for d in decided if d["ratio"] < 0.95]
    assert not misses, misses
    assert all(abs(e[0]) < 0.15 for e in errors), max(errors, key=lambda e: abs(e[0]))


def test_profiles_per_kernel():
    cudnn, fa4 = DeviceProfile.for_device("NVIDIA H200"), DeviceProfile.for_device("NVIDIA H200", backend="fa4")
    assert cudnn.full_block_speedup > 1.0 and fa4.full_block_speedup == 1.0 and fa4.attention_flops > cudnn.attention_flops
    assert DeviceProfile.for_device("NVIDIA H100 80GB HBM3", backend="fa4").attention_flops < fa4.attention_flops
    with pytest.raises(ValueError, match="DeviceProfile.full_block_speedup must be positive"):
        DeviceProfile.h200(full_block_speedup=0)
    # at 1M tokens on 4 GPUs the ring's unmasked blocks make it faster than Ulysses' one causal
    # call with cuDNN; with flash-attention 4 Ulysses is ahead (both as measured, docs/benchmarks.md)
    kw = dict(seq_len=1 << 20, world_size=4, double_ring=False, algorithms=("ring", "ulysses"), **SHAPE)
    assert choose_attention(profile=cudnn, **kw).algorithm == "ring"
    assert choose_attention(profile=fa4, **kw).algorithm == "ulysses"


@pytest.mark.parametrize("backend", ["cudnn", "fa4"])
def test_strategy_plans_with_the_kernels_profile(backend):
    strategy = _strategy(4, ParallelDims(cp=4, world_size=4), expected_seq_len=1 << 20, attention_backend=backend)
    strategy._resolve_auto_attention([_llama(32, 8)])
    expected = choose_attention(seq_len=1 << 20, num_heads=32, num_kv_heads=8, head_dim=128, world_size=4, dtype_bytes=4,
                                head_parallel_size=1, double_ring=False,
                                profile=DeviceProfile.for_device("", backend=backend, gpus_per_node=4))
    assert strategy.attention_plan.est_time_s == pytest.approx(expected.est_time_s)


# ------------------------------------------------------------------ two link levels (issue #24 item 2)


def test_one_node_is_unchanged_by_the_node_terms():
    # every group inside a node: the inter-node parameters do not enter
    kw = dict(seq_len=131072, world_size=8, **SHAPE)
    base = choose_attention(profile=H200, **kw)
    slow = choose_attention(profile=DeviceProfile.h200(inter_node_bandwidth=1e9, inter_node_latency_s=1e-3), **kw)
    assert [(c.label, c.est_time_s) for c in base.candidates] == [(c.label, c.est_time_s) for c in slow.candidates]
    assert all(c.placement == "context-first" for c in base.candidates)


def test_crossing_nodes_costs_the_nic_rate_and_latency():
    kw = dict(algorithm="ring", seq_len=131072, world_size=16, **SHAPE)
    fast = estimate_attention(profile=DeviceProfile.h200(inter_node_bandwidth=350e9, inter_node_latency_s=0.0), **kw)
    ib = estimate_attention(profile=H200, **kw)
    slower = estimate_attention(profile=DeviceProfile.h200(inter_node_latency_s=200e-6), **kw)
    # with NVLink-rate NICs the ring over two nodes costs what it does inside a big node
    big_node = estimate_attention(profile=DeviceProfile.h200(gpus_per_node=16), **kw)
    assert fast.est_time_s == pytest.approx(big_node.est_time_s)
    assert fast.est_time_s < ib.est_time_s < slower.est_time_s


def test_placement_moves_the_all_to_all_or_the_ring_onto_nvlink():
    # 64 GPUs, hp=8 x cp=8, MHA at 128K (LoongTrain Table 4: head-first 72 ms < ring-heavy layouts):
    # head-first keeps the large all-to-alls on NVLink, context-first the ring
    kw = dict(algorithm="2d", hp=8, seq_len=131072, num_heads=32, num_kv_heads=32, head_dim=128, world_size=64, profile=H200)
    hf = estimate_attention(placement="head-first", **kw)
    cf = estimate_attention(placement="context-first", **kw)
    assert hf.placement == "head-first" and hf.label == "2d:8x8:head-first"
    # the all-to-alls: intra-node under head-first; the ring of 8 then crosses nodes (and vice versa)
    p = H200
    s_local_el = 131072 // 64 * 32 * 128
    from lightning_seqpar.attention.cost import _collective
    assert _collective(s_local_el * 2, 8, 1, p) < _collective(s_local_el * 2, 8, 8, p) / 5
    assert hf.est_time_s != cf.est_time_s
    # a large hp on head-first wins where the all-to-all dominates (many heads per rank, short S)
    plan = choose_attention(seq_len=131072, num_heads=32, num_kv_heads=32, head_dim=128, world_size=64, profile=H200)
    assert {"context-first", "head-first"} <= {c.placement for c in plan.candidates}
    assert plan.placement == plan.candidates[0].placement


def test_choose_across_nodes_weighs_inner_rings_and_skips_what_cannot_be_placed():
    plan = choose_attention(seq_len=1048576, num_heads=32, num_kv_heads=8, head_dim=128, world_size=32, profile=H200)
    labels = _labels(plan)
    assert "ring:inner8" in labels and "2d:2x16:inner8" in labels and "2d:2x16:inner4:head-first" in labels
    skipped = dict(plan.skipped)
    assert "ring:inner16" in skipped and "not inside a node of 8" in skipped["ring:inner16"]
    assert "2d:2x16:inner8:head-first" in skipped  # 8 x 2 = 16 ranks per inner ring
    for c in plan.candidates:  # what is offered, ParallelDims accepts
        dims = ParallelDims(hp=c.hp, cp=c.cp, world_size=32, node_size=8, placement=c.placement) if c.algorithm == "2d" else \
            ParallelDims(cp=32, world_size=32, node_size=8)
        dims.check_inner_ring(c.inner_ring_size)
    with pytest.raises(ValueError, match="placement='diagonal' is not supported"):
        choose_attention(seq_len=4096, world_size=16, placement="diagonal", **SHAPE)  # type: ignore[arg-type]
    fixed = choose_attention(seq_len=1048576, world_size=32, placement="head-first", head_parallel_size=4, profile=H200, **SHAPE)
    assert fixed.placement == "head-first" and fixed.hp == 4


def test_double_ring_across_nodes_beats_the_plain_ring_at_short_sequences():
    # 64 GPUs, GQA 32/8 at 128K: the plain ring waits on the NIC at every step
    plan = choose_attention(seq_len=131072, world_size=64, algorithms=("ring",), profile=H200, **SHAPE)
    assert plan.inner_ring_size == 8
    plain = next(c for c in plan.candidates if c.label == "ring")
    assert plan.est_time_s < 0.8 * plain.est_time_s


def test_strategy_auto_across_nodes_sets_placement_and_inner_ring():
    from lightning_seqpar import CausalLMModule
    from lightning_seqpar.models import LlamaConfig

    config = LlamaConfig(vocab_size=64, n_embd=512, n_layer=1, n_head=32, n_kv_head=32, head_dim=128)
    strategy = SequenceParallelStrategy(head_parallel_size="auto", sequence_parallel_size=64, expected_seq_len=131072)
    strategy.parallel_devices = [torch.device("cpu")] * 8
    strategy.num_nodes = 8
    strategy.connect(CausalLMModule(config))
    dims = strategy.resolve_parallel_dims()
    plan = choose_attention(seq_len=131072, world_size=64, dtype_bytes=4, profile=DeviceProfile.h200(gpus_per_node=8),
                            num_heads=32, num_kv_heads=32, head_dim=128)
    assert (dims.node_size, dims.hp, dims.placement) == (8, plan.head_parallel_size, plan.placement)
    strategy._parallel_dims = dims
    strategy._resolve_auto_attention([_llama(32, 32)])
    assert strategy.attention_plan.label == plan.label and strategy.inner_ring_size == plan.inner_ring_size
    strategy._check_options_against_model([_llama(32, 32)])
    with pytest.raises(ValueError, match="placement='sideways' is not supported"):
        SequenceParallelStrategy(placement="sideways")  # type: ignore[arg-type]


def test_strategy_auto_runs_the_attention_its_memory_was_planned_with():
    """memory="auto" chose the attention together with its options (MemoryPlan.attention, Note [Attention and memory
    chosen together]): setup resolves "auto" to that candidate, not to the cost model's first pick."""
    from dataclasses import replace

    from lightning_seqpar.planner.memory import TransformerShape, plan_memory

    strategy = _strategy(4, ParallelDims(cp=4, world_size=4), expected_seq_len=131072)
    strategy._resolve_auto_attention([_llama(32, 8)])
    first, second = strategy.attention_plan.candidates[:2]
    assert first.algorithm != second.algorithm
    shape = TransformerShape(hidden_size=512, num_layers=1, num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=1024,
                             vocab_size=64)
    planned = replace(plan_memory(model_shape=shape, seq_len=131072, device_memory=1e12, sp=4), attention=second.label)
    strategy = _strategy(4, ParallelDims(cp=4, world_size=4), expected_seq_len=131072)
    strategy.memory_plan = planned
    strategy._resolve_auto_attention([_llama(32, 8)])
    assert strategy.attention == second.algorithm and strategy.attention_plan.label == second.label
    assert strategy.attention_plan.candidates[1] == first  # the others keep their order after the pick

"""warm_up_backward_handles (Note [Library handles of the backward thread]): a no-op off CUDA; on a
GPU it runs a backward and keeps no more than the handles' workspaces."""

from __future__ import annotations

import pytest
import torch

from lightning_seqpar.parallel.cuda_warmup import warm_up_backward_handles


def test_no_op_on_cpu():
    assert warm_up_backward_handles(torch.device("cpu")) is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_keeps_no_memory_on_gpu():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    assert warm_up_backward_handles(device) is True
    # cuBLAS workspaces come from the caching allocator and stay with their handle (tens of MiB)
    kept = torch.cuda.memory_allocated(device) - before
    assert 0 <= kept <= 256 * 2**20, kept
    assert warm_up_backward_handles(device) is True  # again: the same handles, nothing more kept
    assert torch.cuda.memory_allocated(device) == before + kept


def _fit_counting_warm_ups(rank: int, world_size: int):
    import lightning_seqpar.strategy as strategy_module
    from strategy_testing import train_strategy

    calls = []
    original = strategy_module.warm_up_backward_handles
    strategy_module.warm_up_backward_handles = lambda device: calls.append(str(device)) or original(device)
    try:
        train_strategy(rank, world_size, dict(sequence_parallel_size=2, attention="ring"), steps=1)
    finally:
        strategy_module.warm_up_backward_handles = original
    return calls


def test_the_strategy_warms_up_once_before_fitting():
    from dist_utils import run_distributed

    assert run_distributed(_fit_counting_warm_ups, 2, timeout=120) == [["cpu"], ["cpu"]]

"""LSS GPT through Lightning: 5-step training parity of SequenceParallelStrategy against devices=1
(needs CausalLMModule to accept GPT configs)."""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from strategy_testing import train_reference, train_strategy

TIMEOUT = 300


@pytest.fixture(scope="module")
def reference():
    return train_reference("gpt-tiny")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world,sp,ac", [(2, 2, "selective++"), (4, 2, None), (4, 4, "full")], ids=["dp1-sp2", "dp2-sp2", "dp1-sp4"])
def test_gpt_training_parity(world, sp, ac, layout, reference):
    kwargs = dict(sequence_parallel_size=sp, attention="allgather", load_balance=layout, activation_checkpointing=ac)
    results = run_distributed(train_strategy, world, kwargs, "gpt-tiny", timeout=TIMEOUT)
    ref_losses, ref_weights = reference
    for losses, _ in results:
        assert losses == results[0][0]
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    weights = results[0][1]
    assert weights.keys() == ref_weights.keys()
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=0, atol=1e-5, msg=name)


def test_gpt_training_parity_offloaded_parameters(reference):
    """offload_params: the sequence-distributed positional embedding's gradient (summed over the ranks)
    reaches the offloaded shards like every other parameter's."""
    kwargs = dict(sequence_parallel_size=2, attention="allgather", offload_params=True)
    results = run_distributed(train_strategy, 2, kwargs, "gpt-tiny", timeout=TIMEOUT)
    ref_losses, ref_weights = reference
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(results[0][1][name], ref, rtol=0, atol=1e-5, msg=name)

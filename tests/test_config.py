"""StrategyConfig: the strategy's options, frozen and checked once; the apply_* functions share its checks."""

from __future__ import annotations

import dataclasses
import inspect
from datetime import timedelta

import pytest
import torch

from lightning_seqpar import SequenceParallelStrategy
from lightning_seqpar.models import Llama, LlamaConfig
from lightning_seqpar.parallel.config import StrategyConfig
from lightning_seqpar.parallel.parallelize import apply_ac, apply_attention


def test_the_config_mirrors_the_constructor():
    """Same names and defaults as SequenceParallelStrategy.__init__ (LightningCLI parses the constructor)."""
    params = {n: p.default for n, p in inspect.signature(SequenceParallelStrategy.__init__).parameters.items() if n != "self"}
    fields = {f.name: f.default for f in dataclasses.fields(StrategyConfig)}
    assert params == fields


def test_the_config_is_frozen_and_resolves_derived_values():
    config = StrategyConfig(sequence_parallel_size=2, load_balance=True, compile={"fullgraph": True}, timeout=30)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.attention = "ring"  # type: ignore[misc]
    assert (config.initial_attention, config.layout, config.compile_kwargs) == ("ring", "zigzag", {"fullgraph": True})
    assert config.timeout == timedelta(seconds=30)
    assert StrategyConfig(attention="lasp").layout == "contiguous"  # load_balance="auto"
    assert StrategyConfig(head_parallel_size=2).initial_attention == "2d"
    assert StrategyConfig().compile_kwargs is None
    strategy = SequenceParallelStrategy(attention="ulysses", mlp_chunk_size=64, offload_params=True)
    assert strategy.config == StrategyConfig(attention="ulysses", mlp_chunk_size=64, offload_params=True)
    assert (strategy.attention, strategy.mlp_chunk_size, strategy.offload_params) == ("ulysses", 64, True)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(uncheckpointed_blocks=-1), "SequenceParallelStrategy: uncheckpointed_blocks must be an int >= 0"),
        (dict(lasp_variant="ring"), "SequenceParallelStrategy: lasp_variant='ring' is not supported"),
        (dict(placement="rack-first"), "SequenceParallelStrategy: placement='rack-first' is not supported"),
        (dict(offload_checkpoints=-1), "SequenceParallelStrategy: offload_checkpoints must be True, False or the number"),
        (dict(offload_checkpoints=1.5), "SequenceParallelStrategy: offload_checkpoints must be True, False or the number"),
        (dict(bf16_adapters=1), "SequenceParallelStrategy: bf16_adapters must be True or False"),
    ],
)
def test_the_config_raises_naming_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StrategyConfig(**kwargs)


def _tiny() -> Llama:
    return Llama(LlamaConfig(vocab_size=32, n_embd=16, n_layer=2, n_head=2, intermediate_size=32, max_seq_len=16))


def test_apply_functions_check_with_the_config_helpers():
    """The same messages as the strategy's, without its name (the functions are used on their own)."""
    with pytest.raises(ValueError, match="^uncheckpointed_blocks must be an int >= 0"):
        apply_ac(_tiny(), "full", uncheckpointed_blocks=-2)
    with pytest.raises(ValueError, match="^offload_checkpoints=True offloads what checkpointed blocks keep"):
        apply_ac(_tiny(), None, offload_checkpoints=True)
    with pytest.raises(ValueError, match="^lasp_variant='ring' is not supported"):
        apply_attention(_tiny(), None, attention="lasp", layout="contiguous", lasp_variant="ring")


def test_apply_attention_needs_the_attention_keyword():
    model = _tiny()
    with pytest.raises(TypeError, match="attention"):
        apply_attention(model, None)
    assert apply_attention(model, None, attention="allgather") == 2
    assert torch.is_tensor(model(torch.zeros(1, 4, dtype=torch.long)))

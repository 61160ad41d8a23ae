"""User mistakes end in a ValueError that names the argument and the fix, raised before any
collective; batches that differ across ranks are named, not hung on; padding and edge cases of
the labels keep the loss and gradients finite and equal to the single-device reference.

``no_collectives()`` (tests/seqpar_testing.py) makes every collective raise ``RuntimeError("collective
ran")``: a ``ValueError`` inside it proves the check ran before any communication.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_utils import run_distributed
from seqpar_testing import no_collectives

TIMEOUT = 180
QUICKSTART = Path(__file__).parent.parent / "recipes" / "quickstart.yaml"


def _ready_strategy(world_size: int, **kwargs: Any):
    """A SequenceParallelStrategy with its mesh built on the pooled process group (no Trainer run)."""
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    strategy = SequenceParallelStrategy(**kwargs)
    L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False)
    strategy.connect(CausalLMModule("tiny"))
    strategy.setup_environment()
    return strategy


def _batch(seq_len: int = 32, batch_size: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (batch_size, seq_len + 1), generator=g)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].clone()}


# ---------------------------------------------------------------------------------------------- local checks

def _bad_batches() -> list[tuple[str, Any, str]]:
    b = _batch()
    left_pad = torch.ones(2, 32, dtype=torch.long)
    left_pad[0, :4] = 0
    right_pad = torch.ones(2, 32, dtype=torch.long)
    right_pad[1, 28:] = 0
    return [
        ("not a dict", torch.zeros(2, 32, dtype=torch.long), "shards dict batches"),
        ("no input_ids", {"ids": b["input_ids"]}, r"keys \['ids'\]"),
        ("length", _batch(seq_len=30), r"sequence length 30 of batch\['input_ids'\] must be a multiple of 4 .*set pad_to_multiple=True"),
        ("float ids", {**b, "input_ids": b["input_ids"].float()}, r"batch\['input_ids'\] must be an integer tensor .*\.long\(\)"),
        ("float labels", {**b, "labels": b["labels"].float()}, r"batch\['labels'\] must be an integer tensor"),
        ("float positions", {**b, "position_ids": torch.arange(32.0).expand(2, 32)}, r"batch\['position_ids'\] must be an integer"),
        ("shifted labels", {**b, "labels": b["labels"][:, 1:]}, r"batch\['labels'\] has shape \(2, 31\) .*never shifted after sharding"),
        ("positions", {**b, "position_ids": torch.arange(16).expand(2, 16)}, r"batch\['position_ids'\] has shape \(2, 16\)"),
        ("4-D mask", {**b, "attention_mask": torch.ones(2, 1, 32, 32)}, r"attention_mask'\] of shape \(2, 1, 32, 32\) is not supported"),
        ("left padding", {**b, "attention_mask": left_pad}, r"rows \[0\] are not right padding .*Pad on the right"),
        ("labels on padding", {**b, "attention_mask": right_pad}, r"labels'\] has targets where batch\['attention_mask'\] is 0; set labels=-100"),
    ]


def _local_checks(rank: int, world_size: int) -> dict[str, str]:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    strategy = _ready_strategy(world_size, sequence_parallel_size=2, attention="ring")
    messages = {}
    for name, batch, match in _bad_batches():
        with no_collectives(), pytest.raises(ValueError, match=match) as info:
            strategy.shard_batch(batch)
        messages[name] = str(info.value)
    # The guard is live: a good batch reaches the cross-rank comparison, a collective.
    with no_collectives(), pytest.raises(RuntimeError, match="collective ran"):
        strategy.shard_batch(_batch())
    # pad_to_multiple: the same length-30 batch is padded locally (checked with the comparison off).
    padding = _ready_strategy(world_size, sequence_parallel_size=2, attention="ring", pad_to_multiple=True,
                              validate_batches=False)
    with no_collectives():
        shard = padding.shard_batch(_batch(seq_len=30))
    assert shard["input_ids"].shape == (2, 16)
    return messages


def test_batch_mistakes_raise_before_any_collective():
    messages = run_distributed(_local_checks, 2, timeout=TIMEOUT)[0]
    assert all(m.startswith("SequenceParallelStrategy") for m in messages.values()), messages


# ---------------------------------------------------------------------------------------------- cross-rank check

def _different_batches(rank: int, world_size: int, kind: str) -> str:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    strategy = _ready_strategy(world_size, sequence_parallel_size=2, attention="ring")
    odd = rank == world_size - 1  # the last rank's batch differs from its group's first rank
    if kind == "shapes":
        batch = _batch(seq_len=64 if odd else 32)
    else:
        batch = _batch(seed=1 if odd else 0)
    with pytest.raises(ValueError) as info:
        strategy.shard_batch(batch)
    return str(info.value)


@pytest.mark.parametrize("world,kind", [(2, "shapes"), (4, "tokens")])
def test_batches_that_differ_across_ranks_are_named(world, kind):
    """Every rank raises the same error (no rank is left waiting), naming the rank that differs."""
    messages = run_distributed(_different_batches, world, kind, timeout=TIMEOUT)
    assert len(set(messages)) == 1, messages
    group = [world - 2, world - 1]
    assert f"ranks [{world - 1}] hold batches with different {kind} than rank {world - 2}" in messages[0]
    assert f"sequence-parallel group {group}" in messages[0] and "use_distributed_sampler" in messages[0]


# ---------------------------------------------------------------------------------------------- model and mesh

def _heads(rank: int, world_size: int) -> list[str]:
    from lightning_seqpar.attention import sequence_parallel_attention
    from lightning_seqpar.models import Llama, LlamaConfig
    from lightning_seqpar.parallel.parallelize import apply_attention
    from seqpar_testing import mesh_1d, mesh_2d

    out = []
    model = Llama(LlamaConfig.from_name("tiny-3h"))
    meshes = [("ulysses", mesh_1d(world_size))]
    if world_size == 4:
        meshes.append(("2d", mesh_2d(("hp", "cp"), (2, 2))))
    for algorithm, mesh in meshes:
        with no_collectives(), pytest.raises(ValueError) as info:
            apply_attention(model, mesh, attention=algorithm)
        out.append(str(info.value))
    # dtype mismatch of the attention inputs
    q = torch.randn(1, 8, 4, 8)
    with no_collectives(), pytest.raises(ValueError, match=r"q, k and v must share one dtype; got q=torch.float32, k=torch.bfloat16"):
        sequence_parallel_attention(q, q.bfloat16(), q, mesh=mesh_1d(world_size), algorithm="ring")
    return out


def test_heads_not_dividing_and_dtype_mismatch_raise_before_any_collective():
    messages = run_distributed(_heads, 4, timeout=TIMEOUT)[0]
    assert "splits the query heads over sequence_parallel_size=4 ranks, but Llama has 3 query heads" in messages[0]
    assert "choose a sequence_parallel_size that divides 3" in messages[0]
    assert "head_parallel_size=2 ranks, but Llama has 3 query heads" in messages[1]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sequence_parallel_size=3), "sequence_parallel_size=3 must divide the world size 4"),
        (dict(sequence_parallel_size=4, head_parallel_size=3, attention="2d"), "head_parallel_size=3 must divide sequence_parallel_size=4"),
        (dict(sequence_parallel_size=2, data_parallel_replicate_size=4), "data_parallel_replicate_size=4 must divide"),
    ],
)
def test_sizes_not_multiplying_to_the_world_raise_before_the_process_group(kwargs, match):
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    strategy = SequenceParallelStrategy(**kwargs)
    L.Trainer(accelerator="cpu", devices=4, strategy=strategy, logger=False)
    strategy.connect(CausalLMModule("tiny"))
    started = torch.distributed.is_initialized()  # another test of this process may have started one
    with no_collectives(), pytest.raises(ValueError, match=match):
        strategy.setup_environment()
    assert torch.distributed.is_initialized() == started  # raised before init_process_group


def test_unknown_recipe_keys_are_named_with_the_fix(capsys, monkeypatch):
    from lightning_seqpar.cli.seqpar import main, unknown_key_hints

    monkeypatch.setattr(sys, "argv", ["seqpar"])
    with no_collectives(), pytest.raises(SystemExit):
        main(["fit", "--config", str(QUICKSTART), "--trainer.strategy.init_args.sequence_parallel_sizes=2"])
    err = capsys.readouterr().err
    assert "hint: unknown key 'sequence_parallel_sizes': did you mean 'sequence_parallel_size'" in err
    assert unknown_key_hints("unrecognized arguments: --model.warmup_step=3")[0].startswith(
        "unknown key 'warmup_step': did you mean 'warmup_steps'")


# ---------------------------------------------------------------------------------------------- padding and NaN safety

def _edge_cases(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Loss and summed gradients of sequence-parallel runs vs one device, for label edge cases."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import torch.distributed as dist

    from lightning_seqpar.loss import chunked_cross_entropy_sum, global_mean_loss, token_cross_entropy_sum
    from lightning_seqpar.models import Llama, LlamaConfig
    from lightning_seqpar.parallel.parallelize import apply_attention

    strategy = _ready_strategy(world_size, sequence_parallel_size=2, attention="ring", pad_to_multiple=True)
    config = LlamaConfig.from_name("tiny")

    def model_on(mesh):
        torch.manual_seed(0)
        model = Llama(config)
        apply_attention(model, mesh, attention="ring")
        return model

    def loss_and_grads(model, batch, group, chunk: int | None):
        pos = batch.get("position_ids")
        if chunk is None:
            loss_sum, n = token_cross_entropy_sum(model(batch["input_ids"], pos), batch["labels"])
        else:
            hidden = model(batch["input_ids"], pos, output="hidden")
            loss_sum, n = chunked_cross_entropy_sum(hidden, model.lm_head.weight, batch["labels"], chunk_size=chunk)
        loss = global_mean_loss(loss_sum, n, group)
        model.zero_grad()
        loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters()}
        reported = loss.detach().clone()
        if group is not None:
            dist.all_reduce(reported)
            for g in grads.values():
                dist.all_reduce(g)
        return reported, grads

    b = _batch()
    zigzag_rank1 = torch.cat([torch.arange(8, 16), torch.arange(16, 24)])  # the positions rank 1 holds
    no_labels_on_rank1 = {**b, "labels": b["labels"].index_fill(1, zigzag_rank1, -100)}
    masked_row = {**b, "labels": b["labels"].clone(), "attention_mask": torch.ones(2, 32, dtype=torch.long)}
    masked_row["labels"][1] = -100
    masked_row["attention_mask"][1] = 0
    cases = {
        "rank without labels": (no_labels_on_rank1, None),
        "rank without labels, chunked loss": (no_labels_on_rank1, 5),
        "fully masked row": (masked_row, None),
        "no labels at all": ({**b, "labels": torch.full_like(b["labels"], -100)}, None),
        "one-token sequences (padded)": (_batch(seq_len=1), None),
        "length 30 (padded)": (_batch(seq_len=30), None),
    }
    results = {}
    for name, (batch, chunk) in cases.items():
        ref_batch = {k: v for k, v in batch.items() if k != "attention_mask"}
        ref_loss, ref_grads = loss_and_grads(model_on(None), ref_batch, None, chunk)
        shard = strategy.shard_batch(batch)
        shard.pop("attention_mask", None)
        loss, grads = loss_and_grads(model_on(strategy.sp_mesh), shard, strategy.sp_mesh, chunk)
        finite = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(g).all()) for g in grads.values())
        err = max(float((grads[k] - ref_grads[k]).abs().max()) for k in grads)
        results[name] = {"loss": float(loss), "ref": float(ref_loss), "finite": finite, "grad_err": err,
                         "grad_norm": float(sum(g.norm() ** 2 for g in ref_grads.values()) ** 0.5),
                         "local_valid": int((shard["labels"] != -100).sum())}
    return results


def test_padding_and_label_edge_cases_match_one_device():
    results = run_distributed(_edge_cases, 2, timeout=TIMEOUT)
    for name, r in results[0].items():
        assert r["finite"], name
        assert r["loss"] == pytest.approx(r["ref"], rel=1e-5, abs=1e-6), name
        assert r["grad_err"] <= 2e-6, (name, r)
    assert results[1]["rank without labels"]["local_valid"] == 0  # rank 1 really had no label
    assert results[1]["one-token sequences (padded)"]["local_valid"] == 0  # rank 1 held padding only
    assert results[0]["no labels at all"]["loss"] == 0.0 and results[0]["no labels at all"]["grad_norm"] == 0.0

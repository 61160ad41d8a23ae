"""SequenceParallelStrategy: argument validation, mesh, registry, the batch hook and the sampler."""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import pytest
import torch

from dist_utils import run_distributed
from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
from lightning_seqpar.parallel.mesh import MESH_AXES, ParallelDims

TIMEOUT = 180


# ---------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sequence_parallel_size=0), "sequence_parallel_size must be a positive int or 'auto'"),
        (dict(sequence_parallel_size="all"), "sequence_parallel_size"),
        (dict(head_parallel_size=0), "head_parallel_size must be a positive int"),
        (dict(data_parallel_replicate_size=-1), "data_parallel_replicate_size must be a positive int"),
        (dict(attention="flash"), "attention='flash' is not supported"),
        (dict(attention="2d"), "attention='2d' needs head_parallel_size > 1"),
        (dict(attention="ring", head_parallel_size=2), "head_parallel_size=2 needs attention='2d'"),
        (dict(load_balance="striped"), "load_balance='striped' is not supported"),
        (dict(activation_checkpointing="some"), "activation_checkpointing='some' is not supported"),
        (dict(compile="yes"), "compile must be True, False, \"auto\" or a dict"),
        (dict(timeout="soon"), "timeout must be"),
        (dict(inner_ring_size=0), "inner_ring_size must be a positive int or None"),
        (dict(attention="allgather", inner_ring_size=2), "inner_ring_size is for attention='ring' or '2d'"),
        (dict(head_chunks=0), "head_chunks must be a positive int"),
        (dict(attention="ulysses", head_chunks=2), "head_chunks=2 is for attention='ring' or 'allgather'"),
        (dict(attention_backend="flash_attn"), "attention_backend='flash_attn' is not supported"),
        (dict(uncheckpointed_blocks=-1), "uncheckpointed_blocks must be an int >= 0"),
        (dict(offload_checkpoints="1"), "offload_checkpoints must be True, False or the number of checkpointed blocks"),
        (dict(offload_checkpoints=True, activation_checkpointing=None), "offload_checkpoints=True offloads what checkpointed"),
        (dict(offload_params="yes"), "offload_params must be True or False, got 'yes'"),
        (dict(offload_params=True, process_group_backend="nccl"), "offload_params=True keeps the parameters and gradients on the CPU"),
        (dict(offload_params=True, process_group_backend="cuda:nccl"), "use 'cpu:gloo,cuda:nccl'"),
        (dict(mlp_chunk_size=0), "mlp_chunk_size must be a positive int"),
        (dict(mlp_chunk_size=True), "mlp_chunk_size must be a positive int"),
    ],
)
def test_constructor_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match) as info:
        SequenceParallelStrategy(**kwargs)
    assert "SequenceParallelStrategy" in str(info.value)


def test_constructor_resolves_choices():
    s = SequenceParallelStrategy(sequence_parallel_size=2, load_balance=False, compile={"fullgraph": True}, timeout=30)
    assert (s.attention, s.layout, s.activation_checkpointing, s.compile_kwargs) == ("ring", "contiguous", "selective++", {"fullgraph": True})
    assert SequenceParallelStrategy(head_parallel_size=2).attention == "2d"  # "auto" with hp > 1
    assert SequenceParallelStrategy(load_balance="zigzag", compile=False).compile_kwargs is None
    assert SequenceParallelStrategy(compile=True).compile_kwargs == {}
    assert SequenceParallelStrategy(timeout=30)._timeout == timedelta(seconds=30)


@pytest.mark.parametrize(
    "device,offload,given,expected",
    [
        ("cuda", True, None, "cpu:gloo,cuda:nccl"),  # CPU gradients: clip_grad_norm_ reduces CPU tensors
        ("cuda", True, "cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
        ("cuda", False, None, None),  # Lightning's default (nccl) stays
        ("cpu", True, None, None),  # Lightning's default (gloo) stays
        ("cuda", True, "gloo", "gloo"),
    ],
)
def test_offload_params_picks_a_process_group_with_a_cpu_backend(device, offload, given, expected):
    """setup_environment chooses the backend before the process group exists (here stopped right there)."""
    strategy = SequenceParallelStrategy(sequence_parallel_size=1, offload_params=offload, process_group_backend=given)
    strategy.parallel_devices = [torch.device(device, 0) if device == "cuda" else torch.device("cpu")]
    chosen = []

    def stop():
        chosen.append(strategy.process_group_backend)
        raise RuntimeError("stopped before init_process_group")

    strategy._setup_distributed = stop  # this instance only
    with pytest.raises(RuntimeError, match="stopped before init_process_group"):
        strategy.setup_environment()
    assert chosen == [expected]


@pytest.mark.parametrize(
    "devices,kwargs,match",
    [
        (4, dict(sequence_parallel_size=3), "sequence_parallel_size=3 must divide the world size 4"),
        (4, dict(sequence_parallel_size=4, head_parallel_size=3, attention="2d"), "head_parallel_size=3 must divide sequence_parallel_size=4"),
        (4, dict(sequence_parallel_size=2, data_parallel_replicate_size=4), "data_parallel_replicate_size=4 must divide the data-parallel size 2"),
    ],
)
def test_sizes_not_dividing_the_world(devices, kwargs, match):
    strategy = SequenceParallelStrategy(**kwargs)
    strategy.parallel_devices = [torch.device("cpu")] * devices
    with pytest.raises(ValueError, match=match):
        strategy.resolve_parallel_dims()


@pytest.mark.parametrize(
    "world,kwargs,dims",
    [
        (8, dict(sequence_parallel_size=4), (1, 2, 1, 4)),
        (8, dict(sequence_parallel_size=4, head_parallel_size=2, attention="2d"), (1, 2, 2, 2)),
        (8, dict(sequence_parallel_size=2, data_parallel_replicate_size=2), (2, 2, 1, 2)),
        (4, dict(), (1, 1, 1, 4)),  # "auto": all devices of the node
    ],
)
def test_parallel_dims(world, kwargs, dims):
    strategy = SequenceParallelStrategy(**kwargs)
    strategy.parallel_devices = [torch.device("cpu")] * world
    resolved = strategy.resolve_parallel_dims()
    assert resolved.sizes == dims
    assert resolved.world_size == world
    assert resolved.sp * resolved.dp == world
    assert resolved.fsdp_shard == resolved.dp_shard * resolved.sp


def test_parallel_dims_validation():
    with pytest.raises(ValueError, match=r"dp_replicate \(1\) x dp_shard \(2\) x hp \(1\) x cp \(3\) = 6 must equal world_size \(4\)"):
        ParallelDims(dp_shard=2, cp=3, world_size=4)
    with pytest.raises(ValueError, match="ParallelDims: hp must be a positive int"):
        ParallelDims(hp=0, world_size=1)


def test_registry():
    from lightning.pytorch.strategies import StrategyRegistry

    for name, attention in [("seqpar", "ring"), ("seqpar_ring", "ring"), ("seqpar_allgather", "allgather"),
                            ("seqpar_ulysses", "ulysses"), ("seqpar_2d", "2d")]:
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, SequenceParallelStrategy)
        assert strategy.attention == attention


def test_trainer_accepts_registered_name():
    import lightning as L

    trainer = L.Trainer(strategy="seqpar_ring", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, SequenceParallelStrategy)


def test_unrunnable_attention_backend_fails_in_setup():
    import lightning as L

    warnings.filterwarnings("ignore")
    steps = []

    class Module(CausalLMModule):
        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            return super().training_step(batch, batch_idx)

    batch = {"input_ids": torch.zeros(1, 16, dtype=torch.long), "labels": torch.zeros(1, 16, dtype=torch.long)}
    trainer = L.Trainer(strategy=SequenceParallelStrategy(attention_backend="efficient"), accelerator="cpu", devices=1, max_steps=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"SequenceParallelStrategy: attention_backend='efficient'.*cannot run on device=cpu"):
        trainer.fit(Module("tiny"), train_dataloaders=torch.utils.data.DataLoader([batch], batch_size=None))
    assert steps == []  # raised in setup, before the first step


# ---------------------------------------------------------------------------------------------- batch hook


class _Recorder:
    """A CausalLMModule that keeps the batches its training_step receives."""

    def __new__(cls, *args, **kwargs):
        class Recording(CausalLMModule):
            def __init__(self) -> None:
                super().__init__("tiny", warmup_steps=0, max_steps=2)
                self.seen: list[dict[str, torch.Tensor]] = []

            def training_step(self, batch, batch_idx):
                self.seen.append({k: v.clone() for k, v in batch.items()})
                return super().training_step(batch, batch_idx)

        return Recording()


class _Dataset(torch.utils.data.Dataset):
    """Sample i: input_ids = 1000 * i + position, plus extra per-token and per-sample tensors."""

    def __init__(self, seq_len: int, with_positions: bool) -> None:
        self.seq_len, self.with_positions = seq_len, with_positions

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        pos = torch.arange(self.seq_len)
        item = {
            "input_ids": (i * 1000 + pos) % 256,
            "labels": (i * 1000 + pos + 1) % 256,
            "loss_mask": (pos % 3 != 0).float(),
            "segment_ids": pos // 5,  # any per-token tensor (document_ids would mean packed documents)
            "sample_id": torch.tensor(i),
        }
        if self.with_positions:
            item["position_ids"] = pos
        return item


def _trainer(world_size: int, strategy, max_steps: int = 2):
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=max_steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, limit_val_batches=0)


def _check_batches(rank: int, world_size: int, sp: int, hp: int, layout: str, with_positions: bool) -> dict:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from lightning_seqpar.parallel.mesh import sp_mesh
    from lightning_seqpar.sharding import sequence_index

    seq_len = 16
    strategy = SequenceParallelStrategy(sequence_parallel_size=sp, head_parallel_size=hp, load_balance=layout,
                                        attention="2d" if hp > 1 else "ring", activation_checkpointing=None)
    module = _Recorder()
    data = torch.utils.data.DataLoader(_Dataset(seq_len, with_positions), batch_size=2)
    _trainer(world_size, strategy).fit(module, train_dataloaders=data)

    mesh = module.device_mesh
    assert mesh is strategy.device_mesh
    assert mesh.mesh_dim_names == MESH_AXES
    assert strategy.parallel_dims.sp == sp
    index = sequence_index(seq_len, sp_mesh(mesh), layout)  # global positions of this rank's tokens
    for batch in module.seen:
        ids = batch["sample_id"]
        assert ids.shape == (2,)  # per-sample tensors are not sharded
        pos = index.expand(2, -1)
        torch.testing.assert_close(batch["position_ids"], pos)
        torch.testing.assert_close(batch["input_ids"], (ids[:, None] * 1000 + pos) % 256)
        torch.testing.assert_close(batch["labels"], (ids[:, None] * 1000 + pos + 1) % 256)
        torch.testing.assert_close(batch["loss_mask"], (pos % 3 != 0).float())
        torch.testing.assert_close(batch["segment_ids"], pos // 5)
    return {"samples": [b["sample_id"].tolist() for b in module.seen], "sampler": strategy.distributed_sampler_kwargs,
            "coords": (mesh.get_local_rank("dp_replicate"), mesh.get_local_rank("dp_shard"), mesh.get_local_rank("hp"), mesh.get_local_rank("cp"))}


@pytest.mark.parametrize(
    "world,sp,hp,layout,with_positions",
    [(2, 2, 1, "zigzag", True), (2, 2, 1, "contiguous", False), (4, 2, 1, "zigzag", False), (4, 4, 2, "zigzag", True)],
)
def test_batches_are_sharded_in_the_strategy(world, sp, hp, layout, with_positions):
    results = run_distributed(_check_batches, world, sp, hp, layout, with_positions, timeout=TIMEOUT)
    dp = world // sp
    for rank, r in enumerate(results):
        assert r["coords"] == (0, rank // sp, (rank % sp) // (sp // hp), rank % (sp // hp))
        assert r["sampler"] == {"num_replicas": dp, "rank": rank // sp}
    for rank, r in enumerate(results):
        same_group = results[(rank // sp) * sp]
        assert r["samples"] == same_group["samples"]  # all ranks of an SP group read the same samples
    if dp > 1:
        assert results[0]["samples"] != results[sp]["samples"]  # data-parallel ranks read different ones
        seen = sorted(s for r in results[::sp] for batch in r["samples"] for s in batch)
        assert seen == sorted(set(seen))


def _bad_length(rank: int, world_size: int) -> str:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    strategy = SequenceParallelStrategy(sequence_parallel_size=2, activation_checkpointing=None)
    data = torch.utils.data.DataLoader(_Dataset(6, True), batch_size=2)  # 6 is not a multiple of 2 * 2
    with pytest.raises(ValueError) as info:
        _trainer(world_size, strategy).fit(CausalLMModule("tiny"), train_dataloaders=data)
    return str(info.value)


def test_sequence_length_must_divide():
    message = run_distributed(_bad_length, 2, timeout=TIMEOUT)[0]
    assert "sequence length 6" in message and "multiple of 4" in message and "sequence_parallel_size=2" in message


def _heads_not_dividing(rank: int, world_size: int) -> str:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    strategy = SequenceParallelStrategy(sequence_parallel_size=2, attention="ulysses", activation_checkpointing=None)
    data = torch.utils.data.DataLoader(_Dataset(8, True), batch_size=2)
    with pytest.raises(ValueError) as info:
        _trainer(world_size, strategy).fit(CausalLMModule("tiny-3h"), train_dataloaders=data)
    return str(info.value)


def test_heads_must_divide():
    message = run_distributed(_heads_not_dividing, 2, timeout=TIMEOUT)[0]
    assert "sequence_parallel_size=2" in message and "3 query heads" in message


def test_non_dict_batch_is_rejected():
    strategy = SequenceParallelStrategy(sequence_parallel_size=1)
    with pytest.raises(ValueError, match="SequenceParallelStrategy shards dict batches"):
        strategy.shard_batch(torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"keys \['ids'\]"):
        strategy.shard_batch({"ids": torch.zeros(2, 4)})


def _no_attention_module(rank: int, world_size: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_seqpar.parallel.parallelize import apply_attention

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    with pytest.raises(ValueError) as info:
        apply_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh, attention="ring")
    assert apply_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)), None, attention="ring") == 0  # one rank: fine
    return str(info.value)


def test_sequence_parallelism_needs_attention_modules():
    message = run_distributed(_no_attention_module, 2, timeout=TIMEOUT)[0]
    assert "no lightning_seqpar.attention.Attention module" in message and "2 ranks" in message

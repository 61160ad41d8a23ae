"""gather_whole_model: FSDP2 over the root only on one rank (Note [One rank: one gather per step] in
lightning_seqpar.parallel.parallelize): the same training and the same checkpoints as a group per block."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from dist_utils import run_distributed
from strategy_testing import GLOBAL_BATCH, SEQ_LEN

TIMEOUT = 240


def _fit(dirpath: str, gather_whole_model: bool, resume_from: str | None, steps: int) -> dict:
    """``steps`` steps of the tiny Llama on one rank (the checkpoint of every epoch saved, one step per epoch)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.data import CopyTaskDataset

    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    strategy = SequenceParallelStrategy(sequence_parallel_size=1, attention="ring", gather_whole_model=gather_whole_model)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        callbacks=[Record(), ModelCheckpoint(dirpath=dirpath, filename="{epoch}", save_top_k=-1, every_n_epochs=1)])
    module = CausalLMModule("tiny", lr=1e-3, warmup_steps=1, max_steps=4, init_seed=0 if resume_from is None else 123)
    data = CopyTaskDataset(vocab_size=256, seq_len=SEQ_LEN, num_samples=GLOBAL_BATCH, supervise="all")
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=GLOBAL_BATCH), ckpt_path=resume_from)
    state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"losses": losses, "weights": state, "step": trainer.global_step,
            "groups": sum(isinstance(m, FSDPModule) for m in module.model.modules()),
            "dtensors": all(isinstance(p, DTensor) for p in module.model.parameters())}


def _fits(rank: int, world_size: int, root: str) -> dict:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    out = {g: _fit(os.path.join(root, f"first-{g}"), g, None, 4) for g in (False, True)}
    # resumed from a checkpoint written after step 2 with the other setting (and a different init seed)
    for g in (False, True):
        out[f"resumed-{g}"] = _fit(os.path.join(root, f"resumed-{g}"), g, os.path.join(root, f"first-{not g}", "epoch=1.ckpt"), 4)
    return out


def test_whole_model_gather_trains_and_checkpoints_like_groups_per_block(tmp_path):
    runs = run_distributed(_fits, 1, str(tmp_path), timeout=TIMEOUT)[0]
    blocks, whole = runs[False], runs[True]
    assert whole["groups"] == 1 and blocks["groups"] > 1  # the root's group only, or the root's and one per block
    assert whole["dtensors"] and blocks["dtensors"]  # DTensor parameters either way
    assert len(whole["losses"]) == len(blocks["losses"]) == 4
    # 32-true on one rank: the same training (the fp32 tolerances of the parity tests)
    torch.testing.assert_close(torch.tensor(whole["losses"]), torch.tensor(blocks["losses"]), rtol=1e-5, atol=2e-6)
    assert whole["weights"].keys() == blocks["weights"].keys()  # the same names: the same checkpoint format
    for name, value in blocks["weights"].items():
        torch.testing.assert_close(whole["weights"][name], value, rtol=1e-5, atol=2e-6, msg=name)
    for g in (False, True):  # a checkpoint written with the other setting resumes the same training
        resumed, first = runs[f"resumed-{g}"], runs[not g]
        assert resumed["step"] == 4 and resumed["groups"] == runs[g]["groups"]
        torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(first["losses"][2:]), rtol=1e-5, atol=0)
        for name, value in first["weights"].items():
            torch.testing.assert_close(resumed["weights"][name], value, rtol=0, atol=1e-5, msg=name)


def test_gather_whole_model_is_refused_beyond_one_rank_and_with_offload_params():
    from lightning_seqpar import SequenceParallelStrategy

    with pytest.raises(ValueError, match="gather_whole_model=True keeps the whole model gathered on the device; it cannot be "
                                         "combined with offload_params=True"):
        SequenceParallelStrategy(gather_whole_model=True, offload_params=True)
    with pytest.raises(ValueError, match="gather_whole_model must be True or False"):
        SequenceParallelStrategy(gather_whole_model=1)


def _two_ranks(rank: int, world_size: int) -> str:
    from lightning_seqpar.parallel.mesh import ParallelDims
    from lightning_seqpar.planner.planning import RunSite, check_options_against_model
    from lightning_seqpar.parallel.config import StrategyConfig
    from lightning_seqpar.parallel.parallelize import apply_fsdp
    from lightning_seqpar.models.llama import Llama, LlamaConfig
    from torch.distributed.device_mesh import init_device_mesh

    dims = ParallelDims.from_sizes(world_size=2, sequence_parallel_size=2, owner="S")
    try:
        check_options_against_model([], config=StrategyConfig(gather_whole_model=True), site=RunSite(device=torch.device("cpu")),
                                    dims=dims, attention="ring", inner_ring_size=None, owner="S")
    except ValueError as error:
        message = str(error)
    try:
        apply_fsdp(Llama(LlamaConfig.from_name("tiny")), init_device_mesh("cpu", (2,)), gather_whole_model=True)
    except ValueError as error:
        return message + " | " + str(error)
    return message


def test_gather_whole_model_needs_a_mesh_of_one_rank():
    message = run_distributed(_two_ranks, 2, timeout=TIMEOUT)[0]
    assert "S: gather_whole_model=True is for one rank" in message and "over 2 ranks" in message
    assert "gather_whole_model=True is for an FSDP mesh of one rank without offload_params" in message

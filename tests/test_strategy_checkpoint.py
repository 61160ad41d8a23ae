"""Checkpoints under SequenceParallelStrategy: save (sharded folder or one file), resume, same training."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from dist_utils import run_distributed
from strategy_testing import GLOBAL_BATCH, SEQ_LEN

TIMEOUT = 240
STEPS_PER_EPOCH = 1  # every epoch is the same global batch: the result does not depend on how
# Lightning orders the data after a resume (only on the restored model, optimizer and schedule)


def _fit(rank: int, world_size: int, dirpath: str, distributed: bool, resume_from: str | None, offload_params: bool = False) -> dict:
    """Fit to step 4, checkpointing at the end of each epoch."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.utils.data import DataLoader

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.data import CopyTaskDataset

    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    strategy = SequenceParallelStrategy(sequence_parallel_size=2, attention="ring", save_distributed_checkpoint=distributed,
                                        offload_params=offload_params)
    checkpoint = ModelCheckpoint(dirpath=dirpath, filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=4,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[Record(), checkpoint])
    module = CausalLMModule("tiny", lr=1e-3, warmup_steps=1, max_steps=4, init_seed=0 if resume_from is None else 123)
    dp = world_size // 2
    data = CopyTaskDataset(vocab_size=256, seq_len=SEQ_LEN, num_samples=GLOBAL_BATCH * STEPS_PER_EPOCH, supervise="all")
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=GLOBAL_BATCH // dp), ckpt_path=resume_from)
    state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"losses": losses, "weights": state if rank == 0 else None, "step": trainer.global_step,
            "files": sorted(os.listdir(dirpath))}


# (world size, offload_params when saving, offload_params when resuming)
RUNS = [
    pytest.param(2, False, False, id="2"),
    pytest.param(4, False, False, id="4"),
    pytest.param(2, True, True, id="2-offload_params"),  # the shards saved from and loaded into host memory
    pytest.param(2, False, True, id="2-offload_params-on-resume"),  # switched on for a resumed run
]


@pytest.mark.parametrize("world_size,offload_first,offload_resumed", RUNS)
@pytest.mark.parametrize("distributed", [True, False], ids=["sharded", "full"])
def test_resume_gives_the_same_training(tmp_path, distributed, world_size, offload_first, offload_resumed):
    first = run_distributed(_fit, world_size, str(tmp_path / "a"), distributed, None, offload_first, timeout=TIMEOUT)[0]
    assert first["step"] == 4 and len(first["losses"]) == 4
    assert first["files"] == [f"epoch={e}.ckpt" for e in range(4)]
    saved = tmp_path / "a" / "epoch=1.ckpt"  # after step 2
    assert saved.is_dir() == distributed  # a folder of shards, or one file
    if distributed:
        assert (saved / "meta.pt").is_file()

    # A different init seed: everything after the resume must come from the checkpoint.
    resumed = run_distributed(_fit, world_size, str(tmp_path / "b"), distributed, str(saved), offload_resumed, timeout=TIMEOUT)[0]
    assert resumed["step"] == 4
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(first["losses"][2:]), rtol=1e-5, atol=0)
    for name, value in first["weights"].items():
        torch.testing.assert_close(resumed["weights"][name], value, rtol=0, atol=1e-5, msg=name)

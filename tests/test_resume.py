"""Exact resume and resharding of distributed checkpoints (CPU gloo, pooled ranks).

* Exact resume: stopping after step k and resuming with ``fit(ckpt_path=...)`` gives the SAME
  per-step losses (bit for bit) and the same random draws as the run that never stopped, in the
  middle of an epoch after the first one and at an epoch's end (model, optimizer, LR schedule,
  data position, random state all come back).
* Resharding: a checkpoint written under one (dp, sp) layout or world size loads under another
  with identical full model and optimizer state dicts, and training goes on with the losses of
  a run that used the new layout from the start.
"""

from __future__ import annotations

import copy
import os
import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from dist_utils import run_distributed

SEQ_LEN = 32
GLOBAL_BATCH = 4
BATCHES_PER_EPOCH = 3
TIMEOUT = 240


def _fit(rank: int, world_size: int, *, sp: int, dirpath: str, steps: int, ckpt_path: str | None = None,
         save_at: tuple[int, ...] = (), capture_at: int | None = None, init_seed: int = 0) -> dict[str, Any]:
    """Train under SequenceParallelStrategy(sp) on a shuffled 3-batch epoch; record losses and random draws.

    ``save_at``: write ``dirpath/step=<k>.ckpt`` after these steps (the same call as ModelCheckpoint's).
    ``capture_at``: gather the full model and optimizer state dicts after that step (or, when
    resuming, right after the checkpoint is restored: ``capture_at == -1``).
    """
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import lightning as L
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.utils.data import DataLoader

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.data import CopyTaskDataset

    record: dict[str, Any] = {"losses": {}, "draws": {}, "captured": None, "start_step": None}

    def full_state(module, trainer) -> dict[str, Any] | None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(module.model, options=options)
        optim = get_optimizer_state_dict(module.model, trainer.optimizers[0], options=options)
        scheduler = trainer.lr_scheduler_configs[0].scheduler.state_dict()
        state = {"model": model, "optim": optim, "scheduler": scheduler, "step": trainer.global_step}
        return copy.deepcopy(state) if rank == 0 else None  # copies: the optimizer updates its state in place

    class Record(L.Callback):
        def on_train_start(self, trainer, pl_module):
            record["start_step"] = trainer.global_step
            if capture_at == -1:
                record["captured"] = full_state(pl_module, trainer)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # Draws from every global generator: equal only if the random state came back.
            record["draws"][trainer.global_step] = (torch.rand(()).item(), float(np.random.rand()), random.random())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            record["losses"][trainer.global_step] = float(trainer.callback_metrics["train/loss"])
            if capture_at == trainer.global_step:
                record["captured"] = full_state(pl_module, trainer)
            if trainer.global_step in save_at:
                trainer.save_checkpoint(os.path.join(dirpath, f"step={trainer.global_step}.ckpt"))

    callbacks: list[Any] = [Record()]
    strategy = SequenceParallelStrategy(sequence_parallel_size=sp, attention="ring", timeout=120)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)
    module = CausalLMModule("tiny", lr=1e-3, warmup_steps=2, max_steps=20, init_seed=init_seed)
    dp = world_size // sp
    data = CopyTaskDataset(vocab_size=256, seq_len=SEQ_LEN, num_samples=GLOBAL_BATCH * BATCHES_PER_EPOCH, supervise="all")
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // dp, shuffle=True)  # Lightning puts a DistributedSampler in
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return record


# ---------------------------------------------------------------------------------------------- exact resume


def test_resume_is_bit_identical(tmp_path):
    """Stop after step 4 (mid-epoch, epoch 1) or 3 (end of epoch 0), resume: the same losses and draws."""
    steps = 7  # 3 batches per epoch: epochs 0, 1 and part of 2
    full = run_distributed(_fit, 2, sp=2, dirpath=str(tmp_path), steps=steps, save_at=(3, 4), timeout=TIMEOUT)
    assert sorted(full[0]["losses"]) == list(range(1, steps + 1))
    for k in (4, 3):
        ckpt = tmp_path / f"step={k}.ckpt"
        assert (ckpt / "meta.pt").is_file() and not (tmp_path / f"step={k}.ckpt.partial").exists()
        # A different init seed: everything after the resume must come from the checkpoint.
        resumed = run_distributed(_fit, 2, sp=2, dirpath=str(tmp_path / f"r{k}"), steps=steps, ckpt_path=str(ckpt),
                                  init_seed=123, timeout=TIMEOUT)
        for rank in range(2):
            assert resumed[rank]["start_step"] == k
            expected_losses = {s: v for s, v in full[rank]["losses"].items() if s > k}
            assert resumed[rank]["losses"] == expected_losses, f"resume after step {k}: losses differ on rank {rank}"
            expected_draws = {s: v for s, v in full[rank]["draws"].items() if s >= k}
            assert resumed[rank]["draws"] == expected_draws, f"resume after step {k}: random state differs on rank {rank}"


# ---------------------------------------------------------------------------------------------- resharding

K = 2  # checkpoint after step 2 (mid-epoch); 2 more steps after it
STEPS = K + 2
_RUNS: dict[tuple, Any] = {}


def _run(world: int, sp: int, tmp_root, **kwargs) -> list[dict[str, Any]]:
    """Run once per (world, sp, kwargs) for the whole module (several tests share the runs)."""
    key = (world, sp, tuple(sorted((k, str(v)) for k, v in kwargs.items())))
    if key not in _RUNS:
        dirpath = tmp_root / f"w{world}-sp{sp}-{len(_RUNS)}"
        _RUNS[key] = run_distributed(_fit, world, sp=sp, dirpath=str(dirpath), steps=STEPS, timeout=TIMEOUT, **kwargs)
        _RUNS[key + ("dir",)] = dirpath
    return _RUNS[key]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    yield tmp_path_factory.mktemp("reshard")
    _RUNS.clear()


def _saved(world: int, sp: int, tmp_root) -> tuple[list[dict[str, Any]], str]:
    """The run under (world, sp) that saved after step K and captured its full state there."""
    results = _run(world, sp, tmp_root, save_at=(K,), capture_at=K)
    key = (world, sp, tuple(sorted((k, str(v)) for k, v in {"save_at": (K,), "capture_at": K}.items())), "dir")
    return results, str(_RUNS[key] / f"step={K}.ckpt")


def _assert_same_state(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    assert loaded["step"] == saved["step"] == K
    assert loaded["model"].keys() == saved["model"].keys()
    for name, value in saved["model"].items():
        assert torch.equal(loaded["model"][name], value), name
    assert loaded["optim"]["state"].keys() == saved["optim"]["state"].keys()
    for name, state in saved["optim"]["state"].items():
        for field, value in state.items():
            assert torch.equal(torch.as_tensor(loaded["optim"]["state"][name][field]), torch.as_tensor(value)), (name, field)
    assert loaded["optim"]["param_groups"] == saved["optim"]["param_groups"]
    assert loaded["scheduler"] == saved["scheduler"]


@pytest.mark.parametrize(
    "saved_layout,loaded_layout",
    [((2, 2), (2, 1)), ((4, 2), (4, 4)), ((4, 2), (2, 2))],
    ids=["dp1sp2-to-dp2sp1", "dp2sp2-to-dp1sp4", "world4-to-world2"],
)
def test_checkpoint_loads_under_another_layout(saved_layout, loaded_layout, tmp_root):
    """(world, sp) -> (world', sp'): identical full state dicts after loading, and the new layout's losses."""
    saved, ckpt = _saved(*saved_layout, tmp_root)
    world, sp = loaded_layout
    resumed = _run(world, sp, tmp_root, ckpt_path=ckpt, capture_at=-1, init_seed=123)
    _assert_same_state(resumed[0]["captured"], saved[0]["captured"])
    # Training goes on as a run that used the new layout from the start (rounding of another
    # layout: the parity tolerance), and as the saving run.
    fresh = _run(world, sp, tmp_root)
    for reference in (fresh[0]["losses"], saved[0]["losses"]):
        expected = [reference[s] for s in range(K + 1, STEPS + 1)]
        got = [resumed[0]["losses"][s] for s in range(K + 1, STEPS + 1)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=0)
    for rank_result in resumed:  # every rank logs the same global loss
        assert rank_result["losses"] == resumed[0]["losses"]

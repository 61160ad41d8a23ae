"""Training runs shared by the parity tests: one device (reference) and the strategy on pooled gloo ranks."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

SEQ_LEN = 32
GLOBAL_BATCH = 4
STEPS = 5
LR = 1e-3


class _LossRecorder:
    """Callback collecting the logged train/loss of every step (global, equal on every rank)."""

    def __new__(cls):  # built lazily so that importing this file does not import lightning
        import lightning as L

        class LossRecorder(L.Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                self.losses.append(float(trainer.callback_metrics["train/loss"]))

        return LossRecorder()


def _dataloader(batch_size: int, *, reference: bool = False) -> DataLoader:
    """Under the strategy Lightning injects ``DistributedSampler(shuffle=True, seed=0)`` with the
    data-parallel rank and size; rank r of D takes ``perm[r::D]``, so a step of all ranks covers
    ``perm[k*B:(k+1)*B]`` — what the reference reads with one replica of the same sampler."""
    from torch.utils.data import DistributedSampler

    from lightning_seqpar.data import CopyTaskDataset

    data = CopyTaskDataset(vocab_size=256, seq_len=SEQ_LEN, num_samples=GLOBAL_BATCH * STEPS, seed=0, supervise="all")
    if reference:
        return DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def _trainer(strategy: Any, devices: int, recorder: Any, steps: int, callbacks: Sequence[Any] = (), **kwargs: Any):
    import lightning as L

    return L.Trainer(**kwargs,
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[recorder, *callbacks],
    )


def _module(model: str, **kwargs: Any):
    from lightning_seqpar import CausalLMModule

    return CausalLMModule(model, lr=LR, weight_decay=0.1, warmup_steps=0, max_steps=STEPS, init_seed=0, **kwargs)


def train_reference(model: str = "tiny", steps: int = STEPS, trainer_kwargs: dict[str, Any] | None = None,
                    **module_kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` steps on one device, no strategy: (losses, final weights)."""
    warnings.filterwarnings("ignore")
    recorder = _LossRecorder()
    module = _module(model, **module_kwargs)
    _trainer("auto", 1, recorder, steps, **(trainer_kwargs or {})).fit(module, train_dataloaders=_dataloader(GLOBAL_BATCH, reference=True))
    return recorder.losses, {k: v.detach().clone() for k, v in module.model.state_dict().items()}


def train_strategy(rank: int, world_size: int, strategy_kwargs: dict[str, Any], model: str = "tiny",
                   steps: int = STEPS, trainer_kwargs: dict[str, Any] | None = None, callbacks: Sequence[Any] = (),
                   **module_kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    """Run on every pooled rank: ``steps`` steps under SequenceParallelStrategy(**strategy_kwargs)
    (``callbacks``: more Lightning callbacks for the Trainer)."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))  # Lightning: processes were created externally
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_seqpar import SequenceParallelStrategy

    strategy = SequenceParallelStrategy(**strategy_kwargs)
    recorder = _LossRecorder()
    module = _module(model, **module_kwargs)
    sp = strategy_kwargs.get("sequence_parallel_size", world_size)
    dp = world_size // sp
    _trainer(strategy, world_size, recorder, steps, callbacks, **(trainer_kwargs or {})).fit(
        module, train_dataloaders=_dataloader(GLOBAL_BATCH // dp))
    state = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return recorder.losses, (state if rank == 0 else None)

"""Evaluation without inference mode (Note [Evaluation without inference mode] in lightning_seqpar.parallel.precision):
``trainer.validate`` / ``predict`` of a model no ``fit`` gathered before. On a GPU (NCCL) Lightning ran them under
``torch.inference_mode`` and FSDP2's first gather failed; gloo hides it (Lightning uses ``no_grad`` there), so this
test makes Lightning skip its gloo check."""

from __future__ import annotations

import os
import warnings

from dist_utils import run_distributed
from strategy_testing import GLOBAL_BATCH, SEQ_LEN


def _evaluate(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import lightning as L
    import lightning.pytorch.loops.utilities as loop_utilities
    from torch.utils.data import DataLoader

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.data import CopyTaskDataset

    loop_utilities._distributed_is_initialized = lambda: False  # Lightning chooses as on a GPU (NCCL): inference_mode
    data = DataLoader(CopyTaskDataset(vocab_size=256, seq_len=SEQ_LEN, num_samples=GLOBAL_BATCH, supervise="all"), batch_size=GLOBAL_BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=SequenceParallelStrategy(sequence_parallel_size=1), logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    metrics = trainer.validate(CausalLMModule("tiny"), dataloaders=data, verbose=False)[0]
    return {"loss": float(metrics["val/loss"]),
            "modes": [getattr(trainer, n).inference_mode for n in ("validate_loop", "test_loop", "predict_loop")]}


def test_validate_of_a_model_never_fitted_runs_outside_inference_mode():
    out = run_distributed(_evaluate, 1, timeout=180)[0]
    assert out["modes"] == [False, False, False]
    assert out["loss"] > 0

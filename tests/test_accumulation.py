"""Gradient accumulation is exact (Note [Loss under gradient accumulation] in lightning_seqpar.training.module): one optimizer
step over k micro-batches under SequenceParallelStrategy (sp 2; dp 2) has the gradient of the mean over EVERY trained
token of the k micro-batches, as one device computes it on all of them at once, although the micro-batches' counts
of trained tokens differ by an order of magnitude (the case chat data with assistant-only labels makes)."""

from __future__ import annotations

import warnings

import pytest
import torch

from dist_utils import run_distributed

SEQ, VOCAB, SAMPLES = 32, 256, 4
COUNTS = (31, 3, 17, 1)  # trained tokens per sample: per-micro-batch means would weigh the 1 like the 31
TIMEOUT = 300


def _samples() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in COUNTS:
        tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        labels = torch.full((SEQ,), -100)
        keep = torch.randperm(SEQ, generator=g)[:n]
        labels[keep] = tokens[1:][keep]
        out.append({"input_ids": tokens[:-1], "labels": labels, "position_ids": torch.arange(SEQ)})
    return out


def _reference() -> dict[str, torch.Tensor]:
    """One device, no strategy: the mean over every trained token of the 4 samples at once; its gradients."""
    from lightning_seqpar import CausalLMModule

    module = CausalLMModule("tiny", init_seed=0)
    module.configure_model()
    batch = {k: torch.stack([s[k] for s in _samples()]) for k in _samples()[0]}
    loss_sum, count = module.loss_sum(batch)
    assert int(count) == sum(COUNTS)
    (loss_sum / count).backward()
    return {n: p.grad.detach().clone() for n, p in module.model.named_parameters()}


def _fit(rank: int, world_size: int, sp: int, accumulate: int):
    warnings.filterwarnings("ignore")
    import lightning as L
    from torch.distributed.tensor import DTensor

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    grads: dict[str, torch.Tensor] = {}

    class Capture(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            for n, p in pl_module.model.named_parameters():
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                grads[n.replace("_checkpoint_wrapped_module.", "")] = g.detach().clone()

    module = CausalLMModule("tiny", init_seed=0, lr=1e-3, warmup_steps=0, max_steps=1)
    loader = torch.utils.data.DataLoader(_samples(), batch_size=1, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=world_size, strategy=SequenceParallelStrategy(sequence_parallel_size=sp),
                        max_steps=1, accumulate_grad_batches=accumulate, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Capture()])
    trainer.fit(module, train_dataloaders=loader)
    return grads if rank == 0 else None


@pytest.mark.parametrize("sp", [2, 1], ids=["sp2", "dp2"])
def test_one_step_over_micro_batches_is_the_mean_over_all_their_tokens(sp):
    reference = _reference()
    # sp 2: each rank sees all 4 micro-batches (accumulate 4); dp 2: each replica 2 of them (accumulate 2)
    grads = run_distributed(_fit, 2, sp, 4 if sp == 2 else 2, timeout=TIMEOUT)[0]
    assert grads.keys() == reference.keys()
    for name, ref in reference.items():
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-6, msg=name)
    # the per-micro-batch means (what accumulation gave before) differ: the test bites
    uniform = torch.tensor(COUNTS, dtype=torch.float64)
    assert (uniform / uniform.sum() - 1 / len(COUNTS)).abs().max() > 0.2

"""Gradient clipping with a fused AdamW under bf16-mixed (Note [Clipping with fused optimizers under
bf16-mixed] in lightning_seqpar.parallel.precision): Lightning's own plugin refuses it; the strategy's clips,
with the same losses as the unfused optimizer, and fp16's scaled gradients are still refused."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
from lightning_seqpar.parallel.precision import ScalerFreeMixedPrecision, scaler_free

MODEL = dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_kv_head=2, intermediate_size=64, max_seq_len=64)
STEPS = 3


def _fit(fused: bool, clip: float | None, strategy=None) -> tuple[list[float], L.Trainer]:
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, MODEL["vocab_size"], (1, 33), generator=g)
        batches.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    module = CausalLMModule(dict(MODEL), lr=1e-2, warmup_steps=0, max_steps=STEPS, init_seed=0, fused_optimizer=fused)
    losses: list[float] = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["train/loss"]))

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy or SequenceParallelStrategy(sequence_parallel_size=1),
                        precision="bf16-mixed", max_steps=STEPS, gradient_clip_val=clip, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Watch()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert len(losses) == STEPS
    return losses, trainer


def test_fused_adamw_clips_like_the_unfused_one_under_bf16_mixed():
    fused, trainer = _fit(fused=True, clip=0.05)
    assert isinstance(trainer.precision_plugin, ScalerFreeMixedPrecision)
    assert trainer.precision_plugin.precision == "bf16-mixed" and trainer.precision_plugin.scaler is None
    assert trainer.optimizers[0].defaults["fused"] is True
    unfused, _ = _fit(fused=False, clip=0.05)
    unclipped, _ = _fit(fused=True, clip=None)
    torch.testing.assert_close(torch.tensor(fused), torch.tensor(unfused), rtol=1e-5, atol=0)
    # the clip acted: a norm of 0.05 changes the second and third losses
    assert all(abs(a - b) > 1e-5 for a, b in zip(fused[1:], unclipped[1:])), (fused, unclipped)


def test_lightning_plugin_refuses_what_the_strategy_allows():
    # the failure the swap exists for, so that a Lightning release that drops its check shows up here
    from lightning.pytorch.strategies import SingleDeviceStrategy

    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        _fit(fused=True, clip=0.05, strategy=SingleDeviceStrategy("cpu"))


def test_scaled_gradients_are_still_refused_with_a_fused_optimizer():
    plugin = scaler_free(MixedPrecision("bf16-mixed", "cpu"))
    assert type(plugin) is ScalerFreeMixedPrecision and isinstance(plugin, MixedPrecision)
    plugin.scaler = object()  # as fp16-mixed holds a GradScaler
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.ones(3)
    opt = torch.optim.AdamW([w], fused=True)
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        plugin.clip_gradients(opt, clip_val=1.0)
    plugin.scaler = None
    plugin.clip_gradients(opt, clip_val=1.0)
    torch.testing.assert_close(w.grad.norm(), torch.tensor(1.0))


def test_other_plugins_are_kept():
    from lightning.pytorch.plugins.precision import Precision

    plain = Precision()
    assert scaler_free(plain) is plain
    swapped = scaler_free(MixedPrecision("bf16-mixed", "cpu"))
    assert scaler_free(swapped) is swapped

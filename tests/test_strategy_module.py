"""CausalLMModule: configuration, schedule, loss, FLOPs, logging; on one device (no processes)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

from lightning_seqpar import CausalLMModule
from lightning_seqpar.models import LlamaConfig
from lightning_seqpar.training.module import batch_samples, batch_tokens, warmup_cosine


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(model=3), "model must be a LlamaConfig"),
        (dict(model="llama-1t"), "unknown Llama config"),
        (dict(lr=0), "lr must be > 0"),
        (dict(weight_decay=-1), "weight_decay"),
        (dict(betas=(0.9, 1.5)), "betas"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(max_steps=0), "max_steps"),
        (dict(min_lr_ratio=2), "min_lr_ratio"),
        (dict(loss_chunk_size=0), "loss_chunk_size"),
        (dict(fused_optimizer="yes"), "fused_optimizer must be True, False or None"),
    ],
)
def test_errors_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CausalLMModule(**kwargs)


def test_model_from_name_config_or_dict():
    config = LlamaConfig.from_name("tiny")
    for model in ("tiny", config, dataclasses.asdict(config)):
        module = CausalLMModule(model)
        assert module.config == config
        assert isinstance(module.hparams["model"], (str, dict))  # plain values: torch.load(weights_only=True)


def test_init_seed_makes_the_init_independent_of_the_global_rng():
    a, b = CausalLMModule("tiny", init_seed=3), CausalLMModule("tiny", init_seed=3)
    a.configure_model()
    torch.rand(10)
    b.configure_model()
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_warmup_cosine():
    f = warmup_cosine(warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0)
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def _batch(seq_len: int = 16, batch_size: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch_size, seq_len + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, :3] = -100
    return {"input_ids": ids[:, :-1], "labels": labels, "position_ids": torch.arange(seq_len).expand(batch_size, -1)}


def test_loss_is_the_token_mean_and_chunking_does_not_change_it():
    batch = _batch()
    plain, chunked = CausalLMModule("tiny"), CausalLMModule("tiny", loss_chunk_size=5)
    for m in (plain, chunked):
        m.configure_model()
    logits = plain(batch["input_ids"], batch["position_ids"])
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    for m in (plain, chunked):
        loss_sum, n = m.loss_sum(batch)
        torch.testing.assert_close(loss_sum / n, expected, rtol=1e-6, atol=1e-6)
        assert n == (batch["labels"] != -100).sum()


def test_fit_logs_loss_perplexity_and_flops(tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    warnings.filterwarnings("ignore")
    data = [_batch() for _ in range(4)]
    module = CausalLMModule("tiny", warmup_steps=1, max_steps=3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=CSVLogger(tmp_path), log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=2, num_sanity_val_steps=0, val_check_interval=3)
    loader = torch.utils.data.DataLoader(data, batch_size=None)
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=loader)
    metrics = trainer.callback_metrics
    assert torch.isclose(metrics["train/ppl"], metrics["train/loss"].exp())
    assert torch.isclose(metrics["val/ppl"], metrics["val/loss"].exp())
    # val/loss is the token-weighted mean over the validation batches
    with torch.no_grad():
        sums = [module.loss_sum(b) for b in data[:2]]
    expected = sum(s for s, _ in sums) / sum(n for _, n in sums)
    torch.testing.assert_close(metrics["val/loss"], expected, rtol=1e-5, atol=1e-6)
    assert module.flops_per_batch == module.config.flops_per_token(16) * 2 * 16
    assert batch_samples(data[0]) == 2 and batch_tokens(data[0]) == 32


def test_load_from_checkpoint(tmp_path):
    import lightning as L

    warnings.filterwarnings("ignore")
    module = CausalLMModule(LlamaConfig.from_name("tiny", n_layer=1), lr=1e-3)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([_batch()], batch_size=None))
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = CausalLMModule.load_from_checkpoint(path, weights_only=True)
    assert loaded.config == module.config and loaded.lr == 1e-3
    for (name, p), q in zip(module.model.state_dict().items(), loaded.model.state_dict().values()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert math.isfinite(float(trainer.callback_metrics["train/loss"]))

"""LoRA (peft) under SequenceParallelStrategy on GPUs, bf16-true; skipped on CPU.

    pytest -s tests/test_lora_gpu.py                                   # one GPU
    torchrun --nproc_per_node=2 -m pytest -s tests/test_lora_gpu.py    # sp = 2 (NCCL)

A Llama-shaped transformers model from a config (d = 512, 4 layers, 8 query / 2 KV heads, vocab
4096, random weights from a fixed seed), LoRA r = 8 on every linear layer, S = 8192 tokens. One
training step under the strategy with ``precision="bf16-true"`` (the chunked loss, selective++
checkpointing): the frozen base is bf16, the adapters, their gradients and their fused AdamW state
are fp32 (FSDP2 with both dtypes in each block's parameter group, NCCL). Against the same peft
model in fp32 on one GPU (SDPA), started from the adapters the strategy's run drew: the loss within 1e-2 (relative), and the adapter gradients with a
relative error (Frobenius norm over all adapters) at most 2x that of the same bf16 model run on one
GPU without the strategy (transformers' SDPA) + 1e-3. Rank 0 prints the numbers.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

S, VOCAB = 8192, 4096
LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "init_lora_weights": False}


def _config():
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=S, attention_dropout=0.0)


def _batch():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (1, S + 1), generator=g)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "position_ids": torch.arange(S)[None]}


def _peft_model(folder: str, dtype: torch.dtype, adapters: dict[str, torch.Tensor]):
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **LORA))
    with torch.no_grad():  # the adapters the strategy's run started from (drawn on the GPU there)
        params = dict(model.named_parameters())
        for name, value in adapters.items():
            params[name].copy_(value)
    return model.cuda()


def _one_gpu(folder: str, dtype: torch.dtype, data, adapters: dict[str, torch.Tensor]):
    model = _peft_model(folder, dtype, adapters)
    batch = {k: v.cuda() for k, v in data.items()}
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
    loss.backward()
    return float(loss), {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.requires_grad}


def _rel(grads, reference) -> float:
    num = sum(float((grads[n] - g).pow(2).sum()) for n, g in reference.items())
    den = sum(float(g.pow(2).sum()) for g in reference.values())
    return (num / den) ** 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("bf16_adapters", [False, True], ids=["fp32-adapters", "bf16-adapters"])
def test_lora_bf16_true_on_gpus(tmp_path_factory, bf16_adapters):
    warnings.filterwarnings("ignore")
    import lightning as L
    from torch.distributed.tensor import DTensor

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # every rank writes its own copy (the same weights: one seed, built on the CPU), so no rank reads a half-written folder
    folder = str(tmp_path_factory.mktemp(f"lora-gpu-rank{rank}") / "model")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32).save_pretrained(folder)
    data = _batch()
    seen: dict = {}

    class Capture(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen["init"] = {n.replace("_checkpoint_wrapped_module.", "").removeprefix("hf."):
                            (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
                            for n, p in pl_module.model.named_parameters() if ".lora_" in n}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            params = dict(pl_module.model.named_parameters())
            seen["dtypes"] = {n: p.dtype for n, p in params.items()}
            seen["grads"] = {n.replace("_checkpoint_wrapped_module.", "").removeprefix("hf."):
                             (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().cpu()
                             for n, p in params.items() if p.grad is not None}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            seen["loss"] = float(trainer.callback_metrics["train/loss"])
            seen["state"] = {v.dtype for s in trainer.optimizers[0].state.values() for k, v in s.items() if k.startswith("exp_avg")}

    class _One(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i):
            return {k: v[0] for k, v in data.items()}

    # bf16_adapters (Note [Adapters in bf16]): FSDP2 gathers the fp32 adapters in bf16; masters, gradients and
    # AdamW state stay fp32, and the gradients stay within the one-GPU bf16 model's error
    strategy = SequenceParallelStrategy(sequence_parallel_size=world, attention="ring", bf16_adapters=bf16_adapters)
    trainer = L.Trainer(accelerator="gpu", devices=world, strategy=strategy, precision="bf16-true", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Capture()])
    module = CausalLMModule(folder, lora=LORA, lr=1e-4, warmup_steps=0, max_steps=1, loss_chunk_size=2048)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(_One(), batch_size=1))
    if rank != 0:
        return
    adapters = {n for n in seen["dtypes"] if ".lora_" in n}
    assert adapters and all(seen["dtypes"][n] == torch.float32 for n in adapters)
    assert all(d == torch.bfloat16 for n, d in seen["dtypes"].items() if n not in adapters)
    assert seen["state"] == {torch.float32}
    ref_loss, ref_grads = _one_gpu(folder, torch.float32, data, seen["init"])
    _, bf16_grads = _one_gpu(folder, torch.bfloat16, data, seen["init"])
    assert seen["grads"].keys() == ref_grads.keys()
    err, err_single = _rel(seen["grads"], ref_grads), _rel(bf16_grads, ref_grads)
    print(f"\nLoRA bf16-true (bf16_adapters={bf16_adapters}), {world} GPU(s): loss {seen['loss']:.5f} vs fp32 {ref_loss:.5f}; adapter gradient rel. error "
          f"{err:.4f} (one-GPU bf16 without the strategy: {err_single:.4f})")
    assert seen["loss"] == pytest.approx(ref_loss, rel=1e-2)
    assert err <= 2 * err_single + 1e-3

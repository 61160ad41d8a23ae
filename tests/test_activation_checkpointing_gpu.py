"""Offloading to host memory on a GPU; skipped on CPU.

    pytest -s tests/test_activation_checkpointing_gpu.py

(one process: not under torchrun)

* Checkpointed block inputs (``offload_checkpoints``): the side-stream copies to pinned host
  memory (in pieces) and back give the same loss and gradients, and the GPU memory held between
  forward and backward drops by the offloaded inputs. A 4-block Llama (d = 1024, S = 8192, fp32
  with TF32 off, so that the only difference between the runs is the summation order of the
  tiled MLP) on one GPU; the last block is left uncheckpointed, so three inputs of
  8192 x 1024 x 4 bytes (32 MiB each) go to the host.
* Parameters (``offload_params``, FSDP2's CPUOffloadPolicy) under ``SequenceParallelStrategy`` on
  one GPU (FSDP2 over a 1-rank mesh, bf16-mixed, gradient clipping, the chunked cross entropy):
  the same losses and weights as without, the parameters, gradients and AdamW state on the host
  (pinned; torch's fused CPU AdamW, stepped with the host's cores), and a peak of GPU memory lower
  by at least half of the fp32 model states (16 bytes/parameter).
"""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
import torch.distributed as dist

from lightning_seqpar.models import Llama, LlamaConfig
from lightning_seqpar.parallel.parallelize import apply_ac, apply_mlp_tiles

pytestmark = pytest.mark.gpu

S, D, LAYERS = 8192, 1024, 4


def _run(model, ids):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    loss = model(ids).float().square().mean()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base  # what forward leaves for backward (logits included)
    loss.backward()
    torch.cuda.synchronize()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, held


@pytest.mark.parametrize("mode", ["full", "selective++"])
@pytest.mark.parametrize("piece_bytes,chunk", [(1 << 28, None), (1 << 20, 1000)])
def test_offload_on_gpu_is_exact_and_frees_the_inputs(mode, piece_bytes, chunk):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, n_embd=D, n_layer=LAYERS, n_head=8, n_kv_head=2, intermediate_size=2816, max_seq_len=S)
    base = Llama(cfg).cuda()
    ids = torch.randint(0, 256, (1, S), device="cuda")
    plain = copy.deepcopy(base)
    apply_mlp_tiles(plain, chunk)
    apply_ac(plain, mode, uncheckpointed_blocks=1)
    offloaded = copy.deepcopy(base)
    apply_mlp_tiles(offloaded, chunk)
    apply_ac(offloaded, mode, uncheckpointed_blocks=1, offload_checkpoints=True)
    host = offloaded.layers[0].checkpoint_fn.keywords["offload"]
    host.piece_bytes = piece_bytes
    loss_p, grads_p, held_p = _run(plain, ids)
    loss_o, grads_o, held_o = _run(offloaded, ids)
    torch.testing.assert_close(loss_o, loss_p, rtol=1e-6, atol=0)
    for name, g in grads_p.items():
        torch.testing.assert_close(grads_o[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    inputs = 3 * S * D * 4  # three checkpointed blocks' inputs, fp32
    assert host.packed_bytes == inputs
    print(f"[offload-gpu] {mode} piece={piece_bytes} chunk={chunk}: held after forward {held_p / 2**20:.0f} MiB "
          f"-> {held_o / 2**20:.0f} MiB (inputs {inputs / 2**20:.0f} MiB)", flush=True)
    assert held_p - held_o >= 0.9 * inputs


# A Llama whose model states dwarf its activations at S = 1024: ~167M parameters (8 blocks of
# d = 1024, a 32000-token vocabulary), 2.7 GB of fp32 parameters, gradients and AdamW moments.
OFFLOAD_MODEL = dict(vocab_size=32000, n_embd=1024, n_layer=8, n_head=8, intermediate_size=2816)
OFFLOAD_STEPS, OFFLOAD_SEQ = 3, 1024


def _fit_offload_params(offload_params: bool) -> dict:
    """OFFLOAD_STEPS steps of CausalLMModule under SequenceParallelStrategy on this GPU; what the run saw."""
    import lightning as L
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    seen: dict = {"losses": [], "peaks": [], "step_threads": []}

    class Watch(L.Callback):
        def on_train_start(self, trainer, pl_module):  # after setup: sharded, optimizer built
            params = list(pl_module.parameters())
            seen["devices"] = {p.device.type for p in params}
            seen["pinned"] = all(p.to_local().is_pinned() for p in params)
            seen["fused"] = [o.defaults.get("fused") for o in trainer.optimizers]
            seen["backend"] = dist.get_backend()
            for o in trainer.optimizers:  # registered after the strategy's: sees the step's thread count
                o.register_step_pre_hook(lambda *_: seen["step_threads"].append(torch.get_num_threads()))
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen["grad_devices"] = {p.grad.device.type for p in pl_module.parameters() if p.grad is not None}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            seen["losses"].append(float(trainer.callback_metrics["train/loss"]))
            seen["peaks"].append(torch.cuda.max_memory_allocated())

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(OFFLOAD_STEPS):
        ids = torch.randint(0, OFFLOAD_MODEL["vocab_size"], (1, OFFLOAD_SEQ + 1), generator=g)
        batches.append({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()  # anything an earlier run left
    # the chunked cross entropy (as benchmarks/train.py runs it) reads lm_head.weight outside the forward
    module = CausalLMModule(dict(OFFLOAD_MODEL), lr=1e-3, warmup_steps=0, max_steps=OFFLOAD_STEPS, init_seed=0, loss_chunk_size=256)
    strategy = SequenceParallelStrategy(sequence_parallel_size=1, offload_params=offload_params)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=OFFLOAD_STEPS,
                        gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Watch()])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    seen["state_devices"] = {t.device.type for o in trainer.optimizers for state in o.state.values()
                             for t in state.values() if torch.is_tensor(t) and t.dim() > 0}
    seen["threads_after"] = torch.get_num_threads()
    seen["parameters"] = sum(p.numel() for p in module.parameters())
    seen["weights"] = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    seen["peak"] = seen["peaks"][-1] - base
    return seen


def test_offload_params_on_gpu_matches_and_frees_the_model_states():
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        pytest.skip("one process on one GPU: run with plain pytest, not under torchrun")
    if dist.is_initialized():
        pytest.skip("needs a process without a process group (the offloaded run initialises 'cpu:gloo,cuda:nccl')")
    try:
        off = _fit_offload_params(True)  # first: it initialises the process group, with a CPU backend
        plain = _fit_offload_params(False)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    assert off["backend"] == "cpu:gloo,cuda:nccl"
    assert off["devices"] == off["grad_devices"] == off["state_devices"] == {"cpu"} and off["pinned"], off
    assert off["fused"] == [True]  # CausalLMModule: torch's fused CPU AdamW for offloaded parameters
    threads = torch.get_num_threads()
    assert off["step_threads"] == [max(threads, len(os.sched_getaffinity(0)))] * OFFLOAD_STEPS  # one process
    assert off["threads_after"] == threads and plain["step_threads"] == [threads] * OFFLOAD_STEPS
    assert plain["devices"] == plain["grad_devices"] == plain["state_devices"] == {"cuda"}
    assert plain["fused"] == [True]
    # bf16 on GPU, W = 1: rtol 1e-3, atol 8e-3 (the same computation; only the optimizer's
    # arithmetic differs, fused CUDA kernels against the CPU's, and each AdamW step moves a
    # weight by at most ~lr, so 3 steps at lr 1e-3 stay inside 8e-3 whatever bf16 does)
    torch.testing.assert_close(torch.tensor(off["losses"]), torch.tensor(plain["losses"]), rtol=1e-3, atol=0)
    assert off["weights"].keys() == plain["weights"].keys()
    for name, value in plain["weights"].items():
        torch.testing.assert_close(off["weights"][name], value, rtol=1e-3, atol=8e-3, msg=lambda m, n=name: f"{n}: {m}")
    states = 16 * plain["parameters"]  # fp32 parameters, gradients and two AdamW moments
    print(f"[offload-params-gpu] peak after {OFFLOAD_STEPS} steps {plain['peak'] / 2**20:.0f} MiB -> "
          f"{off['peak'] / 2**20:.0f} MiB (model states {states / 2**20:.0f} MiB); losses {off['losses']}", flush=True)
    assert plain["peak"] - off["peak"] >= states / 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_hf_model_with_mlp_tiles_in_bf16_true_trains_as_without(tmp_path):
    """A Hugging Face Llama (tiny, S = 8192) under the strategy with ``mlp_chunk_size=2048`` and
    ``precision="bf16-true"``: two steps train (the first backward stopped with a CheckpointError before
    Note [Recomputing under the forward's default dtype]) to the losses of the untiled run (bf16 tolerance)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        pytest.skip("one process (run without torchrun)")
    transformers = pytest.importorskip("transformers")
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    S = 8192
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=S)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "llama")

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            t = torch.randint(0, 256, (S + 1,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": t[:-1], "labels": t[1:]}

    losses = {}
    for tiles in (None, 2048):
        torch.manual_seed(0)
        trainer = L.Trainer(accelerator="cuda", devices=1, strategy=SequenceParallelStrategy(mlp_chunk_size=tiles),
                            precision="bf16-true", max_steps=2, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(CausalLMModule(str(tmp_path / "llama"), lr=1e-3, warmup_steps=0, max_steps=2),
                    torch.utils.data.DataLoader(Data(), batch_size=1))
        losses[tiles] = float(trainer.callback_metrics["train/loss"])
    assert losses[2048] == pytest.approx(losses[None], rel=1e-3), losses

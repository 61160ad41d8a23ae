"""End-to-end training throughput: our strategy against FSDP2 + torch-native context parallel.

    torchrun --nproc_per_node=4 benchmarks/train.py --system seqpar --model llama3-8b --seq 131072
    torchrun --nproc_per_node=4 benchmarks/train.py --system torch_cp --model llama3-8b --seq 131072

Both train the same Llama (lightning_seqpar.models.Llama, random init), on the same synthetic
long-range copy data, with AdamW, bf16 compute and fp32 master weights (FSDP2
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), all GPUs in one sequence-parallel
group, batch 1 sequence of --seq tokens.

* seqpar: the product path — ``lightning.Trainer(strategy=SequenceParallelStrategy(...),
  precision="bf16-mixed")`` with ``CausalLMModule`` (ring attention, zigzag, Selective
  Checkpoint++, FSDP2 over the SP ranks, chunked cross entropy).
* torch_cp (the torchtitan way): FSDP2 ``fully_shard`` per block + root, full activation
  checkpointing of every block, ``torch.distributed.tensor.experimental.context_parallel`` around
  forward and backward (its round-robin load balancer; SDPA with the cuDNN kernel), plain cross
  entropy on the full logits.

Each run times --steps optimizer steps after --warmup steps (CUDA-synchronised wall clock per
step, median), and reports tokens/s/GPU, MFU = tokens/s/GPU * flops_per_token / 989e12 with
flops_per_token = 6 * N_non_embedding + 6 * L * S * d, the peak of
torch.cuda.max_memory_allocated() after warm-up, and the losses.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch
import torch.distributed as dist

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, datasheet


def _row(args, cfg, times, peak_gb, losses, world):
    step = sorted(times)[len(times) // 2]
    tps = args.seq * args.batch / step / world
    return dict(bench="train", system=args.system, algorithm=args.algorithm if args.system == "seqpar" else "allgather-cp",
                model=args.model, seq=args.seq, gpus=world, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                step_time_s=step,
                tokens_per_s_per_gpu=tps, mfu=tps * cfg.flops_per_token(args.seq) / PEAK_BF16, peak_mem_gb=peak_gb,
                losses=losses, ac=args.ac if args.system == "seqpar" else "full", commit=args.commit)


def run_seqpar(args):
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.data import LongRangeDataModule
    from lightning_seqpar.models import LlamaConfig

    cfg = LlamaConfig.from_name(args.model)
    times, losses = [], []
    peak = {}
    cuda = args.device == "cuda"

    class StepTimer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
                if batch_idx == args.warmup:
                    torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if cuda:
                torch.cuda.synchronize()
            if batch_idx >= args.warmup:
                times.append(time.perf_counter() - self.t0)
            loss = trainer.callback_metrics.get("train/loss")
            losses.append(float(loss) if loss is not None else float("nan"))
            peak["gb"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan")

    strategy = SequenceParallelStrategy(sequence_parallel_size=int(os.environ["WORLD_SIZE"]), attention=args.algorithm,
                                        activation_checkpointing=None if args.ac == "none" else args.ac)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
                        precision="bf16-mixed" if cuda else "32-true",
                        max_steps=args.warmup + args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[StepTimer()], log_every_n_steps=1)
    module = CausalLMModule(model=args.model, lr=3e-4, warmup_steps=2, weight_decay=0.0, loss_chunk_size=args.loss_chunk)
    data = LongRangeDataModule(vocab_size=cfg.vocab_size, seq_len=args.seq, batch_size=args.batch,
                               num_samples=(args.warmup + args.steps) * args.batch * 8, val_samples=1, seed=0)
    trainer.fit(module, datamodule=data)
    world = dist.get_world_size()
    return _row(args, cfg, times, peak.get("gb", float("nan")), losses, world)


def run_torch_cp(args):
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.experimental import context_parallel

    from lightning_seqpar.attention import Attention
    from lightning_seqpar.data import LongRangeDataModule
    from lightning_seqpar.models import Llama, LlamaConfig

    class SDPA(nn.Module):  # what torch's context_parallel intercepts; K/V repeated first, as torchtitan's Llama does
        def forward(self, q, k, v):
            g = q.shape[2] // k.shape[2]
            k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return out.transpose(1, 2)

    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    cfg = LlamaConfig.from_name(args.model)
    with torch.device("meta"):
        model = Llama(cfg)
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, Attention):
                setattr(mod, child_name, SDPA())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        model.layers[i] = fully_shard(checkpoint_wrapper(block), mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device="cuda")
    with torch.no_grad():
        torch.manual_seed(0)
        model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, fused=True)
    data = LongRangeDataModule(vocab_size=cfg.vocab_size, seq_len=args.seq, batch_size=args.batch, num_samples=64, val_samples=1, seed=0)
    data.setup("fit")
    loader = iter(data.train_dataloader())
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        batch = {k: v.cuda() for k, v in next(loader).items()}
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
        torch.cuda.synchronize()
        if step == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with context_parallel(mesh, buffers=[ids, labels, pos], buffer_seq_dims=[1, 1, 1], no_restore_buffers={ids, labels, pos}), \
                torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            logits = model(ids, pos)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        rep = loss.detach().clone()
        dist.all_reduce(rep, op=dist.ReduceOp.AVG)
        losses.append(rep.item())
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 1e9, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return _row(args, cfg, times, peak.item(), losses, world)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=["seqpar", "torch_cp"], required=True)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--algorithm", default="ring")
    ap.add_argument("--ac", default="selective++", choices=["selective++", "full", "none"])
    ap.add_argument("--loss-chunk", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the seqpar path (gloo)")
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    if args.system == "torch_cp":
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10), device_id=torch.device("cuda", local_rank))
    row = run_seqpar(args) if args.system == "seqpar" else run_torch_cp(args)
    if dist.get_rank() == 0:
        print(f"[train] {row['system']:8s} {row['model']} S={row['seq']} GPUs={row['gpus']}: {row['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
              f"MFU {row['mfu']:.3f}, step {row['step_time_s']:.2f}s, peak {row['peak_mem_gb']:.1f} GB, losses {[round(x, 3) for x in row['losses']]}",
              flush=True)
        if args.out:
            rows = json.load(open(args.out)) if os.path.exists(args.out) else []
            rows.append(row)
            json.dump(rows, open(args.out, "w"), indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

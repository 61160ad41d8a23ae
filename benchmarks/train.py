"""End-to-end training throughput: our strategy against FSDP2 + torch-native context parallel and
against Megatron-style tensor + sequence parallelism.

    torchrun --nproc_per_node=4 benchmarks/train.py --system seqpar --model llama3-8b --seq 131072
    torchrun --nproc_per_node=4 benchmarks/train.py --system torch_cp --model llama3-8b --seq 131072
    torchrun --nproc_per_node=4 benchmarks/train.py --system tp_sp --model llama3-8b --seq 131072

All train the same Llama (lightning_seqpar.models.Llama, random init), on the same synthetic
long-range copy data, with AdamW, bf16 compute and fp32 master weights (FSDP2
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)), all GPUs in one sequence-parallel
(or, for tp_sp, tensor-parallel) group, batch 1 sequence of --seq tokens.

* seqpar: the product path — ``lightning.Trainer(strategy=SequenceParallelStrategy(...),
  precision="bf16-mixed")`` with ``CausalLMModule`` (ring attention, zigzag, Selective
  Checkpoint++, FSDP2 over the SP ranks, chunked cross entropy).
* torch_cp (the torchtitan way): FSDP2 ``fully_shard`` per block + root, full activation
  checkpointing of every block, ``torch.distributed.tensor.experimental.context_parallel`` around
  forward and backward (its round-robin load balancer; SDPA with the cuDNN kernel), plain cross
  entropy on the full logits.
* tp_sp (the Megatron-LM baseline of the papers): Lightning's ``ModelParallelStrategy`` with
  tensor parallel over all GPUs + sequence parallel norms, full activation checkpointing,
  vocabulary-parallel cross entropy, dummy heads where n_head % W != 0 (``benchmarks/tp_sp.py``,
  Note [The TP+SP baseline]). Every rank reads the full sequence.

``--seqs 32768:3,65536:3,131072:2,262144:1 --models llama-7b,llama-33h`` runs several lengths
(and models: each length for every model before the next length, so an out-of-memory at the longest
ends only the longest) in turn in one process, saving the start-up of a process per run. One record
each, with ``in_process`` (the process's [model, S] list) and ``held_before_gb``: what was still
allocated before the run, so a leak between runs would show rather than hide in the peak.
``S:STEPS`` times STEPS steps at that S instead of --steps.

Each run times --steps optimizer steps after --warmup steps (CUDA-synchronised wall clock per
step, median), and reports tokens/s/GPU, MFU = tokens/s/GPU * flops_per_token / 989e12 with
flops_per_token = 6 * N_non_embedding + 6 * L * S * d, the peak of
torch.cuda.max_memory_allocated() after warm-up (max over ranks), and the losses. With
``--matmul-peak TFLOPS`` (from ``benchmarks/matmul_peak.py``) the record also has
``mfu_measured_peak`` = the same model FLOP rate over the measured bf16 matmul peak.

A CUDA out-of-memory error prints ``[train] OOM`` and exits with code 3 (``OOM_EXIT``), so that
``benchmarks/longest.py`` can tell it from other failures (torchrun itself then exits with 1 and
prints the worker's exit code 3).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from collect import append_records  # benchmarks/ is on sys.path when this file runs as a script

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16, datasheet
OOM_EXIT = 3
ALGORITHMS = {"torch_cp": "allgather-cp", "tp_sp": "megatron-tp-sp"}


def _row(args, cfg, times, peak_gb, losses, world, **extra):
    step = sorted(times)[len(times) // 2]
    tps = args.seq * args.batch / step / world
    flops_per_s = tps * cfg.flops_per_token(args.seq)  # model FLOPs per second per GPU
    row = dict(bench="train", system=args.system, algorithm=ALGORITHMS.get(args.system, args.algorithm),
               model=args.model, seq=args.seq, gpus=world, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               step_time_s=step,
               tokens_per_s_per_gpu=tps, mfu=flops_per_s / PEAK_BF16, peak_mem_gb=peak_gb,
               losses=losses, ac=args.ac if args.system == "seqpar" else ("none" if args.ac == "none" else "full"),
               commit=args.commit)
    if args.optimizer != "auto":
        row["optimizer"] = args.optimizer
    if args.matmul_peak:
        row["mfu_measured_peak"] = flops_per_s / (args.matmul_peak * 1e12)
        row["matmul_peak_tflops"] = args.matmul_peak
    if args.tag:
        row["tag"] = args.tag
    if args.prealloc_optimizer:
        row["prealloc_optimizer"] = True
    row.update(extra)
    return row


def _max_over_ranks(value: float, device: str) -> float:
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _step_timer(args, times: list, losses: list):
    """A callback timing each optimizer step (synchronised) and collecting ``train/loss``; the peak
    memory statistics are reset after the warm-up. Also used by train_scaling.py and hf_finetune.py."""
    import lightning as L

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

    return StepTimer()


def _profiler(args):
    """A callback profiling the first timed step (batch ``args.warmup``) on every rank; rank 0 writes
    the summary (benchmarks/profile_summary.py) to ``args.profile``."""
    import lightning as L

    class StepProfiler(L.Callback):
        def __init__(self):
            self.prof, self.t0 = None, 0.0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup:
                self.prof = _start_profiler(args)
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == args.warmup and self.prof is not None:
                _finish_profiler(args, self.prof, self.t0)

    return StepProfiler()


def _start_profiler(args):
    from torch.profiler import ProfilerActivity, profile

    if args.device == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    prof = profile(activities=activities)
    prof.__enter__()
    return prof


def _finish_profiler(args, prof, t0: float) -> None:
    from profile_summary import format_gaps, format_summary, idle_gaps, summarize

    if args.device == "cuda":
        torch.cuda.synchronize()
    step = time.perf_counter() - t0
    prof.__exit__(None, None, None)
    if dist.get_rank() != 0:
        return
    os.makedirs(args.profile, exist_ok=True)
    summary = dict(summarize(prof, step), system=args.system, model=args.model, seq=args.seq, commit=args.commit,
                   backend=getattr(args, "backend", None))
    base = os.path.join(args.profile, f"profile_{args.system}{'_' + args.tag if args.tag else ''}")
    text = format_summary(summary)
    if args.device == "cuda":  # where the idle time is: from the Chrome trace (kept with --profile-trace)
        trace = base + ".trace.json"  # removed again unless --profile-trace
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            summary["idle"] = idle_gaps(json.load(f), step_s=step)
        if not args.profile_trace:
            os.remove(trace)
        text += "\n" + format_gaps(summary["idle"])
    elif args.profile_trace:
        prof.export_chrome_trace(base + ".trace.json")
    with open(base + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    with open(base + ".txt", "w") as f:
        f.write(text + "\n")
    print(f"[profile] {text}", flush=True)


def _oom_exit():
    """A callback that ends this process with OOM_EXIT at once on an out-of-memory error.

    Lightning's own exception handling would first tear down (moving the model to CPU) while the
    other ranks wait in a collective; torchrun stops them when this rank exits.
    """
    import lightning as L

    class OOMExit(L.Callback):
        def on_exception(self, trainer, pl_module, exception):
            if _is_oom(exception):
                _exit_oom(trainer.strategy.global_rank, exception)

    return OOMExit()


def _exit_oom(rank, exc: BaseException) -> None:
    print(f"[train] OOM rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}", flush=True)
    print(f"[train] oom-state rank {rank}: {_oom_state(exc)}", flush=True)
    sys.stderr.flush()
    os._exit(OOM_EXIT)


def _oom_state(exc: BaseException) -> str:
    """Where an out-of-memory error happened (the innermost frames of ours, of torch if none) and the
    memory then: what PyTorch's allocator held, had reserved and peaked at, and what the driver had free
    (a library's own allocation, e.g. cuBLAS's handle, fails when the allocator has reserved the card)."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    ours = [f for f in frames if "lightning_seqpar" in f.filename or "benchmarks" in f.filename] or frames
    where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(ours[-3:])) or "?"
    memory = "no CUDA"
    if torch.cuda.is_available():
        gb = 1e9
        try:
            free, total = torch.cuda.mem_get_info()
            driver = f", driver free {free / gb:.1f} of {total / gb:.1f} GB"
        except RuntimeError:
            driver = ""
        memory = (f"allocated {torch.cuda.memory_allocated() / gb:.1f} GB, reserved {torch.cuda.memory_reserved() / gb:.1f} GB, "
                  f"peak {torch.cuda.max_memory_allocated() / gb:.1f} GB{driver}")
    return f"{memory}; at {where}"


@torch.no_grad()
def _prealloc_optimizer(optimizer) -> None:
    """Allocate the optimizer's state now: one step on zero gradients (AdamW with no weight decay
    leaves the parameters unchanged; its step count moves by one). The memory peak of step 1 is
    then that of every later step, so an out-of-memory shows in step 1 (benchmarks/longest.py)."""
    for group in optimizer.param_groups:
        if group.get("weight_decay", 0.0) != 0.0:
            raise ValueError("--prealloc-optimizer needs weight_decay=0 (the zero-gradient step must not change parameters)")
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _prealloc():
    import lightning as L

    class PreallocOptimizer(L.Callback):
        def on_train_start(self, trainer, pl_module):
            for optimizer in trainer.optimizers:
                _prealloc_optimizer(optimizer)

    return PreallocOptimizer()


def _trainer(args, strategy, callbacks, precision, *, oom_exit: bool = True):
    """The benchmark Trainer: max_steps = warm-up + timed steps, the devices of this node (torchrun's
    LOCAL_WORLD_SIZE; 1 without torchrun), nothing logged or saved. ``oom_exit=False`` leaves out
    ``_oom_exit`` (hf_families.py records an out-of-memory error and goes on to its next shape)."""
    import lightning as L

    callbacks = [*callbacks, *([_oom_exit()] if oom_exit else []), *([_prealloc()] if args.prealloc_optimizer else []),
                 *([_profiler(args)] if args.profile else [])]
    return L.Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                     strategy=strategy, precision=precision, max_steps=args.warmup + args.steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks, log_every_n_steps=1)


def _datamodule(args, cfg):
    from lightning_seqpar.data import LongRangeDataModule

    return LongRangeDataModule(vocab_size=cfg.vocab_size, seq_len=args.seq, batch_size=args.batch,
                               num_samples=(args.warmup + args.steps) * args.batch * 8, val_samples=1, seed=0)


def _peak_gb(args) -> float:
    if args.device != "cuda":
        return float("nan")
    return _max_over_ranks(torch.cuda.max_memory_allocated() / 1e9, "cuda")


def _host_peak_gb(args) -> float:
    """Peak resident host memory of this process (pinned offload buffers included), max over ranks."""
    import resource

    return _max_over_ranks(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, args.device)


def run_seqpar(args):
    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.models import LlamaConfig

    cfg = LlamaConfig.from_name(args.model)
    times, losses = [], []
    hp = args.head_parallel if args.head_parallel == "auto" else int(args.head_parallel)
    strategy = SequenceParallelStrategy(sequence_parallel_size=int(os.environ["WORLD_SIZE"]), attention=args.algorithm,
                                        head_parallel_size=hp, expected_seq_len=args.seq if args.algorithm == "auto" else None,
                                        activation_checkpointing=None if args.ac == "none" else args.ac,
                                        attention_backend=args.backend, head_chunks=args.head_chunks,
                                        uncheckpointed_blocks=args.uncheckpointed_blocks, compile=args.compile,
                                        offload_checkpoints=args.offload, offload_params=args.offload_params,
                                        mlp_chunk_size=args.mlp_chunk)
    trainer = _trainer(args, strategy, [_step_timer(args, times, losses)], "bf16-mixed" if args.device == "cuda" else "32-true")
    fused = {"auto": None, "fused": True, "default": False}[args.optimizer]
    module = CausalLMModule(model=args.model, lr=3e-4, warmup_steps=2, weight_decay=0.0, loss_chunk_size=args.loss_chunk,
                            fused_optimizer=fused)
    trainer.fit(module, datamodule=_datamodule(args, cfg))
    from lightning_seqpar.attention.local import resolve_backend

    be = resolve_backend(args.backend, torch.device(args.device), torch.bfloat16 if args.device == "cuda" else torch.float32,
                         cfg.head_dim or cfg.n_embd // cfg.n_head)
    dims = strategy.parallel_dims  # what "auto" chose, named as benchmarks/attention.py names it
    algorithm = f"2d:{dims.hp}x{dims.cp}" if strategy.attention == "2d" else strategy.attention
    return _row(args, cfg, times, _peak_gb(args), losses, dist.get_world_size(), backend=be, head_chunks=args.head_chunks,
                algorithm=algorithm, **({"auto": True} if args.algorithm == "auto" else {}),
                uncheckpointed_blocks=args.uncheckpointed_blocks, compiled=args.compile,
                **({"offload_checkpoints": True} if args.offload else {}),
                **_offload_params_record(args),
                **({"host_peak_gb": _host_peak_gb(args)} if args.offload or args.offload_params else {}),
                **({"mlp_chunk_size": args.mlp_chunk} if args.mlp_chunk else {}))


def _offload_params_record(args) -> dict:
    """``offload_params: true`` in the record of a run with --offload-params (absent otherwise)."""
    return {"offload_params": True} if args.offload_params else {}


def run_tp_sp(args):
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_seqpar.models import LlamaConfig
    from tp_sp import TPSPModule, head_layout

    cfg = LlamaConfig.from_name(args.model)
    world = int(os.environ["WORLD_SIZE"])
    layout = head_layout(cfg, world)  # ValueError (before any collective) when Megatron TP cannot run the model
    backends = None
    if args.device == "cuda":
        from torch.nn.attention import SDPBackend

        backends = [SDPBackend.CUDNN_ATTENTION]
    times, losses = [], []
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world)
    # precision: bf16 compute with fp32 master weights comes from FSDP2's MixedPrecisionPolicy inside the module
    trainer = _trainer(args, strategy, [_step_timer(args, times, losses)], "32-true")
    module = TPSPModule(cfg, lr=3e-4, loss_parallel=not args.no_loss_parallel, activation_checkpointing=args.ac != "none",
                        bf16=args.device == "cuda", attention_backends=backends)
    trainer.fit(module, datamodule=_datamodule(args, cfg))
    waste = layout.config(cfg).flops_per_token(args.seq) / cfg.flops_per_token(args.seq) - 1
    return _row(args, cfg, times, _peak_gb(args), losses, dist.get_world_size(),
                heads=f"{layout.n_head}/{layout.n_kv_head}", padded_heads=layout.padded, kv_repeat=layout.kv_repeat,
                padding_flops_waste=waste, loss_parallel=not args.no_loss_parallel)


def run_torch_cp(args):
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
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
    # --offload-params: torchtitan's way (the shards materialised on the host; Llama has no buffers that would need the GPU)
    offload = CPUOffloadPolicy() if args.offload_params else OffloadPolicy()
    for i, block in enumerate(model.layers):
        model.layers[i] = fully_shard(checkpoint_wrapper(block), mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    model.to_empty(device="cpu" if args.offload_params else "cuda")
    with torch.no_grad():
        torch.manual_seed(0)
        model.init_weights()
    # fused AdamW (torchtitan's default), also for --offload-params' host shards (torch's fused CPU kernel)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, fused=args.optimizer != "default" or None)
    if args.prealloc_optimizer:
        _prealloc_optimizer(opt)
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
        prof = _start_profiler(args) if args.profile and step == args.warmup else None
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
        if prof is not None:
            _finish_profiler(args, prof, t0)
        rep = loss.detach().clone()
        dist.all_reduce(rep, op=dist.ReduceOp.AVG)
        losses.append(rep.item())
    return _row(args, cfg, times, _peak_gb(args), losses, world, **_offload_params_record(args))


def _is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, or an allocation failure that a kernel library reports as a RuntimeError."""
    while exc is not None:
        if isinstance(exc, torch.OutOfMemoryError) or (
            isinstance(exc, RuntimeError) and ("out of memory" in str(exc).lower() or "ALLOC_FAILED" in str(exc))
        ):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--system", choices=["seqpar", "torch_cp", "tp_sp"], required=True)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--models", default=None, metavar="M1,M2,...", help="several models in turn in this one process (see --seqs)")
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--seqs", default=None, metavar="S[:STEPS],...",
                    help="several sequence lengths in turn in this one process, a record each (instead of --seq); "
                         "S:STEPS times STEPS steps at S instead of --steps")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--algorithm", default="ring", help="seqpar: the attention algorithm ('auto': the cost model's, for --seq)")
    ap.add_argument("--head-parallel", default="1", help="seqpar: head_parallel_size (hp of 2D attention), or 'auto' with --algorithm auto")
    ap.add_argument("--ac", default="selective++", choices=["selective++", "full", "none"],
                    help="seqpar: the checkpointing policy; tp_sp: 'none' turns full checkpointing off")
    ap.add_argument("--loss-chunk", type=int, default=8192, help="seqpar: chunked cross entropy")
    ap.add_argument("--backend", default="auto", help="seqpar: the local attention kernel (auto: fa4 when installed, else flash-attention-2)")
    ap.add_argument("--compile", action="store_true", help="seqpar: torch.compile each block (strategy compile=True)")
    ap.add_argument("--uncheckpointed-blocks", type=int, default=0, help="seqpar: the last N blocks without checkpointing")
    ap.add_argument("--head-chunks", type=int, default=1, help="seqpar: attention over this many K/V head groups in turn")
    ap.add_argument("--offload", action="store_true", help="seqpar: checkpointed block inputs in pinned host memory (offload_checkpoints)")
    ap.add_argument("--mlp-chunk", type=int, default=None, help="seqpar: the MLP over slices of this many tokens (mlp_chunk_size)")
    ap.add_argument("--offload-params", action="store_true",
                    help="seqpar, torch_cp: FSDP2 keeps parameter shards, gradients and AdamW state in host memory, the "
                         "optimizer step on the CPU (offload_params; CPUOffloadPolicy)")
    ap.add_argument("--optimizer", choices=("auto", "fused", "default"), default="auto",
                    help="AdamW's implementation: auto = CausalLMModule's choice (fused on CUDA and for --offload-params), "
                         "default = torch's default (foreach; a per-parameter loop for DTensors on the CPU)")
    ap.add_argument("--no-loss-parallel", action="store_true", help="tp_sp: gather the logits instead of the vocab-parallel loss")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--matmul-peak", type=float, default=None, metavar="TFLOPS",
                    help="measured bf16 matmul peak per GPU (benchmarks/matmul_peak.py): adds mfu_measured_peak")
    ap.add_argument("--prealloc-optimizer", action="store_true",
                    help="allocate the AdamW state before step 1 (one step on zero gradients), so an OOM shows in step 1")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="torch.profiler over the first timed step; rank 0 writes a kernel-category summary to DIR")
    ap.add_argument("--profile-trace", action="store_true", help="with --profile: also the Chrome trace (large)")
    ap.add_argument("--tag", default=None, help="free label stored in the record (e.g. 'scaling')")
    ap.add_argument("--out", default=None, help="append the record to this JSON list (merge with benchmarks/collect.py)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test (gloo) of seqpar / tp_sp")
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args(argv)
    try:
        runs = [tuple(int(y) for y in x.split(":")) for x in args.seqs.split(",")] if args.seqs else [(args.seq,)]
    except ValueError:
        ap.error(f"--seqs: expected S or S:STEPS entries, comma separated, got {args.seqs!r}")
    if any(len(r) > 2 or min(r) <= 0 for r in runs):
        ap.error(f"--seqs: expected positive S or S:STEPS entries, got {args.seqs!r}")
    models = args.models.split(",") if args.models else [args.model]
    runs = [(m, r[0], r[1] if len(r) == 2 else args.steps) for r in runs for m in models]
    if args.device == "cpu" and args.system == "torch_cp":
        ap.error("--system torch_cp runs on CUDA only")
    if args.offload_params and args.system == "tp_sp":
        ap.error("--offload-params is for --system seqpar and torch_cp (FSDP2); tp_sp's FSDP2 runs inside its own module")
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    if args.system == "torch_cp":
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10), device_id=torch.device("cuda", local_rank))
    runner = {"seqpar": run_seqpar, "torch_cp": run_torch_cp, "tp_sp": run_tp_sp}[args.system]
    for args.model, args.seq, args.steps in runs:
        held = _release(args)
        try:
            row = runner(args)
        except BaseException as exc:  # noqa: BLE001 - an OOM must not hang the other ranks in teardown
            if not _is_oom(exc):
                raise
            _exit_oom(os.environ.get("RANK"), exc)
        if len(runs) > 1:
            row.update(in_process=[[m, seq] for m, seq, _ in runs], held_before_gb=held)
        if dist.get_rank() == 0:
            extra = f", mfu(measured peak) {row['mfu_measured_peak']:.3f}" if "mfu_measured_peak" in row else ""
            print(f"[train] {row['system']:8s} {row['model']} S={row['seq']} GPUs={row['gpus']}: {row['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, "
                  f"MFU {row['mfu']:.3f}{extra}, step {row['step_time_s']:.2f}s, peak {row['peak_mem_gb']:.1f} GB, "
                  f"losses {[round(x, 4) for x in row['losses']]}", flush=True)
            if args.out:
                append_records(args.out, row)
        del row
    dist.barrier()
    dist.destroy_process_group()


def _release(args) -> float:
    """Before each run of a --seqs list: free what the previous run left (its trainer, model and
    optimizer are unreachable once its runner returned) and return what is still allocated, in GB
    (max over ranks; recorded as ``held_before_gb``, so a leak would show in the record rather
    than as a peak that silently includes it)."""
    import gc

    gc.collect()
    if args.device != "cuda" or not dist.is_initialized():
        return 0.0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return _max_over_ranks(torch.cuda.memory_allocated() / 1e9, "cuda")


if __name__ == "__main__":
    main()

"""Training throughput of the package's models (Llama, TransNormerLLM, the LSS GPT): our strategy against FSDP2 +
torch-native context parallel and against Megatron-style tensor + sequence parallelism.

    torchrun --nproc_per_node=4 benchmarks/train.py --system seqpar --model llama3-8b --seq 131072     # also torch_cp, tp_sp
    torchrun --nproc_per_node=4 benchmarks/train.py --system seqpar --model tnl-1b --seq 131072 --algorithm lasp --lasp-variant p2p,allgather
    torchrun --nproc_per_node=4 benchmarks/train.py --system seqpar --model lss-gpt-1.5b --seq 65536 --algorithm allgather --kv-comm input,kv
    python benchmarks/train.py host-adamw --model llama-7b --ranks 4 --threads 16      # offload_params' CPU AdamW step
    torchrun --nproc_per_node=2 benchmarks/train.py --system seqpar --device cpu --model tiny --seq 64   # smoke (gloo)

Every system trains the same model code (random init) on the same synthetic copy-task data with AdamW, bf16 compute
and fp32 master weights, all GPUs in one sequence-parallel (tp_sp: tensor-parallel) group, one sequence of --seq
tokens: seqpar is ``SequenceParallelStrategy`` + ``CausalLMModule`` ("bf16-mixed"; comma lists of --lasp-variant /
--kv-comm train one after the other); torch_cp is torchtitan's way (FSDP2 per block, full activation checkpointing,
``context_parallel`` around cuDNN SDPA, the loss on the full logits); tp_sp is Note [The TP+SP baseline]. ``--seqs
32768:3,65536:3 --models a,b`` trains several lengths (S:STEPS) and models in one process. A record (bench "train") per
run: the median of --steps after --warmup, tokens/s/GPU, MFU = tokens/s/GPU x flops_per_token(S) / 989e12, peak_mem_gb
(after the warm-up, max over ranks), losses, settings. A CUDA out-of-memory error exits the rank with code 3.

Note [The TP+SP baseline]
~~~~~~~~~~~~~~~~~~~~~~~~~
Korthikanti et al. 2023 ("Reducing Activation Recomputation in Large Transformer Models", §4.2.2), with torch's DTensor
tensor-parallel styles as torchtitan's Llama plan (``apply_tp``), on Lightning's ``ModelParallelStrategy`` and the
package's unchanged ``Llama``:

    residual stream  (B, S/W, d)   sequence-sharded ("SP" regions: norms, residual adds)
         | all-gather S        (PrepareModuleInput: Shard(1) -> Replicate)
    q/k/v, gate/up   (B, S, ./W)   ColwiseParallel: each rank holds H/W heads / I/W columns
    attention        (B, S, H/W, D) plain local causal SDPA (cuDNN) over this rank's heads
         | reduce-scatter S    (RowwiseParallel(output_layouts=Shard(1)) of o_proj / down_proj)
    residual stream  (B, S/W, d)

The embedding is vocabulary-sharded; ``loss_parallel`` computes the fp32 cross entropy on logits sharded on the
vocabulary (Megatron's vocab-parallel cross entropy). Every rank holds the FULL sequence for attention: its activations
and the logits grow with S, not S/W. Full activation checkpointing; bf16 compute with fp32 master weights through
FSDP2's MixedPrecisionPolicy on the size-1 data-parallel axis. Order: TP -> AC -> FSDP2, as torchtitan.

Note [Heads that do not divide W]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-LM needs n_head % W == 0 and n_kv_head % W == 0; LightSeq (§4.2) padded heads for Llama-33H, and so do we: MHA
gets zero heads (zero rows of q/k/v_proj, zero columns of o_proj): a dummy head has v = 0, so its output and every
gradient of its rows / columns are 0, and the padded model IS the H-head model at every step. Their FLOPs are the
record's ``padding_flops_waste`` (Llama-33H on 4 GPUs: 36 heads, +6.7% at 128K); MFU counts the real model's. GQA with
n_kv_head % W != 0 repeats every K/V head W / gcd(H_kv, W) times, as Megatron does; anything else: ValueError.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import resource
import sys
import time
from contextlib import nullcontext
from typing import Any, NamedTuple

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
from lightning_seqpar.attention import Attention
from lightning_seqpar.attention.fused import FusedKVAttention
from lightning_seqpar.attention.lasp import LinearAttention, resolve_kernel
from lightning_seqpar.attention.local import resolve_backend
from lightning_seqpar.data import LongRangeDataModule
from lightning_seqpar.models import Llama, LlamaConfig
from lightning_seqpar.models.gpt import GPTConfig
from lightning_seqpar.models.registry import resolve_config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from driver import (PEAK_BF16, append_records, exit_oom, held_gb, is_oom, max_over_ranks, mode_of,  # noqa: E402
                    runner_args, step_timer, trainer)
from profile_summary import finish_profiler, profiler_callback, start_profiler  # noqa: E402

ALGORITHMS = {"torch_cp": "allgather-cp", "tp_sp": "megatron-tp-sp"}


# ---- the TP+SP baseline -------------------------------------------------------------------------------------

class HeadLayout(NamedTuple):
    """Head counts of the TP model (Note [Heads that do not divide W]): query and K/V heads after padding or repetition
    (multiples of W), how often each K/V head is repeated, and the dummy heads added."""

    n_head: int
    n_kv_head: int
    kv_repeat: int
    padded: int


def head_layout(config, tp: int) -> HeadLayout:
    """The head counts TP over ``tp`` ranks runs ``config`` with; ValueError when Megatron TP cannot."""
    H, H_kv = config.n_head, config.n_kv_head
    if H == H_kv:
        padded_h = math.ceil(H / tp) * tp
        return HeadLayout(n_head=padded_h, n_kv_head=padded_h, kv_repeat=1, padded=padded_h - H)
    if H % tp:
        raise ValueError(f"tp_sp: n_head={H} (GQA with n_kv_head={H_kv}) is not divisible by the tensor-parallel size {tp}; "
                         "Megatron-style TP cannot run it (padding is only defined for MHA here)")
    r = tp // math.gcd(H_kv, tp)
    if H % (H_kv * r):
        raise ValueError(f"tp_sp: cannot repeat n_kv_head={H_kv} to a multiple of {tp} that divides n_head={H}")
    return HeadLayout(n_head=H, n_kv_head=H_kv * r, kv_repeat=r, padded=0)


@torch.no_grad()
def pad_heads(model, layout: HeadLayout) -> None:
    """Give every attention block ``layout``'s head counts (zero heads / repeated K/V), in place."""
    D, H_kv, pad = model.config.head_dim, model.config.n_kv_head, layout.padded * model.config.head_dim
    if layout.padded == 0 and layout.kv_repeat == 1:
        return

    def linear(weight: torch.Tensor) -> nn.Linear:
        out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        out.weight.copy_(weight)
        return out

    for block in model.layers:
        attn = block.self_attn
        q = attn.q_proj.weight  # (H * D, d)
        attn.q_proj = linear(torch.cat([q, q.new_zeros(pad, q.shape[1])]))  # (H' * D, d)
        for name in ("k_proj", "v_proj"):
            w = getattr(attn, name).weight  # (H_kv * D, d)
            w = w.view(H_kv, D, -1).repeat_interleave(layout.kv_repeat, dim=0).flatten(0, 1)  # (H_kv * r * D, d)
            setattr(attn, name, linear(torch.cat([w, w.new_zeros(pad, w.shape[1])])))
        o = attn.o_proj.weight  # (d, H * D)
        attn.o_proj = linear(torch.cat([o, o.new_zeros(o.shape[0], pad)], dim=1))  # (d, H' * D)
        attn.n_head, attn.n_kv_head = layout.n_head, layout.n_kv_head


class SDPA(nn.Module):
    """Plain causal SDPA over this rank's heads, q (B, S, H, D), k/v (B, S, H_kv, D) -> (B, S, H, D): TP+SP's local
    attention (GQA natively) and what torch's context_parallel intercepts (``repeat_kv``: K/V repeated first, as
    torchtitan's Llama); ``backends``: the SDPA kernels allowed (cuDNN on GPU)."""

    def __init__(self, backends: list[Any] | None = None, repeat_kv: bool = False) -> None:
        super().__init__()
        self.backends, self.repeat_kv = backends, repeat_kv

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.repeat_kv:
            k, v = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2), v.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        with sdpa_kernel(self.backends) if self.backends else nullcontext():
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                                 enable_gqa=q.shape[2] != k.shape[2])  # (B, H, S, D)
        return out.transpose(1, 2)


def parallelize_tp_sp(model, device_mesh, *, loss_parallel: bool = True, activation_checkpointing: bool = True,
                      param_dtype: torch.dtype | None = None, attention_backends: list[Any] | None = None) -> HeadLayout:
    """Apply Note [The TP+SP baseline] to ``model`` in place over Lightning's 2-D mesh ("data_parallel",
    "tensor_parallel"); returns the head layout it ran with."""
    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    tp = tp_mesh.size()
    layout = head_layout(model.config, tp)
    pad_heads(model, layout)
    parallelize_module(model, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel)})
    for i, block in enumerate(model.layers):
        block.self_attn.attn_core = SDPA(attention_backends)
        parallelize_module(block, tp_mesh, {
            "input_layernorm": SequenceParallel(),
            # (x, freqs_cis): gather the sequence of x; the RoPE rotations are a plain full-S tensor
            "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            **{f"self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
        # this rank's heads: LlamaAttention views its projections as (B, S, n_head, D)
        block.self_attn.n_head, block.self_attn.n_kv_head = layout.n_head // tp, layout.n_kv_head // tp
        if activation_checkpointing:
            model.layers[i] = checkpoint_wrapper(block)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return layout


def _tp_sp_module(config, *, lr: float, activation_checkpointing: bool, bf16: bool, backends):
    """Next-token training of ``Llama(config)`` with Megatron-style TP+SP under ``ModelParallelStrategy``: every rank
    builds the full model from one seed (as the seqpar path), then shards it; AdamW without weight decay."""
    class TPSPModule(L.LightningModule):
        def configure_model(self) -> None:
            if getattr(self, "model", None) is not None:
                return
            device = self.trainer.strategy.root_device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
                torch.manual_seed(0)
                model = Llama(config)
            parallelize_tp_sp(model, self.device_mesh, param_dtype=torch.bfloat16 if bf16 else None,
                              activation_checkpointing=activation_checkpointing, attention_backends=backends)
            self.model = model

        def training_step(self, batch, batch_idx):
            logits = self.model(batch["input_ids"], batch["position_ids"])  # (B, S, V), a DTensor sharded on V
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
            self.log("train/loss", loss.detach().full_tensor())
            return loss

        def backward(self, loss, *args, **kwargs):
            with loss_parallel():  # the backward of the vocabulary-parallel cross entropy needs the context too
                loss.backward(*args, **kwargs)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    return TPSPModule()


# ---- one run ------------------------------------------------------------------------------------------------

def model_config(name: str, seq: int, kv_comm: str | None = None):
    """The named config of any family (lightning_seqpar's model registry); a GPT's learned positions cover ``seq``."""
    cfg = resolve_config(name)
    if isinstance(cfg, GPTConfig):
        return dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq), kv_comm=kv_comm or cfg.kv_comm)
    if kv_comm is not None:
        raise ValueError(f"--kv-comm is for the GPT models (GPTConfig.kv_comm); model {name!r} is not one")
    return cfg


def _row(args, cfg, times, losses, world, **extra):
    step = sorted(times)[len(times) // 2]
    tps = args.seq / step / world
    flops_per_s = tps * cfg.flops_per_token(args.seq)  # model FLOPs per second per GPU
    peak = max_over_ranks(torch.cuda.max_memory_allocated() / 1e9, device="cuda")[0] if args.device == "cuda" else float("nan")
    row = dict(bench="train", system=args.system, algorithm=ALGORITHMS.get(args.system, args.algorithm), model=args.model, seq=args.seq,
               gpus=world, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", step_time_s=step,
               tokens_per_s_per_gpu=tps, mfu=flops_per_s / PEAK_BF16, peak_mem_gb=peak, losses=losses,
               ac=args.ac if args.system == "seqpar" else ("none" if args.ac == "none" else "full"), commit=args.commit)
    row.update({k: v for k, v in (("optimizer", args.optimizer if args.optimizer != "auto" else None), ("tag", args.tag),
                                  ("prealloc_optimizer", args.prealloc_optimizer or None),
                                  ("offload_params", args.offload_params or None)) if v is not None})
    if args.matmul_peak:
        row.update(mfu_measured_peak=flops_per_s / (args.matmul_peak * 1e12), matmul_peak_tflops=args.matmul_peak)
    return dict(row, **extra)


@torch.no_grad()
def _prealloc_optimizer(optimizer) -> None:
    """Allocate the optimizer's state now: one step on zero gradients (AdamW without weight decay leaves the parameters
    unchanged), so that step 1 peaks as every later step does (longest.py)."""
    for group in optimizer.param_groups:
        if group.get("weight_decay", 0.0) != 0.0:
            raise ValueError("--prealloc-optimizer needs weight_decay=0 (the zero-gradient step must not change parameters)")
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _trainer(args, strategy, callbacks: list, precision: str):
    """The Trainer of seqpar / tp_sp: warm-up + timed steps; a CUDA out-of-memory error ends the rank at once
    (Lightning's own handling would first tear down while the other ranks wait in a collective)."""
    class Extras(L.Callback):
        def on_exception(self, trainer, pl_module, exception):
            if is_oom(exception):
                exit_oom(trainer.strategy.global_rank, exception)

        def on_train_start(self, trainer, pl_module):
            for optimizer in trainer.optimizers if args.prealloc_optimizer else []:
                _prealloc_optimizer(optimizer)

    callbacks = [*callbacks, Extras(), *([profiler_callback(args)] if args.profile else [])]
    return trainer(strategy, steps=args.warmup + args.steps, precision=precision, callbacks=callbacks, cuda=args.device == "cuda")


def _datamodule(args, cfg):
    return LongRangeDataModule(vocab_size=cfg.vocab_size, seq_len=args.seq, batch_size=1, num_samples=(args.warmup + args.steps) * 8,
                               val_samples=1, seed=0)


def run_seqpar(args, variant: str, kv_comm: str | None):
    cfg = model_config(args.model, args.seq, kv_comm)
    cuda = args.device == "cuda"
    times, losses, info = [], [], {}

    class Resolved(L.Callback):  # what actually runs: the LASP kernel, GPT's resolved K/V communication
        def on_fit_start(self, trainer, pl_module):
            for m in pl_module.modules():
                if isinstance(m, LinearAttention):
                    m.kernel = args.lasp_kernel or m.kernel  # read at every call
                    info.update(lasp_variant=variant, lasp_kernel=resolve_kernel(m.kernel, pl_module.device))
                if isinstance(m, FusedKVAttention):
                    info.update(kv_comm=m.mode(), kv_comm_requested=kv_comm)
            if cuda:
                info["mem_start_gb"] = torch.cuda.memory_allocated() / 1e9

    strategy = SequenceParallelStrategy(sequence_parallel_size=int(os.environ["WORLD_SIZE"]), attention=args.algorithm,
                                        expected_seq_len=args.seq if args.algorithm == "auto" else None,
                                        activation_checkpointing=None if args.ac == "none" else args.ac, lasp_variant=variant,
                                        attention_backend=args.backend, head_chunks=args.head_chunks,
                                        uncheckpointed_blocks=args.uncheckpointed_blocks, compile=args.compile,
                                        offload_checkpoints=args.offload, offload_params=args.offload_params,
                                        mlp_chunk_size=args.mlp_chunk)
    precision = "bf16-mixed" if cuda else "32-true"
    fit = _trainer(args, strategy, [step_timer(times, losses, warmup=args.warmup, cuda=cuda), Resolved()], precision)
    fused = {"auto": None, "fused": True, "default": False}[args.optimizer]
    module = CausalLMModule(model=cfg, lr=3e-4, warmup_steps=2, weight_decay=0.0, loss_chunk_size=args.loss_chunk, fused_optimizer=fused)
    fit.fit(module, datamodule=_datamodule(args, cfg))
    head_dim = getattr(cfg, "head_dim", None) or cfg.n_embd // cfg.n_head
    be = resolve_backend(args.backend, torch.device(args.device), torch.bfloat16 if cuda else torch.float32, head_dim)
    dims = strategy.parallel_dims  # what "auto" chose, named as benchmarks/attention.py names it
    algorithm = f"2d:{dims.hp}x{dims.cp}" if strategy.attention == "2d" else strategy.attention
    host = {"host_peak_gb": max_over_ranks(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, device=args.device)[0]}  # pinned buffers too
    return _row(args, cfg, times, losses, dist.get_world_size(), backend=be, head_chunks=args.head_chunks, algorithm=algorithm,
                **({"auto": True} if args.algorithm == "auto" else {}), uncheckpointed_blocks=args.uncheckpointed_blocks,
                compiled=args.compile, **({"offload_checkpoints": True} if args.offload else {}),
                **(host if args.offload or args.offload_params else {}), **({"mlp_chunk_size": args.mlp_chunk} if args.mlp_chunk else {}),
                tokens_per_gpu=args.seq // dist.get_world_size(),
                loss_chunk=args.loss_chunk, precision=precision, step_times_s=times, **info)


def run_tp_sp(args, *_):
    cfg = model_config(args.model, args.seq)
    world = int(os.environ["WORLD_SIZE"])
    layout = head_layout(cfg, world)  # ValueError (before any collective) when Megatron TP cannot run the model
    backends = None
    if args.device == "cuda":
        backends = [SDPBackend.CUDNN_ATTENTION]
    times, losses = [], []
    strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world)
    # precision "32-true": bf16 compute with fp32 master weights comes from FSDP2's MixedPrecisionPolicy inside the module
    fit = _trainer(args, strategy, [step_timer(times, losses, warmup=args.warmup, cuda=args.device == "cuda")], "32-true")
    module = _tp_sp_module(cfg, lr=3e-4, activation_checkpointing=args.ac != "none", bf16=args.device == "cuda", backends=backends)
    fit.fit(module, datamodule=_datamodule(args, cfg))
    ran = dataclasses.replace(cfg, n_head=layout.n_head, n_kv_head=layout.n_kv_head, head_dim=cfg.head_dim)  # the padded heads' FLOPs
    return _row(args, cfg, times, losses, world, heads=f"{layout.n_head}/{layout.n_kv_head}", padded_heads=layout.padded,
                kv_repeat=layout.kv_repeat, padding_flops_waste=ran.flops_per_token(args.seq) / cfg.flops_per_token(args.seq) - 1,
                loss_parallel=True)


def run_torch_cp(args, *_):
    world = dist.get_world_size()
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("cp",))
    cfg = model_config(args.model, args.seq)
    with torch.device("meta"):
        model = Llama(cfg)
    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, Attention):
                setattr(mod, child_name, SDPA(repeat_kv=True))
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
    data = _datamodule(args, cfg)
    data.setup("fit")
    loader = iter(data.train_dataloader())
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        batch = {k: v.cuda() for k, v in next(loader).items()}
        ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
        torch.cuda.synchronize()
        if step == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        prof = start_profiler(args) if args.profile and step == args.warmup else None
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
            finish_profiler(args, prof, t0)
        rep = loss.detach().clone()
        dist.all_reduce(rep, op=dist.ReduceOp.AVG)
        losses.append(rep.item())
    return _row(args, cfg, times, losses, world)


# ---- offload_params' optimizer step on the host -------------------------------------------------------------

def host_adamw(argv: list[str]) -> None:
    """One rank's AdamW step over its FSDP2 shards on this host's CPU (``offload_params``, Note [Offloading
    parameters to host memory]): dim-0 shards of ``--model``'s real parameter shapes over ``--ranks`` ranks as
    DTensors on a 1-rank gloo mesh (what the strategy's optimizer sees), ``--layers`` of the blocks materialised,
    the time scaled to all blocks by parameter count (exact for a memory-bound step). ``optimizer.step()`` after
    one warm-up step, for AdamW's ``forloop`` (torch's default for DTensors), ``foreach`` and ``fused``, at 1
    thread (what torchrun gives a process) and at ``--threads``. One record (bench "offload_optimizer") each."""
    ap = runner_args(argparse.ArgumentParser(prog="train.py host-adamw", description=host_adamw.__doc__), device=False)
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--ranks", type=int, default=4, help="ranks FSDP shards over (dp_shard x sp)")
    ap.add_argument("--layers", type=int, default=4, help="blocks materialised; time scaled to all by parameter count")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--impls", default="forloop,foreach,fused")
    ap.add_argument("--device-name", default=None, help="the host, for the record (default: the GPU's name, else 'cpu')")
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    with torch.device("meta"):
        full = Llama(LlamaConfig.from_name(args.model))
    shapes, total = [], 0
    for name, p in full.named_parameters():
        shape = torch.Size(((p.shape[0] + args.ranks - 1) // args.ranks, *p.shape[1:]))
        total += shape.numel()
        if not name.startswith("layers.") or int(name.split(".")[1]) < args.layers:
            shapes.append(shape)
    here = sum(s.numel() for s in shapes)
    device = args.device_name or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    records = []
    for threads in sorted({1, args.threads}):
        for impl in args.impls.split(","):
            torch.set_num_threads(threads)
            g = torch.Generator().manual_seed(0)
            params = []
            for s in shapes:
                params.append(torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g) * 0.02, mesh, [Shard(0)])))
                params[-1].grad = distribute_tensor(torch.randn(s, generator=g) * 1e-3, mesh, [Shard(0)])
            opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **({"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}))
            opt.step()  # creates exp_avg / exp_avg_sq
            t0 = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            dt = (time.perf_counter() - t0) / args.steps * total / here
            gbps = 28 * total / dt / 1e9  # AdamW reads param, grad, 2 moments (16 B) and writes 3 (12 B)
            print(f"[train] host AdamW {args.model} /{args.ranks} ranks ({total / 1e9:.3f}e9 params per rank): "
                  f"{impl:8s} threads {threads:3d}: {dt:7.2f} s/step ({gbps:5.1f} GB/s)", flush=True)
            records.append(dict(bench="offload_optimizer", system="seqpar", algorithm=impl, model=args.model, seq=None, gpus=args.ranks,
                                device=device, threads=threads, params_per_rank=total, step_s=float(f"{dt:.3g}"), gb_per_s=float(f"{gbps:.3g}"),
                                cpu_count=os.cpu_count(), commit=args.commit))
    dist.destroy_process_group()
    if args.out:
        append_records(args.out, records)


# ---- main ---------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    mode, argv = mode_of(argv, "train")
    if mode == "host-adamw":
        return host_adamw(argv)
    ap = runner_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--system", choices=["seqpar", "torch_cp", "tp_sp"], required=True)
    ap.add_argument("--model", default="llama3-8b", help="a named config of any family (llama*, tnl-*, lss-gpt-*, tiny, ...)")
    ap.add_argument("--models", default=None, metavar="M1,M2,...", help="several models in turn in this one process (see --seqs)")
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--seqs", default=None, metavar="S[:STEPS],...", help="several lengths in turn in this one process, a record each")
    ap.add_argument("--algorithm", default="ring", help="seqpar: the attention algorithm ('auto': the cost model's, for --seq)")
    ap.add_argument("--lasp-variant", default="p2p", help="seqpar, TNL: comma list of p2p, allgather (lasp_variant), one run each")
    ap.add_argument("--lasp-kernel", default=None, choices=["auto", "torch", "fla"], help="TNL: LinearAttention.kernel (default: the model's)")
    ap.add_argument("--kv-comm", default=None, help="seqpar, GPT: comma list of input, kv, auto (GPTConfig.kv_comm), one run each")
    ap.add_argument("--ac", default="selective++", choices=["selective++", "full", "none"],
                    help="seqpar: the checkpointing policy; tp_sp: 'none' turns full checkpointing off")
    ap.add_argument("--loss-chunk", type=int, default=8192, help="seqpar: chunked cross entropy")
    ap.add_argument("--backend", default="auto", help="seqpar: the local attention kernel (auto: fa4 when installed, else flash-attention-2)")
    ap.add_argument("--compile", action="store_true", help="seqpar: torch.compile each block (strategy compile=True)")
    ap.add_argument("--uncheckpointed-blocks", type=int, default=0, help="seqpar: the last N blocks without checkpointing")
    ap.add_argument("--head-chunks", type=int, default=1, help="seqpar: attention over this many K/V head groups in turn")
    ap.add_argument("--offload", action="store_true", help="seqpar: checkpointed block inputs in pinned host memory (offload_checkpoints)")
    ap.add_argument("--mlp-chunk", type=int, default=None, help="seqpar: the MLP over slices of this many tokens (mlp_chunk_size)")
    ap.add_argument("--offload-params", action="store_true", help="seqpar, torch_cp: FSDP2 keeps parameter shards, gradients and "
                    "AdamW state in host memory, the optimizer step on the CPU (offload_params; CPUOffloadPolicy)")
    ap.add_argument("--optimizer", choices=("auto", "fused", "default"), default="auto",
                    help="AdamW: auto = CausalLMModule's choice (fused on CUDA and for --offload-params), default = torch's default")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--matmul-peak", type=float, default=None, metavar="TFLOPS", help="measured bf16 matmul peak per GPU: adds mfu_measured_peak")
    ap.add_argument("--prealloc-optimizer", action="store_true",
                    help="allocate the AdamW state before step 1 (one step on zero gradients), so an OOM shows in step 1")
    ap.add_argument("--profile", default=None, metavar="DIR", help="torch.profiler over the first timed step; rank 0 writes a summary to DIR")
    ap.add_argument("--profile-trace", action="store_true", help="with --profile: also the Chrome trace (large)")
    ap.add_argument("--tag", default=None, help="free label stored in the record")
    args = ap.parse_args(argv)
    try:
        runs = [tuple(int(y) for y in x.split(":")) for x in args.seqs.split(",")] if args.seqs else [(args.seq,)]
    except ValueError:
        ap.error(f"--seqs: expected S or S:STEPS entries, comma separated, got {args.seqs!r}")
    if any(len(r) > 2 or min(r) <= 0 for r in runs):
        ap.error(f"--seqs: expected positive S or S:STEPS entries, got {args.seqs!r}")
    models = args.models.split(",") if args.models else [args.model]
    variants = [(v, k) for v in args.lasp_variant.split(",") for k in (args.kv_comm.split(",") if args.kv_comm else [None])]
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        variants = variants[:1] if args.kv_comm else variants  # one GPU: no communication, "input" and "kv" are the same run
    runs = [(m, r[0], r[1] if len(r) == 2 else args.steps, v) for r in runs for m in models for v in variants]
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
    for args.model, args.seq, args.steps, variant in runs:
        held = held_gb(args.device == "cuda")
        try:
            row = runner(args, *variant)
        except BaseException as exc:  # noqa: BLE001 - an OOM must not hang the other ranks in teardown
            if not is_oom(exc):
                raise
            exit_oom(os.environ.get("RANK"), exc)
        if len(runs) > 1:
            row.update(in_process=[[m, seq] for m, seq, _, _ in runs], held_before_gb=held)
        if dist.get_rank() == 0:
            extra = f", mfu(measured peak) {row['mfu_measured_peak']:.3f}" if "mfu_measured_peak" in row else ""
            what = " ".join(f"{k}={row[k]}" for k in ("algorithm", "lasp_variant", "lasp_kernel", "kv_comm") if row.get(k) is not None)
            print(f"[train] {row['system']:8s} {row['model']} S={row['seq']} GPUs={row['gpus']} {what}: {row['tokens_per_s_per_gpu']:.0f} "
                  f"tokens/s/GPU, MFU {row['mfu']:.3f}{extra}, step {row['step_time_s']:.2f}s, peak {row['peak_mem_gb']:.1f} GB, "
                  f"losses {[round(x, 4) for x in row['losses']]}", flush=True)
            if args.out:
                append_records(args.out, row)
        del row
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

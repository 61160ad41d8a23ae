"""One transformer block's training step on one GPU, by how its element-wise work and its checkpoint are done.

Where a long step's time goes outside attention and the matmuls (docs/benchmarks.md, the profile of 2026-11-27, 4 x H200, aa2a2bb: ~1 s of
element-wise kernels and 0.47 s of recomputed matmuls in a 10.3 s Llama-3-8B step at 128K on 4 GPUs): one
Llama-3-8B block (the package's ``LlamaBlock``, bf16) over ``--tokens`` tokens, the tokens one rank holds under
sequence parallelism (128K / 4 = 32K), forward and backward, timed with CUDA events; its kernels' time by kind
(attention, matmul, the rest) from one profiled step; the memory the step adds to what is allocated before it.

    python benchmarks/block.py --tokens 32768 --out $OUT/block.json [--variants eager/none,eager/selective++]

A variant is ``impl/checkpoint``: impl "eager" (the torch ops: SEQPAR_FUSED_KERNELS=0), "fused" (its fused element-wise
kernels, Note [Fused element-wise kernels]; needs liger-kernel), "compile" (``torch.compile`` of the block, as ``compile=True``);
checkpoint "none", "selective++" (the package's default for a checkpointed block, Note [Selective Checkpoint++]),
"selective++mm" (the same keeping the matmuls' outputs too), "selective++nonorm" (without Note [Checkpointed
norms]' nested checkpoints), "full", "selective++offload" (the block's input to pinned host memory, Note [Offloading
checkpoints to host memory]). "compile" compiles what ``apply_compile`` compiles (the block with its checkpoint, or
inside an offloading one: Note [Checkpoints under torch.compile]); ``first_step_s`` in a record is the first step's
wall time, the compile included.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from functools import partial

import torch

VARIANTS = ("eager/none", "eager/selective++", "eager/selective++nonorm", "eager/selective++mm", "eager/full",
            "fused/none", "fused/selective++", "fused/selective++mm", "fused/full", "compile/none", "compile/selective++",
            "compile/full", "fused/selective++offload", "compile/selective++offload")


def _kind(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("flash", "fmha", "attn", "cudnn")):
        return "attention"
    if any(s in n for s in ("nvjet", "gemm", "xmma", "cutlass")):
        return "matmul"
    return "other"


def _block(variant: str, config, device):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    from lightning_seqpar.models.llama import LlamaBlock
    from lightning_seqpar.parallel.activation_checkpointing import (
        SAVE_OPS,
        HostOffload,
        _checkpoint,
        _selective_context,
        checkpoint_block,
        compile_target,
    )

    impl, ckpt = variant.split("/")
    os.environ["SEQPAR_FUSED_KERNELS"] = "1" if impl == "fused" else "0"  # Note [Fused element-wise kernels]
    torch.manual_seed(0)
    block = LlamaBlock(config).to(device=device, dtype=torch.bfloat16)
    if ckpt in ("selective++", "full"):
        block = checkpoint_block(block, ckpt)
    elif ckpt == "selective++offload":
        block = checkpoint_block(block, "selective++", offload=HostOffload())
    elif ckpt == "selective++mm":
        block = checkpoint_block(block, "selective++", save_ops=(*SAVE_OPS, torch.ops.aten.mm.default))
    elif ckpt == "selective++nonorm":
        block = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=_checkpoint,
                                   context_fn=partial(_selective_context, tuple(SAVE_OPS)))
    if impl == "compile":
        compile_target(block).compile()
    return block


def measure(variant: str, tokens: int, steps: int, model: str) -> dict:
    from lightning_seqpar.models.llama import LlamaConfig, rope_freqs_cis

    device = torch.device("cuda")
    config = LlamaConfig.from_name(model)
    block = _block(variant, config, device)
    x = torch.randn(1, tokens, config.n_embd, device=device, dtype=torch.bfloat16, requires_grad=True)
    freqs = rope_freqs_cis(torch.arange(tokens, device=device)[None], head_dim=config.head_dim, theta=config.rope_theta)
    dy = torch.randn_like(x)

    def step():
        y = block(x, freqs)
        y.backward(dy)

    t0 = time.perf_counter()
    step()  # compiles, for "compile"
    torch.cuda.synchronize()
    first_step_s = time.perf_counter() - t0
    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() - base
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    top: dict[str, float] = {}
    for e in prof.key_averages():
        t = e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
        if e.device_type == torch.autograd.DeviceType.CUDA and t > 0:
            by_kind[_kind(e.key)] += t
            top[e.key[:90]] = t
    return {"variant": variant, "tokens": tokens, "model": model, "ms": statistics.median(times), "times_ms": times,
            "added_gb": peak / 1e9, "first_step_s": first_step_s, "kernels_ms": by_kind,
            "top_kernels_ms": dict(sorted(top.items(), key=lambda kv: -kv[1])[:12])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    records = []
    for variant in args.variants.split(","):
        try:
            r = measure(variant, args.tokens, args.steps, args.model)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a row that says why
            r = {"variant": variant, "tokens": args.tokens, "error": f"{type(e).__name__}: {e}"[:500]}
            torch.cuda.empty_cache()
        records.append(r)
        torch.cuda.empty_cache()
        print(json.dumps({k: v for k, v in r.items() if k not in ("times_ms", "top_kernels_ms")}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

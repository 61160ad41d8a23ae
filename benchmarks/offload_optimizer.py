"""The CPU AdamW step of ``offload_params``: implementations and thread counts, on this host's CPU.

With ``offload_params=True`` (Note [Offloading parameters to host memory] in
lightning_seqpar/parallelize.py) every rank runs AdamW on the CPU over its FSDP2 shards: one rank's
shards of ``--model`` over ``--ranks`` ranks (dim-0 shards of the real parameter shapes, built on the
meta device; ``--layers`` of the blocks, the embedding and head whole, the time scaled to all blocks
by parameter count, which is exact for a memory-bound step). The shards are DTensors on a 1-rank
gloo mesh, as the strategy's optimizer sees them. Timed: ``optimizer.step()`` after one warm-up step
(which creates the state), for AdamW's three implementations (``forloop`` = torch's default for DTensor
parameters, ``foreach``, ``fused``) at 1 thread (what ``torchrun`` gives each process: OMP_NUM_THREADS=1)
and at ``--threads`` (this host's cores / GPUs per host).

    python benchmarks/offload_optimizer.py --model llama-7b --ranks 4 --threads 16 --out $OUT/offload_optimizer.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_seqpar.models import Llama, LlamaConfig


def shard_shapes(model: str, ranks: int, layers: int) -> tuple[list[torch.Size], int]:
    """One rank's dim-0 shard shapes (``layers`` blocks, the rest whole) and the full model's per-rank parameter count."""
    cfg = LlamaConfig.from_name(model)
    with torch.device("meta"):
        full = Llama(cfg)
    def local(p: torch.Tensor) -> torch.Size:
        return torch.Size(((p.shape[0] + ranks - 1) // ranks, *p.shape[1:]))
    shapes, total = [], 0
    for name, p in full.named_parameters():
        n = local(p).numel()
        total += n
        block = name.split(".")[1] if name.startswith("layers.") else None
        if block is None or int(block) < layers:
            shapes.append(local(p))
    return shapes, total


def time_step(shapes: list[torch.Size], impl: str, threads: int, steps: int, mesh) -> float:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(distribute_tensor(torch.randn(s, generator=g) * 0.02, mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.randn(s, generator=g) * 1e-3, mesh, [Shard(0)])
        params.append(p)
    kw = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **kw)
    opt.step()  # creates exp_avg / exp_avg_sq
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter() - t0) / steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--ranks", type=int, default=4, help="ranks FSDP shards over (dp_shard x sp)")
    ap.add_argument("--layers", type=int, default=4, help="blocks materialised; time scaled to all by parameter count")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--impls", default="forloop,foreach,fused")
    ap.add_argument("--device-name", default=None, help="the host, for the record (default: the GPU's name, else 'cpu')")
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29611")
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    shapes, total = shard_shapes(args.model, args.ranks, args.layers)
    here = sum(s.numel() for s in shapes)
    device = args.device_name or (torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    records = []
    for threads in sorted({1, args.threads}):
        for impl in args.impls.split(","):
            dt = time_step(shapes, impl, threads, args.steps, mesh) * total / here
            gbps = 28 * total / dt / 1e9  # AdamW reads param, grad, 2 moments (16 B) and writes 3 (12 B)
            print(f"[offload_optimizer] {args.model} /{args.ranks} ranks ({total / 1e9:.3f}e9 params per rank): "
                  f"{impl:8s} threads {threads:3d}: {dt:7.2f} s/step ({gbps:5.1f} GB/s)", flush=True)
            records.append(dict(bench="offload_optimizer", system="seqpar", algorithm=impl, model=args.model, seq=None,
                                gpus=args.ranks, device=device, threads=threads, params_per_rank=total,
                                step_s=round(dt, 3), gb_per_s=round(gbps, 2), cpu_count=os.cpu_count(), commit=args.commit))
    dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()

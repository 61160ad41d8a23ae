"""LASP's two state exchanges at the op level: "p2p" (the state hops rank to rank, LASP Alg. 2-3)
against "allgather" (one all-gather of the W local states), forward + backward of the distributed
linear attention that TransNormer's token mixer calls, at TNL-1B's head shapes.

    torchrun --standalone --nproc_per_node=4 benchmarks/lasp.py --local-seqs 8192,32768,262144 --out lasp.json
    torchrun --standalone --nproc_per_node=2 benchmarks/lasp.py --device cpu --local-seqs 512 --heads 2   (smoke, gloo)

Each rank holds C tokens (``--local-seqs``: tokens per GPU; global length W x C) of bf16
q, k = silu(randn) [1, C, H, Dk] and v [1, C, H, Dv], TNL's decay of layer 1; one measurement is
``lasp_attention(...)`` forward + ``backward`` (``time_ms``) or forward alone under no_grad
(``fwd_ms``), CUDA events, median of ``--iters`` after ``--warmup``, the slowest rank's time.
"local" is the same kernel on the C local tokens with no exchange at all: what LASP costs beyond
it is the state exchange and the inter-chunk term. ``--kernel auto`` is fla-core's kernel on CUDA
when installed (Note [fla-core kernel] in lightning_seqpar/attention/lasp.py).

One record per (length, algorithm) appended to the JSON list in ``--out``: bench "lasp_op",
system "seqpar", algorithm "lasp-p2p" / "lasp-allgather" / "local", model, seq (global),
tokens_per_gpu, gpus, device, kernel, time_ms, fwd_ms, peak_mem_gb (max over ranks of
torch.cuda.max_memory_allocated during the timed calls, inputs and gradients included), commit.
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from collect import append_records  # benchmarks/ is on sys.path when this file runs as a script
from attention import timed  # benchmarks/ is on sys.path when this file runs as a script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local-seqs", default="8192,32768,262144", help="comma list of tokens per GPU")
    ap.add_argument("--heads", type=int, default=16, help="TNL-1B: 16")
    ap.add_argument("--dk", type=int, default=128, help="TNL-1B: 128 (256 on the LRPE layer 0)")
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--layer", type=int, default=1, help="the decay of this TNL layer (of 16)")
    ap.add_argument("--algorithms", default="local,lasp-p2p,lasp-allgather")
    ap.add_argument("--kernel", default="auto", choices=["auto", "torch", "fla"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the same code on gloo (a smoke test)")
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_seqpar.attention.lasp import _resolve_kernel, lasp_attention, linear_attention
    from lightning_seqpar.models.transnormer import tnl_decay_log

    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), device_id=device)
        name = torch.cuda.get_device_name()
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
        name = "cpu"
    W, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh(device.type, (W,), mesh_dim_names=("sp",))
    kernel = _resolve_kernel(args.kernel, device)
    H, Dk, Dv = args.heads, args.dk, args.dv
    decay = tnl_decay_log(H, args.layer, 16, device=device)
    rows = []
    for C in (int(s) for s in args.local_seqs.split(",")):
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        q, k = (F.silu(torch.randn(1, C, H, Dk, device=device, generator=gen)).to(torch.bfloat16).requires_grad_() for _ in range(2))
        v = torch.randn(1, C, H, Dv, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
        do = torch.randn(1, C, H, Dv, device=device, generator=gen).to(torch.bfloat16)
        for algorithm in args.algorithms.split(","):
            if algorithm == "local":
                def call():
                    return linear_attention(q, k, v, decay, kernel=kernel)
            else:
                variant = algorithm.removeprefix("lasp-")

                def call(variant=variant):
                    return lasp_attention(q, k, v, decay, mesh=mesh, variant=variant, kernel=kernel)

            def step(call=call):
                call().backward(do)
                q.grad = k.grad = v.grad = None

            def forward(call=call):
                with torch.no_grad():
                    call()

            try:
                t, peak = timed(step, args.iters, args.warmup, device)
                t_fwd, _ = timed(forward, args.iters, args.warmup, device)
                err = None
            except Exception as e:  # noqa: BLE001 - recorded, and the next shape still runs
                t = t_fwd = peak = float("nan")
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            row = dict(bench="lasp_op", system="seqpar", algorithm=algorithm, model=f"TNL H{H} Dk{Dk} Dv{Dv} layer{args.layer}",
                       seq=C * W, tokens_per_gpu=C, batch=1, gpus=W, device=name, kernel=kernel, time_ms=t * 1e3, fwd_ms=t_fwd * 1e3,
                       peak_mem_gb=peak if device.type == "cuda" else None, commit=args.commit, error=err)
            rows.append(row)
            if rank == 0:
                print(f"[lasp] C={C:>8}/GPU W={W} {algorithm:15s} kernel={kernel}: fwd+bwd {t * 1e3:9.2f} ms, fwd {t_fwd * 1e3:9.2f} ms, "
                      f"peak {peak:6.1f} GB" + (f"  [{err}]" if err else ""), flush=True)
        del q, k, v, do
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0 and args.out:
        append_records(args.out, rows)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    t0 = time.time()
    main()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[lasp] done in {time.time() - t0:.0f}s", flush=True)

"""Distributed attention benchmark: our algorithms next to torch's native context parallel.

    torchrun --nproc_per_node=4 benchmarks/attention.py --seqs 131072,524288 --heads 32/8 \
        --systems seqpar:ring,torch_cp:allgather,torch_cp:alltoall --out results.json

Each rank holds S / W tokens of random q, k, v (bf16, [B, S/W, H, D]); one measurement is a full
forward + backward of causal attention, timed with CUDA events (median of --iters after
--warmup). TFLOP/s per GPU uses the causal count 3.5 * 2 * B * H * S^2 * D / W. Peak memory is
torch.cuda.max_memory_allocated() over the timed steps, inputs and gradients included.

torch_cp runs ``F.scaled_dot_product_attention`` (cuDNN kernel, the same one our ring uses)
inside ``torch.distributed.tensor.experimental.context_parallel`` with its round-robin load
balancer and the named rotate method; its inputs are the local shards ([B, H, S/W, D]).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lightning_seqpar.attention import sequence_parallel_attention


def timed(step, iters: int, warmup: int) -> tuple[float, float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    t = torch.tensor(sorted(times)[len(times) // 2], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    peak = torch.tensor(torch.cuda.max_memory_allocated() / 1e9, device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return t.item(), peak.item()


def seqpar_step(mesh, algorithm, q, k, v, do, inner=None):
    def step():
        out = sequence_parallel_attention(q, k, v, mesh=mesh, algorithm=algorithm, causal=True, layout="zigzag",
                                          backend="cudnn", inner_ring_size=inner)
        out.backward(do)
        q.grad = k.grad = v.grad = None
    return step


def torch_cp_step(mesh, rotate, q, k, v, do):
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()
    gqa = qt.shape[1] != kt.shape[1]
    mode = {"gqa": gqa}

    # context_parallel needs one buffer to learn the global length; the inputs are already local shards
    positions = torch.arange(qt.shape[2] * mesh.size(), device=qt.device)[None]

    def step():
        with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[1]), torch.nn.attention.sdpa_kernel(
            torch.nn.attention.SDPBackend.CUDNN_ATTENTION
        ):
            if mode["gqa"]:
                try:
                    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
                except Exception as e:  # noqa: BLE001 - CP without native GQA: repeat K/V as torchtitan does
                    print(f"torch_cp: enable_gqa failed ({type(e).__name__}); repeating K/V heads", flush=True)
                    mode["gqa"] = False
            if not mode["gqa"]:
                g = qt.shape[1] // kt.shape[1]
                out = F.scaled_dot_product_attention(qt, kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1), is_causal=True)
            out.backward(dot)
        qt.grad = kt.grad = vt.grad = None
    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="131072,524288")
    ap.add_argument("--heads", default="32/8", help="comma list of H_q/H_kv")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--systems", default="seqpar:ring,torch_cp:allgather,torch_cp:alltoall")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), device_id=torch.device("cuda", local_rank))
    W = dist.get_world_size()
    mesh = init_device_mesh("cuda", (W,), mesh_dim_names=("cp",))
    rows = []
    device = torch.cuda.get_device_name()
    for S in (int(s) for s in args.seqs.split(",")):
        for hh in args.heads.split(","):
            hq, hkv = (int(x) for x in hh.split("/"))
            B, D, Sl = args.batch, args.head_dim, S // W
            g = torch.Generator(device="cuda").manual_seed(1234 + dist.get_rank())
            mk = lambda h: torch.randn(B, Sl, h, D, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
            q, k, v, do = mk(hq).requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_(), mk(hq)
            flops = 3.5 * 2 * B * hq * S * S * D / W
            for system in args.systems.split(","):
                name, _, variant = system.partition(":")
                inner = None
                if name == "seqpar" and "@" in variant:
                    variant, inner_s = variant.split("@")
                    inner = int(inner_s)
                step = (seqpar_step(mesh, variant, q, k, v, do, inner) if name == "seqpar" else torch_cp_step(mesh, variant, q, k, v, do))
                try:
                    t, peak = timed(step, args.iters, args.warmup)
                    err = None
                except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is recorded as such
                    t, peak, err = float("nan"), float("nan"), f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    torch.cuda.empty_cache()
                row = dict(bench="attention", system=name, algorithm=variant + (f"@{inner}" if inner else ""), model=f"H{hq}/{hkv}xD{D}",
                           seq=S, batch=B, gpus=W, device=device, tflops_per_gpu=flops / t / 1e12, time_s=t, peak_mem_gb=peak,
                           commit=args.commit, error=err)
                rows.append(row)
                if dist.get_rank() == 0:
                    print(f"S={S:>8} H={hq}/{hkv} {system:22s} {row['tflops_per_gpu']:7.1f} TFLOP/s/GPU  {t * 1e3:9.1f} ms  peak {peak:6.1f} GB"
                          + (f"  [{err}]" if err else ""), flush=True)
            del q, k, v, do
            torch.cuda.empty_cache()
    if dist.get_rank() == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    t0 = time.time()
    with contextlib.suppress(KeyboardInterrupt):
        main()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"done in {time.time() - t0:.0f}s")

"""Local attention kernels on one GPU: correctness of every backend against fp32 math, and
fwd+bwd TFLOP/s of our block ops next to torch SDPA (the same kernels called the usual way).

    python benchmarks/local_attention.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from lightning_seqpar.attention.local import available_backends, block_backward, block_forward


def bench(fn, iters=10, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def check(backend: str, hq: int, hkv: int, causal: bool) -> float:
    g = torch.Generator(device="cuda").manual_seed(0)
    B, S, D = 2, 384, 64
    q = torch.randn(B, S, hq, D, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(B, S, hkv, D, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(B, S, hkv, D, device="cuda", generator=g, dtype=torch.bfloat16)
    do = torch.randn(B, S, hq, D, device="cuda", generator=g, dtype=torch.bfloat16)
    scale = D**-0.5
    o, lse = block_forward(q, k, v, causal=causal, scale=scale, backend=backend)
    grads = block_backward(do, q, k, v, o, lse, causal=causal, scale=scale, backend=backend)
    ro, rl = block_forward(q.float(), k.float(), v.float(), causal=causal, scale=scale, backend="math")
    rg = block_backward(do.float(), q.float(), k.float(), v.float(), ro, rl, causal=causal, scale=scale, backend="math")
    errs = [(a.float() - b).norm() / b.norm() for a, b in zip((o, lse, *grads), (ro, rl, *rg))]
    return max(e.item() for e in errs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seqs", default="8192,32768")
    args = ap.parse_args()
    rows = []
    dev = torch.device("cuda")
    print("backends:", available_backends(dev, torch.bfloat16), torch.cuda.get_device_name())
    # native GQA in the cuDNN op?
    try:
        q = torch.randn(1, 32, 256, 128, device=dev, dtype=torch.bfloat16)
        kv = torch.randn(1, 8, 256, 128, device=dev, dtype=torch.bfloat16)
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kv, kv, None, True, 0.0, True, False)
        print("cudnn native GQA: yes; lse shape", tuple(r[1].shape), "out strides", r[0].stride())
    except Exception as e:  # noqa: BLE001
        print("cudnn native GQA: no:", str(e).splitlines()[0][:200])
    for be in [b for b in available_backends(dev, torch.bfloat16) if b != "math"]:
        for hq, hkv in ((4, 4), (8, 2), (4, 1), (3, 3)):
            for causal in (True, False):
                err = check(be, hq, hkv, causal)
                ok = err < 2e-2
                rows.append(dict(bench="local_check", backend=be, hq=hq, hkv=hkv, causal=causal, rel_err=err, ok=ok))
                print(f"check {be:9s} hq={hq} hkv={hkv} causal={causal}: rel err {err:.2e} {'OK' if ok else 'FAIL'}")
    H, D = 32, 128
    for S in [int(s) for s in args.seqs.split(",")]:
        for hkv in (32, 8):
            q = torch.randn(1, S, H, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, S, hkv, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn(1, S, hkv, D, device=dev, dtype=torch.bfloat16)
            do = torch.randn_like(q)
            # causal fwd+bwd: fwd = 4 B H S^2 D / 2 (mask), bwd = 2.5 x fwd  ->  3.5 * 2 * B * H * S^2 * D
            flops = 3.5 * 2 * H * S * S * D
            for be in [b for b in available_backends(dev, torch.bfloat16) if b != "math"]:
                def ours():
                    o, l = block_forward(q, k, v, causal=True, scale=D**-0.5, backend=be)
                    block_backward(do, q, k, v, o, l, causal=True, scale=D**-0.5, backend=be)
                t = bench(ours)
                rows.append(dict(bench="local", system="seqpar", backend=be, seq=S, hq=H, hkv=hkv, time_s=t, tflops=flops / t / 1e12,
                                 device=torch.cuda.get_device_name()))
                print(f"S={S} hkv={hkv} {be:9s} ours  {flops / t / 1e12:6.1f} TFLOP/s")
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            for name, sdpb in (("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION), ("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
                def ref():
                    with torch.nn.attention.sdpa_kernel(sdpb):
                        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=hkv != H)
                    o.backward(do.transpose(1, 2))
                try:
                    t = bench(ref)
                except Exception as e:  # noqa: BLE001
                    print(f"S={S} hkv={hkv} sdpa {name} failed: {str(e).splitlines()[0][:120]}")
                    continue
                rows.append(dict(bench="local", system="torch_sdpa", backend=name, seq=S, hq=H, hkv=hkv, time_s=t, tflops=flops / t / 1e12,
                                 device=torch.cuda.get_device_name()))
                print(f"S={S} hkv={hkv} {name:9s} sdpa  {flops / t / 1e12:6.1f} TFLOP/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.1f}s")

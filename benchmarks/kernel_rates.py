"""One GPU: forward + backward rate of the local attention kernel on the block shapes that the
distributed algorithms call, for the cost model (Note [Choosing the attention algorithm]).

Ulysses runs ONE causal call over the whole sequence with H/W heads; the ring (zigzag) runs one
causal call over its shard and W-1 non-causal half blocks. Whether a kernel's rate depends on
that (causal vs not, sequence length, heads per call) decides which of the two is faster when the
communication hides. FLOPs: non-causal forward 4 Sq Sk H D, causal forward 2 S^2 H D, backward
2.5x forward (the benchmark's 3.5 x count).

    python benchmarks/kernel_rates.py --backend cudnn --out kernel_rates.json
    python benchmarks/kernel_rates.py --backend fa4 --head-dim 64 --heads 8/2 --labels "one GPU 128K"
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_seqpar.attention.local import block_backward, block_forward

K = 1024
# (label, Sq, Sk, Hq, Hkv, causal)
SHAPES = [
    ("one GPU 32K", 32 * K, 32 * K, 32, 8, True),
    ("one GPU 128K", 128 * K, 128 * K, 32, 8, True),
    ("ring W4 128K: causal shard", 32 * K, 32 * K, 32, 8, True),
    ("ring W4 128K: half block", 16 * K, 32 * K, 32, 8, False),
    ("ulysses W4 128K", 128 * K, 128 * K, 8, 2, True),
    ("ring W4 512K: causal shard", 128 * K, 128 * K, 32, 8, True),
    ("ring W4 512K: half block", 64 * K, 128 * K, 32, 8, False),
    ("ulysses W4 512K", 512 * K, 512 * K, 8, 2, True),
    ("ring W4 1M: causal shard", 256 * K, 256 * K, 32, 8, True),
    ("ring W4 1M: half block q", 128 * K, 256 * K, 32, 8, False),
    ("ring W4 1M: half block k", 256 * K, 128 * K, 32, 8, False),
    ("ulysses W2 1M", 1024 * K, 1024 * K, 16, 4, True),
    ("ulysses W4 1M", 1024 * K, 1024 * K, 8, 2, True),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cudnn")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--head-dim", type=int, default=128, help="64: the Llama-3.2-1B shape")
    ap.add_argument("--labels", default=None, help="comma-separated labels of SHAPES to run (default: all)")
    ap.add_argument("--heads", default=None, help="Hq/Hkv instead of each shape's, e.g. 8/2 (one of four head chunks of 32/8)")
    args = ap.parse_args()
    D, rows = args.head_dim, []
    only = None if args.labels is None else set(args.labels.split(","))
    for label, sq, sk, hq, hkv, causal in SHAPES:
        if only is not None and label not in only:
            continue
        if args.heads:
            hq, hkv = (int(h) for h in args.heads.split("/"))
        q = torch.randn(1, sq, hq, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, sk, hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        fwd = (2.0 if causal else 4.0) * sq * sk * hq * D
        times = []
        for i in range(args.iters + 1):  # the first is the warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            o, lse = block_forward(q, k, v, causal=causal, scale=D**-0.5, backend=args.backend)
            block_backward(do, q, k, v, o, lse, causal=causal, scale=D**-0.5, backend=args.backend)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        t = min(times)
        row = dict(bench="kernel_rate", backend=args.backend, label=label, sq=sq, sk=sk, hq=hq, hkv=hkv, head_dim=D, causal=causal,
                   time_s=t, tflops=3.5 * fwd / t / 1e12, device=torch.cuda.get_device_name(), commit=args.commit)
        rows.append(row)
        print(f"{label:28s} Sq={sq:8d} Sk={sk:8d} H={hq}/{hkv} causal={causal!s:5s} {row['tflops']:6.1f} TFLOP/s  {t * 1e3:9.1f} ms", flush=True)
        del q, k, v, do, o, lse
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

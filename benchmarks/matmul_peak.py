"""The measured dense bf16 matmul peak of one GPU: the denominator of ``mfu_measured_peak``.

    python benchmarks/matmul_peak.py --out matmul.json        # prints and appends {"bench": "matmul", ...}

``torch.mm`` of two n x n bf16 matrices (n in --sizes, default 4096, 8192, 16384), each timed alone
with CUDA events after --warmup calls; TFLOP/s = 2 n^3 / median time. The record's ``tflops`` is the
best size's median (per-size medians under ``by_size``). MFU against the datasheet (989 TFLOP/s
dense bf16 for H100/H200 SXM) is what the papers report; against this measured peak it says how
much of what the GPU really sustains on a plain GEMM the training step reaches.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from collect import append_records  # benchmarks/ is on sys.path when this file runs as a script


def measure(n: int, *, iters: int, warmup: int, device: torch.device) -> float:
    """Median TFLOP/s of ``torch.mm`` on n x n bf16 matrices."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(warmup):
        torch.mm(a, b, out=out)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b, out=out)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n**3 / statistics.median(times) / 1e12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,8192,16384", help="comma-separated n")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--device", type=int, default=0, help="CUDA device index")
    ap.add_argument("--out", default=None, help="append the record to this JSON list")
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("matmul_peak.py measures a CUDA GPU; none is available")
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    by_size = {n: measure(n, iters=args.iters, warmup=args.warmup, device=device) for n in map(int, args.sizes.split(","))}
    best = max(by_size, key=by_size.get)
    row = dict(bench="matmul", system="torch.mm", algorithm="bf16", device=torch.cuda.get_device_name(device), gpus=1,
               n=best, tflops=by_size[best], by_size={str(n): t for n, t in by_size.items()}, iters=args.iters,
               torch=torch.__version__, commit=args.commit)
    print(f"[matmul] {row['device']}: bf16 torch.mm peak {row['tflops']:.1f} TFLOP/s (n={best}; "
          + ", ".join(f"{n}: {t:.1f}" for n, t in by_size.items()) + ")", flush=True)
    if args.out:
        append_records(args.out, row)


if __name__ == "__main__":
    main()

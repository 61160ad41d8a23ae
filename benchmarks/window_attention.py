"""Sliding-window / soft-capped / sink attention on one GPU: kernel accuracy in bf16 against fp32,
and the cost of a window against full causal attention (issue #21: a 4K window at S = 128K should
cost at most 1.2x the window's share of the causal FLOPs).

    PYTHONPATH=$PWD python benchmarks/window_attention.py --out benchmarks/results/$(date +%Y%m%d)-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '-' | tr A-Z a-z)-window.json

Timed (fwd + bwd, median of --iters, the package's block ops as the algorithms call them):
    causal     full causal attention, the "auto" dense kernel (flash-attn 4 when installed, else flash-attention-2)
    window     window w, the "auto" path: flash-attn 4's sliding window when installed, else torch's
               flash-attention-2 sliding-window kernel
    window_softcap  window w + softcap 50, the "auto" path (flash-attn 4 when installed, else FlexAttention)
    flex       window w through FlexAttention (BlockMask from 128-row tiles, forward recomputed in
               backward: Note [FlexAttention backward with the merged lse])
    flex_raw   window w, FlexAttention's own autograd (no recompute): what the kernel itself costs
    softcap    window w + softcap 50 (Gemma 2), FlexAttention
FLOP share of a window w over S tokens: (S w - w (w - 1) / 2) / (S (S + 1) / 2).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from lightning_seqpar.attention.local import available_backends, block_backward, block_forward, resolve_backend
from lightning_seqpar.attention.masked import (
    _flex,
    _flex_block_mask,
    _flex_call,
    flex_backward,
    flex_forward,
    variant_block_backward,
    variant_block_forward,
)
from lightning_seqpar.attention.variants import Mask, Variant


def bench(fn, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def whole_mask(S: int, variant: Variant, dev) -> Mask:
    pos = torch.arange(S, device=dev)[None]
    return Mask(pos, pos, None, None, variant, False, 0)


def accuracy(rows: list, dev) -> None:
    """bf16 kernels vs the fp32 pure-torch kernel on the same inputs (relative L2 errors)."""
    for D in (64, 128, 256):
        for name, variant in (("window", Variant(True, 256)), ("window+softcap", Variant(True, 256, 0, 30.0)),
                              ("chunk", Variant(True, 0, 384)), ("softcap", Variant(True, 0, 0, 30.0))):
            g = torch.Generator(device=dev).manual_seed(D)
            B, S, HQ, HKV = 1, 2048, 8, 2
            q, k, v, do = (torch.randn(B, S, h, D, device=dev, generator=g, dtype=torch.bfloat16) for h in (HQ, HKV, HKV, HQ))
            mask = whole_mask(S, variant, dev)
            be = resolve_backend("auto", dev, torch.bfloat16, D)
            o, l = variant_block_forward(q, k, v, mask, scale=D**-0.5, backend=be)
            grads = variant_block_backward(do, q, k, v, o, l, mask, scale=D**-0.5, backend=be)
            f = [t.float() for t in (q, k, v, do)]
            ro, rl = variant_block_forward(*f[:3], mask, scale=D**-0.5, backend="math")
            rg = variant_block_backward(f[3], *f[:3], ro, rl, mask, scale=D**-0.5, backend="math")
            errs = {n: ((a.float() - b).norm() / b.norm()).item() for n, a, b in zip(("out", "lse", "dq", "dk", "dv"), (o, l, *grads), (ro, rl, *rg))}
            ok = max(errs.values()) < 1.5e-2
            rows.append(dict(bench="window_check", variant=name, head_dim=D, **errs, ok=ok, device=torch.cuda.get_device_name()))
            print(f"check D={D} {name:15s} " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()) + ("" if ok else "  FAIL"))


def timing(rows: list, dev, S: int, window: int, heads: int, kv_heads: int, D: int, iters: int) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v, do = (torch.randn(1, S, h, D, device=dev, generator=g, dtype=torch.bfloat16) for h in (heads, kv_heads, kv_heads, heads))
    scale = D**-0.5
    be = resolve_backend("auto", dev, torch.bfloat16, D)
    causal_flops = 4 * heads * D * S * (S + 1) / 2 * 3.5  # forward 4 H D S^2 / 2; backward 2.5x forward
    share = (S * window - window * (window - 1) / 2) / (S * (S + 1) / 2)
    win = Variant(True, window)
    mask = whole_mask(S, win, dev)
    cap_mask = whole_mask(S, Variant(True, window, 0, 50.0), dev)
    bm = _flex_block_mask(mask)
    bm_cap = _flex_block_mask(cap_mask)

    def dense():
        o, l = block_forward(q, k, v, causal=True, scale=scale, backend=be)
        block_backward(do, q, k, v, o, l, causal=True, scale=scale, backend=be)

    def windowed():
        o, l = variant_block_forward(q, k, v, mask, scale=scale, backend=be)
        variant_block_backward(do, q, k, v, o, l, mask, scale=scale, backend=be)

    def windowed_cap():
        o, l = variant_block_forward(q, k, v, cap_mask, scale=scale, backend=be)
        variant_block_backward(do, q, k, v, o, l, cap_mask, scale=scale, backend=be)

    def flex(m, b):
        def run():
            o, l = flex_forward(q, k, v, m, scale, b)
            flex_backward(do, q, k, v, o, l, m, scale, b)
        return run

    def flex_raw():
        qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
        o, _ = _flex_call(qr, kr, vr, mask, scale, bm)
        torch.autograd.grad(o, (qr, kr, vr), do)

    runs = {"causal": dense, "window": windowed, "window_softcap": windowed_cap, "flex": flex(mask, bm), "flex_raw": flex_raw,
            "softcap": flex(cap_mask, bm_cap)}
    t_causal = None
    for name, fn in runs.items():
        try:
            t = bench(fn, iters)
        except Exception as e:  # noqa: BLE001 - report the kernel that cannot run, measure the others
            print(f"time {name}: failed: {type(e).__name__}: {str(e)[:200]}")
            rows.append(dict(bench="window_time", kernel=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            continue
        t_causal = t if name == "causal" else t_causal
        ratio = None if t_causal is None else t / t_causal
        flops = causal_flops * (1.0 if name == "causal" else share)
        row = dict(bench="window_time", kernel=name, seq_len=S, window=window, heads=heads, kv_heads=kv_heads, head_dim=D,
                   dense_backend=be, seconds=t, tflops=flops / t / 1e12, ratio_to_causal=ratio, flop_share=share,
                   goal_ratio=1.2 * share, meets_goal=None if ratio is None or name == "causal" else ratio <= 1.2 * share,
                   device=torch.cuda.get_device_name(), torch=torch.__version__)
        rows.append(row)
        print(f"time {name:9s} S={S} w={window} D={D}: {t * 1e3:9.2f} ms  {row['tflops']:6.1f} TFLOP/s"
              + ("" if ratio is None else f"  ratio {ratio:.4f} (window share {share:.4f}, goal <= {1.2 * share:.4f})"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dims", default="128,256")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--skip-check", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    _flex()  # import + compile wrapper
    import torch._dynamo.config as cfg

    setattr(cfg, "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit", 256)
    print("backends:", available_backends(dev, torch.bfloat16), torch.cuda.get_device_name(), torch.__version__)
    rows: list = []
    t0 = time.time()
    if not args.skip_check:
        accuracy(rows, dev)
    for D in (int(x) for x in args.head_dims.split(",")):
        timing(rows, dev, args.seq, args.window, args.heads, args.kv_heads, D, args.iters)
    print(f"total {time.time() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

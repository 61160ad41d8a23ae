"""Where a training step's time goes: a torch.profiler trace summarised by kernel category.

Used by ``benchmarks/train.py --profile DIR`` (one step after the warm-up is profiled on every
rank; rank 0 writes ``DIR/profile_<system>.json`` with this summary, ``DIR/profile_<system>.txt``
with the top kernels, and, with ``--profile-trace``, the Chrome trace). Also runs on a saved
summary: ``python benchmarks/profile_summary.py DIR/profile_seqpar.json``.

Categories (first match wins, on the kernel name, case-insensitive; see CATEGORIES):

    attention   flash-attention / cuDNN SDPA / FA4 kernels (and, on CPU, the seqpar attention ops)
    gemm        matmul kernels (cuBLAS / CUTLASS / nvjet), and aten mm / addmm / bmm on CPU
    comm        NCCL kernels (gloo / c10d ops on CPU): time on the GPU, overlapped or not
    copy        memcpy / memset / cat / copy kernels
    other       everything else: norms, rotary, activations, casts, optimizer, loss, merges

``compute_s`` sums every category but comm (kernels of the compute stream run one after
another, so this is the compute stream's busy time); ``exposed_s`` = step time - compute_s is
time the GPU computed nothing: exposed communication, host overhead and synchronisation.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("comm", r"nccl|gloo|c10d|all_reduce|allreduce|all_gather|reduce_scatter|alltoall|all_to_all|send|recv"),
    ("attention", r"flash|fmha|sdpa|cudnn|attn|attention|fwd_combine|_flash_attn"),
    ("gemm", r"gemm|nvjet|xmma|cublas|sm90_|sm100_|cutlass|aten::mm|aten::addmm|aten::bmm|aten::matmul|aten::linear"),
    ("copy", r"memcpy|memset|copy|aten::cat|catarraybatched|aten::to\b|aten::_to_copy"),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, pattern in CATEGORIES:
        if re.search(pattern, low):
            return cat
    return "other"


def summarize(prof: Any, step_s: float) -> dict[str, Any]:
    """Per-category time (s) of one profiled step: device kernels when there are any, else CPU ops."""
    from torch.autograd import DeviceType

    averages = prof.key_averages()
    kernels = [e for e in averages if getattr(e, "device_type", None) == DeviceType.CUDA and _device_us(e) > 0
               and not _annotation(e)]
    rows: list[tuple[str, float, int]] = []
    if kernels:
        source = "cuda kernels"
        rows = [(e.key, _device_us(e) / 1e6, e.count) for e in kernels]
    else:  # CPU: top-level-ish aten / custom ops by self CPU time
        source = "cpu ops (self time)"
        rows = [(e.key, e.self_cpu_time_total / 1e6, e.count) for e in averages if e.self_cpu_time_total > 0]
    by_cat: dict[str, float] = {c: 0.0 for c, _ in CATEGORIES}
    by_cat["other"] = 0.0
    for name, secs, _ in rows:
        by_cat[category(name)] += secs
    compute = sum(v for k, v in by_cat.items() if k != "comm")
    top = sorted(rows, key=lambda r: -r[1])[:25]
    return dict(source=source, step_s=step_s, categories_s=by_cat, compute_s=compute, exposed_s=step_s - compute,
                compute_fraction=compute / step_s if step_s > 0 else None,
                top=[dict(name=n[:160], seconds=s, count=c, category=category(n)) for n, s, c in top])


def _annotation(evt: Any) -> bool:
    """A user annotation's span on the GPU (``Optimizer.step#AdamW.step``, ``nccl:coalesced``), not a kernel:
    counting it would count its kernels twice."""
    return bool(getattr(evt, "is_user_annotation", False)) or "#" in evt.key or evt.key.startswith(("nccl:", "ProfilerStep"))


def _device_us(evt: Any) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, attr, None)
        if v:
            return float(v)
    return 0.0


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"profiled step {s['step_s']:.3f} s ({s['source']}): compute {s['compute_s']:.3f} s "
             f"({100 * (s['compute_fraction'] or 0):.1f}%), exposed {s['exposed_s']:.3f} s"]
    for cat, secs in sorted(s["categories_s"].items(), key=lambda kv: -kv[1]):
        share = 100 * secs / s["step_s"] if s["step_s"] > 0 else 0.0
        lines.append(f"  {cat:10s} {secs:9.3f} s  {share:5.1f}% of the step")
    lines.append("top kernels:")
    for t in s["top"]:
        lines.append(f"  {t['seconds']:8.3f} s  x{t['count']:<6d} [{t['category']}] {t['name']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    for path in argv if argv is not None else sys.argv[1:]:
        print(f"== {path}")
        print(format_summary(json.load(open(path))))


if __name__ == "__main__":
    main()

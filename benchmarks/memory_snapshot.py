"""Where a step's peak GPU memory goes: record the caching allocator's history around a callable, replay
its trace, and group what is alive at the peak by the package / transformers source line that allocated it.

    from memory_snapshot import peak_breakdown
    report = peak_breakdown(lambda: trainer.fit(...))   # a text table, largest groups first

Used to calibrate Note [Memory per token] (lightning_seqpar.memory) against what really stays alive.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

OURS = ("lightning_seqpar", "transformers", "peft", "benchmarks")


def _where(frames: list[dict], depth: int = 3) -> str:
    """The innermost ``depth`` frames from our / transformers' / peft's sources (else the innermost frames)."""
    keep = [f for f in frames if any(k in f.get("filename", "") for k in OURS)] or frames
    return " < ".join(f"{f['filename'].split('site-packages/')[-1].split('/work/')[-1]}:{f['line']}({f['name']})"
                      for f in keep[:depth])


def analyse(snapshot: dict, device: int = 0, top: int = 25) -> str:
    """Replay ``snapshot``'s trace: the peak of (alloc - free_completed) and what is alive then, grouped."""
    trace = snapshot["device_traces"][device]
    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    peak_index = -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _where(ev.get("frames", [])))
            cur += ev["size"]
            if cur > peak:
                peak, peak_index = cur, i
                peak_live = dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in peak_live.values():
        groups[where][0] += size
        groups[where][1] += 1
    lines = [f"peak of the traced allocations {peak / 1e9:.2f} GB at event {peak_index} of {len(trace)} "
             f"(allocated before tracing not included); largest groups alive then:"]
    for where, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        sizes = "" if where else " sizes GB: " + ", ".join(f"{b / 1e9:.2f}" for b, w in sorted(peak_live.values(), reverse=True) if not w)
        lines.append(f"  {size / 1e9:8.2f} GB  {count:5d} x  {where or '(allocated outside Python: autograd)'}{sizes}")
    at_peak = trace[peak_index] if peak_index >= 0 else {}
    lines.append("the allocation that made the peak: " + _where(at_peak.get("frames", []), depth=6))
    return "\n".join(lines)


def peak_breakdown(fn: Callable[[], object], max_entries: int = 400_000) -> str:
    """Run ``fn`` with the allocator's history recorded; the breakdown of its peak (see :func:`analyse`)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        fn()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return analyse(snapshot)

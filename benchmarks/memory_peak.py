"""What is alive at a step's allocation peak, from the CUDA allocator's history, summed by where it was allocated.

Note [The peak's allocations]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The planner's estimate is checked against ``torch.cuda.max_memory_allocated`` (docs/benchmarks.md); when the two part,
the question is which term. A whole run's allocator history with Python stacks is far larger than a file the GPU
machines can return (and slow to build), so one step is recorded (``torch.cuda.memory._record_memory_history`` from
the step's start to its end) and summarised on the machine: the trace's events are replayed in order (``alloc`` adds
a block, ``free_requested`` takes it away: what ``memory_allocated`` counts), the live set is kept at the highest sum,
and its blocks are summed by the innermost frame inside the package (the term's code) and by the innermost frame of all
(the op). Bytes allocated before the recording (parameters, optimizer states, what an earlier step left) are one
entry, "before the step"; a block freed in the step but allocated before it comes off that entry.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

PACKAGE = "lightning_seqpar"


def _where(frames: list[dict], inside: str | None) -> str:
    for f in frames:  # innermost first
        name = f.get("filename", "")
        if inside is None or inside in name:
            short = name.split(inside + "/", 1)[-1] if inside else "/".join(name.split("/")[-2:])  # package path / dir/file
            return f"{short}:{f.get('line')} {f.get('name')}"
    return "(no frame inside the package)" if inside else "(no frame)"


def peak_allocations(trace: list[dict[str, Any]], before: int, *, top: int = 25, inside: str = PACKAGE) -> dict[str, Any]:
    """The live blocks at the highest ``before + sum(alloc) - sum(free)`` of ``trace`` (one device's
    ``_snapshot()["device_traces"][i]``, oldest first), summed by place (Note [The peak's allocations])."""
    live: dict[int, tuple[int, list[dict]]] = {}
    gone_before = 0  # bytes allocated before the recording and freed in it
    total, peak, at = before, before, None
    for i, event in enumerate(trace):
        action, addr, size = event.get("action"), event.get("addr"), event.get("size", 0)
        if action == "alloc":
            live[addr] = (size, event.get("frames", []))
            total += size
        elif action == "free_requested":
            if addr in live:
                total -= live.pop(addr)[0]
            else:
                gone_before += size
                total -= size
        else:
            continue
        if total > peak:
            peak, at = total, (i, dict(live), gone_before)
    index, blocks, gone = at if at is not None else (None, {}, 0)  # never above what was there before the step
    by_place: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, frames in blocks.values():
        for table, key in ((by_place, _where(frames, inside)), (by_op, _where(frames, None))):
            table[key][0] += size
            table[key][1] += 1

    def ranked(table: dict[str, list[int]]) -> list[dict[str, Any]]:
        rows = sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
        return [{"where": k, "gb": round(b / 1e9, 3), "blocks": n} for k, (b, n) in rows]

    return {"peak_bytes": peak, "peak_gb": round(peak / 1e9, 3), "before_gb": round(before / 1e9, 3),
            "before_freed_gb": round(gone / 1e9, 3), "in_step_gb": round(sum(s for s, _ in blocks.values()) / 1e9, 3),
            "peak_event": index, "events": len(trace), "by_place": ranked(by_place), "by_op": ranked(by_op)}

"""Where a training step's time goes: a torch.profiler trace summarised by kernel category, and its idle gaps.

``train.py --profile DIR`` and ``hf.py families --profile DIR`` profile the first timed step on every rank
(:func:`profiler_callback`); rank 0 writes ``DIR/profile_<system>.json`` and ``.txt`` (and ``--profile-trace``: the
Chrome trace). Categories (the first match of CATEGORIES on the kernel name): attention, gemm, comm, copy, other.
``exposed_s`` = step - the non-comm categories of ``key_averages()``: an upper bound of the idle time (on llama3-8b steps
on H200 those sums come out ~0.7 s below the kernels in the trace). ``idle_gaps(trace)`` finds WHERE the idle time is:
every gap on the compute stream is "host" (the next kernel was launched after the GPU ran dry: charged to what the
launching thread was running), "wait" (queued in time, waiting for another stream: charged to the kernel it waited for)
or "edge" (before / after the step's kernels); NCCL kernels ON the compute stream (synchronous collectives) are apart.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

CATEGORIES: tuple[tuple[str, str], ...] = (
    ("comm", r"nccl|gloo|c10d|all_reduce|allreduce|all_gather|reduce_scatter|alltoall|all_to_all|send|recv"),
    ("attention", r"flash|fmha|sdpa|cudnn|attn|attention|fwd_combine|_flash_attn"),
    ("gemm", r"gemm|nvjet|xmma|cublas|sm90_|sm100_|cutlass|aten::mm|aten::addmm|aten::bmm|aten::matmul|aten::linear"),
    ("copy", r"memcpy|memset|copy|aten::cat|catarraybatched|aten::to\b|aten::_to_copy"),
)


def category(name: str) -> str:
    return next((cat for cat, pattern in CATEGORIES if re.search(pattern, name.lower())), "other")


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


def _annotation(evt: Any) -> bool:  # a user annotation's span on the GPU (Optimizer.step#AdamW.step, nccl:...): its kernels again
    return bool(getattr(evt, "is_user_annotation", False)) or "#" in evt.key or evt.key.startswith(("nccl:", "ProfilerStep"))


def _device_us(evt: Any) -> float:
    return float(getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0) or 0)


_KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_CPU_CATS = ("cpu_op", "user_annotation")


def idle_gaps(trace: dict[str, Any] | list[dict[str, Any]], *, step_s: float | None = None, min_gap_us: float = 5.0,
              top: int = 25) -> dict[str, Any]:
    """Idle time of the compute stream in a Chrome trace (``prof.export_chrome_trace``), by cause.

    The compute stream is the stream with the most non-communication kernel time. Returns its
    ``busy_s`` (the union of its kernels' intervals), ``kernel_sum_s`` (their durations summed),
    totals (seconds) for ``host`` / ``wait`` / ``edge`` gaps and the ``top`` causes of each kind, a cause
    being the launching thread's op stack (outermost > ... > innermost, 3 levels) for host gaps and
    the name of the other-stream kernel waited on for wait gaps.
    """
    import bisect

    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels: list[dict[str, Any]] = []
    launches: dict[Any, dict[str, Any]] = {}
    cpu: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") != "X" or "ts" not in e:
            continue
        cat = e.get("cat", "")
        if cat in _KERNEL_CATS:
            kernels.append(e)
        elif cat in _LAUNCH_CATS:
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e
        elif cat in _CPU_CATS and not str(e.get("name", "")).startswith("ProfilerStep"):
            cpu.setdefault(e.get("tid"), []).append(e)
    if not kernels:
        return dict(compute_stream=None, busy_s=0.0, kernel_sum_s=0.0, span_s=0.0, host_s=0.0, wait_s=0.0, edge_s=0.0, gaps=0, host=[], wait=[],
                    comm_on_compute_s=0.0, comm_on_compute=[])

    def stream(e: dict[str, Any]) -> Any:
        return (e.get("pid"), e.get("args", {}).get("stream", e.get("tid")))

    busy: dict[Any, float] = {}
    for k in kernels:
        if category(k.get("name", "")) != "comm":
            busy[stream(k)] = busy.get(stream(k), 0.0) + float(k.get("dur", 0.0))
    main = max(busy, key=busy.__getitem__) if busy else stream(kernels[0])
    compute = sorted((k for k in kernels if stream(k) == main), key=lambda k: k["ts"])
    others = sorted((k for k in kernels if stream(k) != main and k.get("pid") == main[0]),
                    key=lambda k: k["ts"] + k.get("dur", 0.0))
    other_ends = [k["ts"] + k.get("dur", 0.0) for k in others]

    # the op stacks of each CPU thread, for "what was the launching thread doing at time t": ops of a
    # thread nest, so the ops enclosing t are the last op that started before t and its ancestors
    parents: dict[Any, list[int]] = {}
    for tid, evs in cpu.items():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0.0)))
        stack: list[int] = []
        parent: list[int] = []
        for i, e in enumerate(evs):
            while stack and evs[stack[-1]]["ts"] + evs[stack[-1]].get("dur", 0.0) <= e["ts"]:
                stack.pop()
            parent.append(stack[-1] if stack else -1)
            stack.append(i)
        parents[tid] = parent
    starts = {tid: [e["ts"] for e in evs] for tid, evs in cpu.items()}

    def stack_at(tid: Any, t: float) -> str:
        evs, parent = cpu.get(tid, []), parents.get(tid, [])
        i = bisect.bisect_right(starts.get(tid, []), t) - 1
        chain: list[str] = []
        while i >= 0:
            if evs[i]["ts"] + evs[i].get("dur", 0.0) >= t:
                chain.append(str(evs[i].get("name", "?"))[:60])
            i = parent[i]
        if not chain:
            return "(no op: Python / framework code between ops)"
        chain.reverse()  # outermost first
        return " > ".join(chain if len(chain) <= 3 else [chain[0], chain[1], chain[-1]])

    host: dict[str, float] = {}
    wait: dict[str, float] = {}
    host_s = wait_s = 0.0
    n = 0
    kernel_sum_s = sum(float(k.get("dur", 0.0)) for k in compute) / 1e6
    serial: dict[str, float] = {}  # communication kernels ON the compute stream: nothing overlaps them
    for k in compute:
        if category(k.get("name", "")) == "comm":
            name = str(k.get("name", "?"))[:80]
            serial[name] = serial.get(name, 0.0) + float(k.get("dur", 0.0)) / 1e6
    end = compute[0]["ts"] + compute[0].get("dur", 0.0)
    small_s = 0.0  # gaps of at most min_gap_us: launch latency, not counted as idle
    for k in compute[1:]:
        gap = k["ts"] - end
        if 0 < gap <= min_gap_us:
            small_s += gap / 1e6
        if gap > min_gap_us:
            n += 1
            launch = launches.get(k.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] > end:
                cause = stack_at(launch.get("tid"), end + 0.5 * min(gap, launch["ts"] - end))
                host[cause] = host.get(cause, 0.0) + gap / 1e6
                host_s += gap / 1e6
            else:
                j = bisect.bisect_right(other_ends, k["ts"] + 1.0) - 1  # the other-stream kernel that ended last
                cause = (f"[{category(others[j]['name'])}] {str(others[j]['name'])[:80]}" if j >= 0 and other_ends[j] > end
                         else "(no other-stream kernel: event / sync)")
                wait[cause] = wait.get(cause, 0.0) + gap / 1e6
                wait_s += gap / 1e6
        end = max(end, k["ts"] + k.get("dur", 0.0))
    span_s = (end - compute[0]["ts"]) / 1e6
    edge_s = max(0.0, step_s - span_s) if step_s is not None else 0.0
    busy_s = span_s - host_s - wait_s - small_s  # the union of the kernels' intervals (kernels may overlap)

    def ranked(d: dict[str, float]) -> list[dict[str, Any]]:
        return [dict(cause=c, seconds=v) for c, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return dict(compute_stream=str(main), busy_s=busy_s, kernel_sum_s=kernel_sum_s, span_s=span_s, host_s=host_s, wait_s=wait_s, edge_s=edge_s,
                gaps=n, host=ranked(host), wait=ranked(wait), comm_on_compute_s=sum(serial.values()),
                comm_on_compute=ranked(serial))


_BACKWARD = re.compile(r"bwd|bprop|backward|dq_dk_dv|dkdv|_bwd")
_PARTS = (  # the "other" category of CATEGORIES, split (the first match on the lower-case kernel name)
    ("fused (Liger / Inductor)", r"^triton_|_rms_norm_|_swiglu_|_triton_rope|liger_|_geglu_|_layer_norm_|element_mul_kernel|fused_linear_cross"),
    ("optimizer", r"multi_tensor_apply|adam|fused_sgd"),
    ("element-wise & reductions (ATen)", r"at::native|elementwise|reduce_kernel|vectorized|index|scatter|gather|softmax|cross_entropy|nll_loss|embedding"),
)


def part(name: str) -> str:
    """The row of :func:`where_the_step_goes` for one kernel: attention forward / backward, gemm, comm, copy, or a
    part of "other" (fused, optimizer, element-wise, else "other")."""
    cat = category(name)
    low = name.lower()
    if cat == "attention":
        return "attention backward" if _BACKWARD.search(low) else "attention forward"
    if cat != "other":
        return cat
    return next((label for label, pattern in _PARTS if re.search(pattern, low)), "other")


_NAMED_PARTS = ("copy", "element-wise & reductions (ATen)", "other")
"""The parts whose five largest kernels a split names (``top_kernels``): the small kernels a system could still remove."""


def where_the_step_goes(trace: dict[str, Any] | list[dict[str, Any]], *, step_s: float | None = None) -> dict[str, Any]:
    """Note [Where the step goes]: one profiled step's kernel time by part (summed over every stream) beside its compute
    stream's idle time by cause (:func:`idle_gaps`), in seconds.

    ``parts_s``: attention forward / backward, gemm, comm, copy, fused (Liger / Inductor), optimizer, element-wise &
    reductions (ATen), other. ``comm_s`` splits communication: ``kernels`` (its kernels' time, all streams, overlapped or
    not), ``waited`` (the compute stream idle while waiting for another stream), ``waited_on_comm`` (the part of it
    spent on a collective's stream: exposed communication), ``on_compute_stream`` (collectives that run on the
    compute stream: nothing overlaps them).
    ``idle_s``: host (the GPU ran dry: launch-bound Python), wait, edges. The same function reads every system's
    trace, so a row of ours and a peer's split the step the same way. ``top_kernels``: the five largest kernels of
    each of :data:`_NAMED_PARTS` (name, seconds, calls)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    parts: dict[str, float] = {}
    calls: dict[str, int] = {}
    by_name: dict[tuple[str, str], list] = {}  # (part, kernel) -> [seconds, calls]
    for e in events:
        if e.get("ph") == "X" and e.get("cat", "") in _KERNEL_CATS:
            name = str(e.get("name", ""))
            k = part(name)
            parts[k] = parts.get(k, 0.0) + float(e.get("dur", 0.0)) / 1e6
            calls[k] = calls.get(k, 0) + 1
            if k in _NAMED_PARTS:
                entry = by_name.setdefault((k, name), [0.0, 0])
                entry[0] += float(e.get("dur", 0.0)) / 1e6
                entry[1] += 1
    top_kernels = {k: [dict(name=n[:160], seconds=round(sec, 6), calls=c)
                       for (kk, n), (sec, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0]) if kk == k][:5]
                   for k in _NAMED_PARTS if k in parts}
    gaps = idle_gaps(events, step_s=step_s, top=1 << 30)
    waited_comm = sum(w["seconds"] for w in gaps["wait"] if w["cause"].startswith("[comm]"))
    return dict(
        step_s=step_s, parts_s={k: round(v, 6) for k, v in sorted(parts.items(), key=lambda kv: -kv[1])}, calls=calls,
        busy_s=round(gaps["busy_s"], 6),
        comm_s=dict(kernels=round(parts.get("comm", 0.0), 6), waited=round(gaps["wait_s"], 6),
                    waited_on_comm=round(waited_comm, 6), on_compute_stream=round(gaps["comm_on_compute_s"], 6)),
        idle_s=dict(host=round(gaps["host_s"], 6), wait=round(gaps["wait_s"], 6), edge=round(gaps["edge_s"], 6)),
        top_waits=gaps["wait"][:5], top_host=gaps["host"][:5], top_kernels=top_kernels)


def format_gaps(g: dict[str, Any]) -> str:
    lines = [f"compute stream {g['compute_stream']}: busy {g['busy_s']:.3f} s; idle in {g['gaps']} gaps: "
             f"host {g['host_s']:.3f} s, wait {g['wait_s']:.3f} s; edges {g['edge_s']:.3f} s"]
    for kind in ("host", "wait"):
        lines.append(f"top {kind} causes:")
        lines += [f"  {r['seconds']:8.4f} s  {r['cause']}" for r in g[kind]]
    lines.append(f"communication kernels on the compute stream (not overlapped): {g.get('comm_on_compute_s', 0.0):.3f} s")
    lines += [f"  {r['seconds']:8.4f} s  {r['cause']}" for r in g.get("comm_on_compute", [])]
    return "\n".join(lines)


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


def start_profiler(args: Any) -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if args.device == "cuda":
        torch.cuda.synchronize()
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else []))
    prof.__enter__()
    return prof


def finish_profiler(args: Any, prof: Any, t0: float) -> None:
    """End the profile of one step that started at ``t0``; rank 0 writes its summary (and idle gaps) to ``args.profile``."""
    import torch
    import torch.distributed as dist

    if args.device == "cuda":
        torch.cuda.synchronize()
    step = time.perf_counter() - t0
    prof.__exit__(None, None, None)
    if dist.get_rank() != 0:
        return
    os.makedirs(args.profile, exist_ok=True)
    summary = dict(summarize(prof, step), system=args.system, model=args.model, seq=args.seq, commit=args.commit,
                   backend=getattr(args, "backend", None))
    base = os.path.join(args.profile, f"profile_{args.system}{'_' + args.tag if args.tag else ''}")
    text = format_summary(summary)
    if args.device == "cuda":  # where the idle time is: from the Chrome trace (kept with --profile-trace)
        prof.export_chrome_trace(base + ".trace.json")
        with open(base + ".trace.json") as f:
            summary["idle"] = idle_gaps(json.load(f), step_s=step)
        if not args.profile_trace:
            os.remove(base + ".trace.json")
        text += "\n" + format_gaps(summary["idle"])
    elif args.profile_trace:
        prof.export_chrome_trace(base + ".trace.json")
    with open(base + ".json", "w") as f:
        json.dump(summary, f, indent=1)
    with open(base + ".txt", "w") as f:
        f.write(text + "\n")
    print(f"[profile] {text}", flush=True)


def profiler_callback(args: Any) -> Any:
    """A Lightning callback profiling the first timed step (batch ``args.warmup``) on every rank."""
    import lightning as L

    class StepProfiler(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == args.warmup:
                self.prof, self.t0 = start_profiler(args), time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == args.warmup and getattr(self, "prof", None) is not None:
                finish_profiler(args, self.prof, self.t0)

    return StepProfiler()

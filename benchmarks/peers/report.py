"""The peers table of docs/benchmarks.md from the records (``python -m benchmarks.peers.report``).

One row per run, grouped by model and length, each system's tokens/s/GPU as a ratio to the best peer's (the peers:
torchtitan, trl_cp, deepspeed_alst) of the same model, length, GPU kind and count measured in the same run group (one
results file per group: one machine, its runs one after the other; a ratio never mixes machines). A group is named
by its file: ``20261127-9`` is ``benchmarks/results/20261127-nvidia-h200-x4-peers-9.json`` (date, then the
group's number that day); the rows carry the GPU kind and the commit. Profiled steps are left out (the profiler slows the step it
records: ``profiled_step``, or the probe's ``kernels.step`` past the warm-up; ``memory_step``, the allocator's history
recorded), and so are A/B runs of ours with options forced against the defaults (``ab`` in the record: docs/benchmarks.md
cites them in its text); failed runs stay in, with their status.

The memory column is one measure for every row (Note [One measurement for every peer]): ``peak_reserved_gb``, the
probe's reserved peak over the whole run, max over ranks. Records from before the probe do not have it: they show
their own measure, labelled (:func:`memory_cell`): "alloc (old)" is ``max_memory_allocated`` since the first timed
step; torchtitan's old rows show the reserved peak its logger printed ("its log") or, with no log kept, say that
its logger reset the peak. A peer's row names its variant: "as published" or the settings of its own docs that it
ran (``settings["variant"]``); the attention column is the kernel the probe saw in the profiled step.
"""

from __future__ import annotations

import re

import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # loaded by path too (benchmarks/report.py)
from common import SHAPES, bound_tokens_per_s  # noqa: E402

PEERS = ("torchtitan", "trl_cp", "deepspeed_alst")
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def records(paths: list[str] | None = None) -> list[dict]:
    rows = []
    for path in paths or sorted(glob.glob(os.path.join(RESULTS, "*peers*.json"))):
        group = os.path.basename(path).split("-nvidia")[0] + ("" if path.endswith("-peers.json") else
                                                               "-" + path.rsplit("-", 1)[-1].removesuffix(".json"))
        rows += [dict(r, group=group) for r in json.load(open(path))
                 if r.get("bench") == "peers" and not r.get("profiled_step") and not r.get("memory_step") and not r.get("ab") and not kernels_in_timed_steps(r)]
    return rows


def kernels_in_timed_steps(r: dict) -> bool:
    """The probe profiled a timed step (``--kernel-step`` past the warm-up): its step time is the profiler's too."""
    step = (r.get("kernels") or {}).get("step") or 0
    return step > r.get("warmup", 2)


def _k(seq: int) -> str:
    return f"{seq // 1048576}M" if seq % 1048576 == 0 else f"{seq // 1024}K"


def _system(r: dict) -> str:
    """The system, and for a row cut into packed documents how many (another workload: attention within documents)."""
    return r["system"] + (f" ({r['documents']} packed documents)" if r.get("documents") else "")


def variant(r: dict) -> str:
    """A peer's settings as run: "as published" (its published config; every record before issue #56) or the settings
    of its own docs it ran with (torchtitan's compile and full AC, TRL's Liger, ALST's flash-attention)."""
    variant = (r.get("settings") or {}).get("variant")
    if not variant and r.get("flags"):  # a run that failed before its runner wrote its settings: the flags it was given
        variant = " ".join(r["flags"]).replace(" --", ", ").removeprefix("--")
    return variant or "as published"


def _system_cell(r: dict) -> str:
    return _system(r) + (f", {variant(r)}" if r["system"] in PEERS else "")


def _where_system_cell(r: dict) -> str:
    """The system, and for ours the local kernel and the attention it ran ("set" where a run's --option chose it), so
    that rows of ours in one group tell apart."""
    settings = r.get("settings") or {}
    if r["system"] != "seqpar" or not settings.get("kernel"):
        return _system_cell(r)
    chosen = any(str(f).startswith("attention=") for f in r.get("flags") or [])
    return f"{_system(r)} ({settings['kernel']}, {settings.get('attention')}{' set' if chosen else ''})"


def memory_cell(r: dict) -> str:
    """The memory column: the probe's reserved peak, or an older record's own measure, labelled as such."""
    if r.get("peak_reserved_gb") is not None:
        return f"{r['peak_reserved_gb']:.1f}"
    if r.get("peak_reserved_gb_from_log") is not None:
        return f"{r['peak_reserved_gb_from_log']:.1f} (its log)"
    if r.get("peak_mem_gb") is None:
        return "-"
    if "not a peak" in (r.get("peak_mem_measure") or ""):
        return f"{r['peak_mem_gb']:.1f} alloc (old, reset by its logger: no peak)"
    return f"{r['peak_mem_gb']:.1f} alloc (old)"


def master_cell(r: dict) -> str:
    """fp32 / bf16 as the probe read it off the optimizer; for older records of ours, from the precision that ran ("set")."""
    if r.get("master_weights"):
        return r["master_weights"]
    precision = (r.get("settings") or {}).get("precision") if r["system"] == "seqpar" else None
    return {"bf16-true": "bf16 (set)", "bf16-mixed": "fp32 (set)"}.get(precision, "-")


def _settings(r: dict) -> str:
    """What ran: the peer's changes from its published settings, or ours: the options set by hand (else defaults)."""
    if r["system"] != "seqpar":  # the parallel degree and the length, and any change to how the peer trains
        changes = r.get("changes", [])
        trains = [c for c in changes[2:] if any(k in c for k in ("activation_checkpoint", "compile", "offload"))]
        return "; ".join(changes[:2] + trains) or "-"
    s = r.get("settings", {})
    plan = s.get("memory_plan") or ""
    chosen = next((m for m in ("selective++", "full") if f"activation_checkpointing='{m}'" in plan.split("estimate=")[0]), None)
    chosen = (chosen + ", offloaded checkpoints") if chosen and "offload_checkpoints=True" in plan.split("estimate=")[0] else chosen
    chosen = (chosen + ", offloaded parameters") if chosen and "offload_params=True" in plan.split("estimate=")[0] else chosen
    by_hand = [f"{k}={s[k]}" for k in ("attention", "uncheckpointed_blocks", "compile") if k in s and k != "attention"]
    set_attention = any("attention" in c for c in r.get("changes", []))
    parts = [f"attention {s['attention']}" + (" (set)" if set_attention else " (auto)")] if s.get("attention") else []
    parts += [f"kernel {s['kernel']}"] if s.get("kernel") else []
    kept = re.search(r"uncheckpointed_blocks=(\d+)", plan.split("estimate=")[0])
    chosen = f"{chosen}, {kept.group(1)} blocks uncheckpointed" if chosen and kept and kept.group(1) != "0" else chosen
    parts += ([f"memory=auto: {chosen}"] if chosen else []) + by_hand
    parts += ["fused element-wise kernels"] if s.get("fused_kernels") else []
    parts += ["torch element-wise ops (SEQPAR_FUSED_KERNELS=0)"] if s.get("fused_kernels_env") == "0" else []
    parts += [f"loss chunks {s['loss_chunk_size']}" + ("" if s.get("loss_chunk_set", True) else " (auto)")] if s.get("loss_chunk_size") else []
    return ", ".join(parts) if (chosen or by_hand or s.get("loss_chunk_size") or set_attention or s.get("kernel")) else "defaults"


def group_order(group: str) -> tuple[str, int]:
    """A run group's place in time: its date, then its number that day (``20261127`` before ``20261127-2``, ``-9`` before
    ``-10``)."""
    date, _, n = group.partition("-")
    return date, int(n) if n.isdigit() else (0 if not n else -1)


def table(rows: list[dict], newest_only: bool = False) -> list[str]:
    """One row per run, grouped by model, length and GPUs, the newest group first; ``newest_only``: only the newest group
    of each (the table of docs/benchmarks.md)."""
    out = ["| model | S | GPUs | run group | system | version | tokens/s/GPU | vs best peer | MFU | of bound | peak reserved GB | "
           "master weights | attention kernel (profiled) | settings | commit |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    key = lambda r: (r["model"], r["seq"], r["gpus"], r["gpu"], r.get("group", "-"))  # noqa: E731
    anchored = set()
    keys = sorted(sorted({key(r) for r in rows}, key=lambda k: group_order(k[4]), reverse=True), key=lambda k: k[:4])  # newest first
    if newest_only:  # the newest group of each model, length and GPUs; the older ones: the records, benchmarks-history.md
        keys = [k for i, k in enumerate(keys) if i == 0 or keys[i - 1][:4] != k[:4]]
    for k in keys:
        group = [r for r in rows if key(r) == k]
        peers = [r["tokens_per_s_per_gpu"] for r in group if r["system"] in PEERS and r.get("tokens_per_s_per_gpu")]
        best = max(peers, default=None)
        anchor = "" if k[:4] in anchored else f'<a id="peers-{k[0]}-{k[1] // 1024}k-{k[2]}"></a>'  # README rows link here
        anchored.add(k[:4])
        for r in sorted(group, key=lambda r: (r["system"] != "seqpar", r["system"], -(r.get("tokens_per_s_per_gpu") or 0))):
            tps = r.get("tokens_per_s_per_gpu")
            if tps:
                bound = bound_tokens_per_s(SHAPES[r["model"]], r["seq"], r["gpu"], r.get("documents") or 1)
                cells = [f"{tps:,.0f}", f"{tps / best:.2f}x" if best and r["system"] == "seqpar" else "-", f"{r['mfu']:.3f}",
                         f"{tps / bound:.2f}" if bound else "-", memory_cell(r)]
            else:
                cells = [r["status"].split(":")[0], "-", "-", "-", memory_cell(r) if r.get("peak_reserved_gb") else "-"]
            cells += [master_cell(r), r.get("attention_kernel") or "-"]
            out.append(f"| {anchor}{r['model']} | {_k(r['seq'])} | {r['gpus']} x {r['gpu']} | {k[4]} | {_system_cell(r)} | "
                       f"{r.get('version', '-')} | " + " | ".join(cells) + f" | {_settings(r)} | {r['commit']} |")
            anchor = ""
    return out


WHERE_PARTS = ("attention forward", "attention backward", "gemm", "fused (Liger / Inductor)",
               "element-wise & reductions (ATen)", "optimizer", "copy", "other")


def where_table(rows: list[dict]) -> list[str]:
    """Where each system's profiled step goes (issue #56 item 2; Note [Where the step goes] in benchmarks/profile_summary.py),
    the newest group of each model, length and GPUs whose records carry the split: seconds of kernel time by part (the
    profiled step on rank 0, every stream), the communication kernels' time, the compute stream's idle time waiting on
    them (exposed communication) and launch-bound (host) idle, beside the step's physical bound."""
    have = [r for r in rows if ((r.get("kernels") or {}).get("where") or {}).get("parts_s")]
    out = ["| model | S | GPUs | run group | system | profiled step s | " + " | ".join(WHERE_PARTS) +
           " | comm kernels (overlapped or not) | waited on comm | host idle | bound s | commit |",
           "| --- " * (11 + len(WHERE_PARTS)) + "|"]
    key = lambda r: (r["model"], r["seq"], r["gpus"], r["gpu"])  # noqa: E731
    for k in sorted({key(r) for r in have}):
        newest = max((r["group"] for r in have if key(r) == k), key=group_order)
        for r in sorted((r for r in have if key(r) == k and r["group"] == newest), key=lambda r: (r["system"] != "seqpar", _where_system_cell(r))):
            w = r["kernels"]["where"]
            bound = bound_tokens_per_s(SHAPES[r["model"]], r["seq"], r["gpu"], r.get("documents") or 1)
            cells = [f"{w['step_s']:.2f}" if w.get("step_s") else "-"]
            cells += [f"{w['parts_s'].get(p, 0.0):.2f}" for p in WHERE_PARTS]
            cells += [f"{w['comm_s']['kernels']:.2f}", f"{w['comm_s']['waited_on_comm']:.2f}", f"{w['idle_s']['host']:.2f}",
                      f"{r['seq'] / (r['gpus'] * bound):.2f}" if bound else "-"]
            out.append(f"| {r['model']} | {_k(r['seq'])} | {r['gpus']} x {r['gpu']} | {r['group']} | {_where_system_cell(r)} | "
                       + " | ".join(cells) + f" | {r['commit']} |")
    return out


def longest(rows: list[dict]) -> list[str]:
    """The longest length each system trained, per model, GPUs and run group (issue #39: 2 optimizer steps within one
    10-minute run): its largest "ok" length and what stopped the next length it tried ("oom", "timeout", an error),
    or "none tried" (then the length is a lower bound). A group appears once some system in it met a limit or
    trained a length above 128K (the speed rows' length: a run for the longest); a row cut into packed documents is
    its own system (``documents``: attention within each document, a shorter step than a dense row of that length); ours
    as a ratio to the best peer's longest of that group, and in brackets the ratio that is sure (ours over the length
    at which that peer failed: its longest lies below it). A failed run whose
    record names a ``defect`` of ours fixed since (a wrong estimate, not a limit of the method) is not a limit."""
    out = ["| model | GPUs | run group | system | longest S that trained | s per step there | peak reserved GB there | the next length tried | ours / best peer |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    anchored = set()
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["gpus"], r["gpu"], r.get("group", "-")), {}).setdefault(_system(r), []).append(r)
    newest_first = sorted(groups.items(), key=lambda kv: group_order(kv[0][3]), reverse=True)
    for (model, gpus, gpu, group), systems in sorted(newest_first, key=lambda kv: kv[0][:3]):  # groups newest first
        bounds = _bounds(systems)
        there = {system: next((r for r in runs if r.get("status") == "ok" and r["seq"] == bounds[system][0]), {})
                 for system, runs in systems.items()}  # the run at each system's longest length
        if not _shown(bounds):
            continue
        # one anchor per model and GPU count (the README links there, and its figures may come from any group of
        # that model): on the newest group's first row, the model's rows of every group below it
        anchor = f'<a id="peers-longest-{model}-{gpus}"></a>' if (model, gpus) not in anchored else ""
        if anchor:
            anchored.add((model, gpus))
        peer = max(((ok, stop) for system, (ok, stop) in bounds.items() if system in PEERS and ok), default=None)
        for system in sorted(bounds, key=lambda s: (not s.startswith("seqpar"), s)):
            ok, stop = bounds[system]
            next_cell = f"{stop['seq']:,}: {stop['status'].split(':')[0]}" if stop else "none tried"
            ratio = "-"
            if system.startswith("seqpar") and ok and peer:  # the lengths that trained; in brackets what is sure: the peer's
                sure = f" (> {ok / peer[1]['seq']:.2f}x)" if peer[1] else ""  # longest is below the length that failed
                ratio = f"{ok / peer[0]:.2f}x{sure}"
            step, peak = there[system].get("step_time_s"), memory_cell(there[system]) if there[system] else "-"
            out.append(f"| {anchor}{model} | {gpus} x {gpu} | {group} | {system} | {f'{ok:,}' if ok else '-'} | "
                       f"{f'{step:.1f}' if step else '-'} | {peak} | {next_cell} | {ratio} |")
            anchor = ""
    return out


def _bounds(systems: dict[str, list[dict]]) -> dict[str, tuple[int | None, dict | None]]:
    """Each system's largest "ok" length and the first failed run above it: a limit (oom, timeout) before an error."""
    bounds = {}
    for system, runs in systems.items():
        ok = max((r["seq"] for r in runs if r.get("status") == "ok"), default=None)
        above = sorted((r for r in runs if r.get("status") != "ok" and not r.get("defect") and (ok is None or r["seq"] > ok)),
                       key=lambda r: (r["seq"], r["status"].startswith("error")))
        bounds[system] = (ok, above[0] if above else None)
    return bounds


def _shown(bounds: dict[str, tuple[int | None, dict | None]]) -> bool:
    """A run group's rows are a longest-length table row set once a system met a limit (out of memory or time; a run
    that failed with an error is not a length's limit) or trained above 128K."""
    return any(stop is not None and str(stop.get("status")).startswith(("oom", "timeout")) or (ok or 0) > 131072 for ok, stop in bounds.values())


if __name__ == "__main__":
    print("\n".join(table(records(sys.argv[1:] or None))))
    print()
    print("\n".join(longest(records(sys.argv[1:] or None))))


# --------------------------------------------------------------------------------------------- your own model

_OWN_LABELS = {"litgpt-llama3-8b": "LitGPT `GPT` (Llama-3-8B config), unchanged, under the strategy",
               "litgpt-llama3.2-1b": "LitGPT `GPT` (Llama-3.2-1B config), unchanged, under the strategy",
               "llama3-8b": "the package's Llama-3-8B (`CausalLMModule(\"llama3-8b\")`)"}


def own_model_records(paths: list[str] | None = None) -> list[dict]:
    """The runs of docs/own_model.md's speed claims: ``benchmarks/results/*own-model*.json`` (one file, one lease)."""
    rows = []
    for path in paths or sorted(glob.glob(os.path.join(RESULTS, "*own-model*.json"))):
        group = os.path.basename(path).removesuffix(".json")
        rows += [dict(r, group=group) for r in json.load(open(path)) if r.get("bench") == "peers"]
    return rows


def own_model_table(rows: list[dict]) -> list[str]:
    """A model of the user's own (LitGPT's GPT through the routed SDPA) against the package's own model of the same shape
    and against plain LitGPT, each ratio within one results file (one lease, one GPU kind), by length and GPU count."""
    out = ["| run group (GPUs, commit) | model | length | system | tokens/s/GPU | ratio | peak GB | attention, kernel, plan |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for group in sorted({r["group"] for r in rows}):
        mine = [r for r in rows if r["group"] == group]
        for r in mine:
            s = r.get("settings", {})
            compiled = s.get("compile") is True
            if r["system"] == "litgpt":
                system = "plain LitGPT (its SDPA, its chunked loss, no strategy)"
            else:
                system = _OWN_LABELS.get(r["model"], r["model"]) + (", `compile=True`" if compiled else "")
            same = [o for o in mine if o is not r and o["seq"] == r["seq"] and o["gpus"] == r["gpus"] and o.get("tokens_per_s_per_gpu")]
            base = None
            if r["system"] == "seqpar" and r["model"].startswith("litgpt"):  # routed LitGPT against the package's model, else plain
                base = next((o for o in same if o["model"] == "llama3-8b" and not o.get("settings", {}).get("compile")), None) or \
                    next((o for o in same if o["system"] == "litgpt"), None)
            elif compiled:
                base = next((o for o in same if o["model"] == r["model"] and not o.get("settings", {}).get("compile")), None)
            tps = r.get("tokens_per_s_per_gpu")
            ratio = (f"{tps / base['tokens_per_s_per_gpu']:.2f}x " + ("plain LitGPT" if base["system"] == "litgpt" else
                     "the package's model" if base["model"] != r["model"] else "without compile")) if tps and base else "-"
            plan = s.get("memory_plan") or ""
            opts = plan.split("estimate=")[0]
            what = ", ".join(x for x in (s.get("attention"), s.get("kernel"),
                                         "offloaded parameters" if "offload_params=True" in opts else None,
                                         "offloaded checkpoints" if "offload_checkpoints=True" in opts else None) if x)
            status = f"{tps:,.0f}" if tps else r.get("status", "-")
            peak = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") else "-"
            gpus = f"{r['gpus']} x {r['gpu']}, {r.get('commit', '?')}"
            out.append(f"| {group} ({gpus}) | {r['model']} | {_k(r['seq'])} | {system} | {status} | {ratio} | {peak} | {what or '-'} |")
    return out

"""The records of benchmarks/results/*.json: merged in (collect), and the tables of docs/benchmarks.md made from them.

    python -m benchmarks collect --kind nvidia-h200-x4 [--date 20261122] /path/to/out/*.json   # merge into results/
    python -m benchmarks tables [--check]  # rewrite (check) the generated blocks of docs/benchmarks.md (and -history.md)

``collect`` names what a GPU machine wrote ``results/<yyyymmdd>-<machine kind>.json``, records checked (``REQUIRED``)
before anything is written and kept once. Each table sits between ``<!-- generated: NAME -->`` and ``<!-- end: NAME
-->``; the text around it is written by hand, the figures are not. Records are read by file name (date), each file in
the order it was appended. A configuration (system, settings, model, S, GPUs) measured more than once shows its last
record; where a table has one row per system, ours is the fastest setting of the last commit that measured that
model, S and GPUs; profiled (``*prof*``), smoke (``*smoke*``) and ``offload_params`` runs are not throughput figures. A
longest context is the longest S that trained in any record of that system, model and GPU count. Ratios are ours /
the peer's, unrounded, with 2 decimals; in the throughput and attention tables "*" marks records of different commits.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import re
import statistics
import sys
from typing import Any, Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results", "*.json")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
HISTORY_DOC = os.path.join(ROOT, "docs", "benchmarks-history.md")  # the detail tables a reader of the method rarely needs
PEERS = {"torch_cp": "FSDP2 + torch CP", "tp_sp": "Megatron TP+SP"}
NAMES = {"seqpar": "ours", **PEERS, "single": "one GPU"}


# ---- reading and merging records -----------------------------------------------------------------------

_COMMON = ("bench", "system", "algorithm", "model", "seq", "gpus", "device", "peak_mem_gb", "commit")
REQUIRED: dict[str, tuple[tuple[str, ...], ...]] = {
    # bench: groups of keys; each group must have at least one key present with a value
    "train": tuple((k,) for k in _COMMON) + (("tokens_per_s_per_gpu",), ("mfu",)),
    "attention": tuple((k,) for k in _COMMON) + (("tflops_per_gpu", "tokens_per_s_per_gpu"),),
    "longest": tuple((k,) for k in ("bench", "system", "model", "gpus", "seq", "device", "commit")),
    "matmul": (("bench",), ("device",), ("tflops",), ("commit",)),
}
"""Required keys per ``bench``. Other bench kinds (e.g. "local", "local_check") need only ``bench``. Keys of a measured
value may be null in a record of a failed measurement (a non-null ``error``); so may ``seq`` of a "longest" record whose
search found no S that trains."""
_MEASURED = ("peak_mem_gb", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "tflops")


def problems(row: Any) -> list[str]:
    """What is wrong with one record (empty when it is fine)."""
    if not isinstance(row, dict):
        return [f"not a JSON object: {str(row)[:60]}"]
    bench = row.get("bench")
    if not isinstance(bench, str):
        return ["no 'bench'"]
    failed = row.get("error") not in (None, "")
    nullable = _MEASURED + (("seq",) if bench == "longest" else ())
    missing = ["|".join(group) for group in REQUIRED.get(bench, (("bench",),))
               if not any(k in row and (row[k] is not None or (failed and k in nullable)) for k in group)]
    out = [f"missing or null {', '.join(missing)}"] if missing else []
    for key in ("seq", "gpus"):
        if row.get(key) is not None and not (isinstance(row[key], int) and row[key] > 0):
            out.append(f"{key} must be a positive integer, got {row[key]!r}")
    return out


def _rows_of(path: str) -> list[Any]:
    with open(path) as fh:
        data = json.load(fh)
    return data if isinstance(data, list) else [data]


def merge(paths: list[str], target: str) -> tuple[list[Any], int]:
    """All records of ``target`` (if it exists) and of ``paths``, identical ones once; (rows, added)."""
    errors, incoming = [], []
    for path in paths:
        for i, row in enumerate(_rows_of(path)):
            errors += [f"{path}: record {i} (bench={row.get('bench') if isinstance(row, dict) else None}): {p}" for p in problems(row)]
            incoming.append(row)
    if errors:
        raise SystemExit("collect: invalid records, nothing written:\n" + "\n".join(errors))
    rows = _rows_of(target) if os.path.exists(target) else []
    seen = {json.dumps(r, sort_keys=True, allow_nan=True) for r in rows}
    added = 0
    for row in incoming:
        key = json.dumps(row, sort_keys=True, allow_nan=True)
        if key not in seen:
            seen.add(key)
            rows.append(row)
            added += 1
    return rows, added


def collect_main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m benchmarks collect", description="merge records into benchmarks/results/")
    ap.add_argument("files", nargs="+", help="JSON record files")
    ap.add_argument("--kind", required=True, help="the machine kind the records were measured on, e.g. nvidia-h200-x4")
    ap.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d"), help="yyyymmdd (default: today, UTC)")
    ap.add_argument("--results", default=os.path.dirname(RESULTS), help="folder of the merged files (default: benchmarks/results)")
    args = ap.parse_args(argv)
    if not (len(args.date) == 8 and args.date.isdigit()) or not args.kind or os.sep in args.kind or " " in args.kind:
        ap.error(f"--date must be yyyymmdd and --kind a plain name like nvidia-h200-x4, got {args.date!r}, {args.kind!r}")
    target = os.path.join(args.results, f"{args.date}-{args.kind}.json")
    rows, added = merge(args.files, target)
    os.makedirs(args.results, exist_ok=True)
    with open(target, "w") as fh:
        json.dump(rows, fh, indent=1)
        fh.write("\n")
    print(f"collect: {target}: {len(rows)} records ({added} new)")
    return target


def load(paths: Iterable[str]) -> list[dict[str, Any]]:
    """The records of ``paths`` in file-name order, each with ``_file`` (its file's name); unreadable files skipped."""
    rows = []
    for path in sorted(paths):
        try:
            data = _rows_of(path)
        except (OSError, ValueError) as e:
            print(f"report.py: skipping {path}: {e}")
            continue
        rows += [{**row, "_file": os.path.basename(path)} for row in data if isinstance(row, dict)]
    return rows


def longest_per_config(rows: list[dict], keys: tuple[str, ...] = ("system", "model", "gpus", "device")) -> list[dict]:
    """One longest-context record per value of ``keys``: the one with the longest S that trained (a later
    out-of-memory at a longer S does not hide it); a configuration where nothing trained keeps its last record
    ("none fit"). Records whose every attempt was skipped tried nothing and are left out."""
    out: dict[tuple, dict] = {}
    for row in rows:
        attempts = row.get("attempts") or []
        if attempts and all(a.get("status") == "skipped" for a in attempts):
            continue
        key = tuple(str(row.get(k)) for k in keys)
        if key not in out or (_num(row, "seq") or 0) >= (_num(out[key], "seq") or 0):
            out[key] = row
    return list(out.values())


# ---- formatting ------------------------------------------------------------------------------------

def _num(row: dict | None, key: str) -> float | None:
    v = None if row is None else row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        return None
    return float(v)


def f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None, *, rows: tuple[dict | None, dict | None] = (None, None)) -> str:
    """a / b; marked "*" when the two records come from different commits."""
    if a is None or b is None or b == 0:
        return "-"
    x, y = rows
    other = x is not None and y is not None and x.get("commit") != y.get("commit")
    return f"{a / b:.2f}x" + ("*" if other else "")


def seq_k(s: int | None) -> str:
    return "-" if s is None else f"{s >> 20}M" if s % (1 << 20) == 0 else f"{s >> 10}K" if s % 1024 == 0 else str(s)


def date_of(row: dict) -> str:
    """The date of a record: that of its file, named <yyyymmdd>-<machine kind>.json."""
    m = re.match(r"(\d{4})(\d{2})(\d{2})-", row.get("_file", ""))
    return f"{m[1]}-{m[2]}-{m[3]}" if m else "?"


def when(*rows: dict) -> str:
    """The commit(s) and date(s) of records."""
    commits = list(dict.fromkeys(str(r.get("commit") or "-") for r in rows))
    dates = list(dict.fromkeys(date_of(r) for r in rows))
    return f"{' / '.join(commits)}, {' / '.join(dates)}"


def anchor(*parts: Any) -> str:
    return "-".join(re.sub(r"[^a-z0-9]+", "-", str(p).lower()).strip("-") for p in parts)


def table(head: list[str], rows: list[list[str]]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows])


def kernel(row: dict) -> str:
    return "cuDNN" if row.get("backend") in (None, "cudnn", "auto") else str(row["backend"])


# ---- selection -------------------------------------------------------------------------------------

def last_by(rows: list[dict], key: Callable[[dict], Any]) -> dict[Any, dict]:
    return {key(r): r for r in rows}  # later records win


def best_of_last_commit(rows: list[dict], metric: str) -> dict | None:
    """Among ``rows`` (one configuration of model / S / GPUs, several settings): the fastest of the last commit."""
    rows = [r for r in rows if _num(r, metric) is not None]
    if not rows:
        return None
    commit = rows[-1].get("commit")
    return max((r for r in rows if r.get("commit") == commit), key=lambda r: _num(r, metric) or 0.0)


def _scaling_model(r: dict) -> bool:  # the LASP and LSS models: the scaling table's
    return str(r.get("model", "")).startswith(("tnl", "lss-gpt"))


def _throughput_run(r: dict) -> bool:
    tag = str(r.get("tag") or "")
    return not (r.get("error") or r.get("offload_params") or "prof" in tag or "smoke" in tag)


def setting(r: dict) -> str:
    if r.get("train_args"):  # longest.py's later records: train.py's flags as given
        args = re.sub(r"--(warmup|steps) \d+ ?", "", str(r["train_args"])).strip()
        return f"`{args}`"
    if r.get("system") != "seqpar":
        return {"torch_cp": "full AC", "tp_sp": "full AC" + (f", {r['heads']} heads" if r.get("padded_heads") else "")}.get(
            str(r.get("system")), "")
    parts = [str(r.get("algorithm", "")), kernel(r) if r.get("bench") != "longest" or r.get("backend") else "", str(r.get("ac") or ""),
             "compiled" if r.get("compiled") else "", f"{r['uncheckpointed_blocks']} blocks unckpt" if r.get("uncheckpointed_blocks") else "",
             f"head chunks {r['head_chunks']}" if (r.get("head_chunks") or 1) > 1 else "", "offloaded ckpts" if r.get("offload_checkpoints") else "",
             f"MLP slices {r['mlp_chunk_size'] >> 10}K" if r.get("mlp_chunk_size") else "", "offload_params" if r.get("offload_params") else ""]
    return ", ".join(p for p in parts if p and p != "None")


# ---- the tables ------------------------------------------------------------------------------------

def train_table(rows: list[dict]) -> str:
    """Training throughput, ours (each kernel) against both peers, per model / S / GPUs."""
    recs = [r for r in rows if r.get("bench") == "train" and str(r.get("model", "")).startswith("llama") and _throughput_run(r)]
    groups: dict[tuple, list[dict]] = {}
    for r in recs:
        groups.setdefault((r["model"], r["seq"], r["gpus"]), []).append(r)
    out = []
    for (model, seq, gpus), g in sorted(groups.items(), key=lambda kv: kv[0]):
        peers = {s: best_of_last_commit([r for r in g if r["system"] == s], "tokens_per_s_per_gpu") for s in PEERS}
        ours = [best_of_last_commit([r for r in g if r["system"] == "seqpar" and kernel(r) == k], "tokens_per_s_per_gpu")
                for k in ("fa4", "cuDNN")]
        for i, r in enumerate([x for x in ours if x] + [x for x in peers.values() if x]):
            cell = f'<a id="{anchor("train", model, seq_k(seq), gpus)}"></a>{model}' if i == 0 else model
            mine = r["system"] == "seqpar"
            t = _num(r, "tokens_per_s_per_gpu")
            out.append([cell, seq_k(seq), str(gpus), NAMES[r["system"]] if not mine else f"**ours** ({kernel(r)})", setting(r),
                        f"{t:,.0f}" if t else "-", f(_num(r, "mfu"), ".3f"), f(_num(r, "peak_mem_gb"), ".1f"),
                        ratio(t, _num(peers["torch_cp"], "tokens_per_s_per_gpu"), rows=(r, peers["torch_cp"])) if mine else "",
                        ratio(t, _num(peers["tp_sp"], "tokens_per_s_per_gpu"), rows=(r, peers["tp_sp"])) if mine else "", when(r)])
    return table(["model", "S", "GPUs", "system", "setting", "tokens/s/GPU", "MFU", "peak GB", "vs torch CP", "vs TP+SP",
                  "commit, date"], out)


def longest_table(rows: list[dict]) -> str:
    recs = [r for r in rows if r.get("bench") == "longest" and not _scaling_model(r)]
    best = {(r["model"], r["gpus"], r["system"]): r for r in longest_per_config(recs, ("system", "model", "gpus"))}
    out = []
    for model, gpus in sorted({(m, g) for m, g, _ in best}, key=lambda k: (k[0], -k[1])):
        peer = {s: _num(best.get((model, gpus, s)), "seq") for s in PEERS}
        for i, (system, r) in enumerate((x, best[(model, gpus, x)]) for x in ("seqpar", *PEERS) if (model, gpus, x) in best):
            cell = f'<a id="{anchor("longest", model, gpus)}"></a>{model}' if i == 0 else model
            s = _num(r, "seq")
            attempts = ", ".join(f"{a.get('seq'):,}: {a.get('status')}" for a in r.get("attempts", []))
            longest = ("none fit" if s is None else f"{int(s):,}") + (" (lower bound)" if r.get("lower_bound") else "")
            mine = system == "seqpar"
            out.append([cell, str(gpus), NAMES[system] if not mine else "**ours**", setting({**r, "system": system}) if mine else "full AC",
                        f"**{longest}**" if mine else longest, attempts, f(_num(r, "step_time_s"), ".1f"),
                        f(_num(r, "tokens_per_s_per_gpu"), ",.0f"), f(_num(r, "mfu"), ".3f"), f(_num(r, "peak_mem_gb"), ".1f"),
                        ratio(s, peer["torch_cp"]) if mine else "", ratio(s, peer["tp_sp"]) if mine else "", when(r)])
    return table(["model", "GPUs", "system", "setting", "longest S", "attempts", "step s", "tokens/s/GPU", "MFU", "peak GB",
                  "vs torch CP", "vs TP+SP", "commit, date"], out)


def attention_table(rows: list[dict]) -> str:
    """Per heads / S / GPUs / kernel: ours fastest, ours ring with head chunks, torch CP (best rotation), one GPU."""
    recs = [r for r in rows if r.get("bench") == "attention" and r.get("heads")]
    latest = last_by(recs, lambda r: (r["system"], r.get("algorithm"), kernel(r), r.get("head_chunks") or 1, r["heads"], r["seq"], r["gpus"]))
    groups: dict[tuple, list[dict]] = {}
    for r in latest.values():
        groups.setdefault((r["heads"], r["seq"], r["gpus"]), []).append(r)
    heads_order = {"32/8": 0, "32/32": 1, "33/33": 2}
    out = []
    for heads, seq, gpus in sorted(groups, key=lambda k: (heads_order.get(k[0], 9), k[1], k[2])):
        g = groups[(heads, seq, gpus)]
        cp_ok = [r for r in g if r["system"] == "torch_cp" and _num(r, "tflops_per_gpu") is not None]
        cp = max(cp_ok, key=lambda r: _num(r, "tflops_per_gpu") or 0.0) if cp_ok else None
        cp_err = [r for r in g if r["system"] == "torch_cp" and r.get("error")]
        cp_cell = (f"{_num(cp, 'tflops_per_gpu'):.1f} ({cp['algorithm']}), {_num(cp, 'peak_mem_gb'):.1f} GB" if cp else
                   "OOM" if any("OutOfMemory" in str(r["error"]) for r in cp_err) else "-")
        single = [r for r in g if r["system"] == "single" and kernel(r) == "cuDNN" and _num(r, "tflops_per_gpu")]
        for k in ("cuDNN", "fa4"):
            ours = [r for r in g if r["system"] == "seqpar" and kernel(r) == k and _num(r, "tflops_per_gpu") is not None]
            if not ours:
                continue
            fast = max(ours, key=lambda r: _num(r, "tflops_per_gpu") or 0.0)
            rings = [r for r in ours if r.get("algorithm") == "ring"]
            ring = max(rings, key=lambda r: (r.get("head_chunks") or 1, str(r.get("_file")))) if rings else None
            tf = lambda r: _num(r, "tflops_per_gpu")  # noqa: E731
            mem = lambda r: _num(r, "peak_mem_gb")  # noqa: E731
            first = not any(row[0].endswith(f"</a>{heads}") and row[1:3] == [seq_k(seq), str(gpus)] for row in out)
            out.append([f'<a id="{anchor("attention", heads, seq_k(seq), gpus)}"></a>{heads}' if first else heads, seq_k(seq), str(gpus), k,
                        f"{tf(fast):.1f} ({fast['algorithm']}{', chunks ' + str(fast['head_chunks']) if (fast.get('head_chunks') or 1) > 1 else ''})",
                        f"{tf(ring):.1f} (chunks {ring.get('head_chunks') or 1}), {mem(ring):.1f} GB" if ring else "-",
                        cp_cell, f(tf(single[0]), ".1f") if single else "-", ratio(tf(fast), tf(cp), rows=(fast, cp)),
                        ratio(tf(ring), tf(cp), rows=(ring, cp)) if ring else "-",
                        ratio(mem(ring), mem(cp), rows=(ring, cp)) if ring else "-",
                        when(*[r for r in (fast, ring, cp) if r])])
    return table(["heads q/kv", "S", "GPUs", "our kernel", "ours: fastest TFLOP/s/GPU", "ours: ring", "torch CP (cuDNN)", "one GPU",
                  "fastest vs CP", "ring vs CP", "ring memory vs CP", "commit, date"], out)


def scaling_table(rows: list[dict]) -> str:
    recs = [r for r in rows if r.get("bench") == "train" and _scaling_model(r) and r.get("tag") != "max-seq"]
    out = []
    for model, variant_key in (("tnl-1b", "lasp_variant"), ("lss-gpt-1.5b", "kv_comm")):
        g = [r for r in recs if r["model"] == model]
        if not g:
            continue
        commit = g[-1].get("commit")
        last = last_by([r for r in g if r.get("commit") == commit], lambda r: (r["gpus"], r.get(variant_key)))
        one = [r for r in last.values() if r["gpus"] == 1]
        base = _num(one[0], "tokens_per_s_per_gpu") if one else None
        for i, ((gpus, variant), r) in enumerate(sorted(last.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))):
            t = _num(r, "tokens_per_s_per_gpu")
            cell = f'<a id="{anchor("scaling", model)}"></a>{model}' if i == 0 else model
            out.append([cell, str(gpus), f"{r.get('tokens_per_gpu', 0):,}", f"{r.get('algorithm')}, {variant_key} {variant}",
                        f"{t:,.0f}" if t else "-", f(t / base if t and base else None, ".3f"), f(_num(r, "mfu"), ".3f"),
                        f(_num(r, "peak_mem_gb"), ".1f"), when(r)])
    # the longest TNL-1B sequence: train_scaling.py's "train_max_seq" records (and the train record at that S), or longest.py's
    for r in [r for r in rows if r.get("bench") == "train_max_seq" or r.get("bench") == "longest" and _scaling_model(r)][-1:]:
        if r["bench"] == "longest":
            r = x = {**r, "max_seq": r.get("seq"), "tokens_per_gpu": (r.get("seq") or 0) // r["gpus"]}
        else:
            x = ([x for x in rows if x.get("bench") == "train" and x.get("tag") == "max-seq" and x.get("seq") == r.get("max_seq")] or [{}])[-1]
        out.append([f'<a id="{anchor("scaling", "longest", r["model"])}"></a>{r["model"]} (longest)', str(r["gpus"]),
                    f"{r.get('tokens_per_gpu', 0):,}", f"{r.get('algorithm')}, {r.get('ac')} AC; S = **{r['max_seq'] or 0:,}**",
                    f(_num(x, "tokens_per_s_per_gpu"), ",.0f"), "", f(_num(x, "mfu"), ".3f"), f(_num(x, "peak_mem_gb"), ".1f"),
                    when({**r, "_file": r.get("_file", "")})])
    return table(["model", "GPUs", "tokens/GPU", "setting", "tokens/s/GPU", "vs 1 GPU", "MFU", "peak GB", "commit, date"], out)


def lasp_op_table(rows: list[dict]) -> str:
    recs = [r for r in rows if r.get("bench") == "lasp_op"]
    if not recs:
        return ""
    commit = recs[-1].get("commit")
    last = last_by([r for r in recs if r.get("commit") == commit], lambda r: (r["tokens_per_gpu"], r["algorithm"]))
    out = []
    for tok in sorted({t for t, _ in last}):
        c = {a: last.get((tok, a)) for a in ("local", "lasp-p2p", "lasp-allgather")}
        any_r = next(r for r in c.values() if r)
        out.append([f"{tok:,}", str(any_r["gpus"]), str(any_r.get("kernel"))]
                   + [f(_num(c[a], "time_ms"), ".2f") for a in c] + [when(any_r)])
    return table(["tokens/GPU", "GPUs", "kernel", "one GPU's share alone, ms", "LASP p2p, ms", "LASP all-gather, ms", "commit, date"], out)


def hf_table(rows: list[dict]) -> str:
    """The HF model and the native runs of the same commit."""
    hf = [r for r in rows if r.get("bench") == "train" and str(r.get("model", "")).startswith("hf-")]
    out = []
    for r in hf:
        same = [x for x in rows if x.get("bench") == "train" and x.get("commit") == r.get("commit") and x is not r
                and x.get("seq") == r.get("seq") and x.get("gpus") == r.get("gpus") and str(x.get("model", "")).startswith("llama")]
        for i, x in enumerate([r, *same]):
            doc = f"packed documents, mean {x['mean_doc']:,}" if x.get("documents") else "one sequence"
            cell = f'<a id="{anchor("hf", r["model"], seq_k(r["seq"]))}"></a>{x["model"]}' if i == 0 else x["model"]
            out.append([cell, seq_k(x["seq"]), str(x["gpus"]), NAMES.get(x["system"], x["system"]) if x["system"] != "seqpar" else "**ours**",
                        f"{x.get('algorithm')}, {doc}", f(_num(x, "tokens_per_s_per_gpu"), ",.0f"), f(_num(x, "mfu"), ".3f"),
                        f(_num(x, "peak_mem_gb"), ".1f"), when(x)])
    return table(["model", "S", "GPUs", "system", "setting", "tokens/s/GPU", "MFU", "peak GB", "commit, date"], out)


def one_gpu_table(rows: list[dict]) -> str:
    local = last_by([r for r in rows if r.get("bench") == "local"], lambda r: (r["system"], r["backend"], r["seq"], r["hq"], r["hkv"]))
    out = []
    for seq, hq, hkv in sorted({(s, q, k) for _, _, s, q, k in local}):
        for backend in ("cudnn", "flash", "efficient"):
            ours, sdpa = local.get(("seqpar", backend, seq, hq, hkv)), local.get(("torch_sdpa", backend, seq, hq, hkv))
            if ours is None:
                continue
            out.append([f"{hq}/{hkv}", seq_k(seq), backend, f(_num(ours, "tflops"), ".1f"), f(_num(sdpa, "tflops"), ".1f"),
                        ratio(_num(ours, "tflops"), _num(sdpa, "tflops")), when({**ours, "commit": ours.get("commit", "-")})])
    mm = [r for r in rows if r.get("bench") == "matmul"]
    if mm:
        r = mm[-1]
        out.append(["bf16 matmul", f"n = {r.get('n')}", "torch.mm", f(_num(r, "tflops"), ".1f"), "", "", when(r)])
    return table(["heads q/kv", "S", "kernel", "ours (block ops) TFLOP/s", "torch SDPA TFLOP/s", "ours vs SDPA", "commit, date"], out)


def optimizer_table(rows: list[dict]) -> str:
    recs = [r for r in rows if r.get("bench") == "offload_optimizer"]
    if not recs:
        return ""
    commit = recs[-1].get("commit")
    last = last_by([r for r in recs if r.get("commit") == commit], lambda r: (r["algorithm"], r["threads"]))
    threads = sorted({t for _, t in last})
    out = [[a, *[f(_num(last.get((a, t)), "step_s"), ".2f") for t in threads], when(next(r for k, r in last.items() if k[0] == a))]
           for a in ("forloop", "foreach", "fused") if any(k[0] == a for k in last)]
    model = f"{recs[-1]['model']} over {recs[-1]['gpus']} ranks, {recs[-1]['params_per_rank']:,} parameters per rank"
    return (f"One rank's AdamW step over its host shards ({model}):\n\n"
            + table(["AdamW implementation", *[f"{t} thread{'s' if t > 1 else ''}: s/step" for t in threads], "commit, date"], out))


def suites_table(rows: list[dict]) -> str:
    """The suites of benchmarks/suites.py and the command that runs each (records are not read)."""
    from suites import SUITES

    out = []
    for s in SUITES.values():
        cmds = "<br>".join(f"`python -m benchmarks run {s.name} --gpus {g}`" for g in sorted(s.runs))
        runs = "; ".join(f"{g} GPUs: " + ", ".join(r.name for r in s.runs[g]) for g in sorted(s.runs))
        out.append([f"`{s.name}`", s.question, cmds, f"[below](#{s.table})" if s.table else "logs only", runs])
    return table(["suite", "what it measures", "command (one per machine size)", "table", "runs (`--only` names)"], out)


GRID_COLUMNS = (("seqpar", "ring", "ring"), ("seqpar", "allgather", "all-gather"), ("seqpar", "ulysses", "Ulysses"),
                *(("seqpar", f"2d:{hp}x{cp}", f"2D {hp}x{cp}") for hp, cp in ((2, 2), (8, 1), (4, 2), (2, 4), (1, 8))),
                ("seqpar", "ring:inner2", "double ring (2)"), ("seqpar", "ring:inner4", "double ring (4)"),
                ("torch_cp", "allgather", "torch CP allgather"), ("torch_cp", "alltoall", "torch CP alltoall"))


def attention_grid(rows: list[dict], seqs: list[int] | None = None) -> str:
    """Every algorithm of ours and both torch CP rotations, cuDNN, a table per (GPUs, S): per heads, each system's
    TFLOP/s/GPU / peak GB (the latest record of each head-chunk count, the fastest of those; "c<n>": head chunks),
    the best of ours bold, and the ratios of the best of ours to the best torch CP and to one GPU (the latest
    one-GPU record at that S and heads, from any run)."""
    latest: dict[tuple, dict] = {}
    for r in rows:  # later records win
        if (r.get("bench") == "attention" and r.get("heads") and (r["system"] == "torch_cp" or r.get("backend", "cudnn") == "cudnn")
                and (not seqs or r["seq"] in seqs)):
            latest[(r["gpus"], r["seq"], r["heads"], r["system"], r["algorithm"] if r["system"] != "single" else "", r.get("head_chunks", 1))] = r
    ok = lambda r: r is not None and r.get("tflops_per_gpu") and not r.get("error")  # noqa: E731

    def cell(gpus, S, heads, system, algorithm):
        cands = [r for k, r in latest.items() if k[:5] == (gpus, S, heads, system, algorithm)]
        good = [r for r in cands if ok(r)]
        if good:
            r = max(good, key=lambda r: r["tflops_per_gpu"])
            return r, f"{r['tflops_per_gpu']:.1f} / {r['peak_mem_gb']:.1f}" + (f" c{r['head_chunks']}" if r.get("head_chunks", 1) > 1 else "")
        errs = [r["error"] for r in cands if r.get("error")]
        hp = gpus if (system, algorithm) == ("seqpar", "ulysses") else int(algorithm[3:].split("x")[0]) if algorithm.startswith("2d:") else 1
        if int(heads.split("/")[0]) % hp or any("divide" in e and "head-parallel" in e for e in errs):
            return None, f"({heads.split('/')[0]} heads)"  # a head-parallel split that does not divide the heads
        return None, "OOM" if any("OutOfMemory" in e for e in errs) else "-"

    out = []
    for gpus, S in sorted({(k[0], k[1]) for k in latest if k[3] != "single"}):
        cols = [c for c in GRID_COLUMNS if any(k[:2] == (gpus, S) and (k[3], k[4]) == c[:2] for k in latest)]
        out += [f"{gpus} GPUs, S = {S // 1024}K (TFLOP/s/GPU / peak GB):", "",
                "| heads | one GPU | " + " | ".join(c[2] for c in cols) + " | ours / torch CP | ours / one GPU |", "| --- " * (len(cols) + 4) + "|"]
        for heads in sorted({k[2] for k in latest if k[:2] == (gpus, S)}, key=lambda h: (int(h.split("/")[0]), -int(h.split("/")[1]))):
            cells = [cell(gpus, S, heads, *c[:2]) for c in cols]
            best = max((r for (r, _), c in zip(cells, cols) if r and c[0] == "seqpar"), key=lambda r: r["tflops_per_gpu"], default=None)
            cp = max((r["tflops_per_gpu"] for (r, _), c in zip(cells, cols) if r and c[0] == "torch_cp"), default=None)
            one = ([r for k, r in latest.items() if k[1:4] == (S, heads, "single") and ok(r)] or [None])[-1]
            ratios = [f"{best['tflops_per_gpu'] / b:.3f}" if best and b else "-" for b in (cp, one and one["tflops_per_gpu"])]
            one_text = f"{one['tflops_per_gpu']:.1f} / {one['peak_mem_gb']:.1f}" if one else "-"
            out.append(f"| {heads} | {one_text} | " + " | ".join(f"**{t}**" if r is best and r else t for r, t in cells) + f" | {' | '.join(ratios)} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


# Runs of hf.py families whose defaults or kernels have changed since (a newer run of the same model measures what a
# user gets now): kept in the records and told in docs/benchmarks-history.md, left out of the table.
HF_FAMILY_SUPERSEDED = {("llama3.2-1b-shaped", label) for label in ("ec47d6c+ac", "ddbfbf9", "d612a18+fa4", "2fad92d+fa4")} | {
    ("qwen3-next-shaped", label) for label in ("8396b70", "36e593f")}
HF_FAMILY_HISTORY = {("llama3.2-1b-shaped", label) for label in ("3a6f063+kernel", "328d3b1+12steps")}
"""Shown in docs/benchmarks-history.md's copy of the table only (``hf-family-all``): rows a later run of the same
machine kind repeats (docs/benchmarks.md shows the newest)."""


def hf_family_table(rows: list[dict], *, every: bool = False) -> str:
    """hf.py families on one GPU: the latest run of each (model, S, system, our settings, device, commit label); the
    ratio only against plain transformers of the same commit label (the same machine, warm). ``every``: the rows of
    ``HF_FAMILY_HISTORY`` too (the history's copy)."""
    def settings(r: dict) -> str:  # our non-default strategy settings, as the row names them
        options = {"attention_backend": r.get("attention_backend"), **(r.get("strategy_options") or {})}
        text = ", ".join(f"{k}={v}" for k, v in options.items() if v is not None)
        if r.get("kernel") and r.get("attention_backend") == "auto":  # what "auto" ran, and whether the `gpu` extra was there
            extra = {True: ", FA4 installed", False: ", no FA4"}.get(r.get("fa4_installed"), "")
            text += f" -> {r['kernel']}{extra}"
        # Note [Fused kernels in transformers models]; recorded from 2026-11-27 (4 x H200, 6fc01fb) on
        text += {True: ", fused norms / MLP", False: ", torch norms / MLP"}.get(r.get("fused_kernels"), "")
        return text

    hidden = HF_FAMILY_SUPERSEDED | (set() if every else HF_FAMILY_HISTORY)
    runs = last_by([r for r in rows if r.get("bench") == "hf_family" and (r["model"], r.get("commit")) not in hidden],
                   lambda r: (r["model"], r["seq"], r["system"], settings(r), r.get("device", "?"), r.get("commit", "?")))
    out = []
    for (model, seq, system, kernel, device, commit), r in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][4], kv[0][5],
                                                                                                   kv[0][2] != "seqpar", kv[0][3])):
        peer = runs.get((model, seq, "transformers", "", device, commit)) if system == "seqpar" else None
        speed = ratio(_num(r, "tokens_per_s"), _num(peer, "tokens_per_s")) if peer and "error" not in peer else "·"
        name = ("**ours**" + (f" ({kernel})" if kernel else "") if system == "seqpar"
                else f"transformers ({r.get('attn', '?')})")
        first = not out or model != out[-1][0].rsplit("</a>", 1)[-1]  # one anchor per model (README rows link there)
        cell = f'<a id="{anchor("hf-family", model)}"></a>{model}' if first else model
        out.append([cell, seq_k(seq), name, f(_num(r, "tokens_per_s"), ",.0f") if "error" not in r else "out of memory"
                    if "out of memory" in r["error"] else r["error"][:40], f(_num(r, "peak_mem_gb"), ".1f"), speed,
                    f"{r.get('device', '?')}, {when(r)}"])
    return table(["model", "S", "system", "tokens/s", "peak GB", "ours / transformers", "device, commit, date"], out)


def window_table(rows: list[dict]) -> str:
    """attention.py window: a window's step time as a share of full causal attention's, the latest run per device."""
    timed = last_by([r for r in rows if r.get("bench") == "window_time"],
                    lambda r: (r.get("device"), r["kernel"], r["seq_len"], r["window"], r["head_dim"]))
    out = []
    for (device, kernel, seq, window, d), r in sorted(timed.items(), key=lambda kv: (str(kv[0][0]), kv[0][4], kv[0][1])):
        out.append([str(device), seq_k(seq), f"{window:,}", str(d), kernel, f(_num(r, "seconds") * 1e3 if _num(r, "seconds") else None, ".1f"),
                    f(_num(r, "tflops"), ".0f"), f(_num(r, "ratio_to_causal"), ".4f"), f(_num(r, "goal_ratio"), ".4f"), when(r)])
    return table(["device", "S", "window", "D", "kernel", "ms", "TFLOP/s", "time / causal", "goal (1.2 x FLOP share)", "commit, date"], out)


_FINETUNE_SYSTEMS = {"seqpar": "**ours** (memory=\"auto\")", "transformers": "transformers + peft (SDPA, HF checkpointing)",
                     "alst": "ALST (DeepSpeed 0.19.8, one GPU)"}


def _failure(error: str) -> str:
    """A failed run's cell: "host out of memory" (Note [The host-memory watchdog] in benchmarks/driver.py), "out of
    memory" (the GPU's), or the error's start."""
    return ("host out of memory" if error.startswith("host out of memory") else "out of memory" if "out of memory" in error
            else error[:40])


def _frontier_run(r: dict) -> bool:
    """A run of the one-GPU frontier (issue #56): ALST's own offload recipe, or ours with fp32 master weights beside it."""
    return (r.get("bench") == "alst" and str(r.get("recipe", "")).startswith("ArcticTraining")) or (
        r.get("bench") == "memory_plan" and r.get("precision") == "bf16-mixed")


_LAYERS_SUFFIX = re.compile(r"-(\d+)-layers$")


def _fewer_layers(r: dict) -> bool:
    """A run of a model's width with fewer layers than its own (``--layers N`` of alst.py and hf.py memory: the model's
    name ends in ``-N-layers``): not a full-depth figure."""
    full, layers = r.get("full_depth_layers"), r.get("layers")
    return bool(_LAYERS_SUFFIX.search(str(r.get("model", "")))) or (
        isinstance(full, int) and isinstance(layers, int) and layers < full)


def finetune_table(rows: list[dict]) -> str:
    """hf.py memory (ours with memory="auto", plain transformers + peft) and alst.py on one GPU: the latest run of each
    (device, model, S, system), 2 optimizer steps each; ours with the planner's estimate."""
    runs = last_by([r for r in rows if r.get("bench") in ("memory_plan", "alst") and not r.get("plan_seq") and not r.get("options")
                    and r.get("memory") != "manual" and not _frontier_run(r)],
                   lambda r: (r.get("device", "?"), r["model"], r["seq"], r["system"]))
    order = {"seqpar": 0, "transformers": 1, "alst": 2}
    out = []
    for (device, model, seq, system), r in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], order.get(kv[0][3], 9))):
        error = r.get("error")
        if error and error.startswith("skipped"):
            continue
        peer = runs.get((device, model, seq, "transformers")) if system != "transformers" else None
        speed = ratio(_num(r, "tokens_per_s"), _num(peer, "tokens_per_s")) if peer and not peer.get("error") and not error else "·"
        est = _num(r, "estimate_allocated_gb")
        plan = r.get("plan") or {}
        options = ", ".join(k if v is True else f"{k}={v}" for k, v in plan.items()
                            if v is True or not isinstance(v, bool) and v not in (None, 1, "selective++")) or (
            "defaults" if plan else "")
        tokens = _failure(error) if error else f(_num(r, "tokens_per_s"), ",.0f")
        done, steps = r.get("global_step"), r.get("steps")
        if not error and done is not None and steps and done < steps:  # a run split over several 10-minute runs, not finished
            tokens += f" ({done} of {steps} steps)"
        peak = _num(r, "peak_mem_gb")
        if not error and r.get("resumed_from_step"):  # the later steps of a run split over several 10-minute runs
            before = [b for b in rows if b.get("bench") == r["bench"] and b.get("commit") == r.get("commit")
                      and (b.get("device"), b["model"], b["seq"], b["system"]) == (device, model, seq, system)
                      and b.get("global_step") == r["resumed_from_step"] and not b.get("error") and not b.get("plan_seq")]
            if before:
                peak = max([peak] + [_num(b, "peak_mem_gb") for b in before if _num(b, "peak_mem_gb")])
                tokens += f" ({done} steps; from step {r['resumed_from_step'] + 1}, resumed from a checkpoint in a second run)"
        per_gb = f(seq / peak, ",.0f") if not error and peak else "-"
        out.append([model.removeprefix("hf-"), seq_k(seq), _FINETUNE_SYSTEMS.get(system, system), tokens,
                    f(peak, ".1f") if not error else f"> {peak:.1f}" if peak else "-",
                    f(est, ".1f") if est else "·", options or "·", per_gb, speed, f"{device}, {when(r)}"])
    return table(["model", "S", "system", "tokens/s", "peak GB", "planner estimate GB", "planner's options", "tokens per GB",
                  "tokens/s vs transformers", "device, commit, date"], out)


def frontier_table(rows: list[dict]) -> str:
    """The one-GPU frontier (issue #56): a full fine-tune, ours (memory="auto", bf16-mixed: fp32 master weights) against
    ALST's own offload recipe (benchmarks/alst.py --recipe offload: ZeRO-3, fp32 masters on the host), same machine;
    the latest run of each (device, model, S, system). Memory: the allocator's peak reserved (and allocated) GB, the
    process's peak host RSS."""
    runs = last_by([r for r in rows if _frontier_run(r) and not _fewer_layers(r)],
                   lambda r: (r.get("device", "?"), r["model"], r["seq"], r["system"]))
    out = []
    for (device, model, seq, system), r in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2], kv[0][3] != "seqpar")):
        error = r.get("error")
        alst = runs.get((device, model, seq, "alst")) if system == "seqpar" else None
        speed = ratio(_num(r, "tokens_per_s"), _num(alst, "tokens_per_s")) if alst and not alst.get("error") and not error else "·"
        if system == "seqpar":
            plan = r.get("plan") or {}
            how = "memory=\"auto\": " + (", ".join(k if v is True else f"{k}={v}" for k, v in plan.items()
                                                  if v is True or not isinstance(v, bool) and v not in (None, 1)) or "defaults")
            label = "**ours**"
        else:
            how = f"ZeRO-3 offload, {r.get('optimizer')}, Liger ({r.get('liger')}), TiledMLP, checkpoint offload, {r.get('attention')}"
            label = f"ALST's recipe (DeepSpeed {r.get('deepspeed')})"
        tokens = _failure(error) if error else f(_num(r, "tokens_per_s"), ",.0f")
        anchor = "" if out else '<a id="frontier-one-gpu"></a>'  # the README links to the table's first row
        out.append([anchor + model.removeprefix("hf-"), seq_k(seq), label, how, "fp32", tokens, speed, f(_num(r, "peak_reserved_gb"), ".1f"),
                    f(_num(r, "peak_mem_gb"), ".1f"), f(_num(r, "host_maxrss_gb"), ".1f"), f"{device}, {when(r)}"])
    return table(["model", "S", "system", "settings", "master weights", "tokens/s", "vs ALST", "peak reserved GB",
                  "peak allocated GB", "host peak GB", "device, commit, date"], out)


def frontier_layers_table(rows: list[dict]) -> str:
    """The longest by memory (issue #56): the frontier's runs of a model's width with fewer layers (``--layers N``, where
    a full-depth step is longer than one 10-minute run), the latest of each (device, model, S, system). GB per layer:
    the difference of two depths' peak allocated at the same S where both ran, else (ours) what each layer keeps for
    its backward (``kept_bytes_per_token_per_layer`` x S). The planner's estimates, GPU / host GB: ours for the N-layer
    run and for the full depth with the options the N-layer run ran with (Note [The longest by memory] in
    benchmarks/hf.py), and whether those fit the planner's budget of the device and the host; ALST's full depth: its
    recipe's host memory (ZeRO-3's ~18 bytes a parameter and the offloaded checkpoints) against the host's."""
    runs = last_by([r for r in rows if _frontier_run(r) and _fewer_layers(r)],
                   lambda r: (r.get("device", "?"), r["model"], r["seq"], r["system"]))

    def width(model: str) -> str:
        return _LAYERS_SUFFIX.sub("", model).removeprefix("hf-")

    def per_layer(r: dict) -> str:
        key = (r.get("device", "?"), width(r["model"]), r["seq"], r["system"])
        other = [o for o in runs.values() if o is not r and not o.get("error") and o.get("layers") != r.get("layers")
                 and (o.get("device", "?"), width(o["model"]), o["seq"], o["system"]) == key]
        if not r.get("error") and other and _num(r, "peak_mem_gb") is not None and _num(other[0], "peak_mem_gb") is not None:
            return f"{(r['peak_mem_gb'] - other[0]['peak_mem_gb']) / (r['layers'] - other[0]['layers']):.2f} (two depths)"
        kept = _num(r, "kept_bytes_per_token_per_layer")
        return f"{kept * r['seq'] / 1e9:.2f} (kept)" if kept and not r.get("error") else "·"

    def pair(a: float | None, b: float | None) -> str:
        return "·" if a is None else f"{a:.1f} / {f(b, '.1f')}"

    out = []
    for (device, model, seq, system), r in sorted(runs.items(), key=lambda kv: (kv[0][0], width(kv[0][1]), kv[0][2],
                                                                                  kv[1].get("layers") or 0, kv[0][3] != "seqpar")):
        error = r.get("error")
        full_layers = r.get("full_depth_layers")
        if system == "seqpar":
            label = "**ours**"
            estimate = pair(_num(r, "estimate_gb"), _num(r, "estimate_host_gb"))
            full = pair(_num(r, "full_depth_estimate_gb"), _num(r, "full_depth_estimate_host_gb"))
            fits = r.get("full_depth_fits") or {}
            fit = ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in fits.items()) or "·"
            chosen = r.get("full_depth_plan")
            if chosen is not None:
                fit += "; planner: " + (", ".join(k if v is True else f"{k}={v}" for k, v in chosen.items()) or "defaults")
            elif r.get("full_depth_refusal"):
                longest = r.get("full_depth_longest_seq")
                fit += "; planner refuses" + (f" (longest {seq_k(longest)})" if longest else "")
        else:
            label = f"ALST's recipe (DeepSpeed {r.get('deepspeed')})"
            estimate = "·"
            host = sum(_num(r, k) or 0.0 for k in ("full_depth_zero_host_gb_estimate", "full_depth_offload_host_gb_estimate"))
            full = f"· / {host:.1f}" if host else "·"
            total = _num(r, "host_memory_gb")
            fit = f"host {'yes' if host <= total else 'no'} (of {total:.0f})" if host and total else "·"
        out.append([width(model), f"{r.get('layers', '?')} of {full_layers or '?'}", seq_k(seq), label,
                    _failure(error) if error else f(_num(r, "tokens_per_s"), ",.0f") + (" (first step)" if r.get("steps") == 1 else ""),
                    f(_num(r, "peak_reserved_gb"), ".1f"),
                    f(_num(r, "peak_mem_gb"), ".1f"), f(_num(r, "host_maxrss_gb"), ".1f"), per_layer(r), estimate, full, fit,
                    f"{device}, {when(r)}"])
    return table(["model (width)", "layers run", "S", "system", "tokens/s", "peak reserved GB", "peak allocated GB", "host peak GB",
                  "GB per layer", "planner, N layers: GPU / host GB", "full depth: GPU / host GB", "full depth fits",
                  "device, commit, date"], out)


def delta_rule_table(rows: list[dict]) -> str:
    """attention.py scan: one layer's forward + backward; per (device, S, GPUs, documents) the latest record of each
    (system, commit), ours first (the last record not marked ``baseline``, the package's code before a change measured
    beside it); "row's time / ours" is the row's time over ours'."""
    runs = last_by([r for r in rows if r.get("bench") in ("delta_rule", "ssd_scan") or (r.get("bench") == "selective_scan" and r.get("gpus", 1) > 1)],
                   lambda r: (r["bench"], r.get("device"), r["seq"], r["gpus"], r.get("documents") or 0, r["system"], r["commit"],
                             r.get("state_passing")))
    groups: dict[tuple, list[dict]] = {}
    for key, r in runs.items():
        groups.setdefault(key[:5], []).append(r)
    out = []
    for (bench, device, seq, gpus, docs), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][3], kv[0][4], kv[0][2])):
        if all(r.get("error") for r in rs if r["system"] == "seqpar"):
            continue
        ours = [r for r in rs if r["system"] == "seqpar" and not r.get("baseline") and not r.get("error")]  # baseline: the code before, same call
        latest = ours[-1] if ours else None
        # ours: the latest; earlier records of ours that are not a baseline are superseded (not shown)
        chain = [r for r in rs if r.get("state_passing") == "chain"][-1:]  # the latest chain-forced run only
        ordered = ([latest] if latest else []) + [r for r in rs if r is not latest and (r["system"] != "seqpar" or r.get("baseline"))
                                                  and (r.get("state_passing") != "chain" or r in chain)]
        for r in ordered:
            before = "ours, states down the chain" if r.get("state_passing") == "chain" else f"ours before ({r['commit']})"
            name = ("**ours**" if r is latest else before) if r["system"] == "seqpar" else \
                f"{r['system']} (torch path)" if r["system"] == "transformers" else \
                "fla-core (Triton 3.7.1 carried)" if r["system"] == "fla" else r["system"]
            error = r.get("error")
            speed = ratio(_num(r, "time_ms"), _num(latest, "time_ms")) if latest is not None and r is not latest and not error else "·"
            ms = ("out of memory" if "out of memory" in error else error[:40]) if error else f(_num(r, "time_ms"), ",.1f")
            layer = ("gated delta rule (Qwen3-Next)" if bench == "delta_rule" else "Mamba2 SSD (Bamba-9B)" if bench == "ssd_scan"
                     else f"Mamba1 selective scan (d_inner {r.get('channels')}, state {r.get('state')})")
            out.append([layer, seq_k(seq), str(gpus), str(docs or "-"), name, ms, f(_num(r, "tokens_per_s"), ",.0f"),
                        f(_num(r, "peak_mem_gb"), ".1f"), speed, f"{device}, {when(r)}"])
    return table(["layer", "S", "GPUs", "documents", "system", "fwd + bwd ms", "tokens/s", "peak GB", "row's time / ours",
                  "device, commit, date"], out)


_HF_FAMILY_LABELS = {"gemma3": "gemma3-shaped (5 sliding : 1 global)", "gpt-oss": "gpt-oss-shaped (sinks, sliding, MoE)",
                      "qwen3-next": "qwen3-next-shaped (gated DeltaNet 3 : 1)",
                      "llama3-8b-lora": "llama3-8b-shaped, LoRA r=16 all-linear, bf16_adapters"}


def hf_families_gpus_table(rows: list[dict]) -> str:
    """hf.py families under torchrun: the latest run that trained, per (device, GPUs, S, shape)."""
    runs = last_by([r for r in rows if r.get("bench") == "hf-families" and not r.get("error")],
                   lambda r: (r.get("device"), r["gpus"], r["seq"], r["shape"], r.get("documents") or 0, r.get("state_passing") or "parallel"))
    order = list(_HF_FAMILY_LABELS)
    out = []
    for (device, gpus, seq, shape, docs, passing), r in sorted(
            runs.items(), key=lambda kv: (str(kv[0][0]), kv[0][1], kv[0][2], order.index(kv[0][3]) if kv[0][3] in order else 9,
                                          kv[0][4], kv[0][5] != "parallel")):
        states = " + states down the chain (SEQPAR_STATE_CHAIN=1)" if passing == "chain" else " + state passing"
        algorithm = r.get("algorithm", "?") + (states if shape == "qwen3-next" else "")
        out.append([_HF_FAMILY_LABELS.get(shape, shape), str(gpus), seq_k(seq), str(docs or "-"), algorithm,
                    f(_num(r, "tokens_per_s_per_gpu"), ",.0f"), f(_num(r, "mfu"), ".3f"), f(_num(r, "peak_mem_gb"), ".1f"),
                    f"{device}, {when(r)}"])
    return table(["model", "GPUs", "S", "documents", "algorithm (auto)", "tokens/s/GPU", "MFU", "peak GB", "device, commit, date"], out)


def _peers_report():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers", "report.py")
    spec = importlib.util.spec_from_file_location("benchmarks_peers_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def peers_table(rows: list[dict]) -> str:
    """The peers from their own code beside ours (``benchmarks/peers/report.py``, which reads the results files itself:
    a ratio is taken within one file, one run group), the newest group of each model, length and GPUs; profiled steps
    left out. ``rows`` is not read."""
    module = _peers_report()
    return "\n".join(module.table(module.records(), newest_only=True))


def peers_all_table(rows: list[dict]) -> str:
    """The peers table with every run group (docs/benchmarks-history.md); ``rows`` is not read."""
    module = _peers_report()
    return "\n".join(module.table(module.records()))


def peers_longest_table(rows: list[dict]) -> str:
    """The longest length each system trained per run group, and what stopped the next (``benchmarks/peers/report.py``)."""
    module = _peers_report()
    return "\n".join(module.longest(module.records()))


def peers_where_table(rows: list[dict]) -> str:
    """Where each system's profiled step goes, side by side (``benchmarks/peers/report.py``: ``where_table``)."""
    module = _peers_report()
    return "\n".join(module.where_table(module.records()))


def own_model_table(rows: list[dict]) -> str:
    """A model of the user's own (LitGPT) against the package's model and plain LitGPT (``benchmarks/peers/report.py``)."""
    module = _peers_report()
    return "\n".join(module.own_model_table(module.own_model_records()))


TABLES: dict[str, Callable[[list[dict]], str]] = {
    "own-model": own_model_table,
    "peers": peers_table, "peers-all": peers_all_table, "peers-longest": peers_longest_table, "peers-where": peers_where_table,
    "hf-families-gpus": hf_families_gpus_table,
    "delta-rule": delta_rule_table,
    "hf-family": hf_family_table, "hf-family-all": lambda rows: hf_family_table(rows, every=True), "window": window_table, "finetune-one-gpu": finetune_table,
    "frontier-one-gpu": frontier_table, "frontier-layers": frontier_layers_table,
    "attention-grid": attention_grid,
    "suites": suites_table,
    "train": train_table, "longest": longest_table, "attention": attention_table, "scaling": scaling_table,
    "lasp-op": lasp_op_table, "hf": hf_table, "one-gpu": one_gpu_table, "offload-optimizer": optimizer_table,
}


def records(pattern: str = RESULTS) -> list[dict]:
    return load(glob.glob(pattern))


def render(doc: str, rows: list[dict]) -> str:
    """``doc`` with every generated block replaced by its table from ``rows``."""
    def sub(m: re.Match) -> str:
        name = m[1]
        if name not in TABLES:
            raise ValueError(f"a document names a generated table {name!r}; known: {', '.join(TABLES)}")
        return f"<!-- generated: {name} -->\n{TABLES[name](rows)}\n<!-- end: {name} -->"
    return re.sub(r"<!-- generated: ([\w-]+) -->.*?<!-- end: \1 -->", sub, doc, flags=re.S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the docs' tables are not what the records give")
    ap.add_argument("--doc", action="append", default=None,
                    help=f"a document with generated tables (repeatable; default {DOC} and {HISTORY_DOC})")
    ap.add_argument("--results", default=RESULTS, help="glob of the record files")
    args = ap.parse_args(argv)
    rows, failed = records(args.results), 0
    for path in args.doc or [DOC, HISTORY_DOC]:
        doc = open(path).read()
        new = render(doc, rows)
        if args.check:
            if new != doc:
                print(f"{path}: generated tables differ from benchmarks/results; run `python -m benchmarks tables`")
                failed = 1
            else:
                print(f"{path}: generated tables match the records")
            continue
        if new != doc:
            open(path, "w").write(new)
        print(f"{path}: {len(re.findall('<!-- generated: ', new))} tables written")
    return failed


# ---- attention="auto" replayed over every measured point (issue #7 item 4; no GPU) ------------------------

def _label_to_args(label: str) -> dict | None:
    """attention.py's algorithm label -> estimate_attention keywords (None: not a cost-model algorithm)."""
    parts = label.split(":")
    if parts[0] not in ("ring", "allgather", "ulysses", "2d"):
        return None
    kw: dict = {"algorithm": parts[0]}
    for p in parts[1:]:
        if p.startswith("inner"):
            kw["inner_ring_size"] = int(p[5:])
        elif "x" in p and parts[0] == "2d":
            kw["hp"] = int(p.split("x")[0])
    return kw


def auto_points(rows: list[dict]) -> dict:
    """{(gpus, seq, heads, backend): {label: (tflops, time_ms)}} of our attention records: the latest of a label and
    head-chunk count, the best over chunk counts."""
    latest: dict = {}
    for r in rows:
        if r.get("bench") == "attention" and r.get("system") == "seqpar" and not r.get("error") and r.get("tflops_per_gpu"):
            heads = r.get("heads") or r["model"].split("x")[0].lstrip("H")  # older records: model "H32/8xD128"
            key = (r["gpus"], r["seq"], heads, r.get("backend") or "cudnn")
            latest[(key, r["algorithm"], r.get("head_chunks") or 1)] = (r["tflops_per_gpu"], r["time_ms"] if "time_ms" in r else r["time_s"] * 1e3)
    points: dict = {}
    for (key, label, _), value in latest.items():
        if _label_to_args(label) is not None and value[0] > points.setdefault(key, {}).get(label, (0.0,))[0]:
            points[key][label] = value
    return points


def evaluate(points: dict) -> tuple[list[dict], list[tuple]]:
    """(per point where two or more of our algorithms were measured: the cost model's pick among them (the profile of
    that kernel) against the measured best; the model's time error on every run)."""
    from lightning_seqpar.attention.cost import DeviceProfile, choose_attention, estimate_attention

    decided, errors = [], []
    for (gpus, seq, heads, backend), measured in sorted(points.items()):
        hq, hkv = (int(x) for x in heads.split("/"))
        profile = DeviceProfile.for_device("NVIDIA H200", backend=backend, gpus_per_node=max(gpus, 1))
        kw = dict(seq_len=seq, num_heads=hq, num_kv_heads=hkv, head_dim=128, world_size=gpus, profile=profile)
        errors += [(estimate_attention(**kw, **_label_to_args(label)).est_time_s * 1e3 / ms - 1, gpus, seq, heads, backend, label)
                   for label, (_, ms) in measured.items()]
        if len(measured) < 2:
            continue
        ranked = [c.label for c in choose_attention(**kw).candidates]
        pick = next(label for label in ranked if label in measured)  # the model's order among what was measured
        best = max(measured, key=lambda k: measured[k][0])
        decided.append(dict(gpus=gpus, seq=seq, heads=heads, backend=backend, pick=pick, pick_tflops=measured[pick][0], best=best,
                            best_tflops=measured[best][0], ratio=measured[pick][0] / measured[best][0], first=ranked[0],
                            first_measured=ranked[0] in measured))
    return decided, errors


def auto_main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks auto", description='replay attention="auto" over every measured point')
    ap.add_argument("--results", default=RESULTS, help="glob of the record files")
    ap.add_argument("--worst", type=int, default=0, help="also the N largest time errors")
    args = ap.parse_args(argv)
    decided, errors = evaluate(auto_points(load(glob.glob(args.results))))
    for d in decided:
        print(f"W={d['gpus']} S={d['seq']:>8} H={d['heads']:>5} {d['backend']:5s} pick {d['pick']:12s} {d['pick_tflops']:6.1f}  "
              f"best {d['best']:12s} {d['best_tflops']:6.1f}  {d['ratio']:.3f} {'ok' if d['ratio'] >= 0.95 else 'MISS'}"
              f"{'' if d['first_measured'] else '  (its first choice, ' + d['first'] + ', was not measured)'}")
    rel = [e[0] for e in errors]
    print(f"{len(decided)} points, {sum(d['ratio'] < 0.95 for d in decided)} outside 5%, the model's first choice measured at "
          f"{sum(d['first_measured'] for d in decided)}; time error over {len(rel)} runs: median {statistics.median(rel):+.1%}, "
          f"range {min(rel):+.1%} .. {max(rel):+.1%}")
    for e in sorted(errors, key=lambda e: -abs(e[0]))[: args.worst]:
        print(f"  {e[0]:+.1%}  W={e[1]} S={e[2]} H={e[3]} {e[4]} {e[5]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Merge benchmark records (JSON files from a GPU run's $OUT) into benchmarks/results/<date>-<kind>.json.

    python benchmarks/collect.py --kind nvidia-h200-x4 --date 20261122 /path/to/out/*.json
    python benchmarks/collect.py --summary /path/to/out/*.json       # print a table, write nothing

The GPU machine does not know this workplace's name for it ("nvidia-h200-x4"), so the scripts there
write plain files and this step names them. Each input is a JSON list of records (or one record).
Records are checked (``REQUIRED`` below) before anything is written; the command fails with one
line per bad record otherwise. Records already in the target file, or given twice, are kept once
(identical JSON). The older files of ``benchmarks/results/`` (``20261121-nvidia-h200-x4-attention.json``
...) are valid inputs too.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

_COMMON = ("bench", "system", "algorithm", "model", "seq", "gpus", "device", "peak_mem_gb", "commit")
REQUIRED: dict[str, tuple[tuple[str, ...], ...]] = {
    # bench: groups of keys; each group must have at least one key present with a value
    "train": tuple((k,) for k in _COMMON) + (("tokens_per_s_per_gpu",), ("mfu",)),
    "attention": tuple((k,) for k in _COMMON) + (("tflops_per_gpu", "tokens_per_s_per_gpu"),),
    "longest": tuple((k,) for k in ("bench", "system", "model", "gpus", "seq", "device", "commit")),
    "matmul": (("bench",), ("device",), ("tflops",), ("commit",)),
}
"""Required keys per ``bench``. Other bench kinds (e.g. "local", "local_check") need only ``bench``."""
_MEASURED = ("peak_mem_gb", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "tflops")
"""Keys that may be null in a record of a failed measurement (one that has a non-null ``error``);
also ``seq`` of a "longest" record whose search found no S that trains."""


def append_records(path: str, rows: dict | list[dict]) -> None:
    """Append one record or a list of records to the JSON list in ``path`` (created if missing).

    The benchmark scripts call it on one rank after each measurement; collect.py merges the files later.
    """
    old = json.load(open(path)) if os.path.exists(path) else []
    with open(path, "w") as f:
        json.dump(old + (rows if isinstance(rows, list) else [rows]), f, indent=1)


def error_text(error: BaseException, limit: int = 300) -> str:
    """A failed run's error for its record: the type and the first line of the message."""
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:limit] if str(error).strip() else ''}"


def record_and_release(path: str | None, row: dict) -> None:
    """After one measurement of a one-GPU script: append ``row`` to ``path`` (when given), then free what the
    run left (collected objects, the CUDA cache, a default process group) before the next one."""
    import gc

    import torch

    if path:
        append_records(path, row)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def problems(row: Any) -> list[str]:
    """What is wrong with one record (empty when it is fine)."""
    if not isinstance(row, dict):
        return [f"not a JSON object: {str(row)[:60]}"]
    bench = row.get("bench")
    if not isinstance(bench, str):
        return ["no 'bench'"]
    failed = row.get("error") not in (None, "")
    nullable = _MEASURED + (("seq",) if bench == "longest" else ())  # a search where no S trained
    missing = []
    for group in REQUIRED.get(bench, (("bench",),)):
        ok = any(k in row and (row[k] is not None or (failed and k in nullable)) for k in group)
        if not ok:
            missing.append("|".join(group))
    out = [f"missing or null {', '.join(missing)}"] if missing else []
    for key in ("seq", "gpus"):
        if key in row and row[key] is not None and not (isinstance(row[key], int) and row[key] > 0):
            out.append(f"{key} must be a positive integer, got {row[key]!r}")
    return out


def load(path: str) -> list[Any]:
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, list) else [data]


def _key(row: Any) -> str:
    return json.dumps(row, sort_keys=True, allow_nan=True)


def merge(paths: list[str], target: str) -> tuple[list[Any], int]:
    """All records of ``target`` (if it exists) and of ``paths``, identical ones once; (rows, added)."""
    errors = []
    incoming = []
    for path in paths:
        for i, row in enumerate(load(path)):
            for p in problems(row):
                bench = row.get("bench") if isinstance(row, dict) else None
                errors.append(f"{path}: record {i} (bench={bench}): {p}")
            incoming.append(row)
    if errors:
        raise SystemExit("collect.py: invalid records, nothing written:\n" + "\n".join(errors))
    rows = load(target) if os.path.exists(target) else []
    seen = {_key(r) for r in rows}
    added = 0
    for row in incoming:
        k = _key(row)
        if k not in seen:
            seen.add(k)
            rows.append(row)
            added += 1
    return rows, added


def _fmt(v: Any, spec: str = "") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) if spec and isinstance(v, (int, float)) else str(v)


def summary(rows: list[Any]) -> str:
    """A compact fixed-width table of records (what run_*.sh scripts print at the end)."""
    head = ("bench", "system", "model", "S", "GPUs", "tok/s/GPU|TFLOP/s", "MFU", "MFU(meas)", "peak GB", "note")
    lines = []
    for r in rows:
        if not isinstance(r, dict):
            continue
        value = r.get("tokens_per_s_per_gpu", r.get("tflops_per_gpu", r.get("tflops")))
        note = r.get("error") or ""
        if r.get("bench") == "longest":
            note = ("lower bound; " if r.get("lower_bound") else "") + (" ".join(
                f"{a.get('seq')}:{a.get('status')}" for a in r.get("attempts", [])) or note)
        elif r.get("padded_heads"):
            note = f"heads {r.get('heads')}, padding waste {r.get('padding_flops_waste', 0):.1%}"
        lines.append((str(r.get("bench")), str(r.get("system", "")), str(r.get("model", "")), _fmt(r.get("seq")),
                      _fmt(r.get("gpus")), _fmt(value, ".1f"), _fmt(r.get("mfu"), ".3f"), _fmt(r.get("mfu_measured_peak"), ".3f"),
                      _fmt(r.get("peak_mem_gb"), ".1f"), str(note)[:70]))
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in [head, *lines])


def main(argv: list[str] | None = None) -> str | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="JSON record files")
    ap.add_argument("--summary", action="store_true", help="only print a table of the records (missing files are skipped)")
    ap.add_argument("--kind", default=None, help="the machine kind the records were measured on, e.g. nvidia-h200-x4 (required to merge)")
    ap.add_argument("--date", default=datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d"), help="yyyymmdd (default: today, UTC)")
    ap.add_argument("--results", default=RESULTS, help="folder of the merged files (default: benchmarks/results)")
    args = ap.parse_args(argv)
    if args.summary:
        rows = [row for path in args.files if os.path.exists(path) for row in load(path)]
        print(summary(rows))
        return None
    if args.kind is None:
        ap.error("--kind is required to merge records")
    if not (len(args.date) == 8 and args.date.isdigit()):
        ap.error(f"--date must be yyyymmdd, got {args.date!r}")
    if not args.kind or os.sep in args.kind or " " in args.kind:
        ap.error(f"--kind must be a plain name like nvidia-h200-x4, got {args.kind!r}")
    target = os.path.join(args.results, f"{args.date}-{args.kind}.json")
    rows, added = merge(args.files, target)
    os.makedirs(args.results, exist_ok=True)
    with open(target, "w") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
    nan = sum(1 for r in rows if isinstance(r, dict) and any(isinstance(v, float) and math.isnan(v) for v in r.values()))
    print(f"collect.py: {target}: {len(rows)} records ({added} new)" + (f", {nan} with NaN values" if nan else ""))
    return target


if __name__ == "__main__":
    main(sys.argv[1:])

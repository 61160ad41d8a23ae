"""Replay ``attention="auto"`` over every measured attention point (issue #7 item 4).

For each (GPUs, S, heads, kernel) of ``benchmarks/results/*.json`` where at least two of our
algorithms were measured, the cost model picks among the measured ones, with the profile of that
kernel (``DeviceProfile.for_device(..., backend=...)``); the line says the pick's measured
TFLOP/s against the measured best and whether it is within 5%. Also the model's error on every
measured time. No GPU needed.

    python benchmarks/cost_model_check.py            # every point
    python benchmarks/cost_model_check.py --worst 5  # and the five largest time errors
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
from collections import defaultdict

from lightning_seqpar.attention.cost import DeviceProfile, choose_attention, estimate_attention

HERE = os.path.dirname(os.path.abspath(__file__))


def _label_to_args(label: str) -> dict | None:
    """benchmarks/attention.py's algorithm label -> estimate_attention keywords (None: not a cost-model algorithm)."""
    parts = label.split(":")
    kw: dict = {"algorithm": parts[0]}
    if parts[0] not in ("ring", "allgather", "ulysses", "2d"):
        return None
    for p in parts[1:]:
        if p.startswith("inner"):
            kw["inner_ring_size"] = int(p[5:])
        elif "x" in p and parts[0] == "2d":
            kw["hp"] = int(p.split("x")[0])
    return kw


def load(pattern: str) -> dict:
    """{(gpus, seq, heads, backend): {label: (tflops, time_ms)}} of our records, latest record of a label and head-chunk count, best over chunk counts."""
    latest: dict = {}
    for path in sorted(glob.glob(pattern)):
        rows = json.load(open(path))
        if not isinstance(rows, list):
            continue
        for r in rows:
            if r.get("bench") != "attention" or r.get("system") != "seqpar" or r.get("error") or not r.get("tflops_per_gpu"):
                continue
            heads = r.get("heads") or r["model"].split("x")[0].lstrip("H")  # older records: model "H32/8xD128"
            ms = r["time_ms"] if "time_ms" in r else r["time_s"] * 1e3
            key = (r["gpus"], r["seq"], heads, r.get("backend") or "cudnn")
            latest[(key, r["algorithm"], r.get("head_chunks") or 1)] = (r["tflops_per_gpu"], ms)
    points: dict = defaultdict(dict)
    for (key, label, _), value in latest.items():
        if _label_to_args(label) is None:
            continue
        if label not in points[key] or value[0] > points[key][label][0]:
            points[key][label] = value
    return points


def evaluate(points: dict) -> tuple[list[dict], list[tuple]]:
    """(one dict per point with at least two of our algorithms measured, the model's time error on every run)."""
    decided, errors = [], []
    for (gpus, seq, heads, backend), measured in sorted(points.items()):
        hq, hkv = (int(x) for x in heads.split("/"))
        profile = DeviceProfile.for_device("NVIDIA H200", backend=backend, gpus_per_node=max(gpus, 1))
        for label, (_, ms) in measured.items():
            est = estimate_attention(seq_len=seq, num_heads=hq, num_kv_heads=hkv, head_dim=128, world_size=gpus,
                                     profile=profile, **_label_to_args(label))
            errors.append((est.est_time_s * 1e3 / ms - 1, gpus, seq, heads, backend, label))
        if len(measured) < 2:
            continue
        plan = choose_attention(seq_len=seq, num_heads=hq, num_kv_heads=hkv, head_dim=128, world_size=gpus, profile=profile)
        ranked = [c.label for c in plan.candidates]
        pick = next(label for label in ranked if label in measured)  # the model's order among what was measured
        best = max(measured, key=lambda k: measured[k][0])
        decided.append(dict(gpus=gpus, seq=seq, heads=heads, backend=backend, pick=pick, pick_tflops=measured[pick][0],
                            best=best, best_tflops=measured[best][0], ratio=measured[pick][0] / measured[best][0],
                            first=ranked[0], first_measured=ranked[0] in measured))
    return decided, errors


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=os.path.join(HERE, "results", "*.json"))
    ap.add_argument("--worst", type=int, default=0)
    args = ap.parse_args()
    decided, errors = evaluate(load(args.results))
    for d in decided:
        print(f"W={d['gpus']} S={d['seq']:>8} H={d['heads']:>5} {d['backend']:5s} pick {d['pick']:12s} {d['pick_tflops']:6.1f}  "
              f"best {d['best']:12s} {d['best_tflops']:6.1f}  {d['ratio']:.3f} {'ok' if d['ratio'] >= 0.95 else 'MISS'}"
              f"{'' if d['first_measured'] else '  (its first choice, ' + d['first'] + ', was not measured)'}")
    rel = [e[0] for e in errors]
    misses = sum(d["ratio"] < 0.95 for d in decided)
    print(f"{len(decided)} points, {misses} outside 5%, the model's first choice measured at "
          f"{sum(d['first_measured'] for d in decided)}; time error over {len(rel)} runs: median {statistics.median(rel):+.1%}, "
          f"range {min(rel):+.1%} .. {max(rel):+.1%}")
    for e in sorted(errors, key=lambda e: -abs(e[0]))[: args.worst]:
        print(f"  {e[0]:+.1%}  W={e[1]} S={e[2]} H={e[3]} {e[4]} {e[5]}")


if __name__ == "__main__":
    main()

"""Plots of every record in benchmarks/results/*.json in docs/img/ (``python -m benchmarks plot``, matplotlib): attention
(TFLOP/s and peak memory against S, heads 32/8 on 4 GPUs and one GPU), local_attention (one-GPU kernels), train (tokens/s/GPU
with MFU, and peak memory: each system's best setting), longest (the longest S that trains). A configuration measured
more than once is drawn from its last record (files by date); records lacking a field a figure needs are left out of it.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import ROOT, _num, last_by, load, longest_per_config, seq_k  # noqa: E402

SYSTEM_NAMES = {"seqpar": "seqpar (ours)", "torch_cp": "FSDP2 + torch CP", "tp_sp": "Megatron TP+SP", "single": "1 GPU",
                "torch_sdpa": "torch SDPA"}


def latest(rows: list[dict], keys: tuple[str, ...]) -> list[dict]:
    """One record per value of ``keys``: the last one read."""
    return list(last_by(rows, lambda r: tuple(str(r.get(k)) for k in keys)).values())


def _devices(rows: list[dict]) -> str:
    return "; ".join(sorted({f"{r.get('gpus', 1)} x {r['device']}" for r in rows if r.get("device")}))


def _save(plt: Any, fig: Any, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot.py: wrote {os.path.relpath(path, ROOT)}")
    return path


def plot_lines(plt: Any, rows: list[dict], *, y: str, series: tuple[str, ...], label: Any, title: str, ylabel: str,
               out_dir: str, name: str) -> str | None:
    rows = [r for r in rows if _num(r, "seq") and _num(r, y) is not None and not r.get("error")]
    if not rows:
        return None
    rows = latest(rows, series + ("seq",))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(str(r.get(k)) for k in series), []).append(r)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    ax.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
    for key, rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["seq"])
        ax.plot([r["seq"] for r in rs], [r[y] for r in rs], marker="o", label=label(rs[0]))
    seqs = sorted({r["seq"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqs, [seq_k(s) for s in seqs])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sequence length S")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}\n{_devices(rows)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: the lines stay readable
    return _save(plt, fig, out_dir, name)


def _bars(plt: Any, ax: Any, rows: list[dict], config, key: str, *, best: str, note) -> list:
    """One bar per (configuration, system): the system's record of the configuration with the largest ``best``, its
    ``key`` as the height and ``note(record)`` on top; the configurations (the x ticks, in order)."""
    configs = sorted({config(r) for r in rows})
    systems = sorted({str(r.get("system")) for r in rows}, key=lambda s: (s != "seqpar", s))
    width, labelled = 0.8 / len(systems), set()
    for i, system in enumerate(systems):
        for j, cfg in enumerate(configs):
            match = [r for r in rows if str(r.get("system")) == system and config(r) == cfg and _num(r, key) is not None]
            if match:
                r, label = max(match, key=lambda r: _num(r, best) or 0), SYSTEM_NAMES.get(system, system)
                bar = ax.bar([j + (i - (len(systems) - 1) / 2) * width], [_num(r, key)], width, color=f"C{i}",
                             label=None if label in labelled else label)[0]
                labelled.add(label)
                if note(r):
                    ax.annotate(note(r), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    return configs


def plot_train(plt: Any, rows: list[dict], out_dir: str) -> str | None:
    # offload_params runs measure the host-offload path at short S (docs/benchmarks.md), not a throughput setting
    rows = [r for r in rows if r.get("bench") == "train" and r.get("tag") not in ("longest", "scaling")
            and not r.get("offload_params") and _num(r, "tokens_per_s_per_gpu") is not None and _num(r, "seq")]
    if not rows:
        return None
    # the latest record of each setting (tag: e.g. compile / uncheckpointed blocks), then each system's best
    rows = latest(rows, ("system", "algorithm", "model", "seq", "gpus", "device", "tag"))
    config = lambda r: (str(r.get("model")), int(r["seq"]), int(r.get("gpus") or 0))  # noqa: E731
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(7, 1.6 * len({config(r) for r in rows})), 7.5), sharex=True)
    mfu = lambda r: f"{r['mfu']:.2f}" if _num(r, "mfu") is not None else ""  # noqa: E731
    configs = _bars(plt, ax1, rows, config, "tokens_per_s_per_gpu", best="tokens_per_s_per_gpu", note=mfu)
    _bars(plt, ax2, rows, config, "peak_mem_gb", best="tokens_per_s_per_gpu", note=lambda r: "")
    ax1.set_ylabel("tokens/s/GPU, best setting (MFU on bars)")
    ax2.set_ylabel("peak memory per GPU (GB)")
    ax2.set_xticks(range(len(configs)), [f"{m}\nS={seq_k(s)}, {g} GPUs" for m, s, g in configs], fontsize=8)
    ax1.set_title(f"Training throughput and memory\n{_devices(rows)}", fontsize=10)
    for ax in (ax1, ax2):
        ax.grid(axis="y", alpha=0.3)
    ax1.legend(fontsize=8)
    return _save(plt, fig, out_dir, "train.png")


def plot_longest(plt: Any, rows: list[dict], out_dir: str) -> str | None:
    # benchmarks/longest.py writes bench="longest"; the older "train_max_seq" records (max_seq) are the same search
    rows = [r if r.get("bench") == "longest" else {**r, "seq": r.get("max_seq")}
            for r in rows if r.get("bench") in ("longest", "train_max_seq") and r.get("model")]
    if not rows:
        return None
    rows = [{**r, "seq_k": (_num(r, "seq") or 0) / 1024} for r in longest_per_config(rows)]
    config = lambda r: (str(r["model"]), int(r.get("gpus") or 0))  # noqa: E731
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len({config(r) for r in rows})), 4.2))
    note = lambda r: (seq_k(r["seq"]) + ("+" if r.get("lower_bound") else "")) if r.get("seq") else "none fit"  # noqa: E731
    configs = _bars(plt, ax, rows, config, "seq_k", best="seq_k", note=note)
    ax.set_xticks(range(len(configs)), [f"{m}, {g} GPUs" for m, g in configs], fontsize=8)
    ax.set_ylabel("longest trainable S (K tokens)")
    ax.set_title(f"Longest context that trains (whole optimizer steps; +: lower bound)\n{_devices(rows)}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, out_dir, "longest.png")


ATTENTION_SERIES = ("system", "algorithm", "backend", "head_chunks", "gpus", "device")
_PLOTTED = {("seqpar", "ring"), ("seqpar", "allgather"), ("seqpar", "ulysses"), ("torch_cp", "allgather"), ("torch_cp", "alltoall"),
            ("single", None)}


def attention_rows(rows: list[dict]) -> list[dict]:
    """The attention records of the plots: heads 32/8 on 4 GPUs (ring / all-gather / Ulysses / torch CP)
    and one GPU (single, from a run of any size: its figure is per GPU)."""
    out = []
    for r in rows:
        single = r.get("system") == "single"
        if r.get("bench") != "attention" or r.get("heads") != "32/8" or (r.get("gpus") != 4 and not single):
            continue
        if (r.get("system"), None if single else r.get("algorithm")) in _PLOTTED:
            out.append({**r, "backend": r.get("backend", "cudnn"), "head_chunks": r.get("head_chunks", 1), "gpus": 1 if single else 4})
    return out


def attention_label(r: dict) -> str:
    who = SYSTEM_NAMES.get(r.get("system"), r.get("system"))
    alg = "" if r.get("system") == "single" else f" {r.get('algorithm')}"
    chunks = f", head_chunks {r['head_chunks']}" if r.get("head_chunks", 1) > 1 else ""
    return f"{who}{alg} ({r.get('backend')}{chunks})"


def main(argv: list[str] | None = None) -> list[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(ROOT, "benchmarks", "results"), help="folder of *.json records")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "docs", "img"))
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load(glob.glob(os.path.join(args.results, "*.json")))
    os.makedirs(args.out_dir, exist_ok=True)
    written = [
        plot_lines(plt, attention_rows(rows), y="tflops_per_gpu", series=ATTENTION_SERIES, label=attention_label,
                   title="Causal attention fwd + bwd, heads 32/8, D 128, 4 GPUs", ylabel="TFLOP/s per GPU",
                   out_dir=args.out_dir, name="attention.png"),
        plot_lines(plt, attention_rows(rows), y="peak_mem_gb", series=ATTENTION_SERIES, label=attention_label,
                   title="Peak memory of attention fwd + bwd (inputs included), heads 32/8, 4 GPUs", ylabel="GB per GPU",
                   out_dir=args.out_dir, name="attention_memory.png"),
        plot_lines(plt, [r for r in rows if r.get("bench") == "local"], y="tflops", series=("system", "backend", "hq", "hkv", "device"),
                   label=lambda r: f"{'ours' if r.get('system') == 'seqpar' else SYSTEM_NAMES.get(r.get('system'), r.get('system'))} "
                                   f"{r.get('backend', '')}, H={r.get('hq')}/{r.get('hkv')}",
                   title="One-GPU attention kernels, causal forward + backward", ylabel="TFLOP/s",
                   out_dir=args.out_dir, name="local_attention.png"),
        plot_train(plt, rows, args.out_dir),
        plot_longest(plt, rows, args.out_dir),
    ]
    return [p for p in written if p]


if __name__ == "__main__":
    main()

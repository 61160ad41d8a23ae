"""LightSeq's single-node table (Li et al., "LightSeq", arXiv:2310.03294, Table 1: one node of 8 GPUs, 4K-32K tokens per
GPU, Llama-7B, Llama-GQA, Llama-33H) from our training records, with the paper's speedup next to ours.

    python benchmarks/lightseq_table.py benchmarks/results/*-nvidia-h200-x8.json

One markdown table per model: per sequence length, each system's seconds per step and peak GB (the
latest record of that system, model, S and GPU count), and ours over each baseline (the ratio of
step times, i.e. of tokens/s). The paper's column is LightSeq over its Megatron-LM on 8 A100s
(Table 1), for reference only: other GPUs, kernels and baselines.
"""

from __future__ import annotations

import argparse
import json

MODELS = (("llama-7b", "Llama-7B (MHA, 32 heads)"), ("llama-7b-gqa", "Llama-GQA (32 / 8 heads)"), ("llama-33h", "Llama-33H"))
SEQS = (32768, 65536, 131072, 262144)
# LightSeq (arXiv:2310.03294) Table 1, 1x8 A100 80 GB: LightSeq's speedup over Megatron-LM at 4K / 8K / 16K / 32K per GPU
PAPER_SPEEDUP = {
    "llama-7b": (1.02, 1.14, 1.21, 1.24),
    "llama-7b-gqa": (1.06, 1.18, 1.22, 1.26),
    "llama-33h": (1.22, 1.38, 1.45, 1.50),
}
SYSTEMS = (("tp_sp", "Megatron TP+SP"), ("torch_cp", "torch CP"), ("seqpar", "ours"))


def latest(paths: list[str], gpus: int) -> dict[tuple[str, str, int], dict]:
    """(system, model, S) -> the last training record on ``gpus`` GPUs, in file order (pass files oldest first)."""
    out: dict[tuple[str, str, int], dict] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for r in data if isinstance(data, list) else []:
            if isinstance(r, dict) and r.get("bench") == "train" and r.get("gpus") == gpus and r.get("step_time_s"):
                out[(r["system"], r["model"], r["seq"])] = r
    return out


def tables(paths: list[str], gpus: int = 8) -> str:
    rec = latest(paths, gpus)
    lines: list[str] = []
    for model, title in MODELS:
        if not any(k[1] == model for k in rec):
            continue
        lines += [f"{title}, {gpus} GPUs (seconds per step / peak GB):", "",
                  "| tokens per GPU | S | " + " | ".join(name for _, name in SYSTEMS)
                  + " | ours / TP+SP | ours / torch CP | LightSeq / Megatron (paper, 8 x A100) |",
                  "| --- " * (len(SYSTEMS) + 5) + "|"]
        for i, S in enumerate(SEQS):
            rows = {system: rec.get((system, model, S)) for system, _ in SYSTEMS}
            if not any(rows.values()):
                continue
            cells = [f"{r['step_time_s']:.2f} / {r['peak_mem_gb']:.1f}" if r else "-" for r in rows.values()]
            ours = rows["seqpar"]
            ratio = lambda base: f"**{base['step_time_s'] / ours['step_time_s']:.2f}x**" if base and ours else "-"  # noqa: E731
            lines.append(f"| {S // gpus // 1024}K | {S // 1024}K | " + " | ".join(cells)
                         + f" | {ratio(rows['tp_sp'])} | {ratio(rows['torch_cp'])} | {PAPER_SPEEDUP[model][i]:.2f}x |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="JSON record files, oldest first (later records of a point win)")
    ap.add_argument("--gpus", type=int, default=8)
    args = ap.parse_args(argv)
    text = tables(args.files, args.gpus)
    print(text)
    return text


if __name__ == "__main__":
    main()

"""Mamba1's selective scan on one device: the package's local kernel (the token recurrence of Note [Mamba1's
selective scan under sequence sharding]) against transformers' torch path (``mamba_selective_scan``), forward +
backward, fp32, at a Mamba-130m layer's shape (d_inner 1536, state 16) by default.

    python benchmarks/selective_scan.py --seqs 1024,4096 --out selective_scan.json
    python benchmarks/selective_scan.py --device cpu --seqs 64 --channels 64     (smoke)
    torchrun --nproc_per_node=4 benchmarks/selective_scan.py --seqs 65536 --chunks 16 --out selective_scan.json

Under torchrun the package's kernel runs sequence-parallel: every rank holds --seqs / W tokens (zigzag; seq in
the record is the whole sequence, gpus = W) and the states pass in parallel (Note [Parallel state passing for
diagonal recurrences]), or down the chain with SEQPAR_STATE_CHAIN=1 (the record's ``state_passing``); rank 0's
record.

One record per (length, system, chunk size) appended to ``--out``: bench "selective_scan", system "seqpar" /
"transformers", seq (tokens on the device), channels, state, chunk_size (the package's kernel; null for transformers), device, time_ms (median of ``--iters`` after ``--warmup``, forward
+ backward of sum(y * dy)), tokens_per_s, peak_mem_gb (torch.cuda.max_memory_allocated in the timed calls;
null on the CPU), error (the first line, when a run fails: out of memory, say), commit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from collect import error_text, record_and_release  # benchmarks/ is on sys.path when this file runs as a script
from launch import device_and_mesh


def _inputs(T: int, E: int, N: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=g).to(device)
    return {"x": make(1, T, E), "dt": torch.nn.functional.softplus(make(1, T, E) - 4),
            "A": -torch.arange(1, N + 1, dtype=torch.float32).expand(E, N).contiguous().to(device),
            "B": make(1, T, 1, N), "C": make(1, T, 1, N), "D": torch.ones(E, device=device)}


def _step(system: str, inputs: dict[str, torch.Tensor], dy: torch.Tensor, chunk: int, mesh=None) -> None:
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items()}
    if system == "seqpar":
        from lightning_seqpar.attention.recurrent import selective_scan

        y = selective_scan(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], leaves["D"], chunk_size=chunk,
                           mesh=mesh, layout="zigzag")
    else:
        from transformers.models.mamba.modeling_mamba import mamba_selective_scan

        y = mamba_selective_scan(leaves["x"].transpose(1, 2), leaves["dt"].transpose(1, 2), leaves["A"],
                                 leaves["B"][:, :, 0].transpose(1, 2), leaves["C"][:, :, 0].transpose(1, 2),
                                 D=leaves["D"]).transpose(1, 2)
    (y * dy).sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="1024,4096")
    ap.add_argument("--channels", type=int, default=1536, help="d_inner (Mamba-130m: 1536; Jamba: 8192)")
    ap.add_argument("--state", type=int, default=16)
    ap.add_argument("--systems", default="seqpar,transformers")
    ap.add_argument("--chunks", default="8,16,32", help="chunk sizes of the package's kernel (comma list)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()
    device, mesh, rank, world = device_and_mesh(args.device)
    if mesh is not None:
        args.systems = "seqpar"  # transformers' torch path cannot split the sequence
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    for T in (int(s) for s in args.seqs.split(",")):
        runs = [(system, int(c)) for system in args.systems.split(",")
                for c in (args.chunks.split(",") if system == "seqpar" else [0])]
        for system, chunk in runs:
            row = {"bench": "selective_scan", "system": system, "seq": T, "channels": args.channels, "state": args.state,
                   "chunk_size": chunk or None,
                   "device": name, "time_ms": None, "tokens_per_s": None, "peak_mem_gb": None, "error": None,
                   "commit": args.commit, "gpus": world}
            if mesh is not None:
                chain = os.environ.get("SEQPAR_STATE_CHAIN", "0") == "1"
                row["state_passing"] = "chain" if chain else "parallel"
            try:
                inputs = _inputs(T, args.channels, args.state, device)
                dy = torch.randn(1, T, args.channels, generator=torch.Generator().manual_seed(1)).to(device)
                if mesh is not None:
                    from lightning_seqpar.sharding import shard_sequence

                    inputs = {k: (shard_sequence(v, mesh, layout="zigzag") if v.dim() >= 3 else v) for k, v in inputs.items()}
                    dy = shard_sequence(dy, mesh, layout="zigzag")
                for _ in range(args.warmup):
                    _step(system, inputs, dy, chunk, mesh)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(args.iters):
                    if mesh is not None:
                        dist.barrier()
                    start = time.perf_counter()
                    _step(system, inputs, dy, chunk, mesh)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                ms = statistics.median(times) * 1e3
                row.update(time_ms=round(ms, 3), tokens_per_s=round(T / ms * 1e3, 1))
                if device.type == "cuda":
                    row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            except Exception as error:  # noqa: BLE001 - recorded (e.g. out of memory), the next run goes on
                row["error"] = error_text(error)
            if rank == 0:
                print(row, flush=True)
                record_and_release(args.out, row)
    if mesh is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

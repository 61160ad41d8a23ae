"""The gated delta rule (Qwen3-Next's gated DeltaNet) forward + backward: the package's torch kernels
(Note [Blocked affine scan]) against transformers' torch path (``torch_chunk_gated_delta_rule``) and,
where it runs, fla-core's ``chunk_gated_delta_rule``, at a Qwen3-Next layer's shape (32 value heads
of 128, 16 key heads; bf16 inputs, fp32 inside).

    python benchmarks/delta_rule.py --seqs 16384,131072 --out delta_rule.json
    torchrun --nproc_per_node=4 benchmarks/delta_rule.py --seqs 131072 --out delta_rule.json   (sequence parallel)
    python benchmarks/delta_rule.py --seqs 65536 --docs 16            (16 packed documents: the state resets)
    python benchmarks/delta_rule.py --rule ssd --seqs 16384,65536     (Mamba2's scan, Bamba-9B's shape, bench "ssd_scan")
    python benchmarks/delta_rule.py --device cpu --seqs 256 --heads 2 --dim 16 --iters 1      (smoke)

Under torchrun the package's kernel runs sequence-parallel: every rank holds --seq / W tokens
(zigzag) and the states pass between the ranks (Note [Parallel state passing across ranks]); the
record is rank 0's (gpus = W). One record per (length, system) appended to ``--out``: bench
"delta_rule", system, seq (the whole sequence), gpus, heads, dim, documents, device, time_ms (median of
``--iters`` after ``--warmup``, forward + backward of sum(o * do)), tokens_per_s (the whole sequence's
tokens per second), peak_mem_gb, error, commit; with --check under torchrun, rel_err_vs_one_device (relative
L2 error of the output and of every input's gradient against the whole sequence on one device).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from collect import error_text  # benchmarks/ is on sys.path when this file runs as a script
from launch import device_and_mesh


def _inputs(T: int, H: int, D: int, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    return {"q": make(1, T, H // 2, D).bfloat16(), "k": make(1, T, H // 2, D).bfloat16(), "v": make(1, T, H, D).bfloat16(),
            "g": -torch.nn.functional.softplus(make(1, T, H)) * 0.1, "beta": torch.sigmoid(make(1, T, H))}


def _ssd_inputs(T: int, H: int, P: int, N: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Mamba2's scan after the in-projection and the conv (Bamba-9B: 128 heads of 64, state 128, one group)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    return {"x": make(1, T, H, P).bfloat16(), "dt": torch.nn.functional.softplus(make(1, T, H) - 4),
            "A": -torch.rand(H, generator=g).to(device) - 0.5, "B": make(1, T, 1, N).bfloat16(), "C": make(1, T, 1, N).bfloat16(),
            "D": torch.ones(H, device=device)}


def _ssd_step(system: str, inputs: dict[str, torch.Tensor], do: torch.Tensor, kernel: str) -> tuple[torch.Tensor, dict]:
    x = {k: v.detach().requires_grad_() for k, v in inputs.items()}
    if system == "seqpar":
        from lightning_seqpar.attention.recurrent import ssd_scan

        y = ssd_scan(x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], kernel=kernel)
    else:
        from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

        y = mamba2_chunk_scan(x["x"], x["dt"], x["A"], x["B"], x["C"], chunk_size=256, D=x["D"])
        y = y[0] if isinstance(y, tuple) else y
    (y.float() * do).sum().backward()
    return y.detach(), {k: v.grad for k, v in x.items()}


def _step(system: str, inputs: dict[str, torch.Tensor], do: torch.Tensor, mesh, docs=None, kernel: str = "torch"
          ) -> tuple[torch.Tensor, dict]:
    """One forward + backward; ``kernel``: the package's kernel= ("torch": the blocked scan, states in parallel
    across ranks; "fla": fla-core's kernels where they run, the state chain across ranks)."""
    if "x" in inputs:  # --rule ssd (one device)
        return _ssd_step(system, inputs, do, kernel)
    x = {k: v.detach().requires_grad_() for k, v in inputs.items()}
    if system == "seqpar":
        from lightning_seqpar.attention.recurrent import gated_delta_rule

        o = gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], mesh=mesh, layout="zigzag", kernel=kernel,
                             documents=docs)
    elif system == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        rep = x["v"].shape[2] // x["q"].shape[2]
        o, _ = chunk_gated_delta_rule(x["q"].repeat_interleave(rep, 2), x["k"].repeat_interleave(rep, 2), x["v"], g=x["g"],
                                      beta=x["beta"].bfloat16(), use_qk_l2norm_in_kernel=True)
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        rep = x["v"].shape[2] // x["q"].shape[2]
        o, _ = torch_chunk_gated_delta_rule(x["q"].repeat_interleave(rep, 2), x["k"].repeat_interleave(rep, 2), x["v"],
                                            g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=True)
    (o.float() * do).sum().backward()
    return o.detach(), {k: v.grad for k, v in x.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="16384,131072")
    ap.add_argument("--heads", type=int, default=32, help="value heads (key heads: half)")
    ap.add_argument("--dim", type=int, default=128, help="key and value head dim")
    ap.add_argument("--systems", default="seqpar,transformers,fla")
    ap.add_argument("--rule", default="delta", choices=["delta", "ssd"],
                    help="delta: the gated delta rule (Qwen3-Next's shape); ssd: Mamba2's scan (Bamba-9B's shape, one device, "
                         "the peer transformers' mamba2_chunk_scan torch path)")
    ap.add_argument("--kernel", default="torch", choices=["torch", "fla", "auto"], help="the package's kernel= (system seqpar)")
    ap.add_argument("--docs", type=int, default=0, help="pack this many equal documents (the package's kernel only; "
                    "the state resets at each document's start)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--check", action="store_true", help="under torchrun: compare with the whole sequence on one device")
    ap.add_argument("--profile", action="store_true", help="after the timing, print the top kernels of one more step "
                    "(torch.profiler, rank 0)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()
    device, mesh, rank, world = device_and_mesh(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    systems = ["seqpar"] if world > 1 or args.docs else args.systems.split(",")
    for T in (int(s) for s in args.seqs.split(",")):
        for system in systems:
            row = {"bench": "delta_rule" if args.rule == "delta" else "ssd_scan", "system": system, "kernel": args.kernel if system == "seqpar" else None, "seq": T, "gpus": world, "heads": args.heads, "dim": args.dim,
                   "documents": args.docs or None,
                   "device": name, "time_ms": None, "tokens_per_s": None, "peak_mem_gb": None, "error": None,
                   "commit": args.commit}
            if system == "seqpar" and world > 1:  # how the states cross the ranks (SEQPAR_STATE_CHAIN=1: down the chain)
                chain = os.environ.get("SEQPAR_STATE_CHAIN", "0") == "1" or args.kernel == "fla"
                row["state_passing"] = "chain" if chain else "parallel"
                if chain and args.kernel == "torch":
                    row["baseline"] = True  # the same code with the chain forced: the comparison, not ours
            try:
                if system == "fla":
                    from lightning_seqpar.attention.recurrent import _fla_installed, _fla_unusable

                    why = "fla-core is not installed" if not _fla_installed() else _fla_unusable(device.index)
                    if why:
                        raise RuntimeError(why)
                if args.rule == "ssd":
                    if world > 1 or args.docs or system == "fla":
                        raise ValueError("--rule ssd: one device, no documents, systems seqpar and transformers")
                    row.update(heads=128, dim=64, state=128)
                    inputs = _ssd_inputs(T, 128, 64, 128, device)
                    do = torch.randn(1, T, 128, 64, generator=torch.Generator().manual_seed(1)).to(device)
                else:
                    inputs = _inputs(T, args.heads, args.dim, device)
                    do = torch.randn(1, T, args.heads, args.dim, generator=torch.Generator().manual_seed(1)).to(device)
                docs = None
                from lightning_seqpar.documents import PackedDocuments

                if args.docs:
                    lengths = [[T // args.docs] * (args.docs - 1) + [T - T // args.docs * (args.docs - 1)]]
                    docs = PackedDocuments.from_lengths(lengths, world=world)
                if docs is not None and mesh is not None:
                    inputs = {k: docs.shard(v, rank) for k, v in inputs.items()}
                    do = docs.shard(do, rank)
                elif mesh is not None:
                    from lightning_seqpar.sharding import shard_sequence

                    inputs = {k: shard_sequence(v, mesh, layout="zigzag") for k, v in inputs.items()}
                    do = shard_sequence(do, mesh, layout="zigzag")
                for _ in range(args.warmup):
                    _step(system, inputs, do, mesh, docs, args.kernel)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(args.iters):
                    if mesh is not None:
                        dist.barrier()
                    start = time.perf_counter()
                    _step(system, inputs, do, mesh, docs, args.kernel)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - start)
                if device.type == "cuda":
                    row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
                if args.profile:
                    from torch.profiler import ProfilerActivity, profile

                    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                    with profile(activities=activities) as prof:
                        _step(system, inputs, do, mesh, docs, args.kernel)
                        if device.type == "cuda":
                            torch.cuda.synchronize()
                    if rank == 0:
                        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
                        print(f"profile: {system} S={T} documents={args.docs or None}", flush=True)
                        print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70), flush=True)
                if mesh is not None and args.check:  # against the whole sequence on this one device (Note [Parallel
                    # state passing across ranks]): relative L2 error of the output and of every input's gradient
                    from lightning_seqpar.sharding import shard_sequence

                    full = _inputs(T, args.heads, args.dim, device)
                    do_full = torch.randn(1, T, args.heads, args.dim, generator=torch.Generator().manual_seed(1)).to(device)
                    docs_full = None if docs is None else PackedDocuments.from_lengths(lengths, world=1)
                    ref = _step(system, full, do_full, None, docs_full, kernel=args.kernel)
                    got = _step(system, inputs, do, mesh, docs, kernel=args.kernel)
                    shard = ((lambda t: shard_sequence(t, mesh, layout="zigzag").float()) if docs is None  # noqa: E731
                             else (lambda t: docs.shard(t, rank).float()))
                    errs = {"o": ((got[0].float() - shard(ref[0])).norm() / shard(ref[0]).norm()).item()}
                    errs.update({f"d{k}": ((got[1][k].float() - shard(ref[1][k])).norm() / shard(ref[1][k]).norm()).item()
                                 for k in got[1]})
                    row["rel_err_vs_one_device"] = {k: float(f"{v:.3g}") for k, v in errs.items()}
                    del full, ref, got
                ms = statistics.median(times) * 1e3
                row.update(time_ms=round(ms, 3), tokens_per_s=round(T / ms * 1e3, 1))
            except Exception as error:  # noqa: BLE001 - recorded (e.g. out of memory), the next run goes on
                row["error"] = error_text(error)
            if rank == 0:
                print(row, flush=True)
                if args.out:
                    from collect import append_records

                    append_records(args.out, row)
            import gc

            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Distributed attention benchmark: every algorithm of ours, one GPU, and torch's context parallel,
with the cost model's prediction next to each measurement.

    torchrun --nproc_per_node=4 benchmarks/attention.py --out attention.json \
        --grid "seqs=32768,131072;heads=32/8,32/32,33/33;systems=all" \
        --grid "seqs=524288;heads=32/8;systems=seqpar:ring,seqpar:ulysses;iters=2"
    python benchmarks/attention.py --table benchmarks/results/*.json --table-seqs 524288,1048576   # the full grid, every algorithm

Systems (``--grid ... systems=`` or ``--systems``, comma separated):

    seqpar:ring  seqpar:allgather  seqpar:ulysses  seqpar:2d:<hp>x<cp>  seqpar:ring:inner<w>
    torch_cp:allgather  torch_cp:alltoall     torch.distributed.tensor.experimental.context_parallel
    single                                    one GPU, the whole sequence (each rank its own copy)
    all = single + every seqpar split for this world size + both torch_cp; seqpar / torch_cp = theirs
    suffixes of seqpar / single: ":<backend>" (fa4, cudnn, ...; default --backend) and, for ring /
    all-gather, ":chunks<c>" (head_chunks, Note [Head chunks]), e.g. seqpar:ring:fa4:chunks4

Each rank holds S / W tokens of random q, k, v ([B, S/W, H, D], bf16 on GPU); one measurement is a
full forward + backward of causal attention (zigzag layout), timed with CUDA events (median of
iters after warmup; the slowest rank's median). TFLOP/s per GPU uses the causal count
3.5 * 2 * B * H * S^2 * D / W; ``single`` runs the same count with W = 1 on the whole sequence,
with the package's local kernel (cuDNN SDPA unless a backend suffix says otherwise). Peak memory:
torch.cuda.max_memory_allocated() over the timed steps, inputs and gradients included (max over
ranks); op memory (op_mem_gb): that peak minus what was allocated just before the timed steps
(the inputs, and any copies of them a system keeps), i.e. what one forward + backward adds.

torch_cp runs ``F.scaled_dot_product_attention`` (cuDNN kernel, the same one our ring uses) inside
``context_parallel`` with its round-robin load balancer and the named rotate method; its inputs
are the local shards ([B, H, S/W, D]).

One record per (system, S, heads) — a JSON list written after every measurement (so a run cut
short keeps what it measured): bench "attention", system ("seqpar" | "torch_cp" | "single"),
algorithm ("ring", "2d:2x2", "ring:inner2", "alltoall", "cudnn"), heads ("32/8"), model, seq,
batch, gpus, device, tflops_per_gpu, efficiency_vs_single (tflops_per_gpu / single's at the same
S and heads, when single ran in this process), time_ms, peak_mem_gb, commit; predicted_ms (the cost
model, lightning_seqpar.attention.cost, for this algorithm; single: W = 1) and auto_choice (what
``attention="auto"`` with ``head_parallel_size="auto"`` picks for this S, heads and W). A
combination that cannot run is a record with ``error = "skipped: <why>"`` and null measurements.

CPU smoke test (gloo, fp32, math kernel, tiny S):
    torchrun --nproc_per_node=2 benchmarks/attention.py --device cpu --grid "seqs=64;heads=4/2,3/3;systems=all" --iters 1 --warmup 0
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from lightning_seqpar.agreement import RankAgreement
from lightning_seqpar.attention import local_attention, sequence_parallel_attention
from lightning_seqpar.attention.cost import DeviceProfile, causal_flops, choose_attention, estimate_attention


@dataclass(frozen=True)
class Grid:
    seqs: tuple[int, ...]
    heads: tuple[tuple[int, int], ...]
    systems: tuple[str, ...]
    iters: int
    warmup: int


def parse_heads(spec: str) -> tuple[tuple[int, int], ...]:
    out = []
    for hh in spec.split(","):
        hq, _, hkv = hh.partition("/")
        out.append((int(hq), int(hkv or hq)))
    return tuple(out)


def parse_grid(spec: str, defaults: argparse.Namespace) -> Grid:
    """``"seqs=32768,131072;heads=32/8,33/33;systems=all;iters=2;warmup=1"`` (keys optional but seqs)."""
    fields = dict(part.split("=", 1) for part in spec.split(";") if part.strip())
    unknown = set(fields) - {"seqs", "heads", "systems", "iters", "warmup"}
    if unknown or "seqs" not in fields:
        raise SystemExit(f"--grid {spec!r}: expected keys seqs (required), heads, systems, iters, warmup; got {sorted(fields)}")
    return Grid(
        seqs=tuple(int(s) for s in fields["seqs"].split(",")),
        heads=parse_heads(fields.get("heads", defaults.heads)),
        systems=tuple(fields.get("systems", defaults.systems).split(",")),
        iters=int(fields.get("iters", defaults.iters)),
        warmup=int(fields.get("warmup", defaults.warmup)),
    )


def expand_systems(systems: tuple[str, ...], world: int) -> list[str]:
    """Replace "all", "seqpar", "torch_cp" by the systems they stand for at this world size."""
    ours = ["seqpar:ring", "seqpar:allgather", "seqpar:ulysses"]
    ours += [f"seqpar:2d:{hp}x{world // hp}" for hp in range(2, world) if world % hp == 0]
    ours += [f"seqpar:ring:inner{w}" for w in range(2, world) if world % w == 0]
    theirs = ["torch_cp:allgather", "torch_cp:alltoall"]
    out: list[str] = []
    for s in systems:
        out += {"all": ["single", *ours, *theirs], "seqpar": ours, "torch_cp": theirs}.get(s, [s])
    return list(dict.fromkeys(out))


@dataclass(frozen=True)
class System:
    kind: str  # "seqpar" | "torch_cp" | "single"
    algorithm: str  # as recorded: "ring", "2d:2x2", "ring:inner2", "allgather" (torch_cp), "cudnn"
    base: str = ""  # seqpar: "ring" | "allgather" | "ulysses" | "2d"
    hp: int = 1
    cp: int = 1
    inner: int | None = None
    backend: str | None = None  # None: --backend
    chunks: int = 1


def parse_system(name: str, world: int) -> System:
    from lightning_seqpar.attention import BACKENDS

    kind, _, rest = name.partition(":")
    if kind == "single":
        if rest and rest not in BACKENDS:
            raise SystemExit(f"unknown system {name!r}: single or single:<backend>, backend in {BACKENDS}")
        return System("single", "local", backend=rest or None)
    if kind == "torch_cp":
        if rest not in ("allgather", "alltoall"):
            raise SystemExit(f"unknown system {name!r}: torch_cp:allgather or torch_cp:alltoall")
        return System("torch_cp", rest)
    if kind != "seqpar":
        raise SystemExit(f"unknown system {name!r}; see the docstring of benchmarks/attention.py")
    parts = rest.split(":")
    base, extras, hp, cp, inner, backend, chunks = parts[0], parts[1:], 1, world, None, None, 1
    label = [base]
    if base == "ulysses":
        hp, cp = world, 1
    if base == "2d":
        if not extras or "x" not in extras[0]:
            raise SystemExit(f"{name!r}: write 2d as seqpar:2d:<hp>x<cp>")
        hp, cp = (int(x) for x in extras[0].split("x"))
        label.append(extras.pop(0))
    for e in extras:
        if e.startswith("inner"):
            inner = int(e[5:])
            label.append(e)
        elif e.startswith("chunks"):
            chunks = int(e[6:])
        elif e in BACKENDS:
            backend = e
        else:
            raise SystemExit(f"{name!r}: unknown suffix {e!r} (inner<w>, chunks<c> or a backend of {BACKENDS})")
    if base not in ("ring", "allgather", "ulysses", "2d"):
        raise SystemExit(f"unknown system {name!r}; see the docstring of benchmarks/attention.py")
    # the algorithm label leaves out the backend and head chunks (recorded as their own fields)
    return System("seqpar", ":".join(label), base, hp, cp, inner, backend, chunks)


def skip_reason(s: System, world: int, S: int, hq: int, single_max: int, device_type: str, hkv: int = 1) -> str | None:
    """Why this combination cannot (or should not) run; None when it runs. Same answer on every rank."""
    if s.kind == "single":
        return f"the one-GPU reference runs up to --single-max-seq={single_max}" if S > single_max else None
    if S % (2 * world):
        return f"zigzag needs S divisible by 2 * {world}"
    if s.kind == "torch_cp":
        return "torch_cp needs CUDA (cuDNN SDPA)" if device_type != "cuda" else None
    if s.hp * s.cp != world:
        return f"{s.algorithm} needs {s.hp * s.cp} GPUs, this run has {world}"
    if s.hp > 1 and hq % s.hp:
        return f"{s.hp} head-parallel ranks do not divide {hq} query heads"
    if s.chunks > 1 and (s.base not in ("ring", "allgather") or hkv % s.chunks):
        return f"head_chunks={s.chunks} needs ring / all-gather and K/V heads divisible by it"
    if s.inner is not None and (s.cp % s.inner or not 1 < s.inner < s.cp):
        return f"inner ring size {s.inner} must divide cp={s.cp} and be between 1 and it"
    return None


def timed(step, iters: int, warmup: int, device: torch.device) -> tuple[float, float, float]:
    """(median time s, peak GB, op GB = peak - allocated before the timed steps), max over ranks."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    base = 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    t = torch.tensor(sorted(times)[len(times) // 2], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    peak = torch.tensor((torch.cuda.max_memory_allocated() if cuda else 0) / 1e9, device=device)
    op = torch.tensor(((torch.cuda.max_memory_allocated() - base) if cuda else 0) / 1e9, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    dist.all_reduce(op, op=dist.ReduceOp.MAX)
    return t.item(), peak.item(), op.item()


def seqpar_step(mesh, s: System, q, k, v, do, backend: str):
    agreed = RankAgreement()  # the ranks' inputs are compared on the first (warm-up) call only, as an Attention module does

    def step():
        out = sequence_parallel_attention(q, k, v, mesh=mesh, algorithm=s.base, causal=True, layout="zigzag",  # type: ignore[arg-type]
                                          backend=backend, inner_ring_size=s.inner, head_chunks=s.chunks, agreement=agreed)
        out.backward(do)
        q.grad = k.grad = v.grad = None
    return step


def single_step(q, k, v, do, backend: str):
    def step():
        local_attention(q, k, v, causal=True, backend=backend).backward(do)
        q.grad = k.grad = v.grad = None
    return step


def torch_cp_step(mesh, rotate, q, k, v, do):
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()
    mode = {"gqa": qt.shape[1] != kt.shape[1]}

    # context_parallel needs one buffer to learn the global length; the inputs are already local shards
    positions = torch.arange(qt.shape[2] * mesh.size(), device=qt.device)[None]

    def step():
        with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[1]), torch.nn.attention.sdpa_kernel(
            torch.nn.attention.SDPBackend.CUDNN_ATTENTION
        ):
            if mode["gqa"]:
                try:
                    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
                except Exception as e:  # noqa: BLE001 - CP without native GQA: repeat K/V as torchtitan does
                    print(f"torch_cp: enable_gqa failed ({type(e).__name__}); repeating K/V heads", flush=True)
                    mode["gqa"] = False
            if not mode["gqa"]:
                g = qt.shape[1] // kt.shape[1]
                out = F.scaled_dot_product_attention(qt, kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1), is_causal=True)
            out.backward(dot)
        qt.grad = kt.grad = vt.grad = None
    return step


def predictions(s: System, *, S, hq, hkv, D, B, world, profile, dtype_bytes) -> float | None:
    """The cost model's time (ms) for system ``s``; None for torch_cp."""
    kw = dict(seq_len=S, num_heads=hq, num_kv_heads=hkv, head_dim=D, batch=B, dtype_bytes=dtype_bytes, profile=profile)
    try:
        if s.kind == "single":
            return estimate_attention(algorithm="ring", world_size=1, **kw).est_time_s * 1e3
        if s.kind == "seqpar":
            return estimate_attention(algorithm=s.base, world_size=world, hp=s.hp if s.base == "2d" else None,  # type: ignore[arg-type]
                                      inner_ring_size=s.inner, **kw).est_time_s * 1e3
    except ValueError:
        return None
    return None


def run(args: argparse.Namespace) -> None:
    device_type = args.device
    if device_type == "cuda":
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), device_id=device)
        device_name, dtype, backend = torch.cuda.get_device_name(), torch.bfloat16, args.backend
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
        device_name, dtype, backend = "cpu", torch.float32, "math"
    W, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", W))
    profiles: dict[str, DeviceProfile] = {}

    def profile_for(kernel: str) -> DeviceProfile:  # the cost model's rates depend on the local kernel
        return profiles.setdefault(kernel, DeviceProfile.for_device(device_name, backend=kernel, gpus_per_node=per_node))
    dtype_bytes = torch.finfo(dtype).bits // 8
    mesh_1d = init_device_mesh(device_type, (W,), mesh_dim_names=("cp",))
    meshes_2d: dict[int, object] = {}
    grids = [parse_grid(g, args) for g in args.grid] or [parse_grid(f"seqs={args.seqs}", args)]
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        if rank == 0:
            if row.get("error"):
                print(f"S={row['seq']:>8} H={row['heads']:>6} {row['system'] + ':' + row['algorithm']:24s} [{row['error']}]", flush=True)
            else:
                eff = f"  eff {row['efficiency_vs_single']:.3f}" if row.get("efficiency_vs_single") else ""
                pred = f"  pred {row['predicted_ms']:9.1f} ms" if row.get("predicted_ms") else ""
                name = f"{row['system']}:{row['algorithm']}/{row['backend']}" + (f"/c{row['head_chunks']}" if row["head_chunks"] > 1 else "")
                print(f"S={row['seq']:>8} H={row['heads']:>6} {name:30s} {row['tflops_per_gpu']:7.1f} TFLOP/s/GPU"
                      f"  {row['time_ms']:9.1f} ms{pred}  peak {row['peak_mem_gb']:6.1f} GB op {row['op_mem_gb']:6.1f} GB{eff}"
                      f"  auto={row['auto_choice']}", flush=True)
            if args.out:  # rewritten after every measurement, replaced atomically (a run killed by `timeout` keeps its rows)
                with open(args.out + ".tmp", "w") as f:
                    json.dump(rows, f, indent=1)
                os.replace(args.out + ".tmp", args.out)

    for grid in grids:
        systems = [parse_system(name, W) for name in expand_systems(grid.systems, W)]
        for S in grid.seqs:
            for hq, hkv in grid.heads:
                B, D = args.batch, args.head_dim
                autos: dict[str, str] = {}

                def auto_for(kernel: str) -> str:  # what attention="auto" picks for this S, heads and W with this kernel
                    if kernel not in autos:
                        try:
                            autos[kernel] = choose_attention(seq_len=S, num_heads=hq, num_kv_heads=hkv, head_dim=D, world_size=W,
                                                             batch=B, dtype_bytes=dtype_bytes, profile=profile_for(kernel),
                                                             double_ring=False).label
                        except ValueError as e:
                            autos[kernel] = f"none ({e})"
                    return autos[kernel]

                single_tflops = None
                common = dict(bench="attention", heads=f"{hq}/{hkv}", model=f"H{hq}/{hkv}xD{D}", seq=S, batch=B, gpus=W,
                              device=device_name, commit=args.commit)
                for s in systems:
                    why = skip_reason(s, W, S, hq, args.single_max_seq, device_type, hkv)
                    be = s.backend or backend
                    profile = profile_for(be)
                    pred = predictions(s, S=S, hq=hq, hkv=hkv, D=D, B=B, world=W, profile=profile, dtype_bytes=dtype_bytes)
                    if why is None and s.kind == "seqpar":
                        est = estimate_attention(algorithm=s.base, seq_len=S, num_heads=hq, num_kv_heads=hkv, head_dim=D, world_size=W,  # type: ignore[arg-type]
                                                 hp=s.hp if s.base == "2d" else None, inner_ring_size=s.inner, batch=B,
                                                 dtype_bytes=dtype_bytes, profile=profile, head_chunks=s.chunks)
                        if device_type == "cuda" and est.peak_memory_bytes > 0.9 * torch.cuda.get_device_properties(device).total_memory:
                            why = f"the cost model estimates ~{est.peak_memory_bytes / 1e9:.0f} GB per GPU"
                    row = dict(common, auto_choice=auto_for(be), system=s.kind, algorithm=s.algorithm if s.kind != "single" else be,
                               backend=be if s.kind != "torch_cp" else "cudnn", head_chunks=s.chunks,
                               predicted_ms=pred, tflops_per_gpu=None, efficiency_vs_single=None, time_ms=None, peak_mem_gb=None,
                               op_mem_gb=None, error=None)
                    if why is not None:
                        emit(dict(row, error=f"skipped: {why}"))
                        continue
                    g = torch.Generator(device=device).manual_seed(1234 + rank)
                    n = S if s.kind == "single" else S // W
                    mk = lambda h: torch.randn(B, n, h, D, device=device, dtype=dtype, generator=g)  # noqa: E731
                    q, k, v, do = mk(hq).requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_(), mk(hq)
                    if s.kind == "single":
                        step = single_step(q, k, v, do, be)
                    elif s.kind == "torch_cp":
                        step = torch_cp_step(mesh_1d, s.algorithm, q, k, v, do)
                    else:
                        mesh = mesh_1d
                        if s.base == "2d":
                            if s.hp not in meshes_2d:  # cp ranks adjacent, as the strategy builds it (context-first)
                                meshes_2d[s.hp] = init_device_mesh(device_type, (s.hp, s.cp), mesh_dim_names=("hp", "cp"))
                            mesh = meshes_2d[s.hp]
                        step = seqpar_step(mesh, s, q, k, v, do, be)
                    try:
                        t, peak, op = timed(step, grid.iters, grid.warmup, device)
                        tflops = causal_flops(batch=B, seq_len=S, num_heads=hq, head_dim=D) / (1 if s.kind == "single" else W) / t / 1e12
                        if s.kind == "single" and single_tflops is None:  # the first single (the --backend one) is the reference
                            single_tflops = tflops
                        row.update(tflops_per_gpu=tflops, time_ms=t * 1e3, peak_mem_gb=peak, op_mem_gb=op,
                                   efficiency_vs_single=tflops / single_tflops if single_tflops else None)
                    except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is recorded as such
                        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
                    del q, k, v, do, step
                    gc.collect()  # a failed step's traceback holds its graph in a reference cycle (an OOM left 17 GB once)
                    if device_type == "cuda":
                        torch.cuda.empty_cache()
                    emit(row)
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------ grid tables


COLUMNS = (("seqpar", "ring", "ring"), ("seqpar", "allgather", "all-gather"), ("seqpar", "ulysses", "Ulysses"),
           *(("seqpar", f"2d:{hp}x{cp}", f"2D {hp}x{cp}") for hp, cp in ((2, 2), (8, 1), (4, 2), (2, 4), (1, 8))),
           ("seqpar", "ring:inner2", "double ring (2)"), ("seqpar", "ring:inner4", "double ring (4)"),
           ("torch_cp", "allgather", "torch CP allgather"), ("torch_cp", "alltoall", "torch CP alltoall"))


def grid_tables(paths: list[str], seqs: list[int] | None = None) -> str:
    """Markdown tables of the cuDNN grid, one per (GPUs, S): per heads, each system's TFLOP/s/GPU /
    peak GB (the latest record of each head-chunk count, the fastest of those; "c<n>": head chunks),
    the best of ours bold, and the ratios of the best of ours to the best torch CP and to one GPU
    (the latest one-GPU record at that S and heads, from any run)."""
    data = [json.load(open(p)) for p in sorted(paths)]
    return grid_tables_of([r for d in data if isinstance(d, list) for r in d], seqs)


def grid_tables_of(records: list, seqs: list[int] | None = None) -> str:
    """grid_tables of records already read (oldest first); docs/benchmarks.md's full grid (benchmarks/report.py)."""
    rows = [r for r in records if isinstance(r, dict) and r.get("bench") == "attention" and r.get("heads")
            and (r["system"] == "torch_cp" or r.get("backend", "cudnn") == "cudnn") and (not seqs or r["seq"] in seqs)]
    latest: dict[tuple, dict] = {}
    for r in rows:  # later records win
        latest[(r["gpus"], r["seq"], r["heads"], r["system"], r["algorithm"] if r["system"] != "single" else "", r.get("head_chunks", 1))] = r
    ok = lambda r: r is not None and r.get("tflops_per_gpu") and not r.get("error")  # noqa: E731

    def cell(gpus, S, heads, system, algorithm):
        cands = [r for k, r in latest.items() if k[:5] == (gpus, S, heads, system, algorithm)]
        good = [r for r in cands if ok(r)]
        if good:
            r = max(good, key=lambda r: r["tflops_per_gpu"])
            return r, f"{r['tflops_per_gpu']:.1f} / {r['peak_mem_gb']:.1f}" + (f" c{r['head_chunks']}" if r.get("head_chunks", 1) > 1 else "")
        errs = [r["error"] for r in cands if r.get("error")]
        hp = 1  # the head-parallel degree: a head count it does not divide reads "(H heads)"
        if system == "seqpar" and algorithm == "ulysses":
            hp = gpus
        elif system == "seqpar" and algorithm.startswith("2d:"):
            hp = int(algorithm[3:].split("x")[0])
        if int(heads.split("/")[0]) % hp or any("divide" in e and "head-parallel" in e for e in errs):
            return None, f"({heads.split('/')[0]} heads)"
        return None, "OOM" if any("OutOfMemory" in e for e in errs) else "-"

    def single(S, heads):
        rs = [r for k, r in latest.items() if k[1:4] == (S, heads, "single") and ok(r)]
        return rs[-1] if rs else None

    out = []
    for gpus, S in sorted({(k[0], k[1]) for k in latest if k[3] != "single"}):
        cols = [c for c in COLUMNS if any(k[:2] == (gpus, S) and (k[3], k[4]) == c[:2] for k in latest)]
        out += [f"{gpus} GPUs, S = {S // 1024}K (TFLOP/s/GPU / peak GB):", "",
                "| heads | one GPU | " + " | ".join(c[2] for c in cols) + " | ours / torch CP | ours / one GPU |",
                "| --- " * (len(cols) + 4) + "|"]
        for heads in sorted({k[2] for k in latest if k[:2] == (gpus, S)}, key=lambda h: (int(h.split("/")[0]), -int(h.split("/")[1]))):
            cells = [cell(gpus, S, heads, *c[:2]) for c in cols]
            ours = [r for (r, _), c in zip(cells, cols) if r and c[0] == "seqpar"]
            best = max(ours, key=lambda r: r["tflops_per_gpu"], default=None)
            cp = max((r["tflops_per_gpu"] for (r, _), c in zip(cells, cols) if r and c[0] == "torch_cp"), default=None)
            one = single(S, heads)
            texts = [f"**{t}**" if r is best and r else t for r, t in cells]
            ratio = lambda a, b: f"{a / b:.3f}" if a and b else "-"  # noqa: E731
            one_text = f"{one['tflops_per_gpu']:.1f} / {one['peak_mem_gb']:.1f}" if one else "-"
            out.append(f"| {heads} | {one_text} | " + " | ".join(texts)
                       + f" | {ratio(best and best['tflops_per_gpu'], cp)} | {ratio(best and best['tflops_per_gpu'], one and one['tflops_per_gpu'])} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", action="append", default=[], help='"seqs=...;heads=...;systems=...;iters=...;warmup=..." (repeatable)')
    ap.add_argument("--seqs", default="131072,524288", help="without --grid: the sequence lengths")
    ap.add_argument("--heads", default="32/8", help="comma list of H_q/H_kv (default of --grid)")
    ap.add_argument("--systems", default="seqpar:ring,torch_cp:allgather,torch_cp:alltoall", help="default of --grid")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--single-max-seq", type=int, default=131072, help="longest S of the one-GPU reference")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", default="cudnn", help="local kernel of seqpar and single without a backend suffix (CUDA)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    ap.add_argument("--table", nargs="+", metavar="JSON", help="print markdown tables of the cuDNN grid, every algorithm, and exit")
    ap.add_argument("--table-seqs", default="", help="with --table: only these S (comma list)")
    args = ap.parse_args()
    if args.table:
        print(grid_tables(args.table, [int(x) for x in args.table_seqs.split(",") if x]))
        return
    t0 = time.time()
    with contextlib.suppress(KeyboardInterrupt):
        run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"done in {time.time() - t0:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()

"""Attention and the other token mixers alone, forward + backward: our kernels and distributed algorithms against the
peers. One runner, a mode per question (its first argument; ``grid`` when none is given); options: OPTIONS.

    torchrun --nproc_per_node=4 benchmarks/attention.py grid --grid "seqs=32768,131072;heads=32/8,32/32,33/33;systems=all" --out a.json
    python benchmarks/attention.py local --seqs 8192,32768     # our block ops against torch SDPA, one GPU
    python benchmarks/attention.py rates --backend cudnn       # the kernel's rate on the block shapes of the algorithms
    python benchmarks/attention.py window                      # sliding window, soft-capping, FlexAttention, one GPU
    torchrun --nproc_per_node=4 benchmarks/attention.py lasp --local-seqs 8192,32768,262144
    python benchmarks/attention.py scan --rule delta --seqs 16384,131072   # also --rule ssd / mamba1; torchrun: sequence parallel
    python benchmarks/attention.py matmul --sizes 4096,8192,16384          # the bf16 matmul peak of mfu_measured_peak
    torchrun --nproc_per_node=2 benchmarks/attention.py grid --device cpu --grid "seqs=64;heads=4/2,3/3;systems=all" --iters 1 --warmup 0

Every mode times with driver.timed (the median of --iters after --warmup; CUDA events; under torchrun the slowest rank
and the largest memory) and appends a record per measurement to --out. grid (bench "attention"): causal forward +
backward of random q, k, v ([B, S/W, H, D] per rank, bf16, zigzag); TFLOP/s per GPU = 3.5 x 2 x B x H x S^2 x D / W /
time (``single``: the whole sequence on one GPU); peak_mem_gb (inputs and gradients included), op_mem_gb (what the call
adds), predicted_ms (the cost model), auto_choice; torch_cp: SDPA (cuDNN) inside ``context_parallel`` on the local
shards; systems seqpar:ring | allgather | ulysses | 2d:<hp>x<cp> | ring:inner<w>, torch_cp:allgather | alltoall,
single, "all" (every one for this world size), suffixes ":<backend>" and, for ring / all-gather, ":chunks<c>" (Note
[Head chunks]). local: "local_check" (each backend against fp32 math) and "local" (ours against torch SDPA with the same
kernel). rates: "kernel_rate" on the calls the algorithms make, the fastest of --iters (Note [Choosing the attention
algorithm]). window: "window_time" against full causal attention (issue #21's goal: at most 1.2x the window's FLOP
share). lasp: "lasp_op", LASP's p2p and all-gather exchanges and "local" at TNL-1B's heads. scan: "delta_rule" (Qwen3-Next's
gated DeltaNet layer), "ssd_scan" (Mamba2, Bamba-9B's shape) or "selective_scan" (Mamba1) against transformers' torch
path (and fla-core); under torchrun ours is sequence parallel (SEQPAR_STATE_CHAIN=1: the states down the chain);
peak_mem_gb in GiB. matmul: "matmul", torch.mm of n x n bf16, 2 n^3 / time at the best n. a2a (torchrun): "a2a", one
all_to_all_single of --mbs MB per rank alone, the --load alone (bf16 matmuls of --gemm-n, or the local attention kernel
on --load-seq tokens), and the two at once (the all-to-all posted first, as Ulysses posts a stage's all-to-all before the
attention it overlaps): GB/s leaving each GPU, the share of the all-to-all the load hid, and whether every chunk arrived
from the rank it names; the NCCL_* environment of the run is recorded. --path ce: NCCL's copy-engine all-to-all
(docs/benchmarks.md: alone 212-280 GB/s at a stage's sizes on 4 x H200 either way, little of it hidden beside a load).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch._dynamo.config as dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method

from lightning_seqpar.sharding.agreement import RankAgreement
from lightning_seqpar.attention import BACKENDS, lasp_attention, linear_attention, local_attention, sequence_parallel_attention
from lightning_seqpar.attention import local, masked
from lightning_seqpar.attention import recurrent as ours
from lightning_seqpar.attention.cost import DeviceProfile, causal_flops, choose_attention, estimate_attention
from lightning_seqpar.attention.lasp import resolve_kernel
from lightning_seqpar.attention.variants import Mask, Variant
from lightning_seqpar.sharding.documents import PackedDocuments
from lightning_seqpar.models.transnormer import tnl_decay_log
from lightning_seqpar.sharding import shard_sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from driver import append_records, device_name, error_text, mode_of, runner_args, setup, timed  # noqa: E402

OPTIONS: dict[str, dict] = {  # each mode's options and defaults (a list: repeatable; True / False: a switch). grid: without
    # a --grid spec, --seqs at --heads with --systems; --backend of ours and single without a suffix. rates: --labels of
    # RATE_SHAPES, --heads Hq/Hkv for all. lasp: tokens per GPU, TNL-1B's heads, the decay of --layer. scan: --rule delta /
    # ssd / mamba1; --kernel (delta, ssd); --heads (value heads; key heads: half), --dim, --docs (delta); --channels, --state,
    # --chunks (mamba1)
    "grid": dict(iters=3, warmup=1, grid=[], seqs="131072,524288", heads="32/8", systems="seqpar:ring,torch_cp:allgather,torch_cp:alltoall",
                 head_dim=128, batch=1, single_max_seq=131072, backend="cudnn"),
    "local": dict(iters=10, warmup=3, seqs="8192,32768"),
    "rates": dict(iters=2, warmup=1, backend="cudnn", head_dim=128, labels=None, heads=None),
    "window": dict(iters=5, warmup=2, seq=131072, window=4096, heads=16, kv_heads=8, head_dims="128,256"),
    "lasp": dict(iters=5, warmup=2, local_seqs="8192,32768,262144", heads=16, dk=128, dv=128, layer=1,
                 algorithms="local,lasp-p2p,lasp-allgather", kernel="auto"),
    "scan": dict(iters=3, warmup=1, rule="delta", seqs="16384,131072", systems="seqpar,transformers,fla", kernel="torch", heads=32, dim=128,
                 channels=1536, state=16, chunks="8,16,32", docs=0, check=False),
    "matmul": dict(iters=50, warmup=10, sizes="4096,8192,16384"),
    "a2a": dict(iters=10, warmup=3, mbs="32,168", load="gemm", gemm_n=8192, gemm_reps=8, load_seq=131072, load_heads="4/1", path="kernel"),
}


def _free(device) -> None:
    gc.collect()  # a failed step's traceback holds its graph in a reference cycle (an OOM left 17 GB once)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _block(q, k, v, do, *, backend: str, causal: bool = True, mask=None) -> tuple:
    """One forward + backward of the package's block ops on q, k, v [B, S, H, D] (with a ``mask``: the variant ops, Note
    [Attention variants]), as the distributed algorithms call them: (out, lse, (dq, dk, dv))."""
    scale = q.shape[-1] ** -0.5
    if mask is None:
        o, lse = local.block_forward(q, k, v, causal=causal, scale=scale, backend=backend)
        return o, lse, local.block_backward(do, q, k, v, o, lse, causal=causal, scale=scale, backend=backend)
    o, lse = masked.variant_block_forward(q, k, v, mask, scale=scale, backend=backend)
    return o, lse, masked.variant_block_backward(do, q, k, v, o, lse, mask, scale=scale, backend=backend)


# ---- grid: distributed attention, every algorithm against torch CP and one GPU -----------------------------

def parse_grid(spec: str, defaults: argparse.Namespace) -> argparse.Namespace:
    """``"seqs=32768,131072;heads=32/8,33/33;systems=all;iters=2;warmup=1"`` (keys optional but seqs): seqs, heads
    ((H_q, H_kv) pairs), systems, iters, warmup."""
    fields = dict(part.split("=", 1) for part in spec.split(";") if part.strip())
    if set(fields) - {"seqs", "heads", "systems", "iters", "warmup"} or "seqs" not in fields:
        raise SystemExit(f"--grid {spec!r}: expected keys seqs (required), heads, systems, iters, warmup; got {sorted(fields)}")
    heads = tuple((int(h.partition("/")[0]), int(h.partition("/")[2] or h.partition("/")[0]))
                  for h in fields.get("heads", defaults.heads).split(","))
    return argparse.Namespace(seqs=tuple(int(s) for s in fields["seqs"].split(",")), heads=heads,
                              systems=tuple(fields.get("systems", defaults.systems).split(",")),
                              iters=int(fields.get("iters", defaults.iters)), warmup=int(fields.get("warmup", defaults.warmup)))


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
    algorithm: str  # as recorded: "ring", "2d:2x2", "ring:inner2", "allgather" (torch_cp), "local"
    base: str = ""  # seqpar: "ring" | "allgather" | "ulysses" | "2d"
    hp: int = 1
    cp: int = 1
    inner: int | None = None
    backend: str | None = None  # None: --backend
    chunks: int = 1


def parse_system(name: str, world: int) -> System:
    kind, _, rest = name.partition(":")
    if kind == "single" and (not rest or rest in BACKENDS):
        return System("single", "local", backend=rest or None)
    if kind == "torch_cp" and rest in ("allgather", "alltoall"):
        return System("torch_cp", rest)
    parts = rest.split(":")
    base, extras, hp, cp, inner, backend, chunks = parts[0], parts[1:], 1, world, None, None, 1
    if kind != "seqpar" or base not in ("ring", "allgather", "ulysses", "2d"):
        raise SystemExit(f"unknown system {name!r}; see the docstring of benchmarks/attention.py")
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


def _step(s: System, mesh, q, k, v, do, backend: str):
    """One forward + backward of system ``s`` on this rank's q, k, v [B, n, H, D]."""
    if s.kind == "seqpar":
        agreed = RankAgreement()  # the ranks' inputs are compared on the first (warm-up) call only, as an Attention module does

        def call():
            return sequence_parallel_attention(q, k, v, mesh=mesh, algorithm=s.base, causal=True, layout="zigzag", backend=backend,
                                               inner_ring_size=s.inner, head_chunks=s.chunks, agreement=agreed)
    elif s.kind == "single":
        def call():
            return local_attention(q, k, v, causal=True, backend=backend)
    else:
        return _torch_cp_step(mesh, s.algorithm, q, k, v, do)

    def step():
        call().backward(do)
        q.grad = k.grad = v.grad = None
    return step


def _torch_cp_step(mesh, rotate, q, k, v, do):
    set_rotate_method(rotate)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()
    mode = {"gqa": qt.shape[1] != kt.shape[1]}
    # context_parallel needs one buffer to learn the global length; the inputs are already local shards
    positions = torch.arange(qt.shape[2] * mesh.size(), device=qt.device)[None]

    def step():
        with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[1]), torch.nn.attention.sdpa_kernel(
                torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
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


def run_grid(args) -> None:
    device, mesh_1d, rank, W = setup(args.device, group=True, axis="cp")
    cuda = args.device == "cuda"
    name, dtype, backend = device_name(device), torch.bfloat16 if cuda else torch.float32, args.backend if cuda else "math"
    per_node, dtype_bytes = int(os.environ.get("LOCAL_WORLD_SIZE", W)), torch.finfo(dtype).bits // 8
    profiles: dict[str, DeviceProfile] = {}
    meshes_2d: dict[int, object] = {}
    rows: list[dict] = []

    def profile_for(kernel: str) -> DeviceProfile:  # the cost model's rates depend on the local kernel
        return profiles.setdefault(kernel, DeviceProfile.for_device(name, backend=kernel, gpus_per_node=per_node))

    def emit(row: dict) -> None:
        rows.append(row)
        if rank != 0:
            return
        where = f"[attention] S={row['seq']:>8} H={row['heads']:>6} {row['system'] + ':' + row['algorithm']}"
        if row.get("error"):
            print(f"{where} [{row['error']}]", flush=True)
        else:
            eff = f"  eff {row['efficiency_vs_single']:.3f}" if row.get("efficiency_vs_single") else ""
            pred = f"  pred {row['predicted_ms']:9.1f} ms" if row.get("predicted_ms") else ""
            print(f"{where}/{row['backend']}{'/c' + str(row['head_chunks']) if row['head_chunks'] > 1 else ''}: {row['tflops_per_gpu']:7.1f} "
                  f"TFLOP/s/GPU  {row['time_ms']:9.1f} ms{pred}  peak {row['peak_mem_gb']:6.1f} GB op {row['op_mem_gb']:6.1f} GB{eff}"
                  f"  auto={row['auto_choice']}", flush=True)
        if args.out:  # rewritten after every measurement, replaced atomically (a run ended by `timeout` keeps its rows)
            with open(args.out + ".tmp", "w") as f:
                json.dump(rows, f, indent=1)
            os.replace(args.out + ".tmp", args.out)

    for grid in [parse_grid(g, args) for g in args.grid] or [parse_grid(f"seqs={args.seqs}", args)]:
        systems = [parse_system(s, W) for s in expand_systems(grid.systems, W)]
        for S in grid.seqs:
            for hq, hkv in grid.heads:
                B, D = args.batch, args.head_dim
                kw = dict(seq_len=S, num_heads=hq, num_kv_heads=hkv, head_dim=D, batch=B, dtype_bytes=dtype_bytes)
                autos: dict[str, str] = {}
                single_tflops = None
                for s in systems:
                    why = skip_reason(s, W, S, hq, args.single_max_seq, args.device, hkv)
                    be = s.backend or backend
                    profile = profile_for(be)
                    if be not in autos:  # what attention="auto" picks for this S, heads and W with this kernel
                        try:
                            autos[be] = choose_attention(world_size=W, profile=profile, double_ring=False, **kw).label
                        except ValueError as e:
                            autos[be] = f"none ({e})"
                    pred = None
                    if s.kind != "torch_cp":
                        try:  # single: the ring's estimate on one GPU
                            pred = estimate_attention(algorithm=s.base or "ring", world_size=1 if s.kind == "single" else W, profile=profile,
                                                      hp=s.hp if s.base == "2d" else None, inner_ring_size=s.inner, **kw).est_time_s * 1e3
                        except ValueError:
                            pass
                    if why is None and s.kind == "seqpar" and cuda:
                        est = estimate_attention(algorithm=s.base, world_size=W, hp=s.hp if s.base == "2d" else None, inner_ring_size=s.inner,
                                                 profile=profile, head_chunks=s.chunks, **kw)
                        if est.peak_memory_bytes > 0.9 * torch.cuda.get_device_properties(device).total_memory:
                            why = f"the cost model estimates ~{est.peak_memory_bytes / 1e9:.0f} GB per GPU"
                    row = dict(bench="attention", heads=f"{hq}/{hkv}", model=f"H{hq}/{hkv}xD{D}", seq=S, batch=B, gpus=W, device=name,
                               commit=args.commit, auto_choice=autos[be], system=s.kind, algorithm=s.algorithm if s.kind != "single" else be,
                               backend=be if s.kind != "torch_cp" else "cudnn", head_chunks=s.chunks, predicted_ms=pred, tflops_per_gpu=None,
                               efficiency_vs_single=None, time_ms=None, peak_mem_gb=None, op_mem_gb=None, error=None)
                    if why is not None:
                        emit(dict(row, error=f"skipped: {why}"))
                        continue
                    g = torch.Generator(device=device).manual_seed(1234 + rank)
                    n = S if s.kind == "single" else S // W
                    mk = lambda h: torch.randn(B, n, h, D, device=device, dtype=dtype, generator=g)  # noqa: E731
                    q, k, v, do = mk(hq).requires_grad_(), mk(hkv).requires_grad_(), mk(hkv).requires_grad_(), mk(hq)
                    mesh = mesh_1d
                    if s.base == "2d":
                        if s.hp not in meshes_2d:  # cp ranks adjacent, as the strategy builds it (context-first)
                            meshes_2d[s.hp] = init_device_mesh(args.device, (s.hp, s.cp), mesh_dim_names=("hp", "cp"))
                        mesh = meshes_2d[s.hp]
                    step = _step(s, mesh, q, k, v, do, be)
                    try:
                        t, peak, op = timed(step, grid.iters, grid.warmup, device)
                        tflops = causal_flops(batch=B, seq_len=S, num_heads=hq, head_dim=D) / (1 if s.kind == "single" else W) / t / 1e12
                        if s.kind == "single" and single_tflops is None:  # the first single (the --backend one) is the reference
                            single_tflops = tflops
                        row.update(tflops_per_gpu=tflops, time_ms=t * 1e3, peak_mem_gb=peak, op_mem_gb=op,
                                   efficiency_vs_single=tflops / single_tflops if single_tflops else None)
                    except Exception as e:  # noqa: BLE001 - a peer that cannot run this shape is recorded as such
                        row.update(error=error_text(e, 200))
                    del q, k, v, do, step
                    _free(device)
                    emit(row)
    dist.barrier()
    dist.destroy_process_group()


# ---- one GPU: the local kernels, their rates, windows, the matmul peak --------------------------------------

def run_local(args, device) -> list[dict]:
    rows, name = [], device_name(device)
    backends = [b for b in local.available_backends(device, torch.bfloat16) if b != "math"]
    for be in backends:  # correctness first: every backend against fp32 math
        for hq, hkv in ((4, 4), (8, 2), (4, 1), (3, 3)):
            for causal in (True, False):
                g = torch.Generator(device=device).manual_seed(0)
                x = [torch.randn(2, 384, h, 64, device=device, generator=g, dtype=torch.bfloat16) for h in (hq, hkv, hkv, hq)]
                o, lse, grads = _block(*x, causal=causal, backend=be)
                ro, rl, rg = _block(*[t.float() for t in x], causal=causal, backend="math")
                err = max(((a.float() - b).norm() / b.norm()).item() for a, b in zip((o, lse, *grads), (ro, rl, *rg)))
                rows.append(dict(bench="local_check", backend=be, hq=hq, hkv=hkv, causal=causal, rel_err=err, ok=err < 2e-2))
                print(f"[attention] check {be:9s} hq={hq} hkv={hkv} causal={causal}: rel err {err:.2e} {'OK' if err < 2e-2 else 'FAIL'}")
    H, D = 32, 128
    for S in (int(s) for s in args.seqs.split(",")):
        for hkv in (32, 8):
            q, k, v = (torch.randn(1, S, h, D, device=device, dtype=torch.bfloat16) for h in (H, hkv, hkv))
            do = torch.randn_like(q)
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            steps = {("seqpar", be): lambda be=be: _block(q, k, v, do, backend=be) for be in backends}
            for be, sdpb in (("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION), ("flash", torch.nn.attention.SDPBackend.FLASH_ATTENTION)):
                def ref(sdpb=sdpb):
                    with torch.nn.attention.sdpa_kernel(sdpb):
                        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=hkv != H).backward(do.transpose(1, 2))
                steps[("torch_sdpa", be)] = ref
            flops = 3.5 * 2 * H * S * S * D  # causal forward 4 B H S^2 D / 2, backward 2.5x forward
            for (system, be), step in steps.items():
                try:
                    t = timed(step, args.iters, args.warmup, device)[0]
                except Exception as e:  # noqa: BLE001 - torch SDPA's kernel may not take this shape
                    print(f"[attention] S={S} hkv={hkv} {system} {be} failed: {error_text(e, 120)}")
                    continue
                rows.append(dict(bench="local", system=system, backend=be, seq=S, hq=H, hkv=hkv, time_s=t, tflops=flops / t / 1e12, device=name,
                                 commit=args.commit))
                print(f"[attention] S={S} hkv={hkv} {be:9s} {'ours' if system == 'seqpar' else 'sdpa'} {flops / t / 1e12:6.1f} TFLOP/s")
    return rows


K = 1024
RATE_SHAPES = [  # (label, Sq, Sk, Hq, Hkv, causal)
    ("one GPU 32K", 32 * K, 32 * K, 32, 8, True), ("one GPU 128K", 128 * K, 128 * K, 32, 8, True),
    ("ring W4 128K: causal shard", 32 * K, 32 * K, 32, 8, True), ("ring W4 128K: half block", 16 * K, 32 * K, 32, 8, False),
    ("ulysses W4 128K", 128 * K, 128 * K, 8, 2, True),
    ("ring W4 512K: causal shard", 128 * K, 128 * K, 32, 8, True), ("ring W4 512K: half block", 64 * K, 128 * K, 32, 8, False),
    ("ulysses W4 512K", 512 * K, 512 * K, 8, 2, True),
    ("ring W4 1M: causal shard", 256 * K, 256 * K, 32, 8, True), ("ring W4 1M: half block q", 128 * K, 256 * K, 32, 8, False),
    ("ring W4 1M: half block k", 256 * K, 128 * K, 32, 8, False), ("ulysses W2 1M", 1024 * K, 1024 * K, 16, 4, True),
    ("ulysses W4 1M", 1024 * K, 1024 * K, 8, 2, True),
]


def run_rates(args, device) -> list[dict]:
    rows, D = [], args.head_dim
    for label, sq, sk, hq, hkv, causal in RATE_SHAPES:
        if args.labels is not None and label not in args.labels.split(","):
            continue
        if args.heads:
            hq, hkv = (int(h) for h in args.heads.split("/"))
        q, k, v, do = (torch.randn(1, n, h, D, device=device, dtype=torch.bfloat16) for n, h in ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq)))
        t = timed(lambda: _block(q, k, v, do, causal=causal, backend=args.backend), args.iters, args.warmup, device, best=True)[0]
        tflops = 3.5 * (2.0 if causal else 4.0) * sq * sk * hq * D / t / 1e12
        rows.append(dict(bench="kernel_rate", backend=args.backend, label=label, sq=sq, sk=sk, hq=hq, hkv=hkv, head_dim=D, causal=causal,
                         time_s=t, tflops=tflops, device=device_name(device), commit=args.commit))
        print(f"[attention] {label:28s} Sq={sq:8d} Sk={sk:8d} H={hq}/{hkv} causal={causal!s:5s} {tflops:6.1f} TFLOP/s  {t * 1e3:9.1f} ms", flush=True)
        del q, k, v, do
        _free(device)
    return rows


def run_window(args, device) -> list[dict]:
    masked.flex_functions()  # import + compile wrapper
    setattr(dynamo, "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit", 256)
    rows, name = [], device_name(device)

    def whole(S: int, variant: Variant) -> Mask:
        pos = torch.arange(S, device=device)[None]
        return Mask(pos, pos, None, None, variant, False, 0)

    S, w = args.seq, args.window
    share = (S * w - w * (w - 1) / 2) / (S * (S + 1) / 2)
    for D in (int(x) for x in args.head_dims.split(",")):
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, do = (torch.randn(1, S, h, D, device=device, generator=g, dtype=torch.bfloat16)
                       for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
        be = local.resolve_backend("auto", device, torch.bfloat16, D)
        mask, cap = whole(S, Variant(True, w)), whole(S, Variant(True, w, 0, 50.0))
        bm, bm_cap = masked.flex_block_mask(mask), masked.flex_block_mask(cap)

        def flex(m, b):
            def step():
                o, l = masked.flex_forward(q, k, v, m, D**-0.5, b)
                masked.flex_backward(do, q, k, v, o, l, m, D**-0.5, b)
            return step

        def flex_raw():
            qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
            torch.autograd.grad(masked.flex_call(qr, kr, vr, mask, D**-0.5, bm)[0], (qr, kr, vr), do)

        t_causal = None
        for kernel, step in {"causal": lambda: _block(q, k, v, do, backend=be), "window": lambda: _block(q, k, v, do, mask=mask, backend=be),
                             "window_softcap": lambda: _block(q, k, v, do, mask=cap, backend=be), "flex": flex(mask, bm), "flex_raw": flex_raw,
                             "softcap": flex(cap, bm_cap)}.items():
            try:
                t = timed(step, args.iters, args.warmup, device)[0]
            except Exception as e:  # noqa: BLE001 - report the kernel that cannot run, measure the others
                print(f"[attention] time {kernel}: failed: {error_text(e, 200)}")
                rows.append(dict(bench="window_time", kernel=kernel, error=error_text(e)))
                continue
            t_causal = t if kernel == "causal" else t_causal
            ratio = None if t_causal is None else t / t_causal
            flops = 4 * args.heads * D * S * (S + 1) / 2 * 3.5 * (1.0 if kernel == "causal" else share)
            rows.append(dict(bench="window_time", kernel=kernel, seq_len=S, window=w, heads=args.heads, kv_heads=args.kv_heads, head_dim=D,
                             dense_backend=be, seconds=t, tflops=flops / t / 1e12, ratio_to_causal=ratio, flop_share=share, goal_ratio=1.2 * share,
                             meets_goal=None if ratio is None or kernel == "causal" else ratio <= 1.2 * share, device=name, torch=torch.__version__))
            print(f"[attention] time {kernel:9s} S={S} w={w} D={D}: {t * 1e3:9.2f} ms  {flops / t / 1e12:6.1f} TFLOP/s"
                  + ("" if ratio is None else f"  ratio {ratio:.4f} (window share {share:.4f}, goal <= {1.2 * share:.4f})"))
    return rows


def run_matmul(args, device) -> list[dict]:
    by_size = {}
    for n in (int(x) for x in args.sizes.split(",")):
        a, b, out = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(3))
        by_size[n] = 2 * n**3 / timed(lambda: torch.mm(a, b, out=out), args.iters, args.warmup, device)[0] / 1e12
    best = max(by_size, key=by_size.get)
    row = dict(bench="matmul", system="torch.mm", algorithm="bf16", device=device_name(device), gpus=1, n=best, tflops=by_size[best],
               by_size={str(n): t for n, t in by_size.items()}, iters=args.iters, torch=torch.__version__, commit=args.commit)
    print(f"[attention] matmul {row['device']}: bf16 torch.mm peak {row['tflops']:.1f} TFLOP/s (n={best}; "
          + ", ".join(f"{n}: {t:.1f}" for n, t in by_size.items()) + ")", flush=True)
    return [row]


# ---- LASP and the recurrent scans, one device or sequence parallel ------------------------------------------

def run_lasp(args) -> None:
    device, mesh, rank, W = setup(args.device, group=True)
    kernel = resolve_kernel(args.kernel, device)
    H, Dk, Dv = args.heads, args.dk, args.dv
    decay = tnl_decay_log(H, args.layer, 16, device=device)
    rows = []
    for C in (int(s) for s in args.local_seqs.split(",")):
        gen = torch.Generator(device=device).manual_seed(1234 + rank)
        q, k = (F.silu(torch.randn(1, C, H, Dk, device=device, generator=gen)).to(torch.bfloat16).requires_grad_() for _ in range(2))
        v = torch.randn(1, C, H, Dv, device=device, generator=gen).to(torch.bfloat16).requires_grad_()
        do = torch.randn(1, C, H, Dv, device=device, generator=gen).to(torch.bfloat16)
        for algorithm in args.algorithms.split(","):
            def call(variant=algorithm.removeprefix("lasp-")):
                if variant == "local":
                    return linear_attention(q, k, v, decay, kernel=kernel)
                return lasp_attention(q, k, v, decay, mesh=mesh, variant=variant, kernel=kernel)

            def step():
                call().backward(do)
                q.grad = k.grad = v.grad = None

            def forward():
                with torch.no_grad():
                    call()
            try:
                t, peak, _ = timed(step, args.iters, args.warmup, device)
                t_fwd = timed(forward, args.iters, args.warmup, device)[0]
                err = None
            except Exception as e:  # noqa: BLE001 - recorded, and the next shape still runs
                t = t_fwd = peak = float("nan")
                err = error_text(e, 200)
                _free(device)
            rows.append(dict(bench="lasp_op", system="seqpar", algorithm=algorithm, model=f"TNL H{H} Dk{Dk} Dv{Dv} layer{args.layer}",
                             seq=C * W, tokens_per_gpu=C, batch=1, gpus=W, device=device_name(device), kernel=kernel, time_ms=t * 1e3,
                             fwd_ms=t_fwd * 1e3, peak_mem_gb=peak if device.type == "cuda" else None, commit=args.commit, error=err))
            if rank == 0:
                print(f"[attention] lasp C={C:>8}/GPU W={W} {algorithm:15s} kernel={kernel}: fwd+bwd {t * 1e3:9.2f} ms, fwd {t_fwd * 1e3:9.2f} ms, "
                      f"peak {peak:6.1f} GB" + (f"  [{err}]" if err else ""), flush=True)
        del q, k, v, do
        _free(device)
    if rank == 0 and args.out:
        append_records(args.out, rows)
    dist.barrier()
    dist.destroy_process_group()


def _scan_inputs(args, T: int, device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(inputs, output gradient) of --rule on T tokens, the same on every call (seeds 0 and 1, made on the CPU)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=g).to(device)  # noqa: E731
    dy = lambda *s: torch.randn(*s, generator=torch.Generator().manual_seed(1)).to(device)  # noqa: E731
    if args.rule == "delta":  # after the projections: q, k of H/2 key heads, v of H value heads
        H, D = args.heads, args.dim
        return ({"q": make(1, T, H // 2, D).bfloat16(), "k": make(1, T, H // 2, D).bfloat16(), "v": make(1, T, H, D).bfloat16(),
                 "g": -F.softplus(make(1, T, H)) * 0.1, "beta": torch.sigmoid(make(1, T, H))}, dy(1, T, H, D))
    if args.rule == "ssd":  # Mamba2 after the in-projection and the conv (Bamba-9B: 128 heads of 64, state 128, one group)
        return ({"x": make(1, T, 128, 64).bfloat16(), "dt": F.softplus(make(1, T, 128) - 4), "A": -torch.rand(128, generator=g).to(device) - 0.5,
                 "B": make(1, T, 1, 128).bfloat16(), "C": make(1, T, 1, 128).bfloat16(), "D": torch.ones(128, device=device)}, dy(1, T, 128, 64))
    E, N = args.channels, args.state  # Mamba1 (fp32)
    return ({"x": make(1, T, E), "dt": F.softplus(make(1, T, E) - 4), "A": -torch.arange(1.0, N + 1).expand(E, N).contiguous().to(device),
             "B": make(1, T, 1, N), "C": make(1, T, 1, N), "D": torch.ones(E, device=device)}, dy(1, T, E))


def _scan_step(args, system: str, inputs: dict, do: torch.Tensor, mesh, docs=None, chunk: int = 0) -> tuple[torch.Tensor, dict]:
    """One forward + backward of sum(out * do); (out, the inputs' gradients)."""
    x = {k: v.detach().requires_grad_() for k, v in inputs.items()}
    if args.rule == "delta" and system != "seqpar":
        rep = x["v"].shape[2] // x["q"].shape[2]
        q, k = x["q"].repeat_interleave(rep, 2), x["k"].repeat_interleave(rep, 2)
    if (args.rule, system) == ("delta", "seqpar"):
        o = ours.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], mesh=mesh, layout="zigzag", kernel=args.kernel, documents=docs)
    elif (args.rule, system) == ("delta", "fla"):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o = chunk_gated_delta_rule(q, k, x["v"], g=x["g"], beta=x["beta"].bfloat16(), use_qk_l2norm_in_kernel=True)[0]
    elif args.rule == "delta":
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        o = torch_chunk_gated_delta_rule(q, k, x["v"], g=x["g"], beta=x["beta"], use_qk_l2norm_in_kernel=True)[0]
    elif (args.rule, system) == ("ssd", "seqpar"):
        o = ours.ssd_scan(x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], kernel=args.kernel)
    elif args.rule == "ssd":
        from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

        o = mamba2_chunk_scan(x["x"], x["dt"], x["A"], x["B"], x["C"], chunk_size=256, D=x["D"])
        o = o[0] if isinstance(o, tuple) else o
    elif system == "seqpar":
        o = ours.selective_scan(x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], chunk_size=chunk, mesh=mesh, layout="zigzag")
    else:
        from transformers.models.mamba.modeling_mamba import mamba_selective_scan

        t = lambda a: a.transpose(1, 2)  # noqa: E731
        o = t(mamba_selective_scan(t(x["x"]), t(x["dt"]), x["A"], t(x["B"][:, :, 0]), t(x["C"][:, :, 0]), D=x["D"]))
    (o.float() * do).sum().backward()
    return o.detach(), {k: v.grad for k, v in x.items()}


def run_scan(args) -> None:
    device, mesh, rank, world = setup(args.device)
    bench = {"delta": "delta_rule", "ssd": "ssd_scan", "mamba1": "selective_scan"}[args.rule]
    systems = ["seqpar"] if mesh is not None or args.docs else args.systems.split(",")
    chain = os.environ.get("SEQPAR_STATE_CHAIN", "0") == "1" or args.kernel == "fla"
    for T in (int(s) for s in args.seqs.split(",")):
        for system, chunk in [(s, int(c)) for s in systems for c in (args.chunks.split(",") if (args.rule, s) == ("mamba1", "seqpar") else [0])]:
            row = dict(bench=bench, system=system, seq=T, gpus=world, device=device_name(device), time_ms=None, tokens_per_s=None, peak_mem_gb=None,
                       error=None, commit=args.commit)
            row.update(dict(channels=args.channels, state=args.state, chunk_size=chunk or None) if args.rule == "mamba1" else
                       dict(kernel=args.kernel if system == "seqpar" else None, heads=args.heads, dim=args.dim, documents=args.docs or None))
            if args.rule == "ssd":
                row.update(heads=128, dim=64, state=128)
            if system == "seqpar" and world > 1:  # how the states cross the ranks (SEQPAR_STATE_CHAIN=1: down the chain)
                row["state_passing"] = "chain" if chain else "parallel"
                if chain and args.kernel == "torch" and args.rule == "delta":
                    row["baseline"] = True  # the same code with the chain forced: the comparison, not ours
            try:
                if args.rule != "delta" and args.docs or args.rule == "ssd" and world > 1 or system == "fla" and args.rule != "delta":
                    raise ValueError("--docs is for --rule delta; --rule ssd runs on one device; fla-core is a system of --rule delta")
                if system == "fla":
                    why = "fla-core is not installed" if not ours.fla_installed() else ours.fla_unusable(device.index)
                    if why:
                        raise RuntimeError(why)
                full, do_full = _scan_inputs(args, T, device)
                docs = lengths = None
                if args.docs:
                    lengths = [[T // args.docs] * (args.docs - 1) + [T - T // args.docs * (args.docs - 1)]]
                    docs = PackedDocuments.from_lengths(lengths, world=world)
                shard = ((lambda t: t) if mesh is None else (lambda t: docs.shard(t, rank)) if docs is not None  # noqa: E731
                         else (lambda t: shard_sequence(t, mesh, layout="zigzag") if t.dim() >= 3 else t))
                inputs, do = {k: shard(v) for k, v in full.items()}, shard(do_full)
                check = mesh is not None and args.check and args.rule == "delta"
                if not check:
                    full = do_full = None  # not held during the timed calls
                t, peak, _ = timed(lambda: _scan_step(args, system, inputs, do, mesh, docs, chunk), args.iters, args.warmup, device)
                if device.type == "cuda":
                    row["peak_mem_gb"] = round(peak * 1e9 / 2**30, 3)
                if check:  # Note [Parallel state passing across ranks]: against the whole sequence here
                    one = None if docs is None else PackedDocuments.from_lengths(lengths, world=1)
                    ref = _scan_step(args, system, full, do_full, None, one, chunk)
                    got = _scan_step(args, system, inputs, do, mesh, docs, chunk)
                    pairs = [("o", got[0], ref[0])] + [(f"d{k}", got[1][k], ref[1][k]) for k in got[1] if got[1][k] is not None]
                    row["rel_err_vs_one_device"] = {n: float(f"{((a.float() - shard(b).float()).norm() / shard(b).float().norm()).item():.3g}")
                                                    for n, a, b in pairs}
                    del ref, got
                row.update(time_ms=round(t * 1e3, 3), tokens_per_s=round(T / t, 1))
            except Exception as error:  # noqa: BLE001 - recorded (e.g. out of memory), the next run goes on
                row["error"] = error_text(error)
            if rank == 0:
                print(f"[attention] {row}", flush=True)
                if args.out:
                    append_records(args.out, row)
            _free(device)
    if mesh is not None:
        dist.destroy_process_group()


# ---- a2a: the all-to-all alone and beside a load ------------------------------------------------------------------

def _a2a_path(path: str, device: Any) -> tuple[Any, Callable]:
    """(process group, allocator of the send and receive buffers) of an all-to-all path. "kernel": the default group and
    plain tensors (NCCL's send / receive kernels on the SMs). "ce": NCCL's copy-engine all-to-all (NCCL >= 2.28: a
    communicator with the zero-CTA policy and both buffers in symmetric windows, torch's NCCL symmetric memory), which
    takes no SM from the compute it overlaps."""
    if path == "kernel":
        return None, lambda n, dtype, group: (torch.empty(n, device=device, dtype=dtype), torch.empty(n, device=device, dtype=dtype))
    if path != "ce":
        raise SystemExit(f"--path {path!r}: expected kernel or ce")
    import torch.distributed._symmetric_memory as symm_mem

    options = dist.ProcessGroupNCCL.Options()
    options.config.cta_policy = dist.ProcessGroupNCCL.NCCL_CTA_POLICY_ZERO
    group = dist.new_group(backend="nccl", pg_options=options)
    symm_mem.set_backend("NCCL")
    pool = symm_mem.get_mem_pool(device)

    def alloc(n, dtype, group):
        with torch.cuda.use_mem_pool(pool):
            send, recv = torch.empty(n, device=device, dtype=dtype), torch.empty(n, device=device, dtype=dtype)
        for t in (send, recv):
            symm_mem.rendezvous(t, group.group_name)
        return send, recv

    return group, alloc


def run_a2a(args) -> None:
    """Note [Overlapped Ulysses] hides a stage's all-to-all behind the attention of the stage before; this measures how
    fast the all-to-all moves its bytes alone and how much of it a load on the compute stream hides."""
    device, _, rank, W = setup(args.device, group=True)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.load == "gemm":
        a = torch.randn(args.gemm_n, args.gemm_n, device=device, dtype=dtype)

        def load():
            for _ in range(args.gemm_reps):
                torch.mm(a, a)
    elif args.load == "attention":
        hq, hk = (int(h) for h in args.load_heads.split("/"))
        q = torch.randn(1, args.load_seq, hq, 128, device=device, dtype=dtype)
        k, v = (torch.randn(1, args.load_seq, hk, 128, device=device, dtype=dtype) for _ in range(2))
        backend = local.resolve_backend("auto", device, dtype, 128, cudnn_exact=True, seq_len=args.load_seq)

        def load():
            local.block_forward(q, k, v, causal=True, scale=128 ** -0.5, backend=backend)
    else:
        raise SystemExit(f"--load {args.load!r}: expected gemm or attention")
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    group, alloc = _a2a_path(args.path, device)
    if cuda:  # a stream of its own, as training runs: NCCL 2.28's copy-engine batch refuses the legacy default stream
        torch.cuda.set_stream(torch.cuda.Stream())
    rows = []
    for mb in (float(m) for m in args.mbs.split(",")):
        n = max(W, int(mb * 1e6) // dtype.itemsize // W * W)
        send, recv = alloc(n, dtype, group)
        send.copy_(torch.arange(W, device=device, dtype=dtype).repeat_interleave(n // W) + 16 * rank)  # chunk j: j + 16 rank

        def both():
            work = dist.all_to_all_single(recv, send, group=group, async_op=True)
            load()
            work.wait()

        t_a2a = timed(lambda: dist.all_to_all_single(recv, send, group=group), args.iters, args.warmup, device)[0]
        # chunk i of what this rank received came from rank i: rank + 16 i, every element
        want = (rank + 16 * torch.arange(W, device=device, dtype=dtype)).repeat_interleave(n // W)
        exact = bool(torch.equal(recv, want))
        t_load = timed(load, args.iters, args.warmup, device)[0]
        t_both = timed(both, args.iters, args.warmup, device)[0]
        leaving = n * dtype.itemsize * (W - 1) / W
        row = dict(bench="a2a", device=device_name(device), gpus=W, mb_per_rank=round(n * dtype.itemsize / 1e6, 1), load=args.load,
                   path=args.path, a2a_ms=round(t_a2a * 1e3, 3), gb_per_s_out=round(leaving / t_a2a / 1e9, 1), load_ms=round(t_load * 1e3, 3),
                   both_ms=round(t_both * 1e3, 3), hidden=round((t_load + t_a2a - t_both) / t_a2a, 3), exact=exact, nccl_env=env,
                   nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None, commit=args.commit)
        rows.append(row)
        if rank == 0:
            print(f"[attention] {row}", flush=True)
        del send, recv
        _free(device)
    if rank == 0 and args.out:
        append_records(args.out, rows)
    dist.destroy_process_group()


# ---- main -----------------------------------------------------------------------------------------------------

def parser(mode: str) -> argparse.ArgumentParser:
    """A mode's options: the keys of OPTIONS[mode] as flags ("_" -> "-"), their type and default from the value."""
    ap = runner_args(argparse.ArgumentParser(prog=f"benchmarks/attention.py {mode}", description=__doc__.split("\n\n")[0]))
    for name, default in OPTIONS[mode].items():
        flag = "--" + name.replace("_", "-")
        if isinstance(default, (bool, list)):
            ap.add_argument(flag, action="store_true" if isinstance(default, bool) else "append", default=default)
        else:
            ap.add_argument(flag, type=str if default is None else type(default), default=default)
    return ap


def main(argv: list[str] | None = None) -> None:
    mode, argv = mode_of(argv, "attention")
    args = parser(mode).parse_args(argv)
    if mode == "scan" and args.rule != "delta":
        args.systems = args.systems.replace(",fla", "")
    if mode in ("grid", "lasp", "scan", "a2a"):
        return {"grid": run_grid, "lasp": run_lasp, "scan": run_scan, "a2a": run_a2a}[mode](args)
    device, *_ = setup(args.device)
    rows = {"local": run_local, "rates": run_rates, "window": run_window, "matmul": run_matmul}[mode](args, device)
    if args.out:
        append_records(args.out, rows)


if __name__ == "__main__":
    main()

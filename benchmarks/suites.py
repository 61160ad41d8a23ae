"""The benchmark suites (``python -m benchmarks list``): each answers one question of docs/benchmarks.md with, per GPU count,
its runs: one process (or torchrun) of a runner (``kind``: train.py, longest.py, attention.py, hf.py, or pytest) with its
settings and the peers it is compared against. The driver (benchmarks/driver.py) turns a run into a command. Each benchmark
run is limited to 10 minutes on the GPU machines we measure on, so runs are ordered by priority and a suite runs as named
slices (``--only``); every limit here is wall seconds measured on 4 x H200 plus a margin.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Literal

Kind = Literal["train", "longest", "attention", "hf", "pytest"]
KINDS: tuple[str, ...] = Kind.__args__  # type: ignore[attr-defined]
MODES: dict[str, tuple[str | None, ...]] = {"train": (None, "host-adamw"), "longest": (None,), "pytest": (None,),
                                            "attention": ("grid", "local", "rates", "window", "lasp", "scan", "matmul", "a2a"),
                                            "hf": ("families", "finetune", "memory")}  # a runner's first argument
SYSTEMS = ("seqpar", "torch_cp", "tp_sp", "single")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
    """One measurement: a process of a runner (``kind``, ``mode``) on ``gpus`` GPUs, at most ``limit_s`` seconds: what it
    measures (``system``, ``model``, ``seq``), the other settings (``args``, passed unchanged), the descending ``(S,
    seconds)`` attempts of a longest-context search (``seqs``), the specs of the attention grid (``grids``), the runs
    it is compared against (``peers``), whether it needs flash-attention 4 (``fa4``), its environment (``env``)."""

    name: str
    kind: Kind
    gpus: int
    limit_s: int
    mode: str | None = None
    system: str | None = None
    model: str | None = None
    seq: int | None = None
    seqs: tuple[tuple[int, int], ...] = ()
    grids: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    peers: tuple[str, ...] = ()
    fa4: bool = False
    env: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Suite:
    """A named question and its runs per GPU count of the machine (``--gpus N``)."""

    name: str
    question: str
    table: str  # the docs/benchmarks.md section its figures land in
    runs: dict[int, tuple[Run, ...]]

    def select(self, gpus: int, only: tuple[str, ...] = ()) -> list[Run]:
        """The runs for a machine of ``gpus`` GPUs, those matching a pattern of ``only`` (fnmatch) if given."""
        if gpus not in self.runs:
            raise ValueError(f"suite {self.name!r} has runs for --gpus {sorted(self.runs)}, not {gpus}")
        runs = list(self.runs[gpus])
        if only:
            unmatched = [p for p in only if not any(fnmatch.fnmatchcase(r.name, p) for r in runs)]
            if unmatched:
                raise ValueError(f"--only {','.join(unmatched)} matches no run of suite {self.name!r} on {gpus} GPUs; "
                                 f"its runs: {', '.join(r.name for r in runs)}")
            runs = [r for r in runs if any(fnmatch.fnmatchcase(r.name, p) for p in only)]
        return runs


def _a(*items: str) -> tuple[str, ...]:
    return tuple(x for item in items for x in item.split())


ONE_STEP = _a("--warmup 0 --steps 1")
# our settings for the longest contexts of 4 GPUs (recipes/llama3_8b_1m.yaml; parameters on the host, Note
# [Offloading parameters to host memory]) and of 2 GPUs
OURS_1M = _a("--ac selective++ --offload --offload-params --mlp-chunk 32768 --backend fa4") + ONE_STEP
OURS_2GPU = _a("--ac full --backend cudnn") + ONE_STEP
# our best measured llama3-8b setting at 128K (recipes/llama3_8b.yaml) and the one for the other models
OURS_128K = _a("--backend fa4 --compile --uncheckpointed-blocks 14 --algorithm ulysses")
OURS_MODELS = _a("--backend fa4 --compile --uncheckpointed-blocks 10")
EXPANDABLE = (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)
FLA_SMALL = (("SEQPAR_FLA_AUTOTUNE", "small"),)
MATMUL_PEAK = dict(name="matmul-peak", kind="attention", mode="matmul", gpus=1, limit_s=60, args=_a("--sizes 8192 --iters 20"))


def _compare(model: str, seq: int, gpus: int, ours: tuple[str, ...], *, prefix: str, limits: tuple[int, int, int],
             extra: tuple[str, ...] = (), ours_env: tuple[tuple[str, str], ...] = ()) -> tuple[Run, ...]:
    """Ours against FSDP2 + torch CP and Megatron TP+SP: one train.py run each, same model, S, GPUs."""
    names = (f"{prefix}-ours", f"{prefix}-torch_cp", f"{prefix}-tp_sp")
    return (
        Run(name=names[0], kind="train", gpus=gpus, limit_s=limits[0], system="seqpar", model=model, seq=seq,
            args=ours + extra, peers=names[1:], fa4=True, env=ours_env),
        Run(name=names[1], kind="train", gpus=gpus, limit_s=limits[1], system="torch_cp", model=model, seq=seq, args=extra),
        Run(name=names[2], kind="train", gpus=gpus, limit_s=limits[2], system="tp_sp", model=model, seq=seq, args=extra),
    )


def _longest(prefix: str, model: str, gpus: int, ours: tuple[tuple[int, int], ...], ours_args: tuple[str, ...],
             cp: tuple[tuple[int, int], ...], tpsp: tuple[tuple[int, int], ...], *, fa4: bool) -> tuple[Run, ...]:
    names = (f"{prefix}-ours", f"{prefix}-torch_cp", f"{prefix}-tp_sp")
    total = lambda seqs: min(sum(t for _, t in seqs) + 30, 580)  # noqa: E731
    return (
        Run(name=names[0], kind="longest", gpus=gpus, limit_s=total(ours), system="seqpar", model=model, seqs=ours,
            args=ours_args, peers=names[1:], fa4=fa4, env=EXPANDABLE),
        Run(name=names[1], kind="longest", gpus=gpus, limit_s=total(cp), system="torch_cp", model=model, seqs=cp,
            args=ONE_STEP, env=EXPANDABLE),
        Run(name=names[2], kind="longest", gpus=gpus, limit_s=total(tpsp), system="tp_sp", model=model, seqs=tpsp,
            args=ONE_STEP, env=EXPANDABLE),
    )


M, K = 1048576, 524288
_W4_128K = "seqs=131072;heads=32/8,32/32,33/33;systems=all"
_W4_FA4 = "seqs=131072,524288;heads=32/8;systems=single:fa4,seqpar:ring:fa4,seqpar:ring:fa4:chunks4,seqpar:ulysses:fa4,torch_cp:allgather,torch_cp:alltoall"
_CP = "torch_cp:allgather,torch_cp:alltoall"


def _grid(name: str, gpus: int, limit_s: int, *grids: str, fa4: bool = False) -> Run:
    return Run(name=name, kind="attention", mode="grid", gpus=gpus, limit_s=limit_s, grids=grids, fa4=fa4)


def _a2a(gpus: int) -> tuple[Run, ...]:
    """The Ulysses all-to-all's bytes alone and beside a load (docs/benchmarks.md): the sizes of a stage's all-to-alls at
    128K (the outputs' 134 MB and q, k, v's 201 MB per rank on 4 GPUs), beside bf16 matmuls, then beside flash-attention
    4 on a stage's heads (a persistent kernel); NCCL's SM kernels and its copy-engine path (``--path ce``)."""
    sizes, fa4 = "--mbs 32,134,201", "--load attention --load-heads 8/2"
    return (Run(name="a2a", kind="attention", mode="a2a", gpus=gpus, limit_s=120, args=_a(f"{sizes} --load gemm")),
            Run(name="a2a-ce", kind="attention", mode="a2a", gpus=gpus, limit_s=120, args=_a(f"{sizes} --load gemm --path ce")),
            Run(name="a2a-fa4", kind="attention", mode="a2a", gpus=gpus, limit_s=180, args=_a(f"{sizes} {fa4}"), fa4=True),
            Run(name="a2a-fa4-ce", kind="attention", mode="a2a", gpus=gpus, limit_s=180, args=_a(f"{sizes} {fa4} --path ce"), fa4=True))


ATTENTION = Suite(
    name="attention",
    question="Distributed attention alone (forward + backward): TFLOP/s per GPU and peak memory, every algorithm "
             "of ours against torch context parallel and one GPU, heads 32/8 (GQA), 32/32 (MHA), 33/33",
    table="attention",
    runs={
        4: (
            _grid("128k", 4, 240, _W4_128K),
            _grid("512k", 4, 300,
                  f"seqs={K};heads=32/8;systems=seqpar:ring:chunks4,seqpar:allgather:chunks4,seqpar:ulysses,seqpar:ring:inner2,{_CP};iters=1",
                  f"seqs={K};heads=32/32;systems=seqpar:ring:chunks4,seqpar:allgather:chunks4,seqpar:ulysses,seqpar:2d:2x2,{_CP};iters=1",
                  f"seqs={K};heads=33/33;systems=seqpar:ring:chunks3,seqpar:ring:inner2,{_CP};iters=1"),
            _grid("1m", 4, 540,
                  f"seqs={M};heads=32/8;systems=seqpar:ring:chunks4,seqpar:allgather:chunks4,seqpar:ulysses,{_CP};iters=1",
                  f"seqs={M};heads=32/32;systems=seqpar:ring:chunks4,seqpar:allgather:chunks4,seqpar:ulysses,seqpar:2d:2x2,{_CP};iters=1",
                  f"seqs={M};heads=33/33;systems=seqpar:ring:chunks3,seqpar:allgather:chunks3,seqpar:ring:inner2,{_CP};iters=1"),
            _grid("fa4", 4, 300, _W4_FA4, f"seqs={M};heads=32/8;systems=seqpar:ring:fa4:chunks4,seqpar:ulysses:fa4;iters=1", fa4=True),
            *_a2a(4),
        ),
        2: (
            _grid("128k", 2, 150, _W4_128K),
            _grid("512k-1m", 2, 420,
                  f"seqs={K},{M};heads=32/8;systems=seqpar:ring:chunks4,seqpar:allgather:chunks4,seqpar:ulysses,torch_cp:allgather;iters=1",
                  f"seqs={K},{M};heads=32/32;systems=seqpar:ring:chunks4,seqpar:ulysses,torch_cp:allgather;iters=1",
                  f"seqs={K},{M};heads=33/33;systems=seqpar:ring:chunks3,torch_cp:allgather;iters=1"),
        ),
        8: (
            _grid("128k", 8, 300, "seqs=131072;heads=32/32,32/8;systems=all,seqpar:2d:8x1,seqpar:2d:1x8",
                  "seqs=131072;heads=33/33;systems=single,seqpar:ring,seqpar:allgather,seqpar:ring:inner2,seqpar:ring:inner4," + _CP),
            _grid("512k", 8, 240, f"seqs={K};heads=32/8;systems=seqpar:ring,seqpar:ulysses,seqpar:2d:4x2,seqpar:2d:2x4,"
                  "seqpar:ring:inner4,torch_cp:allgather;iters=1"),
        ),
    },
)

TRAIN = Suite(
    name="train",
    question="Training throughput (tokens/s/GPU, MFU, peak memory) of ours against FSDP2 + torch context parallel "
             "and Megatron-style TP+SP, same model, S and GPUs",
    table="train",
    runs={
        4: (
            Run(**MATMUL_PEAK),
            # expandable segments: at 137.8 GB of 139.8 the overlapped Ulysses' buffers left the allocator 8.9 GB
            # reserved but unusable (out of memory at the loss, 2026-11-26)
            *_compare("llama3-8b", 131072, 4, OURS_128K, prefix="llama3-8b-128k", limits=(200, 150, 200), ours_env=EXPANDABLE),
            Run(name="llama3-8b-128k-ours-cudnn", kind="train", gpus=4, limit_s=230, system="seqpar", model="llama3-8b", seq=131072,
                args=_a("--backend cudnn --compile --uncheckpointed-blocks 10"), peers=("llama3-8b-128k-torch_cp",)),
            *_compare("llama-7b", 131072, 4, OURS_MODELS + _a("--algorithm ulysses"), prefix="llama-7b-128k", limits=(260, 270, 270)),
            *_compare("llama-33h", 131072, 4, OURS_MODELS + _a("--algorithm ring"), prefix="llama-33h-128k", limits=(260, 270, 270)),
            *_compare("llama-7b", 262144, 4, _a("--backend fa4 --ac selective++ --head-chunks 4"), prefix="llama-7b-256k",
                      limits=(190, 180, 200), extra=_a("--steps 1")),
            *_compare("llama-33h", 262144, 4, _a("--backend fa4 --ac selective++ --head-chunks 3"), prefix="llama-33h-256k",
                      limits=(190, 180, 200), extra=_a("--steps 1")),
            Run(name="llama3-8b-128k-ours-ring", kind="train", gpus=4, limit_s=200, system="seqpar", model="llama3-8b", seq=131072,
                args=_a("--backend fa4 --compile --uncheckpointed-blocks 14 --algorithm ring"), peers=("llama3-8b-128k-torch_cp",),
                fa4=True),
            Run(name="llama3-8b-256k-ours", kind="train", gpus=4, limit_s=200, system="seqpar", model="llama3-8b", seq=262144,
                args=_a("--backend cudnn --ac selective++ --head-chunks 4 --steps 1")),
            # the 1M setting at 512K (no peer fits 512K); AdamW state allocated before the step
            Run(name="llama3-8b-512k-ours", kind="train", gpus=4, limit_s=400, system="seqpar", model="llama3-8b", seq=524288,
                args=_a("--ac selective++ --head-chunks 4 --offload --mlp-chunk 32768 --backend fa4 --prealloc-optimizer "
                        "--tag offload-512k") + ONE_STEP, fa4=True, env=EXPANDABLE),
            # offload_params at a short S: the host's optimizer step, not a throughput setting (left out of the tables)
            Run(name="llama-7b-64k-offload-params", kind="train", gpus=4, limit_s=150, system="seqpar", model="llama-7b", seq=65536,
                args=_a("--ac selective++ --offload --offload-params --mlp-chunk 32768 --backend cudnn --head-chunks 4 --steps 2 "
                        "--tag offload-params-auto"), env=EXPANDABLE),
        ),
        8: (
            Run(**MATMUL_PEAK),
            # LightSeq's single-node setting (arXiv:2310.03294, Table 1): several S in one process per system
            Run(name="lightseq-ours", kind="train", gpus=8, limit_s=420, system="seqpar", fa4=True,
                args=_a("--backend fa4 --algorithm ring --ac selective++ --uncheckpointed-blocks 8 --models "
                        "llama-7b,llama-7b-gqa,llama-33h --seqs 32768:3,65536:3,131072:2,262144:1 --warmup 1"),
                peers=("lightseq-torch_cp", "lightseq-tp_sp")),
            Run(name="lightseq-torch_cp", kind="train", gpus=8, limit_s=420, system="torch_cp",
                args=_a("--models llama-7b,llama-7b-gqa,llama-33h --seqs 32768:3,65536:3,131072:2,262144:1 --warmup 1")),
            Run(name="lightseq-tp_sp", kind="train", gpus=8, limit_s=450, system="tp_sp",
                args=_a("--models llama-7b,llama-7b-gqa,llama-33h --seqs 32768:3,65536:3,131072:2,262144:1 --warmup 1")),
        ),
    },
)

LONGEST = Suite(
    name="longest",
    question="The longest context that trains one step (AdamW state allocated first), ours against both baselines",
    table="longest",
    runs={
        4: (
            Run(name="llama3-8b-ours", kind="longest", gpus=4, limit_s=560, system="seqpar", model="llama3-8b",
                seqs=((M, 540),), args=OURS_1M + _a("--head-chunks 4"), peers=("llama3-8b-torch_cp", "llama3-8b-tp_sp"),
                fa4=True, env=EXPANDABLE),
            Run(name="llama3-8b-torch_cp", kind="longest", gpus=4, limit_s=330, system="torch_cp", model="llama3-8b",
                seqs=((262144, 150), (229376, 150)), env=EXPANDABLE),
            Run(name="llama3-8b-tp_sp", kind="longest", gpus=4, limit_s=500, system="tp_sp", model="llama3-8b",
                seqs=((262144, 160), (229376, 160), (196608, 160)), env=EXPANDABLE),
            *_longest("llama-7b", "llama-7b", 4, ((786432, 520),), OURS_1M + _a("--head-chunks 4"),
                      ((589824, 290), (524288, 250)), ((589824, 290), (524288, 250)), fa4=True),
            *_longest("llama-33h", "llama-33h", 4, ((917504, 540),), OURS_1M + _a("--head-chunks 3"),
                      ((557056, 300), (491520, 250)), ((524288, 270), (458752, 220)), fa4=True),
        ),
        2: (
            *_longest("llama3-8b", "llama3-8b", 2, ((327680, 300), (294912, 270)), OURS_2GPU + _a("--head-chunks 4"),
                      ((98304, 100), (81920, 90), (65536, 80)), ((81920, 90), (65536, 80)), fa4=False),
            *_longest("llama-7b", "llama-7b", 2, ((393216, 300),), OURS_2GPU + _a("--head-chunks 4"),
                      ((262144, 200), (196608, 150)), ((245760, 160), (229376, 150)), fa4=False),
            *_longest("llama-33h", "llama-33h", 2, ((393216, 300), (360448, 260)), OURS_2GPU + _a("--head-chunks 3"),
                      ((262144, 170), (245760, 160)), ((245760, 160), (229376, 150)), fa4=False),
        ),
    },
)

SCALING = Suite(
    name="scaling",
    question="LASP (TransNormerLLM-1B) and LSS Transformer (GPT-1.5B) weak scaling on 1, 2, 4 GPUs, the LASP op's "
             "two variants, and the longest TNL-1B sequence",
    table="scaling",
    runs={
        4: (
            Run(name="lasp-gpu-tests", kind="pytest", gpus=4, limit_s=200, args=("tests/test_lasp_gpu.py",), env=FLA_SMALL),
            *(Run(name=f"tnl-x{n}", kind="train", gpus=n, limit_s=150 if n == 4 else 120, system="seqpar", model="tnl-1b",
                  seq=32768 * n, args=_a(f"--algorithm lasp --lasp-variant {'p2p,allgather' if n == 4 else 'p2p'}"),
                  env=EXPANDABLE + FLA_SMALL) for n in (1, 2, 4)),
            *(Run(name=f"gpt-x{n}", kind="train", gpus=n, limit_s=90 if n == 1 else 130, system="seqpar", model="lss-gpt-1.5b",
                  seq=16384 * n, args=_a("--algorithm allgather --kv-comm input,kv"), env=EXPANDABLE) for n in (1, 2, 4)),
            Run(name="lasp-op", kind="attention", mode="lasp", gpus=4, limit_s=100, args=_a("--local-seqs 8192,32768,262144 --iters 5 --warmup 2")),
            Run(name="tnl-longest", kind="longest", gpus=4, limit_s=560, system="seqpar", model="tnl-1b",
                seqs=((2097152, 200), (1048576, 200), (524288, 200)),
                args=_a("--algorithm lasp --ac full --loss-chunk 4096 --warmup 1 --steps 1 --tag max-seq"), env=EXPANDABLE + FLA_SMALL),
        ),
    },
)

HF = Suite(
    name="hf",
    question="A Hugging Face Llama (llama3-8b shape) fine-tuned at 128K with packed documents under the strategy",
    table="hf",
    runs={
        4: (
            Run(name="documents-gpu-tests", kind="pytest", gpus=4, limit_s=150, args=("tests/test_documents_gpu.py",)),
            Run(name="hf-llama3-8b-128k", kind="hf", mode="finetune", gpus=4, limit_s=170, system="seqpar", model="hf-llama3-8b",
                seq=131072, args=_a("--documents --mean-doc 16384 --warmup 1 --steps 3")),
            # issue #26 item 3: the long-context families at 128K over 4 GPUs (sliding layers, sinks, a hybrid; LoRA)
            Run(name="hf-families-128k", kind="hf", mode="families", gpus=4, limit_s=220, system="seqpar", seq=131072,
                args=_a("--shapes gemma3,gpt-oss,qwen3-next --warmup 1 --steps 3"), env=EXPANDABLE),
            Run(name="hf-llama3-8b-lora-128k", kind="hf", mode="families", gpus=4, limit_s=240, system="seqpar", seq=131072,
                args=_a("--shapes llama3-8b-lora --warmup 1 --steps 3"), env=EXPANDABLE, fa4=True),
        ),
    },
)

ONE_GPU = Suite(
    name="one-gpu",
    question="One GPU: the bf16 matmul peak MFU is measured against, the local attention kernels (TFLOP/s, "
             "relative error), their rates for the cost model, and the host's AdamW step of offload_params",
    table="one-gpu",
    runs={
        1: (
            Run(**dict(MATMUL_PEAK, limit_s=90, args=_a("--sizes 8192,16384 --iters 30"))),
            Run(name="local-kernels", kind="attention", mode="local", gpus=1, limit_s=200, args=_a("--seqs 8192,32768")),
            Run(name="kernel-rates", kind="attention", mode="rates", gpus=1, limit_s=150, args=_a("--backend cudnn --iters 2")),
            Run(name="offload-optimizer", kind="train", mode="host-adamw", gpus=1, limit_s=120, system="seqpar", model="llama-7b",
                args=_a("--ranks 4 --threads 16")),
        ),
    },
)

GPU_TESTS = Suite(
    name="gpu-tests",
    question="The GPU equivalence tests (bf16 against one GPU), run as a suite so that their logs land beside the records",
    table="",
    runs={
        n: (Run(name="attention", kind="pytest", gpus=n, limit_s=240, args=("tests/test_attention_gpu.py",)),
            Run(name="documents", kind="pytest", gpus=n, limit_s=150, args=("tests/test_documents_gpu.py",)),
            Run(name="checkpointing", kind="pytest", gpus=1, limit_s=150, args=("tests/test_activation_checkpointing_gpu.py",)))
        for n in (2, 4, 8)
    },
)

SUITES: dict[str, Suite] = {s.name: s for s in (ATTENTION, TRAIN, LONGEST, SCALING, HF, ONE_GPU, GPU_TESTS)}


def problems(suite: Suite) -> list[str]:
    """What is wrong with a suite's declaration (empty when every run can be expanded)."""
    out = []
    for gpus, runs in suite.runs.items():
        names = [r.name for r in runs]
        out += [f"{suite.name}/{gpus}: run name {n!r} given twice" for n in sorted({n for n in names if names.count(n) > 1})]
        for r in runs:
            where = f"{suite.name}/{gpus}/{r.name}"
            if r.kind not in KINDS or r.mode not in MODES[r.kind]:
                out.append(f"{where}: unknown kind {r.kind!r} (mode {r.mode!r})")
            if not 1 <= r.gpus <= gpus:
                out.append(f"{where}: needs {r.gpus} GPUs on a machine of {gpus}")
            if r.system is not None and r.system not in SYSTEMS:
                out.append(f"{where}: unknown system {r.system!r}")
            if not 0 < r.limit_s <= 600:
                out.append(f"{where}: limit_s {r.limit_s} outside (0, 600] (the 10-minute limit of a run on our GPU machines)")
            if r.kind == "longest":
                if not r.seqs or [s for s, _ in r.seqs] != sorted((s for s, _ in r.seqs), reverse=True):
                    out.append(f"{where}: seqs must be a non-empty descending list of (S, seconds)")
                if r.model is None or r.system is None:
                    out.append(f"{where}: longest needs a model and a system")
            if (r.kind, r.mode) in (("train", None), ("hf", "finetune")) and r.seq is None and "--seqs" not in r.args:
                out.append(f"{where}: {r.kind} needs seq (or --seqs in args)")
            if r.mode == "grid" and not r.grids:
                out.append(f"{where}: the attention grid needs grids")
            for p in r.peers:
                if p not in names:
                    out.append(f"{where}: peer {p!r} is not a run of this suite on {gpus} GPUs")
    return out

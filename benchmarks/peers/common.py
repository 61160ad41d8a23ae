"""What every peer run shares: the two model shapes, one FLOP formula, the step clock and the record.

Note [One measurement for every peer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each system runs in its own processes (its own launcher: torchrun, accelerate launch, Lightning), one after the
other on the same machine, batch 1 sequence of ``seq`` tokens split over all GPUs, random init, random tokens,
and the environment its own launch sets (``LAUNCH_ENV`` in ``__main__.py``: expandable segments for all three
peers, as torchtitan's ``run_train.sh``, TRL's long-context guide and ALST set them; ours sets them itself).
The clock is the same for all: a CUDA-synchronised wall clock around each optimizer step, read through the peer's
own per-step hook (torchtitan's ``Trainer.train_step``, transformers' ``TrainerCallback.on_step_begin/end``,
Lightning's ``on_train_batch_start/end``); ``warmup`` steps are dropped (compilation, allocator growth) and the
median of the rest is the step time. tokens/s/GPU = seq / step / GPUs. MFU = tokens/s/GPU x flops_per_token /
989e12 (H100 / H200 SXM dense bf16, datasheet) with flops_per_token = 6 x N (every parameter but the input
embedding) + 6 x L x S x (heads x head_dim) (causal attention, forward + backward) -- the formula of
``benchmarks/train.py``, for every row; with N packed documents per row (ours' ``--documents N``) a token attends
only within its document, so S there is the document's length, S / N (the record's ``documents``).

Memory, read outside every system's code and the same way for all (issue #56). The tables' column is
``peak_reserved_gb``: the in-process probe ``probe/sitecustomize.py``, which the harness puts on every launched
process's PYTHONPATH, reads ``torch.cuda.max_memory_reserved()`` after every optimizer step and just before every
``torch.cuda.reset_peak_memory_stats`` call (torchtitan's logger resets the peak every logged step, which made its
old column 32.3 GB where it reserved ~147 GB), keeps a running max over the whole run, and the harness takes the
max over ranks: what the allocator held at its peak, the memory a card must have for the run (CUDA contexts and
NCCL buffers not included). Beside it the record's ``memory`` holds the device side as the driver sees it (NVML,
or ``nvidia-smi`` without it: every GPU's used memory every 0.2 s, contexts, NCCL and the allocator's reserve
included; the whole run and from the last warm-up step's clock line on) and the host side (RSS summed over the
launcher's process tree every 0.2 s, and each rank's ``ru_maxrss``). ``peak_mem_gb``, the old column
(``max_memory_allocated`` since the first timed step, max over ranks), stays in every record, labelled
``peak_mem_measure``; records from before the probe show it in the tables marked as that older measure, and
torchtitan's old rows show the reserved peak its own logger printed (``peak_reserved_gb_from_log``) where the run's
log is kept.

Precision: every system trains with bf16 compute and fp32 master weights (ours "bf16-mixed"; the peers' FSDP2 /
DeepSpeed bf16 mixed precision). The record's ``master_weights`` is read, not assumed: the probe takes the dtype of
the first parameter the first optimizer updates, at its first step.

Kernels: the probe profiles one training step on rank 0 (``--kernel-step``, by default the last warm-up step, so
no timed step is slowed) with CUDA activity only and records the kernels by time, the attention kernel they show
(``attention_kernel``) and whether Liger's or inductor's Triton kernels ran (``kernels``).

Note [The step's physical bound]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Issue #39's yardstick for a row: tokens/s/GPU if every FLOP ran at the fastest rate measured for it on that GPU,
and nothing else took time. Per token: causal attention's forward, 2 x L x S x (heads x head_dim) FLOPs (S the
document's length), at flash-attention 4's measured forward rate, its backward (2.5x the forward's FLOPs, the
kernel's own recomputation included) at its measured backward rate, and 6 x N matmul FLOPs at the measured bf16
matmul peak. H200 rates, head_dim 128 (docs/benchmarks.md, the profiled 128K Qwen3-8B step: 645 and 579 TFLOP/s,
matmuls 736 TFLOP/s); no H100 rates are measured, so H100 rows have no bound. Recomputation (checkpointing),
communication, norms, the loss and the optimizer all count as time above the bound: a system with none of them
at the fastest kernels reaches 1.0.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass

import torch

PEAK_BF16 = 989e12


@dataclass(frozen=True)
class Shape:
    """A dense decoder's shape (the published configs' numbers)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_theta: float

    def params(self) -> float:
        """Every parameter but the input embedding (the head and the norms included)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attn + 3 * self.hidden * self.ffn + 2 * self.hidden) + self.vocab * self.hidden + self.hidden

    def flops_per_token(self, seq: int, documents: int = 1) -> float:
        """Model FLOPs per token of a row of ``seq`` tokens in ``documents`` equal packed documents (causal attention
        within each document)."""
        return 6 * self.params() + 6 * self.layers * (seq / max(documents, 1)) * self.heads * self.head_dim


BOUND_RATES = {"H200": {"attention_forward": 645e12, "attention_backward": 579e12, "matmul": 736e12}}
"""FLOP/s of Note [The step's physical bound], per GPU kind."""


def bound_tokens_per_s(shape: Shape, seq: int, gpu: str, documents: int = 1) -> float | None:
    """Tokens/s/GPU at the step's physical bound (Note [The step's physical bound]); None without measured rates."""
    rates = BOUND_RATES.get(gpu)
    if rates is None:
        return None
    forward = 2 * shape.layers * (seq / max(documents, 1)) * shape.heads * shape.head_dim
    seconds = (6 * shape.params() / rates["matmul"] + forward / rates["attention_forward"]
               + 2.5 * forward / rates["attention_backward"])
    return 1 / seconds


SHAPES = {
    # Llama-3-8B (torchtitan's llama3 "8B" flavor; the package's "llama3-8b")
    "llama3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256, rope_theta=500000.0),
    # LitGPT's "Llama-3-8B" config: the same shape, LitGPT's own GPT (routed SDPA, Note [LitGPT under the strategy])
    "litgpt-llama3-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256, rope_theta=500000.0),
    # LitGPT's "Llama-3.2-1B" config
    "litgpt-llama3.2-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, ffn=8192, vocab=128256, rope_theta=500000.0),
    # Qwen3-8B (its config.json)
    "qwen3-8b": Shape(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=12288, vocab=151936, rope_theta=1000000.0),
}


def qwen3_config(seq: int):
    """The Qwen3-8B-shaped transformers config (random init), max_position_embeddings at least ``seq``."""
    from transformers import Qwen3Config

    s = SHAPES["qwen3-8b"]
    return Qwen3Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.ffn, num_hidden_layers=s.layers,
                       num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
                       max_position_embeddings=max(40960, seq), rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": s.rope_theta}, torch_dtype="bfloat16")


class StepClock:
    """CUDA-synchronised step times and ``max_memory_allocated`` since the first timed step (the old memory column;
    the tables read the probe's, Note [One measurement for every peer])."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self._t0 = warmup, [], None
        # PEERS_PROFILE_STEP=k: rank 0 profiles step k (1-based) and writes its kernels by GPU time to
        # $OUT/profile-<system>.txt (PEERS_PROFILE_NAME names the file)
        self._profile_step = int(os.environ.get("PEERS_PROFILE_STEP", "0"))
        self._prof = None
        # PEERS_MEMORY_STEP=k: rank 0 records the allocator's history in step k and writes what was alive at the step's
        # allocation peak, by place, to $OUT/memory-peak-<PEERS_PROFILE_NAME>.json (Note [The peak's allocations])
        self._memory_step = int(os.environ.get("PEERS_MEMORY_STEP", "0"))
        self._memory_before = None

    def begin(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            if len(self.times) == self.warmup:
                torch.cuda.reset_peak_memory_stats()
        if len(self.times) + 1 == self._profile_step and int(os.environ.get("RANK", "0")) == 0:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                                record_shapes=True)  # the copies by shape: which layer makes them
            self._prof.__enter__()
        if len(self.times) + 1 == self._memory_step and int(os.environ.get("RANK", "0")) == 0 and torch.cuda.is_available():
            self._memory_before = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        self._t0 = time.perf_counter()

    def end(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t0)
        if self._memory_before is not None:
            self._write_memory_peak()
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            name = os.environ.get("PEERS_PROFILE_NAME", "run")
            table = self._prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=70)
            copies = [e for e in self._prof.key_averages(group_by_input_shape=True)
                      if e.key in ("aten::copy_", "aten::clone", "aten::flip", "aten::contiguous", "aten::_to_copy")]
            copies.sort(key=lambda e: -getattr(e, "self_device_time_total", 0))
            by_shape = "\n".join(f"{getattr(e, 'self_device_time_total', 0) / 1e3:9.1f} ms {e.count:6d} x {e.key} {e.input_shapes}"
                                  for e in copies[:25])
            gaps = self._idle_gaps(self.times[-1])  # where the compute stream waited (benchmarks/profile_summary.py)
            with open(os.path.join(os.environ.get("OUT", "."), f"profile-{name}.txt"), "w") as f:
                f.write(f"step {len(self.times)}: {self.times[-1]:.3f} s\n{table}\ncopies by input shape:\n{by_shape}\n\n{gaps}")
            self._prof = None
        if int(os.environ.get("RANK", "0")) == 0:  # a run that runs out of time is read back from these lines
            extra = ""
            if torch.cuda.is_available():  # the allocator's state: a step slowed by cudaMalloc retries says so
                stats = torch.cuda.memory_stats()
                extra = (f" (reserved {stats.get('reserved_bytes.all.peak', 0) / 1e9:.1f} GB, "
                         f"alloc retries {stats.get('num_alloc_retries', 0)}")
                host = getattr(torch.cuda, "host_memory_stats", None)  # the pinned pool: reused from step 2 on, or grown?
                if host is not None:
                    h = host()
                    extra += (f", pinned {h.get('allocated_bytes.current', 0) / 1e9:.1f} GB, peak "
                              f"{h.get('allocated_bytes.peak', 0) / 1e9:.1f}, pinning {h.get('host_alloc_time.total', 0) / 1e6:.1f} s")
                extra += ")"
            print(f"[peers] step {len(self.times)}: {self.times[-1]:.3f} s{extra}", flush=True)

    def _write_memory_peak(self) -> None:
        from benchmarks.memory_peak import peak_allocations

        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        summary = peak_allocations(trace, self._memory_before)
        summary.update(step=len(self.times), max_memory_allocated_gb=round(torch.cuda.max_memory_allocated() / 1e9, 3))
        name = os.environ.get("PEERS_PROFILE_NAME", "run")
        with open(os.path.join(os.environ.get("OUT", "."), f"memory-peak-{name}.json"), "w") as f:
            json.dump(summary, f, indent=1)
        self._memory_before = None

    def _idle_gaps(self, step_s: float) -> str:
        """The profiled step's idle gaps on the compute stream by cause (host / wait / edge), or why not."""
        import json
        import tempfile

        try:
            from benchmarks.profile_summary import format_gaps, idle_gaps

            with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
                path = tmp.name
            self._prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
            os.remove(path)
            return format_gaps(idle_gaps(trace, step_s=step_s))
        except Exception as e:  # noqa: BLE001 - the kernel table above is still written
            return f"idle gaps: not computed ({type(e).__name__}: {e})"

    def peak_gb(self) -> float:
        """max_memory_allocated over every rank (collective: every rank calls it)."""
        peak = torch.tensor(float(torch.cuda.max_memory_allocated()) / 1e9 if torch.cuda.is_available() else 0.0)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            peak = peak.to("cuda" if torch.cuda.is_available() else "cpu")
            torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
        return float(peak)


def gpu_kind() -> str:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return "H200" if "H200" in name else "H100" if "H100" in name else name


def commit() -> str:
    """SEQPAR_COMMIT when set (a GPU machine's copy of the tree may carry another checkout's git state), else HEAD."""
    if os.environ.get("SEQPAR_COMMIT"):
        return os.environ["SEQPAR_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("SEQPAR_COMMIT", "unknown")


def alloc_conf() -> dict[str, str]:
    """The allocator configuration the run's environment gave torch (both variables it reads; Note [One measurement
    for every peer]: each peer's own launch sets it, ours sets it in the strategy and records what it set)."""
    return {v: os.environ[v] for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if v in os.environ}


def write_record(out: str, *, system: str, model: str, seq: int, clock: StepClock, peak_gb: float, settings: dict,
                 changes: list[str], version: str, losses: list[float] | None = None, status: str = "ok",
                 documents: int = 0) -> dict:
    """Rank 0 appends the run's record to ``out`` (a JSON list); every rank returns it. ``documents``: packed documents
    per row (0: one dense sequence), which the FLOPs count."""
    gpus = int(os.environ.get("WORLD_SIZE", "1"))
    timed = clock.times[clock.warmup:]
    step = statistics.median(timed) if timed else None
    tps = seq / step / gpus if step else None
    row = dict(bench="peers", system=system, model=model, seq=seq, gpus=gpus, gpu=gpu_kind(),
               device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", commit=commit(),
               version=version, status=status, warmup=clock.warmup, steps=len(timed), step_times_s=clock.times,
               step_time_s=step, tokens_per_s_per_gpu=tps,
               mfu=tps * SHAPES[model].flops_per_token(seq, documents) / PEAK_BF16 if tps else None,
               flops_per_token=SHAPES[model].flops_per_token(seq, documents), documents=documents, peak_mem_gb=peak_gb,
               peak_mem_measure="max_memory_allocated since the first timed step, max over ranks (StepClock; old measure)",
               losses=losses or [],
               settings=settings, changes=changes, torch=torch.__version__, alloc_conf=alloc_conf(),
               profiled_step=int(os.environ.get("PEERS_PROFILE_STEP", "0")) or None,
               memory_step=int(os.environ.get("PEERS_MEMORY_STEP", "0")) or None,  # a step slowed by the allocator's history
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), shape=asdict(SHAPES[model]))
    if int(os.environ.get("RANK", "0")) == 0:
        rows = json.load(open(out)) if os.path.exists(out) else []
        rows.append(row)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"[peers] {system} {model} S={seq}: {step} s/step, {tps} tokens/s/GPU, peak {peak_gb:.1f} GB", flush=True)
    return row

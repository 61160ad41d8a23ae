"""Arctic Long Sequence Training's one-GPU recipe, side by side with memory="auto" (issue #22).

    PYTHONPATH=$PWD:/tmp/ds python benchmarks/alst.py --model llama-1b,llama3-8b-lora \
        --seqs 32768,131072,262144,524288 --out $OUT/alst.json
    PYTHONPATH=$PWD:/tmp/ds python benchmarks/alst.py --tiny --seqs 64,128      # CPU smoke run, tiny Llama
    PYTHONPATH=$PWD:/tmp/site python benchmarks/alst.py --model llama3-8b --recipe offload --seqs 131072   # ALST's own
    PYTHONPATH=$PWD:/tmp/ds python benchmarks/alst.py --tiny --recipe offload --seqs 64  # its CPU smoke run

(``/tmp/ds``: DeepSpeed installed without ops, ``pip install --no-index --no-deps --target /tmp/ds .whl4/*.whl``.)

Note [ALST on one GPU]
~~~~~~~~~~~~~~~~~~~~~~
ALST (Bekman et al., 2025, arXiv 2506.13996) trains a Hugging Face model at long context on one GPU with
attention-agnostic memory savings (its section 3; Ulysses SP is its multi-GPU part and is not used at one GPU):

* tiled MLP (``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP``): each decoder MLP runs over
  ``ceil(S / hidden_size)`` sequence tiles in forward and recomputes tile by tile in backward, so only one
  tile's (tile, intermediate_size) activations exist at a time. Applied here by replacing every layer's
  ``mlp`` with :class:`TiledMLPBlock` (which holds the HF MLP unchanged) instead of ALST's patch of
  ``LlamaMLP.forward``; the computation is the same autograd function.
* tiled fused logits + loss (``ulysses_sp.TiledFusedLogitsLoss``): the (S, vocab) logits are never whole; tiles
  of about ``--loss-shard-gb`` of fp32 logits (1 GiB, ALST's choice) run lm_head + cross entropy and their
  backward inside the forward. The function computes the lm_head weight gradient for an incoming gradient of
  1 and only scales the hidden-state gradient by the real one, so :func:`alst_loss` makes each tile return its
  summed loss divided by the GLOBAL count of labelled tokens with ``output_reduction="sum"``: the output is the
  mean loss, its incoming gradient 1, and every gradient exact (tested against the plain model in
  tests/test_alst_benchmark.py). (Dividing the returned sum instead would leave the tied embedding's lm_head
  part of the gradient ``n`` times too large.)
* activation-checkpoint offload: HF gradient checkpointing (reentrant: ``torch.utils.checkpoint`` saves each
  layer's input ``hidden_states`` with ``save_for_backward``) inside DeepSpeed's
  ``deepspeed.runtime.activation_checkpointing.offload_activations.CheckpointHiddenStatesOffload`` (0.19+,
  ``get_checkpoint_hidden_states_offloading_ctx_manager``): a ``saved_tensors_hooks`` context that copies those
  inputs to pinned host memory on a side stream and back in backward (the last layer's stays on the GPU). It is
  DeepSpeed's upstreaming of ArcticTraining's ``monkey_patch_checkpoint_function_with_cpu_offload``; while it is
  entered DeepSpeed wraps ``transformers.GradientCheckpointingLayer.__call__`` to mark the inputs, and restores
  it on exit. Reentrant checkpointing is used, as in ALST (ArcticTraining's patch is of the reentrant
  ``CheckpointFunction``); the marked / offloaded / kept counts of the last step are recorded (on the CPU every
  marked input is "skipped": DeepSpeed offloads from an accelerator only).
* ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (ALST's fragmentation advice), set unless already set;
  the value in effect is recorded.

Not used, and why. ALST's 8B-at-500K run holds an 8B FULL fine-tune through ZeRO-3 with parameters and optimizer
state offloaded to the host, which needs ``DeepSpeedCPUAdam`` (a C++ op that DeepSpeed JIT-builds; the wheel is
built without ops). Here the 1B full fine-tune fits on the GPU (bf16 weights, gradients and AdamW state: ~10 GB)
and the 8B run is LoRA (frozen base, ~0.1 GB of fp32 adapters), so no ZeRO stage or optimizer offload is needed:
at one GPU ZeRO partitions over one rank and would only add the engine's buffers. The DeepSpeed engine
(``deepspeed.initialize``) is therefore not used; the optimizer is ``torch.optim.AdamW`` (no fused DeepSpeed
op). Liger kernels (ALST uses them for RMSNorm / RoPE / SwiGLU) are not installed: the model runs transformers'
own modules, as ours does. Attention is transformers' SDPA (flash backend on the GPU; flash-attn is absent).

Note [ALST's offload recipe on one GPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``--recipe offload`` is ALST's own one-GPU recipe for a FULL fine-tune, ArcticTraining's
``projects/sequence-parallelism/run-h200-sp1-llama-8b-liger-offload-tiled-mlp.yml`` (Llama-3.1-8B, "max_length:
1_200_000 # ok 136.15 GB" on one H200; its H100 twin ``run-h100-sp1-llama-8b.yml``: 500,000), through DeepSpeed's API
(not through TRL): ``deepspeed.initialize`` with ``zero_optimization: {stage: 3, offload_optimizer: {device: cpu},
offload_param: {device: cpu}}`` and bf16 (fp32 master weights and Adam states on the host), the optimizer
``DeepSpeedCPUAdam`` (the recipe's ``cpu_adam``, lr 1e-5; JIT-built on the machine: ninja and a C++ compiler; where the
build fails, torch's AdamW on the host with ``zero_force_ds_cpu_optimizer: false``, recorded as ``optimizer``), the
model built under ZeRO-3's partitioned init (``HfDeepSpeedConfig``, as transformers does for a ZeRO-3 run), Liger's
RoPE / RMSNorm / SwiGLU (the recipe's ``model: type: liger``; ``apply_liger_kernel_to_llama``), tiled MLPs
(``tiled_mlp_compute: true``), reentrant gradient checkpointing with the checkpointed inputs offloaded to the host
(``activation_checkpoint_cpu_offload: true``), ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``. Two
departures, stated in every record (``departures``): the loss is DeepSpeed's ``TiledFusedLogitsLoss`` (ALST's
tiled logits+loss; ArcticTraining at one GPU calls Liger's fused linear cross entropy, which reads
``lm_head.weight`` outside ``lm_head``'s forward, where ZeRO-3 has not gathered it: the two hold the same memory,
one (S / shards, vocab) fp32 tile), and attention is ``--attn`` (the recipe's flash_attention_3 needs Hopper wheels
the image lacks; SDPA's flash backend or flash-attention 4 stand in). ``--layers N`` builds the same width with N
layers (the per-layer memory at lengths whose full-depth step is longer than one run; the record adds the full
depth's host estimate, ``full_depth_*``). Host memory: the peak RSS (``ru_maxrss``, pinned buffers included once
touched) and DeepSpeed's offload estimate (~18 bytes a parameter).

For each model and length: the model is built from its config (random init, seed 0, bf16, on the device), trained
2 optimizer steps at batch 1 on the random tokens of benchmarks/memory_plan.py (same generator, same labels); one
record per length with the second step's time and tokens/s, ``torch.cuda.max_memory_allocated`` /
``max_memory_reserved`` over both steps, the losses, the host peak RSS, the offload counts, or the error. A CUDA
out-of-memory error stops that model's longer lengths (recorded as skipped); lengths not started before
--max-minutes are recorded as skipped. A length that exhausts the host's memory is recorded as "host out of memory"
(``host_oom``) and ends the process with exit code 4 (Note [The host-memory watchdog] in benchmarks/driver.py).
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from driver import HostMemoryWatchdog, error_text, host_oom_exit, record_and_release
from hf import LLAMA3_8B, MEMORY_SHAPES

LLAMA_1B = MEMORY_SHAPES["llama-3.2-1b"]

MODELS = {
    # name -> (config dict, LoRA?, record's model name)
    "llama-1b": (LLAMA_1B, False, "hf-llama-3.2-1b-shaped"),
    "llama3-8b-lora": (LLAMA3_8B, True, "hf-llama-3-8b-shaped-lora"),
    "llama3-8b": (MEMORY_SHAPES["llama-3-8b"], False, "hf-llama-3-8b-shaped"),  # --recipe offload: the full fine-tune
}
TINY = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=4096, tie_word_embeddings=True,
            rms_norm_eps=1e-5, attention_dropout=0.0)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _ulysses_sp():
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    return ulysses_sp


def _mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return mlp(x)


class TiledMLPBlock(nn.Module):
    """Holds one decoder layer's MLP and runs it through DeepSpeed's ``TiledMLP`` over ``ceil(S / hidden)`` tiles."""

    def __init__(self, mlp: nn.Module, *, hidden_size: int) -> None:
        super().__init__()
        self.mlp = mlp
        self.hidden_size = hidden_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, H) -> (B, S, H)
        shards = math.ceil(x.shape[-2] / self.hidden_size)  # ALST's tile count: S / hidden_size tiles
        params = [p for p in self.mlp.parameters() if p.requires_grad]
        return _ulysses_sp().TiledMLP.apply(_mlp_forward, self.mlp, x, shards, params)


def causal_lm(model: nn.Module) -> nn.Module:
    """The ``*ForCausalLM`` under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def loss_shards(seq: int, vocab: int, shard_gb: float) -> int:
    """ALST's tile count for the fused logits+loss: tiles of about ``shard_gb`` GiB of fp32 logits."""
    return max(1, math.ceil(seq * vocab * 4 / (shard_gb * 2**30)))


def alst_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, *, shards: int) -> torch.Tensor:
    """Mean next-token loss of ``labels`` (already shifted, -100 ignored) through DeepSpeed's TiledFusedLogitsLoss.

    Each tile returns its summed cross entropy over the global labelled-token count (Note [ALST on one GPU]).
    """
    lm = causal_lm(model)
    hidden = lm.model(input_ids=input_ids, use_cache=False).last_hidden_state  # (B, S, H)
    count = (labels != -100).sum().clamp(min=1)
    vocab = lm.config.vocab_size

    def tile_loss(owner: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # x (n, H), y (n,)
        logits = owner.lm_head(x).float()  # (n, V)
        return F.cross_entropy(logits.view(-1, vocab), y.view(-1), ignore_index=-100, reduction="sum") / count

    params = [p for p in lm.lm_head.parameters() if p.requires_grad]
    return _ulysses_sp().TiledFusedLogitsLoss.apply(tile_loss, lm, hidden, labels, None, shards, params, "sum")


def build_model(spec: dict, *, lora: bool, device: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """The transformers model of ``spec`` (random init) with ALST's tiled MLPs and reentrant gradient checkpointing;
    with ``lora`` a frozen base and peft LoRA r=16 on every projection, adapters in fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    for layer in model.model.layers:
        layer.mlp = TiledMLPBlock(layer.mlp, hidden_size=config.hidden_size)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS),
                                    autocast_adapter_dtype=True)
        causal_lm(model).enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
    model.train()
    return model


def offload_context():
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager,
    )

    return get_checkpoint_hidden_states_offloading_ctx_manager()


def host_memory_bytes() -> int:
    """The host memory this process may use: physical memory, or the cgroup's limit when lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def offload_host_bytes(spec: dict, seq: int) -> int:
    """Pinned host memory the checkpoint offload takes at ``seq``: every layer input but the last, (1, S, H) bf16."""
    return (spec["num_hidden_layers"] - 1) * seq * spec["hidden_size"] * 2


def full_depth_host(spec: dict, seq: int) -> dict:
    """``--layers N``: the host memory the recipe would take at full depth (``spec``'s own layers): ZeRO-3's ~18 bytes
    a parameter (:class:`~lightning_seqpar.planner.memory.TransformerShape`'s count) and the offloaded checkpoints."""
    from lightning_seqpar.planner.memory import TransformerShape

    params = TransformerShape.from_config(spec).params
    return dict(full_depth_layers=spec["num_hidden_layers"], full_depth_zero_host_gb_estimate=18 * params / 1e9,
                full_depth_offload_host_gb_estimate=offload_host_bytes(spec, seq) / 1e9)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def batches(vocab: int, seq: int, steps: int, device: str, row: dict):
    """benchmarks/memory_plan.py's tokens and labels, (1, S) each, one pair a step; the device's peak is reset (and the
    model's memory recorded) before the first."""
    if device == "cuda":
        row.update(model_mem_gb=torch.cuda.memory_allocated() / 1e9)
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        labels = torch.cat([ids[1:], torch.tensor([-100])])
        yield ids[None].to(device), labels[None].to(device)  # (1, S)


def timed_steps(step, update, pairs, device: str, row: dict | None = None):
    """Each (ids, labels) of ``pairs``: ``step`` (forward + backward, returns the loss) under DeepSpeed's checkpoint
    offload, then ``update``; the seconds and loss of each step and the last step's offload stats. ``row`` gets the
    steps so far after each one (``steps_done``), so that a later step's host out of memory keeps them."""
    times: list[float] = []
    losses: list[float] = []
    offload = None
    for ids, labels in pairs:
        _sync(device)
        t0 = time.perf_counter()
        offload = offload_context()
        with offload:
            loss = step(ids, labels)
        update()
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
        del loss
        # each step as it ends: a run stopped later by a call's time limit keeps what it measured
        peak = f", peak allocated {torch.cuda.max_memory_allocated() / 1e9:.1f} GB" if device == "cuda" else ""
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        print(f"[alst] step {len(times)}: {times[-1]:.1f} s, loss {losses[-1]:.4f}{peak}, host max RSS {rss:.1f} GB", flush=True)
        if row is not None:
            row.update(steps_done=len(times), step_times_s=list(times), losses=list(losses), host_maxrss_gb_after_step=rss)
    return times, losses, offload.stats


def run(spec: dict, *, lora: bool, seq: int, steps: int, shard_gb: float, device: str, row: dict) -> None:
    """Train ``steps`` steps at ``seq`` tokens with ALST's pieces; fills ``row``."""
    dtype = torch.bfloat16
    model = build_model(spec, lora=lora, device=device, dtype=dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-5, weight_decay=0.0)
    vocab = spec["vocab_size"]
    shards = loss_shards(seq, vocab, shard_gb)
    row.update(trainable_params=sum(p.numel() for p in trainable), loss_shards=shards,
               mlp_shards=math.ceil(seq / spec["hidden_size"]))
    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = alst_loss(model, ids, labels, shards=shards)
        loss.backward()
        return loss

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times, losses, stats = timed_steps(step, update, batches(vocab, seq, steps, device, row), device, row)
    row.update(step_time_s=times[-1], tokens_per_s=seq / times[-1], losses=losses,
               offload={"marked": stats.marked_tensors, "offloaded": stats.offloaded_tensors,
                        "kept_on_gpu": stats.kept_last_tensors, "skipped": stats.skipped_marked_tensors,
                        "offloaded_gb": stats.offloaded_bytes / 1e9},
               offload_host_gb_estimate=offload_host_bytes(spec, seq) / 1e9)
    if device == "cuda":
        row.update(peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9, peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9)
    else:
        row.update(peak_mem_gb=None)


def ds_config(*, torch_optimizer: bool) -> dict:
    """The recipe's DeepSpeed config (Note [ALST's offload recipe on one GPU]): ZeRO-3, parameters and optimizer on the host."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
            "zero_force_ds_cpu_optimizer": not torch_optimizer, "steps_per_print": 1 << 30, "wall_clock_breakdown": False}


def cpu_adam_error() -> str | None:
    """None where the recipe's ``cpu_adam`` op builds (DeepSpeed JIT-builds it once), else why not."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
        return None
    except Exception as error:  # noqa: BLE001 - no compiler / ninja on the machine: recorded, torch AdamW instead
        return error_text(error, 300)


def _init_distributed(device: str) -> None:
    import deepspeed

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                           LOCAL_RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo", verbose=False)


def run_offload(spec: dict, *, seq: int, steps: int, shard_gb: float, device: str, attn: str, row: dict,
                inspect=None) -> None:
    """Train ``steps`` steps at ``seq`` tokens with ALST's own one-GPU offload recipe; fills ``row``. ``inspect``: called
    with the DeepSpeed engine before the first step (tests read the initial weights there)."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    _init_distributed(device)
    liger = None
    try:  # the recipe's ``model: type: liger``: Liger's RoPE, RMSNorm and SwiGLU in the transformers Llama
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        if device == "cuda":
            apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
            liger = "rope, rms_norm, swiglu"
        else:
            liger = "not applied on the CPU (Triton kernels)"
    except ImportError as error:
        liger = f"not installed ({error})"
    spec = dict(spec)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    why = cpu_adam_error()
    conf = ds_config(torch_optimizer=why is not None)
    keep = HfDeepSpeedConfig(conf)  # noqa: F841 - alive while the model is built: transformers builds it under zero.Init
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=attn)
    for layer in model.model.layers:
        layer.mlp = TiledMLPBlock(layer.mlp, hidden_size=config.hidden_size)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if why is None:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        optimizer = DeepSpeedCPUAdam(params, lr=1e-5, weight_decay=0.0, adamw_mode=True)
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=conf)
    if inspect is not None:
        inspect(engine)
    vocab = config.vocab_size
    shards = loss_shards(seq, vocab, shard_gb)
    row.update(init_s=time.perf_counter() - t0, trainable_params=sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params),
               loss_shards=shards, mlp_shards=math.ceil(seq / config.hidden_size), liger=liger, attention=attn,
               optimizer=type(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).__name__,
               cpu_adam_error=why, zero=conf["zero_optimization"], master_weights="fp32 (ZeRO-3 optimizer on the host)",
               precision="bf16 (DeepSpeed bf16: fp32 master weights and Adam states)",
               departures=["loss: DeepSpeed TiledFusedLogitsLoss for Liger's fused linear cross entropy",
                           f"attention: {attn} for flash_attention_3"])
    def step(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = alst_loss(engine.module, ids, labels, shards=shards)
        engine.backward(loss)
        return loss

    times, losses, stats = timed_steps(step, engine.step, batches(vocab, seq, steps, device, row), device, row)
    row.update(step_time_s=times[-1], step_times_s=times, tokens_per_s=seq / times[-1], losses=losses,
               offload={"offloaded": stats.offloaded_tensors, "kept_on_gpu": stats.kept_last_tensors,
                        "offloaded_gb": stats.offloaded_bytes / 1e9},
               offload_host_gb_estimate=offload_host_bytes(spec, seq) / 1e9,
               zero_host_gb_estimate=18 * row["trainable_params"] / 1e9)
    if device == "cuda":
        row.update(peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9, peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9)
    else:
        row.update(peak_mem_gb=None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--seqs", default="32768,131072,262144", help="comma-separated sequence lengths")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--loss-shard-gb", type=float, default=1.0, help="GiB of fp32 logits per loss tile (ALST: 1)")
    ap.add_argument("--max-minutes", type=float, default=8.0, help="lengths not started by then are recorded as skipped")
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU (smoke run)")
    ap.add_argument("--recipe", choices=("pieces", "offload"), default="pieces",
                    help="pieces: ALST's tiled pieces with torch AdamW on the GPU (Note [ALST on one GPU]); offload: ALST's own "
                         "full fine-tune recipe, ZeRO-3 with parameters and optimizer on the host (Note [ALST's offload recipe on one GPU])")
    ap.add_argument("--layers", type=int, default=None, help="--recipe offload: the model's width with this many layers")
    ap.add_argument("--attn", default="sdpa", help="--recipe offload: transformers' attn_implementation")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()
    if not args.tiny:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before the first CUDA call
    try:
        import deepspeed
    except Exception as error:  # the answer to "does DeepSpeed run on this image" is a result too
        for name in args.model.split(","):
            record_and_release(args.out, dict(bench="alst", system="alst", model=MODELS.get(name, (None, None, name))[2],
                                              gpus=1, commit=args.commit, error=f"import deepspeed: {error_text(error, 600)}"))
        raise

    device = "cpu" if args.tiny else "cuda"
    start = time.monotonic()

    def say(row: dict) -> None:
        print(f"[alst] {row['model']} S={row['seq']}: " + ", ".join(f"{k}={row[k]}" for k in (
            "peak_mem_gb", "peak_reserved_gb", "step_time_s", "tokens_per_s", "losses", "offload", "error") if k in row), flush=True)

    names = args.model.split(",")
    for name in names:
        if name not in MODELS:
            raise SystemExit(f"--model: unknown model {name!r}; choose from {sorted(MODELS)}")
    for name in names:
        spec, lora, model_name = MODELS[name]
        if args.tiny:
            spec, model_name = TINY, model_name.replace("-shaped", "-shaped-tiny")
        offload = args.recipe == "offload"
        if offload and spec.get("tie_word_embeddings"):  # TiledFusedLogitsLoss's in-forward backward meets the embedding's
            spec = dict(spec, tie_word_embeddings=False)  # gradient of the same ZeRO-3 parameter twice (the 8B is untied)
        full_spec = spec
        if args.layers:
            spec, model_name = dict(spec, num_hidden_layers=args.layers), f"{model_name}-{args.layers}-layers"
        if offload and lora:
            raise SystemExit(f"--recipe offload is ALST's full fine-tune recipe; {name!r} is a LoRA run (--recipe pieces)")
        stop: str | None = None
        for seq in (int(s) for s in args.seqs.split(",")):
            row: dict[str, Any] = dict(
                bench="alst", system="alst", model=model_name, seq=seq, gpus=1,
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                device_memory_gb=torch.cuda.get_device_properties(0).total_memory / 1e9 if device == "cuda" else None,
                precision="bf16-true", lora=lora, batch_size=1, steps=args.steps, loss_shard_gb=args.loss_shard_gb,
                recipe=("ArcticTraining run-h200-sp1-llama-8b-liger-offload-tiled-mlp.yml: ZeRO-3 parameter and optimizer "
                        "offload, cpu_adam, Liger, TiledMLP, CheckpointHiddenStatesOffload" if offload else
                        "TiledMLP+TiledFusedLogitsLoss+HF reentrant checkpointing+CheckpointHiddenStatesOffload, torch AdamW"),
                layers=spec["num_hidden_layers"], **(full_depth_host(full_spec, seq) if args.layers else {}),
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), deepspeed=deepspeed.__version__,
                torch=torch.__version__, commit=args.commit)
            host = host_memory_bytes()
            if stop is not None:
                row.update(error=f"skipped: {stop}")
            elif device == "cuda" and offload_host_bytes(spec, seq) > 0.8 * host:
                # the pinned copies alone would not fit in the host: refuse instead of being killed by the OOM killer
                row.update(error=f"skipped: the checkpoint offload would pin {offload_host_bytes(spec, seq) / 1e9:.0f} GB of "
                                 f"host memory, over 80% of the {host / 1e9:.0f} GB this process may use")
            elif time.monotonic() - start > 60 * args.max_minutes:
                row.update(error=f"skipped: --max-minutes {args.max_minutes} passed")
            else:
                try:  # a host out of memory leaves this row, not a SIGKILL (Note [The host-memory watchdog] in driver.py)
                    with HostMemoryWatchdog(host_oom_exit(row, args.out, say=say)):
                        if offload:
                            run_offload(spec, seq=seq, steps=args.steps, shard_gb=args.loss_shard_gb, device=device,
                                        attn=args.attn, row=row)
                        else:
                            run(spec, lora=lora, seq=seq, steps=args.steps, shard_gb=args.loss_shard_gb, device=device, row=row)
                except Exception as error:  # noqa: BLE001 - an OOM is a result: record it, skip this model's longer lengths
                    oom = isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)
                    row.update(error=error_text(error, 600), oom=oom)
                    if device == "cuda":
                        row.update(peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9,
                                   peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9)
                    if oom:
                        stop = f"out of memory at S={seq}"
            row.update(host_maxrss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,
                       host_memory_gb=host_memory_bytes() / 1e9)
            say(row)
            record_and_release(args.out, row)


if __name__ == "__main__":
    main()

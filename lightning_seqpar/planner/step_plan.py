"""A whole training step planned on 8 to 1,024 GPUs: what ``attention="auto"`` picks, the step around it and what
``memory="auto"`` sets for it (``seqpar plan``, in ``lightning_seqpar.cli.plan``), with the strategy's own planners.

Note [Planning a step across nodes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One sequence of S tokens per step over all W GPUs (sp = W, LoongTrain's d_sp = 64 setting),
FSDP2 over the same W ranks, bf16-mixed, selective++ checkpointing. Per GPU and step:

* attention: L x the cost model's plan (``choose_attention``: algorithm, hp x cp, inner ring,
  placement; Note [Two link levels]), forward + backward; selective++ keeps its output, so it
  is not recomputed, unless memory="auto" has to recompute it ("full": its forward once more). The
  algorithm is chosen together with the memory plan, as under the strategy (Note [Attention and
  memory chosen together] in ``lightning_seqpar.planner.memory``).
* linear layers: (6 + 2) x N_matmul x S / W FLOPs (forward, backward, and the recompute of
  selective++) at ``linear_flops``, every block counted as recomputed: where memory="auto" leaves
  blocks without checkpointing (``uncheckpointed_blocks`` in the table), the step is that much
  shorter than planned (2 of 8 parts of their linear work), an upper bound kept so that the step
  and the memory columns stay separate questions.
* FSDP2: all-gather of the bf16 parameters in forward and again in backward, reduce-scatter of
  fp32 gradients: (2 + 2 + 4) x N x (W-1)/W bytes per GPU, a ring at the NIC rate once W
  spans nodes; prefetched, so only what exceeds the compute is exposed.
* memory: what ``memory="auto"`` would do for that step (Note [Planning memory] in
  ``lightning_seqpar.planner.memory``, the same planner the strategy runs): one sequence of S tokens, sp = W,
  dp_shard = 1, the chosen attention algorithm and head-parallel size, the precision and loss chunk
  of :class:`MemorySetting` (bf16-mixed, 8192 by default), a GPU's memory as torch reports it
  (:data:`GPU_MEMORY`). The options it sets and its estimate, or, where none fit, the longest length
  that fits with the options nearest to fitting.

MFU counts model FLOPs as ``Llama.flops_per_token`` does (Note [FLOPs per token], causal
attention halved, no recompute) against 989 TFLOP/s dense bf16. This is a planning estimate:
only the attention part is validated against measurements (python -m benchmarks auto, one
node); the linear rate, the FSDP overlap and the inter-node constants are assumptions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from lightning_seqpar.attention.cost import AttentionPlan, Candidate, DeviceProfile, choose_attention
from lightning_seqpar.planner.memory import (
    DEFAULT_MARGIN,
    RECOMPUTED_ATTENTION,
    MemoryEstimate,
    MemoryPlan,
    MemoryPlanError,
    TransformerShape,
    plan_attention_and_memory,
    plan_memory,
)
from lightning_seqpar.planner.model_shape import MODELS, ModelShape
from lightning_seqpar.planner.planning import lora_targets, lora_trainable_params

PEAK_BF16 = 989e12


GPU_MEMORY: dict[str, float] = {"H100": 85.017493504e9, "H200": 150.10988032e9}
"""``torch.cuda.get_device_properties(...).total_memory`` of an H100 80GB HBM3 and an H200 (141 GB marketed), as the
records in benchmarks/results hold them: what ``memory="auto"`` plans for on those cards."""


@dataclass(frozen=True, kw_only=True)
class MemorySetting:
    """What the memory planner of a planned step assumes besides the model, length and GPUs (``memory="auto"``'s inputs)."""

    gpu_memory: float = GPU_MEMORY["H200"]
    """Bytes of one GPU's memory, as torch reports ``total_memory``."""
    host_memory: float | None = None
    """Bytes of host memory available to each GPU's process (None: not checked)."""
    precision: str = "bf16-mixed"
    loss_chunk_size: int | None = 8192
    """``CausalLMModule(loss_chunk_size=...)`` (the recipes' 8192; None: the full logits)."""
    lora_r: int = 0
    """LoRA rank on every linear layer (0: full training)."""


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    model: str
    seq_len: int
    gpus: int
    plan: AttentionPlan
    step_s: float
    attention_s: float
    attention_comm_s: float
    linear_s: float
    fsdp_exposed_s: float
    memory_gb: float
    """The memory planner's estimate per GPU, GB: of the options it chose, or when none fits of the nearest."""
    mfu: float

    attention_overhead_s: float
    fits: bool
    """Whether ``memory="auto"`` finds options that fit (``memory``)."""
    memory: MemoryPlan | None = None
    """The memory planner's choice (Note [Planning memory] in ``lightning_seqpar.planner.memory``); None when nothing fits."""
    longest_seq_len: int | None = None
    """When nothing fits: the longest length that fits with the options nearest to fitting (0: none)."""

    @property
    def dominant(self) -> str:
        """The largest term besides the matmul and attention kernels, with its share of the step:
        what grows as nodes are added (exposed attention communication, the attention's per-step
        elementwise work and launches, or exposed FSDP traffic)."""
        terms = {"attn comm": self.attention_comm_s, "attn per-step": self.attention_overhead_s, "FSDP": self.fsdp_exposed_s}
        name = max(terms, key=terms.__getitem__)
        return f"{name} {terms[name] / self.step_s:.0%}"

    @property
    def memory_options(self) -> str:
        """What memory="auto" sets: the options that differ from the defaults, or "does not fit" with the longest length."""
        return _memory_options(self.memory, self.longest_seq_len)


def _memory_options(plan: MemoryPlan | None, longest: int | None) -> str:
    if plan is not None:
        return plan.options.changes()
    return f"does not fit (longest {_k(longest)})" if longest else "does not fit at any length"


def plan_step(model: ModelShape, *, seq_len: int, gpus: int, profile: DeviceProfile | None = None,
              linear_flops: float = 650e12, algorithms: Sequence[str] | None = None, double_ring: bool = True,
              memory: MemorySetting | None = None) -> StepPlan:
    """One step of ``model`` on ``gpus`` GPUs (Note [Planning a step across nodes]); its memory by ``memory="auto"``'s
    planner under ``memory`` (default: an H200, bf16-mixed, loss chunks of 8192)."""
    profile = profile or DeviceProfile.h200()
    memory = memory or MemorySetting()
    plan = choose_attention(seq_len=seq_len, num_heads=model.n_head, num_kv_heads=model.n_kv_head, head_dim=model.head_dim,
                            world_size=gpus, profile=profile, algorithms=algorithms, double_ring=double_ring,
                            head_parallel_size=None)
    # the attention and its memory planned together, as under the strategy with head_parallel_size="auto" (Note [Attention
    # and memory chosen together]): the mesh (hp, placement) over every candidate, then the attention within that mesh
    planned: MemoryPlan | MemoryEstimate

    def plan_for(c: Candidate) -> MemoryPlan:
        return _step_memory_plan(model, seq_len=seq_len, gpus=gpus, algorithm=c.algorithm, head_parallel_size=c.hp, memory=memory)

    try:
        mesh = plan_attention_and_memory(plan, plan_for, layers=model.n_layer)[0]
        plan = choose_attention(seq_len=seq_len, num_heads=model.n_head, num_kv_heads=model.n_kv_head, head_dim=model.head_dim,
                                world_size=gpus, profile=profile, algorithms=algorithms, double_ring=double_ring,
                                head_parallel_size=mesh.head_parallel_size,
                                placement=mesh.placement if mesh.head_parallel_size > 1 else None)
        plan, planned = plan_attention_and_memory(plan, plan_for, layers=model.n_layer)
        longest = None
    except MemoryPlanError as refusal:  # none fits: the cost model's pick, with the estimate nearest to fitting
        planned, longest = refusal.best, refusal.longest_seq_len
    pick = plan.candidates[0]
    recompute = isinstance(planned, MemoryPlan) and planned.options.activation_checkpointing == "full"
    attention = model.n_layer * pick.est_time_s * (1 + (RECOMPUTED_ATTENTION if recompute else 0.0))
    attention_comm = model.n_layer * pick.communication_s
    tokens = seq_len / gpus
    linear = 8 * model.matmul_params * tokens / linear_flops
    fsdp_bytes = 8 * model.params * (gpus - 1) / gpus
    fsdp_rate = profile.inter_node_bandwidth if gpus > profile.gpus_per_node else profile.intra_node_collective_bandwidth
    fsdp_exposed = max(0.0, fsdp_bytes / fsdp_rate - (attention + linear))
    step = attention + linear + fsdp_exposed
    mfu = model.flops_per_token(seq_len) * tokens / step / PEAK_BF16
    estimate = planned.estimate if isinstance(planned, MemoryPlan) else planned
    return StepPlan(model=model.name, seq_len=seq_len, gpus=gpus, plan=plan, step_s=step, attention_s=attention,
                    attention_comm_s=attention_comm, linear_s=linear, fsdp_exposed_s=fsdp_exposed, memory_gb=estimate.total / 1e9,
                    mfu=mfu, attention_overhead_s=model.n_layer * pick.elementwise_s, fits=isinstance(planned, MemoryPlan),
                    memory=planned if isinstance(planned, MemoryPlan) else None, longest_seq_len=longest)


def _step_memory_plan(model: ModelShape, *, seq_len: int, gpus: int, algorithm: str, head_parallel_size: int,
                      memory: MemorySetting) -> MemoryPlan:
    """``memory="auto"``'s plan for the step (one sequence over all ``gpus``, FSDP2 over them, the attention ``algorithm``
    on ``head_parallel_size``); the planner's ``MemoryPlanError`` when none fits."""
    shape = model.transformer_shape
    trainable, targets = all_linear_lora(shape, memory.lora_r)
    return plan_memory(
        model_shape=shape, seq_len=seq_len, device_memory=memory.gpu_memory, sp=gpus, dp_shard=1,
        precision=memory.precision, loss_chunk_size=memory.loss_chunk_size, host_memory=memory.host_memory,
        trainable_params=trainable, lora_targets=targets, attention=algorithm, head_parallel_size=head_parallel_size,
        owner="seqpar plan")


def _plan_step_memory(model: ModelShape, *, seq_len: int, gpus: int, algorithm: str, head_parallel_size: int,
                      memory: MemorySetting) -> tuple[MemoryPlan | MemoryEstimate, int | None]:
    """:func:`_step_memory_plan`, or where none fits the estimate nearest to fitting and the longest length that fits."""
    try:
        return _step_memory_plan(model, seq_len=seq_len, gpus=gpus, algorithm=algorithm, head_parallel_size=head_parallel_size,
                                 memory=memory), None
    except MemoryPlanError as refusal:
        return refusal.best, refusal.longest_seq_len


def all_linear_lora(shape: TransformerShape, r: int) -> tuple[int | None, tuple[str, ...]]:
    """``plan_memory``'s ``trainable_params`` and ``lora_targets`` for LoRA of rank ``r`` on every linear layer
    (``target_modules="all-linear"``); (None, ()) for ``r = 0``, full training."""
    if r == 0:
        return None, ()
    config = SimpleNamespace(r=r, target_modules="all-linear")  # the two fields of a peft.LoraConfig the planner reads
    return lora_trainable_params(shape, config), lora_targets(config)


def megatron_cp(model: ModelShape, **kwargs) -> StepPlan:
    """Megatron-style context parallelism: one zigzag ring over every GPU (no head parallelism, no inner rings)."""
    return plan_step(model, algorithms=("ring",), double_ring=False, **kwargs)


TABLE_HEADER = ("| model | S | GPUs | auto picks | step s | MFU | memory='auto' | GB/GPU | host GB/GPU | largest overhead | "
                "Megatron-CP step s | MFU |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|")


def table(models: Sequence[str | ModelShape], seq_lens: Sequence[int], gpus: Sequence[int], *, gpus_per_node: int = 8,
          memory: MemorySetting | None = None, profile: DeviceProfile | None = None) -> list[str]:
    """Markdown rows: auto's pick and its step next to Megatron-style CP, and what ``memory="auto"`` sets and estimates
    (or the longest length that fits), for every feasible combination. ``models``: names of :data:`MODELS` or shapes."""
    profile = profile or DeviceProfile.h200(gpus_per_node=gpus_per_node)
    memory = memory or MemorySetting()
    rows = list(TABLE_HEADER)
    for model in models:
        model = MODELS[model] if isinstance(model, str) else model
        for s in seq_lens:
            for w in gpus:
                if s < w:
                    continue
                budget = (1 - DEFAULT_MARGIN) * memory.gpu_memory / 1e9
                try:
                    auto = plan_step(model, seq_len=s, gpus=w, profile=profile, memory=memory)
                except ValueError:  # no attention algorithm fits (the cost model's own memory check): what would, for a ring
                    planned, longest = _plan_step_memory(model, seq_len=s, gpus=w, algorithm="ring", head_parallel_size=1,
                                                         memory=memory)
                    estimate = planned if isinstance(planned, MemoryEstimate) else planned.estimate
                    rows.append(f"| {model.name} | {_k(s)} | {w} | no attention fits |  |  | "
                                f"{_memory_options(planned if isinstance(planned, MemoryPlan) else None, longest)} | "
                                f"{estimate.total / 1e9:.0f}{'' if longest is None else f' (> {budget:.0f})'} | "
                                f"{_host(estimate)} |  |  |  |")
                    continue
                try:
                    ring = megatron_cp(model, seq_len=s, gpus=w, profile=profile, memory=memory)
                    ring_cells = f"{ring.step_s:.2f} | {ring.mfu:.2f}"
                except ValueError:
                    ring_cells = "does not fit | "
                gb = f"{auto.memory_gb:.0f}" + ("" if auto.fits else f" (> {budget:.0f})")
                host = _host(auto.memory.estimate) if auto.memory is not None else "-"
                rows.append(f"| {model.name} | {_k(s)} | {w} | {auto.plan.label} | {auto.step_s:.2f} | {auto.mfu:.2f} | "
                            f"{auto.memory_options} | {gb} | {host} | {auto.dominant} | {ring_cells} |")
    return rows


def _host(estimate: MemoryEstimate) -> str:
    """Pinned host memory per GPU (offloaded checkpoints and parameters): what the run's host must hold for each GPU's
    process, and what its first step pins (Note [Pinning host memory in parallel] in ``lightning_seqpar.parallel.resources``)."""
    return f"{estimate.host / 1e9:.0f}" if estimate.host else "-"


def _k(s: int) -> str:
    return f"{s // 1048576}M" if s % 1048576 == 0 else f"{s // 1024}K" if s % 1024 == 0 else str(s)


__all__ = ["GPU_MEMORY", "MODELS", "PEAK_BF16", "TABLE_HEADER", "MemorySetting", "ModelShape", "StepPlan", "all_linear_lora",
           "megatron_cp", "plan_step", "table"]

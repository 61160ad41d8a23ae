"""What ``attention="auto"`` and ``memory="auto"`` decide under the strategy, for the model it is given (the planned
step across nodes of ``seqpar plan`` is in ``lightning_seqpar.planner.step_plan``).

The strategy asks this module, beside the cost model (``lightning_seqpar.attention.cost``), for its
decisions that need the model and the world: the mesh sizes it may choose (:func:`plan_mesh_sizes`,
before the process group exists), the algorithm of ``attention="auto"`` (:func:`resolve_auto_attention`,
in setup; Note [Choosing attention automatically]), and the checks of the options against the model's
heads, the mesh and the device (:func:`check_options_against_model`); and ``memory="auto"``'s options
(:func:`plan_memory_options`, before the process group exists, with ``lightning_seqpar.planner.memory``'s estimate).
It also gives the strategy's hooks the mesh sizes of this world (:func:`plan_parallel_dims`) and ``memory="auto"`` at
its two moments (:func:`plan_run_memory`).
"""

from __future__ import annotations

import os
import random
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader

from lightning_seqpar.attention.algorithms import ALGORITHMS
from lightning_seqpar.attention.cost import (
    AttentionPlan,
    Candidate,
    DeviceProfile,
    choose_attention,
)
from lightning_seqpar.attention.local import available_backends, resolve_backend
from lightning_seqpar.models.registry import (
    attention_heads,
    cudnn_attention_exact,
    family_of,
)
from lightning_seqpar.parallel.config import MEMORY_OPTIONS, StrategyConfig, serves_cpu
from lightning_seqpar.parallel.mesh import ParallelDims
from lightning_seqpar.parallel.parallelize import find_blocks, uses_linear_attention
from lightning_seqpar.planner.memory import (
    MemoryPlan,
    TransformerShape,
    plan_attention_and_memory,
    plan_memory,
)

# --------------------------------------------------------------------------------------------- under the strategy

# Note [Choosing attention automatically]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# attention="auto" is resolved in setup(), when the model exists: LASP for a linear-attention
# model; for softmax attention with expected_seq_len, the cost model's choice
# (Note [Choosing the attention algorithm] in lightning_seqpar.attention.cost) for the model's
# (H_q, H_kv, D), sp ranks and this device, among the algorithms the mesh allows: with hp = 1
# ring, all-gather or Ulysses; with hp > 1, 2D. head_parallel_size="auto" must be known
# earlier, when the mesh is built (setup_environment, before configure_model): it is read
# from the LightningModule's ``config`` (CausalLMModule has one) and is 1 when there is none.
# The batches come later still, hence expected_seq_len; without it, the length memory="auto"
# planned for (the datamodule's seq_len or the first batch's: both plans read one length, and
# the memory plan estimates the algorithm this choice will take, since Ulysses holds whole-
# sequence heads where ring holds blocks; where memory binds the two are chosen together, Note
# [Attention and memory chosen together] in lightning_seqpar.planner.memory); with neither "auto" stays "2d" if hp > 1 else
# "ring" (4 x H200, Llama-3-8B at 64K without expected_seq_len: ring 4,390 tokens/s/GPU
# where the cost model's Ulysses ran 4,536). Across nodes (sp > devices per node) it also picks the rank order of the
# mesh (placement="auto": head-first or context-first, decided with hp when the mesh is built)
# and, unless inner_ring_size is set, the inner ring size; on one node no double ring is
# weighed (it only pays off when the outer hops cross nodes). The cost model's rates are the
# local kernel's that attention_backend="auto" will run, cuDNN where the model says its backward
# is exact (registry.cudnn_attention_exact, read from the config before the model is built):
# planned with flash-attention-2's rates instead, the default install ran Llama-3-8B at 128K on
# 4 x H200 with the ring, 3,123 tokens/s/GPU, where Ulysses on the same cuDNN ran 3,166
# (2026-11-28, 905e000; benchmarks/results/20261128-nvidia-h200-x4-peers-2).


@dataclass(frozen=True, kw_only=True)
class RunSite:
    """Where a run computes, as far as the planner needs it (the strategy fills it in)."""

    device: torch.device
    """This rank's device (the CPU while the devices are not known yet)."""
    precision: str = "32-true"
    """The Trainer's precision ("bf16-mixed", "32-true", ...)."""
    gpus_per_node: int = 1
    """Devices per node."""

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype attention computes in under the precision ("bf16-mixed" -> bf16, "32-true" -> fp32, ...)."""
        return {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}.get(self.precision.split("-")[0], torch.float32)

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.precision.startswith("32") else 2


@dataclass(frozen=True)
class ResolvedAttention:
    """What ``attention="auto"`` became in setup: the algorithm, the layout, the inner ring size and the cost model's plan."""

    attention: str
    layout: str
    inner_ring_size: int | None
    plan: AttentionPlan | None = None


def model_attention_shape(module: nn.Module | None) -> tuple[int, int, int] | None:
    """(H_q, H_kv, D) of the softmax attention of ``module``, from the model registry (Note [The model registry])."""
    return attention_heads(module, complete=True)  # type: ignore[return-value]


def is_linear_attention_model(module: nn.Module) -> bool:
    """A linear-attention (LASP) model, built (its blocks call LinearAttention) or still a config of a linear-attention family."""
    family = family_of(getattr(module, "config", None))
    return uses_linear_attention(module) or (family is not None and family.linear_attention)


def _first_shape(roots: Sequence[nn.Module]) -> tuple[int, int, int] | None:
    return next((s for s in map(model_attention_shape, roots) if s is not None), None)


def auto_candidates(config: StrategyConfig, *, inner_ring_size: int | None) -> tuple[str, ...]:
    """The algorithms attention="auto" may pick: those that take the options the user set
    (head_chunks > 1: ring or all-gather; inner_ring_size: ring or 2D)."""
    allowed = set(ALGORITHMS)
    if config.head_chunks > 1:
        allowed &= {"ring", "allgather"}
    if inner_ring_size is not None:
        allowed &= {"ring", "2d"}
    return tuple(a for a in ALGORITHMS if a in allowed)


def plan_attention(shape: tuple[int, int, int] | None, *, config: StrategyConfig, site: RunSite, sp: int,
                   head_parallel_size: int | None, placement: str | None, layout: str, inner_ring_size: int | None,
                   owner: str, seq_len: int | None = None, cudnn_exact: bool = False) -> AttentionPlan | None:
    """The cost model's plan for attention heads ``shape`` = (H_q, H_kv, D) over ``sp`` ranks, for ``expected_seq_len``
    or else ``seq_len`` (the length memory="auto" planned for: the two plans read one length, Note [Choosing attention
    automatically]), with the rates of the local kernel that will run (``cudnn_exact``: the model's, from
    :func:`cudnn_attention_exact`); None when not asked for or unknown."""
    length = config.expected_seq_len if config.expected_seq_len is not None else seq_len
    if config.attention != "auto" or length is None or shape is None or sp == 1:
        return None
    h_q, h_kv, head_dim = shape
    # the local kernel the attention will run, as attention_backend="auto" resolves it (the cost model's rates differ per
    # kernel: Note [Choosing attention automatically])
    kernel = config.attention_backend if config.attention_backend != "auto" else resolve_backend(
        "auto", site.device, site.compute_dtype, head_dim, cudnn_exact=cudnn_exact, seq_len=length // sp)
    device_name = torch.cuda.get_device_name(site.device) if site.device.type == "cuda" else ""
    profile = DeviceProfile.for_device(device_name, backend=kernel, gpus_per_node=max(1, site.gpus_per_node))
    try:
        return choose_attention(
            seq_len=length, num_heads=h_q, num_kv_heads=h_kv, head_dim=head_dim, world_size=sp,
            layout=layout, dtype_bytes=site.dtype_bytes, profile=profile,  # type: ignore[arg-type]
            algorithms=auto_candidates(config, inner_ring_size=inner_ring_size), head_parallel_size=head_parallel_size,
            # inner rings pay off only across nodes (Note [Choosing attention automatically])
            double_ring=inner_ring_size is None and sp > max(1, site.gpus_per_node),
            head_chunks=config.head_chunks if h_kv % config.head_chunks == 0 else 1, placement=placement,  # type: ignore[arg-type]
        )
    except ValueError as error:
        raise ValueError(
            f"{owner}: attention='auto' with expected_seq_len={length}, "
            f"head_parallel_size={config.head_parallel_size!r} and sequence_parallel_size={sp}: {error}"
        ) from error


def plan_mesh_sizes(module: nn.Module | None, *, config: StrategyConfig, site: RunSite, world_size: int, sp: int,
                    layout: str, inner_ring_size: int | None, owner: str,
                    memory: tuple[Callable[[Candidate], MemoryPlan], int] | None = None) -> tuple[int | str, str]:
    """(head_parallel_size, placement) for the mesh: the config's, or with "auto" the cost model's choice for the
    model's heads (Note [Choosing attention automatically]: from the LightningModule's config, if it has one), made
    with each candidate's memory plan where ``memory`` = (a candidate's memory plan, the model's layers) is given
    (Note [Attention and memory chosen together]). No communication; sizes that do not divide are left for
    ``ParallelDims.from_sizes`` to name."""
    hp: int | str = config.head_parallel_size
    placement: str = config.placement
    if hp == "auto" or placement == "auto":
        linear = module is not None and is_linear_attention_model(module)
        fixed_hp = None if hp == "auto" else hp
        plan = None
        if not (linear or world_size % sp or (fixed_hp is not None and sp % fixed_hp)):  # type: ignore[operator]
            plan = plan_attention(model_attention_shape(module), config=config, site=site, sp=sp,
                                  head_parallel_size=fixed_hp, placement=None if placement == "auto" else placement,  # type: ignore[arg-type]
                                  layout=layout, inner_ring_size=inner_ring_size, owner=owner,
                                  cudnn_exact=cudnn_attention_exact(module))
        if plan is not None and memory is not None:
            try:
                plan = plan_attention_and_memory(plan, memory[0], layers=memory[1])[0]
            except ValueError:  # nothing fits any mesh: the cost model's, and the memory plan after it names why
                pass
        if hp == "auto":
            hp = plan.head_parallel_size if plan is not None else 1
        if placement == "auto":
            placement = plan.placement if plan is not None else "context-first"
    return hp, placement


def plan_parallel_dims(module: nn.Module | None, *, config: StrategyConfig, site: RunSite, world_size: int, node_size: int,
                       layout: str, inner_ring_size: int | None, owner: str,
                       device_memory: Callable[[], int | None] | None = None, trainer: Any = None) -> ParallelDims:
    """The mesh sizes for this world, before the process group exists (no communication): sequence_parallel_size
    ("auto": the ``node_size`` devices of a node), head_parallel_size and placement as :func:`plan_mesh_sizes` gives
    them, with each candidate's memory plan where it can be made now (``device_memory``, read when planning, and the
    length known before the process group: :func:`_mesh_memory`); ``ParallelDims.from_sizes`` checks them (a
    ``ValueError`` naming the argument)."""
    sp = node_size if config.sequence_parallel_size == "auto" else config.sequence_parallel_size
    memory = None
    if "auto" in (config.head_parallel_size, config.placement) and device_memory is not None:
        memory = _mesh_memory(module, config=config, site=site, world_size=world_size, node_size=node_size, sp=sp,
                              device_memory=device_memory, trainer=trainer, owner=owner)
    hp, placement = plan_mesh_sizes(module, config=config, site=site, world_size=world_size, sp=sp, layout=layout,
                                    inner_ring_size=inner_ring_size, owner=owner, memory=memory)
    return ParallelDims.from_sizes(
        world_size=world_size,
        sequence_parallel_size=sp,
        head_parallel_size=hp,  # type: ignore[arg-type]
        data_parallel_replicate_size=config.data_parallel_replicate_size,
        placement=placement,  # type: ignore[arg-type]
        node_size=node_size,
        owner=owner,
    )


def _mesh_memory(module: nn.Module | None, *, config: StrategyConfig, site: RunSite, world_size: int, node_size: int, sp: int,
                 device_memory: Callable[[], int | None], trainer: Any, owner: str) -> tuple[Callable[[Candidate], MemoryPlan], int] | None:
    """(a candidate's memory plan, the model's layers) for choosing the mesh, where memory="auto" (or the default) can
    plan before the mesh exists: a CUDA device, a length known then (Note [The length memory="auto" plans for]) and a
    model whose shape the planner reads; None otherwise, and where any of them is wrong (the plan after the mesh names
    it). The data-parallel sizes, and so the plan's inputs but the attention, are the same for every mesh of ``sp``."""
    if config.memory == "manual":
        return None
    try:  # the model and the length first: the device is asked only for a run the planner can plan
        layers = model_shape_of(module, owner=owner).num_layers
        length = memory_plan_length(config, trainer=trainer, in_setup=False, owner=owner)
        memory = None if length is None else device_memory()
        if memory is None:
            return None
        dims = ParallelDims.from_sizes(world_size=world_size, sequence_parallel_size=sp, head_parallel_size=1,
                                       data_parallel_replicate_size=config.data_parallel_replicate_size,
                                       placement="context-first", node_size=node_size, owner=owner)
    except ValueError:
        return None
    assert length is not None
    plan_for = _memory_planner(module, config=config, length=length, site=site, dims=dims, device_memory=memory, owner=owner)
    return (lambda c: plan_for(c.algorithm, c.hp if c.algorithm == "2d" else 1)), layers


def resolve_auto_attention(roots: Sequence[nn.Module], *, config: StrategyConfig, site: RunSite, dims: ParallelDims,
                           layout: str, inner_ring_size: int | None, owner: str, seq_len: int | None = None,
                           planned: str | None = None) -> ResolvedAttention | None:
    """attention="auto": LASP on a linear-attention model, else the cost model's plan (Note [Choosing attention
    automatically]) with the candidate ``planned`` picked, the one memory="auto" chose together with its options
    (``MemoryPlan.attention``, Note [Attention and memory chosen together]); None when nothing changes (not "auto",
    no plan)."""
    if not (config.attention == "auto" and roots):
        return None
    if not all(uses_linear_attention(root) for root in roots):
        plan = plan_attention(_first_shape(roots), config=config, site=site, sp=dims.sp, head_parallel_size=dims.hp,
                              placement=dims.placement, layout=layout, inner_ring_size=inner_ring_size, owner=owner,
                              seq_len=seq_len, cudnn_exact=cudnn_attention_exact(roots[0]))
        if plan is None:
            return None
        if planned is not None:
            plan = plan.picking(planned)
        if inner_ring_size is None and plan.inner_ring_size is not None:  # chosen across nodes
            inner_ring_size = plan.inner_ring_size
        return ResolvedAttention(plan.algorithm, layout, inner_ring_size, plan)
    if dims.hp != 1:
        raise ValueError(f"{owner}: the model uses linear attention (LASP), which needs head_parallel_size=1")
    if layout != "contiguous" and config.load_balance != "auto":
        raise ValueError(f"{owner}: the model uses linear attention (LASP), which needs load_balance='contiguous' (or 'auto')")
    return ResolvedAttention("lasp", "contiguous", inner_ring_size)


def check_plans_agree(config: StrategyConfig, *, attention: str, owner: str) -> None:
    """Every rank planned the same memory options and attention (Note [The plan every rank runs]): one
    ``all_gather_object`` over the default group where the planner ran (``memory`` not "manual") on several ranks;
    a ``ValueError`` naming the ranks and the options that differ, before the model is parallelized.

    Note [The plan every rank runs]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Each rank plans alone, before the process group exists (``offload_params`` decides its backend), from
    inputs that can differ across ranks: the host memory available to it (``MemAvailable``, read at its own
    moment, per node) and the device's memory. Options that differ across ranks make the collectives differ
    (head chunks split the ring's messages, offloaded parameters move the optimizer step to the host): a hang
    or a wrong step, not an error. Since the planner runs by default (``memory=None``), the strategy compares
    the plans once the group exists and stops with the differences named instead; setting the option that
    differs (or ``memory="manual"``) makes every rank run the same."""
    import torch.distributed as dist

    if config.memory == "manual" or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    mine = {"attention": attention, **{name: getattr(config, name) for name in MEMORY_OPTIONS}}
    plans: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(plans, mine)
    differ = sorted({k for p in plans for k in p if p[k] != plans[0][k]})
    if differ:
        by_rank = "; ".join(f"rank {r}: " + ", ".join(f"{k}={p[k]!r}" for k in differ) for r, p in enumerate(plans))
        raise ValueError(f"{owner}: the ranks planned different options ({by_rank}): their collectives would not match. "
                         f"Set {', '.join(k for k in differ if k != 'attention') or 'attention'} explicitly (the planner keeps an option "
                         "you set), or memory='manual' (Note [The plan every rank runs])")


def check_options_against_model(roots: Sequence[nn.Module], *, config: StrategyConfig, site: RunSite, dims: ParallelDims,
                                attention: str, inner_ring_size: int | None, owner: str) -> None:
    """The options that need the model, the mesh or the device, checked in setup before any collective:
    inner_ring_size against the resolved attention and the context-parallel size, head_chunks against the
    model's key/value heads, and a named attention_backend against this device (for the precision's dtype,
    or bf16 / fp16 under a user's own autocast)."""
    if config.gather_whole_model and dims.world_size != 1:
        raise ValueError(f"{owner}: gather_whole_model=True is for one rank (Note [One rank: one gather per step]); this run "
                         f"shards the model over {dims.world_size} ranks (dp_replicate x dp_shard x sp)")
    if inner_ring_size is not None:
        if attention not in ("ring", "2d"):
            raise ValueError(f"{owner}: inner_ring_size={inner_ring_size} needs attention 'ring' or '2d', "
                             f"but attention resolved to {attention!r}")
        dims.check_inner_ring(inner_ring_size, owner=owner)
    chunks = config.head_chunks
    shape = _first_shape(roots)
    if not (chunks == 1 or shape is None or shape[1] % chunks == 0):
        h_kv = shape[1]
        divisors = [d for d in range(1, h_kv + 1) if h_kv % d == 0]
        raise ValueError(f"{owner}: head_chunks={chunks} must divide the model's key/value heads ({h_kv}); "
                         f"choose one of {divisors}")
    backend = config.attention_backend
    if backend == "auto" or all(uses_linear_attention(root) for root in roots):
        return
    dtype = site.compute_dtype
    head_dim = None if shape is None else shape[2]
    runnable = {b for d in (dtype, torch.bfloat16, torch.float16) for b in available_backends(site.device, d, head_dim)}
    if backend not in runnable:
        try:  # resolve_backend's message says why (install, device, dtype, head dim)
            resolve_backend(backend, site.device, dtype, head_dim)
        except ValueError as error:
            raise ValueError(f"{owner}: attention_backend={backend!r}: {error}") from error



# --------------------------------------------------------------------------------------------- memory="auto"

LORA_LINEARS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Llama-style block, by their transformers names (what peft's target_modules names)."""


def lora_targets(lora_config: Any) -> tuple[str, ...]:
    """The linear layers of :data:`LORA_LINEARS` a ``peft.LoraConfig`` adapts ("all-linear", None or a pattern: all),
    and ``"lm_head"`` where it is adapted too (named in the list, or matched by the pattern; Note [An adapted output
    head] in ``lightning_seqpar.hf.lora``)."""
    targets = getattr(lora_config, "target_modules", None)
    if isinstance(targets, str) and targets in LORA_LINEARS:
        return (targets,)
    if targets is None or isinstance(targets, str):
        head = isinstance(targets, str) and targets != "all-linear" and re.fullmatch(targets, "lm_head") is not None
        return LORA_LINEARS + (("lm_head",) if head else ())
    names = set(targets)
    return tuple(t for t in LORA_LINEARS if t in names) + (("lm_head",) if "lm_head" in names else ())


def lora_trainable_params(shape: TransformerShape, lora_config: Any) -> int:
    """Adapter parameters of a ``peft.LoraConfig`` on a Llama-style decoder: r x (in + out) per targeted linear
    layer and block (:func:`lora_targets`)."""
    d, D, I = shape.hidden_size, shape.head_dim, shape.intermediate_size
    sizes = {"q_proj": (d, shape.num_heads * D), "k_proj": (d, shape.num_kv_heads * D), "v_proj": (d, shape.num_kv_heads * D),
             "o_proj": (shape.num_heads * D, d), "gate_proj": (d, I), "up_proj": (d, I), "down_proj": (I, d)}
    r = int(getattr(lora_config, "r", 8))
    targets = lora_targets(lora_config)
    head = r * (d + shape.vocab_size) if "lm_head" in targets else 0
    return shape.num_layers * sum(r * sum(sizes[n]) for n in targets if n != "lm_head") + head


def host_memory_bytes() -> float:
    """The host memory available to new allocations (``MemAvailable`` of /proc/meminfo; the free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device (``torch.cuda.get_device_properties``); None for any other device."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).total_memory)


# Note [The length memory="auto" plans for]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The planner needs the global sequence length of the training batches. It takes the first of:
#
#   1. ``expected_seq_len``, the user's;
#   2. the datamodule's ``seq_len`` (every datamodule of ``lightning_seqpar.data`` has one): the
#      Trainer attaches the datamodule before ``setup_environment``, and ``seq_len`` is a
#      constructor argument, known before the datamodule's ``setup``;
#   3. the first batch of the stage's data (training data under ``fit``): its ``input_ids``' last
#      dimension, read in ``setup`` (after the datamodule's ``setup`` and ``configure_model``,
#      before the model is parallelized) through a loader of its own over the same dataset and
#      ``collate_fn``, in order, without workers and with the random states put back, so the
#      run's loader, sampler and random streams are untouched. Every rank reads the same first
#      sample, so every rank plans the same options.
#
#   time   setup_environment                       setup                          fit loop
#          mesh sizes -> plan (1, 2) -> group     datamodule.setup -> plan (3)   loaders, batches
#                                                  -> parallelize (the options)
#
# With 1 or 2 the plan runs before the process group exists (Note "The order of the steps" in
# docs/architecture.md). With 3 it runs when the group exists already: of the options it may set,
# only ``offload_params`` reaches the group (the CPU backend its host-resident gradients need,
# Note [Offloading parameters to host memory] in ``lightning_seqpar.parallel.parallelize``), so on CUDA with
# ``process_group_backend=None`` the group is then created with "cpu:gloo,cuda:nccl" whatever the
# plan chooses (under "auto"; the default ``memory=None`` adds no backend for a plan it may not make,
# and its plan then keeps ``offload_params`` off unless the group's backend serves the CPU); every
# other option is first read by ``parallelize``. A length read from the first
# batch is that batch's: data of varying lengths needs ``expected_seq_len`` (the longest). Where
# none of the three exists, a ``ValueError`` names ``expected_seq_len`` before any collective (the
# default ``memory=None`` logs it and keeps the options as given).


@dataclass(frozen=True)
class PlannedLength:
    """The sequence length memory="auto" plans for, and how its messages name it (Note [The length memory="auto" plans for])."""

    seq_len: int
    name: str
    """"expected_seq_len", "<datamodule class>.seq_len" or "the first batch's length"."""


def known_seq_len(config: StrategyConfig, datamodule: object, *, owner: str) -> PlannedLength | None:
    """The length memory="auto" plans for, where it is known before the process group exists: ``expected_seq_len``, else
    the datamodule's ``seq_len`` attribute; None when neither is there (Note [The length memory="auto" plans for]).
    A ``seq_len`` that is not a positive int (nor None) raises a ``ValueError`` naming it."""
    if config.expected_seq_len is not None:
        return PlannedLength(config.expected_seq_len, "expected_seq_len")
    seq_len = getattr(datamodule, "seq_len", None)
    if seq_len is None:
        return None
    name = f"{type(datamodule).__name__}.seq_len"
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"{owner}: memory='auto' plans for the datamodule's sequence length, but {name}={seq_len!r} is not a "
                         "positive int; give the strategy expected_seq_len (the global sequence length of the training batches)")
    return PlannedLength(seq_len, name)


def first_batch_seq_len(trainer: Any, *, owner: str) -> PlannedLength:
    """The length of the first batch of the stage's data (``input_ids``' last dimension), read without touching the run's
    loader or random state (Note [The length memory="auto" plans for]). Raises a ``ValueError`` naming
    ``expected_seq_len`` when there is no such batch."""
    loops = {"fit": "fit_loop", "validate": "validate_loop", "test": "test_loop", "predict": "predict_loop"}
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    loop = getattr(trainer, loops.get(getattr(fn, "value", fn), "fit_loop"), None)
    # Lightning keeps where a stage's data comes from (a datamodule, the LightningModule's hook or the loaders given to
    # fit) in the loop's private _data_source; it has no public accessor before the loop's own setup_data.
    source = getattr(loop, "_data_source", None)
    why = "the run has no data source"
    loader = None
    if source is not None and source.is_defined():
        loader = _first_loader(source.dataloader())
        why = "its data is not a torch DataLoader"
    batch = None
    if loader is not None:
        sampled = loader.batch_size is not None or loader.batch_sampler is None  # False: a batch sampler of its own
        peek = DataLoader(loader.dataset, batch_size=loader.batch_size if sampled else 1, collate_fn=loader.collate_fn)
        states = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
        try:
            batch = next(iter(peek), None)
        finally:
            torch.random.set_rng_state(states[0])
            random.setstate(states[1])
            np.random.set_state(states[2])
        why = "its first batch is not a mapping with an input_ids tensor" if batch is not None else "its dataset is empty"
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None  # a dict, or transformers' BatchEncoding
    if not (isinstance(ids, torch.Tensor) and ids.ndim >= 1 and ids.shape[-1] >= 1):
        raise ValueError(f"{owner}: memory='auto' plans the options for a sequence length, and none was found: expected_seq_len "
                         f"is not set, no datamodule gives a seq_len attribute, and {why}. Set expected_seq_len (the global "
                         "sequence length of the training batches), or use memory='manual'")
    return PlannedLength(int(ids.shape[-1]), "the first batch's length")


def memory_plan_length(config: StrategyConfig, *, trainer: Any, in_setup: bool, owner: str) -> PlannedLength | None:
    """The length memory="auto" plans for (Note [The length memory="auto" plans for]): before the process group exists
    (``in_setup=False``) ``expected_seq_len`` or the datamodule's ``seq_len``, None when neither is known; in setup the
    first batch's length, or a ``ValueError`` naming ``expected_seq_len``."""
    if in_setup:
        return first_batch_seq_len(trainer, owner=owner)
    return known_seq_len(config, getattr(trainer, "datamodule", None), owner=owner)


def _first_loader(loaders: Any) -> Any:
    """The first ``torch.utils.data.DataLoader`` in what a ``*_dataloader`` hook returns (a loader, a list or dict of
    them, a ``CombinedLoader``); None when there is none."""
    if isinstance(loaders, DataLoader):
        return loaders
    inner = getattr(loaders, "iterables", None)  # lightning's CombinedLoader
    if inner is not None:
        return _first_loader(inner)
    items = loaders.values() if isinstance(loaders, dict) else loaders if isinstance(loaders, (list, tuple)) else ()
    return next((found for found in map(_first_loader, items) if found is not None), None)


def model_shape_of(module: nn.Module | None, *, owner: str) -> TransformerShape:
    """The sizes the memory planner reads from the LightningModule's ``config``; a ``ValueError`` naming the model when
    they cannot be read."""
    try:
        return TransformerShape.from_config(getattr(module, "config", None))
    except ValueError as error:
        raise ValueError(f"{owner}: memory='auto' needs the model's sizes from the LightningModule's `config` "
                         f"(CausalLMModule has one): {error}") from error


def plan_memory_options(module: nn.Module | None, *, config: StrategyConfig, length: PlannedLength, site: RunSite,
                        dims: ParallelDims, device_memory: int | None, owner: str,
                        group_backend: str | None = None) -> MemoryPlan | None:
    """memory="auto" (or the default None): the options the planner chooses for the LightningModule's model on this
    device for ``length`` (Note [Planning memory] in ``lightning_seqpar.planner.memory``); None when ``device_memory`` is None
    (not a CUDA device) or memory="manual". The options the user set (any value but the default) are fixed;
    ``group_backend``: the process group's backend where it exists already (offload_params needs a CPU one). Raises the
    planner's ``ValueError`` when nothing fits, and one naming the model when its shape cannot be read."""
    return plan_memory_and_compile(module, config=config, length=length, site=site, dims=dims, device_memory=device_memory,
                                   owner=owner, group_backend=group_backend)[0]


def plan_memory_and_compile(module: nn.Module | None, *, config: StrategyConfig, length: PlannedLength, site: RunSite,
                            dims: ParallelDims, device_memory: int | None, owner: str,
                            group_backend: str | None = None) -> tuple[MemoryPlan | None, bool | None]:
    """:func:`plan_memory_options` and, for ``compile="auto"`` on a transformers family it compiles
    (:func:`compiles_transformers_layers`), whether to compile (None: not the planner's to say): compiled where the
    plan keeps the regime it was measured in, Selective Checkpoint++ with the parameters on the GPU, counting the
    compiled layers' memory; else eager, planned as such (Note [Compile by default])."""
    if config.memory == "manual" or device_memory is None:
        return None, None
    plan = partial(_plan_options, module, length=length, site=site, dims=dims, device_memory=device_memory, owner=owner,
                   group_backend=group_backend)
    compiled = compiles_transformers_layers(module, config=config, site=site)
    if config.compile != "auto" or not compiled:
        chosen = plan(config=config)
        if compiled and (
                chosen.options.activation_checkpointing != "selective++" or chosen.options.offload_params):
            rank_zero_warn(f"{owner}: compile=True with {chosen.describe()}: compiled transformers layers were measured "
                           "with Selective Checkpoint++ and the parameters on the GPU only; with full checkpointing and "
                           "offloaded parameters one ran 12% over this estimate (144.5 GB against 128.6, Llama-3-8B at "
                           "256K on one H200) and out of memory. compile=False (or 'auto') plans it eager "
                           "(Note [Compile by default])")
        return chosen, None
    if config.activation_checkpointing == "selective++" and not config.offload_params:
        try:
            return plan(config=replace(config, compile=True), measured_regime=True), True
        except ValueError:
            pass  # compiled does not fit where it was measured: eager, with whatever the planner picks
    return plan(config=replace(config, compile=False)), False


def _plan_options(module: nn.Module | None, *, config: StrategyConfig, length: PlannedLength, site: RunSite,
                  dims: ParallelDims, device_memory: int, owner: str, group_backend: str | None,
                  measured_regime: bool = False) -> MemoryPlan:
    """The planner's options for ``config`` (``measured_regime``: Selective Checkpoint++ and the parameters on the GPU
    fixed, where compiled transformers layers were measured)."""
    plan_for = _memory_planner(module, config=config, length=length, site=site, dims=dims, device_memory=device_memory,
                               owner=owner, group_backend=group_backend,
                               extra_fixed={"activation_checkpointing": "selective++", "offload_params": False} if measured_regime else None)
    # attention="auto": the algorithm setup then resolves is planned with the memory (its memory differs: Ulysses holds
    # whole-sequence heads), Note [Attention and memory chosen together] in lightning_seqpar.planner.memory
    shape = model_shape_of(module, owner=owner)
    plan = plan_attention((shape.num_heads, shape.num_kv_heads, shape.head_dim), config=config, site=site, sp=dims.sp,
                          head_parallel_size=dims.hp, placement=dims.placement, layout=config.layout,
                          inner_ring_size=config.inner_ring_size, owner=owner, seq_len=length.seq_len,
                          cudnn_exact=cudnn_attention_exact(module))
    if plan is None:
        return plan_for(config.initial_attention, dims.hp)
    return plan_attention_and_memory(plan, lambda candidate: plan_for(candidate.algorithm, dims.hp), layers=shape.num_layers)[1]


def _memory_planner(module: nn.Module | None, *, config: StrategyConfig, length: PlannedLength, site: RunSite,
                    dims: ParallelDims, device_memory: float, owner: str, group_backend: str | None = None,
                    extra_fixed: Mapping[str, Any] | None = None) -> Callable[[str, int], MemoryPlan]:
    """``plan_memory`` for the LightningModule's model on this device and ``length`` (``dims``: its sp and data-parallel
    sizes), as a function of the attention algorithm and the head-parallel size: the options the user set (any value
    but the default) fixed, and those the run's other settings exclude. Raises a ``ValueError`` naming the model when
    its shape cannot be read."""
    shape = model_shape_of(module, owner=owner)
    if compiles_transformers_layers(module, config=config, site=site):
        shape = replace(shape, compiled_transformers_layers=True)  # Note [Memory per token]: compiled layers keep more
    elif compiles_package_layers(module, config=config, site=site):
        shape = replace(shape, compiled_package_layers=True)
    defaults = StrategyConfig()
    fixed: dict[str, Any] = {name: getattr(config, name) for name in MEMORY_OPTIONS if getattr(config, name) != getattr(defaults, name)}
    if config.activation_checkpointing is None:  # offload needs checkpointed blocks
        fixed.setdefault("offload_checkpoints", False)
    backend = group_backend or config.process_group_backend
    if backend is not None and not serves_cpu(backend):  # offload_params needs a CPU backend (config's check)
        fixed.setdefault("offload_params", False)
    if dims.world_size != 1:  # one rank only (Note [One rank: one gather per step]); with replicas too, though unsharded
        fixed.setdefault("gather_whole_model", False)
    for name, value in (extra_fixed or {}).items():
        fixed.setdefault(name, value)
    lora = getattr(module, "_lora_config", None)

    def plan_for(algorithm: str, head_parallel_size: int) -> MemoryPlan:
        return plan_memory(
            model_shape=shape, seq_len=length.seq_len, length_name=length.name, device_memory=device_memory, sp=dims.sp,
            dp_shard=dims.dp_shard, precision=site.precision, fixed=fixed, batch_size=1,
            loss_chunk_size=getattr(module, "loss_chunk_size", None),
            trainable_params=None if lora is None else lora_trainable_params(shape, lora),
            lora_targets=() if lora is None else lora_targets(lora),
            host_memory=host_memory_bytes() / max(site.gpus_per_node, 1),
            attention=algorithm, head_parallel_size=head_parallel_size, owner=owner,
        )

    return plan_for


@dataclass(frozen=True)
class RunMemory:
    """What the strategy runs with after ``memory`` at one of its two moments (:func:`plan_run_memory`)."""

    config: StrategyConfig
    """The options: with those the planner set, or as given."""
    plan: MemoryPlan | None = None
    """The planner's choice and estimate; None where it did not plan."""
    later: bool = False
    """No length known yet (before the process group exists): plan again in setup, for the first batch's."""


def plan_run_memory(module: nn.Module | None, *, config: StrategyConfig, site: RunSite, dims: ParallelDims,
                    device_memory: Callable[[], int | None], trainer: Any, in_setup: bool, owner: str,
                    group_backend: str | None = None) -> RunMemory:
    """``memory`` at one of its two moments (Note [The length memory="auto" plans for]): the planner's choice for the
    length known then (:func:`memory_plan_length`) and ``config`` with the options it sets (checked again), logged;
    ``later`` when no length is known yet (before the process group exists: it plans again in setup, for the first
    batch's). ``device_memory``: read when planning, None off CUDA (no plan, a log line). ``group_backend``: in setup, the process group's
    backend as the strategy asked for it (None: Lightning's default for the device). memory="auto" raises where it cannot plan or
    nothing fits; the default None logs why it does not plan, or warns with the planner's message where nothing
    fits, and keeps the options as given (Note [Planning memory] in ``lightning_seqpar.planner.memory``)."""
    as_given = RunMemory(config)
    if config.memory == "manual":
        return as_given
    default = config.memory is None
    which = "memory=None (the default)" if default else "memory='auto'"
    if in_setup and group_backend is None and site.device.type == "cuda":
        group_backend = "nccl"  # what Lightning starts on CUDA without a backend given
    try:
        if default:
            model_shape_of(module, owner=owner)  # before waiting for a length: a model it cannot plan for is not planned
        if (memory := device_memory()) is None:
            rank_zero_info(f"{owner}: {which} plans for CUDA devices; on {site.device.type} the options stay as given")
            return as_given
        length = memory_plan_length(config, trainer=trainer, in_setup=in_setup, owner=owner)
    except ValueError as error:
        if not default:
            raise
        rank_zero_info(f"{owner}: {which} keeps the options as given, the planner cannot plan this run: {error}")
        return as_given
    if length is None:
        return RunMemory(config, later=True)
    try:
        plan, compiled = plan_memory_and_compile(module, config=config, length=length, site=site, dims=dims, device_memory=memory,
                                                 owner=owner, group_backend=group_backend)
    except ValueError as error:
        if not default:
            raise
        rank_zero_warn(f"{owner}: {which} runs with the options as given, which may not fit: {error} (memory='auto' "
                       "refuses such a run; memory='manual' plans nothing)")
        return as_given
    assert plan is not None
    planned = replace(config, **{name: getattr(plan.options, name) for name in MEMORY_OPTIONS},
                      **({} if compiled is None else {"compile": compiled}))
    rank_zero_info(f"{owner}: {plan.describe()} ({length.name})" + (
        "" if compiled is None else f"; compile='auto' -> {compiled} for its transformers layers (Note [Compile by default])"))
    return RunMemory(planned, plan)


# --------------------------------------------------------------------------------------------- the strategy's questions


# Note [Compile by default]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# ``compile="auto"`` (the default) compiles every block (``apply_compile``, its checkpoint included: Note
# [Checkpoints under torch.compile]) where that was measured faster: the package's own models on a CUDA device.
# Inductor fuses the block's element-wise work (RMSNorm, RoPE, SwiGLU, the residual adds, and their recompute in a
# Selective Checkpoint++ block) as liger-kernel's kernels do, so the package as ``pip install`` gives it needs no
# extra for them: one Llama-3-8B block over 32K tokens on one H200, 204 -> 180 ms (liger-kernel: 184 ms); Llama-3-8B
# at 64K on 2 x H200 without the ``gpu`` extra, 4,225 -> 4,743 tokens/s/GPU, ahead of torchtitan with its own
# compile (4,431) on the same machine (docs/benchmarks.md); the default itself, in a later lease: 4,754 against
# 4,517; at 128K on 4 x H200, level with it (3,112 against 3,115). The cost: the first step compiles (Llama-3-8B on
# 2 x H200: 26 s on a fresh machine, 12 s with warm caches, against 9 s eager; one graph per block class, reused
# by every block). Off elsewhere: on CPU (Inductor's C++ build for a short run), for a user's own model (not
# measured on a GPU) and for transformers models. For those ``compile=True`` compiled no layer before Note [One
# graph for every layer] (3,731 -> 3,734 "measured no faster"); now it is 1.16x (Qwen3-8B at 64K on 2 x H200,
# 3,780 -> 4,384, first step 24 s against 10 s), and its layers hold one more hidden state per token (137.7 GB
# allocated against 128.0 eager), which the planner now counts for a transformers model under ``compile=True``
# (Note [Memory per token]). With it the planner offloads that run's checkpoints (139.9 GB over its 135.1 GB
# budget), and that plan, measured compiled, is still 1.10x eager: 4,116 tokens/s/GPU against TRL CP with Liger's
# 3,638 on the same machine (2 x H200, 2026-11-28, bacbad2), where eager ran 3,780-3,800 against 3,679-3,706 in
# three earlier leases. So "auto" also compiles the dense transformers families it was measured or tested on
# (``COMPILED_TRANSFORMERS``: Qwen3 on a GPU; Llama, the same layer without the q/k norms, one graph for every layer
# on the CPU), without LoRA (peft's layers in the block: not measured), and the planner counts their extra hidden
# state under "auto" as under ``True``, in the regime it was measured in: the planner first plans them compiled with
# Selective Checkpoint++ and the parameters on the GPU (offloaded checkpoints, head and MLP chunks allowed) and
# compiles where that fits; where it does not, it plans them eager (``plan_memory_and_compile``). Outside that regime
# the compiled layers' memory is not what the planner counts: Llama-3-8B at 256K on one H200, compiled with full
# checkpointing and offloaded parameters, peaked at 144.5 GB allocated against 128.6 planned and ran out of memory
# (c9fe071), so ``compile=True`` there warns. Other transformers families (MoE, hybrid, sliding-window, sinks) stay eager.
# ``compile=False`` turns it off, ``True`` or a dict of ``torch.compile`` arguments turns it on for any model.


#: The transformers model types ``compile="auto"`` compiles on a CUDA device (Note [Compile by default]).
COMPILED_TRANSFORMERS = ("llama", "qwen3")


def _compiled_transformers_layer(block: nn.Module) -> bool:
    """A decoder layer of ``COMPILED_TRANSFORMERS`` without peft's layers in it (Note [Compile by default])."""
    where = type(block).__module__
    return any(where == f"transformers.models.{t}.modeling_{t}" for t in COMPILED_TRANSFORMERS) and not any(
        type(m).__module__.startswith("peft.") for m in block.modules())


def compiles_transformers_layers(module: nn.Module | None, *, config: StrategyConfig, site: RunSite) -> bool:
    """Whether the strategy compiles this LightningModule's transformers decoder layers (Note [Memory per token]):
    ``compile`` True or a dict, or "auto" on a CUDA device for ``COMPILED_TRANSFORMERS`` without LoRA; read from its
    config before the model is built, as the planner runs before ``resolve_compile``."""
    transformers = sys.modules.get("transformers")
    hf = getattr(module, "config", None)
    if config.compile is False or transformers is None or not isinstance(hf, transformers.PretrainedConfig):
        return False
    if config.compile != "auto":
        return True
    return (site.device.type == "cuda" and getattr(hf, "model_type", None) in COMPILED_TRANSFORMERS
            and getattr(module, "_lora_config", None) is None)


def compiles_package_layers(module: nn.Module | None, *, config: StrategyConfig, site: RunSite) -> bool:
    """Whether the strategy compiles the blocks of this LightningModule's model when it is one of the package's own
    (its ``config`` a package config): ``compile`` True or a dict, or "auto" on a CUDA device (Note [Compile by
    default]); read before the model is built (Note [Memory per token])."""
    if config.compile is False or family_of(getattr(module, "config", None)) is None:
        return False
    return config.compile != "auto" or site.device.type == "cuda"


def resolve_compile(roots: Sequence[nn.Module], *, config: StrategyConfig, site: RunSite) -> StrategyConfig:
    """``compile="auto"`` resolved for these roots on this device (Note [Compile by default]); other values as given."""
    if config.compile != "auto":
        return config
    blocks = [getattr(parent, name) for root in roots for parent, name in find_blocks(root)]
    own = bool(blocks) and all(type(b).__module__.startswith("lightning_seqpar.models.") for b in blocks)
    measured = config.activation_checkpointing == "selective++" and not config.offload_params  # transformers layers
    return replace(config, compile=site.device.type == "cuda" and bool(blocks) and (own or measured and all(map(_compiled_transformers_layer, blocks))))


class RunPlanning:
    """The strategy's questions to the planner, as methods of ``SequenceParallelStrategy`` (a mixin, as the options'
    ``ConfigOptions``): each passes the run's state (the world, the device and precision, the options resolved so far)
    to the functions above and keeps their answer on the strategy (``config``, ``memory_plan``, the resolved
    ``attention``, ``layout`` and ``inner_ring_size``, ``attention_plan``)."""

    config: StrategyConfig
    attention: str
    layout: str
    inner_ring_size: int | None
    attention_plan: AttentionPlan | None
    memory_plan: MemoryPlan | None
    _plan_in_setup: bool

    def resolve_parallel_dims(self) -> ParallelDims:
        """The mesh sizes for this world (no communication). Raises ValueError naming the argument."""
        # "auto": the cost model's choice for the LightningModule's config (Note [Choosing attention automatically]), with
        # each candidate's memory plan where it can be made now (Note [Attention and memory chosen together])
        site = self._run_site()
        return plan_parallel_dims(self.lightning_module, config=self.config, site=site,
                                  world_size=self.num_nodes * self.num_processes, node_size=self.num_processes,
                                  layout=self.layout, inner_ring_size=self.inner_ring_size, owner=type(self).__name__,
                                  device_memory=lambda: self._device_memory_bytes(site.device),
                                  trainer=getattr(self.lightning_module, "_trainer", None))

    def _plan_memory(self, dims: ParallelDims, trainer: Any = None) -> None:
        """memory None / "auto": set the options the planner chooses for this device (``planning.plan_run_memory``): in
        setup_environment for a length known then, else in setup (``trainer``) for the first batch's (Note [The length
        memory="auto" plans for] in ``lightning_seqpar.planner.planning``)."""
        if trainer is not None and not self._plan_in_setup:
            return
        site = self._run_site()
        run = plan_run_memory(self.lightning_module, config=self.config, site=site, dims=dims,
                              device_memory=lambda: self._device_memory_bytes(site.device), in_setup=trainer is not None,
                              trainer=trainer or getattr(self.lightning_module, "_trainer", None), owner=type(self).__name__,
                              group_backend=self._process_group_backend if trainer is not None else None)
        self._plan_in_setup, self.config, self.memory_plan = run.later, run.config, run.plan or self.memory_plan

    def _device_memory_bytes(self, device: torch.device) -> int | None:
        """The memory memory="auto" plans for: the CUDA device's total (None elsewhere). Tests override it."""
        return device_memory_bytes(device)

    def _resolve_auto_attention(self, roots: list[nn.Module]) -> None:
        """attention="auto": what the planner resolves it to for these roots (Note [Choosing attention automatically])."""
        resolved = resolve_auto_attention(roots, config=self.config, site=self._run_site(), dims=self.parallel_dims,
                                          layout=self.layout, inner_ring_size=self.inner_ring_size, owner=type(self).__name__,
                                          seq_len=self.memory_plan.estimate.seq_len if self.memory_plan else None,
                                          planned=self.memory_plan.attention if self.memory_plan else None)
        if resolved is not None:
            self.attention, self.layout, self.inner_ring_size = resolved.attention, resolved.layout, resolved.inner_ring_size
            self.attention_plan = resolved.plan if resolved.plan is not None else self.attention_plan

    def _resolve_compile(self, roots: list[nn.Module]) -> None:
        """compile="auto": on or off for these roots on this device (Note [Compile by default])."""
        self.config = resolve_compile(roots, config=self.config, site=self._run_site())

    def _check_options_against_model(self, roots: list[nn.Module]) -> None:
        """The options that need the model, mesh and device, before any collective (``planning.check_options_against_model``)."""
        check_options_against_model(roots, config=self.config, site=self._run_site(), dims=self.parallel_dims,
                                    attention=self.attention, inner_ring_size=self.inner_ring_size, owner=type(self).__name__)
        check_plans_agree(self.config, attention=self.attention, owner=type(self).__name__)  # before parallelizing

    def _run_site(self) -> RunSite:
        """This run's device, precision and devices per node, for the planner."""
        device = self.root_device if self.parallel_devices else torch.device("cpu")
        return RunSite(device=device, precision=str(getattr(self.precision_plugin, "precision", "32-true")),
                       gpus_per_node=self.num_processes)

"""Parallelism applied to a model by pure functions over a DeviceMesh (torchtitan's shape).

Note [Order of the apply_* calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
:func:`parallelize` applies, in this fixed order (as torchtitan v0.2.2 ``parallelize_llama``):

1. :func:`apply_attention` — switch every ``lightning_seqpar.attention.Attention`` to the
   sequence-parallel algorithm. First, because it only sets attributes and checks the head
   counts against the mesh before anything else touches the model (errors before any
   communication of the step).
2. :func:`apply_mlp_tiles` — optional: each block's MLP runs over slices of the sequence, each
   slice checkpointed (Note [Sequence-tiled MLP]). Inside the block, so before its wrapper.
3. :func:`apply_ac` — wrap each block for activation checkpointing. Before compile, so that the
   compiled region contains the checkpoint (torch.compile traces the selective-checkpoint
   policy and keeps the attention op's outputs; Note [Checkpoints under torch.compile]: a block
   whose checkpoint offloads to host memory is compiled inside it), and before FSDP so that
   FSDP's all-gathers stay outside the recomputed region.
4. :func:`apply_compile` — ``torch.compile`` each (wrapped) block in place. Per block, not the
   whole model: one small graph reused for every layer, and FSDP's hooks stay between graphs.
5. :func:`apply_fsdp` — ``fully_shard`` each block, then the root (on one rank with
   ``gather_whole_model`` the root only: Note [One rank: one gather per step]). Last, because it replaces
   parameters by DTensor shards: everything above must see the module structure first. With
   ``offload_params`` the shards then live in host memory (Note [Offloading parameters to host
   memory]).

"Blocks" are the transformer layers: the elements of an ``nn.ModuleList`` attribute named one
of :data:`BLOCK_CONTAINERS` (``model.layers`` for Llama and Hugging Face Llama/Mistral/Qwen,
``h`` for GPT-2, ``blocks``), or every module of the classes given as ``block_classes``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_seqpar.attention import ALGORITHMS, Attention, LinearAttention
from lightning_seqpar.attention.api import check_head_chunks
from lightning_seqpar.attention.recurrent import Recurrence
from lightning_seqpar.sharding.agreement import RankAgreement
from lightning_seqpar.parallel.config import check_lasp_variant, check_offload_checkpoints, check_uncheckpointed_blocks
from lightning_seqpar.models.registry import attention_heads
from lightning_seqpar.routing.blocks import BLOCK_CONTAINERS, is_marked
from lightning_seqpar.parallel.activation_checkpointing import (MLP_NAMES, SAVE_OPS, ActivationCheckpointing, HostOffload, checkpoint_block,
                                                       compile_target, is_norm, tile_mlp)


GradientReduction = Literal["sum", "mean"]


# --------------------------------------------------------------------------------------------- blocks


def find_blocks(model: nn.Module, block_classes: Sequence[type[nn.Module]] | None = None) -> list[tuple[nn.Module, str]]:
    """The transformer blocks of ``model`` as ``(parent, name)`` pairs: ``getattr(parent, name)`` is the block.

    A block already wrapped (activation checkpointing) is returned as its wrapper.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    found: list[tuple[nn.Module, str]] = []

    def is_block(module: nn.Module) -> bool:
        if block_classes is None:
            return False
        inner = next(iter(module.children())) if isinstance(module, CheckpointWrapper) else module
        return isinstance(inner, tuple(block_classes))

    def visit(parent: nn.Module) -> None:
        for name, child in parent.named_children():
            if block_classes is None:  # Note [Finding the blocks of a user's model]: by name, or a marked container
                if is_marked(child) or (name in BLOCK_CONTAINERS and isinstance(child, nn.ModuleList)):
                    found.extend((child, n) for n, _ in child.named_children())
                    continue
            elif is_block(child):
                found.append((parent, name))
                continue
            visit(child)

    visit(model)
    return found


def _blocks(model: nn.Module, block_classes: Sequence[type[nn.Module]] | None) -> Iterable[nn.Module]:
    return [getattr(parent, name) for parent, name in find_blocks(model, block_classes)]


def _sharing_groups(blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """``blocks`` grouped so that blocks sharing a parameter are in one group (in block order): FSDP2 refuses a
    parameter managed by two groups (Zamba ties the shared attention block of all its hybrid layers)."""
    parent = list(range(len(blocks)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, block in enumerate(blocks):
        for p in block.parameters():
            j = owner.setdefault(id(p), i)
            parent[root(i)] = root(j)
    groups: dict[int, list[nn.Module]] = {}
    for i, block in enumerate(blocks):
        groups.setdefault(root(i), []).append(block)
    return list(groups.values())


def config_value(config: Any, name: str) -> Any:
    """``getattr(config, name, None)``, also None where the config refuses a global value (Gemma 4's
    per-layer ``head_dim`` raises on the global read)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError and the like
        return None


# --------------------------------------------------------------------------------------------- apply_*


def uses_linear_attention(model: nn.Module) -> bool:
    """Whether ``model`` calls :class:`~lightning_seqpar.attention.LinearAttention` and no softmax ``Attention``."""
    modules = list(model.modules())
    return any(isinstance(m, LinearAttention) for m in modules) and not any(isinstance(m, Attention) for m in modules)


def apply_attention(
    model: nn.Module,
    mesh: DeviceMesh | None,
    *,
    attention: Literal["ring", "allgather", "ulysses", "2d", "lasp"],
    layout: Literal["zigzag", "contiguous"] = "zigzag",
    attention_backend: str = "auto",
    inner_ring_size: int | None = None,
    lasp_variant: Literal["p2p", "allgather"] = "p2p",
    head_chunks: int = 1,
) -> int:
    """Configure every :class:`~lightning_seqpar.attention.Attention` in ``model`` for ``mesh``, and every
    :class:`~lightning_seqpar.attention.recurrent.Recurrence` (the recurrent mixers of hybrid models,
    Note [Hybrid models under the strategy]: 1-D meshes only).

    ``mesh`` is the sequence-parallel mesh (1-D, or 2-D ("hp", "cp") for "2d"); None or one rank
    gives local attention. Returns how many modules were configured. The keywords are the
    strategy's (Note [One name per option] in ``lightning_seqpar.parallel.config``): ``attention`` is the
    algorithm, ``attention_backend`` the local kernel.

    Raises:
        ValueError: sequence parallelism over a model without ``Attention`` modules, an unknown
            algorithm, or query heads not divisible by the head-parallel degree (checked from the
            model's config, before any communication).
    """
    algorithm = attention
    if algorithm not in (*ALGORITHMS, "lasp"):
        raise ValueError(f"attention={algorithm!r} is not supported; expected one of {(*ALGORITHMS, 'lasp')}")
    heads = attention_heads(model)  # Note [The model registry]
    check_head_chunks(head_chunks, None if heads is None else heads[1], algorithm)
    sp = 1 if mesh is None else mesh.size()
    linear = [m for m in model.modules() if isinstance(m, LinearAttention)]
    if algorithm == "lasp":
        return _apply_lasp(model, linear, mesh if sp > 1 else None, layout=layout, lasp_variant=lasp_variant)
    if linear and sp > 1:
        raise ValueError(
            f"{type(model).__name__} calls LinearAttention, which only runs sequence-parallel with attention='lasp' "
            f"(got attention={algorithm!r}); use attention='lasp' or 'auto'"
        )
    modules = [m for m in model.modules() if isinstance(m, Attention)]
    recurrent = [m for m in model.modules() if isinstance(m, Recurrence)]
    if not modules and not recurrent:
        if sp > 1:
            raise ValueError(
                f"{type(model).__name__} has no lightning_seqpar.attention.Attention module, so sequence "
                f"parallelism over {sp} ranks cannot be installed; compute the attention of every block with "
                "a `lightning_seqpar.attention.Attention` module (calling `sequence_parallel_attention` directly "
                "is not enough: the strategy installs its mesh and algorithm through those modules)"
            )
        return 0
    if recurrent and sp > 1 and mesh.ndim != 1:  # type: ignore[union-attr]
        raise ValueError(
            f"{type(model).__name__} has recurrent token mixers (Note [Hybrid models under the strategy]) whose state "
            f"passes along the sequence-parallel ranks in order; attention={algorithm!r} over a {mesh.ndim}-D mesh "  # type: ignore[union-attr]
            f"{tuple(mesh.mesh_dim_names or ())} splits heads too, which does not apply to them: use "  # type: ignore[union-attr]
            "head_parallel_size=1 with attention='ring', 'allgather' or 'ulysses'"
        )
    if sp > 1 and algorithm in ("ulysses", "2d"):
        degree = sp if algorithm == "ulysses" else mesh.size(mesh.mesh_dim_names.index("hp"))  # type: ignore[union-attr]
        if heads is not None and heads[0] % degree:
            what = "sequence_parallel_size" if algorithm == "ulysses" else "head_parallel_size"
            raise ValueError(
                f"attention={algorithm!r} splits the query heads over {what}={degree} ranks, but "
                f"{type(model).__name__} has {heads[0]} query heads; choose a {what} that divides {heads[0]} "
                "or attention='ring' / 'allgather'"
            )
    agreement = RankAgreement()  # one for the model: its first attention call compares the ranks' inputs
    # "auto" may take cuDNN only where the model says its gradients are exact with it (Note [Choosing the local kernel])
    cudnn_exact = bool(getattr(model, "cudnn_attention_exact", False))
    for module in modules:
        module.configure(
            mesh=mesh if sp > 1 else None,
            algorithm=algorithm,
            layout=layout,
            backend=attention_backend,  # the attention module's own name for it (Note [One name per option])
            inner_ring_size=inner_ring_size,
            head_chunks=head_chunks if sp > 1 else 1,
            agreement=agreement,
            cudnn_exact=cudnn_exact,
        )
    for module in recurrent:  # hybrid models: the recurrent mixers' state chain follows the batch's layout
        module.configure(mesh=mesh if sp > 1 else None, layout=layout)
    return len(modules) + len(recurrent)


def _apply_lasp(model: nn.Module, modules: list[LinearAttention], mesh: DeviceMesh | None, *, layout: str, lasp_variant: str) -> int:
    """attention='lasp': configure every LinearAttention (LASP needs a 1-D mesh and the contiguous layout)."""
    check_lasp_variant(lasp_variant)
    if layout != "contiguous":
        raise ValueError(f"attention='lasp' needs load_balance='contiguous' (LASP Alg. 1), got layout={layout!r}")
    if not modules:
        if mesh is not None:
            raise ValueError(
                f"attention='lasp': {type(model).__name__} has no lightning_seqpar.attention.LinearAttention module, so "
                f"LASP over {mesh.size()} ranks cannot be installed"
            )
        return 0
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(f"attention='lasp' needs head_parallel_size=1 (a 1-D sequence-parallel mesh), got a {mesh.ndim}-D mesh")
    for module in modules:
        module.configure(mesh=mesh, algorithm="lasp", variant=lasp_variant, layout="contiguous")  # type: ignore[arg-type]
    return len(modules)


def apply_ac(
    model: nn.Module,
    mode: ActivationCheckpointing | None,
    *,
    block_classes: Sequence[type[nn.Module]] | None = None,
    save_ops: Sequence[Any] = SAVE_OPS,
    uncheckpointed_blocks: int = 0,
    offload_checkpoints: bool | int = False,
) -> int:
    """Wrap the blocks of ``model`` for activation checkpointing (in place); returns how many were wrapped.

    ``mode``: "selective++" saves the outputs of ``save_ops`` (the attention) and recomputes the
    rest (Note [Selective Checkpoint++]); "full" recomputes whole blocks; None does nothing.
    ``uncheckpointed_blocks``: the last this many blocks are left unwrapped — they keep every
    activation and are not recomputed (spend free memory on speed; torchtitan's per-layer AC idea).
    ``offload_checkpoints``: the checkpointed blocks keep their inputs in pinned host memory (Note
    [Offloading checkpoints to host memory]); an int: only the first that many do (the rest keep them on the
    device: where the host, not the device, binds).
    """
    check_uncheckpointed_blocks(uncheckpointed_blocks)
    check_offload_checkpoints(offload_checkpoints, activation_checkpointing=mode)
    if mode is None:
        return 0
    found = find_blocks(model, block_classes)
    if not found:
        raise ValueError(
            f"activation_checkpointing={mode!r}: found no transformer blocks in {type(model).__name__} "
            f"(an nn.ModuleList named one of {BLOCK_CONTAINERS})"
        )
    wrapped = found[: max(len(found) - uncheckpointed_blocks, 0)]
    host = HostOffload() if offload_checkpoints else None  # one side stream per device for all blocks
    offloaded = len(wrapped) if offload_checkpoints is True else int(offload_checkpoints)  # the first ones (their inputs
    for i, (parent, name) in enumerate(wrapped):                                          # are needed last in backward)
        block = checkpoint_block(getattr(parent, name), mode, save_ops=save_ops, offload=host if i < offloaded else None)
        parent.register_module(name, block)
    return len(wrapped)


def apply_mlp_tiles(model: nn.Module, mlp_chunk_size: int | None, *, block_classes: Sequence[type[nn.Module]] | None = None) -> int:
    """Run each block's MLP (and its normalisation layers) over slices of ``mlp_chunk_size`` tokens, each checkpointed
    (Note [Sequence-tiled MLP], Note [Checkpointed norms]).

    The MLP is the block's child named one of :data:`~lightning_seqpar.parallel.activation_checkpointing.MLP_NAMES`;
    returns how many were tiled. ``mlp_chunk_size=None`` does nothing.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    if mlp_chunk_size is None:
        return 0
    blocks = list(_blocks(model, block_classes))
    if not blocks:
        raise ValueError(f"mlp_chunk_size: found no transformer blocks in {type(model).__name__} "
                         f"(an nn.ModuleList named one of {BLOCK_CONTAINERS})")
    tiled = 0
    for block in blocks:
        name = next((n for n in MLP_NAMES if isinstance(getattr(block, n, None), nn.Module)), None)
        if name is None:
            raise ValueError(
                f"mlp_chunk_size={mlp_chunk_size}: block {type(block).__name__} has no MLP child named one of {MLP_NAMES}; "
                "tile it by hand with lightning_seqpar.parallel.activation_checkpointing.tile_mlp, or leave mlp_chunk_size=None"
            )
        mlp = getattr(block, name)
        if not isinstance(mlp, CheckpointWrapper):  # tiled already (parallelize called again)
            block.register_module(name, tile_mlp(mlp, mlp_chunk_size))
            tiled += 1
        for norm_name, norm in list(block.named_children()):  # Note [Checkpointed norms]: their fp32 backward, one tile at a time
            if is_norm(norm) and not isinstance(norm, CheckpointWrapper):
                block.register_module(norm_name, tile_mlp(norm, mlp_chunk_size))
    return tiled


def apply_compile(
    model: nn.Module,
    compile_kwargs: dict[str, Any] | None = None,
    *,
    block_classes: Sequence[type[nn.Module]] | None = None,
) -> int:
    """``torch.compile`` every block in place (``nn.Module.compile``: parameter names do not change), its checkpoint
    included; a block whose checkpoint offloads to host memory is compiled inside it (Note [Checkpoints under
    torch.compile] in ``lightning_seqpar.parallel.activation_checkpointing``)."""
    blocks = list(_blocks(model, block_classes))
    if not blocks:
        raise ValueError(
            f"compile: found no transformer blocks in {type(model).__name__} (an nn.ModuleList named one of {BLOCK_CONTAINERS})"
        )
    for block in blocks:
        compile_target(block).compile(**(compile_kwargs or {}))
    return len(blocks)


# Note [Offloading parameters to host memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# ``apply_fsdp(offload_params=True)`` gives every ``fully_shard`` call FSDP2's ``CPUOffloadPolicy``:
# ZeRO-Offload's idea (Ren et al., USENIX ATC 2021; LoongTrain §5.2 pairs it with Selective
# Checkpoint++), the model states on the host and the optimizer step on the CPU. The GPU keeps
# the activations and each block's gathered parameters while the block runs; the host the rest:
#
#     host (pinned on CUDA)                       GPU
#     fp32 parameter shard ---- H2D, per block --> shard --all-gather--> block's full parameters
#                                                                          (bf16 with bf16-mixed), freed after use
#     fp32 gradient shard  <--- D2H, per block --- reduce-scattered gradient shard
#     AdamW exp_avg, exp_avg_sq; the optimizer step runs here, on the CPU
#
# * What lives on the host: per rank, its shard of the fp32 parameters (4 bytes per parameter),
#   their gradients (4) and AdamW's two moments (8): 16 bytes per parameter / the ranks FSDP
#   shards over (dp_shard x sp). That is what leaves the GPU: llama-7b (6.7e9 parameters) on 4
#   GPUs 16 x 6.7e9 / 4 = ~27 GB per GPU, on 2 GPUs ~54 GB.
# * What moves each step: before each block's all-gather its shard is copied host -> device (on
#   FSDP's all-gather copy-in stream, so it overlaps the previous block's compute), in forward
#   and again in backward, where the block is gathered again for the recompute and its
#   gradients (4 bytes per parameter / ranks, twice); after each block's reduce-scatter the
#   gradient shard is copied device -> host (4 bytes per parameter / ranks), and FSDP waits for
#   those copies at the end of backward.
# * The optimizer step runs on the CPU over the host shards. ``CausalLMModule`` then asks for
#   torch's fused CPU AdamW (one vectorised pass over parameter, gradient and moments), not the
#   default (for DTensor parameters a per-parameter loop of ~10 passes). ``torchrun`` starts
#   each process with one thread (OMP_NUM_THREADS=1), so the strategy raises torch's thread count
#   for the step itself, to the host's cores / the processes on it (``with_cpu_threads``,
#   ``host_optimizer_threads``), and restores it afterwards. One rank of llama-7b on 4 x H200
#   (1.685e9 parameters, 64-core host): 13.50 s per step (default, 1 thread) -> 2.26 s (fused,
#   1 thread) -> 0.46 s (fused, 16 threads) (``benchmarks/train.py host-adamw``). The optimizer
#   is built after ``fully_shard`` (Lightning calls ``configure_optimizers`` in the strategy's
#   ``setup`` after ``parallelize``), so it sees the CPU shards.
# * The cost: host memory, 16 bytes per parameter / ranks per process (parameters and
#   gradients pinned on CUDA: pinned memory cannot be swapped out); and step time: the CPU
#   optimizer step (memory-bound: AdamW reads 16 and writes 12 bytes per local parameter) and
#   the PCIe copies, 12 bytes per parameter / ranks per step. Worth it where the step is long
#   (the longest contexts), not for short sequences.
# * Gradient clipping (``torch.nn.utils.clip_grad_norm_``) reduces per-rank norms of CPU
#   gradients over the mesh: the process group needs a CPU backend beside NCCL
#   (``SequenceParallelStrategy`` initialises "cpu:gloo,cuda:nccl" with ``offload_params``).


def host_optimizer_threads(local_processes: int) -> int:
    """Threads for one process's CPU optimizer step: this process's cores / the processes sharing them
    (at least the current ``torch.get_num_threads()``, so a larger OMP_NUM_THREADS is kept)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(torch.get_num_threads(), cores // max(1, local_processes))


def use_host_optimizer_threads(optimizers: Iterable[torch.optim.Optimizer], local_processes: int) -> None:
    """Every optimizer's CPU step (``offload_params``) with this process's share of the cores (:func:`host_optimizer_threads`)."""
    threads = host_optimizer_threads(local_processes)
    for optimizer in optimizers:
        with_cpu_threads(optimizer, threads)


def process_group_backend(backend: str | None, *, device_type: str, host_gradients: bool) -> str | None:
    """The default process group's backend: ``backend`` as given, except on CUDA with none given where gradients live
    in host memory (``offload_params``, or a ``memory="auto"`` plan still to come, which may set it): then
    "cpu:gloo,cuda:nccl", for clipping's reduction of the per-rank norms of CPU gradients (Note above)."""
    if host_gradients and backend is None and device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return backend


def with_cpu_threads(optimizer: torch.optim.Optimizer, threads: int) -> None:
    """Run ``optimizer.step`` with ``threads`` intra-op CPU threads (hooks; the count is restored after)."""
    saved: list[int] = []

    def before(*_: object) -> None:
        saved.append(torch.get_num_threads())
        torch.set_num_threads(threads)

    def after(*_: object) -> None:
        torch.set_num_threads(saved.pop())

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    gradient_reduction: GradientReduction = "sum",
    block_classes: Sequence[type[nn.Module]] | None = None,
    offload_params: bool = False,
    gather_whole_model: bool = False,
) -> nn.Module:
    """FSDP2: ``fully_shard`` every block, then ``model`` itself (the root), over ``mesh``.

    ``mesh`` is 1-D (shard) or 2-D (replicate, shard) for HSDP (``lightning_seqpar.parallel.mesh.fsdp_mesh``).
    ``offload_params``: the sharded parameters, their gradients and the optimizer state live in
    host memory, the optimizer step runs on the CPU (Note [Offloading parameters to host memory]).
    ``gather_whole_model``: on a mesh of one rank, ``fully_shard`` the root only (Note [One rank: one gather per step]).

    Note [One rank: one gather per step]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    On one rank FSDP2 shards nothing, yet every ``fully_shard`` group costs Python each step: its
    pre-/post-forward and backward hooks, the copy into its unsharded buffers (in the compute dtype),
    its gradient "reduction" (a copy at world size 1) and its reshard. With ``gather_whole_model`` the
    blocks get no group of their own: the root's one group holds every parameter, gathered once in
    the forward and kept through the backward (``reshard_after_forward=False``, as the root's always
    was), the gradients reduced once at the end::

        per block (default)          root only (gather_whole_model)
        root: gather, keep           root: gather everything, keep
        block i: gather, free  x L   (no per-block hooks)
        block i: gather, reduce x L  root: reduce every gradient at once

    The same training: the same MixedPrecisionPolicy (compute dtype, fp32 reduce), DTensor
    parameters of the same names and placements, the same checkpoints (a run with it resumes one
    without it and the reverse). The cost is memory: every parameter in the compute dtype stays
    gathered through the step (the root's and two blocks' otherwise), and at the end of the backward
    all unsharded gradients meet FSDP2's reduce buffer at once, when the activations are gone
    (``MemoryEstimate.fsdp_buffers`` and ``gradient_reduction``). Measured on the CPU (a tiny
    16-layer Llama, 64 tokens, one process, no checkpointing, fused AdamW): 43.7 ms per step with a
    group per block, 36.6 ms with the root's only, 29 ms without FSDP (plain transformers 29 ms);
    on one GPU, where the short steps of a 1B model are bound by the CPU (issue #43), that is the
    difference the planner (``memory`` None or "auto") buys with it where it fits. Refused on a mesh
    of more than one rank (there each block's gather is what keeps a rank's memory at its shard) and
    with ``offload_params``. LoRA's frozen bf16 base beside its fp32 adapters in one group is what
    every block's group already holds (FSDP2 asks a uniform dtype of the trainable parameters only);
    blocks that share parameters (``_sharing_groups``) are simply in the one group.

    Note [Gradient reduction]
    ~~~~~~~~~~~~~~~~~~~~~~~~~
    The strategy's loss is the sum of local token losses divided by the GLOBAL number of valid
    tokens (``lightning_seqpar.loss.global_mean_loss``), so the exact gradient is the SUM of the
    per-rank gradients over all SP x DP ranks. FSDP2 averages by default; with
    ``gradient_reduction="sum"`` each FSDP module gets ``set_gradient_divide_factor(1.0)`` and
    ``set_force_sum_reduction_for_comms(True)``: a plain SUM reduce-scatter (and all-reduce
    across replicas), no ReduceOp.AVG (pytorch#162338) nor PREMUL_SUM (which gloo lacks).
    Both setters only touch the module they are called on, so they are set on every one.
    ``"mean"`` keeps FSDP2's average (for a loss that is a per-rank mean).
    """
    if gradient_reduction not in ("sum", "mean"):
        raise ValueError(f"gradient_reduction={gradient_reduction!r} is not supported; expected 'sum' or 'mean'")
    if not isinstance(offload_params, bool):
        raise ValueError(f"offload_params must be True or False, got {offload_params!r}")
    if gather_whole_model and (mesh.size() != 1 or offload_params):
        raise ValueError(f"gather_whole_model=True is for an FSDP mesh of one rank without offload_params (Note [One rank: "
                         f"one gather per step]); got a mesh of {mesh.size()} ranks, offload_params={offload_params}")
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned host memory only where there is a GPU to copy to and from (pinning needs CUDA).
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload_params else OffloadPolicy()
    blocks = [] if gather_whole_model else _blocks(model, block_classes)
    for group in _sharing_groups(blocks):  # blocks that share parameters: one FSDP group
        fully_shard(group[0] if len(group) == 1 else group, mesh=mesh, mp_policy=mp_policy,
                    reshard_after_forward=reshard_after_forward, offload_policy=offload_policy)
    # The root keeps its parameters (embedding, final norm, head) gathered after forward: backward
    # needs them at once.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload_policy)
    if gradient_reduction == "sum":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    return model


def parallel_roots(module: nn.Module, *, owner: str) -> list[nn.Module]:
    """The children of a LightningModule that hold transformer blocks (each is parallelized on its own), checked
    before any collective: there is one, every parameter of ``module`` is inside them, none is on the meta device."""
    roots = [child for child in module.children() if find_blocks(child)]
    if not roots and find_blocks(module):  # the blocks are the LightningModule's own children (a user's own model)
        roots = [module]
    if not roots:
        raise ValueError(
            f"{owner}: found no transformer blocks in {type(module).__name__} "
            "(an nn.ModuleList named 'layers', 'h' or 'blocks', or the longest list of same-class modules; name it with "
            "SequenceParallelStrategy(blocks='path.to.list')); build the model in __init__ or configure_model()"
        )
    in_roots = {id(p) for root in roots for p in root.parameters()}
    outside = [n for n, p in module.named_parameters() if id(p) not in in_roots]
    if outside:
        raise ValueError(
            f"{owner}: parameters {outside[:5]} of {type(module).__name__} are outside the "
            "child module(s) with the transformer blocks and would be neither sharded nor synchronized; "
            "move them into the model"
        )
    on_meta = [n for n, p in module.named_parameters() if p.is_meta]
    if on_meta:
        raise ValueError(
            f"{owner}: parameters {on_meta[:5]} are on the meta device; build the model in "
            "configure_model() without a meta-device context (the strategy places it on this rank's device)"
        )
    return roots


def is_parallelized(module: nn.Module) -> bool:
    """Whether ``parallelize`` already ran on ``module`` (a second fit/validate call on the same module)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return any(
        isinstance(m, (FSDPModule, CheckpointWrapper)) or (isinstance(m, (Attention, LinearAttention)) and m.mesh is not None)
        for m in module.modules()
    )


# --------------------------------------------------------------------------------------------- all of it


def parallelize(
    model: nn.Module,
    *,
    sp_mesh: DeviceMesh | None,
    fsdp_mesh: DeviceMesh | None,
    attention: Literal["ring", "allgather", "ulysses", "2d", "lasp"] = "ring",
    layout: Literal["zigzag", "contiguous"] = "zigzag",
    lasp_variant: Literal["p2p", "allgather"] = "p2p",
    inner_ring_size: int | None = None,
    head_chunks: int = 1,
    attention_backend: str = "auto",
    activation_checkpointing: ActivationCheckpointing | None = "selective++",
    uncheckpointed_blocks: int = 0,
    offload_checkpoints: bool | int = False,
    offload_params: bool = False,
    gather_whole_model: bool = False,
    mlp_chunk_size: int | None = None,
    compile_kwargs: dict[str, Any] | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    block_classes: Sequence[type[nn.Module]] | None = None,
) -> nn.Module:
    """Apply attention -> MLP tiles -> AC -> compile -> FSDP to ``model`` (Note [Order of the apply_* calls]).

    ``compile_kwargs=None`` skips compile; ``fsdp_mesh=None`` skips FSDP (one process).
    ``offload_params``: FSDP2 keeps the parameter shards, gradients and optimizer state in host
    memory (Note [Offloading parameters to host memory]); needs ``fsdp_mesh``. ``gather_whole_model``: on an
    ``fsdp_mesh`` of one rank, FSDP2 over the root only (Note [One rank: one gather per step]).
    """
    if offload_params and fsdp_mesh is None:
        raise ValueError("offload_params=True offloads FSDP2's parameter shards; it needs an fsdp_mesh, got None")
    if gather_whole_model and fsdp_mesh is None:
        raise ValueError("gather_whole_model=True gathers FSDP2's root group; it needs an fsdp_mesh, got None")
    check_offload_checkpoints(offload_checkpoints, activation_checkpointing=activation_checkpointing)
    apply_attention(model, sp_mesh, attention=attention, layout=layout, lasp_variant=lasp_variant, inner_ring_size=inner_ring_size,
                    head_chunks=head_chunks, attention_backend=attention_backend)
    apply_mlp_tiles(model, mlp_chunk_size, block_classes=block_classes)
    apply_ac(model, activation_checkpointing, block_classes=block_classes, uncheckpointed_blocks=uncheckpointed_blocks,
             offload_checkpoints=offload_checkpoints)
    if compile_kwargs is not None:
        apply_compile(model, compile_kwargs, block_classes=block_classes)
    if fsdp_mesh is not None:
        apply_fsdp(model, fsdp_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype, block_classes=block_classes,
                   offload_params=offload_params, gather_whole_model=gather_whole_model)
    return model

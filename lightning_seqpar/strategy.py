"""``SequenceParallelStrategy``: sequence-sharded Lightning training with FSDP2.

Note [What the strategy does, and where]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
It is Lightning's ``ModelParallelStrategy`` (process groups, launcher, FSDP2-aware checkpoint
save/load through ``torch.distributed.checkpoint``) with its own mesh, batch hook and
parallelization. This module holds Lightning's hooks; what they call lives by concern in
``lightning_seqpar.config`` (the options, checked once), ``lightning_seqpar.planning`` (attention="auto"
and the checks against the model), ``lightning_seqpar.parallelize`` (the apply_* steps),
``lightning_seqpar.batches`` (batch checks, padding, sharding, gathering) and
``lightning_seqpar.checkpoint_io`` (checkpoint files and random state); docs/architecture.md maps them.

* ``setup_environment``: check the sizes against the world size (before any communication),
  start the process group, build the 4-D mesh (``lightning_seqpar.mesh``) and hand it to the
  LightningModule (``self.device_mesh``).
* ``tensor_init_context``: ``configure_model`` builds the model directly on this rank's device.
* ``setup``: precision, then ``lightning_seqpar.parallelize.parallelize`` on every child module
  of the LightningModule that holds transformer blocks (attention -> AC -> compile -> FSDP2 over
  dp_shard x hp x cp), then the optimizers (over the sharded parameters).
* ``batch_to_device``: the one place where batches are checked, padded and sharded along the
  sequence (Note [Validating batches without hanging] in ``lightning_seqpar.batches``).
* ``distributed_sampler_kwargs``: the data-parallel rank and size only, so all ranks of one
  sequence-parallel group read the same sample.
* ``process_dataloader``: training loaders become ``ResumableLoader`` s, so that checkpoints hold
  the position within the epoch (Note [Exact mid-epoch resume] in ``lightning_seqpar.data.resumable``).
* ``save_checkpoint`` / ``load_checkpoint`` / ``on_train_start``: checkpoints also hold every
  rank's random state, restored just before the first step after a resume; folders of shards
  are written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import weakref
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_seqpar import checkpoint_io
from lightning_seqpar.attention import ALGORITHMS
from lightning_seqpar.attention.cost import AttentionPlan
from lightning_seqpar.batches import check_batch, gather_sequence, shard_batch
from lightning_seqpar.collective_failures import explain_collective_failure
from lightning_seqpar.config import MEMORY_OPTIONS, ActivationCheckpointingChoice, AttentionChoice, StrategyConfig
from lightning_seqpar.cuda_warmup import warm_up_backward_handles
from lightning_seqpar.data.resumable import ResumableLoader
from lightning_seqpar.documents import set_current_documents
from lightning_seqpar.loss import counting_global_mean_calls
from lightning_seqpar.hf.lora import upcast_trainable
from lightning_seqpar.memory import MemoryPlan
from lightning_seqpar.mesh import ParallelDims, dp_rank_and_size, fsdp_mesh, release_mesh_groups, sp_mesh, warn_if_ranks_not_by_node
from lightning_seqpar.parallelize import host_optimizer_threads, is_parallelized, parallel_roots, parallelize, with_cpu_threads
from lightning_seqpar.planning import (RunSite, check_options_against_model, device_memory_bytes, memory_plan_length, plan_memory_options,
                                       plan_mesh_sizes, resolve_auto_attention)
from lightning_seqpar.precision import convert_module_keeping_rotary, scaler_free

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

class SequenceParallelStrategy(ModelParallelStrategy):
    """Train a causal LM on sequences split across ranks: exact distributed attention + FSDP2.

    Each sequence is split over ``sequence_parallel_size`` ranks (sp = hp x cp); the remaining
    ranks are data parallel. Model states are sharded (FSDP2) over dp_shard x sp. The model code
    does not change: every ``lightning_seqpar.attention.Attention`` in it runs the chosen
    algorithm, every ``LinearAttention`` runs LASP. See docs/strategy.md for each argument.

    Args:
        sequence_parallel_size: ranks that share one sequence (sp). ``"auto"``: all devices of a
            node. Must divide the world size (devices x num_nodes).
        head_parallel_size: hp, the head-parallel part of sp (1 = pure context parallel).
            ``attention="2d"`` needs hp > 1 (LoongTrain 2D attention: Ulysses over hp x ring
            over cp = sp / hp). "ring" and "allgather" need hp = 1; "ulysses" splits heads over
            all sp ranks and needs hp = 1. ``"auto"`` (with ``attention="auto"``): chosen with the
            algorithm by the cost model (Note [Choosing attention automatically]).
        attention: "ring" (LightSeq DistAttn), "allgather" (LSS), "ulysses" (head all-to-all),
            "2d" (LoongTrain), "lasp" (linear attention: KV-state passing, LASP; needs hp = 1 and
            the contiguous layout) or "auto": "lasp" when the model's blocks call
            ``LinearAttention``; else, with ``expected_seq_len``, the algorithm the cost model
            (``lightning_seqpar.attention.cost.choose_attention``) estimates fastest for the
            model's heads on the given head_parallel_size; without it "2d" when
            head_parallel_size > 1, else "ring". Decided in setup; ``attention_plan`` keeps the estimate.
        expected_seq_len: the global sequence length of the training batches, for
            ``attention="auto"`` and ``memory="auto"`` (the batches are not known when the model is parallelized).
        load_balance: how the sequence is split: True / "zigzag" (balanced causal work, LightSeq
            §3.2), False / "contiguous", or "auto" (contiguous for LASP, zigzag otherwise).
        lasp_variant: LASP's state exchange: "p2p" (rank to rank, LASP Alg. 2-3) or "allgather"
            (one all-gather of the local states).
        inner_ring_size: LoongTrain's double ring (§4.3) for attention "ring" / "2d": the cp ranks
            form rings of this many consecutive ranks (set it to the GPUs of one node, so that
            only the outer hops cross nodes); must divide the context-parallel size and, on several
            nodes, fit inside one. None: one ring, or with ``attention="auto"`` on several nodes the
            cost model's choice.
        placement: which group of the 2D grid gets the GPUs of one node (LoongTrain §4.4, Note
            [Node-aware placement] in ``lightning_seqpar.mesh``): "context-first" (the cp ring),
            "head-first" (the hp all-to-all) or "auto": the cost model's choice with
            ``attention="auto"`` and ``expected_seq_len``, else "context-first". The node size
            is the devices per node (``Trainer(devices=...)``, torchrun's LOCAL_WORLD_SIZE).
        head_chunks: attention "ring" / "allgather" runs over this many groups of K/V heads one
            after another: the same result with 1/head_chunks of the attention's working memory
            (Note [Head chunks] in ``lightning_seqpar.attention.api``); must divide the K/V heads.
        attention_backend: the local attention kernel: "auto" (flash-attn 4 when installed on
            Hopper / Blackwell, else torch's flash-attention-2; the pure-torch kernel on CPU), "fa4", "cudnn",
            "flash", "efficient" or "math" (Note [Choosing the local kernel]).
        data_parallel_replicate_size: HSDP replicas; the data-parallel ranks inside a replica
            (dp_shard) are what remains: world / (sp x replicas).
        activation_checkpointing: "selective++" (save attention outputs, recompute the rest of
            each block), "full" (recompute whole blocks) or None.
        uncheckpointed_blocks: leave the last this many blocks without checkpointing: they keep
            every activation (more memory) and skip the recompute (faster backward).
        offload_checkpoints: keep the inputs that checkpointed blocks save in pinned host memory
            (copied on a side stream in forward, back in backward): for the longest contexts,
            where the saved inputs are what does not fit (Note [Offloading checkpoints to host
            memory] in ``lightning_seqpar.activation_checkpointing``). Needs activation_checkpointing. An int
            n: only the first n checkpointed blocks offload (the others keep their inputs on the device), for
            where the host's memory, not the device's, binds.
        offload_params: keep the sharded parameters, their gradients and the optimizer state in
            host memory (FSDP2's ``CPUOffloadPolicy``, ZeRO-Offload style): each block's shard is
            copied to the GPU for its all-gather, gradients come back after the reduce-scatter
            and the optimizer step runs on the CPU. Frees 16 bytes per parameter / (dp_shard x sp)
            of GPU memory (llama-7b on 4 GPUs: ~27 GB) for the same in host memory and a slower
            step (Note [Offloading parameters to host memory] in ``lightning_seqpar.parallelize``).
            On CUDA the process group gets a CPU backend too (``process_group_backend=None``
            becomes "cpu:gloo,cuda:nccl"), for the collectives over CPU tensors (gradient clipping).
        bf16_adapters: LoRA under ``precision="bf16-true"``: FSDP2 gathers the fp32 adapters in bf16 for the
            forward and backward (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, what bf16
            autocast does in Hugging Face training); their shards, gradients and AdamW state stay fp32. peft then
            no longer keeps an fp32 copy of every adapted layer's input for the backward (Note [Adapters in bf16]
            in ``lightning_seqpar.lora``): ~4 bytes x (3d + H D + 2d + I) per token and layer less at the block's
            peak. False (the default): the adapters compute in fp32, as peft's own model does.
        mlp_chunk_size: run each block's MLP over slices of this many tokens, each checkpointed:
            the MLP's intermediate activations (3.5x the block width) exist for one slice at a
            time (Note [Sequence-tiled MLP]). None: the MLP runs on the whole local sequence.
        compile: ``torch.compile`` each block: True, or a dict of ``torch.compile`` keyword
            arguments.
        save_distributed_checkpoint: each rank writes its shard (a folder) if True; else the full
            state is gathered to rank 0 and written to one file.
        process_group_backend: torch.distributed backend; None picks "gloo" on CPU, "nccl" on CUDA
            ("cpu:gloo,cuda:nccl" with ``offload_params``).
        timeout: timeout of collective operations (a timedelta, or seconds), for the default
            process group and every group of the device mesh: a rank that stalls makes the others
            fail after this long.
        pad_to_multiple: right-pad batches whose sequence length the layout cannot split
            (labels -100, positions continued, other tensors 0) instead of raising; the loss of
            the real tokens does not change.
        validate_batches: compare every batch across the ranks of each sequence-parallel group
            (one all-gather of 5 integers per rank and batch) and raise, naming the ranks, if they
            differ in shape, dtype or tokens.
        memory: "manual" (the options as given) or "auto": before the process group exists, the
            planner (``lightning_seqpar.memory.plan_memory``) estimates this rank's peak memory for
            ``expected_seq_len``, else the datamodule's ``seq_len``, else (in setup) the first batch's length
            (Note [The length memory="auto" plans for] in ``lightning_seqpar.planning``) and sets offload_checkpoints, head_chunks,
            mlp_chunk_size, offload_params and (LoRA) bf16_adapters, those left at their defaults only, to the set with
            the least slowdown that fits the device's memory; it logs the choice and the estimate
            (``memory_plan`` keeps them), or raises a ``ValueError`` with the longest length that
            would fit. On a CPU device it does not plan (a log line says so). Note [Planning memory].
    """

    strategy_name = "seqpar"

    def __init__(
        self,
        *,
        sequence_parallel_size: int | Literal["auto"] = "auto",
        head_parallel_size: int | Literal["auto"] = 1,
        attention: AttentionChoice = "auto",
        expected_seq_len: int | None = None,
        load_balance: bool | Literal["zigzag", "contiguous", "auto"] = "auto",
        lasp_variant: Literal["p2p", "allgather"] = "p2p",
        inner_ring_size: int | None = None,
        placement: Literal["auto", "context-first", "head-first"] = "auto",
        head_chunks: int = 1,
        attention_backend: str = "auto",
        data_parallel_replicate_size: int = 1,
        activation_checkpointing: ActivationCheckpointingChoice | None = "selective++",
        uncheckpointed_blocks: int = 0,
        offload_checkpoints: bool | int = False,
        offload_params: bool = False,
        bf16_adapters: bool = False,
        mlp_chunk_size: int | None = None,
        compile: bool | dict[str, Any] = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        pad_to_multiple: bool = False,
        validate_batches: bool = True,
        memory: Literal["manual", "auto"] = "manual",
    ) -> None:
        self.config = StrategyConfig(
            sequence_parallel_size=sequence_parallel_size, head_parallel_size=head_parallel_size, attention=attention,
            expected_seq_len=expected_seq_len, load_balance=load_balance, lasp_variant=lasp_variant,
            inner_ring_size=inner_ring_size, placement=placement, head_chunks=head_chunks, attention_backend=attention_backend,
            data_parallel_replicate_size=data_parallel_replicate_size, activation_checkpointing=activation_checkpointing,
            uncheckpointed_blocks=uncheckpointed_blocks, offload_checkpoints=offload_checkpoints, offload_params=offload_params,
            bf16_adapters=bf16_adapters, mlp_chunk_size=mlp_chunk_size, compile=compile, save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend, timeout=timeout, pad_to_multiple=pad_to_multiple,
            validate_batches=validate_batches, memory=memory,
        )
        """The options as given ("auto" included), checked (Note [One name per option] in ``lightning_seqpar.config``)."""
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=self.config.timeout,
        )
        # What setup resolves: "auto" becomes "lasp" when the model's blocks call LinearAttention and the cost
        # model's choice with expected_seq_len (Note [Choosing attention automatically]); until then "2d" with
        # head_parallel_size > 1, else "ring".
        self.attention: str = self.config.initial_attention
        self.layout: str = self.config.layout
        self.inner_ring_size: int | None = self.config.inner_ring_size
        self.attention_plan: AttentionPlan | None = None
        self.memory_plan: MemoryPlan | None = None
        """memory="auto": the planner's choice and estimate (Note [Planning memory])."""
        self._warned_loss = False
        self._parallel_dims: ParallelDims | None = None
        self._sp_mesh: DeviceMesh | None = None
        self._fsdp_mesh: DeviceMesh | None = None
        self._owns_default_group = False  # Note [What a run releases]
        self._meshes_finalizer: weakref.finalize | None = None
        self._failed = False
        self._rng_state_to_restore: dict[str, Any] | None = None
        self._plan_in_setup = False  # memory="auto" with the length known only from the first batch
        self._fp32_adapters = False  # setup: whether the model has fp32 trainable parameters under low precision (LoRA)

    # the options that setup does not resolve, read from the config
    lasp_variant = property(lambda self: self.config.lasp_variant)
    head_chunks = property(lambda self: self.config.head_chunks)
    attention_backend = property(lambda self: self.config.attention_backend)
    activation_checkpointing = property(lambda self: self.config.activation_checkpointing)
    uncheckpointed_blocks = property(lambda self: self.config.uncheckpointed_blocks)
    offload_checkpoints = property(lambda self: self.config.offload_checkpoints)
    offload_params = property(lambda self: self.config.offload_params)
    bf16_adapters = property(lambda self: self.config.bf16_adapters)
    mlp_chunk_size = property(lambda self: self.config.mlp_chunk_size)
    compile_kwargs = property(lambda self: self.config.compile_kwargs)
    timeout = property(lambda self: self.config.timeout)
    pad_to_multiple = property(lambda self: self.config.pad_to_multiple)
    validate_batches = property(lambda self: self.config.validate_batches)

    # ----------------------------------------------------------------------------------------- mesh

    @property
    @override
    def precision_plugin(self) -> Precision:
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Note [Clipping with fused optimizers under bf16-mixed] in lightning_seqpar.precision
        self._precision_plugin = scaler_free(precision_plugin)

    @property
    def parallel_dims(self) -> ParallelDims:
        """Sizes of the mesh axes (dp_replicate, dp_shard, hp, cp); known once processes are set up."""
        if self._parallel_dims is None:
            raise RuntimeError(f"{type(self).__name__}.parallel_dims is only known after setup_environment()")
        return self._parallel_dims

    @property
    def sp_mesh(self) -> DeviceMesh:
        """The sequence-parallel sub-mesh (1-D "cp", or 2-D ("hp", "cp"))."""
        if self._sp_mesh is None:
            raise RuntimeError(f"{type(self).__name__}.sp_mesh is only known after setup_environment()")
        return self._sp_mesh

    def resolve_parallel_dims(self) -> ParallelDims:
        """The mesh sizes for this world (no communication). Raises ValueError naming the argument."""
        world_size = self.num_nodes * self.num_processes
        sp = self.num_processes if self.config.sequence_parallel_size == "auto" else self.config.sequence_parallel_size
        # "auto": the cost model's choice for the LightningModule's config (Note [Choosing attention automatically])
        hp, placement = plan_mesh_sizes(self.lightning_module, config=self.config, site=self._run_site(), world_size=world_size,
                                        sp=sp, layout=self.layout, inner_ring_size=self.inner_ring_size, owner=type(self).__name__)
        return ParallelDims.from_sizes(
            world_size=world_size,
            sequence_parallel_size=sp,
            head_parallel_size=hp,  # type: ignore[arg-type]
            data_parallel_replicate_size=self.config.data_parallel_replicate_size,
            placement=placement,  # type: ignore[arg-type]
            node_size=self.num_processes,
            owner=type(self).__name__,
        )

    @override
    def setup_environment(self) -> None:
        dims = self.resolve_parallel_dims()  # validated before the process group exists
        self._plan_memory(dims)  # memory="auto": may set offload_params, which the process group's backend depends on
        if (self.offload_params or self._plan_in_setup) and self._process_group_backend is None and self.root_device.type == "cuda":
            # Note [Offloading parameters to host memory]: the CPU-resident gradients (clip_grad_norm_'s per-rank norms) are
            # reduced over the mesh's groups, so they need a CPU backend beside NCCL (also for a plan still to come in setup).
            self._process_group_backend = "cpu:gloo,cuda:nccl"
        # free the modules of earlier runs that nothing references any more, and with them their groups,
        # BEFORE this run builds meshes equal to theirs (Note [What a run releases])
        gc.collect()
        _empty_device_caches(self.root_device)  # and the pinned host blocks of earlier runs' offloaded tensors
        created = not (dist.is_available() and dist.is_initialized())
        self._setup_distributed()  # ModelParallelStrategy: ranks, seed, init_process_group
        self._owns_default_group = self._owns_default_group or created
        warn_if_ranks_not_by_node(self.global_rank, self.node_rank, self.local_rank, self.num_processes)
        reuse = self._device_mesh is not None and self._parallel_dims == dims and self.model is not None and is_parallelized(self.model)
        self._parallel_dims = dims
        if not reuse:  # a later run of the same parallelized module keeps its meshes (Note [What a run releases])
            self._device_mesh = dims.build_mesh(self.root_device.type, timeout=self.timeout)
            self._fsdp_mesh, self._meshes_finalizer = None, None
        self._sp_mesh = sp_mesh(self._device_mesh)
        # LightningModule.device_mesh is read-only and ModelParallelStrategy sets it this same way.
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def _plan_memory(self, dims: ParallelDims, trainer: pl.Trainer | None = None) -> None:
        """memory="auto": set the options the planner chooses for this device (``planning.plan_memory_options``): in
        setup_environment for a length known then, else in setup (``trainer``) for the first batch's (Note [The length
        memory="auto" plans for] in ``lightning_seqpar.planning``)."""
        site, owner = self._run_site(), type(self).__name__
        if self.config.memory != "auto" or (trainer is not None and not self._plan_in_setup):
            return
        if (device_memory := self._device_memory_bytes(site.device)) is None:
            rank_zero_info(f"{owner}: memory='auto' plans for CUDA devices; on {site.device.type} the options stay as given")
            return
        length = memory_plan_length(self.config, trainer=trainer or getattr(self.lightning_module, "_trainer", None),
                                    in_setup=trainer is not None, owner=owner)
        self._plan_in_setup = length is None
        if length is not None:
            plan = plan_memory_options(self.lightning_module, config=self.config, length=length, site=site, dims=dims,
                                       device_memory=device_memory, owner=owner)
            assert plan is not None
            self.memory_plan = plan
            self.config = dataclasses.replace(self.config, **{name: getattr(plan.options, name) for name in MEMORY_OPTIONS})
            rank_zero_info(f"{owner}: {plan.describe()} ({length.name})")  # the config above is checked again

    def _device_memory_bytes(self, device: torch.device) -> int | None:
        """The memory memory="auto" plans for: the CUDA device's total (None elsewhere). Tests override it."""
        return device_memory_bytes(device)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        rank, size = dp_rank_and_size(self.device_mesh)
        return {"num_replicas": size, "rank": rank}

    # ----------------------------------------------------------------------------------------- model

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # configure_model() builds the full model on this rank's device; FSDP2 shards it in setup().
        # (empty_init=True gives meta tensors, which setup() rejects: they are never materialized.)
        with torch.device("meta" if empty_init else self.root_device), self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if not is_parallelized(self.model):
            self._plan_memory(self.parallel_dims, trainer)  # memory="auto" without a length known earlier: the first batch's
            self.model = convert_module_keeping_rotary(self.precision_plugin, self.model)  # bf16-true: bf16 parameters (Note [Rotary frequencies under bf16-true])
            self._fp32_adapters = upcast_trainable(self.model) > 0  # LoRA: the adapters back in fp32 (Note [LoRA under the strategy])
            self.model_to_device()  # before FSDP2: with offload_params it then moves the shards to the host
            self._parallelize(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            warm_up_backward_handles(self.root_device)  # Note [Library handles of the backward thread]
            # configure_optimizers sees the sharded parameters (on the host with offload_params). Unlike
            # ModelParallelStrategy.setup, nothing moves the optimizer state to root_device afterwards.
            self.setup_optimizers(trainer)
            if self.offload_params and self.root_device.type == "cuda":
                threads = host_optimizer_threads(self.num_processes)
                for optimizer in self.optimizers:
                    with_cpu_threads(optimizer, threads)  # Note [Offloading parameters to host memory]
        self.setup_precision_plugin()

    def _parallelize(self, module: nn.Module) -> None:
        roots = parallel_roots(module, owner=type(self).__name__)  # checked before any collective
        dims = self.parallel_dims
        # "bf16-true" / "16-true": parameters are already low precision (convert_module), FSDP2 keeps
        # them; "bf16-mixed": fp32 parameters, gathered in bf16 for compute, gradients reduced in fp32.
        param_dtype = reduce_dtype = None
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.precision == "bf16-mixed":
            param_dtype, reduce_dtype = torch.bfloat16, torch.float32
        if self.bf16_adapters:  # Note [Adapters in bf16] in lightning_seqpar.lora
            precision = getattr(self.precision_plugin, "precision", None)
            if precision != "bf16-true" or not getattr(self, "_fp32_adapters", False):
                raise ValueError(f"{type(self).__name__}: bf16_adapters=True gathers fp32 LoRA adapters in bf16; it needs "
                                 f"precision='bf16-true' and a LoRA model (CausalLMModule(lora=...)), got precision={precision!r}"
                                 + ("" if getattr(self, "_fp32_adapters", False) else " and no fp32 trainable parameters"))
            param_dtype, reduce_dtype = torch.bfloat16, torch.float32
        # FSDP2 also on one rank: one code path, and the same checkpoint format at every size.
        mesh_for_fsdp = self._fsdp_mesh = fsdp_mesh(self.device_mesh, timeout=self.timeout)
        # the groups live as long as the module sharded over them (Note [What a run releases])
        self._meshes_finalizer = weakref.finalize(module, _release_groups, [self._device_mesh, mesh_for_fsdp],
                                                  owns_default_group=self._owns_default_group)
        self._resolve_auto_attention(roots)
        self._check_options_against_model(roots)
        for root in roots:
            parallelize(
                root,
                sp_mesh=self.sp_mesh if dims.sp > 1 else None,
                fsdp_mesh=mesh_for_fsdp,
                attention=self.attention,  # type: ignore[arg-type]
                layout=self.layout,  # type: ignore[arg-type]
                lasp_variant=self.lasp_variant,  # type: ignore[arg-type]
                inner_ring_size=self.inner_ring_size,
                head_chunks=self.head_chunks,
                attention_backend=self.attention_backend,
                activation_checkpointing=self.activation_checkpointing,
                uncheckpointed_blocks=self.uncheckpointed_blocks,
                offload_checkpoints=self.offload_checkpoints,
                offload_params=self.offload_params,
                mlp_chunk_size=self.mlp_chunk_size,
                compile_kwargs=self.compile_kwargs,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
            )

    def _resolve_auto_attention(self, roots: list[nn.Module]) -> None:
        """attention="auto": what the planner resolves it to for these roots (Note [Choosing attention automatically])."""
        resolved = resolve_auto_attention(roots, config=self.config, site=self._run_site(), dims=self.parallel_dims,
                                          layout=self.layout, inner_ring_size=self.inner_ring_size, owner=type(self).__name__)
        if resolved is not None:
            self.attention, self.layout, self.inner_ring_size = resolved.attention, resolved.layout, resolved.inner_ring_size
            self.attention_plan = resolved.plan if resolved.plan is not None else self.attention_plan

    def _check_options_against_model(self, roots: list[nn.Module]) -> None:
        """The options that need the model, mesh and device, before any collective (``planning.check_options_against_model``)."""
        check_options_against_model(roots, config=self.config, site=self._run_site(), dims=self.parallel_dims,
                                    attention=self.attention, inner_ring_size=self.inner_ring_size, owner=type(self).__name__)

    def _run_site(self) -> RunSite:
        """This run's device, precision and devices per node, for the planner."""
        device = self.root_device if self.parallel_devices else torch.device("cpu")
        return RunSite(device=device, precision=str(getattr(self.precision_plugin, "precision", "32-true")),
                       gpus_per_node=self.num_processes)

    # ----------------------------------------------------------------------------------------- steps
    # Note [Timeouts name themselves] in lightning_seqpar.collective_failures: the step methods re-raise a
    # collective's timeout or lost connection as an error that says what it means and what to do.

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._explain_timeouts("training_step"), counting_global_mean_calls() as calls:
            out = super().training_step(*args, **kwargs)
        self._check_loss_normalisation(calls.count)
        return out

    def _check_loss_normalisation(self, calls: int) -> None:
        """Warn (once) when a step's loss did not go through ``global_mean_loss`` while gradients are summed
        over several ranks (Note [Loss normalisation under sequence parallelism]): a per-rank mean loss would
        train with ``dp x sp`` times the gradient, silently."""
        dims = self.parallel_dims
        ranks = dims.dp_replicate * dims.dp_shard * dims.sp
        if ranks == 1 or self._warned_loss or calls:
            return
        self._warned_loss = True
        rank_zero_warn(
            f"{type(self).__name__}: the loss of training_step did not come from lightning_seqpar.loss.global_mean_loss. "
            f"Gradients are SUMMED over the {ranks} data- and sequence-parallel ranks, so a per-rank mean loss trains with "
            f"{ranks}x the single-device gradient; return global_mean_loss(loss_sum, n_valid, self.device_mesh) "
            "(CausalLMModule does), or ignore this if your loss is already a share of the global mean."
        )

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._explain_timeouts("validation_step"):
            return super().validation_step(*args, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._explain_timeouts("backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with self._explain_timeouts("the optimizer step"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    @contextmanager
    def _explain_timeouts(self, where: str) -> Generator[None, None, None]:
        try:
            yield
        except RuntimeError as error:  # torch.distributed.DistBackendError is a RuntimeError
            trainer = self.lightning_module._trainer if self.lightning_module is not None else None
            explained = explain_collective_failure(error, owner=type(self).__name__, rank=self.global_rank, where=where,
                                                   timeout=self.timeout, step=trainer.global_step if trainer is not None else 0)
            if explained is None:
                raise
            raise explained from error

    # ----------------------------------------------------------------------------------------- checkpoints
    # Note [Checkpoint formats] and Note [Complete checkpoints only] in lightning_seqpar.checkpoint_io

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        assert self.model is not None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(self.model, optimizer, options=options)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None) -> None:
        # Collective: Trainer.save_checkpoint calls this on every rank.
        with self._explain_timeouts(f"saving the checkpoint {str(filepath)!r}"):
            self._save_checkpoint(checkpoint, filepath, storage_options)

    def _save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None) -> None:
        checkpoint["rng_states"] = checkpoint_io.gather_rng_states(self.root_device)
        # Note [Complete checkpoints only]: written under NAME.partial, moved into place when complete
        path = Path(self.broadcast(str(filepath)))
        partial = checkpoint_io.partial_path(path)
        if self.global_rank == 0:
            checkpoint_io.remove(partial)
        self.barrier("seqpar_save_checkpoint_start")
        if not self._save_distributed_checkpoint:  # one file, written by rank 0 (the full state dicts are gathered first)
            super().save_checkpoint(checkpoint, partial, storage_options=storage_options)
            if self.global_rank == 0:
                checkpoint_io.replace(partial, path)
            self.barrier("seqpar_save_checkpoint_renamed")
            return
        super().save_checkpoint(checkpoint, partial, storage_options=storage_options)
        self.barrier("seqpar_save_checkpoint_written")
        if self.global_rank == 0:
            checkpoint_io.replace(partial, path)
        self.barrier("seqpar_save_checkpoint_renamed")

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        checkpoint_io.check_loadable(path, owner=type(self).__name__)  # Note [Complete checkpoints only]
        if path.is_dir():  # a folder of shards
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)
        else:
            assert self.model is not None and self.lightning_module is not None
            checkpoint = checkpoint_io.load_full_checkpoint(
                path, self.model, self.optimizers, strict=self.lightning_module.strict_loading,
                fitting=self.lightning_module.trainer.state.fn == TrainerFn.FITTING, weights_only=weights_only)
        # this rank's random state, restored in on_train_start when fitting
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        self._rng_state_to_restore = checkpoint_io.rng_state_of_rank(checkpoint.pop("rng_states", None), self.global_rank) if fitting else None
        return checkpoint

    @override
    def on_train_start(self) -> None:
        # After Lightning created the data iterators (which draw from the global generator, as
        # they did at the start of the epoch in the run that saved) and before the first step.
        super().on_train_start()
        if self._rng_state_to_restore is not None:
            checkpoint_io.set_rng_state(self._rng_state_to_restore, self.root_device)
            self._rng_state_to_restore = None

    # ----------------------------------------------------------------------------------------- data

    @override
    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or isinstance(dataloader, ResumableLoader):
            return dataloader
        return ResumableLoader(dataloader)  # type: ignore[arg-type]

    # ----------------------------------------------------------------------------------------- batches

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.shard_batch(batch)

    def shard_batch(self, batch: Any) -> Any:
        """This rank's piece of a dict batch of full sequences: checked, padded with ``pad_to_multiple``,
        compared across the sequence-parallel group with ``validate_batches``, split along the sequence
        with the strategy's layout (or per document, the documents made current for attention).
        See :func:`lightning_seqpar.batches.shard_batch`."""
        check_batch(batch, owner=type(self).__name__)  # local: before anything else, even before the mesh exists
        dims = self.parallel_dims
        return shard_batch(batch, sp=dims.sp, sp_mesh=self.sp_mesh if dims.sp > 1 else None, device_mesh=self.device_mesh,
                           layout=self.layout, attention=self.attention, pad_to_multiple=self.pad_to_multiple,
                           validate_batches=self.validate_batches, owner=type(self).__name__, checked=True)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The full sequences, on every rank, from this rank's piece of a per-token tensor of the current
        batch: the inverse of :meth:`shard_batch` along dim 1 (:func:`lightning_seqpar.batches.gather_sequence`)."""
        return gather_sequence(x, sp_mesh=self.sp_mesh if self.parallel_dims.sp > 1 else None, layout=self.layout)

    # Note [What a run releases]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The process groups of a run's meshes (Note [Releasing the groups of a mesh] in
    # ``lightning_seqpar.mesh``: five per run at any world size, each with its own threads on gloo,
    # a communicator, proxy thread and GPU memory on NCCL) are what the parallelized module runs
    # on: FSDP2 gathers over them, and so does ``get_model_state_dict(full_state_dict=True)`` or a
    # ``trainer.validate`` after ``fit``. So they live exactly as long as that module:
    #
    # * ``weakref.finalize`` on the module destroys them when the module is freed, and with them
    #   the default process group if this strategy created it (``init_process_group`` ran in the
    #   run, not before it) and no other groups are left (another run may be using it);
    # * ``teardown`` (the end of every run) runs Python's cycle collector: a finished run's module
    #   sits in reference cycles (Trainer <-> LightningModule) that Python frees at no set time, so
    #   the module of an earlier run that the program dropped is freed, and its groups released,
    #   by the next run's end at the latest (``gc.collect()``, ~0.1 s); what remains are the groups
    #   of modules the program still holds;
    # * a later run of the same strategy on the same (already parallelized) module reuses the
    #   meshes: no new groups;
    # * a run that failed (set-up or a step: Lightning calls ``on_exception`` and then
    #   ``teardown``) releases its groups and the default group it created at once: after a
    #   failure they may be unusable (a dead peer), and the module is not trained further;
    # * every run also drops the packed documents of its last batch (device tensors) and, on
    #   CUDA, empties the pinned host memory cache (``offload_checkpoints`` / ``offload_params``)
    #   and the device memory cache.
    #
    # ``tests/test_resources.py`` counts threads, file descriptors, RSS and CUDA memory over ten
    # fits in one process.

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        set_current_documents(None)
        try:
            super().teardown()
        finally:
            self._release()

    def _release(self) -> None:
        """What a run releases at its end (Note [What a run releases]); local, no collective."""
        failed, self._failed = self._failed, False
        if failed or (self._meshes_finalizer is None and self._device_mesh is not None):  # failed, or set-up stopped early
            finalizer, meshes = self._meshes_finalizer, [self._fsdp_mesh, self._device_mesh]
            self._device_mesh = self._sp_mesh = self._fsdp_mesh = None
            self._meshes_finalizer = None
            module = self.lightning_module
            if module is not None and getattr(module, "_device_mesh", None) is not None:
                module._device_mesh = None
            if finalizer is not None:
                finalizer()  # runs _release_groups once
            else:
                _release_groups(meshes, owns_default_group=self._owns_default_group)
            if self._owns_default_group and not _launched_by_torchelastic() and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            self._owns_default_group = False
        gc.collect()  # frees the modules of earlier runs that nothing references any more (and so their groups)
        _empty_device_caches(self.root_device)

    # ----------------------------------------------------------------------------------------- registry

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: dict) -> None:
        strategy_registry.register("seqpar", cls, description="Sequence parallelism, attention chosen automatically")
        for algorithm in (*ALGORITHMS, "lasp"):
            kwargs: dict[str, Any] = {"attention": algorithm}
            if algorithm == "2d":
                kwargs["head_parallel_size"] = 2
            strategy_registry.register(
                f"seqpar_{algorithm}", cls, description=f"Sequence parallelism with {algorithm!r} attention", **kwargs
            )

    def __repr__(self) -> str:
        dims = f", dims={self._parallel_dims}" if self._parallel_dims is not None else ""
        return (
            f"{type(self).__name__}(attention={self.attention!r}, layout={self.layout!r}, "
            f"activation_checkpointing={self.activation_checkpointing!r}, compile={self.compile_kwargs is not None}{dims})"
        )


def _empty_device_caches(device: torch.device) -> None:
    """Give the CUDA caching allocator's free blocks, and the caching host allocator's pinned ones, back."""
    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        if hasattr(torch._C, "_host_emptyCache"):  # pinned host memory (torch has no public API for it)
            torch._C._host_emptyCache()


def _release_groups(meshes: list[DeviceMesh | None], *, owns_default_group: bool) -> None:
    """The groups of a run's meshes, and the default group when the run created it and nothing else uses
    groups any more (Note [What a run releases]). No reference to the module: a ``weakref.finalize`` callback."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    release_mesh_groups(*meshes)
    registry = getattr(dist.distributed_c10d, "_world", None)  # torch's group registry (private; no public list)
    if owns_default_group and not _launched_by_torchelastic() and registry is not None and len(registry.pg_map) == 1:
        dist.destroy_process_group()


def _launched_by_torchelastic() -> bool:
    """Under torchrun the default group rendezvouses through the agent's store, whose keys a second
    init_process_group in the same process would collide with: the default group then stays for the
    process's lifetime (the mesh groups are still released)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


SequenceParallelStrategy.register_strategies(StrategyRegistry)

"""``SequenceParallelStrategy``: sequence-sharded Lightning training with FSDP2.

Note [What the strategy does, and where]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
It is Lightning's ``ModelParallelStrategy`` (process groups, launcher, FSDP2-aware checkpoint
save/load through ``torch.distributed.checkpoint``) with its own mesh, batch hook and
parallelization. This module holds Lightning's hooks, in the order a run calls them ("The order of
the steps the strategy runs" in docs/architecture.md), each saying what it adds to Lightning's;
what they call lives by concern below it: the strategy's internals in ``parallel/`` (``config``, ``mesh``,
``parallelize``, ``precision``, ``checkpoint_io``, ``collective_failures``, ``resources``), the planner's
answers in ``planner/`` (``planning.RunPlanning``: the mesh sizes, ``memory`` and ``attention="auto"``), the
batches in ``sharding/`` (``batches``) and a loss of the user's own in ``loss/`` (the module table of
docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_seqpar.attention import ALGORITHMS
from lightning_seqpar.attention.cost import AttentionPlan
from lightning_seqpar.data.resumable import ResumableLoader
from lightning_seqpar.hf.lora import upcast_trainable
from lightning_seqpar.loss.cross_entropy import OwnLossWarnings, counting_global_mean_calls, token_shares
from lightning_seqpar.models.registry import attention_heads
from lightning_seqpar.parallel import checkpoint_io
from lightning_seqpar.parallel.collective_failures import explaining_collective_failures
from lightning_seqpar.parallel.config import OPTIONS_DOC, ActivationCheckpointingChoice, AttentionChoice, ConfigOptions, StrategyConfig
from lightning_seqpar.parallel.cuda_warmup import warm_up_backward_handles
from lightning_seqpar.parallel.mesh import ParallelDims, dp_rank_and_size, fsdp_mesh, sp_mesh, warn_if_ranks_not_by_node
from lightning_seqpar.parallel.parallelize import (apply_attention, find_blocks, is_parallelized, parallel_roots, parallelize,
                                                   process_group_backend, use_host_optimizer_threads)
from lightning_seqpar.parallel.precision import convert_module_keeping_rotary, evaluate_without_inference_mode, fsdp_dtypes, scaler_free
from lightning_seqpar.parallel.resources import RunGroups, free_unreferenced, prefer_expandable_segments, prefer_parallel_pinning
from lightning_seqpar.planner.memory import MemoryPlan
from lightning_seqpar.planner.planning import RunPlanning
from lightning_seqpar.routing.blocks import find_block_container
from lightning_seqpar.routing.guard import OutsideAttentionGuard
from lightning_seqpar.routing.check import broadcast_initial_weights, check_split_matches_whole
from lightning_seqpar.routing.sdpa import own_model_routing, routed_step, routing_of
from lightning_seqpar.sharding.batches import check_batch, gather_sequence, shard_batch
from lightning_seqpar.sharding.documents import set_current_documents

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

class SequenceParallelStrategy(ConfigOptions, RunPlanning, ModelParallelStrategy):
    __doc__ = """Train a causal LM on sequences split across ranks: exact distributed attention + FSDP2.

    Each sequence is split over ``sequence_parallel_size`` ranks (sp = hp x cp); the remaining
    ranks are data parallel. Model states are sharded (FSDP2) over dp_shard x sp. The model code
    does not change: every ``lightning_seqpar.attention.Attention`` in it runs the chosen
    algorithm, every ``LinearAttention`` runs LASP. See docs/strategy.md for each argument.

""" + OPTIONS_DOC  # the Args: lightning_seqpar.parallel.config.OPTIONS_DOC (seqpar fit --help shows them)

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
        gather_whole_model: bool = False,
        mlp_chunk_size: int | None = None,
        compile: bool | dict[str, Any] | Literal["auto"] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        pad_to_multiple: bool = False,
        validate_batches: bool = True,
        memory: Literal["manual", "auto"] | None = None,
        check_model: bool = True,
        blocks: str | None = None,
    ) -> None:
        self.config = StrategyConfig(
            sequence_parallel_size=sequence_parallel_size, head_parallel_size=head_parallel_size, attention=attention,
            expected_seq_len=expected_seq_len, load_balance=load_balance, lasp_variant=lasp_variant,
            inner_ring_size=inner_ring_size, placement=placement, head_chunks=head_chunks, attention_backend=attention_backend,
            data_parallel_replicate_size=data_parallel_replicate_size, activation_checkpointing=activation_checkpointing,
            uncheckpointed_blocks=uncheckpointed_blocks, offload_checkpoints=offload_checkpoints, offload_params=offload_params,
            bf16_adapters=bf16_adapters, gather_whole_model=gather_whole_model, mlp_chunk_size=mlp_chunk_size, compile=compile, save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend, timeout=timeout, pad_to_multiple=pad_to_multiple,
            validate_batches=validate_batches, memory=memory, check_model=check_model, blocks=blocks,
        )
        """The options as given ("auto" included), checked (Note [One name per option] in ``lightning_seqpar.parallel.config``)."""
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint, process_group_backend=process_group_backend,
                         timeout=self.config.timeout)
        # What setup resolves (Note [Choosing attention automatically]); until then "2d" with head_parallel_size > 1, else "ring".
        self.attention: str = self.config.initial_attention
        self.layout: str = self.config.layout
        self.inner_ring_size: int | None = self.config.inner_ring_size
        self.attention_plan: AttentionPlan | None = None
        self.memory_plan: MemoryPlan | None = None
        """memory="auto" (or None, where it planned): the planner's choice and estimate (Note [Planning memory])."""
        self._own_loss = OwnLossWarnings()  # Note [A loss of the user's own]
        self._token_shares: Any = None
        self._routings: list[Any] = []
        self._parallel_dims: ParallelDims | None = None
        self._sp_mesh: DeviceMesh | None = None
        self._fsdp_mesh: DeviceMesh | None = None
        self._groups = RunGroups()  # Note [What a run releases]
        self._rng_state_to_restore: dict[str, Any] | None = None
        self._plan_in_setup = False  # memory planned with the length known only from the first batch
        self._fp32_adapters = False  # setup: whether the model has fp32 trainable parameters under low precision (LoRA)

    # ----------------------------------------------------------------------------------------- mesh

    @property
    @override
    def precision_plugin(self) -> Precision:
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        # Note [Clipping with fused optimizers under bf16-mixed] in lightning_seqpar.parallel.precision
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

    @override
    def setup_environment(self) -> None:
        dims = self.resolve_parallel_dims()  # validated before the process group exists
        self._plan_memory(dims)  # the planner may set offload_params, which the process group's backend depends on
        # Note [Offloading parameters to host memory]: CPU-resident gradients need a CPU backend beside NCCL (memory=None
        # adds none for a plan still to come: its plan in setup takes offload_params only where the backend serves the CPU)
        self._process_group_backend = process_group_backend(
            self._process_group_backend, device_type=self.root_device.type,
            host_gradients=self.offload_params or (self._plan_in_setup and self.config.memory == "auto"))
        # free the modules of earlier runs that nothing references any more, and with them their groups, BEFORE this
        # run builds meshes equal to theirs, and the pinned host blocks of their offloaded tensors (Note [What a run releases])
        free_unreferenced(self.root_device)
        prefer_expandable_segments(self.root_device)  # before the model is built (Note [Expandable segments by default])
        with self._groups.starting():
            self._setup_distributed()  # ModelParallelStrategy: ranks, seed, init_process_group
        warn_if_ranks_not_by_node(self.global_rank, self.node_rank, self.local_rank, self.num_processes)
        reuse = self._device_mesh is not None and self._parallel_dims == dims and self.model is not None and is_parallelized(self.model)
        self._parallel_dims = dims
        if not reuse:  # a later run of the same parallelized module keeps its meshes (Note [What a run releases])
            self._device_mesh = dims.build_mesh(self.root_device.type, timeout=self.timeout)
            self._fsdp_mesh, self._groups.finalizer = None, None
        self._sp_mesh = sp_mesh(self._device_mesh)
        # LightningModule.device_mesh is read-only and ModelParallelStrategy sets it this same way.
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # the data-parallel rank and size only: all ranks of one sequence-parallel group read the same sample
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
        # precision, parallelize every child holding blocks (attention -> AC -> compile -> FSDP2), then the optimizers
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        evaluate_without_inference_mode(trainer)  # Note [Evaluation without inference mode] in lightning_seqpar.parallel.precision
        if not is_parallelized(self.model):
            self._plan_memory(self.parallel_dims, trainer)  # memory="auto" without a length known earlier: the first batch's
            self.model = convert_module_keeping_rotary(self.precision_plugin, self.model)  # bf16-true: bf16 parameters (Note [Rotary frequencies under bf16-true])
            self._fp32_adapters = upcast_trainable(self.model) > 0  # LoRA: the adapters back in fp32 (Note [LoRA under the strategy])
            self.model_to_device()  # before FSDP2: with offload_params it then moves the shards to the host
            if self.offload_checkpoints or self.offload_params:  # Note [Pinning host memory in parallel]
                prefer_parallel_pinning(self.root_device)
            self._parallelize(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            warm_up_backward_handles(self.root_device)  # Note [Library handles of the backward thread]
            # configure_optimizers sees the sharded parameters (on the host with offload_params). Unlike
            # ModelParallelStrategy.setup, nothing moves the optimizer state to root_device afterwards.
            self.setup_optimizers(trainer)
            if self.offload_params and self.root_device.type == "cuda":  # Note [Offloading parameters to host memory]
                use_host_optimizer_threads(self.optimizers, self.num_processes)
        self.setup_precision_plugin()

    def _parallelize(self, module: nn.Module) -> None:
        owner = type(self).__name__
        find_block_container(module, blocks=self.config.blocks, owner=owner)  # Note [Finding the blocks of a user's model]
        roots = parallel_roots(module, owner=owner)  # checked before any collective
        heads = attention_heads(module)  # the model's config, where the registry reads it (K/V repeated before SDPA)
        self._routings = [r for r in (own_model_routing(root, find_blocks(root), owner=owner, heads=heads) for root in roots) if r is not None]
        dims = self.parallel_dims
        param_dtype, reduce_dtype = fsdp_dtypes(self.precision_plugin, bf16_adapters=self.bf16_adapters,
                                                fp32_adapters=getattr(self, "_fp32_adapters", False), owner=type(self).__name__)
        # FSDP2 also on one rank: one code path, and the same checkpoint format at every size.
        mesh_for_fsdp = self._fsdp_mesh = fsdp_mesh(self.device_mesh, timeout=self.timeout)
        self._groups.tie(module, [self._device_mesh, mesh_for_fsdp])  # released with the module (Note [What a run releases])
        self._resolve_auto_attention([*roots, module] if module not in roots else roots)  # heads: the roots', else the module's config
        self._check_options_against_model(roots)
        self._resolve_compile(roots)  # compile="auto" (Note [Compile by default])
        for root in roots:
            routing = routing_of(root)
            if routing is not None:  # a model of the user's own: one set of initial weights (as DDP), then the check
                broadcast_initial_weights(root, owner=owner)
            if routing is not None and self.check_model and dims.sp > 1:  # Note [Split against whole at setup]
                apply_attention(root, self.sp_mesh, attention=self.attention, layout=self.layout, inner_ring_size=self.inner_ring_size,  # type: ignore[arg-type]
                                head_chunks=self.head_chunks, attention_backend=self.attention_backend)
                check_split_matches_whole(routing, blocks=[getattr(p, n) for p, n in find_blocks(root)], owner=owner)
            parallelize(  # every option under its own name (Note [One name per option] in lightning_seqpar.parallel.config)
                root, sp_mesh=self.sp_mesh if dims.sp > 1 else None, fsdp_mesh=mesh_for_fsdp,
                attention=self.attention, layout=self.layout, lasp_variant=self.lasp_variant,  # type: ignore[arg-type]
                inner_ring_size=self.inner_ring_size, head_chunks=self.head_chunks, attention_backend=self.attention_backend,
                activation_checkpointing=self.activation_checkpointing, uncheckpointed_blocks=self.uncheckpointed_blocks,
                offload_checkpoints=self.offload_checkpoints, offload_params=self.offload_params, mlp_chunk_size=self.mlp_chunk_size,
                gather_whole_model=self.gather_whole_model, compile_kwargs=self.compile_kwargs, param_dtype=param_dtype,
                reduce_dtype=reduce_dtype)
        # Note [SDPA outside the package's attention] in lightning_seqpar.routing.guard: their first step watched
        self._guard = OutsideAttentionGuard([r for r in roots if routing_of(r) is None], sp=dims.sp, owner=owner) \
            if self.compile_kwargs is None else None

    # ----------------------------------------------------------------------------------------- steps
    # Note [Timeouts name themselves] in lightning_seqpar.parallel.collective_failures: the step methods re-raise a
    # collective's timeout or lost connection as an error that says what it means and what to do.

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._explain_timeouts("training_step"), counting_global_mean_calls() as calls, self._routed(args):
            self._step_calls = calls  # read by backward, also by a manual_backward inside the step
            out = super().training_step(*args, **kwargs)
        self._own_loss.check(calls.count, ranks=self.parallel_dims.world_size, shares=self._token_shares, owner=type(self).__name__)
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._explain_timeouts("validation_step"), self._routed(args):
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._routed(args):
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._routed(args):
            return super().predict_step(*args, **kwargs)

    def _routed(self, args: tuple) -> contextlib.AbstractContextManager[None]:
        """A step of a model with its own SDPA calls (Note [Routing a model's own SDPA calls] in lightning_seqpar.routing.sdpa)."""
        return routed_step(self._routings, args[0] if args else None, getattr(self, "_guard", None))

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> torch.Tensor:
        calls, ranks = getattr(self, "_step_calls", None), self.parallel_dims.world_size
        if calls is not None and not calls.count and ranks > 1:  # Note [A loss of the user's own] in lightning_seqpar.loss.cross_entropy
            closure_loss = closure_loss / ranks
        with self._explain_timeouts("backward"):
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with self._explain_timeouts("the optimizer step"):
            return super().optimizer_step(optimizer, closure, model, **kwargs)

    def _explain_timeouts(self, where: str) -> contextlib.AbstractContextManager[None]:
        return explaining_collective_failures(owner=type(self).__name__, rank=self.global_rank, where=where, timeout=self.timeout,
                                              step=lambda: getattr(getattr(self.lightning_module, "_trainer", None), "global_step", 0))

    # ----------------------------------------------------------------------------------------- checkpoints
    # Note [Checkpoint formats] and Note [Complete checkpoints only] in lightning_seqpar.parallel.checkpoint_io

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        assert self.model is not None
        return checkpoint_io.full_optimizer_state(self.model, optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None) -> None:
        # Collective: Trainer.save_checkpoint calls this on every rank.
        with self._explain_timeouts(f"saving the checkpoint {str(filepath)!r}"):
            checkpoint["rng_states"] = checkpoint_io.gather_rng_states(self.root_device)
            # Note [Complete checkpoints only]: written under NAME.partial, moved into place when complete; one file is
            # written by rank 0 (the full state dicts are gathered first), a folder by every rank
            write = functools.partial(super().save_checkpoint, checkpoint, storage_options=storage_options)  # write(path)
            checkpoint_io.write_complete(Path(self.broadcast(str(filepath))), write, barrier=self.barrier,
                                         rank_zero=self.global_rank == 0, every_rank_writes=self._save_distributed_checkpoint)

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
        # training loaders become ResumableLoaders, so that checkpoints hold the position within the epoch
        # (Note [Exact mid-epoch resume] in lightning_seqpar.data.resumable)
        dataloader = super().process_dataloader(dataloader)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.stage != RunningStage.TRAINING or isinstance(dataloader, ResumableLoader):
            return dataloader
        return ResumableLoader(dataloader)  # type: ignore[arg-type]

    # ----------------------------------------------------------------------------------------- batches

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # the one place where batches are checked, padded and sharded along the sequence
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.shard_batch(batch)

    def shard_batch(self, batch: Any) -> Any:
        """This rank's piece of a dict batch of full sequences: checked, padded with ``pad_to_multiple``,
        compared across the sequence-parallel group with ``validate_batches``, split along the sequence
        with the strategy's layout (or per document, the documents made current for attention).
        See :func:`lightning_seqpar.sharding.batches.shard_batch`."""
        check_batch(batch, owner=type(self).__name__)  # local: before anything else, even before the mesh exists
        dims = self.parallel_dims
        local = shard_batch(batch, sp=dims.sp, sp_mesh=self.sp_mesh if dims.sp > 1 else None, device_mesh=self.device_mesh,
                            layout=self.layout, attention=self.attention, pad_to_multiple=self.pad_to_multiple,
                            validate_batches=self.validate_batches, owner=type(self).__name__, checked=True)
        self._token_shares = token_shares(batch, local, sp=dims.sp)  # for a loss of the user's own (no sync here)
        return local

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The full sequences, on every rank, from this rank's piece of a per-token tensor of the current
        batch: the inverse of :meth:`shard_batch` along dim 1 (:func:`lightning_seqpar.sharding.batches.gather_sequence`)."""
        return gather_sequence(x, sp_mesh=self.sp_mesh if self.parallel_dims.sp > 1 else None, layout=self.layout)

    # What a run releases, and when: Note [What a run releases] in lightning_seqpar.parallel.resources

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._groups.failed = True
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        set_current_documents(None)
        try:
            super().teardown()
        finally:  # what a run releases at its end (Note [What a run releases] in lightning_seqpar.parallel.resources); local, no collective
            if self._groups.release_at_end([self._fsdp_mesh, self._device_mesh], built=self._device_mesh is not None):
                self._device_mesh = self._sp_mesh = self._fsdp_mesh = None  # failed, or set-up stopped early
                module = self.lightning_module
                if module is not None and getattr(module, "_device_mesh", None) is not None:
                    module._device_mesh = None
            free_unreferenced(self.root_device)  # the modules of earlier runs that nothing references any more (and their groups)

    # ----------------------------------------------------------------------------------------- registry

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: dict) -> None:
        strategy_registry.register("seqpar", cls, description="Sequence parallelism, attention chosen automatically")
        for algorithm in (*ALGORITHMS, "lasp"):
            kwargs: dict[str, Any] = {"attention": algorithm}
            if algorithm == "2d":
                kwargs["head_parallel_size"] = 2
            strategy_registry.register(f"seqpar_{algorithm}", cls, description=f"Sequence parallelism with {algorithm!r} attention", **kwargs)

    def __repr__(self) -> str:
        dims = f", dims={self._parallel_dims}" if self._parallel_dims is not None else ""
        return (f"{type(self).__name__}(attention={self.attention!r}, layout={self.layout!r}, "
                f"activation_checkpointing={self.activation_checkpointing!r}, compile={self.compile_kwargs is not None}{dims})")


SequenceParallelStrategy.register_strategies(StrategyRegistry)

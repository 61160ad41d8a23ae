"""``SequenceParallelStrategy``: sequence-sharded Lightning training with FSDP2.

Note [What the strategy does, and where]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
It is Lightning's ``ModelParallelStrategy`` (process groups, launcher, FSDP2-aware checkpoint
save/load through ``torch.distributed.checkpoint``) with its own mesh, batch hook and
parallelization:

* ``setup_environment``: check the sizes against the world size (before any communication),
  start the process group, build the 4-D mesh (``lightning_seqpar.mesh``) and hand it to the
  LightningModule (``self.device_mesh``).
* ``tensor_init_context``: ``configure_model`` builds the model directly on this rank's device.
* ``setup``: precision, then ``lightning_seqpar.parallelize.parallelize`` on every child module
  of the LightningModule that holds transformer blocks (attention -> AC -> compile -> FSDP2 over
  dp_shard x hp x cp), then the optimizers (over the sharded parameters).
* ``batch_to_device``: the one place where batches are sharded along the sequence.
* ``distributed_sampler_kwargs``: the data-parallel rank and size only, so all ranks of one
  sequence-parallel group read the same sample.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_seqpar.attention import ALGORITHMS
from lightning_seqpar.checkpointing import AC_MODES
from lightning_seqpar.mesh import ParallelDims, dp_rank_and_size, fsdp_mesh, sp_mesh
from lightning_seqpar.parallelize import find_blocks, parallelize
from lightning_seqpar.sharding import LAYOUTS, required_multiple, shard_sequence

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

AttentionChoice = Literal["ring", "allgather", "ulysses", "2d", "auto"]
ActivationCheckpointingChoice = Literal["selective++", "full"]


class SequenceParallelStrategy(ModelParallelStrategy):
    """Train a causal LM on sequences split across ranks: exact distributed attention + FSDP2.

    Each sequence is split over ``sequence_parallel_size`` ranks (sp = hp x cp); the remaining
    ranks are data parallel. Model states are sharded (FSDP2) over dp_shard x sp. The model code
    does not change: every ``lightning_seqpar.attention.Attention`` in it runs the chosen
    algorithm. See docs/strategy.md for each argument.

    Args:
        sequence_parallel_size: ranks that share one sequence (sp). ``"auto"``: all devices of a
            node. Must divide the world size (devices x num_nodes).
        head_parallel_size: hp, the head-parallel part of sp (1 = pure context parallel).
            ``attention="2d"`` needs hp > 1 (LoongTrain 2D attention: Ulysses over hp x ring
            over cp = sp / hp). "ring" and "allgather" need hp = 1; "ulysses" splits heads over
            all sp ranks and needs hp = 1.
        attention: "ring" (LightSeq DistAttn), "allgather" (LSS), "ulysses" (head all-to-all),
            "2d" (LoongTrain) or "auto" ("2d" when head_parallel_size > 1, else "ring").
        load_balance: how the sequence is split: True / "zigzag" (balanced causal work, LightSeq
            §3.2), False / "contiguous".
        data_parallel_replicate_size: HSDP replicas; the data-parallel ranks inside a replica
            (dp_shard) are what remains: world / (sp x replicas).
        activation_checkpointing: "selective++" (save attention outputs, recompute the rest of
            each block), "full" (recompute whole blocks) or None.
        compile: ``torch.compile`` each block: True, or a dict of ``torch.compile`` keyword
            arguments.
        save_distributed_checkpoint: each rank writes its shard (a folder) if True; else the full
            state is gathered to rank 0 and written to one file.
        process_group_backend: torch.distributed backend; None picks "gloo" on CPU, "nccl" on CUDA.
        timeout: timeout of collective operations (a timedelta, or seconds).
    """

    strategy_name = "seqpar"

    def __init__(
        self,
        *,
        sequence_parallel_size: int | Literal["auto"] = "auto",
        head_parallel_size: int = 1,
        attention: AttentionChoice = "auto",
        load_balance: bool | Literal["zigzag", "contiguous"] = True,
        data_parallel_replicate_size: int = 1,
        activation_checkpointing: ActivationCheckpointingChoice | None = "selective++",
        compile: bool | dict[str, Any] = False,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
    ) -> None:
        name = type(self).__name__
        if not (sequence_parallel_size == "auto" or _positive_int(sequence_parallel_size)):
            raise ValueError(f"{name}: sequence_parallel_size must be a positive int or 'auto', got {sequence_parallel_size!r}")
        for arg, value in (("head_parallel_size", head_parallel_size), ("data_parallel_replicate_size", data_parallel_replicate_size)):
            if not _positive_int(value):
                raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")
        if attention not in (*ALGORITHMS, "auto"):
            raise ValueError(f"{name}: attention={attention!r} is not supported; expected one of {(*ALGORITHMS, 'auto')}")
        if attention == "auto":
            attention = "2d" if head_parallel_size > 1 else "ring"
        if attention == "2d" and head_parallel_size == 1:
            raise ValueError(
                f"{name}: attention='2d' needs head_parallel_size > 1 (Ulysses over hp x ring over cp); "
                "got head_parallel_size=1 (use attention='ring' for pure context parallelism)"
            )
        if attention != "2d" and head_parallel_size != 1:
            raise ValueError(
                f"{name}: head_parallel_size={head_parallel_size} needs attention='2d' (or 'auto'); "
                f"attention={attention!r} runs over all sequence_parallel_size ranks with head_parallel_size=1"
            )
        if load_balance is True or load_balance is False:
            layout = "zigzag" if load_balance else "contiguous"
        elif load_balance in LAYOUTS:
            layout = load_balance
        else:
            raise ValueError(f"{name}: load_balance={load_balance!r} is not supported; expected a bool or one of {LAYOUTS}")
        if activation_checkpointing is not None and activation_checkpointing not in AC_MODES:
            raise ValueError(
                f"{name}: activation_checkpointing={activation_checkpointing!r} is not supported; expected one of {AC_MODES} or None"
            )
        if not isinstance(compile, (bool, dict)):
            raise ValueError(f"{name}: compile must be a bool or a dict of torch.compile keyword arguments, got {compile!r}")
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
            timeout = timedelta(seconds=timeout)
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ValueError(f"{name}: timeout must be a timedelta, a number of seconds or None, got {timeout!r}")
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._sequence_parallel_size = sequence_parallel_size
        self._head_parallel_size = head_parallel_size
        self._data_parallel_replicate_size = data_parallel_replicate_size
        self.attention: str = attention
        self.layout: str = layout
        self.activation_checkpointing = activation_checkpointing
        self.compile_kwargs: dict[str, Any] | None = (dict(compile) if isinstance(compile, dict) else {}) if compile else None
        self._parallel_dims: ParallelDims | None = None
        self._sp_mesh: DeviceMesh | None = None

    # ----------------------------------------------------------------------------------------- mesh

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
        sp = self.num_processes if self._sequence_parallel_size == "auto" else self._sequence_parallel_size
        return ParallelDims.from_sizes(
            world_size=world_size,
            sequence_parallel_size=sp,
            head_parallel_size=self._head_parallel_size,
            data_parallel_replicate_size=self._data_parallel_replicate_size,
            owner=type(self).__name__,
        )

    @override
    def setup_environment(self) -> None:
        dims = self.resolve_parallel_dims()  # validated before the process group exists
        self._setup_distributed()  # ModelParallelStrategy: ranks, seed, init_process_group
        self._parallel_dims = dims
        self._device_mesh = dims.build_mesh(self.root_device.type)
        self._sp_mesh = sp_mesh(self._device_mesh)
        # LightningModule.device_mesh is read-only and ModelParallelStrategy sets it this same way.
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

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
        if not _is_parallelized(self.model):
            self.model = self.precision_plugin.convert_module(self.model)  # bf16-true: bf16 parameters
            self.model_to_device()
            self._parallelize(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _parallelize(self, module: nn.Module) -> None:
        roots = [child for child in module.children() if find_blocks(child)]
        if not roots:
            raise ValueError(
                f"{type(self).__name__}: found no transformer blocks in {type(module).__name__} "
                "(a child module with an nn.ModuleList named 'layers', 'h' or 'blocks'); build the "
                "model in __init__ or configure_model() as an attribute of the LightningModule"
            )
        in_roots = {id(p) for root in roots for p in root.parameters()}
        outside = [n for n, p in module.named_parameters() if id(p) not in in_roots]
        if outside:
            raise ValueError(
                f"{type(self).__name__}: parameters {outside[:5]} of {type(module).__name__} are outside the "
                "child module(s) with the transformer blocks and would be neither sharded nor synchronized; "
                "move them into the model"
            )
        on_meta = [n for n, p in module.named_parameters() if p.is_meta]
        if on_meta:
            raise ValueError(
                f"{type(self).__name__}: parameters {on_meta[:5]} are on the meta device; build the model in "
                "configure_model() without a meta-device context (the strategy places it on this rank's device)"
            )
        dims = self.parallel_dims
        # "bf16-true" / "16-true": parameters are already low precision (convert_module), FSDP2 keeps
        # them; "bf16-mixed": fp32 parameters, gathered in bf16 for compute, gradients reduced in fp32.
        param_dtype = reduce_dtype = None
        if isinstance(self.precision_plugin, MixedPrecision) and self.precision_plugin.precision == "bf16-mixed":
            param_dtype, reduce_dtype = torch.bfloat16, torch.float32
        # FSDP2 also on one rank: one code path, and the same checkpoint format at every size.
        mesh_for_fsdp = fsdp_mesh(self.device_mesh)
        for root in roots:
            parallelize(
                root,
                sp_mesh=self.sp_mesh if dims.sp > 1 else None,
                fsdp_mesh=mesh_for_fsdp,
                attention=self.attention,  # type: ignore[arg-type]
                layout=self.layout,  # type: ignore[arg-type]
                activation_checkpointing=self.activation_checkpointing,
                compile_kwargs=self.compile_kwargs,
                param_dtype=param_dtype,
                reduce_dtype=reduce_dtype,
            )

    # ----------------------------------------------------------------------------------------- checkpoints
    # Note [Checkpoint formats]
    # save_distributed_checkpoint=True: ModelParallelStrategy's folder of shards written by
    # torch.distributed.checkpoint (plus meta.pt with the rest of the Lightning checkpoint).
    # False: one file with the full model and optimizer state dicts of
    # torch.distributed.checkpoint.state_dict, i.e. keyed by parameter names as the plain model
    # has them (activation checkpointing and compile wrappers leave no trace in the names).
    # Both load into any mesh layout: a full tensor is re-sharded on load.

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
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():  # a folder of shards
            return super().load_checkpoint(path, weights_only=weights_only)
        if not path.is_file():
            raise FileNotFoundError(f"{type(self).__name__}: no checkpoint at {str(path)!r}")
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        assert self.model is not None and self.lightning_module is not None
        # Every rank reads the (memory-mapped) file and keeps its own shard of each full tensor.
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(self.model, checkpoint.pop("state_dict"), options=options)
        optimizer_states = checkpoint.pop("optimizer_states", [])
        if self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            for optimizer, state in zip(self.optimizers, optimizer_states):
                set_optimizer_state_dict(self.model, optimizer, state, options=options)
        return checkpoint

    # ----------------------------------------------------------------------------------------- batches

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        return self.shard_batch(batch)

    def shard_batch(self, batch: Any) -> Any:
        """This rank's piece of a dict batch of full sequences (Note [What the strategy does, and where]).

        Every tensor with ``shape[1] == input_ids.shape[1]`` (input ids, labels, position ids,
        loss masks, document ids, ...) is split along dim 1 with the strategy's layout. Missing
        ``position_ids`` are created first as the global positions ``0..S-1``.
        """
        name = type(self).__name__
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ValueError(
                f"{name} shards dict batches with an 'input_ids' tensor (batch, seq_len) and tensors such as "
                f"'labels' / 'position_ids' of the same length; got {type(batch).__name__}"
                + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
            )
        input_ids = batch["input_ids"]
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            raise ValueError(f"{name}: batch['input_ids'] must be a (batch, seq_len) tensor, got {getattr(input_ids, 'shape', input_ids)!r}")
        if self.parallel_dims.sp == 1:
            return batch
        seq_len = input_ids.shape[1]
        multiple = required_multiple(self.sp_mesh, self.layout)
        if seq_len % multiple:
            raise ValueError(
                f"{name}: sequence length {seq_len} of batch['input_ids'] must be a multiple of {multiple} "
                f"(sequence_parallel_size={self.parallel_dims.sp}, load_balance={self.layout!r}); pad the "
                f"sequences (labels -100) or choose seq_len as a multiple of {multiple}"
            )
        out = dict(batch)
        if out.get("position_ids") is None:
            out["position_ids"] = torch.arange(seq_len, device=input_ids.device).expand(input_ids.shape[0], seq_len)
        for key, value in out.items():
            if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == seq_len:
                out[key] = shard_sequence(value, self.sp_mesh, dim=1, layout=self.layout)  # type: ignore[arg-type]
        return type(batch)(out) if not isinstance(batch, dict) else out

    # ----------------------------------------------------------------------------------------- registry

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: dict) -> None:
        strategy_registry.register("seqpar", cls, description="Sequence parallelism, attention chosen automatically")
        for algorithm in ALGORITHMS:
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


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_parallelized(module: nn.Module) -> bool:
    """Whether ``parallelize`` already ran on ``module`` (a second fit/validate call on the same module)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    from lightning_seqpar.attention import Attention

    return any(
        isinstance(m, (FSDPModule, CheckpointWrapper)) or (isinstance(m, Attention) and m.mesh is not None)
        for m in module.modules()
    )


SequenceParallelStrategy.register_strategies(StrategyRegistry)

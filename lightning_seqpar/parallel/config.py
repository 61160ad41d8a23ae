"""The options of :class:`~lightning_seqpar.strategy.SequenceParallelStrategy` as one frozen, typed config.

Note [One name per option]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Every option keeps the name the user gives the strategy from the constructor down to the
``apply_*`` function that uses it: ``attention``, ``attention_backend``, ``lasp_variant``,
``inner_ring_size``, ``head_chunks``, ``activation_checkpointing``, ``uncheckpointed_blocks``,
``offload_checkpoints``, ``offload_params``, ``bf16_adapters``, ``mlp_chunk_size``, ``gather_whole_model``, ``memory``. Two values are derived, and
named for what they are: ``layout`` (the split that ``load_balance`` asks for: True / "auto" ->
"zigzag" unless the attention is LASP) and ``compile_kwargs`` (``compile``'s keyword arguments,
None without compile). The one place where a name changes is the attention module's own public
API (``Attention.configure`` / ``sequence_parallel_attention``), which calls the chosen
algorithm ``algorithm`` and the local kernel ``backend``: ``apply_attention`` passes them there.

The checks are written once, here: :meth:`StrategyConfig.__post_init__` checks every option and
their combinations (a ``ValueError`` that names the argument and what was expected, before any
process group exists). The ``apply_*`` functions used on their own check their arguments with
the same helper functions (``check_uncheckpointed_blocks``, ``check_offload_checkpoints``,
``check_lasp_variant``), not copies of them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_seqpar.attention import ALGORITHMS, BACKENDS, LASP_VARIANTS, Algorithm
from lightning_seqpar.checks import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Range, check_options, option_hints
from lightning_seqpar.parallel.activation_checkpointing import AC_MODES
from lightning_seqpar.parallel.mesh import PLACEMENTS
from lightning_seqpar.sharding.layouts import LAYOUTS

__all__ = [
    "ActivationCheckpointingChoice",
    "AttentionChoice",
    "ConfigOptions",
    "StrategyConfig",
    "check_lasp_variant",
    "check_offload_checkpoints",
    "check_uncheckpointed_blocks",
]

AttentionChoice = Literal[Algorithm, "lasp", "auto"]
ActivationCheckpointingChoice = Literal["selective++", "full"]

MEMORY_CHOICES: tuple[str | None, ...] = (None, "manual", "auto")
"""``memory``: None (the default: "auto" where the planner can plan, else the options as given), "manual" (the options
as given) or "auto" (Note [Planning memory] in ``lightning_seqpar.planner.memory``)."""

MEMORY_OPTIONS: tuple[str, ...] = ("offload_checkpoints", "head_chunks", "mlp_chunk_size", "offload_params", "activation_checkpointing",
                                   "bf16_adapters", "uncheckpointed_blocks", "gather_whole_model")
"""The options ``memory="auto"`` (and the default ``memory=None``) may set, where they are left at their defaults."""

OWNER = "SequenceParallelStrategy"
"""The class whose options these are: every error of the config starts with it."""


def _prefix(owner: str | None) -> str:
    return f"{owner}: " if owner else ""


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def serves_cpu(backend: str) -> bool:
    """Whether a ``torch.distributed`` backend string carries CPU tensors ("nccl" alone does not;
    "cpu:gloo,cuda:nccl" does)."""
    backend = backend.lower().replace(" ", "")
    if ":" in backend:
        return any(part.startswith("cpu:") for part in backend.split(","))
    return backend != "nccl"


# --------------------------------------------------------------------------------------------- shared checks


def check_uncheckpointed_blocks(value: Any, *, owner: str | None = None) -> None:
    """``uncheckpointed_blocks`` is an int >= 0 (the strategy's config and ``apply_ac``)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{_prefix(owner)}uncheckpointed_blocks must be an int >= 0, got {value!r}")


def check_offload_checkpoints(offload_checkpoints: Any, *, activation_checkpointing: str | None, owner: str | None = None) -> None:
    """``offload_checkpoints`` is a bool or a block count >= 0 and needs checkpointed blocks (the strategy's config,
    ``apply_ac`` and ``parallelize``; Note [Offloading checkpoints to host memory]). Also with compile: an offloaded block
    is compiled inside its checkpoint (Note [Checkpoints under torch.compile])."""
    if not isinstance(offload_checkpoints, int) or (not isinstance(offload_checkpoints, bool) and offload_checkpoints < 0):
        raise ValueError(f"{_prefix(owner)}offload_checkpoints must be True, False or the number of checkpointed blocks to "
                         f"offload (an int >= 0, the first ones), got {offload_checkpoints!r}")
    if offload_checkpoints and activation_checkpointing is None:
        raise ValueError(f"{_prefix(owner)}offload_checkpoints={offload_checkpoints!r} offloads what checkpointed blocks keep; it needs "
                         "activation_checkpointing: set activation_checkpointing='selective++' or 'full'")


def check_lasp_variant(value: Any, *, owner: str | None = None) -> None:
    """``lasp_variant`` is one of :data:`~lightning_seqpar.attention.LASP_VARIANTS`."""
    if value not in LASP_VARIANTS:
        raise ValueError(f"{_prefix(owner)}lasp_variant={value!r} is not supported; expected one of {LASP_VARIANTS}")


# --------------------------------------------------------------------------------------------- the config

OPTIONS_DOC = """\
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
            [Node-aware placement] in ``lightning_seqpar.parallel.mesh``): "context-first" (the cp ring),
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
            memory] in ``lightning_seqpar.parallel.activation_checkpointing``). Needs activation_checkpointing. An int
            n: only the first n checkpointed blocks offload (the others keep their inputs on the device), for
            where the host's memory, not the device's, binds.
        offload_params: keep the sharded parameters, their gradients and the optimizer state in
            host memory (FSDP2's ``CPUOffloadPolicy``, ZeRO-Offload style): each block's shard is
            copied to the GPU for its all-gather, gradients come back after the reduce-scatter
            and the optimizer step runs on the CPU. Frees 16 bytes per parameter / (dp_shard x sp)
            of GPU memory (llama-7b on 4 GPUs: ~27 GB) for the same in host memory and a slower
            step (Note [Offloading parameters to host memory] in ``lightning_seqpar.parallel.parallelize``).
            On CUDA the process group gets a CPU backend too (``process_group_backend=None``
            becomes "cpu:gloo,cuda:nccl"), for the collectives over CPU tensors (gradient clipping).
        bf16_adapters: LoRA under ``precision="bf16-true"``: FSDP2 gathers the fp32 adapters in bf16 for the
            forward and backward (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, what bf16
            autocast does in Hugging Face training); their shards, gradients and AdamW state stay fp32. peft then
            no longer keeps an fp32 copy of every adapted layer's input for the backward (Note [Adapters in bf16]
            in ``lightning_seqpar.hf.lora``): ~4 bytes x (3d + H D + 2d + I) per token and layer less at the block's
            peak. False (the default): the adapters compute in fp32, as peft's own model does.
        gather_whole_model: on one rank only (dp_shard x sp x replicas = 1, one GPU), without offload_params: FSDP2
            shards the root module alone, not every block, so the whole model is gathered once per step (in the
            compute dtype) and stays gathered through it: the same training, less Python per step, for the memory of
            every parameter in the compute dtype instead of the root's and two blocks' (Note [One rank: one gather per
            step] in ``lightning_seqpar.parallel.parallelize``). The planner (``memory`` None or "auto") turns it on on one rank
            where it fits. Checkpoints are the same with and without it.
        mlp_chunk_size: run each block's MLP over slices of this many tokens, each checkpointed:
            the MLP's intermediate activations (3.5x the block width) exist for one slice at a
            time (Note [Sequence-tiled MLP]). None: the MLP runs on the whole local sequence.
        compile: ``torch.compile`` each block: True, or a dict of ``torch.compile`` keyword
            arguments; "auto" (the default): on for the package's own models on a CUDA device, and for the
            Llama and Qwen3 families of transformers there where the memory plan keeps Selective Checkpoint++
            with the parameters on the GPU; off elsewhere (Note [Compile by default] in
            ``lightning_seqpar.planner.planning``); False turns it off.
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
        check_model: a model of the user's own whose blocks call ``F.scaled_dot_product_attention`` (routed to the
            sequence-parallel attention, Note [Routing a model's own SDPA calls]) is run once at setup on a short random
            sequence, split and whole, and refused with the cause if they differ (Note [Split against whole at setup]).
            False skips the check. Models of the package and transformers models are not checked (exact by design).
        blocks: the dotted path (from the LightningModule) of the ``nn.ModuleList`` / ``nn.Sequential`` holding the
            transformer blocks, where finding them by name ("layers", "h", "blocks") or by structure (the longest
            list of same-class modules) is ambiguous (Note [Finding the blocks of a user's model]). None: found.
        memory: None (the default), "manual" or "auto". "auto": before the process group exists, the
            planner (``lightning_seqpar.planner.memory.plan_memory``) estimates this rank's peak memory for
            ``expected_seq_len``, else the datamodule's ``seq_len``, else (in setup) the first batch's length
            (Note [The length memory="auto" plans for] in ``lightning_seqpar.planner.planning``) and sets activation_checkpointing
            (None where everything fits), offload_checkpoints, head_chunks, mlp_chunk_size, offload_params, (LoRA)
            bf16_adapters, and for speed gather_whole_model (one rank) and uncheckpointed_blocks, those left at their
            defaults only ("selective++" counts as unset), to the fastest set that fits the device's memory; it logs the
            choice and the estimate (``memory_plan`` keeps them), or raises a ``ValueError`` with the longest length that
            would fit. On a CPU device it does not plan (a log line says so). "manual": the options as given. None: as
            "auto" where the planner can plan (a CUDA device, the model's sizes readable from the LightningModule's
            ``config``, a length known), else the options as given with an info line saying why; where nothing fits it
            warns with the planner's message and runs with the options as given instead of raising. Note [Planning memory].
    """
"""The options' ``Args`` section, written once: the docstring of
:class:`~lightning_seqpar.strategy.SequenceParallelStrategy` (what ``help()`` and ``seqpar fit --help``
show) and of :class:`StrategyConfig` end with it."""


@dataclass(frozen=True)
class StrategyConfig:
    __doc__ = """The strategy's options as the user gave them (``"auto"`` included), checked once on creation.

    The fields are :class:`~lightning_seqpar.strategy.SequenceParallelStrategy`'s keyword arguments,
    with the same names, defaults and meaning (documented here and in docs/strategy.md). ``timeout``
    given as seconds becomes a ``timedelta``. Raises ``ValueError`` naming the argument.

""" + OPTIONS_DOC

    sequence_parallel_size: int | Literal["auto"] = "auto"
    head_parallel_size: int | Literal["auto"] = 1
    attention: AttentionChoice = "auto"
    expected_seq_len: int | None = None
    load_balance: bool | Literal["zigzag", "contiguous", "auto"] = "auto"
    lasp_variant: Literal["p2p", "allgather"] = "p2p"
    inner_ring_size: int | None = None
    placement: Literal["auto", "context-first", "head-first"] = "auto"
    head_chunks: int = 1
    attention_backend: str = "auto"
    data_parallel_replicate_size: int = 1
    activation_checkpointing: ActivationCheckpointingChoice | None = "selective++"
    uncheckpointed_blocks: int = 0
    offload_checkpoints: bool | int = False
    offload_params: bool = False
    bf16_adapters: bool = False
    gather_whole_model: bool = False
    mlp_chunk_size: int | None = None
    compile: bool | dict[str, Any] | Literal["auto"] = "auto"
    save_distributed_checkpoint: bool = True
    process_group_backend: str | None = None
    timeout: timedelta | float | None = default_pg_timeout
    pad_to_multiple: bool = False
    validate_batches: bool = True
    memory: Literal["manual", "auto"] | None = None
    check_model: bool = True
    blocks: str | None = None

    option_ranges: ClassVar[dict[str, Range]] = {
        "sequence_parallel_size": AT_LEAST_ONE, "head_parallel_size": AT_LEAST_ONE, "expected_seq_len": AT_LEAST_ONE,
        "inner_ring_size": AT_LEAST_ONE, "head_chunks": AT_LEAST_ONE, "data_parallel_replicate_size": AT_LEAST_ONE,
        "uncheckpointed_blocks": NON_NEGATIVE, "offload_checkpoints": NON_NEGATIVE, "mlp_chunk_size": AT_LEAST_ONE,
        "timeout": POSITIVE,
    }
    """The numbers each option allows (Note [Checking options by their types] in ``lightning_seqpar.checks``)."""

    def __post_init__(self) -> None:
        timeout = self.timeout
        if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and math.isfinite(timeout):
            object.__setattr__(self, "timeout", timedelta(seconds=timeout))
        self._check()

    # ----------------------------------------------------------------------------------------- derived values

    @property
    def initial_attention(self) -> str:
        """``attention`` before the model is known: "auto" is "2d" with head_parallel_size > 1, else "ring"
        (setup may still choose LASP or the cost model's plan: Note [Choosing attention automatically])."""
        if self.attention != "auto":
            return self.attention
        hp = self.head_parallel_size
        return "2d" if hp != "auto" and hp > 1 else "ring"

    @property
    def layout(self) -> str:
        """How the sequence is split, from ``load_balance``: "zigzag" or "contiguous" ("auto": contiguous for LASP)."""
        if self.load_balance is True or self.load_balance is False:
            return "zigzag" if self.load_balance else "contiguous"
        if self.load_balance == "auto":  # LASP needs contiguous; causal softmax attention is balanced by zigzag
            return "contiguous" if self.initial_attention == "lasp" else "zigzag"
        return self.load_balance

    @property
    def compile_kwargs(self) -> dict[str, Any] | None:
        """``torch.compile``'s keyword arguments for each block, None without compile (and for "auto" not yet resolved:
        the strategy resolves it at setup, ``planning.resolve_compile``)."""
        if not self.compile or self.compile == "auto":
            return None
        return dict(self.compile) if isinstance(self.compile, dict) else {}

    # ----------------------------------------------------------------------------------------- the checks

    def _check(self) -> None:
        name = OWNER
        sp, hp, attention = self.sequence_parallel_size, self.head_parallel_size, self.attention
        if not (sp == "auto" or _positive_int(sp)):
            raise ValueError(f"{name}: sequence_parallel_size must be a positive int or 'auto', got {sp!r}")
        if not (hp == "auto" or _positive_int(hp)):
            raise ValueError(f"{name}: head_parallel_size must be a positive int or 'auto', got {hp!r}")
        if not _positive_int(self.data_parallel_replicate_size):
            raise ValueError(f"{name}: data_parallel_replicate_size must be a positive int, got {self.data_parallel_replicate_size!r}")
        if not (self.expected_seq_len is None or _positive_int(self.expected_seq_len)):
            raise ValueError(f"{name}: expected_seq_len must be a positive int (the global sequence length) or None, "
                             f"got {self.expected_seq_len!r}")
        if hp == "auto" and attention != "auto":
            raise ValueError(
                f"{name}: head_parallel_size='auto' is chosen together with the algorithm and needs attention='auto'; "
                f"got attention={attention!r} (give head_parallel_size as an int)"
            )
        choices = (*ALGORITHMS, "lasp", "auto")
        if attention not in choices:
            raise ValueError(f"{name}: attention={attention!r} is not supported; expected one of {choices}")
        check_lasp_variant(self.lasp_variant, owner=name)
        inner = self.inner_ring_size
        if inner is not None and not _positive_int(inner):
            raise ValueError(f"{name}: inner_ring_size must be a positive int or None, got {inner!r}")
        if inner is not None and attention not in ("ring", "2d", "auto"):
            raise ValueError(f"{name}: inner_ring_size is for attention='ring' or '2d' (the double ring), not attention={attention!r}")
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"{name}: attention_backend={self.attention_backend!r} is not supported; expected one of {BACKENDS}")
        chunks = self.head_chunks
        if not _positive_int(chunks):
            raise ValueError(f"{name}: head_chunks must be a positive int, got {chunks!r}")
        if chunks > 1 and attention not in ("ring", "allgather", "auto"):
            raise ValueError(f"{name}: head_chunks={chunks} is for attention='ring' or 'allgather', not attention={attention!r}")
        if chunks > 1 and hp != "auto" and hp > 1:
            raise ValueError(f"{name}: head_chunks={chunks} is for attention='ring' or 'allgather' (head_parallel_size=1), "
                             f"but head_parallel_size={hp} means 2D attention")
        resolved = self.initial_attention
        if resolved == "2d" and hp == 1:
            raise ValueError(
                f"{name}: attention='2d' needs head_parallel_size > 1 (Ulysses over hp x ring over cp); "
                "got head_parallel_size=1 (use attention='ring' for pure context parallelism)"
            )
        if resolved != "2d" and hp not in (1, "auto"):
            raise ValueError(
                f"{name}: head_parallel_size={hp} needs attention='2d' (or 'auto'); "
                f"attention={resolved!r} runs over all sequence_parallel_size ranks with head_parallel_size=1"
            )
        load_balance = self.load_balance
        if not (isinstance(load_balance, bool) or load_balance in LAYOUTS or load_balance == "auto"):
            raise ValueError(f"{name}: load_balance={load_balance!r} is not supported; expected a bool, 'auto' or one of {LAYOUTS}")
        if resolved == "lasp" and self.layout != "contiguous":
            raise ValueError(
                f"{name}: attention='lasp' needs load_balance='contiguous' (or False / 'auto'): LASP passes the KV state "
                f"from each rank's chunk to the next (LASP, arXiv:2404.02882, Alg. 1-2); got load_balance={load_balance!r}"
            )
        mode = self.activation_checkpointing
        if mode is not None and mode not in AC_MODES:
            raise ValueError(f"{name}: activation_checkpointing={mode!r} is not supported; expected one of {AC_MODES} or None")
        check_uncheckpointed_blocks(self.uncheckpointed_blocks, owner=name)
        if not isinstance(self.compile, (bool, dict)) and self.compile != "auto":
            raise ValueError(f"{name}: compile must be True, False, \"auto\" or a dict of torch.compile keyword arguments, "
                             f"got {self.compile!r}")
        check_offload_checkpoints(self.offload_checkpoints, activation_checkpointing=mode, owner=name)
        if not isinstance(self.offload_params, bool):
            raise ValueError(f"{name}: offload_params must be True or False, got {self.offload_params!r}")
        if not isinstance(self.bf16_adapters, bool):
            raise ValueError(f"{name}: bf16_adapters must be True or False, got {self.bf16_adapters!r}")
        if not isinstance(self.gather_whole_model, bool):
            raise ValueError(f"{name}: gather_whole_model must be True or False, got {self.gather_whole_model!r}")
        if self.gather_whole_model and self.offload_params:
            raise ValueError(f"{name}: gather_whole_model=True keeps the whole model gathered on the device; it cannot be "
                             "combined with offload_params=True (the model states on the host)")
        backend = self.process_group_backend
        if self.offload_params and backend is not None and not serves_cpu(backend):
            raise ValueError(
                f"{name}: offload_params=True keeps the parameters and gradients on the CPU, and gradient clipping "
                f"reduces over CPU tensors, which process_group_backend={backend!r} cannot carry; "
                "use 'cpu:gloo,cuda:nccl' (or None, which picks it on CUDA)"
            )
        if self.mlp_chunk_size is not None and not _positive_int(self.mlp_chunk_size):
            raise ValueError(f"{name}: mlp_chunk_size must be a positive int (tokens per slice) or None, got {self.mlp_chunk_size!r}")
        timeout = self.timeout
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ValueError(f"{name}: timeout must be a timedelta, a finite number of seconds or None, got {timeout!r}")
        if timeout is not None and timeout.total_seconds() <= 0:
            raise ValueError(f"{name}: timeout must be positive, got {timeout!r}")
        if self.blocks is not None and (not isinstance(self.blocks, str) or not self.blocks):
            raise ValueError(f"{name}: blocks must be the dotted path of the module list holding the blocks "
                             f"(e.g. 'model.layers') or None, got {self.blocks!r}")
        for arg, value in (("pad_to_multiple", self.pad_to_multiple), ("validate_batches", self.validate_batches),
                           ("check_model", self.check_model)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}: {arg} must be True or False, got {value!r}")
        if self.memory not in MEMORY_CHOICES:
            raise ValueError(f"{name}: memory={self.memory!r} is not supported; expected one of {MEMORY_CHOICES}")
        if self.placement not in ("auto", *PLACEMENTS):
            raise ValueError(f"{name}: placement={self.placement!r} is not supported; expected 'auto' or one of {PLACEMENTS}")
        # every option by its type, finite numbers and ranges (Note [Checking options by their types]), after the
        # messages above that say more for the options they know
        values = {k: v for k, v in asdict(self).items() if not isinstance(v, timedelta)}
        check_options(values, option_hints(type(self)), owner=name, ranges=self.option_ranges)


class ConfigOptions:
    """The options that setup does not resolve, read from ``self.config``: the strategy's public attributes of the same
    names (``attention``, ``layout`` and ``inner_ring_size`` are the strategy's own: setup may resolve them)."""

    config: StrategyConfig

    lasp_variant = property(lambda self: self.config.lasp_variant)
    head_chunks = property(lambda self: self.config.head_chunks)
    attention_backend = property(lambda self: self.config.attention_backend)
    activation_checkpointing = property(lambda self: self.config.activation_checkpointing)
    uncheckpointed_blocks = property(lambda self: self.config.uncheckpointed_blocks)
    offload_checkpoints = property(lambda self: self.config.offload_checkpoints)
    offload_params = property(lambda self: self.config.offload_params)
    bf16_adapters = property(lambda self: self.config.bf16_adapters)
    gather_whole_model = property(lambda self: self.config.gather_whole_model)
    mlp_chunk_size = property(lambda self: self.config.mlp_chunk_size)
    compile_kwargs = property(lambda self: self.config.compile_kwargs)
    timeout = property(lambda self: self.config.timeout)
    pad_to_multiple = property(lambda self: self.config.pad_to_multiple)
    validate_batches = property(lambda self: self.config.validate_batches)
    check_model = property(lambda self: self.config.check_model)

"""The options of :class:`~lightning_seqpar.strategy.SequenceParallelStrategy` as one frozen, typed config.

Note [One name per option]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Every option keeps the name the user gives the strategy from the constructor down to the
``apply_*`` function that uses it: ``attention``, ``attention_backend``, ``lasp_variant``,
``inner_ring_size``, ``head_chunks``, ``activation_checkpointing``, ``uncheckpointed_blocks``,
``offload_checkpoints``, ``offload_params``, ``bf16_adapters``, ``mlp_chunk_size``, ``memory``. Two values are derived, and
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

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_seqpar.activation_checkpointing import AC_MODES
from lightning_seqpar.attention import ALGORITHMS, BACKENDS, LASP_VARIANTS, Algorithm
from lightning_seqpar.mesh import PLACEMENTS
from lightning_seqpar.sharding import LAYOUTS

__all__ = [
    "ActivationCheckpointingChoice",
    "AttentionChoice",
    "StrategyConfig",
    "check_lasp_variant",
    "check_offload_checkpoints",
    "check_uncheckpointed_blocks",
]

AttentionChoice = Literal[Algorithm, "lasp", "auto"]
ActivationCheckpointingChoice = Literal["selective++", "full"]

MEMORY_CHOICES: tuple[str, ...] = ("manual", "auto")
"""``memory``: "manual" (the options as given) or "auto" (Note [Planning memory] in ``lightning_seqpar.memory``)."""

MEMORY_OPTIONS: tuple[str, ...] = ("offload_checkpoints", "head_chunks", "mlp_chunk_size", "offload_params", "activation_checkpointing",
                                   "bf16_adapters")
"""The options ``memory="auto"`` may set, where they are left at their defaults."""

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


def check_offload_checkpoints(offload_checkpoints: Any, *, activation_checkpointing: str | None, compiled: bool,
                              owner: str | None = None) -> None:
    """``offload_checkpoints`` is a bool or a block count >= 0 and needs checkpointed blocks that run eagerly (the
    strategy's config, ``apply_ac`` and ``parallelize``; Note [Offloading checkpoints to host memory])."""
    if not isinstance(offload_checkpoints, int) or (not isinstance(offload_checkpoints, bool) and offload_checkpoints < 0):
        raise ValueError(f"{_prefix(owner)}offload_checkpoints must be True, False or the number of checkpointed blocks to "
                         f"offload (an int >= 0, the first ones), got {offload_checkpoints!r}")
    if offload_checkpoints and activation_checkpointing is None:
        raise ValueError(f"{_prefix(owner)}offload_checkpoints={offload_checkpoints!r} offloads what checkpointed blocks keep; it needs "
                         "activation_checkpointing: set activation_checkpointing='selective++' or 'full'")
    if offload_checkpoints and compiled:
        raise ValueError(f"{_prefix(owner)}offload_checkpoints={offload_checkpoints!r} runs the blocks eagerly (saved-tensor hooks around the "
                         "checkpoint); set compile=False (compile_kwargs=None)")


def check_lasp_variant(value: Any, *, owner: str | None = None) -> None:
    """``lasp_variant`` is one of :data:`~lightning_seqpar.attention.LASP_VARIANTS`."""
    if value not in LASP_VARIANTS:
        raise ValueError(f"{_prefix(owner)}lasp_variant={value!r} is not supported; expected one of {LASP_VARIANTS}")


# --------------------------------------------------------------------------------------------- the config


@dataclass(frozen=True)
class StrategyConfig:
    """The strategy's options as the user gave them (``"auto"`` included), checked once on creation.

    The fields are :class:`~lightning_seqpar.strategy.SequenceParallelStrategy`'s keyword arguments,
    with the same names, defaults and meaning (see its docstring and docs/strategy.md). ``timeout``
    given as seconds becomes a ``timedelta``. Raises ``ValueError`` naming the argument.
    """

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
    mlp_chunk_size: int | None = None
    compile: bool | dict[str, Any] = False
    save_distributed_checkpoint: bool = True
    process_group_backend: str | None = None
    timeout: timedelta | float | None = default_pg_timeout
    pad_to_multiple: bool = False
    validate_batches: bool = True
    memory: Literal["manual", "auto"] = "manual"

    def __post_init__(self) -> None:
        if isinstance(self.timeout, (int, float)) and not isinstance(self.timeout, bool):
            object.__setattr__(self, "timeout", timedelta(seconds=self.timeout))
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
        """``torch.compile``'s keyword arguments for each block, None without compile."""
        if not self.compile:
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
        if not isinstance(self.compile, (bool, dict)):
            raise ValueError(f"{name}: compile must be a bool or a dict of torch.compile keyword arguments, got {self.compile!r}")
        check_offload_checkpoints(self.offload_checkpoints, activation_checkpointing=mode, compiled=bool(self.compile), owner=name)
        if not isinstance(self.offload_params, bool):
            raise ValueError(f"{name}: offload_params must be True or False, got {self.offload_params!r}")
        if not isinstance(self.bf16_adapters, bool):
            raise ValueError(f"{name}: bf16_adapters must be True or False, got {self.bf16_adapters!r}")
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
            raise ValueError(f"{name}: timeout must be a timedelta, a number of seconds or None, got {timeout!r}")
        if timeout is not None and timeout.total_seconds() <= 0:
            raise ValueError(f"{name}: timeout must be positive, got {timeout!r}")
        for arg, value in (("pad_to_multiple", self.pad_to_multiple), ("validate_batches", self.validate_batches)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}: {arg} must be True or False, got {value!r}")
        if self.memory not in MEMORY_CHOICES:
            raise ValueError(f"{name}: memory={self.memory!r} is not supported; expected one of {MEMORY_CHOICES}")
        if self.placement not in ("auto", *PLACEMENTS):
            raise ValueError(f"{name}: placement={self.placement!r} is not supported; expected 'auto' or one of {PLACEMENTS}")

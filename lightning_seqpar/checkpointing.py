"""Activation checkpointing: Selective Checkpoint++ and full checkpointing of transformer blocks.

Note [Selective Checkpoint++]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Full checkpointing keeps only each block's input and recomputes the whole block in backward.
Under sequence parallelism that recompute is the expensive part: the attention forward runs
again, with all of its communication (the ring's P2P rounds, the Ulysses all-to-alls).
LightSeq §3.3 ("rematerialization-aware checkpointing") and LoongTrain §5.2 (Selective
Checkpoint++) both notice that the attention backward only needs the attention *output* and its
log-sum-exp, so those are saved and everything else in the block is recomputed::

    forward:   x --norm--qkv--rope--[ATTENTION]--o_proj--+--norm--mlp--+--> y
                                      saved: out, lse     (all else dropped)
    backward:  recompute norm, qkv, rope, o_proj, mlp from x;  attention: NOT re-run,
               its backward uses the saved (q, k, v, out, lse)

The policy is data: :data:`SAVE_OPS` lists the ops whose outputs are kept (MUST_SAVE). By default
it is exactly the attention ops of ``lightning_seqpar.attention.ATTENTION_OPS`` — the attention
custom op (which returns out and lse) and the head all-to-alls of Ulysses / 2D — so the extra
memory is one block-output-sized tensor per block, and no other activation. Every other op
is recomputed (PREFER_RECOMPUTE). Pass a longer tuple to :func:`selective_checkpoint_policy` to
trade memory for compute (e.g. ``torch.ops.aten.mm.default``, as torchtitan's op-level SAC does).

Blocks are wrapped with torch's ``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``).
It is what torchtitan and Lightning use, and ``torch.distributed.checkpoint`` and
``Module.state_dict`` both strip its ``_checkpoint_wrapped_module.`` prefix, so checkpoints keep
the model's own parameter names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from lightning_seqpar.attention import ATTENTION_OPS

ActivationCheckpointing = Literal["selective++", "full"]
AC_MODES: tuple[str, ...] = ("selective++", "full")

SAVE_OPS: tuple[Any, ...] = tuple(ATTENTION_OPS)
"""The Selective Checkpoint++ whitelist: ops whose outputs are saved; everything else is recomputed."""


def selective_checkpoint_policy(save_ops: Sequence[Any] = SAVE_OPS) -> Callable[..., CheckpointPolicy]:
    """The policy of ``create_selective_checkpoint_contexts``: MUST_SAVE for ``save_ops``, recompute the rest."""
    keep = frozenset(save_ops)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_context(save_ops: tuple[Any, ...]) -> Any:
    return create_selective_checkpoint_contexts(selective_checkpoint_policy(save_ops))


def checkpoint_block(
    block: nn.Module, mode: ActivationCheckpointing, *, save_ops: Sequence[Any] = SAVE_OPS
) -> nn.Module:
    """``block`` wrapped for activation checkpointing in ``mode`` ("selective++" or "full")."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not supported; expected one of {AC_MODES} or None")
    kwargs: dict[str, Any] = {}
    if mode == "selective++":
        kwargs["context_fn"] = partial(_selective_context, tuple(save_ops))
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)

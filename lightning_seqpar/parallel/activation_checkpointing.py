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

Note [Recurrent layers under Selective Checkpoint++]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A hybrid model's recurrent token mixers (lightning_seqpar.attention.recurrent) are not in
:data:`SAVE_OPS`: their forward runs again in the recompute, with its one all-gather of the piece
composites (Note [Parallel state passing across ranks]). Saving their output alone would not save
it: unlike flash attention, whose backward rebuilds its probabilities from (q, k, lse), the
recurrence's backward needs the state entering every chunk, [H, S / 64, Dk, Dv] fp32 — for
Qwen3-Next's gated DeltaNet 32 KB per token and layer, 8x the 4 KB of the block input that the
checkpoint keeps — and those states cost the chunk terms and the scan, i.e. the forward, to
rebuild. Keeping them (with the chunk terms) would skip the recompute at that memory: a trade
for short sequences with memory to spare, open (it needs the recurrence as a custom op so that
the policy can see it, as the attention ops are).

Note [Offloading checkpoints to host memory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
What a checkpointed block keeps until its backward is its input (B, S/W, d) — and, under
Selective Checkpoint++, the attention output of the same size. At the longest contexts the kept
inputs are what no longer fits: llama3-8b at 1M tokens on 4 GPUs keeps 32 x 2.1 GB of block
inputs per GPU. ``offload=True`` runs each checkpointed block under saved-tensor hooks
(:class:`HostOffload`) that copy what the checkpoint saves and needs a gradient — the block's
input — to pinned host memory, and back when the backward recomputes the block. Inputs without a
gradient (positions, RoPE tables) are shared by every block and stay where they are; the tensors
saved inside the block are the checkpoint's own placeholders, and Selective Checkpoint++ keeps
its attention outputs in its own cache, on the GPU::

    forward, block l:   x_l --(side stream, D2H, async)--> pinned host copy;  GPU memory of x_l freed
    backward, block l:  host copy --(H2D, compute stream)--> x_l  -> recompute block l -> its backward

The device-to-host copy runs on a side stream after the block's input is ready (the input's
memory is not reused until it has finished: ``record_stream``), so it overlaps the block's
forward; the copy back waits for it (an event) and costs ~2 GB / 25 GB/s per block in backward.

Note [Sequence-tiled MLP]
~~~~~~~~~~~~~~~~~~~~~~~~~
The MLP is position-wise (row t of its output depends on row t of its input only), so running it
over slices of the sequence gives the same rows; a module that is not (a mixture of experts with
capacity limits or batch-level router statistics) must not be tiled. Its
intermediate activations are I/d = 3.5 times the block's width (llama3-8b: 262K tokens x 14,336
x 2 bytes = 7.5 GB per tensor at 1M tokens on 4 GPUs, several alive in its backward), which makes
them the largest working set of a checkpointed block's backward. ``mlp_chunk_size=c`` runs the
block's MLP (the child named one of :data:`MLP_NAMES`) over slices of c tokens, each slice under
its own non-reentrant checkpoint: only the slices' inputs are kept, and the backward recomputes
one slice at a time (ALST's "tiled MLP", arXiv:2506.13996 §3.2). Inside a checkpointed block the
MLP forward then runs three times instead of two — a few percent of a long-context step, whose
time is the attention's.

Note [Checkpointed norms]
~~~~~~~~~~~~~~~~~~~~~~~~~
An RMSNorm in bf16 as Hugging Face writes it (``x.float()``, the variance, ``x * rsqrt``, ``w *
y.to(bf16)``) keeps for its backward the fp32 copy of its input and the bf16 normalised tensor: 6
bytes per token and channel beside its output, twice per block. In a checkpointed block these live
from the block's recompute to the end of its backward, at the block's peak: measured with the
allocator's history on one H200 (Llama-3.2-1B shape, 256K tokens, the options the planner picks for
1M), 6.4 GB of the 20.5 GB that the block's backward added, and at 1M tokens the step ran out of
memory by ~8 GB. Each normalisation child of a checkpointed block therefore runs under its own
non-reentrant checkpoint (nested, as the MLP tiles are): it keeps its input only (the block input
or the residual stream, which the block keeps anyway) and recomputes the elementwise forward in
its backward, where the fp32 copy lives for that op alone. That backward, as autograd runs
Hugging Face's ops, holds five fp32 (S, d) tensors at once (the same measurement: 5 x 2.15 GB at 256K
tokens, the largest part of the block's peak): with ``mlp_chunk_size`` the norms are tiled like
the MLP (:func:`tile_mlp`: a norm is position-wise, each row normalised over its own channels, so
the slices give the same rows bitwise), and the fp32 temporaries are those of one slice. The recompute is a few memory-bound
passes over (S, d), negligible beside the block's matmuls and attention; the result is bitwise
the same (the same ops on the same inputs).

Note [Recomputing under the forward's default dtype]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Lightning's "bf16-true" sets the default dtype to bf16 inside ``training_step`` only
(``HalfPrecision.forward_context``); the backward, and so every checkpoint's recomputation, runs
with fp32. A tensor the forward creates from the default dtype then comes back in another dtype.
For a Hugging Face model with ``mlp_chunk_size`` on a GPU that stopped the first backward
(``CheckpointError``: size-0 CPU tensors saved as bf16, recomputed as fp32; seen on one H100 and
one H200 with a Llama-shaped model at 8K, not on the CPU). Every checkpoint of this module
(blocks and MLP tiles) therefore recomputes under the default dtype and the packed documents of
the forward it replays (:func:`_replay`). The backward thread waits for nothing else while it
recomputes (the thread that called ``backward`` is blocked in it), so setting the process-wide
default dtype for the duration of the replay changes nothing outside it.

Note [Checkpoints under torch.compile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``compile=True`` compiles each block after it is wrapped (Note [Order of the apply_* calls] in
``lightning_seqpar.parallel.parallelize``), so Dynamo traces the checkpoint itself: ``torch.utils.checkpoint``
becomes one ``tag_activation_checkpoint`` region of the block's graph, the Selective Checkpoint++
policy tags its ops, and AOTAutograd's partitioner saves the attention op's outputs and recomputes
the rest inside the compiled backward, fused like the forward (torchtitan's way). Two things keep
that one graph:

* the packed documents are read from a per-thread slot that Dynamo traces and guards (Note
  [Per-call state] in ``lightning_seqpar.sharding.documents``). They were a ``ContextVar``, whose ``get``
  broke the graph: the checkpoint region was not captured and every checkpointed block ran
  eagerly under ``compile=True`` (one H200, one Llama-3-8B block at 32K: 209.0 ms compiled against
  207.6 eager, docs/benchmarks.md; issue #56);
* while Dynamo traces, :func:`_checkpoint` and the MLP tiles call ``checkpoint`` on the block
  directly, without :func:`_replay`: the replay that needed the forward's default dtype and
  documents is now the compiled backward, which holds the dtypes of the traced ops and the
  documents' pieces among its saved inputs; and setting the slot inside the traced region
  would be a side effect that Dynamo refuses in a checkpoint ("HOP: Unsafe side effect").

A block whose checkpoint offloads its input (Note [Offloading checkpoints to host memory]) is the
exception: Dynamo does not trace ``saved_tensors_hooks`` (torch 2.11 - 2.13 break the graph there),
so :func:`compile_target` gives the module inside its checkpoint to compile. The checkpoint and its
hooks then run eagerly around the compiled block: the hooks see what the checkpoint saves (the
block's input, to the host), the compiled forward's own saved tensors are the checkpoint's
placeholders, and the recompute in backward runs the compiled forward again, whose attention op
Selective Checkpoint++'s dispatch mode still answers from its cache (the op is an opaque call in
the compiled code). Tested on the CPU: the same outputs and gradients as eager, the attention
forward run once per step under "selective++" and twice under "full", in either placement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_seqpar.attention import ATTENTION_OPS
from lightning_seqpar.sharding.documents import current_documents, run_with_documents

ActivationCheckpointing = Literal["selective++", "full"]
AC_MODES: tuple[str, ...] = ("selective++", "full")

MLP_NAMES: tuple[str, ...] = ("mlp", "channel_mixer", "feed_forward")
"""Names of a block's position-wise MLP child (Llama / GPT / Hugging Face, TNL, torchtitan)."""

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


class HostOffload:
    """Saved-tensor hooks keeping what they pack in pinned host memory (Note [Offloading checkpoints to host memory]).

    ``with offload.hooks(): ...`` offloads every tensor that autograd saves in the region and that
    needs a gradient; CUDA tensors are copied on a side stream (one per device, owned by this
    object), others copied on the host. Pinned memory comes in pieces of ``piece_bytes`` (a power
    of two): torch's pinned-memory cache rounds every allocation up to a power of two, which
    would waste up to half of it on a block input of, say, 1.5 GiB. ``packed_bytes`` counts
    what was offloaded (the tests read it).
    """

    def __init__(self, piece_bytes: int = 1 << 28) -> None:
        if piece_bytes < 1 or piece_bytes & (piece_bytes - 1):
            raise ValueError(f"piece_bytes must be a power of two, got {piece_bytes!r}")
        self._streams: dict[int, torch.cuda.Stream] = {}
        self.piece_bytes = piece_bytes
        self.packed_bytes = 0

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._streams:
            self._streams[index] = torch.cuda.Stream(device=index)
        return self._streams[index]

    def _pack(self, tensor: torch.Tensor) -> tuple[Any, ...]:
        if not tensor.requires_grad:  # positions, RoPE tables, masks: shared by every block, one GPU copy
            return (tensor,)
        self.packed_bytes += tensor.numel() * tensor.element_size()
        flat = tensor.detach().reshape(-1)  # a view for the (contiguous) block input
        step = max(self.piece_bytes // tensor.element_size(), 1)
        cuda = tensor.device.type == "cuda"
        side = self._stream(tensor.device) if cuda else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(tensor.device))  # the input is ready
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            pieces = []
            for piece in flat.split(step):
                host = torch.empty(piece.shape, dtype=piece.dtype, device="cpu", pin_memory=cuda)
                host.copy_(piece, non_blocking=cuda)
                pieces.append(host)
            done = side.record_event() if side is not None else None
        if side is not None:
            flat.record_stream(side)  # its memory is not reused before the copies have finished
        return (tensor.device, tensor.shape, flat.dtype, pieces, done)

    @staticmethod
    def _unpack(packed: tuple[Any, ...]) -> torch.Tensor:
        if len(packed) == 1:
            return packed[0]
        device, shape, dtype, pieces, done = packed
        if done is not None:
            torch.cuda.current_stream(device).wait_event(done)
        flat = torch.empty(sum(p.numel() for p in pieces), dtype=dtype, device=device)
        if pieces:
            for piece, dst in zip(pieces, flat.split(pieces[0].numel())):
                dst.copy_(piece, non_blocking=done is not None)
        return flat.view(shape)


def _replay(dtype: torch.dtype, documents: Any, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under the default dtype and packed documents of the forward it recomputes
    (Note [Recomputing under the forward's default dtype]; Note [Per-call state] in ``lightning_seqpar.sharding.documents``)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return run_with_documents(documents, fn, *args, **kwargs)
    finally:
        torch.set_default_dtype(previous)


def _checkpoint(fn: Callable[..., Any], *args: Any, offload: HostOffload | None = None, **kwargs: Any) -> Any:
    """Non-reentrant ``checkpoint`` of ``fn`` whose recomputation runs with this forward's default dtype and
    packed documents (backward may run in another thread, outside Lightning's precision context); traced by
    torch.compile, the plain ``checkpoint`` (Note [Checkpoints under torch.compile])."""
    with offload.hooks() if offload is not None else contextlib.nullcontext():
        if torch.compiler.is_compiling():  # the recomputation is the compiled backward's
            return checkpoint(fn, *args, use_reentrant=False, **kwargs)
        return checkpoint(_replay, torch.get_default_dtype(), current_documents(), fn, *args, use_reentrant=False, **kwargs)


def offloads(block: nn.Module) -> bool:
    """Whether ``block`` is wrapped by :func:`checkpoint_block` with ``offload`` (its checkpoint runs saved-tensor hooks)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    fn = getattr(block, "checkpoint_fn", None)
    return isinstance(block, CheckpointWrapper) and getattr(fn, "keywords", {}).get("offload") is not None


def compile_target(block: nn.Module) -> nn.Module:
    """The module to ``torch.compile`` for ``block``: the block with its checkpoint, or for a block whose checkpoint
    offloads (:func:`offloads`) the module inside it, the hooks staying eager (Note [Checkpoints under torch.compile])."""
    return block._checkpoint_wrapped_module if offloads(block) else block


def checkpoint_block(
    block: nn.Module,
    mode: ActivationCheckpointing,
    *,
    save_ops: Sequence[Any] = SAVE_OPS,
    offload: HostOffload | None = None,
) -> nn.Module:
    """``block`` wrapped for activation checkpointing in ``mode`` ("selective++" or "full").

    ``offload``: keep the block's saved input in pinned host memory (Note [Offloading checkpoints to host memory]).
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpointing={mode!r} is not supported; expected one of {AC_MODES} or None")
    checkpoint_norms(block)
    kwargs: dict[str, Any] = {}
    if mode == "selective++":
        kwargs["context_fn"] = partial(_selective_context, tuple(save_ops))
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=_checkpoint, offload=offload, **kwargs)


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer: torch's LayerNorm / RMSNorm or a class named ``*RMSNorm`` / ``*LayerNorm`` (Hugging Face's,
    the package's models')."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def checkpoint_norms(block: nn.Module) -> int:
    """Wrap ``block``'s normalisation children in their own checkpoints (Note [Checkpointed norms]); returns how many."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    count = 0
    for name, child in list(block.named_children()):
        if is_norm(child) and not isinstance(child, CheckpointWrapper):  # tiled already: apply_mlp_tiles
            block.register_module(name, checkpoint_wrapper(child, checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=_checkpoint))
            count += 1
    return count


def _sequence_tiles(fn: Callable[..., Any], x: torch.Tensor, *, chunk_size: int) -> torch.Tensor:
    """``fn(x)`` over slices of ``chunk_size`` tokens (dim 1 of (B, S, d), dim 0 of (N, d)), each checkpointed (Note [Sequence-tiled MLP])."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"mlp_chunk_size: the tiled MLP takes one tensor of tokens, got {type(x).__name__}")
    dim = 1 if x.dim() >= 3 else 0
    pieces = x.split(chunk_size, dim=dim)
    if torch.is_grad_enabled() and torch.compiler.is_compiling():  # Note [Checkpoints under torch.compile]
        outs = [checkpoint(fn, p, use_reentrant=False) for p in pieces]
    elif torch.is_grad_enabled():
        dtype, documents = torch.get_default_dtype(), current_documents()  # Note [Recomputing under the forward's default dtype]
        outs = [checkpoint(_replay, dtype, documents, fn, p, use_reentrant=False) for p in pieces]
    else:
        outs = [fn(p) for p in pieces]
    if not all(isinstance(o, torch.Tensor) and o.shape[: dim + 1] == p.shape[: dim + 1] for o, p in zip(outs, pieces)):
        raise ValueError(
            f"mlp_chunk_size: the MLP ({getattr(fn, '__class__', type(fn)).__name__}) must be position-wise and return one "
            f"tensor with a row per input token; got {type(outs[0]).__name__}. Leave mlp_chunk_size=None for this model "
            "(a mixture-of-experts block that returns router logits, for example)"
        )
    return torch.cat(outs, dim=dim)


def tile_mlp(mlp: nn.Module, chunk_size: int) -> nn.Module:
    """``mlp`` run over slices of ``chunk_size`` tokens, each under its own checkpoint (parameter names unchanged)."""
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"mlp_chunk_size must be a positive int (tokens per slice) or None, got {chunk_size!r}")
    return checkpoint_wrapper(mlp, checkpoint_impl=CheckpointImpl.NO_REENTRANT, checkpoint_fn=_sequence_tiles,
                              chunk_size=chunk_size)

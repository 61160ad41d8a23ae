"""What every recurrent mixer of :mod:`lightning_seqpar.attention.recurrent` shares: the state chain across the
ranks (:class:`StateChain`), the checks of the mesh, the layout, the tokens and the packed documents, the segment
layout of packed documents, and the fp32 guard.

The chain is LASP's state passing (LASP, Sun et al., arXiv:2404.02882, §2.2-2.3, Alg. 2-3), for any recurrence
whose step is affine in its state; the family files (``conv.py``, ``chunked.py`` with ``delta_rule.py`` and
``ssd.py``, ``selective.py`` with ``rglru.py``) run their kernels through it and import only downwards: from
here, never the other way.

Note [Linear recurrences under sequence sharding]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Both recurrences keep, per head, a matrix state S of shape [Dk, Dv] and read it with a query:

    gated delta rule (Yang et al., Gated Delta Networks, Eq. 10; Qwen3-Next):
        S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,     o_t = S_t^T q_t
        a_t = exp(g_t) (g_t <= 0), b_t in (0, 1); q, k l2-normalised, q scaled by Dk^-1/2
    Mamba2 SSD (Dao & Gu 2024, §3; B -> keys, C -> queries, dt x -> values):
        S_t = exp(dt_t A) S_{t-1} + B_t (dt_t x_t)^T,               y_t = S_t^T C_t + D x_t

Each step is affine in the previous state, so a piece of the sequence is a function
(out, S_out) = f(piece, S_in): the only thing a piece needs from the tokens before it is S_in,
a [B, H, Dk, Dv] tensor whose size does not depend on the sequence length (LASP §2.2-2.3, which
passes the KV state of TNL's linear attention the same way, attention/lasp.py).

Forward: the pieces run in sequence order; each receives S_in from the owner of the previous
piece (the first piece: zero) and sends its S_out to the owner of the next one.
Backward (LASP Alg. 3): in reverse order; each receives dS_out from the owner of the next piece
(the last: zero), runs its local backward with it as the gradient of its final state and sends
dS_in to the owner of the previous piece. The local forward is recomputed in backward from the
saved inputs and the saved S_in (the kernels save O(T) tensors anyway); nothing else is stored.

One autograd Function holds the whole chain of a layer (both directions), so every send and
receive happens inside one node, in an order fixed by the layout and identical on every rank:
no reliance on the order in which autograd runs nodes, no deadlock with other layers' traffic.

Note [State chain under the zigzag layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With W ranks, zigzag cuts the sequence into 2W pieces and rank r holds pieces r and 2W-1-r
(lightning_seqpar.sharding). Pieces must be visited in sequence order, so the chain is

    piece:  0    1    2   ...  W-1 | W   W+1  ...  2W-1
    rank:   0 -> 1 -> 2 ... -> W-1 -> W-1 -> W-2 -> ... -> 0       (W-1 -> W-1: no message)

down the ranks with the first pieces, then back up with the second pieces: 2W-2 messages per
direction instead of W-1 for contiguous, each one state. For these layers the work per token is
the same everywhere (no causal triangle), so zigzag buys no balance here; it is the attention
layers of the same model that need it. Re-laying the activations out contiguous for the
recurrent layers would move O(S) activations per layer (two all-to-alls); the state chain moves
O(d^2) per hop whatever S, so the recurrent layers take the model's layout as it is.

The chain is sequential: a rank waits for its S_in before its local work. It now carries only
what the parallel forms do not: fla-core's kernels (which give no piece composite), the per-document
states of Mamba1's selective scan and the RG-LRU (without documents their diagonal maps pass in
parallel: Note [Parallel state passing for diagonal recurrences]) and the convolution's per-document
histories. The package's torch
kernels pass the states in parallel instead, one all-gather each way (Note [Parallel state passing
across ranks] in lightning_seqpar.attention.scan; with packed documents one map per document
segment, Note [Parallel state passing with packed documents] there): on 4 H200s at 128K tokens (32
heads of 128) a gated DeltaNet layer's forward + backward went from 3,210 ms down the chain to 101
ms; with 16 packed documents, on 4 H100s, from 762 ms to 194 ms. SEQPAR_STATE_CHAIN=1 sends the
torch kernels' states down the chain anyway (the same results; for comparisons).

Note [Documents in a recurrence]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With packed documents every document must run as if alone: the state (and the convolution's
history) is zero at each document's first token, in the middle of a rank's shard as at its start,
and a document that spans several ranks keeps its own chain. The functions take the batch's
``PackedDocuments`` (the twins read ``current_documents()`` at forward time and pass them; the
piece lengths are bound into the chain's autograd Function then, so the backward, which may run
on another thread, reads nothing: Note [Per-call state] in ``lightning_seqpar.sharding.documents``).

Packed batches are sharded with the per-document zigzag (Note [Packed documents and per-document
zigzag]): global piece p is piece p of EVERY document, end to end, and rank r holds pieces r and
2W-1-r. So a piece of a sample is a run of segments, one per document (pieces[b, n, p] tokens,
possibly none), and the pieces are visited in the same chain as above (Note [State chain under
the zigzag layout]; the torch kernels of the delta rule and SSD fold the same per-document maps in
parallel instead: Note [Parallel state passing with packed documents] in scan.py). What travels is one state PER DOCUMENT, [B, N, H, Dk, Dv] (N: documents of
the widest sample): document n's state after its tokens so far, zero before its first one. A
piece starts each segment from its document's entering state, runs it, and hands on every
document's state (an empty segment passes its state through). States never mix across
documents, so nothing leaks from one document into the next, whichever rank either starts on.
The backward chain is the same Function's (LASP Alg. 3): d(state) per document. With documents
the layout must be "zigzag" (the per-document split; "contiguous" is refused by name, as the
attention op and the strategy refuse it).

Inside a piece, chunked kernels (Note [Chunked gated recurrences]): every segment starts a fresh
chunk, padded at its end to a multiple of c with no-op tokens (g = 0: no decay; k = v = q = 0 and
beta = 0: no write), so no chunk holds a boundary, the chunk formulas are unchanged, and the
state after a segment's last chunk is the state after its last token. The chunks of all segments
run in one blocked scan (Note [Blocked affine scan]) with the resets folded into the transitions:
where chunk j + 1 starts a segment, A_j = 0 and b_j = that segment's entering state. A per-token reset inside a
chunk (the decay multiplied to zero at a document start, g = -inf) is exact in the token
recurrence but makes the chunk's cumulative log decays -inf (their differences NaN) and needs a
mid-chunk injection of the entering state; the padding keeps the kernel as it is for at most
c - 1 idle tokens per segment. fla-core's varlen API (``cu_seqlens`` with one initial and one
final state per sequence) fits this segment form but is not wired yet: kernel="fla" is refused
with documents and kernel="auto" runs the torch kernels for them.

The short convolution's "state" is a document's last k-1 inputs (zeros before its start). With
documents it travels along the same chain, [B, N, k-1, C] per hop, instead of the one-shot halo:
pieces of short documents hold fewer than k-1 tokens (often none), so a window may reach back over
several ranks, which a chain covers exactly. Each segment is convolved over [its history; its
tokens] only, so no window crosses a document boundary; the backward sends d(history) back.

Communication is still independent of S but grows with the number of documents (every document
of 2W tokens or more crosses every hop under the per-document zigzag); for many short documents
re-laying the recurrent layers' activations out per rank (O(S) per layer) would be cheaper:
open, unmeasured.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.attention.comm import P2P, process_group
from lightning_seqpar.sharding.documents import PackedDocuments, exclusive_cumsum, segment_indices
from lightning_seqpar.sharding.layouts import LAYOUTS, chunk_ids, num_chunks

Kernel = Literal["auto", "torch", "fla"]
RECURRENT_KERNELS: tuple[str, ...] = ("auto", "torch", "fla")


# ---------------------------------------------------------------------------------------------
# layout geometry


def piece_owner(piece: int, world: int, layout: str) -> int:
    """The rank holding global piece ``piece``."""
    if layout == "contiguous" or piece < world:
        return piece
    return 2 * world - 1 - piece


# ---------------------------------------------------------------------------------------------
# the state chain (Note [Linear recurrences under sequence sharding])


class StateChain(torch.autograd.Function):
    """(out pieces concatenated) = chain of ``kernel(*piece_inputs, s_in) -> (out, s_out)`` over the ranks."""

    @staticmethod
    def forward(ctx, kernel, group_name: str, layout: str, state_shape: tuple[int, ...], *inputs: Tensor) -> Tensor:
        group = process_group(group_name)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        pieces, n = chunk_ids(rank, world, layout), num_chunks(world, layout)
        comm = P2P(group)
        split = [x.chunk(len(pieces), dim=1) for x in inputs]
        outs, s_ins, carried = [], [], None
        for i, p in enumerate(pieces):
            if p == 0:
                s_in = None
            elif piece_owner(p - 1, world, layout) == rank:
                s_in = carried
            else:
                s_in = inputs[0].new_zeros(state_shape)
                comm.wait(comm.post([], [(s_in, piece_owner(p - 1, world, layout))]))
            out, s_out = kernel(*(x[i] for x in split), s_in, piece=p)
            if p < n - 1 and piece_owner(p + 1, world, layout) != rank:
                comm.wait(comm.post([(s_out.contiguous(), piece_owner(p + 1, world, layout))], []))
            carried = s_out
            outs.append(out)
            s_ins.append(s_in)
        ctx.kernel, ctx.group_name, ctx.layout, ctx.state_shape = kernel, group_name, layout, state_shape
        # the backward recomputes each piece under the forward's autocast state (as torch.utils.checkpoint does)
        ctx.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cuda", "cpu")]
        ctx.has_state = [s is not None for s in s_ins]
        ctx.save_for_backward(*inputs, *(s for s in s_ins if s is not None))
        ctx.n_inputs = len(inputs)
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx, dout: Tensor):
        saved = ctx.saved_tensors
        inputs, states = saved[: ctx.n_inputs], list(saved[ctx.n_inputs:])
        s_ins = [states.pop(0) if has else None for has in ctx.has_state]
        group = process_group(ctx.group_name)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        pieces, n = chunk_ids(rank, world, ctx.layout), num_chunks(world, ctx.layout)
        comm = P2P(group)
        split = [x.chunk(len(pieces), dim=1) for x in inputs]
        douts = dout.chunk(len(pieces), dim=1)
        grads: list[list[Tensor | None]] = [[None] * len(pieces) for _ in inputs]
        carried = None  # d S_in of the local piece after this one
        for i in reversed(range(len(pieces))):
            p = pieces[i]
            if p == n - 1:
                ds_out = None
            elif piece_owner(p + 1, world, ctx.layout) == rank:
                ds_out = carried
            else:
                ds_out = inputs[0].new_zeros(ctx.state_shape)
                comm.wait(comm.post([], [(ds_out, piece_owner(p + 1, world, ctx.layout))]))
            leaves = [x[i].detach().requires_grad_() for x in split]
            s_in = None if s_ins[i] is None else s_ins[i].detach().requires_grad_()
            with torch.enable_grad(), contextlib.ExitStack() as stack:
                for device_type, enabled, dtype in ctx.autocast:
                    stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
                out, s_out = ctx.kernel(*leaves, s_in, piece=p)
                targets, seeds = [out], [douts[i]]
                if ds_out is not None:
                    targets.append(s_out)
                    seeds.append(ds_out)
                wrt = leaves + ([s_in] if s_in is not None else [])
                live = [(t, d) for t, d in zip(targets, seeds) if t.requires_grad]  # a first piece's zero state: none
                got = (torch.autograd.grad([t for t, _ in live], wrt, [d for _, d in live], allow_unused=True) if live
                       else [None] * len(wrt))
            for j in range(len(leaves)):
                grads[j][i] = torch.zeros_like(leaves[j]) if got[j] is None else got[j]
            ds_in = got[len(leaves)] if s_in is not None else None
            if p > 0 and piece_owner(p - 1, world, ctx.layout) != rank:
                comm.wait(comm.post([(ds_in.contiguous(), piece_owner(p - 1, world, ctx.layout))], []))
            carried = ds_in
        return (None, None, None, None, *(torch.cat(gs, dim=1) for gs in grads))


def state_chain(kernel, inputs: list[Tensor], state_shape: tuple[int, ...], mesh: DeviceMesh | None, layout: str) -> Tensor:
    if mesh is None or mesh.size() == 1:
        return kernel(*inputs, None, piece=0)[0]
    return StateChain.apply(kernel, mesh.get_group().group_name, layout, state_shape, *inputs)


def chain_forced() -> bool:
    """SEQPAR_STATE_CHAIN=1: every recurrence sends its states down the chain (the same results; for comparisons)."""
    return os.environ.get("SEQPAR_STATE_CHAIN", "0") == "1"


# ---------------------------------------------------------------------------------------------
# packed documents: every segment starting a fresh chunk (Note [Documents in a recurrence])


def segment_layout(lengths: Tensor, T: int, c: int) -> dict[str, Tensor]:
    """Where the tokens of each segment go when every segment starts a fresh chunk (Note [Documents in a recurrence]).

    lengths: int64 [B, N] on the CPU, each row summing to T (segment n of sample b: the next lengths[b, n]
    tokens of the piece). Returns ``gather`` [Tp] (the row of the flattened [B * T + 1] tokens, B * T
    a zero row, that lands at each padded position), ``scatter`` [B * T] (the padded position of
    every token), and per chunk of the padded sequence its segment (flat b * N + n), first / last flags.
    """
    B, N = lengths.shape
    flat = lengths.reshape(-1)
    n_chunks = -(-flat // c)  # (B N,)
    starts = (torch.arange(B)[:, None] * T + exclusive_cumsum(lengths, 1)).reshape(-1)  # first flat token of each segment
    pstarts = exclusive_cumsum(n_chunks, 0) * c  # first padded position of each segment
    src = segment_indices(starts, flat)
    dst = segment_indices(pstarts, flat)
    Tp = int(n_chunks.sum()) * c
    gather = torch.full((Tp,), B * T, dtype=torch.int64)
    gather[dst] = src
    scatter = torch.empty(B * T, dtype=torch.int64)
    scatter[src] = dst
    seg = torch.repeat_interleave(torch.arange(B * N), n_chunks)
    first = torch.zeros(len(seg), dtype=torch.bool)
    first[exclusive_cumsum(n_chunks, 0)[n_chunks > 0]] = True
    last = torch.zeros(len(seg), dtype=torch.bool)
    last[(torch.cumsum(n_chunks, 0) - 1)[n_chunks > 0]] = True
    return {"gather": gather, "scatter": scatter, "seg": seg, "first": first, "last": last}


# ---------------------------------------------------------------------------------------------
# validation (local metadata only, before any collective)


def check_documents(documents: PackedDocuments | None, batch: int, local_len: int, mesh: DeviceMesh | None,
                    layout: str) -> Tensor | None:
    """The documents' piece lengths [B, N, P] (CPU), after checking they fit this shard; None without documents."""
    if documents is None:
        return None
    if not isinstance(documents, PackedDocuments):
        raise ValueError(f"documents must be a lightning_seqpar.sharding.documents.PackedDocuments or None, got {type(documents).__name__}")
    world = 1 if mesh is None else mesh.size()
    if world > 1 and layout != "zigzag":
        raise ValueError(f"documents are sharded with the per-document zigzag (PackedDocuments.shard); layout={layout!r} "
                         "must be 'zigzag'")
    documents.check(batch=batch, local_len=local_len, world=world)
    return documents.pieces


def check_mesh_layout(mesh: DeviceMesh | None, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; expected one of {LAYOUTS}")
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got {type(mesh).__name__}")
        if mesh.ndim != 1:
            raise ValueError(f"recurrent layers need a 1-D mesh of the sequence-parallel ranks; got ndim={mesh.ndim}, "
                             f"names={tuple(mesh.mesh_dim_names or ())} (head parallelism does not apply to them)")


def pieces_of(T: int, mesh: DeviceMesh | None, layout: str) -> int:
    if mesh is None or mesh.size() == 1:
        return 1
    p = len(chunk_ids(0, mesh.size(), layout))
    if T % p:
        raise ValueError(f"layout={layout!r} gives every rank {p} pieces of equal length, but the local sequence length "
                         f"is {T}; shard with lightning_seqpar.sharding.shard_sequence")
    return p


# Note [Recurrences in fp32 under autocast]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The recurrences' torch kernels compute in fp32 (their inputs cast to fp32 on entry, whatever the
# caller's dtype). Under torch.autocast (Lightning's "bf16-mixed") every matmul inside would run in
# bf16 instead: the state, carried over thousands of chunks, would be rounded to bf16 at every step,
# the kernels' mixed dtypes would meet in the scans' index copies, and a chain piece recomputed in
# the backward (outside autocast) would not be the forward's. So the public recurrences run with
# autocast off (cuda and cpu); their outputs are fp32 or the input's dtype as each documents.
# (fla-core's kernels keep their state in fp32 too.) causal_conv1d is not wrapped: it computes in
# the weight's dtype as transformers' Conv1d does, under autocast as well.


def in_fp32(fn: Callable) -> Callable:
    """Run a public recurrence with autocast off (Note [Recurrences in fp32 under autocast])."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def check_tokens(name: str, x: Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or tuple(x.shape) != shape:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating-point tensor of shape {shape}, got {got}")


"""Sequence-parallel token mixers that are not softmax attention: the short causal convolution,
the gated delta rule (gated DeltaNet, Qwen3-Next) and Mamba2's state-space duality (SSD) scan —
exact under sequence sharding, with the contiguous and the zigzag layout.

Public names:

* :func:`causal_conv1d` — depthwise causal convolution over sequence shards (halo exchange).
* :func:`gated_delta_rule` — the gated delta rule over sequence shards (state passing).
* :func:`ssd_scan` — Mamba2's selective scan (scalar decay per head and token) over sequence shards.
* :func:`selective_scan` — Mamba1's selective scan (decay per channel and state index) over sequence
  shards (Note [Mamba1's selective scan under sequence sharding]).
* :func:`diagonal_recurrence` — a diagonal linear recurrence (RecurrentGemma's RG-LRU) over sequence
  shards, and :func:`sequence_starts` (where its state starts from zero: Note [Diagonal linear
  recurrences under sequence sharding]).
* :func:`gated_delta_rule_chunked`, :func:`ssd_scan_chunked` — the one-device kernels (pure torch,
  chunked, the chunk states by the blocked scan of :mod:`lightning_seqpar.attention.scan`; ``fla-core``
  on CUDA when installed), with an initial state in and the final state out.
* :class:`Recurrence` — a parameter-free module that the model's token mixers call; ``configure``
  gives it the sequence-parallel mesh and layout (as :class:`lightning_seqpar.attention.Attention`).

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

Note [Halo exchange for the short convolution]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A causal depthwise convolution of kernel k reads the current and the k-1 previous inputs. Each
piece needs the last k-1 inputs of the previous piece (zeros before the first piece): one
message of [B, k-1, C] from the owner of the previous piece, all posted at once (no chain); the
backward sends the gradient of the halo back to its owner, which adds it to the gradient of its
last k-1 inputs. Pieces shorter than k-1 tokens would need several predecessors and are refused.

Note [Documents in a recurrence]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With packed documents every document must run as if alone: the state (and the convolution's
history) is zero at each document's first token, in the middle of a rank's shard as at its start,
and a document that spans several ranks keeps its own chain. The functions take the batch's
``PackedDocuments`` (the twins read ``current_documents()`` at forward time and pass them; the
piece lengths are bound into the chain's autograd Function then, so the backward, which may run
on another thread, reads nothing: Note [Per-call state] in ``lightning_seqpar.documents``).

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
import importlib.util
import os
from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.attention.comm import P2P, AllGatherStacked, process_group
from lightning_seqpar.attention.scan import Segments, affine_scan, segment_scan
from lightning_seqpar.documents import PackedDocuments, current_documents, exclusive_cumsum, segment_indices
from lightning_seqpar.sharding import LAYOUTS, chunk_ids, in_global_order, num_chunks

__all__ = [
    "RECURRENT_KERNELS",
    "Recurrence",
    "causal_conv1d",
    "diagonal_recurrence",
    "gated_delta_rule",
    "gated_delta_rule_chunked",
    "selective_scan",
    "sequence_starts",
    "ssd_scan",
    "ssd_scan_chunked",
]

Kernel = Literal["auto", "torch", "fla"]
RECURRENT_KERNELS: tuple[str, ...] = ("auto", "torch", "fla")
_ACTIVATIONS: dict[str | None, Callable[[Tensor], Tensor]] = {None: lambda x: x, "silu": F.silu, "swish": F.silu}


# ---------------------------------------------------------------------------------------------
# one-device chunked kernels (pure torch, fp32): Note [Chunked gated recurrences]
#
# Note [Chunked gated recurrences]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In a chunk of c tokens with entering state S_0 and G_t = g_1 + ... + g_t (log decays):
#   scalar gate (SSD):   o_t = e^{G_t} q_t^T S_0 + sum_{s<=t} e^{G_t-G_s} (q_t . k_s) v_s
#                        S_c = e^{G_c} S_0 + sum_s e^{G_c-G_s} k_s v_s^T
#   delta rule: the same with v_s replaced by the written values w_s, where
#        w_t = b_t (v_t - e^{G_t} S_0^T k_t - sum_{s<t} e^{G_t-G_s} (k_t . k_s) w_s)
#   i.e. (I + L) W = b V - (b e^{G} K) S_0 with L_ts = b_t e^{G_t-G_s} (k_t . k_s), s < t: one
#   unit-lower-triangular solve per chunk (the UT transform of DeltaNet, Yang et al. 2024 §3).
# The decays e^{G_t - G_s} are formed only for s <= t (masked before exp: no overflow).
#
# A decay per key dimension (Kimi Delta Attention, Kimi Linear §2: S_t = Diag(a_t) (I - b_t k_t k_t^T) S_{t-1}
# + b_t k_t v_t^T with a_t = exp(g_t), g_t in R^Dk) is the same with G_t a vector: the scalar e^{G_t} S_0
# becomes Diag(e^{G_t}) S_0 (q_t and k_t scaled per dimension), and every pair product
# e^{G_t-G_s} (x_t . k_s) becomes sum_d x_td k_sd e^{G_td-G_sd}: a [c, c, Dk] tensor of decays per
# chunk (still masked before exp). The state chain, the documents and the segment padding (g = 0)
# are unchanged: only the per-chunk terms differ.


def _chunk(x: Tensor, c: int) -> Tensor:
    """[B, T, H, *D] fp32 -> [B, H, N, c, *D], zero-padded at the end."""
    B, T = x.shape[:2]
    n = -(-T // c)
    x = x.float().movedim(1, 2)  # (B, H, T, *D)
    if n * c != T:
        pad = [0, 0] * (x.dim() - 3) + [0, n * c - T]
        x = F.pad(x, pad)
    return x.reshape(*x.shape[:2], n, c, *x.shape[3:])


def _chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, c: int) -> dict[str, Tensor]:
    """The per-chunk terms of Note [Chunked gated recurrences] (everything but the chunk-to-chunk recurrence).

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; g: [B, T, H] log decay; beta: [B, T, H] or None (SSD).
    """
    qc, kc, vc = _chunk(q, c), _chunk(k, c), _chunk(v, c)  # (B, H, N, c, D)
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    if g.dim() == 4:  # a decay per key dimension (Kimi Delta Attention)
        G = _chunk(g, c).cumsum(3)  # (B, H, N, c, Dk); padding has g = 0 (no decay) and k = v = 0 (no update)
        diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~tri[..., None], float("-inf"))
        decay = diff.exp()  # (B, H, N, c, c, Dk): e^{G_t - G_s} per dimension, s <= t

        def pairs(x: Tensor, y: Tensor) -> Tensor:  # sum_d x_td y_sd e^{G_td - G_sd}: (B, H, N, c, c)
            return torch.einsum("bhntd,bhnsd,bhntsd->bhnts", x, y, decay)

        eG = G.exp()  # (B, H, N, c, Dk)
        terms = {"q": qc * eG, "eG_last": eG[..., -1, :, None],  # (B, H, N, Dk, 1): Diag(e^{G_c}) S
                 "k_out": kc * (G[..., -1:, :] - G).exp()}  # e^{G_c - G_s} * k_s
    else:
        G = _chunk(g, c).cumsum(-1)  # (B, H, N, c)
        diff = (G[..., :, None] - G[..., None, :]).masked_fill(~tri, float("-inf"))
        decay = diff.exp()  # (B, H, N, c, c): e^{G_t - G_s}, s <= t

        def pairs(x: Tensor, y: Tensor) -> Tensor:
            return (x @ y.transpose(-1, -2)) * decay

        eG = G.exp()[..., None]  # (B, H, N, c, 1)
        terms = {"q": qc * eG, "eG_last": eG[..., -1:, :],  # (B, H, N, 1, 1)
                 "k_out": kc * (G[..., -1:] - G).exp()[..., None]}  # e^{G_c - G_s} k_s
    terms["scores"] = pairs(qc, kc)  # (B, H, N, c, c)
    if beta is None:
        terms["u"] = vc
    else:
        bc = _chunk(beta, c)[..., None]  # (B, H, N, c, 1)
        strict = pairs(kc, kc) * bc
        system = strict.tril(-1) + torch.eye(c, dtype=strict.dtype, device=q.device)  # I + L (strictly lower L)
        terms["u"] = torch.linalg.solve_triangular(system, bc * vc, upper=False, unitriangular=True)  # (B, H, N, c, Dv)
        terms["wk"] = torch.linalg.solve_triangular(system, bc * eG * kc, upper=False, unitriangular=True)  # (B, H, N, c, Dk)
    return terms


def _chunked_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, initial: Tensor | None,
                  chunk_size: int, pieces: int = 1, group_name: str | None = None,
                  layout: str = "zigzag") -> tuple[Tensor, Tensor]:
    """(out [B, T, H, Dv] fp32, the state after every piece [pieces, B, H, Dk, Dv] fp32 — one device: [B, H, Dk, Dv]).

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; g: [B, T, H] (or [B, T, H, Dk]) log decay; beta: [B, T, H] or None
    (SSD). The chunk terms of every chunk at once, then the blocked state scan (Note [Blocked affine scan]);
    with ``group_name`` the T tokens are this rank's ``pieces`` pieces and the states pass across the
    ranks (Note [Parallel state passing across ranks]). Differentiable in every input and ``initial``.
    """
    B, T, H, Dk = q.shape
    Dv, n = v.shape[-1], T // pieces

    def split(x: Tensor) -> Tensor:  # [B, T, *D] -> [P B, T / P, *D]: every piece its own chunks
        return x.reshape(B, pieces, n, *x.shape[2:]).transpose(0, 1).reshape(pieces * B, n, *x.shape[2:])

    terms = _chunk_terms(split(q), split(k), split(v), split(g), None if beta is None else split(beta), chunk_size)
    u, K, W = terms["u"], terms["k_out"], terms.get("wk")  # (P B, H, N, c, D)
    per_piece = lambda x: None if x is None else x.reshape(pieces, B, *x.shape[1:])  # noqa: E731
    h_all, h_out = affine_scan(per_piece(terms["eG_last"]), per_piece(K if W is not None else None), per_piece(W),
                               per_piece(K.mT @ u), initial if initial is None else initial.float(),
                               group_name=group_name, layout=layout)
    h_all = h_all.reshape(pieces * B, *h_all.shape[2:])  # (P B, H, N, Dk, Dv): the state entering every chunk
    w = u if W is None else u - W @ h_all
    out = terms["scores"] @ w + terms["q"] @ h_all  # (P B, H, N, c, Dv)
    out = out.reshape(pieces * B, H, -1, Dv)[:, :, :n].transpose(1, 2)  # (P B, n, H, Dv)
    out = out.reshape(pieces, B, n, H, Dv).transpose(0, 1).reshape(B, T, H, Dv)
    return out, (h_out[0] if group_name is None else h_out)


def _segment_layout(lengths: Tensor, T: int, c: int) -> dict[str, Tensor]:
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


def _padded(x: Tensor, gather: Tensor) -> Tensor:
    """[B, T, *D] -> [1, Tp, *D] fp32 along ``_segment_layout``'s ``gather``: each segment starting a chunk, zeros
    between."""
    x = x.float().reshape(-1, *x.shape[2:])
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[gather][None]


def _chunked_scan_segments(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, initial: Tensor | None,
                           lengths: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The scan of every segment alone from its own entering state (Note [Documents in a recurrence]).

    lengths: int64 [B, N] (CPU) segment lengths, rows summing to T; initial: [B, N, H, Dk, Dv] or None
    (zero). Returns (out [B, T, H, Dv] fp32, the state after each segment [B, N, H, Dk, Dv] fp32;
    an empty segment passes its entering state through).
    """
    B, T, H, Dk = q.shape
    N, Dv, c = lengths.shape[1], v.shape[-1], chunk_size
    lay = {name: x.to(q.device) for name, x in _segment_layout(lengths, T, c).items()}
    padded = functools.partial(_padded, gather=lay["gather"])

    terms = _chunk_terms(padded(q), padded(k), padded(v), padded(g), None if beta is None else padded(beta), c)
    init = q.new_zeros(B * N, H, Dk, Dv, dtype=torch.float32) if initial is None else initial.float().reshape(B * N, H, Dk, Dv)
    n_chunks = lay["seg"].numel()
    if n_chunks == 0:  # every segment empty: each passes its entering state through
        return q.new_zeros(B, T, H, Dv, dtype=torch.float32), init.reshape(B, N, H, Dk, Dv)
    # one scan over every chunk of every segment (Note [Blocked affine scan]), the resets folded into the transitions:
    # where chunk j + 1 starts a segment, A_j = 0 and b_j = that segment's entering state
    u, K, W, e = terms["u"][0], terms["k_out"][0], terms.get("wk"), terms["eG_last"][0]  # (H, NC, ...)
    W = None if W is None else W[0]
    b = K.mT @ u  # (H, NC, Dk, Dv)
    starts = lay["first"][1:]  # (NC - 1,): chunk j + 1 starts a segment
    keep = torch.cat([~starts, starts.new_ones(1)]).to(e.dtype)[:, None, None]  # (NC, 1, 1)
    enter = torch.cat([init[lay["seg"][1:]].transpose(0, 1), b.new_zeros(H, 1, Dk, Dv)], dim=1)  # (H, NC, Dk, Dv)
    b_reset = b * keep + enter * (1 - keep)
    h_all, _ = affine_scan((e * keep)[None, None], None if W is None else (K * keep)[None, None],
                           None if W is None else W[None, None], b_reset[None, None], init[lay["seg"][0]][None])
    h_all = h_all[0, 0]  # (H, NC, Dk, Dv): the state entering every chunk
    w = u if W is None else u - W @ h_all
    out = terms["scores"][0] @ w + terms["q"][0] @ h_all  # (H, NC, c, Dv)
    out = out.reshape(H, -1, Dv).transpose(0, 1)[lay["scatter"]]  # (B T, H, Dv)
    # every non-empty segment's leaving state: its last chunk's transition (without the reset) of its entering state
    last = lay["last"].nonzero()[:, 0]
    h_last = h_all[:, last]
    Ah = e[:, last] * h_last if W is None else e[:, last] * h_last - K[:, last].mT @ (W[:, last] @ h_last)
    finals = init.index_copy(0, lay["seg"][last], (Ah + b[:, last]).transpose(0, 1))
    return out.reshape(B, T, H, Dv), finals.reshape(B, N, H, Dk, Dv)


def _chunked_scan_documents(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, pieces: Tensor,
                            chunk_size: int, group_name: str, layout: str) -> Tensor:
    """Every local piece of packed documents at once, the states passing across the ranks in parallel
    (Note [Parallel state passing with packed documents] in ``scan.py``). ``pieces``: int64 [B, N, P] (CPU) the
    segment lengths of this rank's P pieces (in local order). Returns out [B, T, H, Dv] fp32."""
    B, T, H, Dk = q.shape
    N, P, Dv, c = pieces.shape[1], pieces.shape[2], v.shape[-1], chunk_size
    n = T // P

    def split(x: Tensor) -> Tensor:  # [B, T, *D] -> [P B, T / P, *D]: every piece its own segments
        return x.reshape(B, P, n, *x.shape[2:]).transpose(0, 1).reshape(P * B, n, *x.shape[2:])

    lay = _segment_layout(pieces.permute(2, 0, 1).reshape(P * B, N), n, c)  # flat segment (p B + b) N + n
    idx = {name: lay[name].to(q.device) for name in ("gather", "scatter")}

    def padded(x: Tensor) -> Tensor:
        return _padded(split(x), idx["gather"])

    terms = _chunk_terms(padded(q), padded(k), padded(v), padded(g), None if beta is None else padded(beta), c)
    u, K, W, e = terms["u"][0], terms["k_out"][0], terms.get("wk"), terms["eG_last"][0]  # (H, NC, ...)
    W = None if W is None else W[0]
    segs = Segments(lay["seg"], lay["first"].nonzero()[:, 0], lay["last"].nonzero()[:, 0], (P, B, N), q.device)
    h_all = segment_scan(e, None if W is None else K, W, K.mT @ u, segs, group_name=group_name, layout=layout)
    w = u if W is None else u - W @ h_all
    out = terms["scores"][0] @ w + terms["q"][0] @ h_all  # (H, NC, c, Dv)
    out = out.reshape(H, -1, Dv).transpose(0, 1)[idx["scatter"]]  # (P B n, H, Dv)
    return out.reshape(P, B, n, H, Dv).transpose(0, 1).reshape(B, T, H, Dv)


# fla path: thin, marked, tested on GPU by tests/test_recurrent.py::test_fla_kernels_match_torch


@functools.cache
def _fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


@functools.cache
def _fla_unusable(device_index: int | None) -> str | None:
    """Why fla-core's gated kernels cannot run on this CUDA device, or None.

    fla-core (0.6) refuses, in the backward, Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs (its
    issue #640: wrong results of the gated chunk_bwd_dqkwg kernel) unless tilelang is installed:
    the torch 2.11 image ships Triton 3.6.0. Checked here so that kernel="auto" takes the torch
    kernels instead of failing in the first backward."""
    import triton

    major, _ = torch.cuda.get_device_capability(device_index)
    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    if major == 9 and (3, 4, 0) <= version < (3, 7, 1) and importlib.util.find_spec("tilelang") is None:
        return (f"fla-core's gated kernels give wrong gradients with Triton {triton.__version__} on Hopper (fla issue #640; "
                "it refuses them): install Triton >= 3.7.1 or tilelang")
    return None


def _resolve_kernel(kernel: str, device: torch.device, documents: bool = False) -> str:
    if kernel not in RECURRENT_KERNELS:
        raise ValueError(f"kernel={kernel!r} is not supported; expected one of {RECURRENT_KERNELS}")
    if documents:  # Note [Documents in a recurrence]: the torch kernels only
        if kernel == "fla":
            raise ValueError("kernel='fla' does not take packed documents here (the per-document state reset runs in the "
                             "package's torch kernels); use kernel='torch' or 'auto' (which runs them for packed documents)")
        return "torch"
    usable = device.type == "cuda" and _fla_installed()
    why = _fla_unusable(device.index) if usable else None
    if kernel == "auto":
        return "fla" if usable and why is None else "torch"
    if kernel == "fla" and not usable:
        raise ValueError(f"kernel='fla' needs CUDA tensors and fla-core (pip install fla-core); got device={device}, "
                         f"fla installed={_fla_installed()}; use kernel='torch' or 'auto'")
    if kernel == "fla" and why is not None:
        raise ValueError(f"kernel='fla': {why}; or use kernel='torch' / 'auto'")
    return kernel


def _scan(q, k, v, g, beta, initial, chunk_size, kernel) -> tuple[Tensor, Tensor]:
    """Dispatch to the torch or the fla kernel; fp32 out and state."""
    if kernel == "fla":  # fla path: fla's own autograd Functions (they take the final-state gradient)
        if beta is None:
            from fla.ops.simple_gla import chunk_simple_gla

            out, state = chunk_simple_gla(q, k, v, g=g.float(), scale=1.0, initial_state=initial, output_final_state=True)
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            out, state = chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta, scale=1.0, initial_state=initial,
                                                output_final_state=True)
        return out.float(), state.float()
    return _chunked_scan(q, k, v, g, beta, initial, chunk_size)


# ---------------------------------------------------------------------------------------------
# layout geometry


def _owner(piece: int, world: int, layout: str) -> int:
    """The rank holding global piece ``piece``."""
    if layout == "contiguous" or piece < world:
        return piece
    return 2 * world - 1 - piece


# ---------------------------------------------------------------------------------------------
# the state chain (Note [Linear recurrences under sequence sharding])


class _StateChain(torch.autograd.Function):
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
            elif _owner(p - 1, world, layout) == rank:
                s_in = carried
            else:
                s_in = inputs[0].new_zeros(state_shape)
                comm.wait(comm.post([], [(s_in, _owner(p - 1, world, layout))]))
            out, s_out = kernel(*(x[i] for x in split), s_in, piece=p)
            if p < n - 1 and _owner(p + 1, world, layout) != rank:
                comm.wait(comm.post([(s_out.contiguous(), _owner(p + 1, world, layout))], []))
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
            elif _owner(p + 1, world, ctx.layout) == rank:
                ds_out = carried
            else:
                ds_out = inputs[0].new_zeros(ctx.state_shape)
                comm.wait(comm.post([], [(ds_out, _owner(p + 1, world, ctx.layout))]))
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
            if p > 0 and _owner(p - 1, world, ctx.layout) != rank:
                comm.wait(comm.post([(ds_in.contiguous(), _owner(p - 1, world, ctx.layout))], []))
            carried = ds_in
        return (None, None, None, None, *(torch.cat(gs, dim=1) for gs in grads))


def _chain(kernel, inputs: list[Tensor], state_shape: tuple[int, ...], mesh: DeviceMesh | None, layout: str) -> Tensor:
    if mesh is None or mesh.size() == 1:
        return kernel(*inputs, None, piece=0)[0]
    return _StateChain.apply(kernel, mesh.get_group().group_name, layout, state_shape, *inputs)


# ---------------------------------------------------------------------------------------------
# the halo exchange (Note [Halo exchange for the short convolution])


class _Halo(torch.autograd.Function):
    """x [B, T, C] -> halos [P, B, width, C]: the last ``width`` inputs before each local piece."""

    @staticmethod
    def forward(ctx, x: Tensor, width: int, group_name: str, layout: str) -> Tensor:
        group = process_group(group_name)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        pieces, n = chunk_ids(rank, world, layout), num_chunks(world, layout)
        parts = x.chunk(len(pieces), dim=1)
        halos = x.new_zeros((len(pieces), x.shape[0], width, x.shape[2]))
        sends, recvs = [], []
        for i, p in enumerate(pieces):
            if p > 0:
                src = _owner(p - 1, world, layout)
                if src == rank:
                    halos[i] = parts[i - 1][:, -width:]
                else:
                    recvs.append((halos[i], src))
            if p < n - 1 and _owner(p + 1, world, layout) != rank:
                sends.append((parts[i][:, -width:].contiguous(), _owner(p + 1, world, layout)))
        comm = P2P(group)
        comm.wait(comm.post(sends, recvs))
        ctx.args = (width, group_name, layout, x.shape[1])
        return halos

    @staticmethod
    def backward(ctx, dhalos: Tensor):
        width, group_name, layout, T = ctx.args
        group = process_group(group_name)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        pieces, n = chunk_ids(rank, world, layout), num_chunks(world, layout)
        P, B, _, C = dhalos.shape
        dtails = dhalos.new_zeros(P, B, width, C)  # gradient of each local piece's last `width` inputs
        sends, recvs = [], []
        for i, p in enumerate(pieces):
            if p > 0:
                dst = _owner(p - 1, world, layout)
                if dst == rank:
                    dtails[i - 1] += dhalos[i]
                else:
                    sends.append((dhalos[i].contiguous(), dst))
            if p < n - 1 and _owner(p + 1, world, layout) != rank:
                buf = dhalos.new_zeros(B, width, C)
                recvs.append((buf, _owner(p + 1, world, layout)))
        comm = P2P(group)
        comm.wait(comm.post(sends, recvs))
        received = iter(buf for buf, _ in recvs)
        for i, p in enumerate(pieces):
            if p < n - 1 and _owner(p + 1, world, layout) != rank:
                dtails[i] += next(received)
        return _tails_to_input(dtails, T), None, None, None


def _tails_to_input(dtails: Tensor, T: int) -> Tensor:
    """[P, B, width, C] gradients of each piece's last ``width`` rows -> [B, T, C]."""
    P, B, width, C = dtails.shape
    per = T // P
    dx = dtails.new_zeros(B, P, per, C)
    dx[:, :, per - width:] = dtails.transpose(0, 1)
    return dx.reshape(B, T, C)


# ---------------------------------------------------------------------------------------------
# the short convolution with packed documents (Note [Documents in a recurrence])


def _extended_layout(lengths: Tensor, T: int, width: int) -> dict[str, Tensor]:
    """Each segment's rows preceded by its ``width`` history rows, segments end to end.

    lengths: int64 [B, N] (CPU), rows summing to T. Rows are numbered as in ``cat([x.reshape(B * T, C),
    history.reshape(B * N * width, C)])``. Returns ``gather`` [E] (the row at each extended position),
    ``token`` [B * T] (the extended position of every token) and ``tail`` [B * N * width] (the
    extended positions of the last ``width`` rows of every segment: its history for what follows).
    """
    B, N = lengths.shape
    flat = lengths.reshape(-1)
    block = flat + width
    estart = exclusive_cumsum(block, 0)  # (B N,)
    starts = (torch.arange(B)[:, None] * T + exclusive_cumsum(lengths, 1)).reshape(-1)
    j = torch.arange(width)
    hist_pos = (estart[:, None] + j).reshape(-1)  # where each history row goes
    tok_pos = segment_indices(estart + width, flat)
    src = segment_indices(starts, flat)
    gather = torch.empty(int(block.sum()), dtype=torch.int64)
    gather[hist_pos] = B * T + torch.arange(B * N * width)
    gather[tok_pos] = src
    token = torch.empty(B * T, dtype=torch.int64)
    token[src] = tok_pos
    tail = (estart[:, None] + flat[:, None] + j).reshape(-1)
    return {"gather": gather, "token": token, "tail": tail}


def _extended(x: Tensor, history: Tensor, lengths: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """x [B, T, C], history [B, N, width, C] -> the extended rows [E, C] and their layout."""
    B, T, C = x.shape
    lay = {n: i.to(x.device) for n, i in _extended_layout(lengths, T, history.shape[2]).items()}
    return torch.cat([x.reshape(B * T, C), history.reshape(-1, C)])[lay["gather"]], lay


def _tail_kernel(x: Tensor, s_in: Tensor | None, *, piece: int, pieces: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """One piece of the convolution's history chain: (its entering histories [B, N * width, C], leaving histories
    [B, N, width, C]); the history of a document is its last ``width`` inputs so far (zeros before its start)."""
    B, _, C = x.shape
    lengths = pieces[:, :, piece]
    N = lengths.shape[1]
    if s_in is None:
        s_in = x.new_zeros(B, N, width, C)
    rows, lay = _extended(x, s_in, lengths)
    return s_in.reshape(B, N * width, C), rows[lay["tail"]].reshape(B, N, width, C)


def _conv_segments(x: Tensor, history: Tensor, lengths: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """The causal conv of every segment of x [B, T, C] over its own history [B, N, width, C] only."""
    B, T, C = x.shape
    rows, lay = _extended(x, history, lengths)  # (E, C)
    out = F.conv1d(rows.t()[None], weight[:, None], bias, groups=C)[0].t()  # (E - width, C): row e ends at e + width
    return out[lay["token"] - history.shape[2]].reshape(B, T, C)


# ---------------------------------------------------------------------------------------------
# validation (local metadata only, before any collective)


def _check_documents(documents: PackedDocuments | None, batch: int, local_len: int, mesh: DeviceMesh | None,
                     layout: str) -> Tensor | None:
    """The documents' piece lengths [B, N, P] (CPU), after checking they fit this shard; None without documents."""
    if documents is None:
        return None
    if not isinstance(documents, PackedDocuments):
        raise ValueError(f"documents must be a lightning_seqpar.documents.PackedDocuments or None, got {type(documents).__name__}")
    world = 1 if mesh is None else mesh.size()
    if world > 1 and layout != "zigzag":
        raise ValueError(f"documents are sharded with the per-document zigzag (PackedDocuments.shard); layout={layout!r} "
                         "must be 'zigzag'")
    documents.check(batch=batch, local_len=local_len, world=world)
    return documents.pieces


def _check_mesh_layout(mesh: DeviceMesh | None, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; expected one of {LAYOUTS}")
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh or None, got {type(mesh).__name__}")
        if mesh.ndim != 1:
            raise ValueError(f"recurrent layers need a 1-D mesh of the sequence-parallel ranks; got ndim={mesh.ndim}, "
                             f"names={tuple(mesh.mesh_dim_names or ())} (head parallelism does not apply to them)")


def _pieces_of(T: int, mesh: DeviceMesh | None, layout: str) -> int:
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


def _fp32(fn: Callable) -> Callable:
    """Run a public recurrence with autocast off (Note [Recurrences in fp32 under autocast])."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


def _check_tokens(name: str, x: Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or tuple(x.shape) != shape:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a floating-point tensor of shape {shape}, got {got}")


# ---------------------------------------------------------------------------------------------
# public functions


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, activation: str | None = None,
                  mesh: DeviceMesh | None = None, layout: Literal["zigzag", "contiguous"] = "zigzag",
                  documents: PackedDocuments | None = None) -> Tensor:
    """Depthwise causal convolution of kernel k over the sequence (shards): ``out_t = act(bias +
    sum_j weight[:, j] x_{t-k+1+j})``, zero before the first token (Note [Halo exchange for the short
    convolution]).

    Args:
        x: ``[B, T_local, C]`` — this rank's shard (``layout``); weight ``[C, k]``; bias ``[C]`` or None.
        activation: None or "silu".
        mesh: the sequence-parallel ranks (1-D), or None / one rank: the whole sequence on one device.
        documents: packed documents (built with ``world`` = the mesh size; x sharded by
            ``PackedDocuments.shard``, layout "zigzag"): no window reaches into the previous
            document (Note [Documents in a recurrence]).

    Returns:
        ``[B, T_local, C]`` in x's dtype, computed in the weight's dtype as transformers does.
    """
    _check_mesh_layout(mesh, layout)
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not supported; expected one of {tuple(_ACTIVATIONS)}")
    if x.dim() != 3 or weight.dim() != 2 or weight.shape[0] != x.shape[2]:
        raise ValueError(f"x must be [B, T, C] and weight [C, k] with the same C; got x={tuple(x.shape)}, weight={tuple(weight.shape)}")
    width = weight.shape[1] - 1
    P = _pieces_of(x.shape[1], mesh, layout)
    pieces = _check_documents(documents, x.shape[0], x.shape[1], mesh, layout)
    xs = x.to(weight.dtype)
    if pieces is not None and width:
        B, T, C = xs.shape
        N = pieces.shape[1]
        if mesh is None or mesh.size() == 1:
            history = xs.new_zeros(P, B, N * width, C)
            ids = [0]
        else:
            kernel = functools.partial(_tail_kernel, pieces=pieces, width=width)
            history = _StateChain.apply(kernel, mesh.get_group().group_name, layout, (B, N, width, C), xs)
            history = torch.stack(history.chunk(P, dim=1))  # (P, B, N width, C)
            ids = chunk_ids(mesh.get_local_rank(), mesh.size(), layout)
        outs = [_conv_segments(part, history[i].reshape(B, N, width, C), pieces[:, :, ids[i]], weight, bias)
                for i, part in enumerate(xs.chunk(P, dim=1))]
        return _ACTIVATIONS[activation](torch.cat(outs, dim=1)).to(x.dtype)
    if P == 1 and (mesh is None or mesh.size() == 1):
        padded = [F.pad(xs, (0, 0, width, 0))]
    else:
        if width > x.shape[1] // P:
            raise ValueError(f"a convolution of kernel {width + 1} needs the {width} previous tokens of every piece, but "
                             f"the pieces of layout={layout!r} hold {x.shape[1] // P} tokens; use shorter kernels, fewer "
                             "ranks or longer sequences")
        halos = _Halo.apply(xs, width, mesh.get_group().group_name, layout) if width else None  # (P, B, width, C)
        parts = xs.chunk(P, dim=1)
        padded = [parts[i] if halos is None else torch.cat([halos[i], parts[i]], dim=1) for i in range(P)]
    outs = [F.conv1d(p.transpose(1, 2), weight[:, None], bias, groups=weight.shape[0]).transpose(1, 2) for p in padded]
    return _ACTIVATIONS[activation](torch.cat(outs, dim=1)).to(x.dtype)


def gated_delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, initial_state: Tensor | None = None,
                             chunk_size: int = 64, kernel: Kernel = "auto") -> tuple[Tensor, Tensor]:
    """The gated delta rule on one device (Note [Chunked gated recurrences]); q already normalised and scaled.

    q, k ``[B, T, H, Dk]``, v ``[B, T, H, Dv]``, g (log decay, <= 0) and beta ``[B, T, H]``;
    initial_state ``[B, H, Dk, Dv]`` or None. Returns ``(out [B, T, H, Dv] fp32, final state fp32)``.
    """
    return _scan(q, k, v, g, beta, initial_state, chunk_size, _resolve_kernel(kernel, q.device))


def ssd_scan_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, *, initial_state: Tensor | None = None,
                     chunk_size: int = 64, kernel: Kernel = "auto") -> tuple[Tensor, Tensor]:
    """Scalar-gated linear attention on one device (Mamba2 SSD with q = C, k = B, v = dt x, g = dt A)."""
    return _scan(q, k, v, g, None, initial_state, chunk_size, _resolve_kernel(kernel, q.device))


def _check_scan(q, k, v, g, beta, chunk_size) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, Dk] of the same shape; got q={tuple(q.shape)}, k={tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, Dv] matching q; got q={tuple(q.shape)}, v={tuple(v.shape)}")
    if beta is not None and isinstance(g, Tensor) and g.dim() == 4:  # a decay per key dimension (delta rule only)
        _check_tokens("g", g, tuple(q.shape))
    else:
        _check_tokens("g", g, tuple(q.shape[:3]))
    if beta is not None:
        _check_tokens("beta", beta, tuple(q.shape[:3]))
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


@_fp32
def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None = None,
                     use_qk_l2norm: bool = True, mesh: DeviceMesh | None = None,
                     layout: Literal["zigzag", "contiguous"] = "zigzag", chunk_size: int = 64,
                     kernel: Kernel = "auto", documents: PackedDocuments | None = None) -> Tensor:
    """The gated delta rule over sequence shards (Note [Linear recurrences under sequence sharding]).

    Conventions of transformers' Qwen3-Next and fla's ``chunk_gated_delta_rule``: q, k ``[B, T, H_k, Dk]``,
    v ``[B, T, H_v, Dv]`` with H_v a multiple of H_k (each q/k head serves H_v / H_k consecutive
    value heads), g ``[B, T, H_v]`` (log decay) or ``[B, T, H_v, Dk]`` (a log decay per key
    dimension: Kimi Delta Attention, Note [Chunked gated recurrences]; the torch kernels run,
    kernel="fla" is refused), beta ``[B, T, H_v]``; q and k l2-normalised in fp32
    (eps 1e-6 inside the square root) when ``use_qk_l2norm``, then q scaled by ``scale`` (default Dk^-1/2).

    ``documents``: packed documents (built with ``world`` = the mesh size; the inputs sharded by
    ``PackedDocuments.shard``, layout "zigzag"): the state is zero at every document's first token
    (Note [Documents in a recurrence]); the torch kernels run (kernel="fla" is refused).

    Returns ``[B, T_local, H_v, Dv]`` in q's dtype; differentiable in q, k, v, g, beta.
    """
    _check_mesh_layout(mesh, layout)
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"q, k must be [B, T, H_k, Dk] and v [B, T, H_v, Dv] with H_v a multiple of H_k; got q={tuple(q.shape)}, "
                         f"k={tuple(k.shape)}, v={tuple(v.shape)}")
    dtype = q.dtype
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    if v.shape[2] != q.shape[2]:
        q, k = (x.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for x in (q, k))
    _check_scan(q, k, v, g, beta, chunk_size)
    _pieces_of(q.shape[1], mesh, layout)
    pieces = _check_documents(documents, q.shape[0], q.shape[1], mesh, layout)
    if g.dim() == 4 and kernel == "fla":
        raise ValueError("kernel='fla' does not take a decay per key dimension (g of shape [B, T, H, Dk]; fla-core's "
                         "chunk_kda is not wired): use kernel='torch' or 'auto' (which runs the torch kernels for it)")
    ker = _resolve_kernel(kernel, q.device, pieces is not None or g.dim() == 4)
    fn = functools.partial(_delta_kernel, chunk_size=chunk_size, kernel=ker, pieces=pieces)
    B, _, H, Dk = q.shape
    docs = () if pieces is None else (pieces.shape[1],)  # a state per document
    if _state_passing(mesh, ker):
        out = _parallel_scan(q, k, v.float(), g.float(), beta.float(), chunk_size, mesh, layout, pieces)  # type: ignore[arg-type]
    else:
        out = _chain(fn, [q, k, v.float(), g.float(), beta.float()], (B, *docs, H, Dk, v.shape[-1]), mesh, layout)
    return out.to(dtype)


def _state_passing(mesh: DeviceMesh | None, kernel: str) -> bool:
    """Whether the states pass in parallel (Note [Parallel state passing across ranks], with documents Note [Parallel
    state passing with packed documents]) rather than down the chain (Note [Linear recurrences under sequence
    sharding]): the package's torch kernels (fla-core's kernels give no piece composite). SEQPAR_STATE_CHAIN=1 sends
    them down the chain anyway (the same results; for comparisons)."""
    return mesh is not None and mesh.size() > 1 and kernel == "torch" and not _chain_forced()


def _chain_forced() -> bool:
    """SEQPAR_STATE_CHAIN=1: every recurrence sends its states down the chain (the same results; for comparisons)."""
    return os.environ.get("SEQPAR_STATE_CHAIN", "0") == "1"


def _parallel_scan(q, k, v, g, beta, chunk_size: int, mesh: DeviceMesh, layout: str, pieces: Tensor | None) -> Tensor:
    """The torch kernels over every local piece at once, the states passing in parallel across the ranks."""
    group_name, P = mesh.get_group().group_name, _pieces_of(q.shape[1], mesh, layout)
    if pieces is None:
        return _chunked_scan(q, k, v, g, beta, None, chunk_size, P, group_name, layout)[0]
    local = pieces[:, :, list(chunk_ids(mesh.get_local_rank(), mesh.size(), layout))]
    return _chunked_scan_documents(q, k, v, g, beta, local, chunk_size, group_name, layout)


def _delta_kernel(q, k, v, g, beta, s_in, *, piece, chunk_size, kernel, pieces=None):
    """One piece of the chain: (out, state out); with documents (``pieces`` [B, N, P]) a state per document."""
    if pieces is None:
        return _scan(q, k, v, g, beta, s_in, chunk_size, kernel)
    return _chunked_scan_segments(q, k, v, g, beta, s_in, pieces[:, :, piece], chunk_size)


def _ssd_kernel(q, k, v, g, s_in, *, piece, chunk_size, kernel, pieces=None):
    return _delta_kernel(q, k, v, g, None, s_in, piece=piece, chunk_size=chunk_size, kernel=kernel, pieces=pieces)


@_fp32
def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *, mesh: DeviceMesh | None = None,
             layout: Literal["zigzag", "contiguous"] = "zigzag", chunk_size: int = 64, kernel: Kernel = "auto",
             documents: PackedDocuments | None = None) -> Tensor:
    """Mamba2's selective scan over sequence shards (Note [Linear recurrences under sequence sharding]).

    Conventions of transformers' Mamba2 / Bamba chunked scan, after the discretisation of dt
    (softplus, bias and clamp are the caller's): x ``[B, T, H, P]``, dt ``[B, T, H]``, A ``[H]``
    (negative), B and C ``[B, T, G, N]`` with H a multiple of G (group g serves H / G consecutive
    heads), D ``[H]`` or None. ``y_t = sum_{s<=t} exp(sum_{s<u<=t} dt_u A) (C_t . B_s) dt_s x_s + D x_t``.

    ``documents``: as for :func:`gated_delta_rule` (the state is zero at every document's first token).

    Returns ``[B, T_local, H, P]`` fp32; differentiable in every input.
    """
    _check_mesh_layout(mesh, layout)
    Bsz, T, H, P = x.shape
    if B.dim() != 4 or C.shape != B.shape or B.shape[:2] != (Bsz, T) or H % B.shape[2]:
        raise ValueError(f"B and C must be [B, T, G, N] with G dividing the {H} heads of x; got x={tuple(x.shape)}, "
                         f"B={tuple(B.shape)}, C={tuple(C.shape)}")
    _check_tokens("dt", dt, (Bsz, T, H))
    if A.shape != (H,):
        raise ValueError(f"A must have shape [H] = ({H},), got {tuple(A.shape)}")
    rep = H // B.shape[2]
    q = C.float().repeat_interleave(rep, dim=2)
    k = B.float().repeat_interleave(rep, dim=2)
    v = x.float() * dt.float()[..., None]
    g = dt.float() * A.float()
    _check_scan(q, k, v, g, None, chunk_size)
    _pieces_of(T, mesh, layout)
    pieces = _check_documents(documents, Bsz, T, mesh, layout)
    ker = _resolve_kernel(kernel, x.device, pieces is not None)
    fn = functools.partial(_ssd_kernel, chunk_size=chunk_size, kernel=ker, pieces=pieces)
    docs = () if pieces is None else (pieces.shape[1],)  # a state per document
    if _state_passing(mesh, ker):
        y = _parallel_scan(q, k, v, g, None, chunk_size, mesh, layout, pieces)  # type: ignore[arg-type]
    else:
        y = _chain(fn, [q, k, v, g], (Bsz, *docs, H, k.shape[-1], P), mesh, layout)
    if D is not None:
        y = y + D.float()[:, None] * x.float()
    return y


# ---------------------------------------------------------------------------------------------
# Mamba1's selective scan
#
# Note [Mamba1's selective scan under sequence sharding]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Mamba (Gu & Dao 2023, §3.2 and Alg. 2; transformers' MambaMixer / JambaMambaMixer /
# FalconMambaMixer / ZambaMambaMixer, the torch path of ``mamba_selective_scan``) keeps, per
# channel e of the d_inner channels, a state h[e, :] of N entries, each with its own decay:
#
#     h_t[e, n] = exp(dt_t[e] A[e, n]) h_{t-1}[e, n] + dt_t[e] x_t[e] B_t[n],
#     y_t[e]    = sum_n h_t[e, n] C_t[n] + D[e] x_t[e]
#
# (B_t, C_t shared by the channels of a group: one group for Mamba / Jamba / Falcon-Mamba, one per
# Mamba head for Zamba). It is the SSD recurrence of Note [Linear recurrences under sequence
# sharding] with the scalar decay replaced by a diagonal one: still affine in the state, so the
# same chain carries it, one [B, d_inner, N] state per hop (per document: [B, docs, d_inner, N]),
# contiguous or zigzag (Note [State chain under the zigzag layout]), with the document resets of
# Note [Documents in a recurrence].
#
# The local kernel is chunked (the diagonal-decay form of Note [Chunked gated recurrences]): in a
# chunk of c tokens entering with state S_0 and G_t = sum_{u<=t} dt_u A (per e, n),
#
#     h_t = e^{G_t} S_0 + sum_{s<=t} e^{G_t - G_s} (dt_s x_s B_s),     y_t = <h_t, C_t>,
#
# the decays e^{G_t - G_s} formed only for s <= t (masked before exp: at most 1, no overflow), a
# [c, c, E, N] workspace per chunk; the chunks (of every sample, one sample after the other) run
# in sequence (B T / c steps instead of T), each under activation checkpointing, so autograd keeps one chunk's workspace at a time and O(T E N)
# inputs (transformers' torch path keeps its T per-token states as well). Every segment of a
# piece (a document's tokens, or the whole piece) starts a fresh chunk, padded at its end with
# no-op tokens (dt = 0: no decay, no write), as Note [Documents in a recurrence] does for the
# chunked SSD: no chunk holds a document start, and the state after a segment's last chunk is its
# document's leaving state (an empty segment passes its entering state through). Pure torch, fp32:
# exact (tested against a float64 token loop), not a fused kernel (mamba_ssm's selective scan with
# an initial state would be the fast path; not wired).


def _selective_chunk(G: Tensor, w: Tensor, C: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk: G [c, E, N] cumulative log decays, w [c, E, N] writes (dt x B), C [c, E, N], state [E, N]
    entering -> (y [c, E], state after the chunk)."""
    c = G.shape[0]
    tri = torch.ones(c, c, dtype=torch.bool, device=G.device).tril()[:, :, None, None]
    decay = (G[:, None] - G[None, :]).masked_fill(~tri, float("-inf")).exp()  # (t, s, E, N): e^{G_t - G_s}, s <= t
    h = G.exp() * state + torch.einsum("tsen,sen->ten", decay, w)  # (c, E, N): the state after each token
    return (h * C).sum(-1), h[-1]


def _selective_kernel(g: Tensor, u: Tensor, B: Tensor, C: Tensor, s_in: Tensor | None, *, piece: int,
                      chunk_size: int, pieces: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One piece of the chain (Note [Mamba1's selective scan under sequence sharding]).

    g: [Bsz, T, E, N] log decays (dt A); u: [Bsz, T, E] written values (dt x); B, C: [Bsz, T, G, N];
    s_in: [Bsz, E, N] (with documents [Bsz, docs, E, N]) or None (zero). Returns (y [Bsz, T, E] without
    the D term, the leaving state(s) shaped as s_in), fp32.
    """
    Bsz, T, E, N = g.shape
    G, c = B.shape[2], chunk_size
    lengths = torch.full((Bsz, 1), T, dtype=torch.int64) if pieces is None else pieces[:, :, piece]
    docs = lengths.shape[1]
    lay = {name: x.to(g.device) for name, x in _segment_layout(lengths, T, c).items()}

    def padded(x: Tensor) -> Tensor:  # [Bsz, T, *D] -> [chunks, c, *D], each segment starting a chunk, zeros between
        x = x.float().reshape(Bsz * T, *x.shape[2:])
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[lay["gather"]]
        return x.reshape(-1, c, *x.shape[1:])

    Gc = padded(g).cumsum(1)  # (chunks, c, E, N); padding: g = 0 (no decay), u = 0 (no write)
    w = (padded(u).reshape(-1, c, G, E // G, 1) * padded(B)[:, :, :, None, :]).reshape(-1, c, E, N)
    Cc = padded(C).repeat_interleave(E // G, dim=2)  # (chunks, c, E, N)
    init = g.new_zeros(Bsz * docs, E, N) if s_in is None else s_in.float().reshape(Bsz * docs, E, N)
    finals = list(init.unbind(0))
    seg, first, last = lay["seg"].tolist(), lay["first"].tolist(), lay["last"].tolist()
    ys, state = [], init[0]
    for j in range(len(seg)):  # the recurrence over chunks; a segment's first chunk starts from its document's state
        if first[j]:
            state = init[seg[j]]
        # recomputed in backward: autograd keeps one chunk's [c, c, E, N] decays at a time, not every chunk's
        y, state = checkpoint(_selective_chunk, Gc[j], w[j], Cc[j], state, use_reentrant=False)
        ys.append(y)
        if last[j]:
            finals[seg[j]] = state
    y = torch.cat(ys)[lay["scatter"]].reshape(Bsz, T, E)
    leaving = torch.stack(finals).reshape(Bsz, docs, E, N)
    return y, (leaving[:, 0] if pieces is None else leaving)


# Note [Parallel state passing for diagonal recurrences]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Mamba1's selective scan and the RG-LRU have a diagonal transition, so a piece maps the state that
# enters it elementwise:
#
#     S_out = exp(G) * S_in + s,   G = the sum of the piece's log decays (per e, n),
#     s = sum_t exp(G_after_t) * w_t,   G_after_t = the sum of the log decays after token t,
#
# w_t the write (dt_t x_t B_t; the RG-LRU's u_t). (exp G, s) costs O(T E N) elementwise, with no
# [c, c] workspace: a few percent of the kernel. Without documents, every rank computes its pieces'
# maps (autograd on, 256 tokens at a time under activation checkpointing); one all-gather, whose
# backward is a reduce-scatter, gives every rank every piece's. Each rank folds them in sequence
# order (S_in[p + 1] = exp(G_p) S_in[p] + s_p) and runs its pieces' kernel from the exact
# entering states. The backward is autograd's:
#
#   - the kernel's gradient of its entering state flows through the fold into the gathered maps;
#   - the reduce-scatter hands every rank the gradient of its own pieces' maps;
#   - the per-piece sums carry it to the inputs.
#
# No rank waits for another's kernel: the chain's critical path was 2W pieces, now it is the rank's
# own 2. With documents the per-document states still go down the chain (Note [Documents in a
# recurrence]); SEQPAR_STATE_CHAIN=1 sends these down the chain too.

_MAP_CHUNK = 256  # tokens per step of a piece's map: a [Bsz, 256, E, N] workspace


def _map_chunk(g: Tensor, u: Tensor, B: Tensor, s: Tensor) -> Tensor:
    """s after a chunk: g [Bsz, c, E, N] log decays, u [Bsz, c, E], B [Bsz, c, G, N], s [Bsz, E, N] (the zero-entering
    state before it)."""
    Bsz, c, E, N = g.shape
    G = B.shape[2]
    after = g.flip(1).cumsum(1).flip(1) - g  # the log decays after each token, within the chunk (<= 0)
    w = (u.reshape(Bsz, c, G, E // G, 1) * B[:, :, :, None, :]).reshape(Bsz, c, E, N)
    return g.sum(1).exp() * s + (after.exp() * w).sum(1)


def _diagonal_map(g: Tensor, u: Tensor, B: Tensor) -> tuple[Tensor, Tensor]:
    """(exp G, s) of one piece: its leaving state is exp(G) * S_in + s (Note [Parallel state passing for diagonal
    recurrences]); [Bsz, E, N] each, differentiable."""
    s = g.new_zeros(g.shape[0], *g.shape[2:])
    for t in range(0, g.shape[1], _MAP_CHUNK):
        s = checkpoint(_map_chunk, g[:, t:t + _MAP_CHUNK], u[:, t:t + _MAP_CHUNK], B[:, t:t + _MAP_CHUNK], s,
                       use_reentrant=False)
    return g.sum(1).exp(), s


def _parallel_diagonal(kernel, inputs: list[Tensor], map_of, mesh: DeviceMesh, layout: str) -> Tensor:
    """The pieces of a diagonal recurrence with their states passed in parallel (Note [Parallel state passing for diagonal
    recurrences]). ``kernel(*piece_inputs, s_in, piece=)`` -> (out, leaving); ``map_of(*piece_inputs)`` -> (exp G, s)
    shaped as the state."""
    rank, world = mesh.get_local_rank(), mesh.size()
    ids = chunk_ids(rank, world, layout)
    split = [x.chunk(len(ids), dim=1) for x in inputs]
    local = torch.stack([torch.stack(map_of(*(x[i] for x in split))) for i in range(len(ids))])  # [P, 2, *state]
    maps = in_global_order(AllGatherStacked.apply(local, mesh.get_group().group_name), world, layout)  # [2, *state] each
    # the first piece enters with a zero state that is still the gather's output: every rank's backward then reaches
    # the gather's reduce-scatter (rank 0's pieces may need no other piece's map: the contiguous layout)
    state, entering = maps[0][1] * 0, []
    for m in maps:
        entering.append(state)
        state = m[0] * state + m[1]
    return torch.cat([kernel(*(x[i] for x in split), entering[p], piece=p)[0] for i, p in enumerate(ids)], dim=1)


def _diagonal_in_parallel(mesh: DeviceMesh | None, pieces: Tensor | None) -> bool:
    """Whether a diagonal recurrence passes its states in parallel (Note [Parallel state passing for diagonal
    recurrences]): several ranks, no documents, SEQPAR_STATE_CHAIN unset."""
    return mesh is not None and mesh.size() > 1 and pieces is None and not _chain_forced()


@_fp32
def selective_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None, *,
                   mesh: DeviceMesh | None = None, layout: Literal["zigzag", "contiguous"] = "zigzag",
                   chunk_size: int = 16, documents: PackedDocuments | None = None) -> Tensor:
    """Mamba1's selective scan over sequence shards (Note [Mamba1's selective scan under sequence sharding]).

    After the discretisation of dt (softplus and bias are the caller's): x and dt ``[B, T, E]``
    (E = d_inner channels), A ``[E, N]`` (negative), B and C ``[B, T, G, N]`` with G dividing E
    (group g serves the E / G consecutive channels g E/G ...), D ``[E]`` or None.
    ``y_t[e] = sum_n h_t[e, n] C_t[n] + D[e] x_t[e]`` with
    ``h_t[e, n] = exp(dt_t[e] A[e, n]) h_{t-1}[e, n] + dt_t[e] x_t[e] B_t[n]``, h zero before the first token.

    ``documents``: as for :func:`gated_delta_rule` (the state is zero at every document's first token).
    ``chunk_size``: tokens per chunk of the local kernel (its workspace is [c, c, E, N] per sample).

    Returns ``[B, T_local, E]`` fp32 (without the gate); differentiable in every input.
    """
    _check_mesh_layout(mesh, layout)
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, E], got {tuple(x.shape)}")
    Bsz, T, E = x.shape
    _check_tokens("dt", dt, (Bsz, T, E))
    if A.dim() != 2 or A.shape[0] != E:
        raise ValueError(f"A must have shape [E, N] = ({E}, N), got {tuple(A.shape)}")
    N = A.shape[1]
    if B.dim() != 4 or C.shape != B.shape or B.shape[:2] != (Bsz, T) or B.shape[3] != N or E % B.shape[2]:
        raise ValueError(f"B and C must be [B, T, G, N] with G dividing the {E} channels of x and N = {N} (A's); "
                         f"got x={tuple(x.shape)}, B={tuple(B.shape)}, C={tuple(C.shape)}")
    if D is not None and tuple(D.shape) != (E,):
        raise ValueError(f"D must have shape [E] = ({E},) or be None, got {tuple(D.shape)}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    _pieces_of(T, mesh, layout)
    pieces = _check_documents(documents, Bsz, T, mesh, layout)
    g = dt.float()[..., None] * A.float()  # (B, T, E, N) log decays
    u = dt.float() * x.float()  # (B, T, E)
    fn = functools.partial(_selective_kernel, chunk_size=chunk_size, pieces=pieces)
    docs = () if pieces is None else (pieces.shape[1],)  # a state per document
    if _diagonal_in_parallel(mesh, pieces):
        y = _parallel_diagonal(fn, [g, u, B.float(), C.float()], lambda g, u, B, C: _diagonal_map(g, u, B), mesh, layout)  # type: ignore[arg-type]
    else:
        y = _chain(fn, [g, u, B.float(), C.float()], (Bsz, *docs, E, N), mesh, layout)
    if D is not None:
        y = y + D.float() * x.float()
    return y


# ---------------------------------------------------------------------------------------------
# a diagonal linear recurrence (RecurrentGemma's RG-LRU)
#
# Note [Diagonal linear recurrences under sequence sharding]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Griffin's RG-LRU (De et al. 2024, §2.4; transformers' RecurrentGemmaRglru) keeps one number per
# channel and decays each by its own gate:
#
#     h_t = a_t * h_{t-1} + u_t,    a_t = exp(log_a_t) in (0, 1],    u_t = sqrt(1 - a_t^2) (i_t * x_t)
#
# (the input term is the caller's). It is Mamba1's selective scan (Note [Mamba1's selective scan
# under sequence sharding]) with one state entry per channel (N = 1), the decay log_a_t itself
# (rather than dt_t A) and the write u_t itself (rather than dt_t x_t B_t) — so the same chunked
# kernel and the same chain run it, with B = C = 1 and a [B, E] state per hop ([B, docs, E] with
# documents), and no division by dt: expressing it through selective_scan's arguments would need
# x = u / dt, which is neither exact nor defined at dt = 0.
#
# The RG-LRU also RESETS: where position_ids == 0 it multiplies a_t by 0 (h_t = u_t). Under
# sharding a reset in the middle of a piece cannot be applied to a state that another rank holds
# implicitly, but it need not be: the state is zero at every document's first token (Note
# [Documents in a recurrence]) and at the sequence's first, so a reset there changes nothing
# (and the gradient of a_t at such a token is zero either way: it multiplies a zero state).
# :func:`sequence_starts` gives, per local token, whether it is such a start; the caller checks
# that its resets are exactly those (and refuses by name where they are not, e.g. positions that
# restart at 0 without the batch's documents), so no reset is silently dropped.


def _diagonal_kernel(g: Tensor, u: Tensor, s_in: Tensor | None, *, piece: int, chunk_size: int,
                     pieces: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One piece of the chain: g, u [Bsz, T, E]; s_in [Bsz, (docs,) E] or None -> (h [Bsz, T, E], the leaving state(s))."""
    ones = g.new_ones(*g.shape[:2], 1, 1)  # B = C = 1 (one group, N = 1): the write is u, the read is h
    y, s_out = _selective_kernel(g[..., None], u, ones, ones, None if s_in is None else s_in[..., None], piece=piece,
                                 chunk_size=chunk_size, pieces=pieces)
    return y, s_out[..., 0]


@_fp32
def diagonal_recurrence(log_a: Tensor, u: Tensor, *, mesh: DeviceMesh | None = None,
                        layout: Literal["zigzag", "contiguous"] = "zigzag", chunk_size: int = 16,
                        documents: PackedDocuments | None = None) -> Tensor:
    """``h_t = exp(log_a_t) * h_{t-1} + u_t`` per channel over sequence shards, h zero before the first token
    (and, with ``documents``, before every document's first token): Note [Diagonal linear recurrences under
    sequence sharding].

    log_a, u: ``[B, T_local, E]`` (log_a <= 0 and finite). Returns h ``[B, T_local, E]`` fp32; differentiable in both.
    """
    _check_mesh_layout(mesh, layout)
    if not isinstance(u, Tensor) or u.dim() != 3 or not u.is_floating_point():
        raise ValueError(f"u must be a floating-point tensor [B, T, E], got {getattr(u, 'shape', type(u).__name__)}")
    Bsz, T, E = u.shape
    _check_tokens("log_a", log_a, (Bsz, T, E))
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    _pieces_of(T, mesh, layout)
    pieces = _check_documents(documents, Bsz, T, mesh, layout)
    fn = functools.partial(_diagonal_kernel, chunk_size=chunk_size, pieces=pieces)
    docs = () if pieces is None else (pieces.shape[1],)  # a state per document
    if _diagonal_in_parallel(mesh, pieces):
        def map_of(g: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:  # N = 1, B = 1: the write is u
            decay, s = _diagonal_map(g[..., None], w, g.new_ones(*g.shape[:2], 1, 1))
            return decay[..., 0], s[..., 0]

        return _parallel_diagonal(fn, [log_a.float(), u.float()], map_of, mesh, layout)  # type: ignore[arg-type]
    return _chain(fn, [log_a.float(), u.float()], (Bsz, *docs, E), mesh, layout)


def sequence_starts(batch: int, local_len: int, *, mesh: DeviceMesh | None = None,
                    layout: Literal["zigzag", "contiguous"] = "zigzag", documents: PackedDocuments | None = None) -> Tensor:
    """bool ``[B, T_local]`` (CPU): which of this rank's tokens start a recurrence from a zero state — the first
    token of every document (``documents``), else the sequence's first token (rank 0's first, in both layouts)."""
    _check_mesh_layout(mesh, layout)
    _pieces_of(local_len, mesh, layout)
    world = 1 if mesh is None else mesh.size()
    rank = 0 if world == 1 else mesh.get_local_rank()  # type: ignore[union-attr]
    if _check_documents(documents, batch, local_len, mesh, layout) is not None:
        positions = documents.position_ids()  # type: ignore[union-attr]  # (B, S): 0 at every document start
        return (positions if world == 1 else documents.shard(positions, rank)) == 0  # type: ignore[union-attr]
    starts = torch.zeros(batch, local_len, dtype=torch.bool)
    if rank == 0 and local_len:
        starts[:, 0] = True
    return starts


class Recurrence(nn.Module):
    """The sequence-parallel forms of the recurrent token mixers, as one parameter-free module.

    A model's token mixer calls :meth:`conv`, :meth:`delta_rule`, :meth:`ssd`, :meth:`selective` or :meth:`diagonal`; :meth:`configure`
    (the strategy's or the test's call) gives it the mesh and the layout of the batch. Unconfigured
    (or one rank) it computes the whole sequence on one device.
    """

    def __init__(self, *, chunk_size: int = 64, kernel: Kernel = "auto") -> None:
        super().__init__()
        if kernel not in RECURRENT_KERNELS:
            raise ValueError(f"kernel={kernel!r} is not supported; expected one of {RECURRENT_KERNELS}")
        self.chunk_size, self.kernel = chunk_size, kernel
        self.mesh: DeviceMesh | None = None
        self.layout: str = "zigzag"

    def configure(self, *, mesh: DeviceMesh | None, layout: Literal["zigzag", "contiguous"] = "zigzag",
                  kernel: Kernel | None = None) -> None:
        _check_mesh_layout(mesh, layout)
        if kernel is not None:
            if kernel not in RECURRENT_KERNELS:
                raise ValueError(f"kernel={kernel!r} is not supported; expected one of {RECURRENT_KERNELS}")
            self.kernel = kernel
        self.mesh = mesh if mesh is not None and mesh.size() > 1 else None
        self.layout = layout

    # ``documents``: packed documents to reset the state at, default the batch's (``current_documents()``,
    # read here at forward time and bound into the autograd Functions: Note [Per-call state])

    def conv(self, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
             documents: PackedDocuments | None = None) -> Tensor:
        documents = documents if documents is not None else current_documents()
        return causal_conv1d(x, weight, bias, activation=activation, mesh=self.mesh, layout=self.layout,  # type: ignore[arg-type]
                             documents=documents)

    def delta_rule(self, q, k, v, g, beta, *, use_qk_l2norm: bool = True, documents: PackedDocuments | None = None) -> Tensor:
        documents = documents if documents is not None else current_documents()
        return gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=use_qk_l2norm, mesh=self.mesh, layout=self.layout,  # type: ignore[arg-type]
                                chunk_size=self.chunk_size, kernel=self.kernel, documents=documents)  # type: ignore[arg-type]

    def ssd(self, x, dt, A, B, C, D, *, documents: PackedDocuments | None = None) -> Tensor:
        documents = documents if documents is not None else current_documents()
        return ssd_scan(x, dt, A, B, C, D, mesh=self.mesh, layout=self.layout, chunk_size=self.chunk_size,  # type: ignore[arg-type]
                        kernel=self.kernel, documents=documents)  # type: ignore[arg-type]

    def selective(self, x, dt, A, B, C, D, *, chunk_size: int = 16, documents: PackedDocuments | None = None) -> Tensor:
        documents = documents if documents is not None else current_documents()
        return selective_scan(x, dt, A, B, C, D, mesh=self.mesh, layout=self.layout, chunk_size=chunk_size,  # type: ignore[arg-type]
                              documents=documents)

    def diagonal(self, log_a: Tensor, u: Tensor, *, chunk_size: int = 16, documents: PackedDocuments | None = None) -> Tensor:
        documents = documents if documents is not None else current_documents()
        return diagonal_recurrence(log_a, u, mesh=self.mesh, layout=self.layout, chunk_size=chunk_size,  # type: ignore[arg-type]
                                   documents=documents)

    def starts(self, batch: int, local_len: int, *, documents: PackedDocuments | None = None) -> Tensor:
        """:func:`sequence_starts` on this module's mesh and layout."""
        documents = documents if documents is not None else current_documents()
        return sequence_starts(batch, local_len, mesh=self.mesh, layout=self.layout, documents=documents)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        where = "local" if self.mesh is None else f"layout={self.layout}, mesh={tuple(self.mesh.shape)}"
        return f"chunk_size={self.chunk_size}, kernel={self.kernel}, {where}"

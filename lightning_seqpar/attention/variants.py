"""Attention variants over global positions: sliding windows, chunked attention, soft-capped
scores and attention sinks, in every algorithm.

Note [Attention variants]
~~~~~~~~~~~~~~~~~~~~~~~~~
Transformers' conventions (``masking_utils``; Gemma 2/3, gpt-oss, Llama 4), with i, j GLOBAL
token indices of the (packed) sequence:

* window w (causal only): query i sees keys j with i - w < j <= i (``sliding_window_overlay``);
* chunk_size c: query i sees keys j with i // c == j // c (and j <= i when causal);
* softcap c: scores x = (q . k) * scale become c * tanh(x / c) before the softmax (Gemma 2);
* sinks s_h: one logit per query head that joins the softmax denominator only (gpt-oss):
  out = sum_j exp(x_ij) v_j / (sum_j exp(x_ij) + exp(s_h)).

Packed documents add "same document" to the mask (both must hold), and i, j are then the positions
INSIDE the document (0 at its first token): each document is masked as if it were alone, so its
chunks start at its own first token (Llama 4 under packing). Causality and windows only compare
i - j of two tokens of one document, which is the same either way; chunks are the reason.
The interval-bound decisions below stay conservative with in-document positions: a block is
skipped only when no pair of one document is allowed, and full only when one document holds
every row.

Every algorithm cuts attention into blocks (a range of query rows against a range of key rows)
and knows the global positions of both; a block is then *skipped* when no (i, j) of it is
allowed, *full* when every pair is allowed (a dense kernel, no mask), else *masked* (a kernel
with the mask built from the positions: ``lightning_seqpar.attention.masked``). The decision
uses only interval bounds of the positions (min/max of a half-shard, or of a 128-row tile
inside the GPU kernel), so it is conservative: a block is skipped only when it is wholly masked.
Softcapping changes the scores of every block, so with a softcap no block takes the dense kernel.

Sinks need no kernel: they act as one extra key with score s_h and a zero value, so after the
last merge lse' = logaddexp(lse, s_h) and out' = out * exp(lse - lse'). The backward of every
block is the ordinary one given the final (out', lse') — P = exp(x - lse') are the true
probabilities, delta = rowsum(dout * out') — and the sink's own gradient is that of a score whose
value gradient is zero: d s_h = -sum over rows of exp(s_h - lse') * (dout . out').

Note [Windows, zigzag and the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Zigzag exists to balance the causal triangle: under full causal attention, query chunk a does
work proportional to a. A window w makes the work of a query min(i + 1, w): flat after the
first w tokens. So with a window the contiguous layout is already balanced (only the first rank
does less, on its first w tokens), and zigzag adds nothing to the balance of compute.

What a window changes is which K/V a rank needs. With chunks of c >= w tokens, chunk a needs
only chunks a - 1 and a. Contiguous: rank r needs rank r - 1 only — the ring stops after one
hop (``VariantPlan.steps``: the ring runs only as many steps as the farthest source any rank
needs, and the dK/dV accumulators then go home in one direct hop). Zigzag: chunk r needs chunk
r - 1 (rank r - 1, one hop) but chunk 2W-1-r needs chunk 2W-2-r, held by rank r + 1, which is
W - 1 hops round a one-directional ring — so the ring still makes all W - 1 hops, although only
three of the W steps compute anything (every other block pair is skipped). Both layouts give
every rank the same kernel work; contiguous also communicates one hop instead of W - 1, so it is
the layout to pick for windowed layers. (A model that alternates windowed and global layers, as
Gemma and gpt-oss do, shares one layout for all layers; zigzag then balances the global layers
and the windowed ones still skip their masked blocks.) The all-gather and Ulysses algorithms
move the whole sequence anyway; they skip masked blocks in compute only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from lightning_seqpar.sharding.documents import PackedDocuments
from lightning_seqpar.sharding.layouts import chunk_ids


class Variant(NamedTuple):
    """The mask and score options of one attention call (0 = unused)."""

    causal: bool
    window: int = 0
    chunk: int = 0
    softcap: float = 0.0

    @property
    def active(self) -> bool:
        """Whether anything beyond plain causal / non-causal attention is asked for (sinks aside)."""
        return bool(self.window or self.chunk or self.softcap)


class Half(NamedTuple):
    """A run of a shard's rows and their global positions (positions inside their documents with packed documents)."""

    rows: slice
    pos: Tensor  # int64 [Bp, n] on the CPU, Bp = 1 (same for every sample) or B
    doc: Tensor | None  # int64 [B, n] document ids (packed documents), else None
    piece: int  # packed documents: the piece index of every document these rows hold; else -1


class Mask(NamedTuple):
    """A block's mask: positions of its query and key rows (on the device) and the variant."""

    q_pos: Tensor  # int64 [Bp, Sq]
    k_pos: Tensor  # int64 [Bp', Sk]
    q_doc: Tensor | None  # [B, Sq]
    k_doc: Tensor | None
    variant: Variant
    full: bool  # no pair of the block is masked
    offset: int | None  # q_pos[0] - k_pos[0] when both are one arange each (the same for every sample), else None


def check_variant_args(*, causal: bool, window, softcap, chunk_size, sinks, h_q: int | None = None) -> Variant:
    """ValueErrors naming the argument; the Variant of the call."""
    for name, val in (("window", window), ("chunk_size", chunk_size)):
        if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {val!r}")
    if window is not None and not causal:
        raise ValueError(f"window={window} needs causal=True (a sliding window looks back from each query: i - window < j <= i)")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not math.isfinite(softcap) or softcap <= 0:
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")
    if sinks is not None:
        if not isinstance(sinks, Tensor) or sinks.ndim != 1 or not sinks.is_floating_point():
            raise ValueError(f"sinks must be None or a 1-D floating-point tensor [H_q], got {getattr(sinks, 'shape', type(sinks).__name__)}")
        if h_q is not None and sinks.shape[0] != h_q:
            raise ValueError(f"sinks must have one logit per query head: shape [{h_q}], got {tuple(sinks.shape)}")
    return Variant(causal, window or 0, chunk_size or 0, float(softcap or 0.0))


# ---------------------------------------------------------------------------------------------
# positions of the shards


def _doc_ids(pieces: Tensor, pos: Tensor) -> Tensor:
    """Document id of every sample position ``pos`` [B, n] (pieces [B, N, P])."""
    ends = torch.cumsum(pieces.sum(-1), 1)  # [B, N]
    return torch.searchsorted(ends, pos.contiguous(), right=True)


def _in_document(pieces: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
    """(position inside its document, document id) of every sample position ``pos`` [B, n]
    (Note [Attention variants]: with packed documents every mask counts from the document's start)."""
    doc = _doc_ids(pieces, pos)
    lengths = pieces.sum(-1)  # [B, N]
    starts = torch.cumsum(lengths, 1) - lengths
    return pos - torch.gather(starts, 1, doc.clamp(max=lengths.shape[1] - 1)), doc


def shard_halves(rank: int, world: int, layout: str, s_local: int, docs: Tensor | None) -> list[Half]:
    """The row runs of ``rank``'s shard with their global positions (one run per layout chunk;
    packed documents: one per piece index, every sample's positions INSIDE their documents)."""
    if docs is not None:
        P = docs.shape[2]
        S = int(docs[0].sum())
        if world == 1 or P == 1:
            pos = torch.arange(S).expand(docs.shape[0], S)
            return [Half(slice(None), *_in_document(docs, pos), 0)]
        index = PackedDocuments(docs, S, world).index(rank)  # [B, s_local]
        half = s_local // 2
        out = []
        for h in (0, 1):
            pos = index[:, h * half : (h + 1) * half]
            out.append(Half(slice(h * half, (h + 1) * half), *_in_document(docs, pos), rank if h == 0 else P - 1 - rank))
        return out
    if world == 1:
        return [Half(slice(None), torch.arange(s_local)[None], None, -1)]
    ids = chunk_ids(rank, world, layout)
    c = s_local // len(ids)
    return [Half(slice(i * c, (i + 1) * c), torch.arange(cid * c, (cid + 1) * c)[None], None, -1) for i, cid in enumerate(ids)]


def classify(qpos: Tensor, kpos: Tensor, qdoc, kdoc, v: Variant, pieces: tuple[int, int] | None = None) -> str:
    """"skip", "full" or "masked" for a block, from interval bounds of its positions (conservative)."""
    q_lo, q_hi, k_lo, k_hi = int(qpos.min()), int(qpos.max()), int(kpos.min()), int(kpos.max())
    dmin, dmax = q_lo - k_hi, q_hi - k_lo  # range of i - j
    if v.causal and dmax < 0:
        return "skip"
    if v.window and dmin >= v.window:
        return "skip"
    if v.chunk and (q_hi // v.chunk < k_lo // v.chunk or k_hi // v.chunk < q_lo // v.chunk):
        return "skip"
    if pieces is not None and v.causal and pieces[1] > pieces[0]:
        return "skip"  # per-document zigzag: piece b > a lies after piece a in every document
    full = (not v.causal or dmin >= 0) and (not v.window or dmax < v.window)
    if v.chunk:
        full = full and q_lo // v.chunk == q_hi // v.chunk == k_lo // v.chunk == k_hi // v.chunk
    if qdoc is not None:
        if bool(((qdoc.amax(1) < kdoc.amin(1)) | (kdoc.amax(1) < qdoc.amin(1))).all()):
            return "skip"  # different documents in every sample
        full = full and bool(((qdoc.amin(1) == qdoc.amax(1)) & (kdoc.amin(1) == kdoc.amax(1)) & (qdoc.amin(1) == kdoc.amin(1))).all())
    return "full" if full else "masked"


def _is_range(pos: Tensor) -> bool:
    return pos.shape[0] == 1 and (pos.shape[1] < 2 or bool((pos[0, 1:] - pos[0, :-1] == 1).all()))


def _offset(qh: Half, kh: Half) -> int | None:
    return int(qh.pos[0, 0]) - int(kh.pos[0, 0]) if qh.doc is None and _is_range(qh.pos) and _is_range(kh.pos) else None


class VariantPlan:
    """The blocks of every (rank, source rank) pair of one call, for ring and all-gather.

    ``blocks(rank, src)``: ``(query rows, key rows, Mask)`` of the non-skipped block pairs of
    ``rank``'s queries against ``src``'s keys; ``steps``: how many ring steps any rank needs
    (Note [Windows, zigzag and the ring]).
    """

    def __init__(self, world: int, layout: str, s_local: int, docs: Tensor | None, variant: Variant, device: torch.device) -> None:
        self.world, self.variant, self.device = world, variant, device
        self.halves = [shard_halves(r, world, layout, s_local, docs) for r in range(world)]
        self._dev: dict[tuple[int, int, str], Tensor] = {}
        self._kinds = {}
        for r in range(world):
            for s in range(world):
                for a, qh in enumerate(self.halves[r]):
                    for b, kh in enumerate(self.halves[s]):
                        pieces = (qh.piece, kh.piece) if docs is not None else None
                        self._kinds[r, s, a, b] = classify(qh.pos, kh.pos, qh.doc, kh.doc, variant, pieces)
        needed = [(r - s) % world for (r, s, _, _), kind in self._kinds.items() if kind != "skip"]
        self.steps = 1 + max(needed, default=0)

    def _on_device(self, rank: int, i: int, what: str) -> Tensor | None:
        key = (rank, i, what)
        if key not in self._dev:
            h = self.halves[rank][i]
            t = h.pos if what == "pos" else h.doc
            self._dev[key] = None if t is None else t.to(self.device, non_blocking=True)
        return self._dev[key]

    def blocks(self, rank: int, src: int) -> list[tuple[slice, slice, Mask]]:
        out = []
        for a, qh in enumerate(self.halves[rank]):
            for b, kh in enumerate(self.halves[src]):
                kind = self._kinds[rank, src, a, b]
                if kind == "skip":
                    continue
                mask = Mask(self._on_device(rank, a, "pos"), self._on_device(src, b, "pos"), self._on_device(rank, a, "doc"),
                            self._on_device(src, b, "doc"), self.variant, kind == "full", _offset(qh, kh))
                out.append((qh.rows, kh.rows, mask))
        return out

    def count(self) -> int:
        """Non-skipped block pairs over all (rank, source) pairs (tests, benchmarks)."""
        return sum(kind != "skip" for kind in self._kinds.values())


def local_mask(q: Tensor, docs: Tensor | None, variant: Variant) -> tuple[Mask | None, str]:
    """The mask of a whole sequence in sample order (local attention, Ulysses), and its kind."""
    S = q.shape[1]
    (h,) = shard_halves(0, 1, "contiguous", S, docs)
    kind = classify(h.pos, h.pos, h.doc, h.doc, variant)
    if kind == "skip":
        return None, kind
    pos = h.pos.to(q.device, non_blocking=True)
    doc = None if h.doc is None else h.doc.to(q.device, non_blocking=True)
    return Mask(pos, pos, doc, doc, variant, kind == "full", 0 if docs is None else None), kind


# ---------------------------------------------------------------------------------------------
# sinks (Note [Attention variants])


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """(out', lse') with the sink logits [H] joined to the softmax denominator; out [B, S, H, D], lse [B, H, S]."""
    s = sinks.detach().to(lse.dtype).view(1, -1, 1)
    new_lse = torch.logaddexp(lse, s)
    factor = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1); 0 where lse = -inf
    return (out.to(lse.dtype) * factor).to(out.dtype), new_lse


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d sinks [H] of the local rows, given the final (out', lse') and dout."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)  # (B, H, S)
    p_sink = torch.exp(sinks.detach().to(acc).view(1, -1, 1) - lse)
    return -(p_sink * delta).sum((0, 2)).to(sinks.dtype)

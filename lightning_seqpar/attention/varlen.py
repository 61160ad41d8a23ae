"""Varlen plans: the document-masked attention blocks of every algorithm (Note [Packed documents and per-document zigzag]
in ``lightning_seqpar.sharding.documents``).

The algorithms receive the piece lengths ``pieces`` (int64 ``[B, N, P]`` on the CPU; P = 2W for
W ranks, 1 for one rank) and turn each block pair into one varlen kernel call:

* ring — rank r's half h holds piece a = (r, 2W-1-r)[h] of every document; against half h' of
  the K/V of rank s (piece b): b < a -> unmasked segments, b == a -> causal segments (the
  diagonal), b > a -> nothing. Two calls per hop (three on the own shard), the same work on
  every rank for every document;
* all-gather — the gathered K/V arrive in rank order; for half h (piece a) one index gathers,
  for every document, its pieces 0..a in document order (all pieces if not causal): one varlen
  call, causal bottom-right aligned (piece a is the suffix of that prefix);
* local / Ulysses — the whole sequence (in rank order for Ulysses) is put in sample order and
  every document is one causal segment.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_seqpar.attention.local import Varlen
from lightning_seqpar.sharding.documents import PackedDocuments, exclusive_cumsum, segment_indices

Block = tuple[slice, slice, bool, "Varlen | None"]  # (query rows, key rows, causal, segments)


def _piece_of(rank: int, half: int, P: int) -> int:
    return 0 if P == 1 else (rank if half == 0 else P - 1 - rank)


class DocSegments:
    """cu_seqlens of the block pairs of one attention call, built on first use and cached."""

    def __init__(self, pieces: Tensor, device: torch.device) -> None:
        self.pieces = pieces
        self.device = device
        self._cache: dict[object, Varlen] = {}

    @property
    def num_pieces(self) -> int:
        return self.pieces.shape[2]

    def _cu(self, lengths: Tensor) -> tuple[Tensor, int]:
        flat = lengths.reshape(-1)
        cu = torch.nn.functional.pad(torch.cumsum(flat, 0), (1, 0)).to(torch.int32)
        return cu.to(self.device, non_blocking=True), int(flat.max()) if flat.numel() else 0

    def varlen(self, key: object, q_lengths: Tensor, k_lengths: Tensor) -> Varlen:
        if key not in self._cache:
            (cu_q, max_q), (cu_k, max_k) = self._cu(q_lengths), self._cu(k_lengths)
            self._cache[key] = Varlen(cu_q, cu_k, max_q, max_k)
        return self._cache[key]

    def pair(self, a: int, b: int) -> Varlen:
        """Queries of piece ``a`` against keys of piece ``b``, document by document."""
        return self.varlen(("pair", a, b), self.pieces[:, :, a], self.pieces[:, :, b])

    def whole(self) -> Varlen:
        """Every document against itself (the sequence in sample order)."""
        lengths = self.pieces.sum(-1)
        return self.varlen("whole", lengths, lengths)


def ring_doc_plan(rank: int, src: int, causal: bool, s_local: int, seg: DocSegments) -> list[Block]:
    """The varlen blocks of ``rank`` against the K/V of ``src`` (ring; module docstring)."""
    P = seg.num_pieces
    half = s_local // 2
    halves = (slice(0, half), slice(half, None))
    plan: list[Block] = []
    for hq in (0, 1):
        a = _piece_of(rank, hq, P)
        for hk in (0, 1):
            b = _piece_of(src, hk, P)
            if causal and b > a:
                continue
            plan.append((halves[hq], halves[hk], causal and a == b, seg.pair(a, b)))
    return plan


def gathered_doc_plan(rank: int, world: int, causal: bool, s_local: int, seg: DocSegments) -> list[tuple[slice, Tensor, bool, Varlen]]:
    """For each local half: (query rows, index of its keys in the flattened rank-ordered K/V
    ``[B * W * s_local]``, causal, segments) (all-gather; module docstring)."""
    pieces = seg.pieces
    B, N, P = pieces.shape
    half = s_local // 2
    owner = torch.tensor([(p if p < world else P - 1 - p) * s_local + (0 if p < world else half) for p in range(P)])
    starts = (torch.arange(B).view(B, 1, 1) * (world * s_local) + owner.view(1, 1, P) + exclusive_cumsum(pieces, 1))  # [B, N, P]
    plan = []
    for hq in (0, 1):
        a = _piece_of(rank, hq, P)
        keys = list(range(a + 1)) if causal else list(range(P))
        index = segment_indices(starts[:, :, keys], pieces[:, :, keys]).to(seg.device, non_blocking=True)
        vl = seg.varlen(("gathered", a, causal), pieces[:, :, a], pieces[:, :, keys].sum(-1))
        plan.append((slice(hq * half, (hq + 1) * half), index, causal, vl))
    return plan


def sample_order(pieces: Tensor, device: torch.device) -> tuple[Tensor, Tensor] | None:
    """For a whole sequence in rank order (P > 1): ``(to_sample, to_rank)`` [B, S] gather indices
    along the sequence (``x.gather(1, to_sample)`` puts it in sample order, ``to_rank`` back).
    None when the sequence is already in sample order (P == 1)."""
    B, N, P = pieces.shape
    if P == 1:
        return None
    S = int(pieces[0].sum())
    docs = PackedDocuments(pieces, S, P // 2)
    to_rank = docs.rank_order()  # position (in sample order) of each rank-ordered token
    to_sample = torch.empty_like(to_rank).scatter_(1, to_rank, torch.arange(S).expand(B, S).contiguous())
    return to_sample.to(device, non_blocking=True), to_rank.to(device, non_blocking=True)


def reorder(x: Tensor, index: Tensor, dim: int) -> Tensor:
    """``x`` gathered along ``dim`` (1 for [B, S, ...], 2 for lse [B, H, S]) with the per-sample ``index`` [B, S]."""
    shape = [1] * x.ndim
    shape[0], shape[dim] = index.shape
    return x.gather(dim, index.view(shape).expand(*x.shape[:dim], index.shape[1], *x.shape[dim + 1 :]))

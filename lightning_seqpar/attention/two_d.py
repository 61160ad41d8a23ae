"""LoongTrain 2D attention (Gu et al., arXiv:2406.18485, §4.2-4.4): Ulysses inside "hp", ring
inside "cp".

Note [2D attention]
~~~~~~~~~~~~~~~~~~~
The SP ranks form an hp x cp grid. The sequence is split over cp (zigzag or contiguous) and each
cp shard contiguously over hp (Note [Sequence layouts]). An all-to-all inside each hp group turns
the hp pieces of a cp shard into the whole cp shard for H/hp heads; the ring then runs over cp
for those heads (optionally as a double ring, Note [Ring attention]); a second all-to-all
returns the output to sequence shards.

    hp=2, cp=2:      (h0,c0) (h1,c0) | (h0,c1) (h1,c1)
    a2a over hp  ->  c0 shard, heads 0..H/2 | c0 shard, heads H/2..H | ...
    ring over cp ->  (h0,c0) <-> (h0,c1),  (h1,c0) <-> (h1,c1)

Placement (§4.4) is how the mesh is built, not an option here: with
``init_device_mesh("cuda", (cp, hp), mesh_dim_names=("cp", "hp"))`` the hp ranks are adjacent
GPUs ("head-first": the all-to-all stays on the fastest links); with ``(hp, cp)`` and names
("hp", "cp") the cp ranks are adjacent ("context-first": the ring's P2P stays local). Both give
the same result; only the link each collective uses differs.
"""

from __future__ import annotations

import torch

from lightning_seqpar.attention.local import acc_dtype
from lightning_seqpar.attention.comm import kv_repeat
from lightning_seqpar.attention.ulysses import head_to_seq, seq_to_head


class _RepeatKV(torch.autograd.Function):
    """``x.repeat_interleave(r, dim=2)`` whose backward sums the r copies' gradients in fp32 and
    rounds once (autograd's own backward would add them in bf16: for MQA under Ulysses each K/V
    gradient is a sum over every query head, and the repeated roundings doubled its error)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, r: int) -> torch.Tensor:
        ctx.r = r
        return x.repeat_interleave(r, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        B, S, H, D = grad.shape
        return grad.view(B, S, H // ctx.r, ctx.r, D).sum(3, dtype=acc_dtype(grad.dtype, grad.device)).to(grad.dtype), None


def split_kv_heads(q, k, v, hp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) with each K/V head repeated so that ``hp`` head-parallel ranks can split them (``kv_repeat``)."""
    r = kv_repeat(q.shape[2], k.shape[2], hp)
    if r is None:
        raise ValueError(f"cannot split {q.shape[2]} query heads / {k.shape[2]} key-value heads over {hp} head-parallel ranks")
    if r > 1:
        k, v = _RepeatKV.apply(k, r), _RepeatKV.apply(v, r)
    return k, v


def two_d_attention(q, k, v, *, hp: int, hp_group: str, inner_attention) -> torch.Tensor:
    """Head all-to-all over hp around ``inner_attention`` (the ring over cp, or local attention)."""
    k, v = split_kv_heads(q, k, v, hp)
    qh, kh, vh = (seq_to_head(x, hp, hp_group) for x in (q, k, v))
    return head_to_seq(inner_attention(qh, kh, vh), hp, hp_group)

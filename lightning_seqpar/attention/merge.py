"""Online-softmax merge of partial attention results.

Note [Merging partial attention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
If the keys of a row are split into blocks a and b with partial results (o_a, l_a), (o_b, l_b)
(o = softmax-weighted values over the block, l = log-sum-exp of the block's scores), then

    l = log(exp(l_a) + exp(l_b))                 (logaddexp)
    o = exp(l_a - l) * o_a + exp(l_b - l) * o_b

(FlashAttention's rescaling; LightSeq Alg. 1.) A row that has seen no key yet has l = -inf and
o = 0. When both are -inf the row still has no key: we keep l = -inf and o = 0 by computing the
weights against a finite stand-in for l, so no NaN appears in forward or backward.
"""

from __future__ import annotations

import torch

from lightning_seqpar.attention.local import acc_dtype


def merge_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor, rows: slice = slice(None)) -> None:
    """Merge ``(block_out, block_lse)`` into ``out[:, rows]`` / ``lse[:, :, rows]`` in place.

    ``out``: [B, S, H, D] fp32 accumulator, ``lse``: [B, H, S] fp32 (-inf where nothing seen yet);
    ``block_out``: [B, S_rows, H, D], ``block_lse``: [B, H, S_rows].
    """
    cur_out = out[:, rows]
    cur_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(cur_lse, block_lse)
    finite = torch.where(torch.isinf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_cur = torch.exp(cur_lse - finite).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    w_blk = torch.exp(block_lse - finite).transpose(1, 2).unsqueeze(-1)
    cur_out.mul_(w_cur).add_(block_out * w_blk)  # in place: one temporary of the block size, not three
    cur_lse.copy_(new_lse)


def new_accumulators(q: torch.Tensor, head_dim_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero output [B, S, Hq, Dv] and -inf lse [B, Hq, S], in ``acc_dtype`` (fp32; fp64 for fp64 ``q`` and fp32 ``q`` on the CPU)."""
    B, S, H, D = q.shape
    acc = acc_dtype(q.dtype, q.device)
    out = torch.zeros(B, S, H, head_dim_v or D, dtype=acc, device=q.device)
    lse = torch.full((B, H, S), float("-inf"), dtype=acc, device=q.device)
    return out, lse

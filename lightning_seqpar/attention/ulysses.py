"""Head-parallel attention (DeepSpeed-Ulysses; LoongTrain §4.2) and its all-to-alls.

Note [Ulysses]
~~~~~~~~~~~~~~
An all-to-all turns sequence shards into head shards: rank p gives up all but heads
[p*H/P, (p+1)*H/P) of its tokens and receives those heads for every token. Each rank then runs
ordinary attention over the whole sequence for its heads, and a second all-to-all turns the
output back into sequence shards.

    [B, S/P, H, D] --a2a--> [B, S, H/P, D] --attention--> [B, S, H/P, D] --a2a--> [B, S/P, H, D]

The gathered sequence arrives in rank order: under zigzag it is put into global order (one
index_select) before the causal attention and back after.

GQA: the query heads of one rank must share the K/V heads it holds. When P does not divide H_kv,
each K/V head is repeated r times first (r the smallest divisor of H_q / H_kv with
P | H_kv * r; LoongTrain §4.2), so that query head h still meets K/V head h // (H_q / H_kv).
The repeat's backward sums the gradients of the copies. H_q must be divisible by P.

The all-to-alls are torch's functional collectives with autograd: they trace under
torch.compile and their backward is the reverse all-to-all.
"""

from __future__ import annotations

import torch
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor


def _a2a(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return wait_tensor(all_to_all_single_autograd(x, None, None, group_name))


def seq_to_head(x: torch.Tensor, degree: int, group_name: str) -> torch.Tensor:
    """[B, S_local, H, D] -> [B, degree * S_local, H / degree, D] (sequence in rank order)."""
    B, S, H, D = x.shape
    y = x.reshape(B, S, degree, H // degree, D).permute(2, 0, 1, 3, 4).contiguous()  # (P, B, S, H/P, D)
    y = _a2a(y, group_name)  # y[p]: rank p's tokens, my heads
    return y.permute(1, 0, 2, 3, 4).reshape(B, degree * S, H // degree, D)


def head_to_seq(x: torch.Tensor, degree: int, group_name: str) -> torch.Tensor:
    """[B, degree * S_local, H_local, D] -> [B, S_local, degree * H_local, D]; inverse of seq_to_head."""
    B, S_all, Hl, D = x.shape
    S = S_all // degree
    y = x.reshape(B, degree, S, Hl, D).permute(1, 0, 2, 3, 4).contiguous()  # (P, B, S, Hl, D)
    y = _a2a(y, group_name)  # y[p]: my tokens, rank p's heads
    return y.permute(1, 2, 0, 3, 4).reshape(B, S, degree * Hl, D)

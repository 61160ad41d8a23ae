"""Input checks shared by the attention entry points: local metadata only, so they run before
any collective and every rank fails the same way (then ``check_ranks_agree``: the ranks agree)."""

from __future__ import annotations

from torch import Tensor


def check_qkv_tensors(q, k, v) -> None:
    """q, k, v are 4-D floating-point tensors [B, S, H, D] of one dtype on one device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 4:
            raise ValueError(f"{name} must have 4 dims [batch, seq_local, heads, head_dim], got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
        if t.shape[2] == 0 or t.shape[3] == 0:
            raise ValueError(f"{name} must have at least one head and head_dim >= 1, got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype; got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device; got q={q.device}, k={k.device}, v={v.device}")

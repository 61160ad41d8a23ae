"""Cross entropy for sequence-parallel training: token sums, a chunked head, and the global mean.

Note [Loss normalisation under sequence parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A rank of an SP x DP group holds a shard of a sequence (and of a batch). Each rank computes the
SUM of its token losses and divides by the GLOBAL number of valid tokens, all-reduced over the
SP x DP ranks:

    loss_r = sum_{t in shard r} l_t / N_global          sum_r loss_r = mean over all tokens

* The sum over ranks of ``loss_r`` is exactly the single-device mean loss of the whole batch,
  whatever the number of valid tokens on each rank (a mean of per-rank means would weight a
  rank with few valid tokens too much). Report ``all_reduce(loss_r.detach(), SUM)``.
* d(sum_r loss_r)/dθ = sum_r d(loss_r)/dθ: the gradients of the ranks ADD UP. The gradient
  reduction over the SP x DP ranks must therefore be a SUM (e.g. FSDP2's
  ``set_gradient_divide_factor(1.0)``), or the loss must be multiplied by the group size when the
  reduction averages. Sequence-distributed parameters such as learned position embeddings then
  get the right gradient with no special case (LSS Transformer's "double gradient averaging").
* The count is an integer and carries no gradient; the all-reduce happens in the forward pass only.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["IGNORE_INDEX", "GlobalMeanCalls", "chunked_cross_entropy_sum", "counting_global_mean_calls", "global_mean_loss",
           "global_token_count", "token_cross_entropy_sum"]

IGNORE_INDEX = -100
"""Label value of tokens that do not count in the loss (padding, prompt, the last position)."""


def token_cross_entropy_sum(
    logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the token cross entropies over valid labels, and the number of valid labels.

    Args:
        logits: (..., V) scores of any floating dtype; the loss is computed in fp32.
        labels: (...) target ids, ``ignore_index`` where a token does not count.

    Returns:
        ``(loss_sum, n_valid)``: an fp32 scalar and an int64 scalar tensor.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: logits must be "
            f"labels.shape + (vocab_size,)"
        )
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    return loss_sum, (labels != ignore_index).sum()


# Note [Chunked cross entropy]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The logits of a long sequence dominate memory: 32K tokens x 128K vocabulary in fp32 are 16 GiB.
# ``_ChunkedLinearCrossEntropy`` walks over chunks of ``chunk_size`` tokens and, for each one,
#
#     logits_c = h_c @ W^T                  (n, V), upcast to fp32
#     loss    += CE_sum(logits_c, y_c)
#     G_c      = softmax(logits_c) - onehot(y_c)      (rows of ignored tokens set to 0)
#     dh_c     = G_c @ W                    (n, d)   -> written into grad_hidden
#     dW      += G_c^T @ h_c                (V, d)   accumulated in fp32
#
# so the gradients are computed in the FORWARD pass (as Liger's fused linear cross entropy does),
# and only (n, V) logits exist at any time, in forward and backward. Backward just scales the
# stored (N, d) and (V, d) gradients by the incoming scalar gradient. This costs 3 matmuls
# per chunk, against 4 for torch.utils.checkpoint around each chunk (which recomputes the logits
# in backward). With a logit soft-cap c (Gemma 2's ``final_logit_softcapping``) the scores are
# c * tanh(z / c) of the raw logits z, and G_c is multiplied by their derivative 1 - tanh^2(z / c). Gradients are only computed for the inputs that require them, and not at all
# under ``torch.no_grad`` (validation).
class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,  # (N, d)
        weight: torch.Tensor,  # (V, d)
        labels: torch.Tensor,  # (N,)
        chunk_size: int,
        ignore_index: int,
        grad_hidden_needed: bool,
        grad_weight_needed: bool,
        softcap: float | None = None,
    ) -> torch.Tensor:
        loss_sum = torch.zeros((), device=hidden.device, dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden) if grad_hidden_needed else None
        grad_weight = None
        if grad_weight_needed:
            grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_size):
            h = hidden[start : start + chunk_size]  # (n, d)
            y = labels[start : start + chunk_size]  # (n,)
            logits = (h @ weight.T).float()  # (n, V)
            capped = None
            if softcap:
                capped = torch.tanh(logits / softcap)  # (n, V)
                logits = capped * softcap
            loss_sum += F.cross_entropy(logits, y, ignore_index=ignore_index, reduction="sum")
            if grad_hidden is None and grad_weight is None:
                continue
            valid = y != ignore_index  # (n,)
            g = torch.softmax(logits, dim=-1)  # (n, V)
            del logits
            g.scatter_add_(1, torch.where(valid, y, 0)[:, None], -valid[:, None].to(g.dtype))
            g.mul_(valid[:, None])
            if capped is not None:
                g.mul_(1 - capped.square())
                del capped
            g = g.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + chunk_size] = g @ weight  # (n, d)
            if grad_weight is not None:
                grad_weight += (g.T @ h).float()  # (V, d)
        ctx.save_for_backward(*(t for t in (grad_hidden, grad_weight) if t is not None))
        ctx.needed = (grad_hidden_needed, grad_weight_needed)
        ctx.weight_dtype = weight.dtype
        return loss_sum

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_loss: torch.Tensor):  # type: ignore[override]
        saved = iter(ctx.saved_tensors)
        grad_hidden_needed, grad_weight_needed = ctx.needed
        grad_hidden = grad_weight = None
        if grad_hidden_needed:
            stored = next(saved)
            grad_hidden = stored * grad_loss.to(stored.dtype)
        if grad_weight_needed:
            grad_weight = (next(saved) * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_cross_entropy_sum(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int = 4096,
    ignore_index: int = IGNORE_INDEX,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_cross_entropy_sum(hidden @ lm_head_weight.T, labels)`` without the full logits.

    At most ``chunk_size`` tokens' logits exist at a time, in forward and backward
    (Note [Chunked cross entropy]). Differentiable in ``hidden`` and ``lm_head_weight``.

    Args:
        hidden: (..., d) final hidden states, e.g. ``model(ids, pos, output="hidden")``.
        lm_head_weight: (V, d) output head weight (``model.lm_head.weight``).
        labels: (...) target ids, ``ignore_index`` where a token does not count.
        chunk_size: tokens per chunk.
        softcap: None, or c > 0: the logits are ``c * tanh(logits / c)`` (Gemma 2's
            ``final_logit_softcapping``).

    Returns:
        ``(loss_sum, n_valid)``: an fp32 scalar and an int64 scalar tensor.
    """
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be None or a number > 0, got {softcap!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if lm_head_weight.ndim != 2 or hidden.shape[-1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"lm_head_weight must be (vocab_size, d) with d = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got {tuple(lm_head_weight.shape)}"
        )
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} disagree: hidden must be "
            f"labels.shape + (d,)"
        )
    grad_on = torch.is_grad_enabled()
    loss_sum = _ChunkedLinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        lm_head_weight,
        labels.reshape(-1),
        chunk_size,
        ignore_index,
        grad_on and hidden.requires_grad,
        grad_on and lm_head_weight.requires_grad,
        None if softcap is None else float(softcap),
    )
    return loss_sum, (labels != ignore_index).sum()


@dataclass
class GlobalMeanCalls:
    """How often :func:`global_mean_loss` ran inside one :func:`counting_global_mean_calls` block."""

    count: int = 0


_COUNTER: ContextVar[GlobalMeanCalls | None] = ContextVar("lightning_seqpar.global_mean_calls", default=None)
"""The counter of the innermost :func:`counting_global_mean_calls` block of this context (a handle: no state here)."""


@contextmanager
def counting_global_mean_calls() -> Iterator[GlobalMeanCalls]:
    """``with counting_global_mean_calls() as calls: ...``: ``calls.count`` is the number of :func:`global_mean_loss`
    calls inside the block (this thread / context only). ``SequenceParallelStrategy`` counts a training step's
    calls to warn when its loss did not come from :func:`global_mean_loss`."""
    calls = GlobalMeanCalls()
    token = _COUNTER.set(calls)
    try:
        yield calls
    finally:
        _COUNTER.reset(token)


def global_mean_loss(
    loss_sum: torch.Tensor,
    n_valid: torch.Tensor | int,
    group: dist.ProcessGroup | DeviceMesh | None = None,
) -> torch.Tensor:
    """``loss_sum`` divided by the number of valid tokens summed over ``group``.

    See Note [Loss normalisation under sequence parallelism].

    Args:
        loss_sum: this rank's sum of token losses (keeps its gradient).
        n_valid: this rank's number of valid tokens (no gradient flows through it).
        group: the SP x DP ranks: a process group, or a DeviceMesh (all of its dimensions). With
            None, or a group of one rank, the local count is used and nothing is communicated.

    Returns:
        This rank's share of the global mean loss; the sum of the shares over ``group`` is the
        mean over every valid token. A global count of zero gives a zero loss (with a gradient of
        zero), never NaN.
    """
    count = global_token_count(n_valid, group, loss_sum.device)
    return loss_sum / count.clamp(min=1).to(loss_sum.dtype)


def global_token_count(
    n_valid: torch.Tensor | int,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The number of valid tokens summed over ``group`` (an int64 scalar on ``device``): the denominator of
    :func:`global_mean_loss`, which a loss that normalises itself otherwise (``CausalLMModule`` under gradient
    accumulation: Note [Loss under gradient accumulation]) calls directly; counted as a :func:`global_mean_loss` call."""
    calls = _COUNTER.get()
    if calls is not None:
        calls.count += 1
    count = torch.as_tensor(n_valid, device=device).detach().to(torch.int64).clone()
    if count.ndim != 0:
        raise ValueError(f"n_valid must be a scalar count, got shape {tuple(count.shape)}")
    if group is not None and dist.is_available() and dist.is_initialized():
        groups = group.get_all_groups() if isinstance(group, DeviceMesh) else [group]
        for g in groups:
            if dist.get_world_size(g) > 1:
                dist.all_reduce(count, op=dist.ReduceOp.SUM, group=g)
    return count


# Note [A loss of the user's own]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A LightningModule of the user's own returns ``F.cross_entropy(logits, labels)``: the mean over its
# rank's tokens. FSDP2 under the strategy SUMS gradients over the dp x sp ranks (Note [Gradient
# reduction]), so such a loss would train with dp x sp times the gradient. The strategy counts the
# step's ``global_mean_loss`` calls; where there were none, its ``backward`` divides the loss by the
# number of ranks: the mean of the per-rank means, as DDP trains. That is the global mean exactly
# when every sequence-parallel rank holds the same number of trained tokens (labels != -100): true
# for dense batches, not with padding, masked prompts or packed documents whose labels are ignored
# unevenly. So the strategy also keeps each batch's trained-token counts (this shard's and the whole
# sequence's: every sp rank holds the full batch before it is split, so no collective) and warns once
# where they differ, naming the counts and the fix: return ``global_mean_loss(loss_sum, n_valid, mesh)``,
# exact for any split. Data-parallel ranks hold different sequences; their mean of means is DDP's.


def token_shares(full: Any, local: Any, *, sp: int) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(trained tokens of this shard, of the whole batch, sp) of a batch with labels split over ``sp`` ranks, as
    tensors (no device sync); None without labels or sequence parallelism (Note [A loss of the user's own])."""
    if sp == 1 or not isinstance(full, dict) or not isinstance(local, dict):
        return None
    labels, shard = full.get("labels"), local.get("labels")
    if not isinstance(labels, torch.Tensor) or not isinstance(shard, torch.Tensor):
        return None
    return (shard != IGNORE_INDEX).sum(), (labels != IGNORE_INDEX).sum(), sp


def uneven_token_shares(shares: tuple[torch.Tensor, torch.Tensor, int] | None) -> str | None:
    """Why a per-rank mean loss is not the global mean for this batch, or None where the shards are even."""
    if shares is None:
        return None
    local, total, sp = int(shares[0]), int(shares[1]), shares[2]
    if local * sp == total:
        return None
    return (f"This step the batch had {total} trained tokens (labels != {IGNORE_INDEX}) and this rank's shard {local}, "
            f"not {total / sp:g} of {sp} sequence-parallel ranks, so the mean of per-rank means weighs tokens unevenly: "
            "return lightning_seqpar.loss.global_mean_loss(*token_cross_entropy_sum(logits, labels), self.device_mesh), "
            "exact for any split.")


def own_loss_message(ranks: int) -> str:
    """What the strategy does with a loss that did not come from :func:`global_mean_loss`."""
    return (f"the loss of training_step did not come from lightning_seqpar.loss.global_mean_loss: it is taken as a mean over "
            f"this rank's tokens, and backward averages it over the {ranks} data- and sequence-parallel ranks, as DDP does "
            "(Note [A loss of the user's own]); that is the global mean when every rank trains the same number of tokens.")


class OwnLossWarnings:
    """The strategy's warnings for a training step whose loss did not come from :func:`global_mean_loss` (Note [A loss
    of the user's own]): once that backward averages it over the ranks, and once more where the sequence-parallel ranks
    trained different numbers of tokens (then the mean of per-rank means is not the global mean)."""

    def __init__(self) -> None:
        self.warned_loss = self.warned_uneven = False

    def check(self, calls: int, *, ranks: int, shares: tuple[torch.Tensor, torch.Tensor, int] | None, owner: str) -> None:
        """After a training step with ``calls`` calls of :func:`global_mean_loss` over ``ranks`` (dp_replicate x dp_shard
        x sp) ranks; ``shares``: the step's batch's :func:`token_shares`."""
        if ranks == 1 or calls or (self.warned_loss and self.warned_uneven):
            return
        uneven = uneven_token_shares(shares)
        if uneven is not None and not self.warned_uneven:
            self.warned_uneven = self.warned_loss = True
            warnings.warn(f"{owner}: {own_loss_message(ranks)} {uneven}", stacklevel=2)
        elif not self.warned_loss:
            self.warned_loss = True
            rank_zero_warn(f"{owner}: {own_loss_message(ranks)}")

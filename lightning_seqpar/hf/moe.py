"""The router load-balancing loss of transformers MoE models, exact under sequence and data parallelism.

Note [Router auxiliary loss under sequence parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``config.output_router_logits=True`` a transformers MoE causal LM (Mixtral, Qwen2-MoE,
Qwen3-MoE, OLMoE, ...) adds ``router_aux_loss_coef * aux`` to its loss, with
``load_balancing_loss_func`` (Switch Transformer, arXiv:2101.03961, eqs. 4-6) over the router
logits of every MoE layer (``[tokens, E]`` each, the rows of all layers counted together):

    p_t = softmax(router logits of row t)           (E,)
    f_e = #{(t, k): top-k of p_t picks e} / R       (no gradient: top-k)
    P_e = sum_t p_t[e] / R                          R = number of rows (tokens x MoE layers)
    aux = E * sum_e f_e * P_e

Under the strategy a rank holds a shard of the sequences of its data-parallel slice. f and R
are GLOBAL statistics: the rank's expert counts and row count are all-reduced (SUM) over every
rank of the SP x DP mesh, exactly as the loss's token count (Note [Loss normalisation under
sequence parallelism] in ``lightning_seqpar.loss.cross_entropy``). The rank then adds its SHARE

    aux_r = E * sum_e f_e * (sum_{t in rank r} p_t[e]) / R

Summed over the ranks, the shares are ``aux`` of the whole global batch, value AND gradient
(f carries none), like the cross-entropy shares, and FSDP2 sums the gradients; the logged loss
(the sum of the shares) is transformers' own loss of the same batch on one device. One
all-reduce of ``E + 1`` numbers per step. Without a mesh the share is the whole ``aux``.

Families whose auxiliary loss is this formula over ``outputs.router_logits`` are listed in
:data:`STANDARD_AUX_LOSS_MODEL_TYPES` (each checked against transformers' own loss in
tests/test_hf_exact.py); any other model with ``output_router_logits=True`` is refused by name,
rather than trained without its auxiliary loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["STANDARD_AUX_LOSS_MODEL_TYPES", "RouterAux", "RouterStats", "router_aux", "router_stats", "router_aux_loss_share"]

STANDARD_AUX_LOSS_MODEL_TYPES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"})
"""``config.model_type`` of the families whose auxiliary loss is Note [Router auxiliary loss under sequence parallelism]."""


@dataclasses.dataclass(frozen=True)
class RouterAux:
    """How a model adds its router loss: ``coef * aux`` over ``num_experts`` experts, ``top_k`` per token."""

    num_experts: int
    top_k: int
    coef: float


@dataclasses.dataclass(frozen=True)
class RouterStats:
    """One rank's router statistics of one forward: expert picks ``counts`` (E,) (no gradient), router
    probability sums ``prob_sums`` (E,) (with gradient), ``rows`` (a 0-d float tensor)."""

    counts: Tensor
    prob_sums: Tensor
    rows: Tensor


def router_aux(model: nn.Module) -> RouterAux | None:
    """The router loss a transformers causal LM adds to its loss, or None when it adds none
    (``config.output_router_logits`` is False or absent).

    Raises:
        ValueError: ``output_router_logits=True`` on a family whose auxiliary loss is not the
            standard one (:data:`STANDARD_AUX_LOSS_MODEL_TYPES`), naming the model type.
    """
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    model_type = getattr(config, "model_type", None)
    fields = [getattr(model, name, None) for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")]
    if model_type not in STANDARD_AUX_LOSS_MODEL_TYPES or any(f is None for f in fields):
        raise ValueError(
            f"{type(model).__name__} (model_type={model_type!r}) has config.output_router_logits=True, and its router "
            f"auxiliary loss is not one lightning_seqpar computes exactly across ranks (supported: "
            f"{sorted(STANDARD_AUX_LOSS_MODEL_TYPES)}); set config.output_router_logits=False (no auxiliary loss)"
        )
    num_experts, top_k, coef = fields
    return RouterAux(num_experts=int(num_experts), top_k=int(top_k), coef=float(coef))


def router_stats(router_logits: Sequence[Tensor], aux: RouterAux) -> RouterStats:
    """This rank's statistics from the router logits of every MoE layer (``[tokens, E]`` each), as
    transformers' ``load_balancing_loss_func`` without an attention mask computes them."""
    if not router_logits:
        raise ValueError("output_router_logits=True but the model returned no router logits")
    device = router_logits[0].device
    counts = torch.zeros(aux.num_experts, dtype=torch.float32, device=device)
    prob_sums = torch.zeros(aux.num_experts, dtype=torch.float32, device=device)
    rows = 0
    for logits in router_logits:
        probs = torch.softmax(logits.to(device), dim=-1)  # (T, E), in the logits' dtype as transformers does
        picked = torch.topk(probs, aux.top_k, dim=-1).indices  # (T, k)
        counts.scatter_add_(0, picked.reshape(-1), torch.ones(picked.numel(), dtype=torch.float32, device=device))  # no host sync
        prob_sums = prob_sums + probs.float().sum(dim=0)
        rows += probs.shape[0]
    return RouterStats(counts=counts, prob_sums=prob_sums, rows=torch.tensor(float(rows), device=device))


def router_aux_loss_share(stats: RouterStats, aux: RouterAux, mesh: DeviceMesh | None = None) -> Tensor:
    """This rank's share of ``coef * aux`` of the global batch (Note [Router auxiliary loss under
    sequence parallelism]): the shares of all ranks of ``mesh`` add up to it. ``mesh``: every
    SP x DP rank (all its dimensions are reduced over); None: this rank's batch is the whole batch."""
    totals = torch.cat([stats.counts.detach(), stats.rows.reshape(1)])  # (E + 1,)
    if mesh is not None and dist.is_available() and dist.is_initialized():
        for group in mesh.get_all_groups():
            if dist.get_world_size(group) > 1:
                dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=group)
    rows = totals[-1].clamp(min=1.0)
    fractions = totals[:-1] / rows  # f_e (E,), global, no gradient
    return aux.coef * aux.num_experts * (fractions * stats.prob_sums).sum() / rows

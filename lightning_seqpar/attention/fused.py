"""The LSS Transformer's fused communication (Wang et al., arXiv:2311.02382, Principle 3):
all-gather the attention INPUT once and project K and V locally, instead of gathering K and V.

Note [Fused communication]
~~~~~~~~~~~~~~~~~~~~~~~~~~
With W sequence-parallel ranks, rank r holds x_r (B, S/W, d) and computes Q_r from it. Every
rank needs K and V of the whole sequence (Principle 3, Eq. 2). Two ways to get them:

    "kv"     K_r, V_r = x_r W_k, x_r W_v       -> all-gather K, V     (2 * H_kv * D per token)
    "input"  x = all-gather(x_r)               -> K, V = x W_k, x W_v (d per token)

          rank r:  x_r ──┬── W_q ──> Q_r ────────────────┐
                         └── all-gather ──> x ── W_kv ──> K, V ──> attention(Q_r; K, V) ──> O_r

"input" is LSS's fused all-gather (Fig. 2(ii)): one collective in the forward pass, and its
autograd backward is one reduce-scatter of dx (Fig. 2(v)); the attention backward itself needs no
communication (:func:`~lightning_seqpar.attention.gathered_kv_attention`). The W_kv projection
runs on the whole sequence on every rank (W times the K/V projection FLOPs of "kv"), and
autograd keeps the gathered x, K and V of the whole sequence until backward. "kv" with
``algorithm="allgather"`` moves 2 * H_kv * D per token in one all-gather forward, and again in
backward (re-gather) plus a reduce-scatter of dK/dV, but keeps nothing of length S.

For multi-head attention d = H * D < 2 * H * D: gathering x moves half the bytes. With grouped
or multi-query attention 2 * H_kv * D can be smaller than d, and then gathering K/V wins.
``kv_comm="auto"`` picks by that byte count (:func:`resolve_kv_comm`).

The module holds no mesh of its own: it wraps an :class:`~lightning_seqpar.attention.Attention`
(``self.core``), which ``lightning_seqpar.parallel.parallelize.apply_attention`` finds and configures like
any other (it walks ``model.modules()``, which reaches submodules). The mesh, algorithm, layout
and backend are read from ``self.core`` at every call, so the strategy's ``configure`` is the one
switch, and ``configure(mesh=None)`` goes back to local attention.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from torch import Tensor, nn

from lightning_seqpar.attention.api import Attention, gathered_kv_attention
from lightning_seqpar.sharding.layouts import gather_along

__all__ = ["KVComm", "KV_COMMS", "FusedKVAttention", "resolve_kv_comm"]

KVComm = Literal["auto", "kv", "input"]
KV_COMMS: tuple[str, ...] = ("auto", "kv", "input")

#: ``kv_proj(x) -> (k, v)``: (B, S', d) -> two (B, S', H_kv, D), for any length S'.
KVProjection = Callable[[Tensor], tuple[Tensor, Tensor]]


def resolve_kv_comm(
    kv_comm: str, *, algorithm: str | None, n_embd: int, n_kv_head: int, head_dim: int
) -> Literal["local", "kv", "input"]:
    """What :class:`FusedKVAttention` does under ``algorithm`` (None: no sequence parallelism).

    * ``"local"``: no mesh; K and V are projected from the local x (one device).
    * ``"kv"``: K and V are projected locally and handed to the strategy's ``algorithm``.
    * ``"input"``: x is all-gathered and K, V are projected for the whole sequence.

    ``kv_comm="auto"`` is ``"input"`` when the strategy all-gathers K/V (``algorithm="allgather"``)
    and x is the smaller payload, ``n_embd < 2 * n_kv_head * head_dim`` (Note [Fused
    communication]); else ``"kv"``. Ring, Ulysses and 2D attention are kept as chosen: they do
    not gather the sequence, so there is nothing to fuse. ``kv_comm="input"`` gathers x under any
    1-D algorithm ("ring", "allgather", "ulysses" all become the fused all-gather); "2d" has a
    2-D mesh and is refused.

    Raises:
        ValueError: an unknown ``kv_comm``, or ``kv_comm="input"`` with ``algorithm="2d"``.
    """
    if kv_comm not in KV_COMMS:
        raise ValueError(f"kv_comm={kv_comm!r} is not supported; expected one of {KV_COMMS}")
    if algorithm is None:
        return "local"
    if kv_comm == "input":
        if algorithm == "2d":
            raise ValueError(
                "kv_comm='input' all-gathers the layer input over a 1-D sequence-parallel mesh; attention='2d' "
                "runs over an ('hp', 'cp') mesh: use kv_comm='kv' (or 'auto') with attention='2d', or "
                "attention='allgather'"
            )
        return "input"
    if kv_comm == "auto" and algorithm == "allgather" and n_embd < 2 * n_kv_head * head_dim:
        return "input"
    return "kv"


class FusedKVAttention(nn.Module):
    """Attention whose K/V come either from the strategy's algorithm or from one all-gather of x.

    ``forward(q, x, kv_proj)`` takes this rank's queries ``q`` (B, S, H, D), the attention input
    ``x`` (B, S, d) they were projected from, and the K/V projection ``kv_proj`` (any sequence
    length), and returns (B, S, H, D). Which communication runs is :meth:`mode`
    (Note [Fused communication]); all of them give the attention of the whole sequence.

    Args:
        n_embd: d, the width of x.
        n_kv_head: H_kv, key/value heads.
        head_dim: D.
        kv_comm: "auto", "kv" or "input" (:func:`resolve_kv_comm`).
        causal: causal mask over global positions.
        scale: softmax scale, default ``1 / sqrt(D)``.
    """

    def __init__(
        self, *, n_embd: int, n_kv_head: int, head_dim: int, kv_comm: KVComm = "auto", causal: bool = True,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        resolve_kv_comm(kv_comm, algorithm=None, n_embd=n_embd, n_kv_head=n_kv_head, head_dim=head_dim)
        self.n_embd, self.n_kv_head, self.head_dim, self.kv_comm = n_embd, n_kv_head, head_dim, kv_comm
        self.core = Attention(causal=causal, scale=scale)

    def mode(self) -> Literal["local", "kv", "input"]:
        """What the next call does, from ``kv_comm`` and how ``self.core`` is configured."""
        algorithm = None if self.core.mesh is None else self.core.algorithm
        return resolve_kv_comm(self.kv_comm, algorithm=algorithm, n_embd=self.n_embd, n_kv_head=self.n_kv_head,
                               head_dim=self.head_dim)

    def forward(self, q: Tensor, x: Tensor, kv_proj: KVProjection) -> Tensor:
        mode = self.mode()  # ValueError here, before any collective
        if mode != "input":
            k, v = kv_proj(x)  # (B, S, H_kv, D) each
            return self.core(q, k, v)  # (B, S, H, D)
        mesh = self.core.mesh
        assert mesh is not None and mesh.ndim == 1
        # One all-gather of x in the forward pass; its autograd backward is one reduce-scatter.
        x_full = gather_along(x, mesh.get_group(), dim=1)  # (B, W*S, d), rank order
        k, v = kv_proj(x_full)  # (B, W*S, H_kv, D) each
        core = self.core
        return gathered_kv_attention(q, k, v, mesh=mesh, causal=core.causal, layout=core.layout,  # type: ignore[arg-type]
                                     scale=core.scale, backend=core.backend)  # (B, S, H, D)

    def extra_repr(self) -> str:
        return f"kv_comm={self.kv_comm}"

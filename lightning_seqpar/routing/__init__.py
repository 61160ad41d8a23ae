"""A user's own model under the strategy: its blocks found (``blocks``), its SDPA calls routed to the sequence-parallel
attention and its position tables read at global positions (``sdpa``), and the check at setup that it is exact
(``check``). See docs/own_model.md."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from torch import nn

__all__ = ["own_model_routing", "routed_step"]


def needs_routing(root: nn.Module) -> bool:
    """A model that computes no attention through the package's modules: its own SDPA calls are routed."""
    from lightning_seqpar.attention import Attention, LinearAttention
    from lightning_seqpar.attention.recurrent import Recurrence

    return not any(isinstance(m, (Attention, LinearAttention, Recurrence)) for m in root.modules())


def own_model_routing(root: nn.Module, *, owner: str) -> Any:
    """Install the routed SDPA in ``root`` where it has no attention module of the package (None otherwise)."""
    from lightning_seqpar.parallelize import find_blocks
    from lightning_seqpar.routing.sdpa import install_sdpa_routing, routing_of

    existing = routing_of(root)
    if existing is not None or not needs_routing(root):
        return existing
    found = find_blocks(root)
    names = {id(m): n for n, m in root.named_modules()}
    blocks_name = names.get(id(found[0][0]), "?") if found else "?"
    return install_sdpa_routing(root, [getattr(p, n) for p, n in found], owner=owner, blocks_name=blocks_name or type(root).__name__)


@contextmanager
def routed_step(routings: list[Any], batch: Any) -> Iterator[None]:
    """One training / validation / predict step of models with routed SDPA (``Routing.step``), for ``batch``."""
    if not routings:
        yield
        return
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    local_len = int(ids.shape[1]) if ids is not None and ids.dim() >= 2 else None
    with ExitStack() as stack:
        for routing in routings:
            stack.enter_context(routing.step(local_len))
        yield

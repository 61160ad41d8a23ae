"""The sequence-parallel recurrent token mixers as one parameter-free module (:class:`Recurrence`), over every
family of :mod:`lightning_seqpar.attention.recurrent`: what a model's token mixer calls, and what the strategy's
``apply_attention`` configures (as :class:`lightning_seqpar.attention.Attention`).
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.attention.recurrent.base import RECURRENT_KERNELS, Kernel, check_mesh_layout
from lightning_seqpar.attention.recurrent.conv import causal_conv1d
from lightning_seqpar.attention.recurrent.delta_rule import gated_delta_rule
from lightning_seqpar.attention.recurrent.rglru import diagonal_recurrence, sequence_starts
from lightning_seqpar.attention.recurrent.selective import selective_scan
from lightning_seqpar.attention.recurrent.ssd import ssd_scan
from lightning_seqpar.sharding.documents import PackedDocuments, current_documents


class Recurrence(nn.Module):
    """The sequence-parallel forms of the recurrent token mixers, as one parameter-free module.

    A model's token mixer calls :meth:`conv`, :meth:`delta_rule`, :meth:`ssd`, :meth:`selective` or :meth:`diagonal`; :meth:`configure`
    (the strategy's or the test's call) gives it the mesh and the layout of the batch. Unconfigured
    (or one rank) it computes the whole sequence on one device.
    """

    def __init__(self, *, chunk_size: int = 64, kernel: Kernel = "auto") -> None:
        super().__init__()
        if kernel not in RECURRENT_KERNELS:
            raise ValueError(f"kernel={kernel!r} is not supported; expected one of {RECURRENT_KERNELS}")
        self.chunk_size, self.kernel = chunk_size, kernel
        self.mesh: DeviceMesh | None = None
        self.layout: str = "zigzag"

    def configure(self, *, mesh: DeviceMesh | None, layout: Literal["zigzag", "contiguous"] = "zigzag",
                  kernel: Kernel | None = None) -> None:
        check_mesh_layout(mesh, layout)
        if kernel is not None:
            if kernel not in RECURRENT_KERNELS:
                raise ValueError(f"kernel={kernel!r} is not supported; expected one of {RECURRENT_KERNELS}")
            self.kernel = kernel
        self.mesh = mesh if mesh is not None and mesh.size() > 1 else None
        self.layout = layout

    # ``documents``: packed documents to reset the state at, default the batch's (``current_documents()``,
    # read here at forward time and bound into the autograd Functions: Note [Per-call state])

    def conv(self, x: Tensor, weight: Tensor, bias: Tensor | None, activation: str | None,
             documents: PackedDocuments | None = None) -> Tensor:
        documents = documents if documents is not None else current_documents()
        return causal_conv1d(x, weight, bias, activation=activation, mesh=self.mesh, layout=self.layout,  # type: ignore[arg-type]
                             documents=documents)

    def delta_rule(self, q, k, v, g, beta, *, use_qk_l2norm: bool = True, documents: PackedDocuments | None = None) -> Tensor:
        documents = documents if documents is not None else current_documents()
        return gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=use_qk_l2norm, mesh=self.mesh, layout=self.layout,  # type: ignore[arg-type]
                                chunk_size=self.chunk_size, kernel=self.kernel, documents=documents)  # type: ignore[arg-type]

    def ssd(self, x, dt, A, B, C, D, *, documents: PackedDocuments | None = None) -> Tensor:
        documents = documents if documents is not None else current_documents()
        return ssd_scan(x, dt, A, B, C, D, mesh=self.mesh, layout=self.layout, chunk_size=self.chunk_size,  # type: ignore[arg-type]
                        kernel=self.kernel, documents=documents)  # type: ignore[arg-type]

    def selective(self, x, dt, A, B, C, D, *, chunk_size: int = 16, documents: PackedDocuments | None = None) -> Tensor:
        documents = documents if documents is not None else current_documents()
        return selective_scan(x, dt, A, B, C, D, mesh=self.mesh, layout=self.layout, chunk_size=chunk_size,  # type: ignore[arg-type]
                              documents=documents)

    def diagonal(self, log_a: Tensor, u: Tensor, *, chunk_size: int = 16, documents: PackedDocuments | None = None) -> Tensor:
        documents = documents if documents is not None else current_documents()
        return diagonal_recurrence(log_a, u, mesh=self.mesh, layout=self.layout, chunk_size=chunk_size,  # type: ignore[arg-type]
                                   documents=documents)

    def starts(self, batch: int, local_len: int, *, documents: PackedDocuments | None = None) -> Tensor:
        """:func:`sequence_starts` on this module's mesh and layout."""
        documents = documents if documents is not None else current_documents()
        return sequence_starts(batch, local_len, mesh=self.mesh, layout=self.layout, documents=documents)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        where = "local" if self.mesh is None else f"layout={self.layout}, mesh={tuple(self.mesh.shape)}"
        return f"chunk_size={self.chunk_size}, kernel={self.kernel}, {where}"

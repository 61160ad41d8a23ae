"""The chunked kernels of the matrix-state gated recurrences, on one device and across the ranks: the gated delta
rule (``delta_rule.py``) and Mamba2's SSD (``ssd.py``) run through them.

Pure torch and fp32 (the chunked form with DeltaNet's UT transform, Yang et al. 2024 §3: Note [Chunked gated
recurrences] below), the chunk states by the blocked scan of :mod:`lightning_seqpar.attention.scan`; ``fla-core``
on CUDA when installed (:func:`resolve_kernel`); across the ranks the states pass in parallel
(:func:`parallel_scan`, Note [Parallel state passing across ranks] in ``scan.py``) or down the chain
(:func:`piece_scan` under Note [Linear recurrences under sequence sharding] in ``base.py``).
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_seqpar.attention.recurrent.base import RECURRENT_KERNELS, chain_forced, check_tokens, pieces_of, segment_layout
from lightning_seqpar.attention.scan import Segments, affine_scan, segment_scan
from lightning_seqpar.sharding.layouts import chunk_ids


# ---------------------------------------------------------------------------------------------
# one-device chunked kernels (pure torch, fp32): Note [Chunked gated recurrences]
#
# Note [Chunked gated recurrences]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# In a chunk of c tokens with entering state S_0 and G_t = g_1 + ... + g_t (log decays):
#   scalar gate (SSD):   o_t = e^{G_t} q_t^T S_0 + sum_{s<=t} e^{G_t-G_s} (q_t . k_s) v_s
#                        S_c = e^{G_c} S_0 + sum_s e^{G_c-G_s} k_s v_s^T
#   delta rule: the same with v_s replaced by the written values w_s, where
#        w_t = b_t (v_t - e^{G_t} S_0^T k_t - sum_{s<t} e^{G_t-G_s} (k_t . k_s) w_s)
#   i.e. (I + L) W = b V - (b e^{G} K) S_0 with L_ts = b_t e^{G_t-G_s} (k_t . k_s), s < t: one
#   unit-lower-triangular solve per chunk (the UT transform of DeltaNet, Yang et al. 2024 §3).
# The decays e^{G_t - G_s} are formed only for s <= t (masked before exp: no overflow).
#
# A decay per key dimension (Kimi Delta Attention, Kimi Linear §2: S_t = Diag(a_t) (I - b_t k_t k_t^T) S_{t-1}
# + b_t k_t v_t^T with a_t = exp(g_t), g_t in R^Dk) is the same with G_t a vector: the scalar e^{G_t} S_0
# becomes Diag(e^{G_t}) S_0 (q_t and k_t scaled per dimension), and every pair product
# e^{G_t-G_s} (x_t . k_s) becomes sum_d x_td k_sd e^{G_td-G_sd}: a [c, c, Dk] tensor of decays per
# chunk (still masked before exp). The state chain, the documents and the segment padding (g = 0)
# are unchanged: only the per-chunk terms differ.


def _chunk(x: Tensor, c: int) -> Tensor:
    """[B, T, H, *D] fp32 -> [B, H, N, c, *D], zero-padded at the end."""
    B, T = x.shape[:2]
    n = -(-T // c)
    x = x.float().movedim(1, 2)  # (B, H, T, *D)
    if n * c != T:
        pad = [0, 0] * (x.dim() - 3) + [0, n * c - T]
        x = F.pad(x, pad)
    return x.reshape(*x.shape[:2], n, c, *x.shape[3:])


def _chunk_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, c: int) -> dict[str, Tensor]:
    """The per-chunk terms of Note [Chunked gated recurrences] (everything but the chunk-to-chunk recurrence).

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; g: [B, T, H] log decay; beta: [B, T, H] or None (SSD).
    """
    qc, kc, vc = _chunk(q, c), _chunk(k, c), _chunk(v, c)  # (B, H, N, c, D)
    tri = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    if g.dim() == 4:  # a decay per key dimension (Kimi Delta Attention)
        G = _chunk(g, c).cumsum(3)  # (B, H, N, c, Dk); padding has g = 0 (no decay) and k = v = 0 (no update)
        diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~tri[..., None], float("-inf"))
        decay = diff.exp()  # (B, H, N, c, c, Dk): e^{G_t - G_s} per dimension, s <= t

        def pairs(x: Tensor, y: Tensor) -> Tensor:  # sum_d x_td y_sd e^{G_td - G_sd}: (B, H, N, c, c)
            return torch.einsum("bhntd,bhnsd,bhntsd->bhnts", x, y, decay)

        eG = G.exp()  # (B, H, N, c, Dk)
        terms = {"q": qc * eG, "eG_last": eG[..., -1, :, None],  # (B, H, N, Dk, 1): Diag(e^{G_c}) S
                 "k_out": kc * (G[..., -1:, :] - G).exp()}  # e^{G_c - G_s} * k_s
    else:
        G = _chunk(g, c).cumsum(-1)  # (B, H, N, c)
        diff = (G[..., :, None] - G[..., None, :]).masked_fill(~tri, float("-inf"))
        decay = diff.exp()  # (B, H, N, c, c): e^{G_t - G_s}, s <= t

        def pairs(x: Tensor, y: Tensor) -> Tensor:
            return (x @ y.transpose(-1, -2)) * decay

        eG = G.exp()[..., None]  # (B, H, N, c, 1)
        terms = {"q": qc * eG, "eG_last": eG[..., -1:, :],  # (B, H, N, 1, 1)
                 "k_out": kc * (G[..., -1:] - G).exp()[..., None]}  # e^{G_c - G_s} k_s
    terms["scores"] = pairs(qc, kc)  # (B, H, N, c, c)
    if beta is None:
        terms["u"] = vc
    else:
        bc = _chunk(beta, c)[..., None]  # (B, H, N, c, 1)
        strict = pairs(kc, kc) * bc
        system = strict.tril(-1) + torch.eye(c, dtype=strict.dtype, device=q.device)  # I + L (strictly lower L)
        terms["u"] = torch.linalg.solve_triangular(system, bc * vc, upper=False, unitriangular=True)  # (B, H, N, c, Dv)
        terms["wk"] = torch.linalg.solve_triangular(system, bc * eG * kc, upper=False, unitriangular=True)  # (B, H, N, c, Dk)
    return terms


def _chunked_scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, initial: Tensor | None,
                  chunk_size: int, pieces: int = 1, group_name: str | None = None,
                  layout: str = "zigzag") -> tuple[Tensor, Tensor]:
    """(out [B, T, H, Dv] fp32, the state after every piece [pieces, B, H, Dk, Dv] fp32 — one device: [B, H, Dk, Dv]).

    q, k: [B, T, H, Dk]; v: [B, T, H, Dv]; g: [B, T, H] (or [B, T, H, Dk]) log decay; beta: [B, T, H] or None
    (SSD). The chunk terms of every chunk at once, then the blocked state scan (Note [Blocked affine scan]);
    with ``group_name`` the T tokens are this rank's ``pieces`` pieces and the states pass across the
    ranks (Note [Parallel state passing across ranks]). Differentiable in every input and ``initial``.
    """
    B, T, H, Dk = q.shape
    Dv, n = v.shape[-1], T // pieces

    def split(x: Tensor) -> Tensor:  # [B, T, *D] -> [P B, T / P, *D]: every piece its own chunks
        return x.reshape(B, pieces, n, *x.shape[2:]).transpose(0, 1).reshape(pieces * B, n, *x.shape[2:])

    terms = _chunk_terms(split(q), split(k), split(v), split(g), None if beta is None else split(beta), chunk_size)
    u, K, W = terms["u"], terms["k_out"], terms.get("wk")  # (P B, H, N, c, D)
    per_piece = lambda x: None if x is None else x.reshape(pieces, B, *x.shape[1:])  # noqa: E731
    h_all, h_out = affine_scan(per_piece(terms["eG_last"]), per_piece(K if W is not None else None), per_piece(W),
                               per_piece(K.mT @ u), initial if initial is None else initial.float(),
                               group_name=group_name, layout=layout)
    h_all = h_all.reshape(pieces * B, *h_all.shape[2:])  # (P B, H, N, Dk, Dv): the state entering every chunk
    w = u if W is None else u - W @ h_all
    out = terms["scores"] @ w + terms["q"] @ h_all  # (P B, H, N, c, Dv)
    out = out.reshape(pieces * B, H, -1, Dv)[:, :, :n].transpose(1, 2)  # (P B, n, H, Dv)
    out = out.reshape(pieces, B, n, H, Dv).transpose(0, 1).reshape(B, T, H, Dv)
    return out, (h_out[0] if group_name is None else h_out)


def _padded(x: Tensor, gather: Tensor) -> Tensor:
    """[B, T, *D] -> [1, Tp, *D] fp32 along ``segment_layout``'s ``gather``: each segment starting a chunk, zeros
    between."""
    x = x.float().reshape(-1, *x.shape[2:])
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[gather][None]


def _chunked_scan_segments(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, initial: Tensor | None,
                           lengths: Tensor, chunk_size: int) -> tuple[Tensor, Tensor]:
    """The scan of every segment alone from its own entering state (Note [Documents in a recurrence]).

    lengths: int64 [B, N] (CPU) segment lengths, rows summing to T; initial: [B, N, H, Dk, Dv] or None
    (zero). Returns (out [B, T, H, Dv] fp32, the state after each segment [B, N, H, Dk, Dv] fp32;
    an empty segment passes its entering state through).
    """
    B, T, H, Dk = q.shape
    N, Dv, c = lengths.shape[1], v.shape[-1], chunk_size
    lay = {name: x.to(q.device) for name, x in segment_layout(lengths, T, c).items()}
    padded = functools.partial(_padded, gather=lay["gather"])

    terms = _chunk_terms(padded(q), padded(k), padded(v), padded(g), None if beta is None else padded(beta), c)
    init = q.new_zeros(B * N, H, Dk, Dv, dtype=torch.float32) if initial is None else initial.float().reshape(B * N, H, Dk, Dv)
    n_chunks = lay["seg"].numel()
    if n_chunks == 0:  # every segment empty: each passes its entering state through
        return q.new_zeros(B, T, H, Dv, dtype=torch.float32), init.reshape(B, N, H, Dk, Dv)
    # one scan over every chunk of every segment (Note [Blocked affine scan]), the resets folded into the transitions:
    # where chunk j + 1 starts a segment, A_j = 0 and b_j = that segment's entering state
    u, K, W, e = terms["u"][0], terms["k_out"][0], terms.get("wk"), terms["eG_last"][0]  # (H, NC, ...)
    W = None if W is None else W[0]
    b = K.mT @ u  # (H, NC, Dk, Dv)
    starts = lay["first"][1:]  # (NC - 1,): chunk j + 1 starts a segment
    keep = torch.cat([~starts, starts.new_ones(1)]).to(e.dtype)[:, None, None]  # (NC, 1, 1)
    enter = torch.cat([init[lay["seg"][1:]].transpose(0, 1), b.new_zeros(H, 1, Dk, Dv)], dim=1)  # (H, NC, Dk, Dv)
    b_reset = b * keep + enter * (1 - keep)
    h_all, _ = affine_scan((e * keep)[None, None], None if W is None else (K * keep)[None, None],
                           None if W is None else W[None, None], b_reset[None, None], init[lay["seg"][0]][None])
    h_all = h_all[0, 0]  # (H, NC, Dk, Dv): the state entering every chunk
    w = u if W is None else u - W @ h_all
    out = terms["scores"][0] @ w + terms["q"][0] @ h_all  # (H, NC, c, Dv)
    out = out.reshape(H, -1, Dv).transpose(0, 1)[lay["scatter"]]  # (B T, H, Dv)
    # every non-empty segment's leaving state: its last chunk's transition (without the reset) of its entering state
    last = lay["last"].nonzero()[:, 0]
    h_last = h_all[:, last]
    Ah = e[:, last] * h_last if W is None else e[:, last] * h_last - K[:, last].mT @ (W[:, last] @ h_last)
    finals = init.index_copy(0, lay["seg"][last], (Ah + b[:, last]).transpose(0, 1))
    return out.reshape(B, T, H, Dv), finals.reshape(B, N, H, Dk, Dv)


def _chunked_scan_documents(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor | None, pieces: Tensor,
                            chunk_size: int, group_name: str, layout: str) -> Tensor:
    """Every local piece of packed documents at once, the states passing across the ranks in parallel
    (Note [Parallel state passing with packed documents] in ``scan.py``). ``pieces``: int64 [B, N, P] (CPU) the
    segment lengths of this rank's P pieces (in local order). Returns out [B, T, H, Dv] fp32."""
    B, T, H, Dk = q.shape
    N, P, Dv, c = pieces.shape[1], pieces.shape[2], v.shape[-1], chunk_size
    n = T // P

    def split(x: Tensor) -> Tensor:  # [B, T, *D] -> [P B, T / P, *D]: every piece its own segments
        return x.reshape(B, P, n, *x.shape[2:]).transpose(0, 1).reshape(P * B, n, *x.shape[2:])

    lay = segment_layout(pieces.permute(2, 0, 1).reshape(P * B, N), n, c)  # flat segment (p B + b) N + n
    idx = {name: lay[name].to(q.device) for name in ("gather", "scatter")}

    def padded(x: Tensor) -> Tensor:
        return _padded(split(x), idx["gather"])

    terms = _chunk_terms(padded(q), padded(k), padded(v), padded(g), None if beta is None else padded(beta), c)
    u, K, W, e = terms["u"][0], terms["k_out"][0], terms.get("wk"), terms["eG_last"][0]  # (H, NC, ...)
    W = None if W is None else W[0]
    segs = Segments(lay["seg"], lay["first"].nonzero()[:, 0], lay["last"].nonzero()[:, 0], (P, B, N), q.device)
    h_all = segment_scan(e, None if W is None else K, W, K.mT @ u, segs, group_name=group_name, layout=layout)
    w = u if W is None else u - W @ h_all
    out = terms["scores"][0] @ w + terms["q"][0] @ h_all  # (H, NC, c, Dv)
    out = out.reshape(H, -1, Dv).transpose(0, 1)[idx["scatter"]]  # (P B n, H, Dv)
    return out.reshape(P, B, n, H, Dv).transpose(0, 1).reshape(B, T, H, Dv)


# fla path: thin, marked, tested on GPU by tests/test_recurrent.py::test_fla_kernels_match_torch


@functools.cache
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


@functools.cache
def fla_unusable(device_index: int | None) -> str | None:
    """Why fla-core's gated kernels cannot run on this CUDA device, or None.

    fla-core (0.6) refuses, in the backward, Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs (its
    issue #640: wrong results of the gated chunk_bwd_dqkwg kernel) unless tilelang is installed:
    the torch 2.11 image ships Triton 3.6.0. Checked here so that kernel="auto" takes the torch
    kernels instead of failing in the first backward."""
    import triton

    major, _ = torch.cuda.get_device_capability(device_index)
    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:3] if p.isdigit())
    if major == 9 and (3, 4, 0) <= version < (3, 7, 1) and importlib.util.find_spec("tilelang") is None:
        return (f"fla-core's gated kernels give wrong gradients with Triton {triton.__version__} on Hopper (fla issue #640; "
                "it refuses them): install Triton >= 3.7.1 or tilelang")
    return None


def resolve_kernel(kernel: str, device: torch.device, documents: bool = False) -> str:
    if kernel not in RECURRENT_KERNELS:
        raise ValueError(f"kernel={kernel!r} is not supported; expected one of {RECURRENT_KERNELS}")
    if documents:  # Note [Documents in a recurrence]: the torch kernels only
        if kernel == "fla":
            raise ValueError("kernel='fla' does not take packed documents here (the per-document state reset runs in the "
                             "package's torch kernels); use kernel='torch' or 'auto' (which runs them for packed documents)")
        return "torch"
    usable = device.type == "cuda" and fla_installed()
    why = fla_unusable(device.index) if usable else None
    if kernel == "auto":
        return "fla" if usable and why is None else "torch"
    if kernel == "fla" and not usable:
        raise ValueError(f"kernel='fla' needs CUDA tensors and fla-core (pip install fla-core); got device={device}, "
                         f"fla installed={fla_installed()}; use kernel='torch' or 'auto'")
    if kernel == "fla" and why is not None:
        raise ValueError(f"kernel='fla': {why}; or use kernel='torch' / 'auto'")
    return kernel


def gated_scan(q, k, v, g, beta, initial, chunk_size, kernel) -> tuple[Tensor, Tensor]:
    """Dispatch to the torch or the fla kernel; fp32 out and state."""
    if kernel == "fla":  # fla path: fla's own autograd Functions (they take the final-state gradient)
        if beta is None:
            from fla.ops.simple_gla import chunk_simple_gla

            out, state = chunk_simple_gla(q, k, v, g=g.float(), scale=1.0, initial_state=initial, output_final_state=True)
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            out, state = chunk_gated_delta_rule(q, k, v, g=g.float(), beta=beta, scale=1.0, initial_state=initial,
                                                output_final_state=True)
        return out.float(), state.float()
    return _chunked_scan(q, k, v, g, beta, initial, chunk_size)


# ---------------------------------------------------------------------------------------------
# the checks, and the states across the ranks: in parallel or down the chain


def check_scan(q, k, v, g, beta, chunk_size) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, Dk] of the same shape; got q={tuple(q.shape)}, k={tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, Dv] matching q; got q={tuple(q.shape)}, v={tuple(v.shape)}")
    if beta is not None and isinstance(g, Tensor) and g.dim() == 4:  # a decay per key dimension (delta rule only)
        check_tokens("g", g, tuple(q.shape))
    else:
        check_tokens("g", g, tuple(q.shape[:3]))
    if beta is not None:
        check_tokens("beta", beta, tuple(q.shape[:3]))
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def state_passing(mesh: DeviceMesh | None, kernel: str) -> bool:
    """Whether the states pass in parallel (Note [Parallel state passing across ranks], with documents Note [Parallel
    state passing with packed documents]) rather than down the chain (Note [Linear recurrences under sequence
    sharding]): the package's torch kernels (fla-core's kernels give no piece composite). SEQPAR_STATE_CHAIN=1 sends
    them down the chain anyway (the same results; for comparisons)."""
    return mesh is not None and mesh.size() > 1 and kernel == "torch" and not chain_forced()


def parallel_scan(q, k, v, g, beta, chunk_size: int, mesh: DeviceMesh, layout: str, pieces: Tensor | None) -> Tensor:
    """The torch kernels over every local piece at once, the states passing in parallel across the ranks."""
    group_name, P = mesh.get_group().group_name, pieces_of(q.shape[1], mesh, layout)
    if pieces is None:
        return _chunked_scan(q, k, v, g, beta, None, chunk_size, P, group_name, layout)[0]
    local = pieces[:, :, list(chunk_ids(mesh.get_local_rank(), mesh.size(), layout))]
    return _chunked_scan_documents(q, k, v, g, beta, local, chunk_size, group_name, layout)


def piece_scan(q, k, v, g, beta, s_in, *, piece, chunk_size, kernel, pieces=None):
    """One piece of the chain: (out, state out); with documents (``pieces`` [B, N, P]) a state per document."""
    if pieces is None:
        return gated_scan(q, k, v, g, beta, s_in, chunk_size, kernel)
    return _chunked_scan_segments(q, k, v, g, beta, s_in, pieces[:, :, piece], chunk_size)


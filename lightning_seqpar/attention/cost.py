"""A cost model of the distributed attention algorithms, and ``attention="auto"``'s choice.

Note [Choosing the attention algorithm]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
LoongTrain (Gu et al., arXiv:2406.18485, §4.5) writes the time of one attention layer as computation
plus the communication that cannot hide behind it, and picks hp x cp (and the inner ring size w)
that minimise it. We do the same for every algorithm this package implements, per rank, for one
layer's forward + backward, following what our code actually does (ring.py, allgather.py,
ulysses.py, two_d.py):

    time = compute + exposed communication + elementwise work + launch latencies

* compute: the causal FLOPs of this rank (balanced by zigzag: 2 B H S^2 D / W forward, 2.5x that
  backward, i.e. the 3.5 x 2 B H S^2 D count) at the local kernel's rate, plus a fixed cost per
  kernel call (which is what makes many small blocks slower than one large one). The rate of a
  causal (masked) call and of an unmasked block differ by ``full_block_speedup``: cuDNN runs the
  ring's unmasked half blocks ~5% faster than causal calls, so the ring ((W-1)/W of its work
  unmasked) beats Ulysses (one causal call over the whole sequence) at long S with cuDNN, and
  not with flash-attention 4, whose causal calls lose nothing (measured both ways at 1M on 4 x
  H200). The profile therefore depends on the kernel (``DeviceProfile.for_device(..., backend=)``).
* ring (over cp ranks, w = inner ring size, G = cp / w outer steps), at every step::

        forward step    max(block compute, K/V hop)                 + overlap_slowdown x hop
        backward step   max(block compute, K/V hop + fp32 dK/dV hop) + overlap_slowdown x hops
        exposed         the last dK/dV hop of every inner ring; the outer dK/dV hop (blocking)

  The outer K/V hop of a double ring hides behind the w steps of an inner ring (§4.5.3:
  T = A (w-1) + B). ``overlap_slowdown``: a transfer that hides behind compute still costs some
  time, because NCCL's kernels take SMs and memory bandwidth from the attention kernel.
* all-gather: one all-gather of K/V in forward, again in backward, then a reduce-scatter of the
  fp32 dK/dV. Nothing overlaps (allgather.py posts each collective and waits for it).
* Ulysses: one all-to-all per stage each way (Note [Overlapped Ulysses]); the first stage's inputs
  and the last stage's outputs are exposed, the others hide behind attention (``overlap_slowdown``).
  The head part of 2D: all-to-alls of q, k, v and out in forward and of their gradients in
  backward (4 + 4), not overlapped. K/V heads are repeated first when hp does not
  divide H_kv (``kv_repeat``: MQA at hp = 4 sends 4x the K/V bytes), and those bytes are counted
  (§4.5.3 Size(kv) = max(H_kv, hp) / H x 4SD / W).
* elementwise work: the fp32 merges of partial results (Note [Merging partial attention]), the
  fp32 dQ and dK/dV accumulators, the copies around the all-to-alls and the reorderings into
  global order, in bytes moved at the HBM bandwidth that torch's elementwise kernels reach, plus
  a fixed cost per elementwise kernel. On one node these, not the links, separate the
  algorithms.

Placement is the mesh's (Note [Node-aware placement] in lightning_seqpar.parallel.mesh, LoongTrain §4.4):
"context-first" makes the cp ranks of a group adjacent (the hp group has stride cp),
"head-first" the hp ranks (the cp ring has stride hp). Two link levels: a group of ``size``
ranks ``stride`` apart stays inside a node when size x stride <= gpus_per_node; otherwise each
node holds gpus_per_node / stride of its members (Note [Two link levels]).

Note [Two link levels]
~~~~~~~~~~~~~~~~~~~~~~
Inside a node GPUs talk over NVLink (``intra_node_*``), across nodes over one NIC per GPU
(``inter_node_bandwidth``, plus ``inter_node_latency_s`` per transfer). A ring hop is as slow as
its slowest link: a ring that leaves a node runs every step at the NIC's rate (the double ring
exists to keep w - 1 of every w hops on NVLink and to overlap the one outer hop with w blocks,
§4.3-4.5.3). A collective over a group with m members per node moves (m - 1)/size of its bytes
over NVLink and (size - m)/size over the NICs, at the same time (all-to-all), or all of
(size - 1)/size at the NIC's rate (ring all-gather / reduce-scatter, which NCCL runs as a ring
through every node); its latency grows by ``inter_node_latency_s`` per further node. With
``gpus_per_node`` >= W every term is intra-node and the model is the one validated on one node
(python -m benchmarks auto).

The candidates: ring, double ring (every inner size 1 < w < W dividing W), all-gather, Ulysses
(hp = W; needs W | H_q) and 2D (every 1 < hp < W with hp | W and hp | H_q, with and without inner
rings). Among the candidates within ``tie_tolerance`` of the fastest, the one with the least
estimated memory wins. The model is a guide for choosing, not a profiler: its constants are in
:class:`DeviceProfile`, with what each was calibrated against or assumed from.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Literal

from lightning_seqpar.attention.algorithms import ALGORITHMS, Algorithm
from lightning_seqpar.attention.comm import kv_repeat
from lightning_seqpar.attention.ulysses import ulysses_stages

Placement = Literal["context-first", "head-first"]
PLACEMENTS: tuple[str, ...] = ("context-first", "head-first")


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """What the cost model assumes about one GPU and its links. Rates in FLOP/s and bytes/s.

    Args:
        name: label for reports.
        attention_flops: rate of the local attention kernel on large causal blocks, counted as
            3.5 x 2 B H S^2 D per forward + backward (the benchmark's causal count).
        attention_call_s: fixed cost of one attention kernel call (forward or backward): launch,
            ramp-up and the last partial wave.
        memory_bandwidth: bytes/s that torch's elementwise kernels reach (merges, accumulators, copies).
        elementwise_call_s: fixed cost of one elementwise kernel.
        intra_node_p2p_bandwidth: bytes/s per GPU and direction of a NCCL send/recv inside a node.
        intra_node_collective_bandwidth: bus bandwidth (bytes/s per GPU) of NCCL all-gather,
            reduce-scatter and all-to-all inside a node.
        inter_node_bandwidth: bytes/s per GPU across nodes (one NIC per GPU).
        p2p_latency_s: fixed cost of one send/recv hop.
        collective_latency_s: fixed cost of one collective.
        overlap_slowdown: fraction of the time of a transfer hidden behind compute that still
            slows that compute (NCCL kernels use SMs and memory bandwidth).
        gpus_per_node: GPUs joined by the intra-node links.
        inter_node_latency_s: added to a transfer that crosses nodes (per further node for a
            collective).
        memory_bytes: device memory, for the feasibility of a candidate.
        full_block_speedup: the kernel's rate on a block without a causal mask, relative to
            ``attention_flops`` (its rate on causal calls). The ring (zigzag) spends (W-1)/W of
            its work in such blocks, Ulysses none: one causal call over the whole sequence.
    """

    name: str
    attention_flops: float
    attention_call_s: float
    memory_bandwidth: float
    elementwise_call_s: float
    intra_node_p2p_bandwidth: float
    intra_node_collective_bandwidth: float
    inter_node_bandwidth: float
    p2p_latency_s: float
    collective_latency_s: float
    overlap_slowdown: float
    gpus_per_node: int
    memory_bytes: float
    full_block_speedup: float = 1.0
    inter_node_latency_s: float = 20e-6

    def __post_init__(self) -> None:
        for name in ("attention_flops", "memory_bandwidth", "intra_node_p2p_bandwidth",
                     "intra_node_collective_bandwidth", "inter_node_bandwidth", "memory_bytes", "full_block_speedup"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DeviceProfile.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("attention_call_s", "elementwise_call_s", "p2p_latency_s", "collective_latency_s", "overlap_slowdown",
                     "inter_node_latency_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"DeviceProfile.{name} must be >= 0, got {getattr(self, name)!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"DeviceProfile.gpus_per_node must be a positive int, got {self.gpus_per_node!r}")

    @classmethod
    def h200(cls, **overrides) -> DeviceProfile:
        """One H200 (bf16, cuDNN attention) in an 8-GPU NVLink/NVSwitch node, one 400 Gb/s NIC per GPU.

        Measured (benchmarks/results, 2026-11-21): ``attention_flops`` — our cuDNN path on one
        H200 reaches 538-545 TFLOP/s causal forward + backward at S = 8K-32K (519-541 at
        128K-1M); ``full_block_speedup`` — the same kernel without a mask runs 555-562 TFLOP/s on
        the ring's half blocks at 128K-1M, against 522-541 for causal calls of those lengths
        (``benchmarks/attention.py rates``, 2026-11-22: 1.04-1.07x); the rest was checked
        against 4xH200, H 32/8, D 128: ring 510.8 / 528.3 and all-gather 513.4 / 537.3 TFLOP/s per
        GPU at S = 128K / 512K (the model gives 515 / 533 and 516 / 535).
        Assumed: the link rates (NVLink 4 is 450 GB/s per direction, NCCL reaches ~350; checked
        only through the 2- and 4-GPU attention times above), 45 GB/s per NIC (400 Gb/s InfiniBand
        per GPU = 50 GB/s, ~90% of it in NCCL's send/recv and all-to-all), 20 us extra latency per
        inter-node transfer, the other latencies and fixed call costs, 3 TB/s for elementwise
        kernels (of 4.8), ``overlap_slowdown``. Override any of them, e.g. for 200 Gb/s NICs
        ``DeviceProfile.h200(inter_node_bandwidth=22e9)``.
        """
        return replace(cls(
            name="H200", attention_flops=540e12, attention_call_s=20e-6, memory_bandwidth=3.0e12,
            elementwise_call_s=5e-6, intra_node_p2p_bandwidth=350e9, intra_node_collective_bandwidth=350e9,
            inter_node_bandwidth=45e9, p2p_latency_s=15e-6, collective_latency_s=25e-6, overlap_slowdown=0.15,
            gpus_per_node=8, memory_bytes=141e9, full_block_speedup=1.05), **overrides)

    @classmethod
    def h100(cls, **overrides) -> DeviceProfile:
        """One H100 SXM: the H200 profile with H100 memory (80 GB, 3.35 TB/s). Assumed, not
        measured: a kernel rate of 500e12 (same SMs and clocks, less memory bandwidth)."""
        return cls.h200(**{"name": "H100", "attention_flops": 500e12, "memory_bandwidth": 2.2e12, "memory_bytes": 80e9, **overrides})

    @classmethod
    def for_device(cls, device_name: str, backend: str = "cudnn", **overrides) -> DeviceProfile:
        """The profile for a ``torch.cuda.get_device_name()`` and local kernel: H100 for an H100,
        else H200 (the one measured; also the stand-in for CPU runs, where the choice does not
        matter). ``backend="fa4"``: flash-attention 4's rates (:data:`FA4_RATES`); "flash":
        flash-attention-2's (:data:`FLASH_RATES`); any other kernel is modelled as cuDNN."""
        rates = dict(FA4_RATES) if backend == "fa4" else dict(FLASH_RATES) if backend == "flash" else {}
        if "H100" in device_name.upper():
            if rates:
                rates["attention_flops"] *= 500 / 540  # the H100 profile's ratio to the H200's (assumed)
            return cls.h100(**{**rates, **overrides})
        return cls.h200(**{**rates, **overrides})


FLASH_RATES: dict[str, float] = {"attention_flops": 320e12}
"""torch's flash-attention-2 kernels on an H200: ~320 TFLOP/s causal forward + backward (H 32, D 128,
8K-128K; Note [Choosing the local kernel]); on one H100 275-302 at 8K-32K (2026-11-25), which the
H100 profile's 500/540 scaling gives (296)."""

FA4_RATES: dict[str, float] = {"attention_flops": 600e12, "full_block_speedup": 1.0}
"""flash-attention 4 on an H200 (2026-11-22, benchmarks/results): 609 TFLOP/s causal forward +
backward on one GPU at 128K, our ring / Ulysses with it 582-607 TFLOP/s per GPU at 128K-1M on 4
GPUs. Its causal scheduling leaves no gap to unmasked blocks that the distributed runs show
(Ulysses, one causal call, is 1.6% faster than the ring at 128K and at 1M): 1.0, assumed from
those runs, not measured per block."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    """The estimate for one way to run the layer. Times in seconds, memory in bytes (one rank).

    ``label`` names it the way ``benchmarks/attention.py`` does: "ring", "ring:inner2",
    "allgather", "ulysses", "2d:2x2" (hp x cp), "2d:2x4:inner2".
    """

    algorithm: Algorithm
    hp: int
    cp: int
    inner_ring_size: int | None
    est_time_s: float
    compute_s: float
    communication_s: float
    elementwise_s: float
    peak_memory_bytes: float
    kv_repeat: int = 1
    placement: Placement = "context-first"

    @property
    def label(self) -> str:
        return _label(self.algorithm, self.hp, self.cp, self.inner_ring_size, self.placement)


def _label(algorithm: str, hp: int | None, cp: int, inner: int | None, placement: str) -> str:
    base = {"2d": f"2d:{hp}x{cp}"}.get(algorithm, algorithm)
    return base + (f":inner{inner}" if inner else "") + (":head-first" if placement == "head-first" else "")


@dataclass(frozen=True, kw_only=True)
class AttentionPlan:
    """What :func:`choose_attention` picked, and every candidate it weighed (the pick first, then
    the others fastest first).

    ``hp`` / ``cp``: the head- and context-parallel degrees of the algorithm (ring and all-gather:
    1 x W; Ulysses: W x 1; 2D: hp x cp). The strategy runs Ulysses on a 1-D mesh, so its mesh
    needs ``head_parallel_size = hp if algorithm == "2d" else 1``.
    ``skipped``: (label, reason) of the combinations that cannot run.
    ``placement``: the mesh's rank order for this plan (Note [Node-aware placement]); only 2D
    with 1 < hp < W tells the two apart.
    """

    algorithm: Algorithm
    hp: int
    cp: int
    inner_ring_size: int | None
    est_time_s: float
    candidates: tuple[Candidate, ...]
    skipped: tuple[tuple[str, str], ...] = field(default=())
    placement: Placement = "context-first"

    @property
    def label(self) -> str:
        """The chosen candidate's label ("ring", "2d:2x2", ...)."""
        return self.candidates[0].label

    @property
    def head_parallel_size(self) -> int:
        """The strategy's ``head_parallel_size`` for this plan."""
        return self.hp if self.algorithm == "2d" else 1

    def picking(self, label: str) -> AttentionPlan:
        """This plan with the candidate ``label`` picked (first; the others keep their order); itself where that
        candidate is the pick already or is not among the candidates."""
        pick = next((c for c in self.candidates if c.label == label), None)
        if pick is None or pick is self.candidates[0]:
            return self
        return replace(self, algorithm=pick.algorithm, hp=pick.hp, cp=pick.cp, inner_ring_size=pick.inner_ring_size,
                       est_time_s=pick.est_time_s, candidates=(pick, *[c for c in self.candidates if c is not pick]),
                       placement=pick.placement)


# --------------------------------------------------------------------------------------------- model


@dataclass(frozen=True)
class _Shape:
    B: int
    S: int
    Hq: int
    Hkv: int
    D: int
    W: int
    e: int  # bytes per element of q, k, v
    causal: bool
    balanced: bool  # zigzag (or not causal): every rank does the same work


@dataclass
class _Tally:
    compute: float = 0.0
    comm: float = 0.0
    elementwise_bytes: float = 0.0
    elementwise_calls: int = 0

    def time(self, p: DeviceProfile) -> tuple[float, float, float]:
        ew = self.elementwise_bytes / p.memory_bandwidth + self.elementwise_calls * p.elementwise_call_s
        return self.compute, self.comm, ew


def _nodes(size: int, stride: int, gpn: int) -> tuple[int, int]:
    """(members of a group per node, whether it crosses nodes) for ``size`` ranks ``stride`` apart."""
    if size * stride <= gpn:
        return size, False
    return max(1, min(size, gpn // stride)), True


def _collective(bytes_per_rank: float, size: int, stride: int, p: DeviceProfile, ring: bool = False) -> float:
    """All-to-all (``ring=False``) or ring all-gather / reduce-scatter (``ring=True``) in which each
    rank sends (size-1)/size of ``bytes_per_rank`` (Note [Two link levels])."""
    if size == 1:
        return 0.0
    m, crosses = _nodes(size, stride, p.gpus_per_node)
    if not crosses:
        return p.collective_latency_s + bytes_per_rank * (size - 1) / size / p.intra_node_collective_bandwidth
    latency = p.collective_latency_s + p.inter_node_latency_s * (size // m - 1)
    if ring:
        return latency + bytes_per_rank * (size - 1) / size / p.inter_node_bandwidth
    intra = bytes_per_rank * (m - 1) / size / p.intra_node_collective_bandwidth
    inter = bytes_per_rank * (size - m) / size / p.inter_node_bandwidth
    return latency + max(intra, inter)


def _hop(nbytes: float, crosses: bool, p: DeviceProfile) -> float:
    if crosses:
        return p.p2p_latency_s + p.inter_node_latency_s + nbytes / p.inter_node_bandwidth
    return p.p2p_latency_s + nbytes / p.intra_node_p2p_bandwidth


def _attn_call(flops_fwd: float, p: DeviceProfile, backward: bool, causal_share: float = 1.0) -> float:
    """One kernel call of ``flops_fwd`` forward FLOPs, ``causal_share`` of them in causal (masked) calls."""
    per_flop = causal_share / p.attention_flops + (1.0 - causal_share) / (p.attention_flops * p.full_block_speedup)
    return (2.5 if backward else 1.0) * flops_fwd * per_flop + p.attention_call_s


def _fwd_flops(B: int, H: int, n_q: int, n_k: int, D: int, causal_block: bool) -> float:
    """Forward FLOPs of queries x keys (2 matmuls); a causal (diagonal) block counts half."""
    return 4.0 * B * H * n_q * n_k * D * (0.5 if causal_block else 1.0)


def _ring(sh: _Shape, hq: int, hkv: int, cp: int, w: int, t: _Tally, p: DeviceProfile, stride: int = 1) -> None:
    """Ring over ``cp`` ranks ``stride`` apart (inner rings of ``w``) for ``hq`` / ``hkv`` local heads, S / cp tokens each."""
    B, D, e = sh.B, sh.D, sh.e
    s_local = sh.S // cp
    q_el = B * s_local * hq * D
    kv_el = 2 * B * s_local * hkv * D
    G = cp // w
    _, inner_crosses = _nodes(w, stride, p.gpus_per_node)
    _, outer_crosses = _nodes(cp, stride, p.gpus_per_node)
    # work of the slowest rank: balanced (zigzag) = causal half of S_local x S; contiguous causal:
    # the last rank attends all earlier shards in full
    total = _fwd_flops(B, hq, s_local, sh.S, D, causal_block=sh.causal and sh.balanced)
    if sh.causal and not sh.balanced:
        total = _fwd_flops(B, hq, s_local, sh.S - s_local, D, False) + _fwd_flops(B, hq, s_local, s_local, D, True)
    step = total / cp
    # the causal (masked) call: the rank's own shard, 1/cp of the work when balanced; none without a mask
    if not sh.causal:
        causal_share = 0.0
    elif sh.balanced:
        causal_share = 1.0 / cp
    else:
        causal_share = _fwd_flops(B, hq, s_local, s_local, D, True) / total
    kv_hop = _hop(kv_el * e, inner_crosses, p)
    kv_dkv_hop = _hop(kv_el * (e + 4), inner_crosses, p)
    dkv_hop = _hop(kv_el * 4, inner_crosses, p)
    outer_hop = _hop(kv_el * e, outer_crosses, p)
    outer_dkv_hop = _hop(kv_el * 4, outer_crosses, p)
    s = p.overlap_slowdown

    fwd_c, bwd_c = _attn_call(step, p, False, causal_share), _attn_call(step, p, True, causal_share)
    fwd = bwd = comm = 0.0
    for o in range(G):
        # forward inner ring: the next K/V block arrives while this one is computed
        inner = (w - 1) * (max(fwd_c, kv_hop) + s * kv_hop) + fwd_c
        comm += (w - 1) * (max(fwd_c, kv_hop) - fwd_c)
        if o < G - 1:  # the outer fetch hides behind the inner ring (§4.5.3: A (w-1) + B)
            comm += max(0.0, outer_hop - inner)
            inner = max(inner, outer_hop) + s * outer_hop
        fwd += inner
        # backward: K/V and the fp32 dK/dV accumulators travel together, one step behind
        inner_b = (w - 1) * (max(bwd_c, kv_dkv_hop) + s * kv_dkv_hop) + bwd_c
        comm += (w - 1) * (max(bwd_c, kv_dkv_hop) - bwd_c)
        if w > 1:  # the last inner dK/dV hop is waited for after the inner ring
            inner_b += dkv_hop
            comm += dkv_hop
        if o < G - 1:
            comm += max(0.0, outer_hop - inner_b)
            inner_b = max(inner_b, outer_hop) + s * outer_hop
        if G > 1:  # the outer dK/dV hop is blocking
            inner_b += outer_dkv_hop
            comm += outer_dkv_hop
        bwd += inner_b
    t.compute += fwd + bwd - comm
    t.comm += comm
    # merges: the slowest rank (the last) merges all S_local rows at every step;
    # ~44 bytes per element (fp32 out x w, blk.float() x w, their sum, copy_)
    merge_el = B * cp * s_local * hq * D
    t.elementwise_bytes += 44 * merge_el + 2 * kv_el * e + 4 * q_el + 6 * q_el  # merges, stack(k, v), zeros, .to
    # backward: dq += dq_b, dK/dV block zeros, += dk_b / dv_b, += the incoming accumulator, casts
    t.elementwise_bytes += 10 * merge_el + cp * kv_el * (4 + 10 + 12) + 4 * q_el + 6 * q_el + 6 * kv_el
    t.elementwise_calls += cp * 12 + cp * 8 + 8


def _allgather(sh: _Shape, t: _Tally, p: DeviceProfile) -> None:
    B, D, e, W = sh.B, sh.D, sh.e, sh.W
    s_local = sh.S // W
    q_el = B * s_local * sh.Hq * D
    kv_el = 2 * B * s_local * sh.Hkv * D
    full_el = W * kv_el
    total = _fwd_flops(B, sh.Hq, s_local, sh.S, D, causal_block=sh.causal and sh.balanced)
    if sh.causal and not sh.balanced:
        total = _fwd_flops(B, sh.Hq, s_local, sh.S - s_local, D, False) + _fwd_flops(B, sh.Hq, s_local, s_local, D, True)
    calls = 4 if sh.causal and sh.balanced else (2 if sh.causal else 1)
    # masked calls: the two diagonal chunks (zigzag: 1/(2W) of the work), the own shard (contiguous)
    causal_share = 0.0 if not sh.causal else (_fwd_flops(B, sh.Hq, s_local, s_local, D, True) / total if not sh.balanced
                                              else 1.0 / (2 * W))
    gather = _collective(full_el * e, W, 1, p, ring=True)
    scatter = _collective(full_el * 4, W, 1, p, ring=True)
    t.compute += calls * (_attn_call(total / calls, p, False, causal_share) + _attn_call(total / calls, p, True, causal_share))
    t.comm += 2 * gather + scatter
    merged = B * s_local * sh.Hq * D * (2 if sh.causal else 1)
    order = 2 * kv_el * e + 2 * (2 * full_el * e)  # stack; permute copy + index_select into global order
    t.elementwise_bytes += order + 44 * merged + 4 * q_el + 6 * q_el
    t.elementwise_bytes += order + 4 * q_el + 10 * merged + 4 * full_el + 10 * full_el + 16 * full_el + 6 * kv_el + 6 * q_el
    t.elementwise_calls += 6 + 12 * calls + 6 + 4 * calls + 6


def _head_parallel(sh: _Shape, hp: int, stride: int, r: int, t: _Tally, p: DeviceProfile, stages: int = 0) -> None:
    """The all-to-alls of Ulysses / 2D over ``hp`` ranks ``stride`` apart and their copies. ``stages``: Ulysses'
    overlapped stages (Note [Overlapped Ulysses]; 0: 2D's functional all-to-alls, none overlapped)."""
    B, D, e = sh.B, sh.D, sh.e
    s_local = sh.S // sh.W
    q_el = B * s_local * sh.Hq * D
    kv_el = 2 * B * s_local * sh.Hkv * D
    kvr_el = r * kv_el
    a2a = lambda el: _collective(el * e, hp, stride, p)  # noqa: E731
    repeat = (kv_el + kvr_el) * e if r > 1 else 0
    copies = 2 * (2 * e) * (2 * q_el + kvr_el)  # a copy before and after each all-to-all
    if stages:
        # one all-to-all per stage each way: q k v / out in forward, dout / dq dk dv in backward; the first stage's
        # inputs and the last stage's outputs are exposed, the rest hides behind the stages' attention
        each = [a2a((q_el + kvr_el) / stages), a2a(q_el / stages)]
        t.comm += 2 * sum(x + (stages - 1) * x * p.overlap_slowdown for x in each)
        t.elementwise_bytes += 2 * copies + 2 * repeat
        t.elementwise_calls += 2 * (2 * stages * 4 + (2 if r > 1 else 0))
        return
    # forward q, k, v, out; backward dout, dq, dk, dv (k and v as separate all-to-alls)
    t.comm += 2 * (a2a(q_el) + 2 * a2a(kvr_el / 2) + a2a(q_el))
    t.elementwise_bytes += 2 * copies + 2 * repeat
    t.elementwise_calls += 2 * (4 * 2 + (2 if r > 1 else 0))


def _local(sh: _Shape, hq: int, t: _Tally, p: DeviceProfile, reorder_el: float) -> None:
    """Ulysses' inner attention: the whole sequence for ``hq`` heads, reordered to global order under zigzag."""
    total = _fwd_flops(sh.B, hq, sh.S, sh.S, sh.D, causal_block=sh.causal)
    share = 1.0 if sh.causal else 0.0  # one call over the whole sequence
    t.compute += _attn_call(total, p, False, share) + _attn_call(total, p, True, share)
    if reorder_el and sh.causal and sh.balanced and sh.W > 1:  # index_select forward, index-add backward
        t.elementwise_bytes += 2 * sh.e * reorder_el + 3 * sh.e * reorder_el
        t.elementwise_calls += 8


def _memory(sh: _Shape, algorithm: str, hp: int, cp: int, r: int, inner: int | None, chunks: int = 1) -> float:
    """Rough peak bytes of one layer's attention (inputs, outputs, gradients, buffers) on one rank.

    ``chunks``: head chunks of the ring / all-gather (Note [Head chunks]); the buffers beyond the
    inputs, outputs and their gradients hold one chunk of heads at a time."""
    B, D, e, W = sh.B, sh.D, sh.e, sh.W
    s_local = sh.S // W
    q_el = B * s_local * sh.Hq * D
    kv_el = 2 * B * s_local * sh.Hkv * D
    # q, out, dout, k, v; their gradients; lse; the kernel's fp32 dQ workspace in backward
    base = (3 * q_el + kv_el) * e + (q_el + kv_el) * e + 4 * B * s_local * sh.Hq + 4 * q_el
    kvr = r * kv_el
    if algorithm == "ulysses" or (algorithm == "2d" and cp == 1):
        return base + 3 * (2 * q_el + kvr) * e
    extra = 0.0
    if hp > 1:  # head layout copies of q, k, v, out
        extra += 2 * (2 * q_el + kvr) * e
    if algorithm == "allgather":
        full = W * kv_el
        return base + max(3 * full * e + 4 * 4 * q_el, 2 * full * e + 3 * 4 * full + 4 * q_el) / chunks
    bufs = (2 + (1 if inner and inner < cp else 0)) * kvr * e
    # forward: the fp32 output and the merge's fp32 temporaries; backward: fp32 dQ and three dK/dV buffers
    return base + extra + (bufs + max(4 * 4 * q_el, 4 * q_el + 3 * 4 * kvr + q_el * e)) / chunks


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"choose_attention: {name} must be an int >= {minimum}, got {value!r}")


def estimate_attention(
    *,
    algorithm: Algorithm,
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    world_size: int,
    hp: int | None = None,
    inner_ring_size: int | None = None,
    batch: int = 1,
    causal: bool = True,
    layout: Literal["zigzag", "contiguous"] = "zigzag",
    dtype_bytes: int = 2,
    profile: DeviceProfile | None = None,
    head_chunks: int = 1,
    placement: Placement = "context-first",
) -> Candidate:
    """The cost model's estimate for one algorithm (Note [Choosing the attention algorithm]).

    ``hp``: head-parallel degree of "2d" (dividing world_size; hp = 1 is the ring over every rank and
    hp = world_size head parallelism alone, as the attention runs them); ignored otherwise.
    ``inner_ring_size``: double ring for "ring" / "2d". ``head_chunks``: "ring" / "all-gather" over
    this many groups of K/V heads one after another (Note [Head chunks]): the same time, less
    working memory. ``placement``: the mesh's rank order for "2d" (Note [Node-aware placement]);
    the other algorithms run over one axis and ignore it. Raises ValueError, naming the argument,
    for a combination that cannot run.
    """
    profile = profile or DeviceProfile.h200()
    sh = _shape(seq_len, num_heads, num_kv_heads, head_dim, world_size, batch, causal, layout, dtype_bytes)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"estimate_attention: algorithm={algorithm!r} is not supported; expected one of {ALGORITHMS}")
    W = world_size
    if placement not in PLACEMENTS:
        raise ValueError(f"estimate_attention: placement={placement!r} is not supported; expected one of {PLACEMENTS}")
    if algorithm == "2d":
        if hp is None or isinstance(hp, bool) or not isinstance(hp, int) or not 1 <= hp <= W or W % hp:
            raise ValueError(f"estimate_attention: algorithm='2d' needs hp, a divisor of world_size ({W}) from 1 to {W}, got hp={hp!r}")
    else:
        hp = W if algorithm == "ulysses" else 1
    cp = W // hp
    if hp > 1 and num_heads % hp:
        raise ValueError(f"estimate_attention: {algorithm!r} splits num_heads={num_heads} over {hp} head-parallel ranks; "
                         f"{hp} must divide num_heads")
    if inner_ring_size is not None:
        if algorithm not in ("ring", "2d"):
            raise ValueError(f"estimate_attention: inner_ring_size is only used by 'ring' or '2d', not {algorithm!r}")
        if isinstance(inner_ring_size, bool) or not isinstance(inner_ring_size, int) or inner_ring_size < 1 or cp % inner_ring_size:
            raise ValueError(f"estimate_attention: inner_ring_size={inner_ring_size!r} must be a positive int dividing "
                             f"the context-parallel size ({cp})")
        if inner_ring_size == cp:
            inner_ring_size = None
    _check("head_chunks", head_chunks)
    if head_chunks > 1 and (algorithm not in ("ring", "allgather") or num_kv_heads % head_chunks):
        raise ValueError(f"estimate_attention: head_chunks={head_chunks} needs algorithm 'ring' or 'allgather' and must divide "
                         f"num_kv_heads={num_kv_heads}; got algorithm={algorithm!r}")
    r = kv_repeat(num_heads, num_kv_heads, hp) if hp > 1 else 1
    assert r is not None  # hp | num_heads makes r = H_q / H_kv always work
    t = _Tally()
    if W == 1:
        _local(sh, num_heads, t, profile, 0)
    elif algorithm == "allgather":
        _allgather(sh, t, profile)
    elif algorithm == "ring":
        _ring(sh, num_heads, num_kv_heads, W, inner_ring_size or W, t, profile)
    else:  # Ulysses, or 2D at any hp x cp (hp = 1 runs the ring alone: no all-to-all, no copies)
        hp_stride, cp_stride = (1, hp) if placement == "head-first" else (cp, 1)
        if hp > 1:
            overlapped = algorithm == "ulysses"  # Note [Overlapped Ulysses] (the sinks' functional path is not modelled)
            _head_parallel(sh, hp, hp_stride, r, t, profile, ulysses_stages(num_kv_heads * r // hp) if overlapped else 0)
        if cp == 1:  # Ulysses puts the zigzag shards in sequence order within its copies; 2D's cp = 1 shards are contiguous
            _local(sh, num_heads // hp, t, profile, 0)
        else:
            _ring(sh, num_heads // hp, num_kv_heads * r // hp, cp, inner_ring_size or cp, t, profile, cp_stride)
    compute, comm, ew = t.time(profile)
    return Candidate(
        algorithm=algorithm, hp=hp, cp=cp, inner_ring_size=inner_ring_size, est_time_s=compute + comm + ew,
        compute_s=compute, communication_s=comm, elementwise_s=ew,
        peak_memory_bytes=_memory(sh, algorithm, hp, cp, r, inner_ring_size, head_chunks), kv_repeat=r,
        placement=placement if algorithm == "2d" and 1 < hp < W else "context-first",
    )


def _shape(seq_len, num_heads, num_kv_heads, head_dim, world_size, batch, causal, layout, dtype_bytes) -> _Shape:
    for name, value in (("seq_len", seq_len), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("world_size", world_size), ("batch", batch), ("dtype_bytes", dtype_bytes)):
        _check(name, value)
    if num_heads % num_kv_heads:
        raise ValueError(f"choose_attention: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if seq_len < world_size:
        raise ValueError(f"choose_attention: seq_len ({seq_len}) must be at least world_size ({world_size}): every rank needs tokens")
    if not isinstance(causal, bool):
        raise ValueError(f"choose_attention: causal must be a bool, got {causal!r}")
    if layout not in ("zigzag", "contiguous"):
        raise ValueError(f"choose_attention: layout={layout!r} is not supported; expected 'zigzag' or 'contiguous'")
    return _Shape(batch, seq_len, num_heads, num_kv_heads, head_dim, world_size, dtype_bytes, causal,
                  balanced=layout == "zigzag" or not causal)


def choose_attention(
    *,
    seq_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    world_size: int,
    batch: int = 1,
    causal: bool = True,
    layout: Literal["zigzag", "contiguous"] = "zigzag",
    dtype_bytes: int = 2,
    profile: DeviceProfile | None = None,
    algorithms: Collection[str] | None = None,
    head_parallel_size: int | None = None,
    double_ring: bool = True,
    tie_tolerance: float = 0.01,
    head_chunks: int = 1,
    placement: Placement | None = None,
) -> AttentionPlan:
    """Pick the attention algorithm and hp x cp split with the least estimated time.

    Args:
        seq_len: global sequence length S (all ranks together).
        num_heads, num_kv_heads: H_q and H_kv (H_q % H_kv == 0).
        head_dim: D.
        world_size: sequence-parallel ranks W (hp x cp).
        batch: sequences per step on each rank.
        causal, layout: the mask and how the sequence is split (contiguous + causal leaves the
            ring and all-gather unbalanced; Ulysses does not care).
        dtype_bytes: bytes per element of q, k, v (2 for bf16).
        profile: the device's :class:`DeviceProfile` (default: H200).
        algorithms: restrict the candidates (default: all of ``ALGORITHMS``).
        head_parallel_size: restrict 2D to this hp (the strategy's fixed ``head_parallel_size``);
            1 allows ring, double ring, all-gather and Ulysses; None allows all.
        double_ring: include inner ring sizes.
        tie_tolerance: among candidates within this fraction of the fastest, the one with the
            least estimated memory wins.
        head_chunks: the ring and all-gather candidates run over this many groups of K/V heads
            (Note [Head chunks]; must divide num_kv_heads), which lowers their estimated memory;
            the other candidates are estimated without.
        placement: restrict 2D to this rank order (the mesh's, once built); None weighs both
            where they differ (W > ``profile.gpus_per_node``). Orders and inner rings the mesh
            would refuse (a group straddling nodes, an inner ring leaving its node; Note
            [Node-aware placement]) are skipped when W > gpus_per_node.

    Returns:
        :class:`AttentionPlan`; ``candidates`` fastest first, ``skipped`` says what cannot run.

    Raises:
        ValueError: naming the argument, for inputs no algorithm can take.
    """
    profile = profile or DeviceProfile.h200()
    _shape(seq_len, num_heads, num_kv_heads, head_dim, world_size, batch, causal, layout, dtype_bytes)
    allowed = tuple(ALGORITHMS if algorithms is None else algorithms)
    unknown = [a for a in allowed if a not in ALGORITHMS]
    if unknown or not allowed:
        raise ValueError(f"choose_attention: algorithms={tuple(allowed)!r} must be a non-empty subset of {ALGORITHMS}")
    if head_parallel_size is not None:
        _check("head_parallel_size", head_parallel_size)
        if world_size % head_parallel_size:
            raise ValueError(f"choose_attention: head_parallel_size={head_parallel_size} must divide world_size={world_size}")
    if not 0 <= tie_tolerance < 1:
        raise ValueError(f"choose_attention: tie_tolerance must be in [0, 1), got {tie_tolerance!r}")
    _check("head_chunks", head_chunks)
    if num_kv_heads % head_chunks:
        raise ValueError(f"choose_attention: head_chunks={head_chunks} must divide num_kv_heads={num_kv_heads}")
    if placement is not None and placement not in PLACEMENTS:
        raise ValueError(f"choose_attention: placement={placement!r} is not supported; expected one of {PLACEMENTS} or None")
    W = world_size
    gpn = profile.gpus_per_node
    kw = dict(seq_len=seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, world_size=W,
              batch=batch, causal=causal, layout=layout, dtype_bytes=dtype_bytes, profile=profile)
    # (algorithm, hp, inner, placement) to try
    tries: list[tuple[str, int | None, int | None, str]] = []
    cf = "context-first"
    fixed_hp = head_parallel_size
    if W == 1:
        tries.append(("ring", None, None, cf))
    else:
        if fixed_hp in (None, 1):
            if "ring" in allowed:
                tries.append(("ring", None, None, cf))
                tries += [("ring", None, w, cf) for w in _divisors(W) if 1 < w < W and double_ring]
            if "allgather" in allowed:
                tries.append(("allgather", None, None, cf))
            if "ulysses" in allowed:
                tries.append(("ulysses", None, None, cf))
        if "2d" in allowed:
            # on one node both orders give the same estimate: weigh head-first only across nodes
            orders = [placement] if placement is not None else ([cf, "head-first"] if W > gpn else [cf])
            for order in orders:
                for hp in _divisors(W):
                    if 1 < hp < W and fixed_hp in (None, hp):
                        cp = W // hp
                        tries.append(("2d", hp, None, order))
                        tries += [("2d", hp, w, order) for w in _divisors(cp) if 1 < w < cp and double_ring]
    candidates, skipped = [], []
    for algorithm, hp, inner, order in tries:
        degree = W if algorithm == "ulysses" else (hp or 1)
        label = _label(algorithm, hp, W // (hp or 1), inner, order)
        if degree > 1 and num_heads % degree:
            skipped.append((label, f"{degree} head-parallel ranks do not divide num_heads={num_heads}"))
            continue
        unplaceable = _unplaceable(W, hp or 1, inner, order, gpn)
        if unplaceable:
            skipped.append((label, unplaceable))
            continue
        chunks = head_chunks if algorithm in ("ring", "allgather") else 1
        c = estimate_attention(algorithm=algorithm, hp=hp, inner_ring_size=inner, head_chunks=chunks,  # type: ignore[arg-type]
                               placement=order, **kw)  # type: ignore[arg-type]
        if c.peak_memory_bytes > profile.memory_bytes:
            skipped.append((label, f"needs ~{c.peak_memory_bytes / 1e9:.0f} GB of {profile.memory_bytes / 1e9:.0f} GB"))
            continue
        candidates.append(c)
    if not candidates:
        reasons = "; ".join(f"{label}: {why}" for label, why in skipped) or "no candidate allowed"
        raise ValueError(f"choose_attention: no algorithm can run num_heads={num_heads} on world_size={W} "
                         f"with algorithms={allowed}, head_parallel_size={head_parallel_size} ({reasons})")
    candidates.sort(key=lambda c: c.est_time_s)
    best_time = candidates[0].est_time_s
    near = [c for c in candidates if c.est_time_s <= best_time * (1 + tie_tolerance)]
    pick = min(near, key=lambda c: (c.peak_memory_bytes, c.est_time_s))
    ordered = (pick, *[c for c in candidates if c is not pick])
    return AttentionPlan(algorithm=pick.algorithm, hp=pick.hp, cp=pick.cp, inner_ring_size=pick.inner_ring_size,
                         est_time_s=pick.est_time_s, candidates=ordered, skipped=tuple(skipped), placement=pick.placement)


def _unplaceable(W: int, hp: int, inner: int | None, placement: str, gpn: int) -> str | None:
    """Why the mesh would refuse this layout across nodes (the rules of ParallelDims and
    ParallelDims.check_inner_ring, Note [Node-aware placement]); None when it can be placed."""
    if W <= gpn:
        return None
    cp = W // hp
    group, axis, stride = (hp, "hp", hp) if placement == "head-first" else (cp, "cp", 1)
    if group > 1 and group % gpn and gpn % group:
        return f"{placement}: the {axis} groups of {group} would straddle nodes of {gpn}"
    if inner is not None and 1 < inner < cp:
        span = inner * (hp if placement == "head-first" else 1)
        if span > gpn or gpn % span:
            return f"{placement}: an inner ring of {inner} spans {span} ranks, not inside a node of {gpn}"
    return None


def causal_flops(*, batch: int, seq_len: int, num_heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention as the benchmarks count them: 3.5 x 2 B H S^2 D."""
    return 3.5 * 2 * batch * num_heads * seq_len**2 * head_dim


__all__ = [
    "PLACEMENTS",
    "AttentionPlan",
    "Candidate",
    "DeviceProfile",
    "Placement",
    "causal_flops",
    "choose_attention",
    "estimate_attention",
    "kv_repeat",
]

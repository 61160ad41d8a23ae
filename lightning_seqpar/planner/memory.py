"""GPU memory of one training step under the strategy, and ``memory="auto"``'s choice of options.

:func:`estimate_memory` gives the peak bytes on one rank as named terms (:class:`MemoryEstimate`);
:func:`plan_memory` tries the options that trade time for memory, in order of the time they cost,
and returns the first set that fits the device (:class:`MemoryPlan`), or raises ``ValueError``
with the largest sequence length that would fit. Pure arithmetic: no torch.distributed, no device.

Note [Memory per token]
~~~~~~~~~~~~~~~~~~~~~~~
A Llama-style decoder (RMSNorm, GQA attention, gated MLP) of width d, L layers, H_q query / H_kv
key-value heads of dimension D, MLP width I, vocabulary V, trained on N = B x S / sp tokens per
rank; e bytes per activation element (2 under bf16, 4 under fp32), fp32 = 4. Per token and layer:

    tensor (per token)                       bytes          1B shape, bf16     kept
    ---------------------------------------  -------------  -----------------  ------------------------------
    block input x (the checkpoint's input)   d e            4,096              until the block's backward;
                                                                               host with offload_checkpoints
    attention output + LSE (Selective++)     H_q D e + 4 H_q 4,096 + 128       until the block's backward
    RMSNorm output (norms checkpointed)      d e            4,096 (x 2 norms)  the block's recompute
    RMSNorm backward: five fp32 (N, d)       20 d           40,960             transient, one norm (a tile of
                                                                               it with mlp_chunk_size)
    q, k, v after RoPE                       (H_q + 2 H_kv) D e  6,144         the block's recompute
    MLP: gate, up, silu(gate), silu*up       4 I e          65,536             the block's recompute
    MLP backward: two I-wide gradients       2 I e          32,768             transient
    gradient flowing between blocks          d e            4,096              transient
    block input copied back (offload)        d e            4,096              transient, with offload

Selective Checkpoint++ keeps 8,320 B per token and layer (133,120 B per token over 16 layers of
the 1B shape); ``offload_checkpoints`` moves the block input to the host (4,224 B stays). Under
Ulysses and 2D it also keeps the head all-to-alls' outputs (they are in ``ATTENTION_OPS``, so the
recompute does not repeat their communication): q, k, v in the head layout, (H_q + 2 H_kv) D e, and
the output back in the sequence layout, H_q D e, per local token -- 20,480 B more per token and layer
for Llama-3-8B / Qwen3-8B (4 x H200, Qwen3-8B shape at 128K, sp 4, Ulysses with flash-attention 4:
the planner, counting ring's 8,320 only, chose 4 uncheckpointed blocks for an estimated 132.6 GB and
the step ran out of memory asking for 18.6 GiB with 115.4 GiB allocated; Llama-3-8B the same way
peaked at 133.5 GB under Ulysses against 113.2 GB under ring, estimate 131.4). A model that
normalises q and k inside its attention (Qwen3, OLMo2, Gemma 3: ``TransformerShape.qk_norm``) keeps
for those norms' backward their fp32 input copy and normalised output, (H_q + H_kv) D (4 + e) per
token and layer -- 30,720 B for Qwen3-8B -- in every uncheckpointed block and in a block's recompute,
through its attention's backward (not wrapped by Note [Checkpointed norms], which takes a block's own
norm children only; 7.9 GB per rank for Qwen3-8B at 1M on 4 GPUs). Counted
with saved-tensor hooks on the CPU, a Qwen3 layer keeps 3,881 B per token more than the same Llama
layer (3,840 predicted); uncounted, the planner left 11 blocks uncheckpointed for Qwen3-8B at 128K
under Ulysses (4 x H200) and the step went 11.9 GB over its 134.2 GB estimate; counted, 9 blocks,
133.6 GB estimated, 133.9 measured. With the fused element-wise kernels (the package's Llama, and transformers' Llama / Mistral / Qwen2 / Qwen3 norms and
MLPs, on a GPU with liger-kernel: ``TransformerShape.fused_elementwise``; Note [Fused element-wise kernels] in
``lightning_seqpar.models.fused``) a norm keeps its bf16 input and output (2 d e, no fp32 copy; the q / k norms 2 e per
element of q and k), the MLP its gate, up and their product (3 I e, no silu(gate)),
and a norm's backward holds its bf16 gradient only: for Llama-3-8B at 128K on 4 GPUs an uncheckpointed block then
costs 3.9 GB over a checkpointed one instead of 5.4 (RoPE's fp32 copies, which neither path counts, go too). The
backward of ONE block recomputes it, and its peak is the larger of two phases:

* MLP phase (the MLP's backward runs first): both norms' outputs, q/k/v, the MLP's four saved
  I-wide tensors and two I-wide gradients, the incoming gradient: 116,736 B per token for the 1B
  shape (120,832 with offload). ``mlp_chunk_size=c`` replaces the MLP's 6 I e per token by the
  same for c tokens (one tile at a time, Note [Sequence-tiled MLP]).
* norm phase: one RMSNorm's backward (Note [Checkpointed norms] in
  ``lightning_seqpar.parallel.activation_checkpointing``) beside the block's input and gradients; with
  ``mlp_chunk_size`` the norms are tiled too and its fp32 tensors are one tile's.
* attention phase: norm 1's output, the incoming gradient and the attention's own working set on
  this rank: the cost model's estimate (``attention.cost.estimate_attention(...).peak_memory_bytes``:
  q, k, v, out, their gradients, the LSE, the kernel's fp32 dQ and the algorithm's buffers, the
  latter divided by ``head_chunks``, Note [Head chunks]).

For the 1B shape on one GPU the MLP phase is the larger (the attention's ~66 KB per token, 38 KB
with head_chunks=4, is not): head chunks pay off where attention buffers dominate, on several
ranks (the ring's travelling K/V, all-gather's full K/V). ``activation_checkpointing="full"``
keeps only x per layer and adds the attention output to the recompute; ``None`` keeps the whole
recompute state per layer.

A transformers model's decoder layers compiled (``compile=True``; ``TransformerShape.compiled_transformers_layers``)
keep one more hidden state, d e, per token in every Selective Checkpoint++ layer: Qwen3-8B at 64K on 2 x H200 under
Ulysses allocated 137.7 GB compiled against 128.0 eager (estimate 130.2): 9.7 GB = 36 layers x 32,768 tokens x
8,220 B, d e = 8,192. The package's own blocks compiled (``TransformerShape.compiled_package_layers``) do the same
under the ring and all-gather: Llama-3-8B at 128K on 2 x H200, ring, one block uncheckpointed, allocated 141.1 GB
against 128.7 planned; what was alive at that step's peak (the loss; ``PEERS_MEMORY_STEP``, Note [The peak's
allocations] in benchmarks/memory_peak.py, 2026-11-28) was 64.3 GB of model states, 15.3 GB of loss and FSDP
buffers (18.3 planned) and 61.5 GB of saved activations against 46.2 planned: every checkpointed layer kept three
tensors of d e per token (the attention's output, an RMSNorm's output, one made on the MLP's line) where the eager
count is 2 d e (31 layers x 65,536 tokens x 8,192 B = 16.6 GB), and the uncheckpointed block 10.2 GB against 12.6
(compiled, no fp32 norm copies: left as an upper bound). Counted, that plan is estimated at 145.3 GB, and the
planner offloads the block inputs instead, at the same step time: 99.2 GB allocated against 100.0 planned without
the extra state, so offloaded checkpoints keep none and it is counted only for the layers whose checkpoints stay on
the GPU (the 1M recipe's plan, every checkpoint offloaded, is unchanged). Under Ulysses the records do not show it
(at 128K on 4 GPUs compiled plans measure from 12 GB under their estimates to 1.6 over, at 64K on 2 GPUs 4-6 GB
over: 134.5 / 137.3 against 130.7 / 131.4, inside the margin): not counted there until a snapshot says which term
differs.

Only dense decoders are modelled: a config with experts (``num_local_experts`` and the like) or with
recurrent / convolution layers (``layer_types`` other than attention, Mamba / LRU / conv fields) is
refused by name (``TransformerShape.from_config``), since their memory per token differs; sliding-
window layers count as full attention (an upper bound).

The loss runs before the backward (Note [Chunked cross entropy] in ``lightning_seqpar.loss.cross_entropy``):
its peak, which does not coexist with a block's backward, is the final norm's state, the hidden
states and their gradient (d (4 + 3e) per token), one chunk's logits (n x V x (e + 4 + 4): the
bf16 product, the fp32 logits, the fp32 log-softmax or softmax) and the fp32 (V, d) gradient of
the head; without ``loss_chunk_size`` the logits of all N tokens (N x V x (e + 3 x 4)).

Model states, per parameter, divided by dp_shard x sp (FSDP2 shards over both): "bf16-true" holds
bf16 parameters, bf16 gradients and AdamW's two moments in the parameter's dtype (torch's AdamW
allocates ``zeros_like(param)``): 2 + 2 + 4 = 8 B; "bf16-mixed" and "32-true" fp32 everywhere:
4 + 4 + 8 = 16 B. LoRA: the frozen base holds its parameters only (in the precision's parameter
dtype); the adapters are fp32 with fp32 gradients and moments, 16 B each (Note [LoRA under the
strategy]). Gradients are counted in full although in the first step's backward they appear
layer by layer: an upper bound, exact under gradient accumulation. ``offload_params`` moves all
three to the host. FSDP2's unsharded parameters stay on the GPU: the root module's (embeddings,
head, final norm; kept gathered through the step) and two blocks' (the one running and the one
prefetched), in the compute dtype. With ``gather_whole_model`` (one rank) every parameter stays gathered
through the step, and at the end of the backward every gradient is reduced at once: the unsharded gradients
in the compute dtype beside FSDP2's reduce buffer in the gradients' dtype, when the activations are gone
(``gradient_reduction``, a peak of its own beside the activations' one).

Peak = model states + FSDP buffers + max(L x saved per layer x N + max(block phase, loss phase),
gradient reduction) + ``OVERHEAD_BYTES``. ``MemoryEstimate.allocated`` (without the overhead) is what
``torch.cuda.max_memory_allocated`` measures. Calibration (one H200, the Llama-3.2-1B shape,
bf16-true, batch 1, AdamW, selective++, loss chunks of 8192; issue #22), with checkpointed norms:
35.3 GB at 256K with the options the planner picks for 1M (the loss phase is the peak), 109.8 GB
at 512K with offload_checkpoints and 123.8 GB at 1M (offload_checkpoints, head_chunks=4,
mlp_chunk_size=8192, offload_params); the estimate is 35.4 / 109.4 / 124.4 GB (tests/test_memory_plan.py
holds it to 5%). Before the norms were checkpointed their fp32 state was 12,288 B per token and
layer at the block's peak and the 1M step ran out of memory above 143 GB.

Note [Planning memory]
~~~~~~~~~~~~~~~~~~~~~~
The planner runs under ``memory="auto"``, and under the default ``memory=None`` where it can: on a CUDA
device, for a model whose shape :meth:`TransformerShape.from_config` reads, with a length known (Note [The
length memory="auto" plans for] in ``lightning_seqpar.planner.planning``); elsewhere None keeps the options as given
with one log line, and where nothing fits it warns with the message below instead of raising
(``planning.plan_run_memory``). It first tries no activation checkpointing at all (unless the user set it or
``offload_checkpoints``): where every layer's saved tensors fit, that is the fastest, by far at short
lengths, where Selective Checkpoint++'s recomputation is bound by the CPU (one H200, Llama-3.2-1B
shape, one GPU: 4K 30,527 tokens/s without checkpointing against 13,099 with selective++, plain
transformers 28,650; 32K 27,510 against 24,437 at 84.3 GB, estimate 83.8). Otherwise it starts
from the options as the user gave them and walks :data:`LADDER`, the
changes that save memory in order of what they cost in time: for fp32 LoRA adapters under
"bf16-true", ``bf16_adapters`` (no time: the adapters compute in bf16, Note [Adapters in bf16] in
``lightning_seqpar.hf.lora``; it changes their rounding, so it is dropped again where nothing else is
needed), then ``offload_checkpoints`` (copies on
a side stream that overlap the forward; ~2 GB / 25 GB/s per block in the backward), then
``head_chunks`` 2, 4, 8 (more, smaller attention calls and messages), then ``mlp_chunk_size``
(the MLP forward a third time), then ``offload_params`` (PCIe copies of every block's shard and
the optimizer step on the CPU), and last ``activation_checkpointing="full"``: attention is
recomputed (one more attention forward per layer, a quarter of a long step's time) only when
memory, not time, binds, and its output is no longer kept (Selective Checkpoint++'s H_q D e + 4 H_q
per token and layer). Each step is added to the ones before it (head_chunks replaces the smaller
count; "full" is tried once without and once with offload_params, for where the host binds) and
the walk stops at the first set that fits: its estimate within ``(1 - margin) x`` the device's
memory AND its pinned host bytes (``MemoryEstimate.host``: the offloaded block inputs, L x N x d e,
and the offloaded model states) within ``(1 - margin) x`` the host memory available to the rank
(MemAvailable / GPUs per node; pinning more than the host has would stop the run far from the
planner). Where no set fits because the host binds, the sets are walked again with only the first k
blocks offloaded (``offload_checkpoints=k``; the last L - k keep their inputs on the device, which
backward needs first), k the most the host holds. Then what that set does not need is dropped again, the costliest first
(activation_checkpointing, offload_params, mlp_chunk_size, head_chunks down to the fewest that
fit, offload_checkpoints, bf16_adapters): head chunks save nothing where the MLP phase is the larger one, but
once the MLP is tiled the attention phase may be. What the chosen set leaves of the budget then goes to
speed, first on one rank (dp_shard x sp = 1, nothing offloaded: where memory binds enough to offload, the
step is long and not bound by the CPU) ``gather_whole_model``, FSDP2 over the root only, the whole model
gathered once per step, where its estimate still fits (also after no checkpointing at all: Note [One rank:
one gather per step] in ``lightning_seqpar.parallel.parallelize``, issue #43: a short step on one GPU is bound by the
CPU, and every FSDP2 group costs Python); then the most blocks left without checkpointing (``uncheckpointed_blocks``, the last blocks; no recompute
in their backward) whose estimate still fits, where checkpointing is on and nothing is offloaded (4 x H200,
Llama-3-8B at 64K, sequence-parallel 4 with the chunked loss: 24 blocks uncheckpointed gave 4,390 tokens/s
per GPU against 4,100 with none; a user-set count is counted in the estimate, which before left it out and
let 12 blocks at 128K stop making progress after the first step). An option the user set is never changed (its
step is skipped; "selective++", the default, counts as unset). When nothing fits, the error names
``expected_seq_len``, the device memory, the estimate nearest to fitting with its largest term
(and the host's share where the host binds), and the longest length (a multiple of lcm(1024,
2 sp)) that set would fit, found by binary search over the estimate.

LoRA (``trainable_params``, ``lora_targets``): peft casts each adapted layer's input to the fp32
adapters' dtype and ``lora_A`` keeps that copy for its backward, so a block's recompute holds
4 x (input width) bytes per token and adapted layer (the attention projections' through the whole
block backward, the MLP's per tile), plus the fp32 sum of base and adapter outputs of the widest
adapted attention projection. Measured on one H200 (Llama-3-8B shape, r = 16 on every linear
layer): 49.4 GB at 32K (estimate 51.1), 112.8 GB at 192K (125.2); without these terms the estimate
at 256K was 125.0 GB where the step ran out of memory above 143 GB.

Note [Attention and memory chosen together]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Where memory binds, attention="auto" and the memory plan are one decision: Selective Checkpoint++ keeps more per
token and layer under Ulysses / 2D (the head all-to-alls' outputs too: 28,800 B for the Qwen3-8B shape) than under
the ring or all-gather (the attention output and LSE: 8,320 B), so at long lengths the cost model's fastest
attention can be the one the planner must recompute (activation_checkpointing="full", the walk's last step), and
recomputing attention adds its forward again, 1 of the 3.5 parts of its FLOPs. Measured (4 x H200, issue #39,
session 20261127-5): the Qwen3-8B shape at 640K with flash-attention 4 ran Ulysses with full recomputation,
250 s per step, where the cost model had Ulysses 1% ahead of the ring on attention alone (185 against 187 s per
step) and the ring fits with Selective Checkpoint++ and offloaded block inputs (107 GB); on the kernels alone
(the attention suite, 32/8 heads, 4 x H200, FA4) the ring is 3.6% slower than Ulysses at 512K and 1.6% at 1M,
where recomputation costs 28.6%. So under attention="auto", :func:`plan_attention_and_memory` plans the memory of
every candidate of the cost model that the mesh allows and scores each L x its attention time x (1 + 1/3.5 where
its plan recomputes attention); the fastest wins (of those within 1%, the cost model's tie tolerance, the one
with the least attention memory), and setup resolves "auto" to the candidate the memory was planned for
(``MemoryPlan.attention``). The mesh comes first: with head_parallel_size="auto" (or placement="auto")
and a length known before the process group exists (``expected_seq_len``, a datamodule's ``seq_len``), its hp and
placement are chosen the same way over every candidate (``planning.plan_parallel_dims``; Llama-70B shape at 4M on
64 GPUs: the cost model's 2D 8 x 8 must recompute attention, ~2,950 s per step planned, a ring over all 64 fits
without, ~2,350 s: the mesh becomes hp = 1); then the memory plan weighs the candidates of that mesh. ``seqpar
plan`` makes the same choice. Of the other options only offloaded parameters are weighed: the score adds their
model states' bytes over :data:`OFFLOADED_STATES_RATE` (8.5 GB/s). Measured why (2 x H200, cuDNN, Llama-3-8B at
128K, 2026-11-28, a55f0e4): on attention time alone Ulysses won, whose memory fits only with the parameters
offloaded (64 GB pinned, 28.5 s per step after the first), where the ring fits with Selective Checkpoint++ alone
(20.9 s): the PCIe copies and the optimizer step on the CPU cost 7.5 s of that step, more than recomputing
attention would. (At 1M on 16 GPUs, Llama-70B shape, 70 GB of states per rank cost ~8 s of a ~630 s step, less
than recomputing attention: there the ring with offloaded parameters stays.) Offloaded checkpoints overlap the
forward (6% of a Qwen3-8B step at 64K on 2 x H200), head chunks cost the cost model nothing, MLP tiles cost the
same for every candidate that needs them, and uncheckpointed blocks save a few percent at the lengths where memory
binds (4 x H200 at 128K: Ulysses with 8 blocks uncheckpointed ran 3,166 tokens/s/GPU, the ring with 11 3,123). At
128K on 4 GPUs every candidate keeps Selective Checkpoint++ and Ulysses runs; from ~512K the ring runs
with its memory options instead of Ulysses with recomputation (estimate at 640K: 187 s of attention instead of
238 s). Measured side by side (4 x H200, cuDNN, the Qwen3-8B shape at 128K, the same 12 blocks uncheckpointed):
the ring with Selective Checkpoint++ 12.71 s per step, Ulysses recomputing attention in 24 blocks 14.40 s; the
score predicts 1.4 s of the 1.69 s difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from lightning_seqpar.attention.cost import AttentionPlan, Candidate, estimate_attention
from lightning_seqpar.planner.model_shape import TransformerShape

__all__ = [
    "LADDER",
    "OFFLOADED_STATES_RATE",
    "OVERHEAD_BYTES",
    "RECOMPUTED_ATTENTION",
    "MemoryEstimate",
    "MemoryOptions",
    "MemoryPlan",
    "MemoryPlanError",
    "TransformerShape",
    "estimate_memory",
    "ladder",
    "largest_fitting_seq_len",
    "plan_attention_and_memory",
    "plan_memory",
]

OVERHEAD_BYTES = 1.5e9
"""What a process holds on the GPU outside the caching allocator's tensors: the CUDA context and
kernel images (~0.5-0.7 GB with torch's lazy module loading), NCCL's communicators and buffers,
cuBLAS / cuDNN workspaces. Assumed, not measured per device."""

DEFAULT_MARGIN = 0.10
"""The share of device memory the planner leaves free: the caching allocator's fragmentation
(``max_memory_reserved`` above ``max_memory_allocated``) and what the estimate leaves out."""

NORM_BACKWARD = 5 * 4
"""Bytes per token and channel that one RMSNorm's backward holds at once as autograd runs Hugging Face's ops:
five fp32 (N, d) tensors (measured with the allocator's history, Note [Checkpointed norms])."""

MLP_TILE = 8192
"""The ``mlp_chunk_size`` the planner picks (tokens per slice)."""
LORA_ATTENTION = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})
"""Adapted linear layers of the attention block (their fp32 input copies live through the whole block's
backward); the MLP's (gate_proj, up_proj, down_proj) are tiled with ``mlp_chunk_size``."""

PARAM_BYTES: dict[str, tuple[int, int, int, int]] = {
    # precision: (parameter, gradient, optimizer state, activation element) bytes
    "bf16-true": (2, 2, 4, 2), "16-true": (2, 2, 4, 2),
    "bf16-mixed": (4, 4, 8, 2), "16-mixed": (4, 4, 8, 2),
    "32-true": (4, 4, 8, 4), "32": (4, 4, 8, 4), "64-true": (8, 8, 16, 8),
}
"""Per-parameter bytes of a trained parameter by Trainer precision (Note [Memory per token])."""

AcMode = Literal["selective++", "full"] | None


@dataclass(frozen=True, kw_only=True)
class MemoryOptions:
    """The strategy options that trade time for memory (the strategy's names and meaning)."""

    activation_checkpointing: AcMode = "selective++"
    offload_checkpoints: bool | int = False
    head_chunks: int = 1
    mlp_chunk_size: int | None = None
    offload_params: bool = False
    bf16_adapters: bool = False
    uncheckpointed_blocks: int = 0
    gather_whole_model: bool = False
    """One rank only (dp_shard x sp = 1, no offload_params): FSDP2 shards the root alone, so the whole model is gathered
    once per step and stays gathered (Note [One rank: one gather per step] in ``lightning_seqpar.parallel.parallelize``)."""

    def changes(self) -> str:
        """The options that differ from the defaults, short ("offload_checkpoints, head_chunks=4"); "defaults" when none."""
        defaults = MemoryOptions()
        parts = [name if value is True else f"{name}={value}" for name, value in
                 ((f.name, getattr(self, f.name)) for f in fields(self)) if value != getattr(defaults, name)]
        return ", ".join(parts) or "defaults"

    def label(self) -> str:
        parts = [f"activation_checkpointing={self.activation_checkpointing!r}"]
        parts += [f"offload_checkpoints={self.offload_checkpoints}", f"head_chunks={self.head_chunks}",
                  f"mlp_chunk_size={self.mlp_chunk_size}", f"offload_params={self.offload_params}"]
        if self.bf16_adapters:
            parts.append("bf16_adapters=True")
        if self.uncheckpointed_blocks:
            parts.append(f"uncheckpointed_blocks={self.uncheckpointed_blocks}")
        if self.gather_whole_model:
            parts.append("gather_whole_model=True")
        return ", ".join(parts)


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Peak GPU bytes of one rank in one training step, by term (Note [Memory per token])."""

    seq_len: int
    tokens: int
    """Tokens on this rank: batch x seq_len / sp."""
    options: MemoryOptions
    parameters: float
    gradients: float
    optimizer_states: float
    fsdp_buffers: float
    """Unsharded parameters: the root module's and two blocks' (with ``gather_whole_model`` every parameter's)."""
    saved_per_layer: float
    """Bytes each layer keeps on the device until its backward (for all of this rank's tokens; the mean over the
    layers where only some offload their input)."""
    saved_activations: float
    """``saved_per_layer`` x layers."""
    block_recompute: float
    """The larger phase of one block's backward (its recompute and gradients)."""
    attention_working: float
    """The attention phase alone (the cost model's estimate, with ``head_chunks``), for reports."""
    loss_working: float
    """The chunked (or full) loss, which runs before the backward."""
    gradient_reduction: float = 0.0
    """``gather_whole_model``: the one reduction of every gradient at the end of the backward (the unsharded gradients in
    the compute dtype beside FSDP2's fp32 reduce buffer); it does not coexist with the saved activations."""
    host: float = 0.0
    """Pinned host bytes of this rank: the offloaded block inputs (``offload_checkpoints``) and the model states
    (``offload_params``); not in :attr:`total`."""
    overhead: float = OVERHEAD_BYTES
    host_states: float = 0.0
    """The model states' share of :attr:`host` (``offload_params``: parameters, gradients and optimizer states of
    this rank), which every step moves over PCIe and steps on the CPU (:data:`OFFLOADED_STATES_RATE`)."""

    @property
    def activations_peak(self) -> float:
        return max(self.block_recompute, self.loss_working)

    @property
    def allocated(self) -> float:
        """What ``torch.cuda.max_memory_allocated`` should read: every term but the overhead."""
        return (self.parameters + self.gradients + self.optimizer_states + self.fsdp_buffers
                + max(self.saved_activations + self.activations_peak, self.gradient_reduction))

    @property
    def total(self) -> float:
        return self.allocated + self.overhead

    def terms(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer_states": self.optimizer_states,
                "fsdp_buffers": self.fsdp_buffers, "saved_activations": self.saved_activations,
                "block_recompute": self.block_recompute, "loss_working": self.loss_working, "overhead": self.overhead,
                **({"gradient_reduction": self.gradient_reduction} if self.gradient_reduction else {})}

    def largest_term(self) -> str:
        terms = self.terms()
        return max(terms, key=terms.__getitem__)

    def describe(self) -> str:
        """One line: the total and every term, in GB."""
        inner = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in self.terms().items())
        return f"{self.total / 1e9:.1f} GB ({inner})" + (f", {self.host / 1e9:.1f} GB pinned on the host" if self.host else "")


def _precision_bytes(precision: str) -> tuple[int, int, int, int]:
    if precision not in PARAM_BYTES:
        raise ValueError(f"precision={precision!r} is not modelled; expected one of {sorted(PARAM_BYTES)}")
    return PARAM_BYTES[precision]


def estimate_memory(
    *,
    model_shape: TransformerShape,
    seq_len: int,
    sp: int = 1,
    dp_shard: int = 1,
    precision: str = "bf16-true",
    options: MemoryOptions = MemoryOptions(),
    batch_size: int = 1,
    loss_chunk_size: int | None = None,
    trainable_params: int | None = None,
    lora_targets: Collection[str] = (),
    attention: str = "ring",
    head_parallel_size: int = 1,
) -> MemoryEstimate:
    """Peak GPU memory of one rank for one training step (Note [Memory per token]).

    Args:
        model_shape: the decoder's sizes.
        seq_len: the global sequence length; each of the ``sp`` ranks holds ``seq_len / sp`` tokens.
        sp: sequence-parallel ranks; dp_shard: the data-parallel ranks FSDP2 shards over besides them.
        precision: the Trainer's ("bf16-true", "bf16-mixed", "32-true", ...).
        options: activation_checkpointing, offload_checkpoints, head_chunks, mlp_chunk_size, offload_params.
        batch_size: sequences per step and rank (the micro-batch).
        loss_chunk_size: ``CausalLMModule``'s; None: the full logits.
        trainable_params: LoRA: the adapters' parameter count (fp32, with gradients and AdamW state);
            the rest of the model is frozen. None: every parameter is trained.
        lora_targets: LoRA: the adapted linear layers of a block (names of ``lightning_seqpar.planner.planning.LORA_LINEARS``);
            each keeps an fp32 copy of its input for its backward (Note [Memory per token]); and "lm_head"
            where the output head is adapted (the chunked loss then widens its operands).
        attention: the algorithm ("ring", "allgather", "ulysses", "2d"; "auto" and "lasp" are estimated as
            "ring"); head_parallel_size: hp of "2d".
    """
    for name, value in (("seq_len", seq_len), ("sp", sp), ("dp_shard", dp_shard), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"estimate_memory: {name} must be a positive int, got {value!r}")
    if seq_len % sp:
        raise ValueError(f"estimate_memory: seq_len={seq_len} must be a multiple of sp={sp}")
    p_bytes, g_bytes, o_bytes, e = _precision_bytes(precision)
    m = model_shape
    d, L, Hq, Hkv, D, I, V = (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim,
                              m.intermediate_size, m.vocab_size)
    n = batch_size * seq_len // sp  # tokens on this rank
    shards = sp * dp_shard

    # model states (sharded over dp_shard x sp), on the host with offload_params
    if trainable_params is None:
        parameters, gradients, optimizer = m.params * p_bytes, m.params * g_bytes, m.params * o_bytes
    else:  # LoRA: a frozen base in the parameter dtype, fp32 adapters with fp32 gradients and moments
        parameters = m.params * p_bytes + trainable_params * 4
        gradients, optimizer = trainable_params * 4, trainable_params * 8
    on_host = options.offload_params
    host = states_on_host = (parameters + gradients + optimizer) / shards if on_host else 0.0
    parameters, gradients, optimizer = (0.0, 0.0, 0.0) if on_host else (parameters / shards, gradients / shards, optimizer / shards)
    # FSDP2 gathers into its own buffers (on one rank too): the root module's, kept through the step, and two blocks';
    # with gather_whole_model every parameter, kept through the step, and all gradients reduced at once at its end
    # (Note [One rank: one gather per step] in lightning_seqpar.parallel.parallelize)
    reduction = 0.0
    if options.gather_whole_model:
        if shards != 1 or options.offload_params:
            raise ValueError(f"estimate_memory: gather_whole_model is for one rank without offload_params (FSDP2 over "
                             f"dp_shard x sp = 1), got dp_shard x sp = {shards}, offload_params={options.offload_params}")
        fsdp_buffers = m.params * e
        # the unsharded gradients in the compute dtype beside FSDP2's reduce buffer in the gradients' dtype (fp32 adapters:
        # 4 + 4, an upper bound under bf16_adapters)
        reduction = m.params * (e + g_bytes) if trainable_params is None else trainable_params * (4 + 4)
    else:
        fsdp_buffers = (m.root_params + 2 * m.block_params) * e

    # per token (Note [Memory per token])
    x = d * e
    attn_out = Hq * D * e + 4 * Hq
    norm = d * (4 + e)
    qkv = (Hq + 2 * Hkv) * D * e
    qk_norm = (Hq + Hkv) * D * (4 + e) if m.qk_norm else 0  # the q / k norms' fp32 input copy and normalised output
    mlp_saved = (4 if m.gated_mlp else 2) * I * e
    norm_backward = NORM_BACKWARD
    if m.fused_elementwise:  # Note [Memory per token]: the fused kernels keep bf16 inputs, no fp32 copy, no silu(gate)
        norm, norm_backward = 2 * d * e, e
        mlp_saved = (3 if m.gated_mlp else 2) * I * e
        qk_norm = (Hq + Hkv) * D * 2 * e if m.qk_norm else 0
    mlp_grads = 2 * I * e
    mode = options.activation_checkpointing
    # offload_checkpoints: every checkpointed block (True) or the first k; the others keep their input on the device
    # uncheckpointed_blocks: the last u blocks keep every saved tensor, as without checkpointing
    u = 0 if mode is None else min(int(options.uncheckpointed_blocks), L)
    k = 0 if mode is None else L - u if options.offload_checkpoints is True else min(int(options.offload_checkpoints), L - u)
    back = x if k else 0  # the offloaded input copied back for the recompute
    # LoRA (peft casts each adapted layer's input to the fp32 adapter's dtype; lora_A keeps that copy), and the
    # fp32 sum of base output and adapter output that the widest adapted attention projection forms
    widths = {"q_proj": d, "k_proj": d, "v_proj": d, "o_proj": Hq * D, "gate_proj": d, "up_proj": d, "down_proj": I}
    head_lora = "lm_head" in lora_targets  # Note [An adapted output head]: the loss widens the hidden states and the head
    lora_targets = [t for t in lora_targets if t != "lm_head"]
    unknown = set(lora_targets) - set(widths)
    if unknown:
        raise ValueError(f"estimate_memory: lora_targets {sorted(unknown)} are not among {sorted(widths)}")
    if options.bf16_adapters and trainable_params is not None:
        # Note [Adapters in bf16]: lora_A keeps its input itself, one tensor for the layers that read the same one
        # (q|k|v read the normed x, gate|up the normed x of the MLP): x e, plus o_proj's / down_proj's own inputs
        read = {"q_proj": "x", "k_proj": "x", "v_proj": "x", "o_proj": "o", "gate_proj": "y", "up_proj": "y", "down_proj": "h"}
        lora_attn = sum({read[t]: widths[t] for t in lora_targets if t in LORA_ATTENTION}.values()) * e
        lora_mlp = sum({read[t]: widths[t] for t in lora_targets if t not in LORA_ATTENTION}.values()) * e
    else:
        lora_attn = sum(4 * widths[t] for t in lora_targets if t in LORA_ATTENTION)
        outputs = {"q_proj": Hq * D, "k_proj": Hkv * D, "v_proj": Hkv * D, "o_proj": d}
        lora_attn += 8 * max((outputs[t] for t in lora_targets if t in LORA_ATTENTION), default=0)
        lora_mlp = sum(4 * widths[t] for t in lora_targets if t not in LORA_ATTENTION)
    if options.mlp_chunk_size is None:
        mlp_saved += lora_mlp
        lora_tile = 0
    else:
        lora_tile = min(options.mlp_chunk_size, n) * lora_mlp

    # the MLP's saved tensors and gradients: the whole rank's tokens, or one tile
    if options.mlp_chunk_size is not None:
        tile = min(options.mlp_chunk_size, n) * (mlp_saved + mlp_grads)
        mlp_tokens = 0
    else:
        tile = 0
        mlp_tokens = mlp_saved + mlp_grads
    algorithm = attention if attention in ("ring", "allgather", "ulysses", "2d") else "ring"
    attention_bytes = estimate_attention(
        algorithm=algorithm,  # type: ignore[arg-type]
        seq_len=seq_len, num_heads=Hq, num_kv_heads=Hkv, head_dim=D, world_size=sp,
        hp=head_parallel_size if algorithm == "2d" else None, batch=batch_size, dtype_bytes=e,
        head_chunks=options.head_chunks if algorithm in ("ring", "allgather") else 1,
    ).peak_memory_bytes

    kept_on_device = x * (L - u - k) / max(L - u, 1)  # the block inputs not offloaded, averaged over the checkpointed layers
    # Ulysses / 2D: Selective Checkpoint++ also keeps the head all-to-alls' outputs (q, k, v in, the output back)
    head_all_to_alls = qkv + Hq * D * e if algorithm in ("ulysses", "2d") else 0
    head_out = Hq * D * e if algorithm in ("ulysses", "2d") else 0  # unchecked: the attention's output in both layouts
    if mode == "selective++":
        saved_token = kept_on_device + attn_out + head_all_to_alls
        # Note [Memory per token]: compiled layers keep one more hidden state (measured: transformers layers; the
        # package's own under the ring / all-gather, where their checkpoints stay on the GPU)
        saved_token += x if m.compiled_transformers_layers else 0
        saved_token += kept_on_device if m.compiled_package_layers and algorithm in ("ring", "allgather") else 0
        recompute_extra = 0
    elif mode == "full":
        saved_token = kept_on_device
        recompute_extra = attn_out  # the recompute runs the attention again and keeps its output
    else:  # no checkpointing: every layer keeps what its backward needs
        saved_token = x + 2 * norm + qkv + qk_norm + attn_out + head_out + (mlp_saved if options.mlp_chunk_size is None else 0)
        recompute_extra = 0
    bare_token = x + 2 * norm + qkv + qk_norm + attn_out + head_out + (mlp_saved if options.mlp_chunk_size is None else 0) + lora_attn
    if mode is None:  # the saved tensors are in saved_token; the backward adds gradients
        saved_token += lora_attn
        mlp_phase = n * ((mlp_grads if options.mlp_chunk_size is None else 0) + x) + tile + lora_tile
        attention_phase = attention_bytes + n * x
        norm_phase = 0
    else:  # the norms run under their own checkpoints (Note [Checkpointed norms]): their outputs are what stays
        mlp_phase = n * (2 * x + qkv + qk_norm + mlp_tokens + x + back + recompute_extra + lora_attn) + tile + lora_tile
        attention_phase = n * (x + x + back + recompute_extra + lora_attn + qk_norm) + attention_bytes  # the q / k norms back after it
        rows = n if options.mlp_chunk_size is None else min(options.mlp_chunk_size, n)  # tiled with the MLP
        norm_phase = n * (3 * x + back) + rows * norm_backward * d
    block = max(mlp_phase, attention_phase, norm_phase)
    host += k * n * x  # every offloaded block's input, pinned until its backward

    # the loss (before the backward)
    head_grad = V * d * 4 if (trainable_params is None or head_lora) else 0
    if loss_chunk_size is None:
        loss = n * V * (e + 3 * 4)
    else:
        loss = min(loss_chunk_size, n) * V * (e + 4 + 4) + head_grad
        if head_lora:  # the widened copies of the hidden states and of the head's weight
            loss += n * d * e + V * d * e
    loss += n * (norm + 2 * x)

    return MemoryEstimate(
        seq_len=seq_len, tokens=n, options=options, parameters=float(parameters), gradients=float(gradients),
        optimizer_states=float(optimizer), fsdp_buffers=float(fsdp_buffers), saved_per_layer=float(n * saved_token),
        saved_activations=float((L - u) * n * saved_token + u * n * bare_token), block_recompute=float(block), attention_working=float(attention_phase),
        loss_working=float(loss), gradient_reduction=float(reduction), host=float(host), host_states=float(states_on_host),
    )


# --------------------------------------------------------------------------------------------- the planner


@dataclass(frozen=True, kw_only=True)
class MemoryPlan:
    """What ``memory="auto"`` chose: the options, their estimate, and every estimate the planner made, in order."""

    options: MemoryOptions
    estimate: MemoryEstimate
    device_memory: float
    tried: tuple[MemoryEstimate, ...]
    attention: str | None = None
    """The attention candidate (its cost-model label: "ring", "ulysses", ...) this plan was chosen with, where
    attention="auto" and the memory were planned together (Note [Attention and memory chosen together]); else None."""

    def describe(self) -> str:
        with_attention = "" if self.attention is None else f" with attention {self.attention!r}"
        return (f"memory='auto' for seq_len={self.estimate.seq_len}{with_attention}: {self.options.label()}; estimated "
                f"peak {self.estimate.describe()} of {self.device_memory / 1e9:.1f} GB")


class MemoryPlanError(ValueError):
    """:func:`plan_memory`'s refusal when no options fit: the message, and its numbers for callers that tabulate them."""

    def __init__(self, message: str, *, best: MemoryEstimate, longest_seq_len: int) -> None:
        super().__init__(message)
        self.best = best
        """The estimate nearest to fitting (its options and terms)."""
        self.longest_seq_len = longest_seq_len
        """The longest sequence length that fits with ``best``'s options (a multiple of lcm(1024, 2 sp)); 0 when none does."""


LADDER: tuple[tuple[str, Any], ...] = (
    ("bf16_adapters", True), ("offload_checkpoints", True), ("head_chunks", 2), ("head_chunks", 4), ("head_chunks", 8),
    ("mlp_chunk_size", MLP_TILE), ("offload_params", True), ("activation_checkpointing", "full"),
)
"""The changes ``memory="auto"`` tries, least slowdown first (Note [Planning memory])."""


def ladder(*, fixed: Mapping[str, Any], num_kv_heads: int, head_chunks_allowed: bool = True,
           adapters: bool = False) -> list[tuple[str, Any]]:
    """The steps of :data:`LADDER` that apply: none for an option in ``fixed`` (the user's), no offload without
    checkpointing, head_chunks only where it divides ``num_kv_heads`` and ``head_chunks_allowed`` (attention "ring" /
    "allgather" with head_parallel_size 1), bf16_adapters only for fp32 LoRA adapters under "bf16-true" (``adapters``)."""
    unknown = set(fixed) - {f.name for f in fields(MemoryOptions)}
    if unknown:
        raise ValueError(f"plan_memory: {sorted(unknown)} are not options the planner knows")
    steps = []
    for name, value in LADDER:
        if name in fixed:
            continue
        if name == "offload_checkpoints" and fixed.get("activation_checkpointing", "selective++") is None:
            continue
        if name == "activation_checkpointing" and fixed.get("offload_checkpoints") is False:
            continue  # recomputing attention saves its output only next to the offloaded block inputs
        if name == "head_chunks" and not (head_chunks_allowed and num_kv_heads % value == 0):
            continue
        if name == "bf16_adapters" and not adapters:
            continue
        if name == "offload_params" and fixed.get("gather_whole_model"):
            continue  # the whole model gathered on the device: one rank, its states there
        steps.append((name, value))
    return steps


OFFLOADED_STATES_RATE = 8.5e9
"""Bytes of offloaded model states (:attr:`MemoryEstimate.host_states`) a step gets through per second: the PCIe
copies of the parameters and gradients and the optimizer step on the CPU. Measured: 2 x H200 (32 CPU cores),
Llama-3-8B at 128K, 64.2 GB of states per rank cost 7.5 s a step (28.5 s against 20.9 without; 2026-11-28, a55f0e4;
Note [Attention and memory chosen together]). One machine's figure: the host's cores and PCIe set it."""


RECOMPUTED_ATTENTION = 1 / 3.5
"""What recomputing attention's forward (activation_checkpointing="full") adds to a layer's attention time: the
forward's share of the causal FLOPs, 1 of 3.5 parts (Note [Attention and memory chosen together])."""


def plan_attention_and_memory(plan: AttentionPlan, plan_for: Callable[[Candidate], MemoryPlan], *, layers: int,
                              tie_tolerance: float = 0.01) -> tuple[AttentionPlan, MemoryPlan]:
    """attention="auto" and memory="auto" as one decision (Note [Attention and memory chosen together]): ``plan_for``
    (a :func:`plan_memory` for one candidate's algorithm) for every candidate of ``plan``, scored ``layers`` x its
    attention time x (1 + :data:`RECOMPUTED_ATTENTION` where its memory plan recomputes attention) + its offloaded
    model states over :data:`OFFLOADED_STATES_RATE`; of those within ``tie_tolerance`` of the best score, the one with
    the least attention memory (the cost model's own rule). Returns the plan with that candidate picked and its memory
    plan (``MemoryPlan.attention`` names it). Raises the first candidate's ``MemoryPlanError``
    when no candidate's memory fits."""
    scored: list[tuple[float, Candidate, MemoryPlan]] = []
    refusal: MemoryPlanError | None = None
    for candidate in plan.candidates:
        try:
            memory = plan_for(candidate)
        except MemoryPlanError as error:
            refusal = refusal or error
            continue
        recompute = RECOMPUTED_ATTENTION if memory.options.activation_checkpointing == "full" else 0.0
        # offloaded model states cost their copies and the CPU's optimizer step (Note [Attention and memory chosen together])
        offload = memory.estimate.host_states / OFFLOADED_STATES_RATE
        scored.append((layers * candidate.est_time_s * (1 + recompute) + offload, candidate, memory))
    if not scored:
        assert refusal is not None
        raise refusal
    fastest = min(s[0] for s in scored)
    # within the tie tolerance of the fastest, the least attention memory: the cost model's own rule (choose_attention)
    near = [s for s in scored if s[0] <= fastest * (1 + tie_tolerance)]
    _, candidate, memory = min(near, key=lambda s: (s[1].peak_memory_bytes, s[0]))
    return plan.picking(candidate.label), replace(memory, attention=candidate.label)


def largest_fitting_seq_len(budget: float, *, granule: int, upper: int, host_budget: float = float("inf"), **kwargs: Any) -> int:
    """The largest multiple of ``granule`` up to ``upper`` whose ``estimate_memory(**kwargs)`` fits in ``budget``
    device bytes and ``host_budget`` host bytes; 0 when none does (binary search: the estimate grows with seq_len)."""
    lo, hi = 0, max(upper // granule, 1)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        e = estimate_memory(seq_len=mid * granule, **kwargs)
        if e.total <= budget and e.host <= host_budget:
            lo = mid
        else:
            hi = mid - 1
    return lo * granule


def _partial_offload(sets: list[MemoryOptions], estimate: Callable[[MemoryOptions], MemoryEstimate], layers: int,
                     budget: float, host_budget: float) -> MemoryEstimate | None:
    """Where the host, not the device, binds: the first set (ladder order) that fits with only the first k blocks'
    inputs offloaded, k the most the host holds (Note [Planning memory]); None when none does."""
    for options in sets:
        if options.offload_checkpoints is not True or options.activation_checkpointing is None:
            continue
        for k in range(layers - 1, 0, -1):  # the host's share shrinks with k, the device's grows
            trial = estimate(replace(options, offload_checkpoints=k))
            if trial.host <= host_budget:
                if trial.total <= budget:
                    return trial
                break
    return None


def _gather_whole_model(chosen: MemoryEstimate, estimate: Callable[[MemoryOptions], MemoryEstimate],
                        fits: Callable[[MemoryEstimate], bool], fixed: Mapping[str, Any], shards: int) -> MemoryEstimate:
    """The first of the speed levers: on one rank (``shards`` = dp_shard x sp = 1) without offload_params, the whole model
    gathered once per step where its estimate still fits and nothing is offloaded (Note [Planning memory])."""
    o = chosen.options
    if "gather_whole_model" in fixed or shards != 1 or o.offload_params or o.offload_checkpoints or o.gather_whole_model:
        return chosen
    trial = estimate(replace(o, gather_whole_model=True))
    return trial if fits(trial) else chosen


def _uncheckpoint(chosen: MemoryEstimate, estimate: Callable[[MemoryOptions], MemoryEstimate],
                  fits: Callable[[MemoryEstimate], bool], fixed: Mapping[str, Any], layers: int) -> MemoryEstimate:
    """Spend what the chosen set leaves of the budget on speed: the most blocks left without checkpointing (no
    recompute in their backward) that still fit, where checkpointing is on, nothing is offloaded and the user did
    not set ``uncheckpointed_blocks`` (Note [Planning memory]). Binary search: the estimate grows with the count."""
    o = chosen.options
    if "uncheckpointed_blocks" in fixed or o.activation_checkpointing is None or o.offload_checkpoints or o.offload_params:
        return chosen
    lo, hi, best = 0, layers - 1, chosen
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = estimate(replace(o, uncheckpointed_blocks=mid))
        if fits(trial):
            lo, best = mid, trial
        else:
            hi = mid - 1
    return best


def plan_memory(
    *,
    model_shape: TransformerShape,
    seq_len: int,
    device_memory: float,
    sp: int = 1,
    dp_shard: int = 1,
    precision: str = "bf16-true",
    fixed: Mapping[str, Any] | None = None,
    batch_size: int = 1,
    loss_chunk_size: int | None = None,
    trainable_params: int | None = None,
    lora_targets: Collection[str] = (),
    attention: str = "ring",
    head_parallel_size: int = 1,
    margin: float = DEFAULT_MARGIN,
    host_memory: float | None = None,
    owner: str = "plan_memory",
    length_name: str = "expected_seq_len",
) -> MemoryPlan:
    """The options with the least slowdown whose estimate fits ``(1 - margin) x device_memory`` (Note [Planning memory]).

    ``fixed``: options the user set (``MemoryOptions`` field names), which every candidate keeps. Raises
    ``MemoryPlanError`` (a ``ValueError``) naming the length (as ``length_name``: the strategy's ``expected_seq_len``, a datamodule's
    ``seq_len``, ...), the device memory, the best estimate and the largest sequence length that would fit with
    the most memory-saving options, when none fits."""
    if not 0 <= margin < 1:
        raise ValueError(f"{owner}: margin must be in [0, 1), got {margin!r}")
    if not device_memory > 0:
        raise ValueError(f"{owner}: device_memory must be positive, got {device_memory!r}")
    if host_memory is not None and not host_memory > 0:
        raise ValueError(f"{owner}: host_memory must be positive or None, got {host_memory!r}")
    fixed = dict(fixed or {})
    budget = (1 - margin) * device_memory
    host_budget = float("inf") if host_memory is None else (1 - margin) * host_memory

    def fits(e: MemoryEstimate) -> bool:
        return e.total <= budget and e.host <= host_budget

    common = dict(model_shape=model_shape, sp=sp, dp_shard=dp_shard, precision=precision, batch_size=batch_size,
                  loss_chunk_size=loss_chunk_size, trainable_params=trainable_params, lora_targets=tuple(lora_targets),
                  attention=attention,
                  head_parallel_size=head_parallel_size)
    allowed = attention in ("ring", "allgather", "auto") and head_parallel_size == 1
    tried: list[MemoryEstimate] = []

    def estimate(options: MemoryOptions) -> MemoryEstimate:
        tried.append(estimate_memory(seq_len=seq_len, options=options, **common))
        return tried[-1]

    # the option sets in ladder order, each step added to the previous ones (head_chunks replaced)
    steps = ladder(fixed=fixed, num_kv_heads=model_shape.num_kv_heads, head_chunks_allowed=allowed,  # checks `fixed`
                   adapters=trainable_params is not None and precision == "bf16-true")
    if "activation_checkpointing" not in fixed and not fixed.get("offload_checkpoints"):
        # no checkpointing at all, the fastest, where it fits (Note [Planning memory]: short sequences, large GPUs)
        bare = estimate(MemoryOptions(**{**fixed, "activation_checkpointing": None}))
        if fits(bare):
            bare = _gather_whole_model(bare, estimate, fits, fixed, sp * dp_shard)
            return MemoryPlan(options=bare.options, estimate=bare, device_memory=device_memory, tried=tuple(tried))
    sets = [MemoryOptions(**fixed)]
    for name, value in steps:
        previous = sets[-1]
        if name == "activation_checkpointing" and previous.offload_params and "offload_params" not in fixed:
            # recomputing attention without the model states on the host: where the host, not the device, binds
            sets.append(replace(previous, offload_params=False, activation_checkpointing=value))
        sets.append(replace(previous, **{name: value}))
    chosen = next((e for e in map(estimate, sets) if fits(e)), None)
    if chosen is None and "offload_checkpoints" not in fixed:
        chosen = _partial_offload(sets, estimate, model_shape.num_layers, budget, host_budget)
    if chosen is not None:
        # drop what the fitting set does not need, the costliest first; head_chunks to the fewest that fit
        defaults = MemoryOptions()
        for name in ("activation_checkpointing", "offload_params", "mlp_chunk_size", "head_chunks", "offload_checkpoints",
                     "bf16_adapters"):  # bf16_adapters costs no time: kept where anything else would have to
            if name in fixed or getattr(chosen.options, name) == getattr(defaults, name):
                continue
            lighter = [getattr(defaults, name)]
            if name == "head_chunks":
                lighter += [c for c in (2, 4) if c < chosen.options.head_chunks and model_shape.num_kv_heads % c == 0]
            for value in lighter:
                trial = estimate(replace(chosen.options, **{name: value}))
                if fits(trial):
                    chosen = trial
                    break
        chosen = _gather_whole_model(chosen, estimate, fits, fixed, sp * dp_shard)  # speed: first one gather per step,
        chosen = _uncheckpoint(chosen, estimate, fits, fixed, model_shape.num_layers)  # then blocks without recompute
        return MemoryPlan(options=chosen.options, estimate=chosen, device_memory=device_memory, tried=tuple(tried))
    best = min(tried, key=lambda t: max(t.total / budget, t.host / host_budget))  # the nearest to fitting
    granule = math.lcm(1024, 2 * sp)
    longest = largest_fitting_seq_len(budget, granule=granule, upper=seq_len, host_budget=host_budget, options=best.options,
                                      **common)
    where = (f"the largest that would fit with them is seq_len={longest}" if longest
             else "no sequence length fits: the model states alone exceed it")
    host = ""
    if best.total <= budget:  # the device would hold it: the host does not (offloaded block inputs, model states)
        host = (f"; it fits the device but puts {best.host / 1e9:.1f} GB on the host, which has {host_memory / 1e9:.1f} GB "
                f"available for this rank ({1 - margin:.0%} of it planned)")
    raise MemoryPlanError(
        f"{owner}: memory='auto' found no options that fit {length_name}={seq_len} in {device_memory / 1e9:.1f} GB of "
        f"device memory ({1 - margin:.0%} of it planned): with {best.options.label()} the estimate is {best.describe()}, "
        f"its largest term {best.largest_term()}{host}; {where}. Use more sequence-parallel ranks or "
        + (f"a shorter {length_name}" if not length_name.startswith("the ") else "shorter sequences")
        + ("" if loss_chunk_size is not None else ", or CausalLMModule(loss_chunk_size=...) (the full logits are counted)"),
        best=best, longest_seq_len=longest,
    )

"""The Megatron-LM baseline of the papers: tensor parallel + sequence parallel (TP+SP) through
Lightning's own ``ModelParallelStrategy``, on the package's unchanged ``Llama``.

    torchrun --nproc_per_node=4 benchmarks/train.py --system tp_sp --model llama3-8b --seq 131072

Note [The TP+SP baseline]
~~~~~~~~~~~~~~~~~~~~~~~~~
Korthikanti et al. 2023 ("Reducing Activation Recomputation in Large Transformer Models", §4.2.2),
written with torch's DTensor tensor-parallel styles as torchtitan's Llama plan does
(``torchtitan/models/llama3/infra/parallelize.py``, ``apply_tp``):

    residual stream  (B, S/W, d)   sequence-sharded ("SP" regions: norms, residual adds)
         | all-gather S        (PrepareModuleInput: Shard(1) -> Replicate)
    q/k/v, gate/up   (B, S, ./W)   ColwiseParallel: each rank holds H/W heads / I/W columns
    attention        (B, S, H/W, D) plain local causal SDPA (cuDNN) over this rank's heads
         | reduce-scatter S    (RowwiseParallel(output_layouts=Shard(1)) of o_proj / down_proj)
    residual stream  (B, S/W, d)

* embed_tokens: RowwiseParallel (vocabulary-sharded table, output reduce-scattered to Shard(1)).
* lm_head: ColwiseParallel from Shard(1); with loss parallel (default) the logits stay sharded on
  the vocabulary (B, S, V/W) and ``torch.distributed.tensor.parallel.loss_parallel`` computes the
  cross entropy without gathering them (Megatron's vocab-parallel cross entropy); the logits are
  cast to fp32 first, as Megatron and the torch_cp baseline do.
* Every rank holds the FULL sequence for attention: TP does not split the sequence there, so the
  attention activations and the logits grow with S, not S/W.
* Full activation checkpointing of every block (``checkpoint_wrapper``), as Megatron runs long
  sequences; bf16 compute with fp32 master weights through FSDP2's ``MixedPrecisionPolicy`` on the
  size-1 data-parallel axis of Lightning's mesh (Lightning's TP + FSDP2 recipe; one rank means no
  sharding, only the bf16 cast), the same precision scheme as the other two systems.
  Order: TP -> AC -> FSDP2, as torchtitan.

Note [Heads that do not divide W]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-LM needs n_head % W == 0 and n_kv_head % W == 0. LightSeq (§4, "Implementation"; §4.2
"In support of arbitrary numbers of heads") added head padding to Megatron for Llama-33H, and so
do we, before sharding:

* MHA (n_kv_head == n_head), n_head % W != 0: pad q, k and v to ceil(H/W) * W heads with zero
  rows of q_proj / k_proj / v_proj and zero columns of o_proj. A dummy head has v = 0, so its
  output is 0 and every gradient of the dummy rows / columns is exactly 0: the padded model IS
  the H-head model at every step (AdamW keeps zero parameters with zero gradients at zero). The
  dummy heads still cost attention and projection FLOPs: the record's ``padding_flops_waste`` is
  that share of the model FLOPs (Llama-33H on 4 GPUs: 36 heads, +6.7% at 128K), and MFU counts
  only the real model's FLOPs.
* GQA, n_kv_head % W != 0 (and n_head % W == 0): repeat every K/V head r times (r = W /
  gcd(H_kv, W)), as Megatron does when TP exceeds the query groups; equal at init, the copies then
  get their own gradients (as in Megatron).
* Anything else (GQA with n_head % W != 0) raises ValueError: not runnable as Megatron TP.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_seqpar.models import Llama, LlamaConfig

__all__ = ["HeadLayout", "SDPAttention", "TPSPModule", "head_layout", "pad_heads", "parallelize_tp_sp"]


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """Head counts of the TP model (Note [Heads that do not divide W])."""

    n_head: int
    """Query heads after padding (a multiple of W)."""
    n_kv_head: int
    """K/V heads after padding or repetition (a multiple of W)."""
    kv_repeat: int
    """How many times each K/V head is repeated (GQA); 1 otherwise."""
    padded: int
    """Dummy (zero) heads added (MHA)."""

    def config(self, config: LlamaConfig) -> LlamaConfig:
        """``config`` with these head counts (what actually runs, for the padding FLOPs)."""
        return dataclasses.replace(config, n_head=self.n_head, n_kv_head=self.n_kv_head, head_dim=config.head_dim)


def head_layout(config: LlamaConfig, tp: int) -> HeadLayout:
    """The head counts TP over ``tp`` ranks runs ``config`` with; ValueError when Megatron TP cannot."""
    H, H_kv = config.n_head, config.n_kv_head
    assert H_kv is not None
    if H == H_kv:
        padded_h = math.ceil(H / tp) * tp
        return HeadLayout(n_head=padded_h, n_kv_head=padded_h, kv_repeat=1, padded=padded_h - H)
    if H % tp:
        raise ValueError(
            f"tp_sp: n_head={H} (GQA with n_kv_head={H_kv}) is not divisible by the tensor-parallel size {tp}; "
            "Megatron-style TP cannot run it (padding is only defined for MHA here)"
        )
    r = tp // math.gcd(H_kv, tp)
    if H % (H_kv * r):
        raise ValueError(f"tp_sp: cannot repeat n_kv_head={H_kv} to a multiple of {tp} that divides n_head={H}")
    return HeadLayout(n_head=H, n_kv_head=H_kv * r, kv_repeat=r, padded=0)


@torch.no_grad()
def pad_heads(model: Llama, layout: HeadLayout) -> None:
    """Give every attention block ``layout``'s head counts (zero heads / repeated K/V), in place."""
    cfg = model.config
    D, H, H_kv = cfg.head_dim, cfg.n_head, cfg.n_kv_head
    if layout.padded == 0 and layout.kv_repeat == 1:
        return

    def linear(weight: torch.Tensor) -> nn.Linear:
        out = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        out.weight.copy_(weight)
        return out

    for block in model.layers:
        attn = block.self_attn
        pad = layout.padded * D
        q = attn.q_proj.weight  # (H * D, d)
        attn.q_proj = linear(torch.cat([q, q.new_zeros(pad, q.shape[1])]))  # (H' * D, d)
        for name in ("k_proj", "v_proj"):
            w = getattr(attn, name).weight  # (H_kv * D, d)
            w = w.view(H_kv, D, -1).repeat_interleave(layout.kv_repeat, dim=0).flatten(0, 1)  # (H_kv * r * D, d)
            setattr(attn, name, linear(torch.cat([w, w.new_zeros(pad, w.shape[1])])))
        o = attn.o_proj.weight  # (d, H * D)
        attn.o_proj = linear(torch.cat([o, o.new_zeros(o.shape[0], pad)], dim=1))  # (d, H' * D)
        attn.n_head, attn.n_kv_head = layout.n_head, layout.n_kv_head
    assert H == layout.n_head - layout.padded


class SDPAttention(nn.Module):
    """Plain local causal attention over this rank's heads: ``F.scaled_dot_product_attention``.

    q (B, S, H_local, D), k/v (B, S, H_kv_local, D) -> (B, S, H_local, D). GQA runs natively
    (``enable_gqa``), without repeating K/V. ``backends``: the SDPA kernels allowed (cuDNN on GPU).
    """

    def __init__(self, backends: list[Any] | None = None) -> None:
        super().__init__()
        self.backends = backends

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(self.backends) if self.backends else nullcontext():
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=q.shape[2] != k.shape[2]
            )  # (B, H_local, S, D)
        return out.transpose(1, 2)  # (B, S, H_local, D)


def parallelize_tp_sp(
    model: Llama,
    device_mesh: Any,
    *,
    loss_parallel: bool = True,
    activation_checkpointing: bool = True,
    param_dtype: torch.dtype | None = None,
    attention_backends: list[Any] | None = None,
) -> HeadLayout:
    """Apply Note [The TP+SP baseline] to ``model`` in place over Lightning's 2-D mesh
    ("data_parallel", "tensor_parallel"); returns the head layout it ran with."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp_mesh, dp_mesh = device_mesh["tensor_parallel"], device_mesh["data_parallel"]
    tp = tp_mesh.size()
    layout = head_layout(model.config, tp)
    pad_heads(model, layout)

    parallelize_module(model, tp_mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    })
    for i, block in enumerate(model.layers):
        block.self_attn.attn_core = SDPAttention(attention_backends)
        parallelize_module(block, tp_mesh, {
            "input_layernorm": SequenceParallel(),
            # (x, freqs_cis): gather the sequence of x; the RoPE rotations are a plain full-S tensor
            "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
        # this rank's heads: LlamaAttention views its projections as (B, S, n_head, D)
        block.self_attn.n_head = layout.n_head // tp
        block.self_attn.n_kv_head = layout.n_kv_head // tp
        if activation_checkpointing:
            model.layers[i] = checkpoint_wrapper(block)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype is not None else None)
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return layout


class TPSPModule(L.LightningModule):
    """Next-token training of ``Llama(config)`` with Megatron-style TP+SP under ``ModelParallelStrategy``.

    Args:
        config: the model (the name of a ``LlamaConfig`` or one).
        lr: AdamW learning rate (constant; no weight decay), as the torch_cp baseline.
        loss_parallel: vocabulary-parallel cross entropy on sharded logits; False gathers the logits.
        activation_checkpointing: full checkpointing of every block.
        bf16: bf16 compute with fp32 master weights (FSDP2 MixedPrecisionPolicy); False: fp32.
        attention_backends: SDPA backends for the local attention (e.g. [SDPBackend.CUDNN_ATTENTION]).
        init_seed: seed of the weight initialisation (every rank builds the same full model first).
    """

    def __init__(
        self,
        config: LlamaConfig | str,
        *,
        lr: float = 3e-4,
        loss_parallel: bool = True,
        activation_checkpointing: bool = True,
        bf16: bool = True,
        attention_backends: list[Any] | None = None,
        init_seed: int = 0,
    ) -> None:
        super().__init__()
        self.config = LlamaConfig.from_name(config) if isinstance(config, str) else config
        self.lr, self.loss_parallel, self.activation_checkpointing = lr, loss_parallel, activation_checkpointing
        self.bf16, self.attention_backends, self.init_seed = bf16, attention_backends, init_seed
        self.model: Llama | None = None
        self.layout: HeadLayout | None = None

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        device = self.trainer.strategy.root_device
        # The full model on every rank from one seed (as the seqpar path builds it), then sharded.
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            torch.manual_seed(self.init_seed)
            model = Llama(self.config)
        self.layout = parallelize_tp_sp(
            model, self.device_mesh, loss_parallel=self.loss_parallel, activation_checkpointing=self.activation_checkpointing,
            param_dtype=torch.bfloat16 if self.bf16 else None, attention_backends=self.attention_backends,
        )
        self.model = model

    def _loss_context(self) -> Any:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.loss_parallel else nullcontext()

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None
        logits = self.model(batch["input_ids"], batch["position_ids"])  # (B, S, V), a DTensor sharded on V under loss parallel
        with self._loss_context():
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        reported = loss.detach()
        if hasattr(reported, "full_tensor"):  # a replicated DTensor under loss parallel
            reported = reported.full_tensor()
        self.log("train/loss", reported)
        return loss

    @override
    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        with self._loss_context():  # the backward of the vocabulary-parallel cross entropy needs the context too
            loss.backward(*args, **kwargs)

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.model is not None
        return torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0)

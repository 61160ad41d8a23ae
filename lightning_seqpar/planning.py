"""What ``attention="auto"`` picks on 8 to 1,024 GPUs, and a whole training step around it (``seqpar plan``).

Note [Planning a step across nodes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
One sequence of S tokens per step over all W GPUs (sp = W, LoongTrain's d_sp = 64 setting),
FSDP2 over the same W ranks, bf16-mixed, selective++ checkpointing. Per GPU and step:

* attention: L x the cost model's plan (``choose_attention``: algorithm, hp x cp, inner ring,
  placement; Note [Two link levels]), forward + backward; selective++ keeps its output, so it
  is not recomputed.
* linear layers: (6 + 2) x N_matmul x S / W FLOPs (forward, backward, and the recompute of
  selective++) at ``linear_flops``.
* FSDP2: all-gather of the bf16 parameters in forward and again in backward, reduce-scatter of
  fp32 gradients: (2 + 2 + 4) x N x (W-1)/W bytes per GPU, a ring at the NIC rate once W
  spans nodes; prefetched, so only what exceeds the compute is exposed.
* memory: 16 N / W bytes of model states (fp32 parameter, gradient, two Adam moments), the
  checkpointed block inputs and attention outputs (L x 2 x S/W x d x 2 bytes), one block's
  working memory (the attention estimate's peak; the MLP's 3 x ffn activations) and the fp32
  logits of S/W tokens.

MFU counts model FLOPs as ``Llama.flops_per_token`` does (Note [FLOPs per token], causal
attention halved, no recompute) against 989 TFLOP/s dense bf16. This is a planning estimate:
only the attention part is validated against measurements (benchmarks/cost_model_check.py, one
node); the linear rate, the FSDP overlap and the inter-node constants are assumptions.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_seqpar.attention.cost import AttentionPlan, DeviceProfile, choose_attention

PEAK_BF16 = 989e12


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a Llama-style decoder that the plan needs."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    head_dim: int
    ffn: int
    vocab: int

    @property
    def matmul_params(self) -> int:
        """Weights used in matmuls per token (attention, MLP, output head)."""
        attn = self.d_model * self.head_dim * (2 * self.n_head + 2 * self.n_kv_head)
        return self.n_layer * (attn + 3 * self.d_model * self.ffn) + self.vocab * self.d_model

    @property
    def params(self) -> int:
        return self.matmul_params + self.vocab * self.d_model  # + the input embedding

    def flops_per_token(self, seq_len: int) -> float:
        return 6 * self.matmul_params + 6 * self.n_layer * seq_len * self.n_head * self.head_dim


MODELS: dict[str, ModelShape] = {
    "llama3-8b": ModelShape(name="llama3-8b", n_layer=32, d_model=4096, n_head=32, n_kv_head=8, head_dim=128, ffn=14336, vocab=128256),
    "llama-70b": ModelShape(name="llama-70b", n_layer=80, d_model=8192, n_head=64, n_kv_head=8, head_dim=128, ffn=28672, vocab=128256),
    "llama-33h": ModelShape(name="llama-33h", n_layer=32, d_model=4224, n_head=33, n_kv_head=33, head_dim=128, ffn=11008, vocab=32000),
    "llama-7b": ModelShape(name="llama-7b", n_layer=32, d_model=4096, n_head=32, n_kv_head=32, head_dim=128, ffn=11008, vocab=32000),
}
"""Llama-70B-shaped: 80 layers, d 8192, 64 query / 8 K/V heads, FFN 28672 (Llama 3 70B's sizes)."""


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    model: str
    seq_len: int
    gpus: int
    plan: AttentionPlan
    step_s: float
    attention_s: float
    attention_comm_s: float
    linear_s: float
    fsdp_exposed_s: float
    memory_gb: float
    mfu: float

    attention_overhead_s: float
    fits: bool

    @property
    def dominant(self) -> str:
        """The largest term besides the matmul and attention kernels, with its share of the step:
        what grows as nodes are added (exposed attention communication, the attention's per-step
        elementwise work and launches, or exposed FSDP traffic)."""
        terms = {"attn comm": self.attention_comm_s, "attn per-step": self.attention_overhead_s, "FSDP": self.fsdp_exposed_s}
        name = max(terms, key=terms.__getitem__)
        return f"{name} {terms[name] / self.step_s:.0%}"


def plan_step(model: ModelShape, *, seq_len: int, gpus: int, profile: DeviceProfile | None = None,
              linear_flops: float = 650e12, algorithms: Sequence[str] | None = None, double_ring: bool = True) -> StepPlan:
    """One step of ``model`` on ``gpus`` GPUs (Note [Planning a step across nodes])."""
    profile = profile or DeviceProfile.h200()
    plan = choose_attention(seq_len=seq_len, num_heads=model.n_head, num_kv_heads=model.n_kv_head, head_dim=model.head_dim,
                            world_size=gpus, profile=profile, algorithms=algorithms, double_ring=double_ring,
                            head_parallel_size=None)
    pick = plan.candidates[0]
    attention = model.n_layer * pick.est_time_s
    attention_comm = model.n_layer * pick.communication_s
    tokens = seq_len / gpus
    linear = 8 * model.matmul_params * tokens / linear_flops
    fsdp_bytes = 8 * model.params * (gpus - 1) / gpus
    fsdp_rate = profile.inter_node_bandwidth if gpus > profile.gpus_per_node else profile.intra_node_collective_bandwidth
    fsdp_exposed = max(0.0, fsdp_bytes / fsdp_rate - (attention + linear))
    step = attention + linear + fsdp_exposed
    activations = model.n_layer * 2 * tokens * model.d_model * 2 + 3 * tokens * model.ffn * 2 + tokens * model.vocab * 4
    memory = 16 * model.params / gpus + activations + pick.peak_memory_bytes
    mfu = model.flops_per_token(seq_len) * tokens / step / PEAK_BF16
    return StepPlan(model=model.name, seq_len=seq_len, gpus=gpus, plan=plan, step_s=step, attention_s=attention,
                    attention_comm_s=attention_comm, linear_s=linear, fsdp_exposed_s=fsdp_exposed, memory_gb=memory / 1e9, mfu=mfu,
                    attention_overhead_s=model.n_layer * pick.elementwise_s, fits=memory <= profile.memory_bytes)


def megatron_cp(model: ModelShape, **kwargs) -> StepPlan:
    """Megatron-style context parallelism: one zigzag ring over every GPU (no head parallelism, no inner rings)."""
    return plan_step(model, algorithms=("ring",), double_ring=False, **kwargs)


def table(models: Sequence[str], seq_lens: Sequence[int], gpus: Sequence[int], *, gpus_per_node: int = 8) -> list[str]:
    """Markdown rows: auto's pick and its step next to Megatron-style CP, for every feasible combination."""
    profile = DeviceProfile.h200(gpus_per_node=gpus_per_node)
    rows = ["| model | S | GPUs | auto picks | step s | MFU | GB/GPU | largest overhead | Megatron-CP step s | MFU |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name in models:
        model = MODELS[name]
        for s in seq_lens:
            for w in gpus:
                if s < w:
                    continue
                try:
                    auto = plan_step(model, seq_len=s, gpus=w, profile=profile)
                except ValueError:
                    rows.append(f"| {name} | {_k(s)} | {w} | does not fit |  |  |  |  |  |  |")
                    continue
                try:
                    ring = megatron_cp(model, seq_len=s, gpus=w, profile=profile)
                    ring_cells = f"{ring.step_s:.2f} | {ring.mfu:.2f}"
                except ValueError:
                    ring_cells = "does not fit | "
                rows.append(f"| {name} | {_k(s)} | {w} | {auto.plan.label} | {auto.step_s:.2f} | {auto.mfu:.2f} | "
                            f"{auto.memory_gb:.0f}{'' if auto.fits else ' (> HBM)'} | {auto.dominant} | {ring_cells} |")
    return rows


def _k(s: int) -> str:
    return f"{s // 1048576}M" if s % 1048576 == 0 else f"{s // 1024}K"


def _ints(text: str) -> list[int]:
    """``"128K,1M,8"`` -> [131072, 1048576, 8]; a ValueError for anything else."""
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = 1048576 if part.endswith("M") else 1024 if part.endswith("K") else 1
        digits = part[:-1] if scale > 1 else part
        if not digits.isdigit() or int(digits) < 1:
            raise ValueError(f"expected positive integers with an optional K or M suffix, comma-separated (e.g. 128K,1M), got {text!r}")
        out.append(int(digits) * scale)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="seqpar plan", description="What attention='auto' picks across nodes, and the step around it "
                                 "(Note [Planning a step across nodes] in lightning_seqpar.planning).")
    ap.add_argument("--model", default="llama3-8b,llama-70b,llama-33h", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--seq", default="128K,512K,1M,4M", help="sequence lengths, e.g. 128K,1M")
    ap.add_argument("--gpus", default="8,64,256,1024", help="GPU counts")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    args = ap.parse_args(argv)
    unknown = [m for m in args.model.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"--model: unknown {unknown}; expected some of {sorted(MODELS)}")
    parsed = {}
    for flag, text in (("--seq", args.seq), ("--gpus", args.gpus)):
        try:
            parsed[flag] = _ints(text)
        except ValueError as error:
            ap.error(f"{flag}: {error}")
    if args.gpus_per_node < 1:
        ap.error(f"--gpus-per-node: expected a positive integer, got {args.gpus_per_node}")
    print("\n".join(table(args.model.split(","), parsed["--seq"], parsed["--gpus"], gpus_per_node=args.gpus_per_node)))


__all__ = ["MODELS", "ModelShape", "StepPlan", "megatron_cp", "plan_step", "table"]

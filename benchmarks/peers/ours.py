"""Ours, as a user gets it: ``lightning.Trainer(strategy=SequenceParallelStrategy(sequence_parallel_size=GPUs,
memory="auto"))`` with ``CausalLMModule`` -- the package's Llama (``model="llama3-8b"``, against torchtitan) or the
Qwen3-8B-shaped transformers model from its config (``model={"model_type": "qwen3", ...}``, against TRL / ALST).

    torchrun --nproc_per_node 4 benchmarks/peers/ours.py --model llama3-8b --seq 131072 --out $OUT/peers.json
    torchrun --nproc_per_node 4 benchmarks/peers/ours.py --model qwen3-8b --seq 131072 --out $OUT/peers.json

Every strategy option is its default (attention="auto", attention_backend="auto", memory="auto" for the
datamodule's seq_len) unless --option NAME=VALUE says otherwise (recorded). Precision: "bf16-mixed" on CUDA for
every model (fp32 master weights, bf16 compute: what the peers' optimizers update too -- torchtitan's FSDP2 mixed
precision, accelerate's FSDP2 mixed precision and DeepSpeed's bf16 mode keep fp32 parameters; the harness's probe
reads each system's from its optimizer into the record's ``master_weights``), changeable with --precision (the
Qwen3 rows before issue #56 ran "bf16-true": bf16 weights and Adam states). Data:
the copy task with every token labelled (``LongRangeDataModule(supervise="all")``); ``--documents N`` cuts each
row into N equal packed documents (``document_ids``, no label across a boundary: :func:`packed_copy_task`). Note [One measurement for every peer].
"""

from __future__ import annotations

import argparse
import ast
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import SHAPES, StepClock, qwen3_config, write_record  # noqa: E402


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _host_alloc_seconds() -> float | None:
    """Seconds this rank spent growing the pinned host pool (``torch.cuda.host_memory_stats``, where torch has it):
    the offloaded checkpoints' host copies are allocated in the first step and cached after it."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if not torch.cuda.is_available() or stats is None:
        return None
    total_us = stats().get("host_alloc_time.total")
    return None if total_us is None else total_us / 1e6


def document_ids(seq: int, documents: int) -> torch.Tensor:
    """``documents`` equal documents over ``seq`` tokens (the last takes the remainder): each token's document index."""
    return (torch.arange(seq) // (seq // documents)).clamp(max=documents - 1)


def packed_copy_task(base, documents: int):
    """``base`` (LongRangeDataModule) whose rows are cut into ``documents`` packed documents: ``document_ids`` per row,
    no label across a document boundary (the strategy restarts positions per document and splits each document with
    the per-document zigzag)."""
    if documents < 1:
        raise ValueError(f"--documents must be >= 1, got {documents}")

    class Packed(torch.utils.data.Dataset):
        def __init__(self, rows) -> None:
            self.rows = rows

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, index: int) -> dict:
            row = dict(self.rows[index])
            ids = document_ids(row["input_ids"].shape[0], documents)
            labels = row["labels"].clone()
            labels[:-1][ids[1:] != ids[:-1]] = -100  # a document's last token does not predict the next one's first
            return dict(row, labels=labels, document_ids=ids)

    class PackedDataModule(base):
        def _dataset(self, num_samples: int, stream: int):
            return Packed(super()._dataset(num_samples, stream))

    return PackedDataModule


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def litgpt_module(model: str, *, seq: int, tiny: bool, plain: bool):
    """LitGPT's config for ``model`` (litgpt-llama3-8b, litgpt-llama3.2-1b) with block_size = seq: LitGPTModule, or with
    ``plain`` a LightningModule as a LitGPT user writes it (``gpt(input_ids)``, LitGPT's chunked cross entropy)."""
    import lightning as L

    from lightning_seqpar.training.litgpt import LitGPTModule

    name = {"litgpt-llama3-8b": "Llama-3-8B", "litgpt-llama3.2-1b": "Llama-3.2-1B"}[model]
    overrides = {"block_size": seq} | ({"n_layer": 2, "n_embd": 64, "n_head": 4, "n_query_groups": 2, "head_size": 16,
                                        "intermediate_size": 128, "vocab_size": 64, "padded_vocab_size": 64} if tiny else {})
    if not plain:
        return LitGPTModule(name, config_overrides=overrides, lr=3e-4, warmup_steps=2, weight_decay=0.0)

    class PlainLitGPT(LitGPTModule):
        def training_step(self, batch, batch_idx):
            from litgpt.utils import chunked_cross_entropy

            return chunked_cross_entropy(self.gpt(batch["input_ids"]), batch["labels"])

    return PlainLitGPT(name, config_overrides=overrides, lr=3e-4, warmup_steps=2, weight_decay=0.0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(SHAPES), required=True)
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--steps", type=int, default=5, help="optimizer steps, warm-up included")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--precision", default=None)
    p.add_argument("--option", action="append", default=[], help="a strategy option NAME=VALUE (Python literal)")
    p.add_argument("--loss-chunk", type=int, default=None, help="CausalLMModule(loss_chunk_size=...); 0: the full logits; "
                   "default: the module's default ('auto': 8192 where the chunked loss serves the model)")
    p.add_argument("--documents", type=int, default=0, help="pack this many equal documents per row (document_ids)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on CPU (smoke run)")
    p.add_argument("--plain", action="store_true", help="litgpt-* models: plain LitGPT on one device (its SDPA, LitGPT's "
                   "chunked cross entropy, no strategy) instead of LitGPTModule under the strategy")
    p.add_argument("--out", default="peers.json")
    args = p.parse_args()

    import lightning as L

    import lightning_seqpar
    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
    from lightning_seqpar.data import LongRangeDataModule

    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    options = dict(o.split("=", 1) for o in args.option)
    options = {k: _value(v) for k, v in options.items()}
    strategy_kwargs = dict(sequence_parallel_size=world, memory="auto") | options
    litgpt = args.model.startswith("litgpt-")
    if args.model == "llama3-8b":
        model = "tiny" if args.tiny else "llama3-8b"
        precision = args.precision or ("bf16-mixed" if cuda else "32-true")
    elif litgpt:  # LitGPT's GPT, unchanged (Note [LitGPT under the strategy])
        precision = args.precision or ("bf16-mixed" if cuda else "32-true")
    else:
        cfg = qwen3_config(args.seq).to_dict()
        if args.tiny:
            cfg.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, vocab_size=512, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16)
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "rope_parameters")
        model = {"model_type": "qwen3", **{k: cfg[k] for k in keep}}
        precision = args.precision or ("bf16-mixed" if cuda else "32-true")
    if litgpt:
        module = litgpt_module(args.model, seq=args.seq, tiny=args.tiny, plain=args.plain)
    else:
        module = CausalLMModule(model=model, lr=3e-4, warmup_steps=2, weight_decay=0.0, loss_chunk_size="auto" if args.loss_chunk is None else args.loss_chunk or None)
    data = (packed_copy_task(LongRangeDataModule, args.documents) if args.documents else LongRangeDataModule)(
        vocab_size=64 if args.tiny else 32000, seq_len=args.seq, batch_size=1, num_samples=args.steps * 2, val_samples=0, seed=0,
        supervise="all")
    clock, losses = StepClock(args.warmup), []

    class Clock(L.Callback):
        def on_train_batch_start(self, *a, **k):
            clock.begin()

        def on_train_batch_end(self, trainer, pl_module, outputs, *a, **k):
            clock.end()
            losses.append(float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs))

    strategy = "auto" if args.plain else SequenceParallelStrategy(**strategy_kwargs)
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        strategy=strategy, precision=precision, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Clock()])
    trainer.fit(module, datamodule=data)
    if args.plain:  # plain LitGPT: no strategy, its SDPA
        write_record(args.out, system="litgpt", model=args.model, seq=args.seq, clock=clock, peak_gb=clock.peak_gb(),
                     settings=dict(precision=precision, kernel="torch SDPA (LitGPT's own)", loss="litgpt chunked_cross_entropy",
                                   data="copy task, every token labelled"),
                     changes=[], version=f"litgpt {_version('litgpt')}", losses=losses, documents=0)
        return
    plan = strategy.memory_plan
    from lightning_seqpar.attention.local import resolve_backend

    layer = next(m for m in module.modules() if type(m).__name__ == "Attention")  # the kernel "auto" runs, as it logs it
    kernel = layer.backend if layer.backend != "auto" or not cuda else resolve_backend(
        "auto", torch.device("cuda"), torch.bfloat16, SHAPES[args.model].head_dim, cudnn_exact=layer.cudnn_exact,
        seq_len=args.seq if strategy.attention == "ulysses" else args.seq // strategy.parallel_dims.sp)  # a call's query tokens
    settings = dict(strategy_kwargs, precision=precision, attention=strategy.attention, kernel=kernel,
                    memory_plan=None if plan is None else str(plan), data="copy task, every token labelled" + (
                        f", {args.documents} packed documents per row" if args.documents else ""))
    if strategy.compile_kwargs is not None and "compile" not in options:  # compile="auto" resolved on (Note [Compile by default])
        settings.update(compile=True, compile_auto=True)
    from lightning_seqpar.parallel.config import StrategyConfig

    defaults = StrategyConfig()  # an option given at its default value is not fixed: memory="auto" may still set it
    as_default = sorted(k for k, v in options.items() if getattr(defaults, k, object()) == v)
    changes = [] if not options else [f"options set: {sorted(options)}"] + (
        [f"given at their defaults, so memory='auto' may still set them: {as_default}"] if as_default else [])
    settings["loss_chunk_size"] = getattr(module, "loss_chunk_size", None)  # what ran ("auto" resolved)
    settings["loss_chunk_set"] = args.loss_chunk is not None
    settings["host_alloc_s"] = _host_alloc_seconds()  # pinned host memory grown (offloaded checkpoints): part of the first step
    from lightning_seqpar.parallel.resources import pinning_in_effect, segments_in_effect

    settings["pinned_allocation"] = pinning_in_effect()  # Note [Pinning host memory in parallel]
    settings["device_segments"] = segments_in_effect()  # Note [Expandable segments by default]
    from lightning_seqpar.models.fused import fused_kernels_on
    from lightning_seqpar.models.llama import RMSNorm

    # Note [Fused element-wise kernels]: the package's Llama on a GPU with liger-kernel (not the transformers models)
    settings["fused_kernels"] = bool(cuda and fused_kernels_on() and any(isinstance(m, RMSNorm) for m in module.modules()))
    settings["fused_kernels_env"] = os.environ.get("SEQPAR_FUSED_KERNELS")  # "0": turned off for a comparison
    write_record(args.out, system="seqpar", model=args.model, seq=args.seq, clock=clock, peak_gb=clock.peak_gb(),
                 settings=settings, changes=changes, version=f"lightning_seqpar {lightning_seqpar.__version__}", losses=losses,
                 documents=args.documents)


if __name__ == "__main__":
    main()

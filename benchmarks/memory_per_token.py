"""What the strategy keeps per token on one GPU (issue #22 item 3): a Llama-3.2-1B-shaped transformers
model (hidden 2048, 16 layers, 32 / 8 heads of 64, FFN 8192, vocab 128256, tied embeddings; random
init), ``precision="bf16-true"``, batch 1, under ``SequenceParallelStrategy(sequence_parallel_size=1)``
with its defaults (Selective Checkpoint++), the chunked loss (``loss_chunk_size=4096``: without it the
fp32 logits alone are 4.2 GB per 8K tokens) and each memory option in turn.

    PYTHONPATH=$PWD python benchmarks/memory_per_token.py --seqs 32768,65536,131072 \
        --out benchmarks/results/DATE-DEVICE-memory-per-token.json

Per (option, S), on the second step (the AdamW state exists): the memory allocated when the step
starts (model states), when the backward starts (``on_before_backward``: what the forward kept for
the backward), the step's peak, and the kept bytes per token per layer = (before backward - at
start) / (S x layers) — the figure Note [Memory per token] is about. A run that does not fit is
recorded with its error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collect import error_text, record_and_release  # noqa: E402

SHAPE = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, max_position_embeddings=1 << 20,
             rope_theta=500000.0, attention_dropout=0.0)
OPTIONS: dict[str, dict] = {
    "default": {},
    "offload_checkpoints": {"offload_checkpoints": True},
    "mlp_chunk_size=8192": {"mlp_chunk_size": 8192},
    "offload+head_chunks=4": {"offload_checkpoints": True, "head_chunks": 4},
}


def run(option: str, seq: int) -> dict:
    import lightning as L
    from transformers import AutoConfig

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    spec = dict(SHAPE)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    seen: dict = {}

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.cuda.synchronize()
            if batch_idx == 1:
                torch.cuda.reset_peak_memory_stats()
                seen["start"] = torch.cuda.memory_allocated()
            self.t0 = time.perf_counter()

        def on_before_backward(self, trainer, pl_module, loss):
            if trainer.global_step == 1:
                torch.cuda.synchronize()
                seen["before_backward"] = torch.cuda.memory_allocated()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            if batch_idx == 1:
                seen["step_s"] = time.perf_counter() - self.t0
                seen["peak"] = torch.cuda.max_memory_allocated()
                seen["reserved"] = torch.cuda.max_memory_reserved()

    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(2):
        ids = torch.randint(0, config.vocab_size, (seq,), generator=g)
        data.append({"input_ids": ids, "labels": torch.cat([ids[1:], torch.tensor([-100])])})
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-true", max_steps=2, logger=False,
                        strategy=SequenceParallelStrategy(sequence_parallel_size=1, **OPTIONS[option]),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Probe()])
    module = CausalLMModule(model=config, lr=1e-5, warmup_steps=0, weight_decay=0.0, loss_chunk_size=4096)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=1))
    layers = config.num_hidden_layers
    kept = seen["before_backward"] - seen["start"]
    return dict(model_states_gb=seen["start"] / 1e9, kept_gb=kept / 1e9, peak_gb=seen["peak"] / 1e9,
                reserved_gb=seen["reserved"] / 1e9, kept_bytes_per_token_per_layer=kept / (seq * layers),
                step_time_s=seen["step_s"], tokens_per_s=seq / seen["step_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="32768,65536,131072")
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    ap.add_argument("--max-minutes", type=float, default=9.0)
    args = ap.parse_args()
    t_end = time.time() + 60 * args.max_minutes
    for option in args.options.split(","):
        for seq in (int(s) for s in args.seqs.split(",")):
            if time.time() > t_end:
                print(f"[memory] budget spent; skipping {option} S={seq}", flush=True)
                continue
            row = dict(bench="memory_per_token", system="seqpar", model="llama3.2-1b-shaped", seq=seq, gpus=1, option=option,
                       device=torch.cuda.get_device_name(), torch=torch.__version__, commit=args.commit)
            try:
                row.update(run(option, seq))
                print(f"[memory] {option} S={seq}: model states {row['model_states_gb']:.2f} GB, kept for backward "
                      f"{row['kept_gb']:.2f} GB = {row['kept_bytes_per_token_per_layer']:.0f} B/token/layer, peak "
                      f"{row['peak_gb']:.2f} GB (reserved {row['reserved_gb']:.2f}), {row['tokens_per_s']:.0f} tokens/s", flush=True)
            except Exception as error:  # noqa: BLE001 - record what did not run (OOM) and go on
                row.update(error=error_text(error))
                print(f"[memory] {option} S={seq}: {row['error']}", flush=True)
            record_and_release(args.out, row)


if __name__ == "__main__":
    main()

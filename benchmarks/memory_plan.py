"""memory="auto" on one GPU: the planner's choice and estimate against the measured peak (issue #22).

    PYTHONPATH=$PWD python benchmarks/memory_plan.py --seqs 32768,131072,262144 \
        --out benchmarks/results/DATE-DEVICE-memory-plan.json

For each length: a Llama-3.2-1B-shaped ``transformers.LlamaForCausalLM`` (config, random init; hidden 2048, 16
layers, 32 / 8 heads of 64, FFN 8192, vocab 128256, tied embeddings) trained 2 optimizer steps with
``SequenceParallelStrategy(sequence_parallel_size=1, memory="auto", expected_seq_len=S)``, bf16-true, batch 1,
``CausalLMModule(loss_chunk_size=--loss-chunk)``, AdamW. One record per length: the planner's options and
estimate (every term, GB), ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over both steps, their
ratio to the estimate, the second step's time and tokens/s. A length that does not fit (the planner's refusal or
a CUDA out-of-memory error) is recorded with its error and the run goes on; lengths not started before
--max-minutes are recorded as skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collect import error_text, record_and_release  # noqa: E402

LLAMA_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=1 << 21,
                rms_norm_eps=1e-5, tie_word_embeddings=True, attention_dropout=0.0)


def run(seq: int, steps: int, loss_chunk: int, row: dict) -> None:
    """Train ``steps`` steps at ``seq`` tokens; fills ``row`` (the plan first, so that it is kept when a step fails)."""
    import lightning as L
    from transformers import AutoConfig

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    spec = dict(LLAMA_1B)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    times: list[float] = []
    losses: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            loss = trainer.callback_metrics.get("train/loss")
            losses.append(float(loss) if loss is not None else float("nan"))

    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(steps):
        ids = torch.randint(0, config.vocab_size, (seq,), generator=g)
        data.append({"input_ids": ids, "labels": torch.cat([ids[1:], torch.tensor([-100])])})
    strategy = SequenceParallelStrategy(sequence_parallel_size=1, memory="auto", expected_seq_len=seq)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-true", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Timer()])
    module = CausalLMModule(model=config, lr=1e-5, warmup_steps=1, weight_decay=0.0, loss_chunk_size=loss_chunk)
    torch.cuda.reset_peak_memory_stats()
    try:
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=1))
    finally:  # the plan is known before the first step, also when a step runs out of memory
        plan = strategy.memory_plan
        if plan is not None:
            est = plan.estimate
            row.update(plan={k: getattr(plan.options, k) for k in ("offload_checkpoints", "head_chunks", "mlp_chunk_size",
                                                                   "offload_params")},
                       estimate_gb=est.total / 1e9, estimate_allocated_gb=est.allocated / 1e9,
                       estimate_terms_gb={k: v / 1e9 for k, v in est.terms().items()})
        row.update(peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9, peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9)
    step = times[-1]
    row.update(step_time_s=step, tokens_per_s=seq / step, losses=losses,
               measured_over_estimate=row["peak_mem_gb"] / row["estimate_allocated_gb"] if "estimate_allocated_gb" in row else None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="32768,131072,262144", help="comma-separated sequence lengths")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--loss-chunk", type=int, default=8192)
    ap.add_argument("--max-minutes", type=float, default=25.0, help="lengths not started by then are recorded as skipped")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()
    start = time.monotonic()
    device = torch.cuda.get_device_name()
    total = torch.cuda.get_device_properties(0).total_memory / 1e9
    for seq in (int(s) for s in args.seqs.split(",")):
        row = dict(bench="memory_plan", system="seqpar", model="hf-llama-3.2-1b-shaped", seq=seq, gpus=1, device=device,
                   device_memory_gb=total, precision="bf16-true", loss_chunk_size=args.loss_chunk, torch=torch.__version__,
                   commit=args.commit)
        if time.monotonic() - start > 60 * args.max_minutes:
            row.update(error=f"skipped: --max-minutes {args.max_minutes} passed")
        else:
            try:
                run(seq, args.steps, args.loss_chunk, row)
            except Exception as error:  # noqa: BLE001 - an OOM or the planner's refusal is a result: record it, go on
                row.update(error=error_text(error, 600),
                           oom=isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error))
        print(f"[memory_plan] S={seq}: " + ", ".join(f"{k}={row[k]}" for k in ("plan", "estimate_allocated_gb", "peak_mem_gb",
              "peak_reserved_gb", "tokens_per_s", "error") if k in row), flush=True)
        record_and_release(args.out, row)


if __name__ == "__main__":
    main()

"""memory="auto" on one GPU: the planner's choice and estimate against the measured peak, and the longest
context that trains against plain transformers (+ peft) on the same GPU (issue #22).

    PYTHONPATH=$PWD python benchmarks/memory_plan.py --seqs 32768,131072,262144 \
        --out benchmarks/results/DATE-DEVICE-memory-plan.json
    PYTHONPATH=$PWD python benchmarks/memory_plan.py --model llama-3-8b --lora 16 --system transformers --seqs 32768,65536

--model: ``llama-3.2-1b`` (hidden 2048, 16 layers, 32 / 8 heads of 64, FFN 8192, vocab 128256, tied embeddings)
or ``llama-3-8b`` (4096, 32 layers, 32 / 8 heads of 128, FFN 14336, vocab 128256); a
``transformers.LlamaForCausalLM`` from the config, random init. --lora R: peft LoRA of rank R (alpha 2R) on
every linear layer, the base frozen (0: full fine-tune). Each length trains --steps optimizer steps (AdamW),
batch 1, bf16 weights:

seqpar       ``SequenceParallelStrategy(sequence_parallel_size=1, memory="auto", expected_seq_len=S)``,
             ``precision="bf16-true"`` (LoRA adapters fp32), ``CausalLMModule(loss_chunk_size=--loss-chunk)``;
             the record has the planner's options and estimate (every term, GB) and measured / estimate.
transformers the same model unmodified as a user runs it: bf16 weights (peft's adapters fp32), SDPA,
             ``gradient_checkpointing_enable()`` (non-reentrant), transformers' own loss on the full logits,
             torch AdamW over the trainable parameters.

One record per length: ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the steps, the last
step's time and tokens/s. A length that does not fit (the planner's refusal or a CUDA out-of-memory error) is
recorded with its error and the longer lengths are skipped; lengths not started before --max-minutes are
recorded as skipped. Steps longer than a 10-minute run allows (1M tokens: ~8 minutes each on an H200) run one
call each: ``--ckpt-dir DIR --stop-after 1`` writes DIR/last.ckpt after this call's step and the next call
resumes from it (the optimizer state included), e.g. twice
``python benchmarks/memory_plan.py --seqs 1048576 --ckpt-dir /tmp/ck --stop-after 1 --out ...`` on a warm machine.
Under a time limit, end it with SIGKILL (``timeout -s KILL``): Lightning takes a SIGTERM at the end of the
running step, so a step that outlasts the limit is not stopped by ``timeout``'s default signal. Carry
flash-attention 4 (or pass ``--options attention_backend=cudnn`` for a model whose cuDNN gradients were
checked): without it "auto" runs flash-attention-2, ~1.9x slower on Hopper at head dim 128.
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
LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=1 << 21,
                rms_norm_eps=1e-5, tie_word_embeddings=False, attention_dropout=0.0)
SHAPES = {"llama-3.2-1b": LLAMA_1B, "llama-3-8b": LLAMA_8B,
          "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True)}  # CPU smoke runs
CUDA = torch.cuda.is_available()
ACCELERATOR = "gpu" if CUDA else "cpu"  # the CPU for smoke runs of the script (--model tiny): no memory figures


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _peaks() -> dict:
    return dict(peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if CUDA else 0.0,
                peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9 if CUDA else 0.0)


def _config(model: str):
    from transformers import AutoConfig

    spec = dict(SHAPES[model])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def _lora(rank: int) -> dict | None:
    return None if rank == 0 else {"r": rank, "lora_alpha": 2 * rank, "target_modules": "all-linear"}


def _data(vocab: int, seq: int, steps: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (seq,), generator=g)
        data.append({"input_ids": ids, "labels": torch.cat([ids[1:], torch.tensor([-100])])})
    return data


def run(model: str, lora: int, seq: int, steps: int, loss_chunk: int, row: dict, ckpt_dir: str | None = None,
        stop_after: int | None = None, plan_seq: int | None = None, options: dict | None = None, snapshot: bool = False) -> None:
    """seqpar: train ``steps`` steps at ``seq`` tokens; fills ``row`` (the plan first, so that it is kept when a step fails).

    ``ckpt_dir``: resume from ``ckpt_dir/last.ckpt`` when it exists (the optimizer state included) and, with
    ``stop_after=n``, stop after n steps in this process and write it there: steps too long for one 10-minute run
    run one call each (the record says which steps ran here). ``plan_seq``: the planner's expected_seq_len when it
    differs from ``seq`` (a short run with a long run's options: checks those options and the resume quickly).
    ``options``: strategy options given by hand (the planner keeps them and plans the rest); ``snapshot``: record
    the allocator's history and put the breakdown of the peak in the row (memory_snapshot.py)."""
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    config = _config(model)
    times: list[float] = []
    losses: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            _sync()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            _sync()
            times.append(time.perf_counter() - self.t0)
            loss = trainer.callback_metrics.get("train/loss")
            losses.append(float(loss) if loss is not None else float("nan"))
            if stop_after is not None and len(times) >= stop_after and trainer.global_step < steps:
                # The rest in the next call. Saved here, inside the step's end as ModelCheckpoint and the
                # package's preemption callback save: a checkpoint written after fit() returns records the
                # epoch as ended, and the resumed run would start the epoch again (step 2 on batch 0).
                os.makedirs(ckpt_dir, exist_ok=True)
                trainer.save_checkpoint(os.path.join(ckpt_dir, "last.ckpt"))
                trainer.should_stop = True

    data = _data(config.vocab_size, seq, steps)
    resume = os.path.join(ckpt_dir, "last.ckpt") if ckpt_dir else None
    resume = resume if resume and os.path.exists(resume) else None
    strategy = SequenceParallelStrategy(sequence_parallel_size=1, memory="auto", expected_seq_len=plan_seq or seq,
                                        **(options or {}))
    trainer = L.Trainer(accelerator=ACCELERATOR, devices=1, strategy=strategy, precision="bf16-true", max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[Timer()])
    module = CausalLMModule(model=config, lora=_lora(lora), lr=1e-5, warmup_steps=1, weight_decay=0.0,
                            loss_chunk_size=loss_chunk)
    if CUDA:
        torch.cuda.reset_peak_memory_stats()
    try:
        def fit() -> None:
            trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=1), ckpt_path=resume)

        if snapshot and CUDA:
            from memory_snapshot import peak_breakdown

            row["peak_breakdown"] = peak_breakdown(fit)
            print(row["peak_breakdown"], flush=True)
        else:
            fit()
        row.update(resumed_from_step=None if resume is None else trainer.global_step - len(times), global_step=trainer.global_step)
    finally:  # the plan is known before the first step, also when a step runs out of memory
        plan = strategy.memory_plan
        if plan is not None:
            est = plan.estimate
            row.update(plan={k: getattr(plan.options, k) for k in ("activation_checkpointing", "offload_checkpoints", "head_chunks",
                                                                   "mlp_chunk_size", "offload_params", "bf16_adapters")},
                       estimate_host_gb=est.host / 1e9,
                       estimate_gb=est.total / 1e9, estimate_allocated_gb=est.allocated / 1e9,
                       estimate_terms_gb={k: v / 1e9 for k, v in est.terms().items()})
        row.update(**_peaks())
    step = times[-1]
    row.update(step_time_s=step, tokens_per_s=seq / step, losses=losses,
               measured_over_estimate=row["peak_mem_gb"] / row["estimate_allocated_gb"] if row.get("estimate_allocated_gb") else None)


def run_plain(model: str, lora: int, seq: int, steps: int, row: dict) -> None:
    """transformers (+ peft) unmodified: ``steps`` steps at ``seq`` tokens; fills ``row``."""
    from transformers import AutoModelForCausalLM

    config = _config(model)
    with torch.device("cuda"):
        net = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.config.use_cache = False
    if lora:
        import peft

        net = peft.get_peft_model(net, peft.LoraConfig(task_type="CAUSAL_LM", **_lora(lora)))  # adapters fp32 (peft's default)
    net.train()
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0)
    times, losses = [], []
    torch.cuda.reset_peak_memory_stats()
    try:
        for item in _data(config.vocab_size, seq, steps):
            ids, labels = item["input_ids"][None].cuda(), item["labels"][None].cuda()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = net(input_ids=ids, labels=labels, use_cache=False).loss  # transformers shifts: labels = ids
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            losses.append(float(loss))
    finally:
        row.update(peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9, peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9,
                   trainable_params=sum(p.numel() for p in params))
        del net, opt, params
    row.update(step_time_s=times[-1], tokens_per_s=seq / times[-1], losses=losses, attn="sdpa")


def _options(text: str) -> dict:
    """``"head_chunks=8,offload_params=true"`` -> ``{"head_chunks": 8, "offload_params": True}``."""
    out: dict = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        low = value.strip().lower()
        out[key.strip()] = (True if low == "true" else False if low == "false" else None if low == "none"
                            else int(low) if low.lstrip("-").isdigit() else value.strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="32768,131072,262144", help="comma-separated sequence lengths, shortest first")
    ap.add_argument("--model", default="llama-3.2-1b", choices=sorted(SHAPES))
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on every linear layer (0: full fine-tune)")
    ap.add_argument("--system", default="seqpar", choices=("seqpar", "transformers"))
    ap.add_argument("--ckpt-dir", default=None, help="seqpar: resume from DIR/last.ckpt if it exists; write it when stopping early")
    ap.add_argument("--stop-after", type=int, default=None, help="seqpar: steps in this process (with --ckpt-dir)")
    ap.add_argument("--plan-seq", type=int, default=None, help="seqpar: plan for this length instead (a quick check of a long plan)")
    ap.add_argument("--options", default="", help="seqpar: strategy options by hand, e.g. head_chunks=8,offload_params=true")
    ap.add_argument("--snapshot", action="store_true", help="seqpar: the breakdown of the peak (the allocator's history)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--loss-chunk", type=int, default=8192)
    ap.add_argument("--max-minutes", type=float, default=25.0, help="lengths not started by then are recorded as skipped")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()
    start = time.monotonic()
    device = torch.cuda.get_device_name() if CUDA else "cpu"
    total = torch.cuda.get_device_properties(0).total_memory / 1e9 if CUDA else 0.0
    name = f"hf-{args.model}-shaped" + (f"-lora{args.lora}" if args.lora else "")
    failed = None
    for seq in (int(s) for s in args.seqs.split(",")):
        row = dict(bench="memory_plan", system=args.system, model=name, seq=seq, gpus=1, device=device,
                   device_memory_gb=total, precision="bf16-true", lora_rank=args.lora, steps=args.steps,
                   loss_chunk_size=args.loss_chunk if args.system == "seqpar" else None, torch=torch.__version__,
                   commit=args.commit)
        if failed is not None:
            row.update(error=f"skipped: {failed} did not fit")
        elif time.monotonic() - start > 60 * args.max_minutes:
            row.update(error=f"skipped: --max-minutes {args.max_minutes} passed")
        else:
            try:
                if args.system == "seqpar":
                    row.update(plan_seq=args.plan_seq, options=_options(args.options))
                    run(args.model, args.lora, seq, args.steps, args.loss_chunk, row, args.ckpt_dir, args.stop_after, args.plan_seq,
                        row["options"], args.snapshot)
                else:
                    run_plain(args.model, args.lora, seq, args.steps, row)
            except Exception as error:  # noqa: BLE001 - an OOM or the planner's refusal is a result: record it, go on
                row.update(error=error_text(error, 600),
                           oom=isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error))
                failed = seq
        print(f"[memory_plan] {args.system} {name} S={seq}: " + ", ".join(f"{k}={row[k]}" for k in ("plan", "estimate_allocated_gb", "peak_mem_gb",
              "peak_reserved_gb", "tokens_per_s", "error") if k in row), flush=True)
        record_and_release(args.out, row)


if __name__ == "__main__":
    main()

"""Long-context model families on one GPU: a Gemma-3-shaped, a gpt-oss-shaped and a Qwen3-Next-shaped
hybrid model (random init, a few layers) trained a few steps at --seq tokens with SequenceParallelStrategy, against plain
transformers on the same GPU (issues #21, #23; with fla-core installed, both use its gated DeltaNet kernel).

    PYTHONPATH=$PWD python benchmarks/hf_families.py --seq 32768 --out benchmarks/results/DATE-DEVICE-hf-families.json

ours   ``Trainer(strategy=SequenceParallelStrategy(sequence_parallel_size=1), precision="bf16-mixed")`` +
       ``CausalLMModule(<the model config>, loss_chunk_size=4096)``: the package's attention with the
       layers' sliding windows (Gemma 3: 5 local : 1 global, window 1024; gpt-oss: alternating,
       window 128), sinks (gpt-oss) and the chunked loss; its default checkpointing.
plain  the same transformers model, unmodified: fp32 weights, ``torch.autocast(bf16)``, AdamW, gradient
       checkpointing on (what a user does at long context), the first of ``sdpa``, ``flex_attention``,
       ``eager`` that the model accepts; full logits and transformers' own loss.
Both: median step time after one warm-up step, peak allocated memory after the warm-up, tokens/s.
A run that does not fit is recorded with its error (``CUDA out of memory``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collect import error_text, record_and_release  # noqa: E402

# Gemma 3 12B's layer shape (hidden 3840, 16 / 8 heads of 256, FFN 15360, vocab 262144, window 1024,
# 5 local layers per global one), 6 layers; gpt-oss-20b's (hidden 2880, 64 / 8 heads of 64, window 128
# on every other layer, sinks, top-4 MoE of FFN 2880, vocab 201088), 4 layers and 8 experts (32 in the
# release) to fit one GPU with AdamW states.
SHAPES: dict[str, dict] = {
    "gemma3": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=6,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=262144, sliding_window=1024,
                   query_pre_attn_scalar=256, max_position_embeddings=131072, attention_dropout=0.0,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    "gpt-oss": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=4, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=64, vocab_size=201088, sliding_window=128, num_local_experts=8,
                    num_experts_per_tok=4, max_position_embeddings=131072, attention_dropout=0.0,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    # Qwen3-Next-80B-A3B's layer shape (hidden 2048, 16 / 2 heads of 256, gated DeltaNet with 16 key / 32
    # value heads of 128, conv 4, 3 linear : 1 full), 8 layers, a dense FFN in place of the 512-expert MoE
    "qwen3-next": dict(model_type="qwen3_next", hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                       linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       num_experts=0, vocab_size=151936, max_position_embeddings=262144, attention_dropout=0.0,
                       layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2),
}


def _config(shape: str):
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def _batches(vocab: int, seq: int, n: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(0, vocab, (1, seq), generator=g)
        yield ids


def run_ours(shape: str, seq: int, steps: int) -> dict:
    import lightning as L

    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    config = _config(shape)
    times: list[float] = []
    losses: list[float] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            torch.cuda.synchronize()
            if batch_idx == 1:
                torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            if batch_idx >= 1:
                times.append(time.perf_counter() - self.t0)
            loss = trainer.callback_metrics.get("train/loss")
            losses.append(float(loss) if loss is not None else float("nan"))

    data = [{"input_ids": ids[0], "labels": torch.cat([ids[0, 1:], torch.tensor([-100])])}
            for ids in _batches(config.vocab_size, seq, steps + 1)]
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=SequenceParallelStrategy(sequence_parallel_size=1),
                        precision="bf16-mixed", max_steps=steps + 1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[Timer()])
    module = CausalLMModule(model=config, lr=1e-5, warmup_steps=1, weight_decay=0.0, loss_chunk_size=4096)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=1))
    return dict(step_time_s=sorted(times)[len(times) // 2], peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9, losses=losses,
                attn="seqpar")


def run_plain(shape: str, seq: int, steps: int) -> dict:
    from transformers import AutoModelForCausalLM

    config = _config(shape)
    model = None
    for impl in ("sdpa", "flex_attention", "eager"):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=impl)
            break
        except (ValueError, ImportError):
            continue
    model = model.cuda().train()
    model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
    times, losses = [], []
    for i, ids in enumerate(_batches(config.vocab_size, seq, steps + 1)):
        ids = ids.cuda()
        torch.cuda.synchronize()
        if i == 1:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 1:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return dict(step_time_s=sorted(times)[len(times) // 2], peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9, losses=losses,
                attn=model.config._attn_implementation)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shapes", default="gemma3,gpt-oss")
    ap.add_argument("--systems", default="seqpar,transformers")
    ap.add_argument("--out", default=None)
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        for system in args.systems.split(","):
            row = dict(bench="hf_family", system=system, model=f"{shape}-shaped", seq=args.seq, gpus=1,
                       device=torch.cuda.get_device_name(), torch=torch.__version__, commit=args.commit, config=SHAPES[shape])
            try:
                got = (run_ours if system == "seqpar" else run_plain)(shape, args.seq, args.steps)
                row.update(got, tokens_per_s=args.seq / got["step_time_s"])
                print(f"[hf_family] {shape} {system} ({got['attn']}) S={args.seq}: {row['tokens_per_s']:.0f} tokens/s, "
                      f"step {got['step_time_s']:.2f} s, peak {got['peak_mem_gb']:.1f} GB, losses "
                      f"{[round(x, 3) for x in got['losses']]}", flush=True)
            except Exception as error:  # noqa: BLE001 - record what did not run (OOM) and go on
                row.update(error=error_text(error))
                print(f"[hf_family] {shape} {system} S={args.seq}: {row['error']}", flush=True)
            record_and_release(args.out, row)


if __name__ == "__main__":
    main()

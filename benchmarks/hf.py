"""Hugging Face models (transformers, peft; random init) under SequenceParallelStrategy against plain transformers:
one runner, a mode per question (its first argument; ``families`` when none is given).

    PYTHONPATH=$PWD python benchmarks/hf.py families --seq 32768 --out benchmarks/results/DATE-DEVICE-hf-families.json
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nproc_per_node=4 benchmarks/hf.py families --seq 131072 --out f.json
    torchrun --nproc_per_node=4 benchmarks/hf.py finetune --seq 131072 --documents --out hf.json
    PYTHONPATH=$PWD python benchmarks/hf.py memory --seqs 32768,131072,262144 --out benchmarks/results/DATE-DEVICE-memory-plan.json
    PYTHONPATH=$PWD python benchmarks/hf.py memory --model llama-3-8b --lora 16 --system transformers --seqs 32768,65536
    PYTHONPATH=$PWD python benchmarks/hf.py memory --memory manual --options offload_checkpoints=true --loss-chunk 4096 --seqs 65536

families  A Gemma-3-shaped, a gpt-oss-shaped and a Qwen3-Next-shaped hybrid model, LoRA on the Llama-3-8B shape and
          the Llama-3.2-1B shape (SHAPES), a few steps at --seq tokens (issues #21, #23, #26, #43). Ours:
          ``SequenceParallelStrategy(sequence_parallel_size=WORLD_SIZE, attention=--algorithm)`` + ``CausalLMModule(<config>,
          loss_chunk_size=4096)``, "bf16-mixed" (LoRA: "bf16-true" with ``bf16_adapters=True``, the configuration of
          docs/hf_finetune.md). Plain transformers (one GPU only: it cannot split one sequence over GPUs): the same
          model unmodified, fp32 weights (bf16 base + peft's fp32 adapters for LoRA), ``torch.autocast(bf16)``, fused
          AdamW, gradient checkpointing, the first of sdpa / flex_attention / eager it accepts, its own loss on the full
          logits. Median step after --warmup, peak memory after the warm-up (max over ranks), tokens/s/GPU, and MFU =
          tokens/s/GPU x model FLOPs per token / 989e12 (:func:`model_flops`: 6 x the parameters a token runs through
          but the input embedding, only the top-k experts; 12 x S_eff x heads x head_dim per softmax layer, S_eff the
          mean keys a query sees; the delta-rule state update and sinks left out; LoRA: 4 x N_frozen + 6 x N_adapters +
          attention). Records: bench "hf_family" on one GPU, "hf-families" under torchrun; a shape that fails (out of
          memory, a refusal) is recorded with its error and the next one runs. Under torchrun every rank first tells
          the others how its run ended (Agreement); a rank left waiting in a collective exits, torchrun stops the rest.
finetune  ``transformers.LlamaForCausalLM`` of the llama3-8b shape at --seq over the GPUs, random tokens in documents
          of exponential lengths (mean --mean-doc; ``document_ids``: attention stays inside each document). Record
          bench "train", model "hf-llama3-8b"; MFU counts 6 N_non-embedding + 6 L d sum(len_i^2) / S.
memory    One GPU (issue #22): ``SequenceParallelStrategy(sequence_parallel_size=1, memory="auto", expected_seq_len=S)``
          (``--memory manual``: the options of --options only), "bf16-true" (LoRA adapters fp32): the planner's options
          and estimate (every term, GB) against the measured peak, and what the last step keeps for its backward (Note
          [Memory per token]: kept_bytes_per_token_per_layer = (allocated when the backward starts - when the step
          starts) / (S x layers)); or --system transformers: the model unmodified, bf16 weights (peft's adapters fp32),
          SDPA, non-reentrant gradient checkpointing, its own loss. --steps AdamW steps per length, shortest first; a
          length that does not fit is recorded with its error and the longer ones skipped. A step longer than a 10-minute
          run: ``--ckpt-dir DIR --stop-after 1`` writes DIR/last.ckpt after this run's step and the next run resumes from
          it (end it with ``timeout -s KILL``: Lightning takes a SIGTERM at the end of the step).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
import traceback
from collections import defaultdict

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from driver import (PEAK_BF16, append_records, error_text, held_gb, is_oom, max_over_ranks, mode_of, record_and_release,  # noqa: E402
                    runner_args, step_timer, trainer)

LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=1 << 20, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, attention_dropout=0.0)
LLAMA3_1B = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, attention_dropout=0.0)
_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
TINY_LLAMA = dict(model_type="llama", num_hidden_layers=2, tie_word_embeddings=True, **_TINY)
# Gemma 3 12B's layer shape (hidden 3840, 16 / 8 heads of 256, FFN 15360, vocab 262144, window 1024, 5 local layers per global
# one), 6 layers; gpt-oss-20b's (hidden 2880, 64 / 8 heads of 64, window 128 on every other layer, sinks, top-4 MoE of FFN 2880,
# vocab 201088), 4 layers and 8 experts (32 in the release) to fit one GPU with AdamW states; Qwen3-Next-80B-A3B's (hidden
# 2048, 16 / 2 heads of 256, gated DeltaNet with 16 key / 32 value heads of 128, conv 4, 3 linear : 1 full), 8 layers, a dense
# FFN in place of the 512-expert MoE; Llama-3-8B's, all 32 layers, LoRA on every linear layer; Llama-3.2-1B's with its llama3
# rope scaling: a full-rotary model, the first hour of a new user on one GPU (issue #43).
SHAPES: dict[str, dict] = {
    "gemma3": dict(model_type="gemma3_text", hidden_size=3840, intermediate_size=15360, num_hidden_layers=6, num_attention_heads=16,
                   num_key_value_heads=8, head_dim=256, vocab_size=262144, sliding_window=1024, query_pre_attn_scalar=256,
                   max_position_embeddings=131072, attention_dropout=0.0, layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    "gpt-oss": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=4, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=64, vocab_size=201088, sliding_window=128, num_local_experts=8, num_experts_per_tok=4,
                    max_position_embeddings=131072, attention_dropout=0.0, layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen3-next": dict(model_type="qwen3_next", hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                       num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=0, vocab_size=151936,
                       max_position_embeddings=262144, attention_dropout=0.0, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2),
    "llama3-8b-lora": dict(LLAMA3_8B),
    "llama3.2-1b": dict(LLAMA3_1B, max_position_embeddings=131072, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
LORA: dict[str, dict] = {"llama3-8b-lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}}
"""The shapes trained with LoRA (``CausalLMModule(lora=...)``), with their peft.LoraConfig fields."""
TINY: dict[str, dict] = {  # --device cpu: each shape shrunk, its layer pattern kept (windows below the smoke test's --seq)
    "gemma3": dict(_TINY, query_pre_attn_scalar=16, sliding_window=32),
    "gpt-oss": dict(_TINY, intermediate_size=32, sliding_window=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    "qwen3-next": dict(_TINY, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       num_hidden_layers=4),
    "llama3-8b-lora": dict(_TINY, num_hidden_layers=2), "llama3.2-1b": dict(_TINY, num_hidden_layers=2),
}
MEMORY_SHAPES = {"llama-3.2-1b": dict(LLAMA3_1B, rope_theta=500000.0, max_position_embeddings=1 << 21, rms_norm_eps=1e-5),
                 "llama-3-8b": dict(LLAMA3_8B, head_dim=128, max_position_embeddings=1 << 21), "tiny": TINY_LLAMA}
"""The shapes of ``memory`` (tiny: CPU smoke runs, no memory figures)."""
AGREE_TIMEOUT_S = 120
"""Under torchrun: how long a rank waits for the others to say how their run of a shape ended (the ranks leave a run
within seconds of each other; one that does not answer waits in a collective for a rank that failed)."""


def _spec(shape: str, *, tiny: bool = False) -> dict:
    """The config fields of ``shape`` (TINY's on top with ``tiny``: the layer pattern tiled to its layers)."""
    spec = dict(SHAPES[shape], **(TINY[shape] if tiny else {}))
    n = spec["num_hidden_layers"]
    if "layer_types" in spec:
        pattern = SHAPES[shape]["layer_types"]
        spec["layer_types"] = (pattern * math.ceil(n / len(pattern)))[:n]
    return spec


def _config(spec: dict):
    from transformers import AutoConfig

    spec = dict(spec)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def _mean_keys(seq: int, window: int | None) -> float:
    """The mean number of keys a query attends to over ``seq`` causal positions: S / 2 without a window, mean over p
    of min(p + 1, window) with one (transformers' window: query i sees keys i - window < j <= i)."""
    if window is None or window >= seq:
        return seq / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


def model_flops(config, seq: int, lora: dict | None = None) -> dict:
    """Model FLOPs per trained token (forward + backward) of ``config`` at ``seq`` tokens, and their parts (the
    conventions: the module docstring). Counted on the model built on the meta device (no memory)."""
    from torch import nn
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    top_k = getattr(config, "num_experts_per_tok", None) or experts
    n = 0.0
    for name, p in model.named_parameters():  # a tied head is the embedding: named once, counted as the head
        if p is not embedding or tied:
            n += p.numel() * (top_k / experts if experts and ".experts." in name else 1.0)
    width = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    attention = 0.0
    for kind in getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers:
        if kind in ("full_attention", "sliding_attention"):
            attention += 12 * width * _mean_keys(seq, config.sliding_window if kind == "sliding_attention" else None)
        elif kind != "linear_attention":  # gated DeltaNet: its projections are in N, the state update is left out
            raise ValueError(f"model_flops: no FLOP count for layer type {kind!r}")
    out = dict(n_active_params=n, attention_flops_per_token=attention)
    if lora is None:
        return dict(out, flops_per_token=6 * n + attention, flops_convention="6*N_active + attention")
    if lora.get("target_modules") != "all-linear":
        raise ValueError(f"model_flops: LoRA FLOPs are counted for target_modules='all-linear' only, got {lora.get('target_modules')!r}")
    # peft's "all-linear": every nn.Linear but the output layer
    adapters = sum(lora["r"] * (m.in_features + m.out_features) for m in model.modules() if isinstance(m, nn.Linear) and m is not head)
    return dict(out, n_lora_params=adapters, flops_per_token=4 * n + 6 * adapters + attention,
                flops_convention="LoRA: 4*N_frozen + 6*N_lora + attention (no weight gradient for the frozen base)")


def _sample(ids: torch.Tensor, lengths: list[int] | None = None, documents: bool = True) -> dict:
    """One training sample of ids [S]; with document ``lengths``, those packed documents (the last token of each
    predicts nothing: its label is -100; ``document_ids`` unless ``documents`` is False)."""
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    if not lengths:
        return {"input_ids": ids, "labels": labels}
    labels[torch.cumsum(torch.tensor(lengths), 0) - 1] = -100
    doc = {"document_ids": torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))} if documents else {}
    return {"input_ids": ids, "labels": labels, **doc}


def _ids(vocab: int, seq: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (seq,), generator=g) for _ in range(n)]


def _fit(config, data: list[dict], strategy, *, steps: int, precision: str, callbacks: list, cuda: bool, lora=None, loss_chunk: int,
         warmup_steps: int = 1, ckpt_path: str | None = None):
    """``CausalLMModule(config)`` trained ``steps`` steps on ``data`` (batch 1) under ``strategy``; the Trainer."""
    from lightning_seqpar import CausalLMModule

    fit = trainer(strategy, steps=steps, precision=precision, callbacks=callbacks, cuda=cuda)
    module = CausalLMModule(model=config, lora=lora, lr=1e-5, warmup_steps=warmup_steps, weight_decay=0.0, loss_chunk_size=loss_chunk)
    fit.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=1), ckpt_path=ckpt_path)
    return fit


def run_plain(config, seq: int, row: dict, *, lora: dict | None, steps: int, warmup: int = 0, bf16: bool, autocast: bool, fused: bool,
              checkpointing: dict | None = None, last: bool = False) -> None:
    """One GPU: the unmodified transformers model (+ peft for ``lora``) with ``bf16`` or fp32 weights, optionally under
    ``torch.autocast(bf16)``; the median step after ``warmup`` (``last``: the last step); fills ``row`` (the peak also
    when a step runs out of memory)."""
    from transformers import AutoModelForCausalLM

    model = None
    with torch.device("cuda"):
        for impl in ("sdpa", "flex_attention", "eager"):
            try:
                model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, **({"dtype": torch.bfloat16} if bf16 else {}))
                break
            except (ValueError, ImportError):
                continue
    attn = model.config._attn_implementation
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    model.config.use_cache = False
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **lora))  # adapters fp32 (peft's default)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, **({"fused": True} if fused else {}))
    times, losses = [], []
    try:
        for i, ids in enumerate(_ids(config.vocab_size, seq, warmup + steps)):
            ids = ids[None].cuda()
            torch.cuda.synchronize()
            if i == warmup:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # transformers shifts the labels itself
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
            losses.append(float(loss))
    finally:
        row.update(peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9, peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9,
                   trainable_params=sum(p.numel() for p in params))
        del model, opt, params
    step = times[-1] if last else sorted(times)[len(times) // 2]
    row.update(step_time_s=step, tokens_per_s=seq / step, losses=losses, attn=attn)


# ---- families -------------------------------------------------------------------------------------------------

class Agreement:
    """Under torchrun: one exchange per shape, over a gloo group with a timeout, of how each rank's run ended (None or
    its error), so that all ranks take the same path after a failure. A rank whose run raises inside ``trainer.fit``
    exchanges in ``on_exception`` (before Lightning's teardown, which may wait on the device); the others after
    ``fit``. When the exchange times out or a peer is gone, this rank prints its error, rank 0 also records it, and
    the process exits with code 1 (torchrun then stops the ranks left waiting)."""

    def __init__(self, group, on_abort) -> None:
        self.group, self.on_abort, self.result = group, on_abort, None

    def __call__(self, error: str | None) -> list[str | None]:
        if self.result is None:
            got: list = [None] * dist.get_world_size()
            try:
                dist.all_gather_object(got, error, group=self.group)
            except Exception as exc:  # noqa: BLE001 - a rank waits in a collective for one that failed, or is gone
                self.on_abort(error, exc)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
            self.result = got
        return self.result

    def callback(self):
        import lightning as L

        agreement = self

        class Exchange(L.Callback):
            def on_exception(self, trainer, pl_module, exception):
                agreement(error_text(exception))

        return Exchange()


def run_ours(args, shape: str, world: int, callbacks: list) -> dict:
    from lightning_seqpar import SequenceParallelStrategy

    config = _config(_spec(shape, tiny=args.device == "cpu"))
    lora = LORA.get(shape)
    times, losses = [], []
    docs = [args.seq // args.docs] * (args.docs - 1) + [args.seq - args.seq // args.docs * (args.docs - 1)] if args.docs else None
    data = [_sample(ids, docs) for ids in _ids(config.vocab_size, args.seq, args.warmup + args.steps)]
    extra = {} if args.activation_checkpointing is None else {
        "activation_checkpointing": None if args.activation_checkpointing == "none" else args.activation_checkpointing}
    strategy = SequenceParallelStrategy(sequence_parallel_size=world, attention=args.algorithm, attention_backend=args.attention_backend,
                                        expected_seq_len=args.seq if args.algorithm == "auto" else None, bf16_adapters=lora is not None,
                                        timeout=datetime.timedelta(seconds=args.timeout), **extra,
                                        **({"memory": args.memory} if args.memory is not None else {}))
    if args.profile:
        from profile_summary import profiler_callback

        callbacks = [*callbacks, profiler_callback(argparse.Namespace(**vars(args), system="seqpar", model="hf", tag="", profile_trace=False))]
    _fit(config, data, strategy, steps=args.warmup + args.steps, precision=_precision(args, shape), cuda=args.device == "cuda", lora=lora,
         callbacks=[step_timer(times, losses, warmup=args.warmup, cuda=args.device == "cuda"), *callbacks], loss_chunk=args.loss_chunk)
    dims = strategy.parallel_dims  # what "auto" chose, named as benchmarks/train.py names it
    algorithm = f"2d:{dims.hp}x{dims.cp}" if strategy.attention == "2d" else strategy.attention
    return dict(step_time_s=sorted(times)[len(times) // 2], losses=losses, algorithm=algorithm, attn="seqpar")


def _precision(args, shape: str) -> str:  # LoRA: the frozen base in bf16, fp32 adapters (with bf16_adapters: gathered in bf16)
    return "bf16-true" if shape in LORA else "bf16-mixed" if args.device == "cuda" else "32-true"


def _family_row(args, shape: str, system: str, world: int, bench: str) -> dict:
    spec = _spec(shape, tiny=args.device == "cpu")
    ours = system == "seqpar"
    options = {k: v for k, v in (("activation_checkpointing", args.activation_checkpointing), ("memory", args.memory)) if v is not None}
    return dict(bench=bench, shape=shape, system=system, model=f"{shape}-shaped" + ("-tiny" if args.device == "cpu" else ""), seq=args.seq,
                gpus=world, documents=args.docs or None,
                state_passing=("chain" if os.environ.get("SEQPAR_STATE_CHAIN", "0") == "1" else "parallel") if ours else None,
                device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__, commit=args.commit,
                algorithm=args.algorithm if ours else "transformers", attention_backend=args.attention_backend if ours else None,
                strategy_options=options if ours else None, precision=_precision(args, shape) if ours else "autocast-bf16",
                lora=LORA.get(shape), warmup=args.warmup, steps=args.steps, config=spec,
                **({"auto": True} if ours and args.algorithm == "auto" else {}), **model_flops(_config(spec), args.seq, LORA.get(shape)))


def _measured(row: dict, got: dict, world: int) -> dict:
    tps = row["seq"] / got["step_time_s"] / world
    return dict(got, tokens_per_s_per_gpu=tps, mfu=tps * row["flops_per_token"] / PEAK_BF16)


def _line(row: dict) -> str:
    head = f"[hf] {row['shape']} {row['system']} S={row['seq']} GPUs={row['gpus']}"
    if row.get("error"):
        return f"{head}: {row['error']}"
    kernel = f", {row['attention_backend']}" if row.get("attention_backend") else ""
    return (f"{head} ({row.get('algorithm', row.get('attn'))}{kernel}): {row['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, MFU {row['mfu']:.3f}, "
            f"step {row['step_time_s']:.2f} s, peak {row['peak_mem_gb']:.1f} GB, losses {[round(x, 3) for x in row['losses']]}")


def families(args) -> None:
    """One GPU (a plain launch): ours and plain transformers, one shape after another. Under torchrun: ours over all
    ranks, the ranks agreeing on how each shape ended (Agreement) before the next (the default group stays)."""
    world, cuda, rank = int(os.environ.get("WORLD_SIZE", "1")), args.device == "cuda", 0
    if world > 1:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout),
                                device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else None)
        rank = dist.get_rank()
        agree_s = min(AGREE_TIMEOUT_S, args.timeout / 2)  # shorter than a collective's timeout: the failed rank exits first
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=agree_s))
        if rank == 0 and "transformers" in args.systems:
            print(f"[hf] transformers: skipped under torchrun (WORLD_SIZE={world}): plain transformers cannot split one sequence over "
                  f"GPUs (each would hold all {args.seq} tokens); its one-GPU runs: a plain `python` launch", flush=True)
    for shape in args.shapes:
        for system in args.systems if world == 1 else [s for s in args.systems if s == "seqpar"]:
            row = _family_row(args, shape, system, world, "hf_family" if world == 1 else "hf-families")
            callbacks = []
            if world > 1:
                row["held_before_gb"] = held_gb(cuda)

                def abort(error: str | None, exc: BaseException, row=row) -> None:
                    print(f"[hf] rank {rank}: {row['shape']} failed ({error}); the ranks did not all report within {agree_s:.0f} s "
                          f"({type(exc).__name__}: {str(exc).strip()[:120]}): exiting, torchrun stops the rest", flush=True)
                    if rank == 0 and error is not None and args.out:
                        append_records(args.out, dict(row, error=error, error_ranks=[0], aborted=True))

                agreement = Agreement(group, abort)
                callbacks = [agreement.callback()]
            if system == "transformers" and not cuda:
                print(f"[hf] {shape} transformers: skipped on --device cpu", flush=True)
                continue
            got, error = {}, None
            try:
                if system == "seqpar":
                    got = run_ours(args, shape, world, callbacks)
                else:
                    run_plain(_config(_spec(shape)), args.seq, got, lora=LORA.get(shape), steps=args.steps, warmup=args.warmup,
                              bf16=shape in LORA, autocast=True, fused=True)
            except Exception as exc:  # noqa: BLE001 - a shape that fails (OOM) is a result: record it, go on
                error = error_text(exc)
                if world > 1 and not is_oom(exc):
                    traceback.print_exc()
            errors = agreement(error) if world > 1 else [error]
            failed = [r for r, e in enumerate(errors) if e is not None]
            if failed:
                row.update(error=errors[failed[0]], **({"error_ranks": failed} if world > 1 else {}))
            else:
                if system == "seqpar":
                    got["peak_mem_gb"] = max_over_ranks(torch.cuda.max_memory_allocated() / 1e9, device="cuda")[0] if cuda else float("nan")
                row.update(_measured(row, got, world), **({"tokens_per_s": args.seq / got["step_time_s"]} if world == 1 else {}))
            if rank == 0:
                print(_line(row), flush=True)
            record_and_release(args.out if rank == 0 else None, row, end_group=world == 1)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


# ---- finetune: a transformers Llama with packed documents over the GPUs ---------------------------------------

def doc_lengths(seq: int, mean_doc: int | None, seed: int) -> list[int]:
    """Document lengths of sample ``seed`` (exponential, mean ``mean_doc``; one document without it), summing to ``seq``."""
    if mean_doc is None:
        return [seq]
    g = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < seq:
        out.append(max(1, int(torch.empty(1).exponential_(1.0 / mean_doc, generator=g))))
    out[-1] -= sum(out) - seq
    return [n for n in out if n > 0]


def finetune(args) -> None:
    from lightning_seqpar import SequenceParallelStrategy

    cuda, world = args.device == "cuda", int(os.environ["WORLD_SIZE"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    shape = LLAMA3_8B if cuda else dict(TINY_LLAMA, tie_word_embeddings=False, max_position_embeddings=4096)
    n = args.warmup + args.steps
    lengths = [doc_lengths(args.seq, args.mean_doc if args.documents else None, i) for i in range(2 * n)]
    data = [_sample(ids, lengths[i], args.documents) for i, ids in enumerate(_ids(shape["vocab_size"], args.seq, 2 * n))]
    times, losses = [], []
    strategy = SequenceParallelStrategy(sequence_parallel_size=world, attention=args.algorithm)
    fit = _fit(dict(shape), data, strategy, steps=n, precision="bf16-mixed" if cuda else "32-true", cuda=cuda, loss_chunk=args.loss_chunk,
               callbacks=[step_timer(times, losses, warmup=args.warmup, cuda=cuda)])
    peak = max_over_ranks(torch.cuda.max_memory_allocated() / 1e9 if cuda else float("nan"), device="cuda" if cuda else "cpu")[0]
    n_non_embedding = sum(p.numel() for name, p in fit.lightning_module.model.named_parameters()
                          if "embed_tokens" not in name and "lm_head" not in name)  # DTensor numel: global
    span = sum(sum(x * x for x in lengths[i]) / args.seq for i in range(args.warmup, n)) / args.steps  # mean sum(len^2) / S
    flops_per_token = 6 * n_non_embedding + 6 * shape["num_hidden_layers"] * span * shape["hidden_size"]
    step = sorted(times)[len(times) // 2]
    tps = args.seq / step / world
    row = dict(bench="train", system="seqpar", algorithm=args.algorithm + ("+documents" if args.documents else ""),
               model="hf-llama3-8b" if cuda else "hf-tiny", seq=args.seq, gpus=world, device=torch.cuda.get_device_name() if cuda else "cpu",
               step_time_s=step, tokens_per_s_per_gpu=tps, mfu=tps * flops_per_token / PEAK_BF16, peak_mem_gb=peak, losses=losses,
               documents=args.documents, mean_doc=args.mean_doc if args.documents else args.seq, attention_span=span, commit=args.commit)
    if dist.get_rank() == 0:
        print(f"[hf] {row['model']} {row['algorithm']} S={args.seq} GPUs={world}: {tps:.0f} tokens/s/GPU, MFU {row['mfu']:.3f} "
              f"(attention span {span:.0f}), step {step:.2f}s, peak {peak:.1f} GB, losses {[round(x, 3) for x in losses]}", flush=True)
        if args.out:
            append_records(args.out, row)


# ---- memory: memory="auto" on one GPU against transformers (+ peft), and what a step keeps per token ----------

def _options(text: str) -> dict:
    """``"head_chunks=8,offload_params=true"`` -> ``{"head_chunks": 8, "offload_params": True}``."""
    out: dict = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        low = value.strip().lower()
        out[key.strip()] = (True if low == "true" else False if low == "false" else None if low == "none"
                            else int(low) if low.lstrip("-").isdigit() else value.strip())
    return out


def run_memory(args, seq: int, row: dict) -> None:
    """Ours with memory="auto": ``args.steps`` steps at ``seq`` tokens; fills ``row`` (the plan first, so that it is kept
    when a step fails). ``--ckpt-dir``: resume from DIR/last.ckpt when it exists and, with ``--stop-after n``, stop
    after n steps in this process and write it there. ``--plan-seq``: the planner's length when it differs from
    ``seq``; ``--options``: strategy options by hand (the planner plans the rest); ``--snapshot``: the breakdown of the
    peak from the allocator's history."""
    from lightning_seqpar import SequenceParallelStrategy

    cuda = torch.cuda.is_available()
    config = _config(MEMORY_SHAPES[args.model])
    times, losses, kept = [], [], {}

    class StopAfter(type(step_timer(times, losses, warmup=-1, cuda=cuda))):  # every step timed; what the last one keeps
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            kept["start"] = torch.cuda.memory_allocated() if cuda else 0

        def on_before_backward(self, trainer, pl_module, loss):
            kept["backward"] = torch.cuda.memory_allocated() if cuda else 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if args.stop_after is not None and len(times) >= args.stop_after and trainer.global_step < args.steps:
                # The rest in the next run. Saved here, inside the step's end as ModelCheckpoint saves: a checkpoint written
                # after fit() returns records the epoch as ended, and the resumed run would start the epoch again.
                os.makedirs(args.ckpt_dir, exist_ok=True)
                trainer.save_checkpoint(os.path.join(args.ckpt_dir, "last.ckpt"))
                trainer.should_stop = True

    resume = os.path.join(args.ckpt_dir, "last.ckpt") if args.ckpt_dir else None
    resume = resume if resume and os.path.exists(resume) else None
    strategy = SequenceParallelStrategy(sequence_parallel_size=1, memory=args.memory, **row["options"],
                                        **({"expected_seq_len": args.plan_seq or seq} if args.memory == "auto" else {}))
    lora = {"r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": "all-linear"} if args.lora else None
    data = [_sample(ids) for ids in _ids(config.vocab_size, seq, args.steps)]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    try:
        def fit() -> None:
            row["global_step"] = _fit(config, data, strategy, steps=args.steps, precision="bf16-true", callbacks=[StopAfter()], cuda=cuda,
                                      lora=lora, loss_chunk=args.loss_chunk, ckpt_path=resume).global_step

        if args.snapshot and cuda:
            row["peak_breakdown"] = peak_breakdown(fit)
            print(row["peak_breakdown"], flush=True)
        else:
            fit()
        row["resumed_from_step"] = None if resume is None else row["global_step"] - len(times)
    finally:  # the plan is known before the first step, also when a step runs out of memory
        plan = strategy.memory_plan
        if plan is not None:
            est = plan.estimate
            row.update(plan={k: getattr(plan.options, k) for k in ("activation_checkpointing", "offload_checkpoints", "head_chunks",
                                                                   "mlp_chunk_size", "offload_params", "bf16_adapters")},
                       estimate_host_gb=est.host / 1e9, estimate_gb=est.total / 1e9, estimate_allocated_gb=est.allocated / 1e9,
                       estimate_terms_gb={k: v / 1e9 for k, v in est.terms().items()})
        row.update(peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
                   peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9 if cuda else 0.0)
    row.update(step_time_s=times[-1], tokens_per_s=seq / times[-1], losses=losses,
               measured_over_estimate=row["peak_mem_gb"] / row["estimate_allocated_gb"] if row.get("estimate_allocated_gb") else None,
               model_states_gb=kept["start"] / 1e9, kept_gb=(kept["backward"] - kept["start"]) / 1e9,
               kept_bytes_per_token_per_layer=(kept["backward"] - kept["start"]) / (seq * config.num_hidden_layers))


def memory(args) -> None:
    start, failed, cuda = time.monotonic(), None, torch.cuda.is_available()
    device, total = (torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / 1e9) if cuda else ("cpu", 0.0)
    name = f"hf-{args.model}-shaped" + (f"-lora{args.lora}" if args.lora else "")
    for seq in (int(s) for s in args.seqs.split(",")):
        row = dict(bench="memory_plan", system=args.system, model=name, seq=seq, gpus=1, device=device, device_memory_gb=total,
                   precision="bf16-true", lora_rank=args.lora, steps=args.steps, loss_chunk_size=args.loss_chunk if args.system == "seqpar" else None,
                   torch=torch.__version__, commit=args.commit, **({"memory": "manual"} if args.memory == "manual" else {}))
        if failed is not None:
            row.update(error=f"skipped: {failed} did not fit")
        elif time.monotonic() - start > 60 * args.max_minutes:
            row.update(error=f"skipped: --max-minutes {args.max_minutes} passed")
        else:
            try:
                if args.system == "seqpar":
                    row.update(plan_seq=args.plan_seq, options=_options(args.options))
                    run_memory(args, seq, row)
                else:
                    lora = {"r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": "all-linear"} if args.lora else None
                    run_plain(_config(MEMORY_SHAPES[args.model]), seq, row, lora=lora, steps=args.steps, bf16=True, autocast=False, fused=False,
                              checkpointing={"use_reentrant": False}, last=True)
            except Exception as error:  # noqa: BLE001 - an OOM or the planner's refusal is a result: record it, go on
                row.update(error=error_text(error, 600), oom=isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error))
                failed = seq
        print(f"[hf] memory {args.system} {name} S={seq}: " + ", ".join(f"{k}={row[k]}" for k in ("plan", "estimate_allocated_gb", "peak_mem_gb",
              "peak_reserved_gb", "tokens_per_s", "error") if k in row), flush=True)
        record_and_release(args.out, row)


def peak_breakdown(fn, max_entries: int = 400_000, top: int = 25) -> str:
    """Run ``fn`` with the CUDA allocator's history recorded; replay its trace: the peak of (alloc - free_completed)
    and what is alive then, grouped by the package / transformers / peft source line that allocated it (how Note
    [Memory per token] was calibrated against what really stays alive)."""
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        fn()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)

    def where(frames: list[dict], depth: int = 3) -> str:  # the innermost frames of ours / transformers / peft, else any
        keep = [f for f in frames if any(k in f.get("filename", "") for k in ("lightning_seqpar", "transformers", "peft", "benchmarks"))] or frames
        return " < ".join(f"{f['filename'].split('site-packages/')[-1].split('/work/')[-1]}:{f['line']}({f['name']})" for f in keep[:depth])

    live: dict[int, tuple[int, str]] = {}
    cur = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}
    peak_index = -1
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames", [])))
            cur += ev["size"]
            if cur > peak:
                peak, peak_index, peak_live = cur, i, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, at in peak_live.values():
        groups[at][0] += size
        groups[at][1] += 1
    lines = [f"peak of the traced allocations {peak / 1e9:.2f} GB at event {peak_index} of {len(trace)} "
             f"(allocated before tracing not included); largest groups alive then:"]
    for at, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        sizes = "" if at else " sizes GB: " + ", ".join(f"{b / 1e9:.2f}" for b, w in sorted(peak_live.values(), reverse=True) if not w)
        lines.append(f"  {size / 1e9:8.2f} GB  {count:5d} x  {at or '(allocated outside Python: autograd)'}{sizes}")
    lines.append("the allocation that made the peak: " + where((trace[peak_index] if peak_index >= 0 else {}).get("frames", []), depth=6))
    return "\n".join(lines)


# ---- main -----------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    mode, argv = mode_of(argv, "hf")
    ap = runner_args(argparse.ArgumentParser(prog=f"benchmarks/hf.py {mode}", description=__doc__.split("\n\n")[0]))
    add = ap.add_argument
    if mode in ("families", "finetune"):
        add("--seq", type=int, default=32768 if mode == "families" else 131072, help="tokens per sequence (one per step, split over the GPUs)")
        add("--steps", type=int, default=3, help="timed steps (the median is recorded)")
        add("--warmup", type=int, default=1, help="untimed steps first (the peak memory counts from the end of these)")
        add("--algorithm", default="auto" if mode == "families" else "ring", help="the strategy's attention= ('auto': the cost model's)")
        add("--loss-chunk", type=int, default=4096 if mode == "families" else 8192, help="CausalLMModule(loss_chunk_size=)")
    if mode == "families":
        add("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
        add("--systems", default="seqpar,transformers", help="seqpar, transformers (one GPU only)")
        add("--docs", type=int, default=0, help="pack this many equal documents into each sequence (document_ids; ours only)")
        add("--attention-backend", default="auto", help="the strategy's attention_backend= (auto, cudnn, flash, fa4, ...)")
        add("--activation-checkpointing", default=None, help="the strategy's activation_checkpointing= ('none': None); default: its default")
        add("--memory", default=None, help="the strategy's memory= ('auto': the planner); default: its default")
        add("--timeout", type=float, default=600.0, help="seconds a collective may wait (process group and strategy)")
        add("--profile", default=None, metavar="DIR", help="profile our first timed step (benchmarks/profile_summary.py)")
    elif mode == "finetune":
        add("--model", default="hf-llama3-8b", choices=["hf-llama3-8b"], help="the llama3-8b shape (a tiny one on --device cpu)")
        add("--documents", action="store_true", help="packed documents of random lengths (document masking)")
        add("--mean-doc", type=int, default=16384)
    else:
        add("--seqs", default="32768,131072,262144", help="sequence lengths, shortest first")
        add("--model", default="llama-3.2-1b", choices=sorted(MEMORY_SHAPES))
        add("--max-minutes", type=float, default=25.0, help="lengths not started by then are recorded as skipped")
        add("--memory", default="auto", choices=("auto", "manual"), help="the strategy's memory= (manual: --options only)")
        add("--lora", type=int, default=0, help="LoRA rank on every linear layer (0: full fine-tune)")
        add("--system", default="seqpar", choices=("seqpar", "transformers"))
        add("--ckpt-dir", default=None, help="resume from DIR/last.ckpt if it exists; write it when stopping early")
        add("--stop-after", type=int, default=None, help="steps in this process (with --ckpt-dir)")
        add("--plan-seq", type=int, default=None, help="plan for this length instead (a quick check of a long plan)")
        add("--options", default="", help="strategy options by hand, e.g. head_chunks=8,offload_params=true")
        add("--snapshot", action="store_true", help="the breakdown of the peak (the allocator's history)")
        add("--steps", type=int, default=2)
        add("--loss-chunk", type=int, default=8192)
    args = ap.parse_args(argv)
    if mode == "families":
        args.shapes, args.systems = [s for s in args.shapes.split(",") if s], [s for s in args.systems.split(",") if s]
        unknown = [s for s in args.shapes if s not in SHAPES] + [s for s in args.systems if s not in ("seqpar", "transformers")]
        if unknown:
            ap.error(f"unknown shape or system {unknown}; shapes: {', '.join(SHAPES)}; systems: seqpar, transformers")
    if getattr(args, "warmup", 0) < 0 or getattr(args, "steps", 1) < 1:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    {"families": families, "finetune": finetune, "memory": memory}[mode](args)


if __name__ == "__main__":
    main()

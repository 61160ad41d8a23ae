"""Hugging Face models (transformers, peft; random init) under SequenceParallelStrategy against plain transformers:
one runner, a mode per question (its first argument; ``families`` when none is given).

    PYTHONPATH=$PWD python benchmarks/hf.py families --seq 32768 --out benchmarks/results/DATE-DEVICE-hf-families.json
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nproc_per_node=4 benchmarks/hf.py families --seq 131072 --out f.json
    torchrun --nproc_per_node=4 benchmarks/hf.py finetune --seq 131072 --documents --out hf.json
    PYTHONPATH=$PWD python benchmarks/hf.py memory --seqs 32768,131072,262144 --out benchmarks/results/DATE-DEVICE-memory-plan.json
    PYTHONPATH=$PWD python benchmarks/hf.py memory --model llama-3-8b --lora 16 --system transformers --seqs 32768,65536
    PYTHONPATH=$PWD python benchmarks/hf.py memory --memory manual --options offload_checkpoints=true --loss-chunk 4096 --seqs 65536

families  SHAPES a few steps at --seq: ours (``SequenceParallelStrategy`` over WORLD_SIZE GPUs, ``CausalLMModule``, "bf16-mixed";
          LoRA "bf16-true" with ``bf16_adapters``) and, on one GPU, plain transformers (fp32 weights under bf16 autocast,
          fused AdamW, gradient checkpointing, its own loss); MFU from :func:`model_flops`. Records "hf_family" (one GPU) or
          "hf-families" (torchrun); a shape that fails is recorded with its error and the next one runs.
finetune  ``transformers.LlamaForCausalLM`` of llama3-8b's shape over the GPUs, random tokens in packed documents of
          exponential lengths (mean --mean-doc): bench "train", MFU of 6 N_non-embedding + 6 L d sum(len_i^2) / S.
memory    One GPU (issue #22): ``memory="auto"`` (``--memory manual``: --options only), "bf16-true": the planner's options
          and estimate against the measured peak, what the last step keeps for its backward (Note [Memory per token]);
          or --system transformers (+ peft): bf16 weights, SDPA, non-reentrant checkpointing. Shortest length first; once
          one does not fit, the longer ones are skipped. A step longer than a 10-minute run: ``--ckpt-dir DIR
          --stop-after 1`` saves after this run's step and the next run resumes (stop a run with ``timeout -s KILL``);
          or ``--layers N``, the same width with N layers, and the planner's estimate for the full depth (Note [The
          longest by memory]). A length that exhausts the host's memory is recorded as "host out of memory" and ends
          the process with exit code 4 (Note [The host-memory watchdog] in benchmarks/driver.py).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import resource
import sys
import time
import traceback
from dataclasses import asdict, replace

import lightning as L
import torch
import torch.distributed as dist

from lightning_seqpar import CausalLMModule, SequenceParallelStrategy
from lightning_seqpar.attention.local import auto_backends_run, fa4_interface
from lightning_seqpar.models.fused import fused_kernels_on
from lightning_seqpar.parallel.config import MEMORY_OPTIONS
from lightning_seqpar.planner.memory import DEFAULT_MARGIN, MemoryOptions, MemoryPlanError, estimate_memory, plan_memory
from lightning_seqpar.planner.planning import device_memory_bytes, host_memory_bytes, model_shape_of
from lightning_seqpar.planner.step_plan import all_linear_lora

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from driver import (PEAK_BF16, HostMemoryWatchdog, append_records, error_text, held_gb, host_oom_exit, is_oom,  # noqa: E402
                    max_over_ranks, mode_of, record_and_release, runner_args, step_timer, trainer)
from profile_summary import profiler_callback  # noqa: E402

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
LORA: dict[str, dict] = {"llama3-8b-lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}}  # CausalLMModule(lora=...)
TINY: dict[str, dict] = {  # --device cpu: each shape shrunk, its layer pattern kept (windows below the smoke test's --seq)
    "gemma3": dict(_TINY, query_pre_attn_scalar=16, sliding_window=32),
    "gpt-oss": dict(_TINY, intermediate_size=32, sliding_window=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    "qwen3-next": dict(_TINY, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       num_hidden_layers=4),
    "llama3-8b-lora": dict(_TINY, num_hidden_layers=2), "llama3.2-1b": dict(_TINY, num_hidden_layers=2),
}
MEMORY_SHAPES = {"llama-3.2-1b": dict(LLAMA3_1B, rope_theta=500000.0, max_position_embeddings=1 << 21, rms_norm_eps=1e-5),
                 "llama-3-8b": dict(LLAMA3_8B, head_dim=128, max_position_embeddings=1 << 21), "tiny": TINY_LLAMA}  # tiny: CPU smoke runs
AGREE_TIMEOUT_S = 120  # how long a rank waits for the others to say how a shape ended (one that does not answer waits for a failed one)


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

    return AutoConfig.for_model(spec["model_type"], **{k: v for k, v in spec.items() if k != "model_type"})


def _mean_keys(seq: int, window: int | None) -> float:
    """The mean number of keys a query attends to over ``seq`` causal positions: S / 2 without a window, mean over p
    of min(p + 1, window) with one (transformers' window: query i sees keys i - window < j <= i)."""
    if window is None or window >= seq:
        return seq / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


def model_flops(config, seq: int, lora: dict | None = None) -> dict:
    """Model FLOPs per trained token (forward + backward) of ``config`` at ``seq`` tokens, and their parts, counted on
    the model built on the meta device: 6 x the parameters a token runs through but the input embedding (the head
    counts, also tied; of an MoE layer only the top-k experts); 12 x S_eff x heads x head_dim per softmax layer, S_eff
    the mean keys a query sees (:func:`_mean_keys`; recomputation, sinks and the delta-rule state update not counted);
    LoRA: the frozen base gets no weight gradient, 4 x N_base + 6 x N_adapters + the attention term."""
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
    fit = trainer(strategy, steps=steps, precision=precision, callbacks=callbacks, cuda=cuda)
    module = CausalLMModule(model=config, lora=lora, lr=1e-5, warmup_steps=warmup_steps, weight_decay=0.0, loss_chunk_size=_loss_chunk(loss_chunk))
    fit.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=1), ckpt_path=ckpt_path)
    return fit


def _loss_chunk(n: int):
    """--loss-chunk: 0 the full logits, a negative number the module's default ("auto"), else tokens per piece."""
    return "auto" if n < 0 else (n or None)


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

class Agreement(L.Callback):
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

    def on_exception(self, trainer, pl_module, exception) -> None:
        self(error_text(exception))


def run_ours(args, shape: str, world: int, callbacks: list) -> dict:
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
        callbacks = [*callbacks, profiler_callback(argparse.Namespace(**vars(args), system="seqpar", model="hf", tag="", profile_trace=False))]
    _fit(config, data, strategy, steps=args.warmup + args.steps, precision=_precision(args, shape), cuda=args.device == "cuda", lora=lora,
         callbacks=[step_timer(times, losses, warmup=args.warmup, cuda=args.device == "cuda"), *callbacks], loss_chunk=args.loss_chunk)
    dims = strategy.parallel_dims  # what "auto" chose, named as benchmarks/train.py names it
    algorithm = f"2d:{dims.hp}x{dims.cp}" if strategy.attention == "2d" else strategy.attention
    kernel = args.attention_backend if args.attention_backend != "auto" else ",".join(auto_backends_run()) or None
    return dict(step_time_s=sorted(times)[len(times) // 2], losses=losses, algorithm=algorithm, attn="seqpar", kernel=kernel)


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
                loss_chunk_size=_loss_chunk(args.loss_chunk) if ours else None,
                lora=LORA.get(shape), warmup=args.warmup, steps=args.steps, config=spec,
                **({"lanes": int(os.environ["SEQPAR_LANES"])} if os.environ.get("SEQPAR_LANES") else {}),  # benchmarks/lanes.sh
                **({"fa4_installed": fa4_interface() is not None, "fused_kernels": fused_kernels_on()} if ours and args.device == "cuda" else {}),
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
                callbacks = [agreement]
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


PLAN_KEYS = ("activation_checkpointing", "offload_checkpoints", "head_chunks", "mlp_chunk_size", "offload_params", "bf16_adapters")
"""The planner's options a record's ``plan`` names."""


def _memory_spec(args) -> dict:
    """The config fields of ``--model``, with ``--layers N`` its width at N layers."""
    spec = dict(MEMORY_SHAPES[args.model])
    return spec if args.layers is None else dict(spec, num_hidden_layers=args.layers)


# Note [The longest by memory]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# At the longest lengths a full-depth step takes longer than one 10-minute run. ``--layers N`` trains the same width
# with N layers at that length: its peak and what each layer keeps (``kept_bytes_per_token_per_layer``) are measured,
# and the record adds the planner's estimate for the full depth (the shape's own ``num_hidden_layers``) at the same
# length, precision, loss chunk and LoRA, with the options this run ran with (``full_depth_estimate_gb`` /
# ``_allocated_gb`` / ``_host_gb``, and whether they fit the planner's budget of the device and of the host's
# MemAvailable when the run began, ``full_depth_fits``), and what the planner itself picks for the full depth there
# (``full_depth_plan``: its options, or its refusal in ``full_depth_refusal`` with the longest length it would fit).
# The estimate is the package's (``estimate_memory`` / ``plan_memory``) with the inputs the strategy gave it for the
# N-layer run: the N-layer shape as the strategy read it (``model_shape_of``) with the full depth's layer count, LoRA
# as ``seqpar memory`` counts ``target_modules="all-linear"``. ``full_depth_inputs_match`` checks those inputs: the
# same call for N layers gives the strategy's own estimate (checked where the strategy planned, on a CUDA device).
# The planner plans the N-layer run for N layers (4 Llama-3-8B layers at 256K need no offload_params; 32 do), so to
# check its full-depth plan give the N-layer run that plan's options (``--options offload_checkpoints=true,
# offload_params=true``, from ``full_depth_plan`` or ``seqpar memory``): fixed, they are the options of both estimates.


def _changes(options: MemoryOptions) -> dict:
    """The fields of a ``MemoryOptions`` that differ from its defaults ({}: the defaults)."""
    defaults = asdict(type(options)())
    return {k: v for k, v in asdict(options).items() if v != defaults[k]}


def full_depth(args, strategy, seq: int, host_memory: float) -> dict:
    """``--layers N`` (Note [The longest by memory]): the planner's estimate and choice for the full-depth model after an
    N-layer run under ``strategy``; ``host_memory``: MemAvailable when the run began (what the strategy planned with)."""
    module, plan = strategy.lightning_module, strategy.memory_plan
    shape = model_shape_of(module, owner="hf.py memory")  # the N-layer shape the strategy planned for
    full = replace(shape, num_layers=MEMORY_SHAPES[args.model]["num_hidden_layers"])
    options = plan.options if plan is not None else MemoryOptions(**{n: getattr(strategy.config, n) for n in MEMORY_OPTIONS})
    attention = plan.attention if plan is not None and plan.attention else strategy.config.initial_attention

    def common(shape) -> dict:
        trainable, targets = all_linear_lora(shape, args.lora)
        return dict(model_shape=shape, seq_len=args.plan_seq or seq, precision=args.precision, batch_size=1,
                    loss_chunk_size=module.loss_chunk_size, trainable_params=trainable, lora_targets=targets, attention=attention)

    est = estimate_memory(options=options, **common(full))
    device_memory = plan.device_memory if plan is not None else (
        device_memory_bytes(torch.device("cuda")) if torch.cuda.is_available() else None)
    row = dict(full_depth_layers=full.num_layers, full_depth_options=_changes(options), full_depth_estimate_gb=est.total / 1e9,
               full_depth_estimate_allocated_gb=est.allocated / 1e9, full_depth_estimate_host_gb=est.host / 1e9,
               full_depth_host_memory_gb=host_memory / 1e9, full_depth_plan=None,
               full_depth_inputs_match=None if plan is None else estimate_memory(options=options, **common(shape)) == plan.estimate)
    if device_memory is None:
        return dict(row, full_depth_refusal="not planned: no CUDA device")
    budget = 1 - DEFAULT_MARGIN  # plan_memory's
    row["full_depth_fits"] = {"device": est.total <= budget * device_memory, "host": est.host <= budget * host_memory}
    fixed = {k: v for k, v in _options(args.options).items() if k in MEMORY_OPTIONS}  # the strategy's: those given
    try:
        chosen = plan_memory(device_memory=device_memory, host_memory=host_memory, fixed=fixed, owner="hf.py memory",
                             **common(full))
        row.update(full_depth_plan=_changes(chosen.options), full_depth_plan_estimate_gb=chosen.estimate.total / 1e9,
                   full_depth_plan_host_gb=chosen.estimate.host / 1e9)
    except MemoryPlanError as error:
        row.update(full_depth_refusal=str(error), full_depth_longest_seq=error.longest_seq_len)
    return row


def run_memory(args, seq: int, row: dict) -> None:
    """Ours with memory="auto": ``args.steps`` steps at ``seq`` tokens; fills ``row`` (the plan first, so that it is kept
    when a step fails). ``--ckpt-dir``: resume from DIR/last.ckpt when it exists and, with ``--stop-after n``, stop
    after n steps in this process and write it there. ``--plan-seq``: the planner's length when it differs from
    ``seq``; ``--options``: strategy options by hand (the planner plans the rest); ``--snapshot DIR``: the CUDA allocator's
    history (every allocation alive at the peak with its Python stack: how Note [Memory per token] was checked)."""
    cuda = torch.cuda.is_available()
    config = _config(_memory_spec(args))
    times, losses, kept = [], [], {}
    host_memory = host_memory_bytes()  # MemAvailable as the strategy plans with it (--layers: the full depth's plan too)

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
    if args.snapshot and cuda:  # every allocation with its Python stack; open the file in https://pytorch.org/memory_viz
        torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
    try:
        row["global_step"] = _fit(config, data, strategy, steps=args.steps, precision=args.precision, callbacks=[StopAfter()], cuda=cuda,
                                  lora=lora, loss_chunk=args.loss_chunk, ckpt_path=resume).global_step
        row["resumed_from_step"] = None if resume is None else row["global_step"] - len(times)
    finally:  # the plan is known before the first step, also when a step runs out of memory
        if args.snapshot and cuda:
            os.makedirs(args.snapshot, exist_ok=True)
            torch.cuda.memory._dump_snapshot(os.path.join(args.snapshot, f"memory-{seq}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        plan = strategy.memory_plan
        if plan is not None:
            est = plan.estimate
            row.update(plan={k: getattr(plan.options, k) for k in PLAN_KEYS},
                       estimate_host_gb=est.host / 1e9, estimate_gb=est.total / 1e9, estimate_allocated_gb=est.allocated / 1e9,
                       estimate_terms_gb={k: v / 1e9 for k, v in est.terms().items()})
        if args.layers is not None and strategy.lightning_module is not None:
            try:
                row.update(full_depth(args, strategy, seq, host_memory))
            except Exception as error:  # noqa: BLE001 - recorded; never in place of the step's own error
                row.update(full_depth_error=error_text(error, 600))
        row.update(peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9 if cuda else 0.0,
                   peak_reserved_gb=torch.cuda.max_memory_reserved() / 1e9 if cuda else 0.0,
                   host_maxrss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    row.update(step_time_s=times[-1], tokens_per_s=seq / times[-1], losses=losses,
               measured_over_estimate=row["peak_mem_gb"] / row["estimate_allocated_gb"] if row.get("estimate_allocated_gb") else None,
               model_states_gb=kept["start"] / 1e9, kept_gb=(kept["backward"] - kept["start"]) / 1e9,
               kept_bytes_per_token_per_layer=(kept["backward"] - kept["start"]) / (seq * config.num_hidden_layers))


def memory(args) -> None:
    start, failed, cuda = time.monotonic(), None, torch.cuda.is_available()
    device, total = (torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / 1e9) if cuda else ("cpu", 0.0)
    name = f"hf-{args.model}-shaped" + (f"-lora{args.lora}" if args.lora else "") + (f"-{args.layers}-layers" if args.layers else "")
    layers = _memory_spec(args)["num_hidden_layers"]

    def say(row: dict) -> None:
        print(f"[hf] memory {args.system} {name} S={row['seq']}: " + ", ".join(f"{k}={row[k]}" for k in (
              "plan", "estimate_allocated_gb", "full_depth_estimate_gb", "peak_mem_gb", "peak_reserved_gb", "tokens_per_s", "error")
              if k in row), flush=True)

    for seq in (int(s) for s in args.seqs.split(",")):
        row = dict(bench="memory_plan", system=args.system, model=name, seq=seq, layers=layers, gpus=1, device=device, device_memory_gb=total,
                   precision=args.precision, lora_rank=args.lora, steps=args.steps, loss_chunk_size=args.loss_chunk if args.system == "seqpar" else None,
                   torch=torch.__version__, commit=args.commit, **({"memory": "manual"} if args.memory == "manual" else {}))
        if failed is not None:
            row.update(error=f"skipped: {failed} did not fit")
        elif time.monotonic() - start > 60 * args.max_minutes:
            row.update(error=f"skipped: --max-minutes {args.max_minutes} passed")
        else:
            try:  # a host out of memory leaves this row, not a SIGKILL (Note [The host-memory watchdog] in driver.py)
                with HostMemoryWatchdog(host_oom_exit(row, args.out, say=say)):
                    if args.system == "seqpar":
                        row.update(plan_seq=args.plan_seq, options=_options(args.options))
                        run_memory(args, seq, row)
                    else:
                        lora = {"r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": "all-linear"} if args.lora else None
                        run_plain(_config(_memory_spec(args)), seq, row, lora=lora, steps=args.steps, bf16=True, autocast=False,
                                  fused=False, checkpointing={"use_reentrant": False}, last=True)
            except Exception as error:  # noqa: BLE001 - an OOM or the planner's refusal is a result: record it, go on
                row.update(error=error_text(error, 600), oom=isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error))
                failed = seq
        say(row)
        record_and_release(args.out, row)


# ---- main -----------------------------------------------------------------------------------------------------

OPTIONS: dict[str, dict] = {  # each mode's options and defaults (True / False: a switch). families: --shapes of SHAPES; --docs:
    # equal packed documents (ours); --algorithm, --attention-backend, --activation-checkpointing ("none": None), --memory: the
    # strategy's (None: its default); --timeout: seconds a collective may wait; --profile DIR: our first timed step; --loss-chunk: 0 the full
    # logits, -1 CausalLMModule's default ("auto")
    "families": dict(seq=32768, steps=3, warmup=1, algorithm="auto", loss_chunk=4096, shapes=",".join(SHAPES), systems="seqpar,transformers",
                     docs=0, attention_backend="auto", activation_checkpointing=None, memory=None, timeout=600.0, profile=None),
    "finetune": dict(seq=131072, steps=3, warmup=1, algorithm="ring", loss_chunk=8192, model="hf-llama3-8b", documents=False, mean_doc=16384),
    # memory: --lora R: rank R on every linear layer (0: full fine-tune); --plan-seq: plan for this length instead; --options
    # "head_chunks=8,offload_params=true"; --snapshot DIR: the CUDA allocator's history (https://pytorch.org/memory_viz); --layers N:
    # the model's width with N layers, and the planner's estimate for its full depth (Note [The longest by memory])
    "memory": dict(seqs="32768,131072,262144", model="llama-3.2-1b", max_minutes=25.0, memory="auto", lora=0, system="seqpar", ckpt_dir=None,
                   stop_after=None, plan_seq=None, options="", snapshot=None, steps=2, loss_chunk=8192, precision="bf16-true", layers=None),
}
_INTS = ("stop_after", "plan_seq", "layers")


def main(argv: list[str] | None = None) -> None:
    mode, argv = mode_of(argv, "hf")
    ap = runner_args(argparse.ArgumentParser(prog=f"benchmarks/hf.py {mode}", description=__doc__.split("\n\n")[0]))
    for name, default in OPTIONS[mode].items():
        kind = int if name in _INTS else str if default is None else type(default)
        ap.add_argument("--" + name.replace("_", "-"), **({"action": "store_true"} if kind is bool else {"type": kind, "default": default}))
    args = ap.parse_args(argv)
    if mode == "families":
        args.shapes, args.systems = [s for s in args.shapes.split(",") if s], [s for s in args.systems.split(",") if s]
        unknown = [s for s in args.shapes if s not in SHAPES] + [s for s in args.systems if s not in ("seqpar", "transformers")]
        if unknown:
            ap.error(f"unknown shape or system {unknown}; shapes: {', '.join(SHAPES)}; systems: seqpar, transformers")
    if args.steps < 1 or getattr(args, "warmup", 0) < 0 or mode == "memory" and args.model not in MEMORY_SHAPES:
        ap.error(f"--steps must be >= 1, --warmup >= 0 and --model one of {', '.join(MEMORY_SHAPES)}")
    if getattr(args, "layers", None) is not None and args.layers < 1:
        ap.error(f"--layers must be a positive number of decoder layers, got {args.layers}")
    {"families": families, "finetune": finetune, "memory": memory}[mode](args)


if __name__ == "__main__":
    main()

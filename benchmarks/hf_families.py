"""Long-context Hugging Face model families under SequenceParallelStrategy: a Gemma-3-shaped, a gpt-oss-shaped
and a Qwen3-Next-shaped hybrid model, and LoRA on the Llama-3-8B shape (random init), trained a few steps at
--seq tokens (issues #21, #23, #26; with fla-core installed, the Qwen3-Next rows use its gated DeltaNet kernel).

One GPU (a plain ``python`` launch): ours against plain transformers on the same GPU.

    PYTHONPATH=$PWD python benchmarks/hf_families.py --seq 32768 --out benchmarks/results/DATE-DEVICE-hf-families.json

Several GPUs (torchrun, issue #26 item 3): one sequence of --seq tokens split over all GPUs; ours only.

    PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nproc_per_node=4 \\
        benchmarks/hf_families.py --seq 131072 --out hf-families-4gpu.json

ours   ``Trainer(strategy=SequenceParallelStrategy(sequence_parallel_size=WORLD_SIZE, attention=--algorithm),
       devices=WORLD_SIZE)`` + ``CausalLMModule(<the model config>, loss_chunk_size=4096)``: the package's
       attention with the layers' sliding windows (Gemma 3: 5 local : 1 global, window 1024; gpt-oss:
       alternating, window 128), sinks (gpt-oss), the gated DeltaNet layers passed state rank to rank
       (Qwen3-Next), the chunked loss, its default checkpointing (selective++), FSDP2 over the ranks.
       Precision "bf16-mixed" (fp32 master weights, AdamW); the LoRA shape ``CausalLMModule(...,
       lora={"r": 16, "lora_alpha": 32, "target_modules": "all-linear"})`` under "bf16-true" with
       ``bf16_adapters=True`` (the frozen base in bf16, the adapters and their AdamW state fp32, gathered
       in bf16: the configuration docs/hf_finetune.md and recipes/lora_finetune.yaml describe).
plain  one GPU only: the same transformers model, unmodified: fp32 weights (bf16 base + peft's fp32 adapters
       for the LoRA shape), ``torch.autocast(bf16)``, AdamW, gradient checkpointing on (what a user does at
       long context), the first of ``sdpa``, ``flex_attention``, ``eager`` that the model accepts; full
       logits and transformers' own loss. Under torchrun it is skipped (a printed line says so): plain
       transformers cannot split one sequence over GPUs, every GPU would hold all --seq tokens.
Both: median step time after --warmup steps, peak allocated memory after the warm-up (max over ranks),
tokens/s/GPU = --seq / step time / GPUs, and

    MFU = tokens/s/GPU x FLOPs per token / 989e12 (H100/H200 SXM dense bf16, as benchmarks/train.py)

with model FLOPs per token (forward + backward; recomputation by checkpointing not counted), :func:`model_flops`:

* 6 x N: N the parameters every token runs through except the input embedding table (a lookup), as
  ``LlamaConfig.flops_per_token`` in benchmarks/train.py counts them: the output head counts (also when tied
  to the embedding: it is still a V x d matmul); of an MoE layer's experts only the top-k a token uses
  (gpt-oss: 4 of 8); the gated DeltaNet layers count their projections and convolution only: the chunked
  delta-rule state update (O(d_k d_v) per token and head) is left out.
* attention: 12 x S_eff x n_heads x head_dim per softmax-attention layer, S_eff the mean number of keys a
  query sees: S / 2 for a full causal layer (= train.py's 6 x S x d per layer), mean over positions p of
  min(p + 1, window) for a sliding layer (transformers' window: query i sees keys i - window < j <= i).
  Sinks (one logit per head) are left out.
* LoRA (flops_convention in the record): the frozen base gets no weight gradient, so 4 x N_base (forward 2,
  input gradient 2) + 6 x N_adapters (r x (in + out) per adapted linear layer) + the attention term.

Records: one per shape and system; bench "hf_family" on one GPU (the docs table ``hf-family``), "hf-families"
under torchrun. A shape that fails (``CUDA out of memory``, a refusal) is recorded with its error and the next
shape runs. Under torchrun every rank first tells the others whether its run failed (one exchange over a gloo
group, before Lightning tears the run down): when all answer, rank 0 records the error and all go on;
when a rank does not answer within AGREE_TIMEOUT_S (it waits in a collective for the rank that failed), the
failed rank prints the error (rank 0 also records it) and exits with code 1, and torchrun stops the others.
--device cpu: a smoke test on CPU (gloo) with every shape shrunk to a width of 64 and a vocabulary of 256,
its layer pattern (windows, sinks, experts, DeltaNet layers, LoRA) kept.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collect import append_records, error_text, record_and_release  # noqa: E402
from hf_finetune import LLAMA3_8B  # noqa: E402
from train import PEAK_BF16, _is_oom, _peak_gb, _release, _step_timer, _trainer  # noqa: E402

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
    # Llama-3-8B's shape (benchmarks/hf_finetune.py: 4096 / 32 layers / 32 / 8 heads of 128 / FFN 14336 / vocab
    # 128256, rope_theta 500000, untied head), all 32 layers, LoRA (LORA below) on every linear layer
    "llama3-8b-lora": dict(LLAMA3_8B),
    # Llama-3.2-1B's shape (2048 / 16 layers / 32 / 8 heads of 64 / FFN 8192 / vocab 128256, tied head, its llama3
    # rope scaling): a full-rotary model, the first hour of a new user on one GPU (issue #43)
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, attention_dropout=0.0,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}
LORA: dict[str, dict] = {"llama3-8b-lora": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear"}}
"""The shapes trained with LoRA (``CausalLMModule(lora=...)``), with their peft.LoraConfig fields."""

_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256)
TINY: dict[str, dict] = {
    "gemma3": dict(_TINY, query_pre_attn_scalar=16, sliding_window=32),  # 6 layers: 5 local, 1 global
    "gpt-oss": dict(_TINY, intermediate_size=32, sliding_window=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2),
    "qwen3-next": dict(_TINY, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                       num_hidden_layers=4),
    "llama3-8b-lora": dict(_TINY, num_hidden_layers=2),
    "llama3.2-1b": dict(_TINY, num_hidden_layers=2),
}
"""--device cpu: what each shape becomes (its layer pattern kept, windows below the smoke test's --seq)."""

AGREE_TIMEOUT_S = 120
"""Under torchrun: how long a rank waits for the others to say how their run of a shape ended (the
ranks leave a run within seconds of each other; one that does not answer waits in a collective for a
rank that failed)."""


def _spec(shape: str, *, tiny: bool = False, layers: int | None = None) -> dict:
    """The config fields of ``shape`` (TINY's on top with ``tiny``); ``layers`` sets num_hidden_layers, the
    layer pattern (layer_types) tiled to that many layers."""
    spec = dict(SHAPES[shape], **(TINY[shape] if tiny else {}))
    n = layers or spec["num_hidden_layers"]
    if n < 1:
        raise ValueError(f"--layers must be >= 1, got {n}")
    spec["num_hidden_layers"] = n
    if "layer_types" in spec:
        pattern = SHAPES[shape]["layer_types"]
        spec["layer_types"] = (pattern * math.ceil(n / len(pattern)))[:n]
    return spec


def _config(spec: dict):
    from transformers import AutoConfig

    spec = dict(spec)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def _mean_keys(seq: int, window: int | None) -> float:
    """The mean number of keys a query attends to over ``seq`` causal positions: S / 2 without a window (the
    causal discount of benchmarks/train.py), mean over p of min(p + 1, window) with one."""
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
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embedding
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    top_k = getattr(config, "num_experts_per_tok", None) or experts
    n = 0.0
    for name, p in model.named_parameters():  # a tied head is the embedding: named once, counted as the head
        if p is embedding and not tied:
            continue
        n += p.numel() * (top_k / experts if experts and ".experts." in name else 1.0)
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    width = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    attention = 0.0
    for kind in types:
        if kind == "full_attention":
            attention += 12 * width * _mean_keys(seq, None)
        elif kind == "sliding_attention":
            attention += 12 * width * _mean_keys(seq, config.sliding_window)
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


def _batches(vocab: int, seq: int, n: int):
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        ids = torch.randint(0, vocab, (1, seq), generator=g)
        yield ids


def _sample(ids: torch.Tensor, docs: int) -> dict:
    """One training sample of ids [S]; with ``docs`` > 0, that many equal packed documents (``document_ids``; the
    last token of each predicts nothing: its label is -100)."""
    labels = torch.cat([ids[1:], torch.tensor([-100])])
    if not docs:
        return {"input_ids": ids, "labels": labels}
    seq = ids.numel()
    lengths = [seq // docs] * (docs - 1) + [seq - seq // docs * (docs - 1)]
    document_ids = torch.repeat_interleave(torch.arange(docs), torch.tensor(lengths))
    labels[torch.cumsum(torch.tensor(lengths), 0) - 1] = -100
    return {"input_ids": ids, "labels": labels, "document_ids": document_ids}


def _precision(args, shape: str) -> str:
    if shape in LORA:
        return "bf16-true"  # the frozen base in bf16, fp32 adapters (with bf16_adapters: gathered in bf16)
    return "bf16-mixed" if args.device == "cuda" else "32-true"


class Agreement:
    """Under torchrun: one exchange per shape, over a gloo group with a timeout, of how each rank's run ended
    (None or its error), so that all ranks take the same path after a failure. A rank whose run raises inside
    ``trainer.fit`` exchanges in ``on_exception`` (before Lightning's teardown, which may wait on the device);
    the others after ``fit``. When the exchange times out or a peer is gone, this rank prints its error, rank 0
    also records it, and the process exits with code 1 (torchrun then stops the ranks left waiting)."""

    def __init__(self, group, on_abort) -> None:
        self.group, self.on_abort, self.result = group, on_abort, None

    def __call__(self, error: str | None) -> list[str | None]:
        if self.result is None:
            if self.group is None:
                self.result = [error]
            else:
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
    from lightning_seqpar import CausalLMModule, SequenceParallelStrategy

    config = _config(_spec(shape, tiny=args.device == "cpu", layers=args.layers))
    lora = LORA.get(shape)
    times: list[float] = []
    losses: list[float] = []
    data = [_sample(ids[0], args.docs) for ids in _batches(config.vocab_size, args.seq, args.warmup + args.steps)]
    extra = {} if args.activation_checkpointing is None else {"activation_checkpointing": None if args.activation_checkpointing == "none"
                                                                else args.activation_checkpointing}
    if args.memory is not None:
        extra["memory"] = args.memory
    strategy = SequenceParallelStrategy(sequence_parallel_size=world, attention=args.algorithm, attention_backend=args.attention_backend, **extra,
                                        expected_seq_len=args.seq if args.algorithm == "auto" else None,
                                        bf16_adapters=lora is not None, timeout=datetime.timedelta(seconds=args.timeout))
    trainer = _trainer(args, strategy, [_step_timer(args, times, losses), *callbacks], _precision(args, shape), oom_exit=False)
    module = CausalLMModule(model=config, lora=lora, lr=1e-5, warmup_steps=1, weight_decay=0.0, loss_chunk_size=args.loss_chunk)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=1))
    dims = strategy.parallel_dims  # what "auto" chose, named as benchmarks/train.py names it
    algorithm = f"2d:{dims.hp}x{dims.cp}" if strategy.attention == "2d" else strategy.attention
    return dict(step_time_s=sorted(times)[len(times) // 2], losses=losses, algorithm=algorithm, attn="seqpar")


def run_plain(args, shape: str) -> dict:
    """One GPU: the unmodified transformers model (+ peft for a LoRA shape)."""
    from transformers import AutoModelForCausalLM

    config = _config(_spec(shape, layers=args.layers))
    lora = LORA.get(shape)
    model = None
    for impl in ("sdpa", "flex_attention", "eager"):
        try:  # a LoRA shape: the base in bf16, as a user fine-tunes it
            model = AutoModelForCausalLM.from_config(config, attn_implementation=impl, **({"dtype": torch.bfloat16} if lora else {}))
            break
        except (ValueError, ImportError):
            continue
    model = model.cuda()
    model.gradient_checkpointing_enable()
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", **lora))  # adapters fp32 (peft's default)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.0, fused=True)
    times, losses = [], []
    for i, ids in enumerate(_batches(config.vocab_size, args.seq, args.warmup + args.steps)):
        ids = ids.cuda()
        torch.cuda.synchronize()
        if i == args.warmup:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return dict(step_time_s=sorted(times)[len(times) // 2], peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9, losses=losses,
                attn=model.config._attn_implementation)


def _measured(row: dict, got: dict, world: int) -> dict:
    tps = row["seq"] / got["step_time_s"] / world
    return dict(got, tokens_per_s_per_gpu=tps, mfu=tps * row["flops_per_token"] / PEAK_BF16)


def _line(row: dict) -> str:
    head = f"[hf_families] {row['shape']} {row['system']} S={row['seq']} GPUs={row['gpus']}"
    if row.get("error"):
        return f"{head}: {row['error']}"
    kernel = f", {row['attention_backend']}" if row.get("attention_backend") else ""
    return (f"{head} ({row.get('algorithm', row.get('attn'))}{kernel}): {row['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, MFU {row['mfu']:.3f}, "
            f"step {row['step_time_s']:.2f} s, peak {row['peak_mem_gb']:.1f} GB, losses {[round(x, 3) for x in row['losses']]}")


def _base_row(args, shape: str, system: str, world: int, bench: str) -> dict:
    spec = _spec(shape, tiny=args.device == "cpu", layers=args.layers)
    flops = model_flops(_config(spec), args.seq, LORA.get(shape))
    return dict(bench=bench, shape=shape, system=system, model=f"{shape}-shaped" + ("-tiny" if args.device == "cpu" else ""),
                seq=args.seq, gpus=world, documents=args.docs or None,
                state_passing=("chain" if os.environ.get("SEQPAR_STATE_CHAIN", "0") == "1" else "parallel") if system == "seqpar" else None,
                device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                torch=torch.__version__, commit=args.commit, algorithm=args.algorithm if system == "seqpar" else "transformers",
                attention_backend=args.attention_backend if system == "seqpar" else None,
                strategy_options={k: v for k, v in (("activation_checkpointing", args.activation_checkpointing), ("memory", args.memory))
                                  if v is not None} if system == "seqpar" else None,
                precision=_precision(args, shape) if system == "seqpar" else "autocast-bf16", lora=LORA.get(shape),
                warmup=args.warmup, steps=args.steps, config=spec,
                **({"auto": True} if system == "seqpar" and args.algorithm == "auto" else {}), **flops)


def main_one_gpu(args) -> None:
    """A plain launch: one device, ours and plain transformers (the one-GPU table of docs/benchmarks.md)."""
    for shape in args.shapes:
        for system in args.systems:
            row = _base_row(args, shape, system, 1, "hf_family")
            try:
                if system == "seqpar":
                    got = run_ours(args, shape, 1, [])
                    got["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else float("nan")
                elif args.device != "cuda":
                    print(f"[hf_families] {shape} transformers: skipped on --device cpu", flush=True)
                    continue
                else:
                    got = run_plain(args, shape)
                row.update(_measured(row, got, 1))
                row["tokens_per_s"] = args.seq / got["step_time_s"]  # the one-GPU table's column
            except Exception as error:  # noqa: BLE001 - record what did not run (OOM) and go on
                row.update(error=error_text(error))
            print(_line(row), flush=True)
            record_and_release(args.out, row)


def main_distributed(args, world: int) -> None:
    """Under torchrun: ours over all ranks, one shape after another in this process (the default group stays)."""
    cuda = args.device == "cuda"
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        torch.cuda.set_device(local_rank)
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout, device_id=torch.device("cuda", local_rank) if cuda else None)
    rank = dist.get_rank()
    agree_s = min(AGREE_TIMEOUT_S, args.timeout / 2)  # shorter than a collective's timeout: the failed rank exits first
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=agree_s))
    if rank == 0 and "transformers" in args.systems:
        print(f"[hf_families] transformers: skipped under torchrun (WORLD_SIZE={world}): plain transformers cannot split one "
              f"sequence over GPUs (each would hold all {args.seq} tokens); its one-GPU runs: a plain `python` launch", flush=True)
    for shape in args.shapes if "seqpar" in args.systems else []:
        held = _release(args)
        row = _base_row(args, shape, "seqpar", world, "hf-families")
        row["held_before_gb"] = held

        def abort(error: str | None, exc: BaseException, row=row) -> None:
            print(f"[hf_families] rank {rank}: {row['shape']} failed ({error}); the ranks did not all report within "
                  f"{agree_s:.0f} s ({type(exc).__name__}: {str(exc).strip()[:120]}): exiting, torchrun stops the rest", flush=True)
            if rank == 0 and error is not None:
                row.update(error=error, error_ranks=[0], aborted=True)
                if args.out:
                    append_records(args.out, row)

        agreement = Agreement(group, abort)
        got, error = None, None
        try:
            got = run_ours(args, shape, world, [agreement.callback()])
        except Exception as exc:  # noqa: BLE001 - a shape that fails (OOM) is a result: record it, go on
            error = error_text(exc)
            if not _is_oom(exc):
                traceback.print_exc()
        errors = agreement(error)
        failed = [r for r, e in enumerate(errors) if e is not None]
        if failed:
            row.update(error=errors[failed[0]], error_ranks=failed)
        else:
            row.update(_measured(row, got, world), peak_mem_gb=_peak_gb(args))
        if rank == 0:
            print(_line(row), flush=True)
            if args.out:
                append_records(args.out, row)
        del got, row
    _release(args)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=32768, help="tokens per sequence (one sequence per step, split over the GPUs)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (the median is recorded)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (the peak memory counts from the end of these)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--systems", default="seqpar,transformers", help="seqpar, transformers (one GPU only)")
    ap.add_argument("--layers", type=int, default=None, help="num_hidden_layers of every shape (the layer pattern tiled)")
    ap.add_argument("--docs", type=int, default=0, help="pack this many equal documents into each sequence (document_ids; "
                    "ours only): attention masked per document, recurrent states reset at each")
    ap.add_argument("--algorithm", default="auto", help="the strategy's attention= ('auto': the cost model's for --seq)")
    ap.add_argument("--loss-chunk", type=int, default=4096, help="CausalLMModule(loss_chunk_size=)")
    ap.add_argument("--attention-backend", default="auto", help="the strategy's attention_backend= (auto, cudnn, flash, fa4, ...)")
    ap.add_argument("--activation-checkpointing", default=None, help="the strategy's activation_checkpointing= ('none': None); default: its default")
    ap.add_argument("--memory", default=None, help="the strategy's memory= ('auto': the planner); default: its default")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait (process group and strategy)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test with tiny shapes (gloo)")
    ap.add_argument("--out", default=None, help="append the records to this JSON list (merge with benchmarks/collect.py)")
    ap.add_argument("--commit", default=os.environ.get("SEQPAR_COMMIT", "unknown"))
    ap.add_argument("--profile", default=None, metavar="DIR", help="profile our first timed step (benchmarks/train.py's profiler)")
    ap.set_defaults(prealloc_optimizer=False, system="seqpar", tag="", profile_trace=False, model="hf")  # train.py's _trainer reads them
    args = ap.parse_args()
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.shapes if s not in SHAPES] + [s for s in args.systems if s not in ("seqpar", "transformers")]
    if unknown:
        ap.error(f"unknown shape or system {unknown}; shapes: {', '.join(SHAPES)}; systems: seqpar, transformers")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        main_distributed(args, world)
    else:
        main_one_gpu(args)


if __name__ == "__main__":
    main()

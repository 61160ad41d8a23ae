"""TRL's SFTTrainer with the accelerate configs of TRL's long-context guide: context parallel (FSDP2 + cp_size,
``system="trl_cp"``) or DeepSpeed ALST / Ulysses (ZeRO-3 + sp_size, ``system="deepspeed_alst"``).

    accelerate launch --config_file benchmarks/peers/accelerate_cp.yaml --num_processes 4 \
        benchmarks/peers/trl_sft.py --system trl_cp --seq 131072 --out $OUT/peers.json
    accelerate launch --config_file benchmarks/peers/accelerate_alst.yaml --num_processes 4 \
        benchmarks/peers/trl_sft.py --system deepspeed_alst --seq 131072 --out $OUT/peers.json

The configs are TRL's ``examples/accelerate_configs/context_parallel_2gpu.yaml`` and ``alst_ulysses_4gpu.yaml``,
changed only in the GPU count (cp_size = sp_size = GPUs, dp_shard_size 1: the whole sequence split over every GPU,
as ours is) and, for ALST, ``sp_attn_implementation: sdpa`` (flash-attn 2 is not on the GPU image; TRL's guide names
SDPA as the fallback). The SFTConfig is the guide's: ``max_length`` = --seq, ``pad_to_multiple_of`` = 2 x cp (CP) or
sp (ALST), batch 1, bf16, the FSDP config's activation checkpointing for CP (``gradient_checkpointing=False``, as the
guide says) and ``gradient_checkpointing=True`` for ALST (the HF ALST guide), ``packing`` off (TRL refuses packing
with CP; the rows are already one sequence each), TRL 1.16's default loss (the fused LM head: log-probs in chunks,
never the full logits), ``--offload`` = ``activation_offloading=True`` (TRL's offload of saved activations to the
host). Model: the Qwen3-8B shape from its config (random init, bf16), SDPA attention. Data: random token rows of
exactly --seq tokens, already tokenized (a stub tokenizer gives the pad token). Note [One measurement for every
peer] in common.py.

Each peer at its best (issue #56), every setting from the peer's own docs or code of the version run (``SOURCES``,
also in each record's ``settings["sources"]``); a run with none of these flags is the as-published row:

* ``--liger``: ``SFTConfig(use_liger_kernel=True)`` (TRL's Liger integration page; accelerate's sequence-parallel
  guide: "Liger is highly recommended for long sequence lengths"). In TRL 1.16 it applies Liger's RMSNorm, RoPE and
  SwiGLU kernels only: ``SFTTrainer.__init__`` forces ``fused_linear_cross_entropy=False`` because Liger's fused
  loss would replace the model's forward, which TRL patches with its own fused LM head (``add_fused_lm_head``: the
  per-token log-probs in tiles, never the full logits -- the chunked loss, TRL's default whatever the flag). 1.16
  also warns the flag is deprecated for Hub kernels (``use_kernels``), which an offline machine cannot fetch. The
  run logs, from inside the process at the first step, which modules Liger patched and how many forwards took the
  fused LM head (``settings["liger"]``, ``settings["loss_path"]``); the profiled step's kernels name Liger's.
* ``--attn IMPL`` (``deepspeed_alst`` only): the attention ALST's core runs. accelerate 1.15's guide names
  ``flash_attention_2`` / ``flash_attention_3`` ("Flash Attention should be the ideal choice"). Neither can run on
  the GPU image: ``flash-attn`` (2) is an sdist on PyPI (no wheel for torch 2.11 + CUDA 13, a CUDA build longer
  than a GPU command's 10 minutes) and flash-attention 3 has no PyPI release; the Hub kernels
  (``kernels-community/...``) need the internet. What runs offline is ``flash_attention_4``: transformers 5.17's own
  attention for the ``flash-attn-4`` wheels (CuTe DSL, pure Python, carried as ours carries them), which DeepSpeed
  0.19.8's Ulysses wraps like any entry of ``ALL_ATTENTION_FUNCTIONS``. accelerate 1.15's config check lists only
  the names above, so for ``flash_attention_4`` the runner lets that one name through its check (recorded in the
  changes). ``trl_cp`` runs SDPA only: torch's context parallel works only with SDPA (accelerate's CP guide).
* packing: ``trl_cp`` cannot (TRL 1.16 raises "Packing is not compatible with context parallelism": CP drops the
  block-diagonal mask); for ``deepspeed_alst`` the rows are single documents of exactly --seq tokens, so packing and
  ``padding_free`` have nothing to remove (TRL 1.16 itself warns padding-free at batch 1 is of no benefit): off.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import StepClock, qwen3_config, write_record  # noqa: E402

SOURCES = {
    "use_liger_kernel": "https://huggingface.co/docs/trl/v1.16.0/liger_kernel_integration; trl 1.16.0 "
                        "trl/trainer/sft_trainer.py (SFTTrainer.__init__: fused_linear_cross_entropy forced off)",
    "chunked loss": "trl 1.16.0 trl/trainer/utils.py add_fused_lm_head (SFTTrainer's default loss); "
                    "https://huggingface.co/docs/trl/v1.16.0/long_context_training",
    "liger for ALST": "https://github.com/huggingface/accelerate/blob/v1.15.0/docs/source/concept_guides/sequence_parallelism.md",
    "sp_attn_implementation": "https://github.com/huggingface/accelerate/blob/v1.15.0/docs/source/concept_guides/"
                              "sequence_parallelism.md (sdpa, flash_attention_2 or flash_attention_3)",
    "cp attention": "https://github.com/huggingface/accelerate/blob/v1.15.0/docs/source/concept_guides/context_parallelism.md "
                    "(torch-backend CP works only with SDPA)",
    "packing with CP": "trl 1.16.0 trl/trainer/sft_trainer.py (ValueError: Packing is not compatible with context parallelism)",
}
ATTN = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def attention_check(system: str, attn: str) -> str | None:
    """Why ``attn`` cannot run for ``system`` here, or None (the packages are looked for, not imported)."""
    if attn not in ATTN:
        return f"--attn {attn!r}: one of {ATTN}"
    if system == "trl_cp" and attn != "sdpa":
        return "trl_cp: torch's context parallel works only with SDPA (accelerate's context-parallel guide)"
    if attn == "sdpa":
        return None
    from transformers.utils import import_utils

    check = getattr(import_utils, f"is_flash_attn_{attn[-1]}_available", None)
    if check is None or not check():
        wheel = {"2": "flash-attn (PyPI ships only its sdist; no wheel for torch 2.11 + CUDA 13)",
                 "3": "flash-attn-3 (no PyPI release; built from source)", "4": "flash-attn-4 (carried into the site)"}
        return f"--attn {attn}: not importable here: {wheel[attn[-1]]}"
    return None


def let_accelerate_take(attn: str) -> None:
    """accelerate 1.15's ``DeepSpeedSequenceParallelConfig`` accepts sdpa, flash_attention_2 / _3 and Hub kernels by
    name; DeepSpeed 0.19.8 and transformers 5.17 run any attention of ``ALL_ATTENTION_FUNCTIONS``. Let ``attn`` through
    that one check (everything else of the config unchanged)."""
    from accelerate.utils import dataclasses as accelerate_dataclasses

    cls = accelerate_dataclasses.DeepSpeedSequenceParallelConfig
    check = cls.__post_init__

    def __post_init__(self):
        wanted = self.sp_attn_implementation or os.environ.get("PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION")
        if wanted != attn:
            return check(self)
        self.sp_attn_implementation = "flash_attention_3"  # a name on its list, for the check only
        check(self)
        self.sp_attn_implementation = attn

    cls.__post_init__ = __post_init__


def liger_state(model) -> dict:
    """Which of the model's modules Liger patched (its ``_get_name`` / RoPE function), read from the live model."""
    from transformers.models.qwen3 import modeling_qwen3

    base = getattr(model, "model", model)
    layer = base.layers[0]
    rope = getattr(modeling_qwen3.apply_rotary_pos_emb, "__module__", "") or ""
    return dict(rms_norm=layer.input_layernorm._get_name(), mlp=layer.mlp._get_name(),
                rope=("liger" if rope.startswith("liger_kernel") else "transformers") + f" ({rope})",
                final_norm=base.norm._get_name())


def count_loss_path(model) -> dict:
    """Counts the model's forwards with and without TRL's fused LM head (a pass-through around ``model.forward``)."""
    forward = model.forward
    chain, f = [], forward
    for _ in range(8):  # accelerate's autocast wrapper, TRL's _fused_forward, the model's own forward
        f = getattr(f, "__func__", f)
        code = getattr(f, "__code__", None)
        chain.append(code.co_name if code else type(f).__name__)
        f = getattr(f, "__wrapped__", None)
        if f is None:
            break
    calls = dict(forward_chain=chain, fused_lm_head=0, plain=0)

    def counted(*args, **kwargs):
        calls["fused_lm_head" if kwargs.get("fused_lm_head") else "plain"] += 1
        return forward(*args, **kwargs)

    model.forward = counted
    return calls


def stub_tokenizer(vocab: int):
    """A fast tokenizer with the model's vocabulary size and a pad token (the rows are already token ids)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
                                   model_max_length=10**9)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--system", choices=["trl_cp", "deepspeed_alst"], required=True)
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--offload", action="store_true", help="activation_offloading=True")
    p.add_argument("--ckpt-offload", action="store_true", help="run under accelerate_cp_long.yaml (TRL's long-context "
                   "example: fsdp_activation_checkpointing_offload); the launcher picks the config, this records it")
    p.add_argument("--liger", action="store_true", help="SFTConfig(use_liger_kernel=True): Liger's RMSNorm / RoPE / SwiGLU")
    p.add_argument("--attn", default="sdpa", help="attention implementation (deepspeed_alst: also ALST's core "
                   "attention): sdpa, flash_attention_2, flash_attention_3, flash_attention_4")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke run)")
    p.add_argument("--out", default="peers.json")
    args = p.parse_args()

    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    why_not = attention_check(args.system, args.attn)
    if why_not:
        raise SystemExit(why_not)
    if args.system == "deepspeed_alst":  # the YAML names sdpa: the core attention ALST runs is --attn
        os.environ["PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION"] = args.attn
        if args.attn == "flash_attention_4":
            let_accelerate_take(args.attn)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = qwen3_config(args.seq)
    if args.tiny:
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size = 2, 64, 128, 512
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    config._attn_implementation = args.attn
    torch.manual_seed(0)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
                                                 attn_implementation=args.attn)
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, config.vocab_size, (args.seq,), generator=gen).tolist() for _ in range(args.steps * max(1, world))]
    data = datasets.Dataset.from_dict({"input_ids": rows})
    multiple = 2 * world if args.system == "trl_cp" else world
    sft = SFTConfig(output_dir=os.environ.get("OUT", "/tmp") + f"/{args.system}", max_length=args.seq,
                    pad_to_multiple_of=multiple, packing=False, per_device_train_batch_size=1,
                    gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=3e-4, bf16=torch.cuda.is_available(),
                    gradient_checkpointing=args.system == "deepspeed_alst", activation_offloading=args.offload,
                    logging_steps=1, report_to="none", save_strategy="no", dataset_num_proc=1, seed=0,
                    use_cpu=not torch.cuda.is_available(), use_liger_kernel=args.liger)
    clock, losses = StepClock(args.warmup), []
    seen: dict = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, _args, state, control, model=None, **k):
            # Liger patches the model when training starts (transformers' Trainer.train): read what ran from the model
            try:  # recording only: a model this cannot read still trains
                seen["liger"] = liger_state(model) if args.liger else None
                seen["loss_path"] = count_loss_path(model)
            except Exception as e:  # noqa: BLE001
                seen["liger"] = seen.get("liger") or f"not read: {type(e).__name__}: {e}"

        def on_step_begin(self, *a, **k):
            clock.begin()

        def on_step_end(self, *a, **k):
            clock.end()
            if len(clock.times) == 1 and int(os.environ.get("RANK", "0")) == 0:  # from inside the process, once
                print(f"[peers] liger: {seen['liger']}; loss path: {seen['loss_path']}", flush=True)

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    trainer = SFTTrainer(model=model, args=sft, train_dataset=data, processing_class=stub_tokenizer(config.vocab_size),
                         callbacks=[Clock()])
    trainer.train()
    pc = trainer.accelerator.parallelism_config
    example = ("cp 8 on 8 GPUs" if args.ckpt_offload else "cp 2 on 2 GPUs") if args.system == "trl_cp" else "sp 2 x dp 2 on 4 GPUs"
    changes = [f"{'cp' if args.system == 'trl_cp' else 'sp'}_size={world}, dp_shard_size=1 (TRL's example: {example})",
               f"max_length={args.seq}", f"max_steps={args.steps}", "Qwen3-8B shape from its config, random init, bf16",
               "random token rows (pre-tokenized), stub tokenizer", "saving / reporting off"]
    if args.system == "deepspeed_alst" and args.attn == "sdpa":
        changes.append("sp_attn_implementation=sdpa (no flash-attention 2 / 3 on the GPU image)")
    elif args.system == "deepspeed_alst":
        changes.append(f"sp_attn_implementation={args.attn}" + (
            " (flash-attention 2 / 3, the guide's, cannot run on the GPU image; accelerate 1.15's name check let "
            "through)" if args.attn == "flash_attention_4" else ""))
    if args.liger:
        changes.append("use_liger_kernel=True (Liger RMSNorm / RoPE / SwiGLU; TRL 1.16 keeps its own fused LM head)")
    if args.ckpt_offload:
        changes.append("no YaRN rope_parameters (random init: nothing to extend); checkpoints offloaded as the example's config")
    settings = dict(parallelism=str(pc), distributed_type=str(trainer.accelerator.distributed_type),
                    gradient_checkpointing=sft.gradient_checkpointing, activation_offloading=args.offload,
                    loss_type=sft.loss_type, attn_implementation=args.attn, use_liger_kernel=args.liger,
                    liger=seen.get("liger"), loss_path=seen.get("loss_path"),
                    variant=", ".join((["liger"] if args.liger else []) + ([args.attn] if args.attn != "sdpa" else [])
                                      + (["activation_offloading"] if args.offload else [])
                                      + (["long-context example config"] if args.ckpt_offload else [])) or "as published",
                    packing=False, packing_note="refused with CP by TRL 1.16" if args.system == "trl_cp" else
                    "one document of exactly max_length per row: packing / padding_free remove nothing", sources=SOURCES,
                    fsdp_activation_checkpointing=os.environ.get("FSDP_ACTIVATION_CHECKPOINTING"),
                    fsdp_activation_checkpointing_offload=os.environ.get("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"))
    version = f"trl {trl.__version__}, accelerate {__import__('accelerate').__version__}, transformers {transformers.__version__}"
    if args.system == "deepspeed_alst":
        version += f", deepspeed {__import__('deepspeed').__version__}"
    write_record(args.out, system=args.system, model="qwen3-8b", seq=args.seq, clock=clock, peak_gb=clock.peak_gb(),
                 settings=settings, changes=changes, version=version, losses=losses)


if __name__ == "__main__":
    main()

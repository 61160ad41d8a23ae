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
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import StepClock, qwen3_config, write_record  # noqa: E402


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
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (CPU smoke run)")
    p.add_argument("--out", default="peers.json")
    args = p.parse_args()

    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    config = qwen3_config(args.seq)
    if args.tiny:
        config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.vocab_size = 2, 64, 128, 512
        config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if torch.cuda.is_available() else torch.float32,
                                                 attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, config.vocab_size, (args.seq,), generator=gen).tolist() for _ in range(args.steps * max(1, world))]
    data = datasets.Dataset.from_dict({"input_ids": rows})
    multiple = 2 * world if args.system == "trl_cp" else world
    sft = SFTConfig(output_dir=os.environ.get("OUT", "/tmp") + f"/{args.system}", max_length=args.seq,
                    pad_to_multiple_of=multiple, packing=False, per_device_train_batch_size=1,
                    gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=3e-4, bf16=torch.cuda.is_available(),
                    gradient_checkpointing=args.system == "deepspeed_alst", activation_offloading=args.offload,
                    logging_steps=1, report_to="none", save_strategy="no", dataset_num_proc=1, seed=0,
                    use_cpu=not torch.cuda.is_available())
    clock, losses = StepClock(args.warmup), []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            clock.begin()

        def on_step_end(self, *a, **k):
            clock.end()

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
    if args.system == "deepspeed_alst":
        changes.append("sp_attn_implementation=sdpa (flash-attn 2 not on the GPU image)")
    if args.ckpt_offload:
        changes.append("no YaRN rope_parameters (random init: nothing to extend); checkpoints offloaded as the example's config")
    settings = dict(parallelism=str(pc), distributed_type=str(trainer.accelerator.distributed_type),
                    gradient_checkpointing=sft.gradient_checkpointing, activation_offloading=args.offload,
                    loss_type=sft.loss_type, attn_implementation="sdpa", packing=False,
                    fsdp_activation_checkpointing=os.environ.get("FSDP_ACTIVATION_CHECKPOINTING"),
                    fsdp_activation_checkpointing_offload=os.environ.get("FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"))
    version = f"trl {trl.__version__}, accelerate {__import__('accelerate').__version__}, transformers {transformers.__version__}"
    if args.system == "deepspeed_alst":
        version += f", deepspeed {__import__('deepspeed').__version__}"
    write_record(args.out, system=args.system, model="qwen3-8b", seq=args.seq, clock=clock, peak_gb=clock.peak_gb(),
                 settings=settings, changes=changes, version=version, losses=losses)


if __name__ == "__main__":
    main()
